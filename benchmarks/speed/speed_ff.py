r"""Speed and memory of the FF decomposition (GlobEnc+FF) on MiniLM: closed form vs numerical IG vs forward.

Usage:
    python benchmarks/speed/speed_ff.py [--batch 2] [--tokens 64 128] [--repeats 3] [--long 512]
    python benchmarks/speed/speed_ff.py --flops [--batch 8] [--tokens 64] [--repeats 3] [--threads 2]

For every token length, times one plain forward pass, ``FFIntegratedDecomposition`` with the
exact closed form (the default) and with ``method="riemann", steps=50`` (midpoint-rule IG by
autograd), interleaved in one run so that noise hits all alike, and prints medians and the
ratios to the forward pass. Then the peak extra memory of one call on 1 example: the
resident-set growth over the loaded model, polled every 2 ms in a fresh subprocess per
(method, length), at every --tokens length and, for the closed form with its default memory
budget, at --long tokens.

``--flops``: throughput instead. Times (min of ``--repeats`` interleaved calls after a
warm-up, ``--threads`` torch threads) the plain forward pass, GlobEnc+FF
(``FFIntegratedDecomposition``, norm contribution) and ALTI+FF (``contribution="alti"``),
with a timer around the per-layer explicit-parts stage (``component_scope_maps``), and
divides analytic matmul FLOP counts (:func:`forward_flops`, :func:`ff_parts_flops`) by the
times: GFLOP/s of the forward pass, of the FF-parts stage, and of the whole call (its
recording forward included).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, str(BENCHMARKS.parent))  # measure the checkout this script lives in
sys.path.insert(0, str(BENCHMARKS))

from _bench import measure_peak, print_json, random_ids, run_child, time_interleaved  # noqa: E402

METHODS = ("forward", "closed_form", "riemann50")


def _setup(batch: int, tokens: int):
    from captum_normattr import load_default_model

    model, _ = load_default_model()
    ids = random_ids(batch, tokens, sep=102)
    return model, ids, torch.ones_like(ids)


def _runner(name: str, model):
    from captum_normattr import FFIntegratedDecomposition

    if name == "forward":
        return lambda ids, mask: model(input_ids=ids, attention_mask=mask)
    if name == "closed_form":
        a = FFIntegratedDecomposition(model)
    elif name == "riemann50":
        a = FFIntegratedDecomposition(model, method="riemann", steps=50)
    else:
        raise ValueError(name)
    return lambda ids, mask: a.attribute(ids, additional_forward_args=(mask,))


def time_methods(batch: int, tokens: int, repeats: int) -> dict:
    model, ids, mask = _setup(batch, tokens)
    runs = {n: _runner(n, model) for n in METHODS}
    return {"batch": batch, "tokens": tokens, "seconds": time_interleaved(runs, (ids, mask), repeats)}


def peak_memory_child(name: str, tokens: int) -> None:
    model, ids, mask = _setup(1, tokens)
    extra_mb, seconds = measure_peak(_runner(name, model), ids, mask)
    print_json({"method": name, "tokens": tokens, "extra_peak_mb": extra_mb, "seconds": seconds})


def _child(name: str, tokens: int) -> dict:
    return run_child(__file__, ["--_memory_child", name, "--long", str(tokens)])


def forward_flops(cfg, batch: int, tokens: int) -> float:
    r"""Matmul FLOPs (2 per multiply-add) of one BERT-style forward pass.

    Per layer and token: Q, K, V, O projections 8 D^2, FF 4 D F, attention scores and
    mixing 4 T D. Embeddings, LayerNorms, softmax and the pooler are left out (< 1%).
    """
    d, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    return float(n * batch * tokens * (8 * d * d + 4 * d * f + 4 * tokens * d))


def ff_parts_flops(cfg, batch: int, tokens: int) -> float:
    r"""Matmul FLOPs of the explicit parts of ``component_scope_maps`` (post-LN layer, closed form).

    Per layer and example, with T tokens, D width, F FF width, H heads:

    - attention parts in D (LN1 output parts): 2 T^2 H D (sum over heads per pair);
    - pre-activation parts in F: 2 T^2 H F (the per-head values projected to F, mixed);
    - FF output parts through W_out: 2 T^2 F D (the dominant term);
    - per-token projections (values through W_O and through W_O A1 W1, the residual
      through A1 W1): 2 T D^2 + 4 T D F.

    The elementwise work (IG coefficients applied, norms, L1 distances: O(T^2 (F + D)))
    is not counted, nor the closed-form IG coefficients (O(T F), no integration nodes:
    the elementwise closed form (g(p) - g(0)) / p is exact, ``gate_integrals`` with its
    Gauss-Legendre nodes only runs for gated FFs).
    """
    d, f, n, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads
    t = tokens
    per = 2 * t * t * h * d + 2 * t * t * h * f + 2 * t * t * f * d + 2 * t * d * d + 4 * t * d * f
    return float(n * batch * per)


def flops_table(batch: int, tokens: int, repeats: int, threads: int) -> None:
    import time

    from captum_normattr import FFIntegratedDecomposition
    from captum_normattr.decompose.kinds import registry as layer_kinds

    torch.set_num_threads(threads)
    stage = {"s": 0.0}
    inner = layer_kinds.component_scope_maps

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            stage["s"] += time.perf_counter() - t0

    layer_kinds.component_scope_maps = timed
    model, ids, mask = _setup(batch, tokens)
    runs = {"forward": lambda: model(input_ids=ids, attention_mask=mask)}
    for name, contribution in (("GlobEnc+FF", "norm"), ("ALTI+FF", "alti")):
        a = FFIntegratedDecomposition(model, contribution=contribution)
        runs[name] = (lambda a=a: a.attribute(ids, additional_forward_args=(mask,)))
    best: dict = {}
    with torch.no_grad():
        for fn in runs.values():
            fn()
        for _ in range(repeats):
            for name, fn in runs.items():
                stage["s"] = 0.0
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if dt < best.get(name, (float("inf"),))[0]:
                    best[name] = (dt, stage["s"])
    cfg = model.config
    fw, ffp = forward_flops(cfg, batch, tokens), ff_parts_flops(cfg, batch, tokens)
    f_s = best["forward"][0]
    fw_rate = fw / f_s / 1e9
    print(f"MiniLM, batch {batch} x {tokens} tokens, {threads} threads, min of {repeats}; "
          f"forward {fw / 1e9:.2f} GFLOP, FF parts {ffp / 1e9:.1f} GFLOP ({ffp / fw:.0f}x)")
    print("| run | seconds | of which FF-parts stage (s) | GFLOP/s, FF-parts stage | GFLOP/s, whole call | "
          "stage GFLOP/s / forward GFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| forward ({cfg._attn_implementation}) | {f_s:.3f} | - | - | {fw_rate:.1f} | 1 |")
    for name in ("GlobEnc+FF", "ALTI+FF"):
        tot, st = best[name]
        rate = ffp / st / 1e9
        print(f"| {name} | {tot:.2f} | {st:.2f} | {rate:.1f} | {(ffp + fw) / tot / 1e9:.1f} | "
              f"{rate / fw_rate:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 128])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long", type=int, default=512, help="closed-form memory check at this length (0: skip)")
    p.add_argument("--flops", action="store_true", help="GFLOP/s of GlobEnc+FF, ALTI+FF and the forward pass")
    p.add_argument("--threads", type=int, default=2, help="torch threads (--flops)")
    p.add_argument("--_memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._memory_child:
        peak_memory_child(args._memory_child, args.long)
        return
    torch.manual_seed(0)
    if args.flops:
        for t in args.tokens:
            flops_table(args.batch, t, args.repeats, args.threads)
        return
    print(f"MiniLM (6 layers, D 384, FF 1536), FFIntegratedDecomposition (GlobEnc+FF, norm contribution), "
          f"torch threads {torch.get_num_threads()}")
    print("| tokens | batch | forward (s) | closed form (s) | IG 50 steps (s) | closed / forward | IG50 / forward | IG50 / closed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in args.tokens:
        s = time_methods(args.batch, t, args.repeats)["seconds"]
        print(f"| {t} | {args.batch} | {s['forward']:.4f} | {s['closed_form']:.3f} | {s['riemann50']:.3f} | "
              f"{s['closed_form'] / s['forward']:.0f} | {s['riemann50'] / s['forward']:.0f} | "
              f"{s['riemann50'] / s['closed_form']:.2f} |", flush=True)
    print("\npeak extra memory of one call on 1 example (RSS growth over the loaded model, polled every 2 ms; "
          "default memory_budget_mb=128):")
    print("| tokens | forward (MB) | closed form (MB) | IG 50 steps (MB) |")
    print("|---:|---:|---:|---:|")
    for t in args.tokens:
        r = {n: _child(n, t)["extra_peak_mb"] for n in METHODS}
        print(f"| {t} | {r['forward']:.0f} | {r['closed_form']:.0f} | {r['riemann50']:.0f} |", flush=True)
    if args.long:
        r = _child("closed_form", args.long)
        f = _child("forward", args.long)
        print(f"| {args.long} | {f['extra_peak_mb']:.0f} | {r['extra_peak_mb']:.0f} ({r['seconds']:.1f} s) | not run |")


if __name__ == "__main__":
    main()
