r"""The README's first command: GlobEnc and ALTI scores of a sentence on the packaged MiniLM.

Run ``python -m captum_normattr.quickstart "your sentence"``.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


from captum_normattr.attr import ALTIAttribution, GlobEncAttribution
from captum_normattr.models.loading import load_default_model
from captum_normattr.tokens import readable_tokens

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    r"""Print every token of a sentence with its GlobEnc (N_ENC) and ALTI score.

    Args:
        argv: command-line arguments (a sentence); defaults to ``sys.argv[1:]``.

    Returns:
        Exit code 0.
    """
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("sentence", nargs="?", default="A gripping, funny and deeply moving film.")
    args = parser.parse_args(argv)
    model, tokenizer = load_default_model()
    batch = tokenizer([args.sentence], return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    globenc = GlobEncAttribution(model, map_name="N_ENC").decompose(ids, additional_forward_args=(mask,))
    alti = ALTIAttribution(model).decompose(ids, additional_forward_args=(mask,))
    tokens = readable_tokens(tokenizer, ids[0])
    g = globenc.scores[0] / globenc.scores[0].sum()
    a = alti.scores[0]
    print(f"model: all-MiniLM-L6-v2 (packaged), explained position 0 ([CLS]), rollout '{globenc.rollout_convention}'")
    print(f"{'token':<16}{'GlobEnc':>10}{'ALTI':>10}")
    for tok, gs, as_ in zip(tokens, g.tolist(), a.tolist()):
        print(f"{tok:<16}{gs:>10.4f}{as_:>10.4f}")
    err = max(float(globenc.extras["completeness_error"].max()), float(alti.extras["completeness_error"].max()))
    ratio = globenc.mixing_ratio[0].mean().item()
    print(f"GlobEnc scores normalised to sum 1; N_ENC mixing ratio {ratio:.3f}; completeness error {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
