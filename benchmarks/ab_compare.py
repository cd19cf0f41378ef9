r"""Whole calls of this checkout against another version of the package, interleaved in one process.

Usage:
    git archive <commit> | tar -x -C <dir>       # an export (or any checkout) of the other version
    python benchmarks/ab_compare.py --base <dir> [--model minilm|llama|smollm2|vit]
                                    [--method globenc|alti|alti_logit|decompx] [--batch 32] [--tokens 128]
                                    [--repeats 5] [--threads 2] [--compiled] [--cpu-time]

``--model minilm`` (default) is ``speed_core.py``'s setting, ``llama`` the ~100M-parameter
random Llama of ``speed_decoder.py`` (batch 1; ``--tokens``), ``smollm2`` the real
SmolLM2-135M-Instruct of ``memory/long_prompts.py`` (float32, sdpa, batch 1, ``--tokens`` random
ids; ALTI-Logit and DecompX explain token 42 through the model's own LM head, as there),
``vit`` the ViT-Base of ``vit_speed.py`` (``--batch`` images of 224 x 224).

On a shared machine, wall times of separate processes drift by 10-20% between runs; two
versions timed in the same process, one call after the other, drift together. The other
version's package is copied into a temporary directory as ``captum_normattr_base`` (its
imports and the name of its recording attention renamed, so that both coexist), and the
plain forward pass, the other version's method and this checkout's method (and, with
``--compiled``, this checkout's method with its compiled kernels forced on) are called in
turn, after one warm-up call each, on the packaged MiniLM. Prints the minimum over the
repeats and the ratios to the forward pass.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from _bench import DECODER_TARGET, LLAMA_100M, llama_model, random_ids  # noqa: E402

_NAME = re.compile(r"\bcaptum_normattr\b")


def import_renamed(base_dir: Path, into: Path):
    r"""Copy ``base_dir/captum_normattr`` to ``into/captum_normattr_base`` (renamed) and import it."""
    src = base_dir / "captum_normattr"
    if not src.is_dir():
        raise SystemExit(f"{base_dir} holds no captum_normattr package")
    dst = into / "captum_normattr_base"
    shutil.copytree(src, dst)
    for f in dst.rglob("*.py"):
        text = f.read_text()
        text = text.replace('"captum_normattr_capture"', '"captum_normattr_base_capture"')
        f.write_text(_NAME.sub("captum_normattr_base", text))
    sys.path.insert(0, str(into))
    import captum_normattr_base

    return captum_normattr_base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, type=Path, help="a checkout or export of the other version")
    p.add_argument("--model", choices=("minilm", "llama", "smollm2", "vit"), default="minilm")
    p.add_argument("--method", choices=("globenc", "alti", "alti_logit", "decompx"), default="globenc")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compiled", action="store_true", help="also time this checkout with its compiled kernels forced on")
    p.add_argument("--cpu-time", action="store_true",
                   help="CPU time of the process instead of wall time (use with --threads 1: contention inflates it much less)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import captum_normattr as new
    from captum_normattr.decompose.primitives import compiled

    with tempfile.TemporaryDirectory() as tmp:
        base = import_renamed(args.base.resolve(), Path(tmp))
        if args.model == "minilm":
            model, _ = new.load_default_model()
            ids = random_ids(args.batch, args.tokens)
            mask = torch.ones_like(ids)
            forward = lambda: model(input_ids=ids, attention_mask=mask)  # noqa: E731

            def method(pkg):
                a = pkg.GlobEncAttribution(model, "N_ENC") if args.method == "globenc" else pkg.ALTIAttribution(model)
                return lambda: a.attribute(ids, additional_forward_args=(mask,))
        elif args.model == "llama":
            model = llama_model(LLAMA_100M)
            ids = random_ids(1, args.tokens, low=100, high=30000, cls=None)
            forward = lambda: model(input_ids=ids, use_cache=False)  # noqa: E731

            def method(pkg):  # as _bench.decoder_runner builds them, from either package
                cls = {"globenc": "GlobEncAttribution", "alti": "ALTIAttribution", "alti_logit": "ALTILogitAttribution",
                       "decompx": "DecompXAttribution"}[args.method]
                kw = {"unembedding": model.embed_tokens.weight} if args.method in ("alti_logit", "decompx") else {}
                a = getattr(pkg, cls)(model, **kw)
                if args.method == "decompx":
                    return lambda: a.decompose(ids, target=42)
                return lambda: a.attribute(ids, target=42) if kw else a.attribute(ids)
        elif args.model == "smollm2":  # memory/long_prompts.py's model and calls
            model, _ = new.load_default_model("decoder")
            model.config._attn_implementation = "sdpa"
            model = model.float().eval()
            ids = random_ids(1, args.tokens, low=100, high=49152, cls=None)
            forward = lambda: model(input_ids=ids, use_cache=False)  # noqa: E731

            def method(pkg):
                cls = {"globenc": "GlobEncAttribution", "alti": "ALTIAttribution", "alti_logit": "ALTILogitAttribution",
                       "decompx": "DecompXAttribution"}[args.method]
                a = getattr(pkg, cls)(model)
                if args.method == "decompx":
                    return lambda: a.decompose(ids, target=DECODER_TARGET)
                return lambda: a.attribute(ids, target=DECODER_TARGET) if args.method == "alti_logit" else a.attribute(ids)
        else:
            from transformers import ViTConfig, ViTForImageClassification

            torch.manual_seed(0)
            model = ViTForImageClassification(ViTConfig(image_size=224, patch_size=16, num_labels=10)).eval()
            pixels = torch.randn(args.batch, 3, 224, 224)
            forward = lambda: model(pixel_values=pixels)  # noqa: E731

            def method(pkg):
                cls = {"globenc": "GlobEncAttribution", "alti": "ALTIAttribution", "decompx": "DecompXAttribution"}[args.method]
                a = getattr(pkg, cls)(model)
                return lambda: a.attribute(pixels, target=0) if args.method == "decompx" else a.attribute(pixels)

        runs = {"forward": forward, "base": method(base), "this": method(new)}
        if args.compiled:
            this = runs["this"]

            def this_compiled():
                compiled.use_compiled_kernels(True)
                try:
                    return this()
                finally:
                    compiled.use_compiled_kernels(None)

            runs["this, compiled"] = this_compiled
        best = {k: float("inf") for k in runs}
        clock = time.process_time if args.cpu_time else time.perf_counter
        with torch.no_grad():
            for f in runs.values():
                f()
            for _ in range(args.repeats):
                for k, f in runs.items():
                    t0 = clock()
                    f()
                    best[k] = min(best[k], clock() - t0)
    shape = {"minilm": f"{args.batch} x {args.tokens}", "llama": f"1 x {args.tokens}", "smollm2": f"1 x {args.tokens}",
             "vit": f"{args.batch} x 197"}[args.model]
    print(f"{args.method}, {args.model} {shape}, {torch.get_num_threads()} threads, min of {args.repeats}, "
          f"interleaved in one process, {'CPU' if args.cpu_time else 'wall'} time")
    for k, v in best.items():
        ratio = "" if k == "forward" else f" = {v / best['forward']:.2f}x forward"
        print(f"  {k:16s} {v:.3f} s{ratio}")


if __name__ == "__main__":
    main()
