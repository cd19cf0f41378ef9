r"""The FF decomposition's raw rollout on SmolLM2-135M-Instruct: beyond float32, carried with a power of two.

``FFIntegratedDecomposition`` (GlobEnc+FF: RES2 norm maps) on the packaged decoder, float32
and bfloat16 weights, 64 and 128 tokens, ``rollout="raw"`` and ``"row_normalized"``: whether
any score is NaN, the power of two the raw rollout is returned divided by
(``extras["rollout_log2_scale"]``), the magnitude the explained row reaches, the largest
row sum of the layer maps, position 0's share of the absolute score mass, and the Spearman
correlation of the raw and row-normalised scores over the other tokens (the explained last
token left out). Results: ``benchmarks/results/ff_rollout_range.json``.

    python benchmarks/faithfulness/ff_rollout_range.py --out benchmarks/results/ff_rollout_range.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
import warnings

import torch

from captum_normattr import FFIntegratedDecomposition, load_default_model

TEXT = ("The old lighthouse keeper climbed the stairs every evening to light the lamp, and the ships that passed "
        "the rocky coast at night trusted its beam to guide them safely home through the fog and the storms of winter. ")


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_default_model("decoder")
    ids = tok([TEXT * 8], return_tensors="pt")["input_ids"]
    records = []
    for dtype_name in args.dtypes:
        m = model.to(getattr(torch, dtype_name))
        for n in args.tokens:
            x = ids[:, :n]
            mask = torch.ones_like(x)
            scores = {}
            for conv in ("raw", "row_normalized"):
                t0 = time.time()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    res = FFIntegratedDecomposition(m, rollout=conv).decompose(x, additional_forward_args=(mask,), return_layer_maps=True,
                                                                               return_rollout=False)
                s = res.scores[0]
                scale = int(res.extras.get("rollout_log2_scale", torch.zeros(1, dtype=torch.long))[0])
                top = float(s.abs().max())
                body = s[:-1].abs()
                rec = {
                    "dtype": dtype_name, "tokens": n, "rollout": conv, "seconds": round(time.time() - t0, 1),
                    "nan_scores": int(s.isnan().sum()), "log2_scale": scale,
                    "log10_max": round(math.log10(top) + scale * math.log10(2.0), 1) if top > 0 else None,
                    "max_row_sum": float(res.layer_maps[0].sum(-1).max()),
                    "sink_share": float(body[0] / body.sum()) if bool(torch.isfinite(body).all()) else None,
                    "warnings": [str(w.message) for w in caught],
                }
                scores[conv] = s
                records.append(rec)
                print({k: v for k, v in rec.items() if k != "warnings"}, flush=True)
                for w in rec["warnings"]:
                    print("   warning:", w[:160], flush=True)
            rho = _spearman(scores["raw"][1:-1].double(), scores["row_normalized"][1:-1].double())
            records.append({"dtype": dtype_name, "tokens": n, "spearman_raw_vs_row_normalized_without_sink": rho})
            print(f"   {dtype_name} {n} tokens: Spearman(raw, row_normalized) without position 0: {rho:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"model": "SmolLM2-135M-Instruct", "method": "FFIntegratedDecomposition (RES2, norm)",
                       "records": records}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
