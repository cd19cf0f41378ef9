r"""Speed and memory of the decoder methods on a ~100M-parameter Llama-family model (random weights).

Usage:
    nice python benchmarks/speed/speed_decoder.py [--tokens 256 1024] [--ff-tokens 256]
                                            [--search-methods alti] [--limit-gb 8] [--search-budget 300]
                                            [--ratio-tokens 1024] [--repeats 3] [--threads 2]

First, the speed ratios: every method and one plain forward pass (sdpa) timed side by
side in this process at ``--ratio-tokens`` (batch 1, ``--threads`` torch threads, one
warm-up call each, then the minimum of ``--repeats`` interleaved calls); DecompX is the
default (adjoint) DecompXAttribution on the next-token logit of token 42.

Config: hidden 768, 12 layers, 12 heads, 4 key/value heads (GQA), intermediate 2048 (SwiGLU),
vocab 32000, float32, bare ``LlamaModel`` (97.6M parameters); ALTI-Logit uses the
(tied) embedding matrix as unembedding. Every measurement runs in a fresh subprocess:
one call, its wall time, and its peak extra memory = resident-set growth over the loaded
model and inputs, polled every 2 ms. Ratios are against one plain forward pass (sdpa)
measured the same way. Then, per method in ``--search-methods``, the longest input (a
multiple of 256) whose peak extra memory stays under ``--limit-gb``: the child aborts as
soon as it crosses the limit (so the machine never sees much more), the first probe is
predicted from a fit a + c T^2 (or a full quadratic with 3+ points) of the measured peaks, and the search stops after
``--search-budget`` seconds (the answer is then a bracket).

``--families`` (ratio table only) puts families side by side in one process, each against its own forward pass:
``_bench.DECODER_FAMILIES`` (one per layer kind) and the frontier mechanisms of ``_frontier.py`` (``gpt_oss``:
sinks and clamped experts; ``deepseek_v3``: latent attention; ``llama4_text``: chunked attention and input-scaled
experts; ``granitemoe``; the hybrid mixers ``qwen3_5_text``, ``granitemoehybrid``, ``kimi_linear``, ``lfm2``),
e.g. ``--families llama gpt_oss deepseek_v3 llama4_text granitemoe --config small --layers 2``. ``--exactness``
adds, per family and length, ALTI-Logit's and DecompX's token scores plus no-token terms against the model's own
logit (recomputed from its forward pass), float32.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, os.path.dirname(BENCHMARKS))  # this checkout's package
sys.path.insert(0, BENCHMARKS)

from _bench import LLAMA_100M, decoder_runner, measure_peak, print_json, random_ids, time_interleaved  # noqa: E402
from _bench import run_child as _run_script  # noqa: E402
from _frontier import ALL_FAMILIES, any_family_model  # noqa: E402

CONFIG = LLAMA_100M
#: ``--config small``: the small Llama shape of ``memory_engine.py``'s depth section (hidden 256, 8 heads, 4 kv heads,
#: FF 704, vocab 1000), for side-by-side family figures at long lengths on a small CPU
SMALL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=704,
             vocab_size=1000, max_position_embeddings=16384, hidden_act="silu")
LAYERS = [None]
METHODS = ("forward", "globenc", "alti", "alti_logit", "ff")
#: the family of the measured model (``--family``; ``_bench.family_model``: a mixture of experts shaped like the Llama;
#: ``_frontier.frontier_model``: the frontier mechanisms of issue #34)
FAMILY = ["llama"]


def _model():
    return any_family_model(FAMILY[0], CONFIG, layers=LAYERS[0])


def _runner(name: str, model):
    r"""One call of ``name`` on ``model``: the shared decoder runners, plus the FF decomposition."""
    if name == "ff":
        from captum_normattr import FFIntegratedDecomposition

        a = FFIntegratedDecomposition(model)  # RES2 scope, gated FF by Gauss-Legendre (48 nodes)
        return lambda ids: a.attribute(ids)
    return decoder_runner(name, model)


RATIO_METHODS = ("globenc", "alti", "alti_logit", "decompx")
GOALS = {"globenc": 2.0, "alti": 4.0, "alti_logit": 4.0, "decompx": 4.0}


def ratios(tokens: int, repeats: int, threads: int, methods=RATIO_METHODS, no_warm_up=()) -> dict:
    r"""Minimum seconds of the forward pass and of each method, side by side in this process."""
    torch.set_num_threads(threads)
    model = _model()
    ids = random_ids(1, tokens, low=100, high=min(30000, CONFIG["vocab_size"]), cls=None)
    runs = {n: _runner(n, model) for n in ("forward",) + tuple(methods)}
    return time_interleaved(runs, (ids,), repeats, stat="min", no_warm_up=[m for m in no_warm_up if m in runs])


def child(name: str, tokens: int, limit_mb: float) -> None:
    torch.set_num_threads(1)
    model = _model()
    ids = random_ids(1, tokens, low=100, high=30000, cls=None)

    def abort(extra_mb: float) -> None:  # before the machine sees much more than the limit
        print_json({"method": name, "tokens": tokens, "exceeded": True, "extra_peak_mb": extra_mb})
        os._exit(3)

    extra_mb, seconds = measure_peak(_runner(name, model), ids, limit_mb=limit_mb, on_exceed=abort)
    print_json({"method": name, "tokens": tokens, "exceeded": False, "seconds": seconds, "extra_peak_mb": extra_mb})


def run_child(name: str, tokens: int, limit_mb: float) -> dict:
    return _run_script(__file__, ["--family", FAMILY[0], "--_child", name, "--_tokens", str(tokens), "--_limit", str(limit_mb)],
                       ok_returncodes=(0, 3), what=f"{name} at {tokens} tokens")


def search(name: str, measured: dict, limit_mb: float, budget_s: float, cap: int) -> dict:
    r"""Longest multiple of 256 tokens under ``limit_mb``: quadratic-fit first guess, then bisection."""
    import numpy as np

    pts = sorted((t, r["extra_peak_mb"]) for t, r in measured.items())
    fits = {t: m for t, m in pts if m <= limit_mb}
    lo = max(fits) if fits else 0
    hi = cap + 256
    if len(pts) >= 2:
        t_arr = np.array([p[0] for p in pts], dtype=float)
        m_arr = np.array([p[1] for p in pts])
        if len(pts) == 2:  # two points: peak = a + c t^2 (the (T, T) tensors dominate)
            c = (m_arr[1] - m_arr[0]) / (t_arr[1] ** 2 - t_arr[0] ** 2)
            coef = np.array([c, 0.0, m_arr[0] - c * t_arr[0] ** 2])
        else:
            coef = np.polyfit(t_arr, m_arr, 2)
        coef[-1] -= limit_mb  # roots of peak(t) - limit
        roots = [r.real for r in np.roots(coef) if abs(r.imag) < 1e-9 and r.real > 0]
        guess = int(max(roots) // 256 * 256) if roots else 2 * lo
    else:
        guess = 2 * lo
    print(f"    {name}: quadratic fit of the measured peaks predicts ~{guess} tokens at {limit_mb / 1024:g} GB", flush=True)
    start = time.perf_counter()
    probes = []
    t = min(max(guess, lo + 256), cap)
    while hi - lo > 256 and time.perf_counter() - start < budget_s:
        r = run_child(name, t, limit_mb)
        probes.append(r)
        if r["exceeded"]:
            hi = t
        else:
            lo = t
        took = "" if r["exceeded"] else f", {r['seconds']:.1f} s"
        verdict = "over (aborted)" if r["exceeded"] else "fits"
        print(f"    probe {name} {t} tokens: {verdict} (peak {r['extra_peak_mb']:.0f} MB{took})", flush=True)
        if t >= cap and not r["exceeded"]:
            break
        t = (lo + hi) // 2 // 256 * 256
        if t <= lo:
            break
    return {"method": name, "fits": lo, "over": hi if hi <= cap else None, "complete": hi - lo <= 256, "probes": probes}


def exactness(tokens: int) -> dict:
    r"""ALTI-Logit's and DecompX's token scores plus no-token terms against the model's own logit (float32).

    The model's logit is recomputed here, apart from the attribution: its own forward pass (sdpa or its eager
    attention), the last position's final hidden state dotted with the (tied) embedding row of the target.
    ``rel_*``: |sum of the scores + no-token terms - model logit| / max(|model logit|, 1e-6); ``delta_*`` the
    methods' own reported completeness error.
    """
    from _bench import DECODER_TARGET

    from captum_normattr import ALTILogitAttribution

    model = _model()
    ids = random_ids(1, tokens, low=100, high=min(30000, CONFIG["vocab_size"]), cls=None)
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        ref = float(model(input_ids=ids, use_cache=False).last_hidden_state[0, -1].double()
                    @ emb[DECODER_TARGET].double())
    d = decoder_runner("decompx", model)(ids)  # DecompXAttribution.decompose
    r = ALTILogitAttribution(model, unembedding=emb).decompose(ids, target=DECODER_TARGET)
    alti_total = float(r.scores.double().sum() + r.no_token_total.double().sum())
    dx_total = float(d.scores.double().sum() + d.bias_scores.double()[0, 0])
    scale = max(abs(ref), 1e-6)
    return {"model_logit": ref, "alti_logit_total": alti_total, "decompx_total": dx_total,
            "rel_alti_logit": abs(alti_total - ref) / scale, "rel_decompx": abs(dx_total - ref) / scale,
            "delta_alti_logit": float(r.delta[0]), "delta_decompx": float(d.delta[0])}


def side_by_side(args) -> None:
    r"""``--families``: the ratio table of every family at every length, one family after the other in this process."""
    import json
    import platform

    import transformers

    cap = {k: int(v) for k, v in (kv.split("=") for kv in args.max_tokens)}
    out = {"meta": {"argv": sys.argv[1:], "config": CONFIG, "layers": args.layers, "threads": args.threads,
                    "repeats": args.repeats, "stat": "min", "no_warm_up": args.no_warm_up, "torch": torch.__version__,
                    "transformers": transformers.__version__, "python": platform.python_version(),
                    "cpus": os.cpu_count(), "niceness": os.nice(0)}, "ratios": []}
    for t in args.ratio_lengths or [args.ratio_tokens]:
        for f in args.families:
            FAMILY[0] = f
            methods = [m for m in args.ratio_methods if t <= cap.get(m, t)]
            t0 = time.perf_counter()
            sec = ratios(t, args.repeats, args.threads, methods, args.no_warm_up)
            rec = {"family": f, "tokens": t, "seconds": sec,
                   "ratio_to_forward": {m: sec[m] / sec["forward"] for m in methods}, "wall_s": time.perf_counter() - t0}
            if args.exactness:
                rec["exactness"] = exactness(t)
                e = rec["exactness"]
                print(f"{f}: {t} tokens, model logit {e['model_logit']:.4g}; |scores + no-token - logit| / |logit|: "
                      f"ALTI-Logit {e['rel_alti_logit']:.2e}, DecompX {e['rel_decompx']:.2e}", flush=True)
            out["ratios"].append(rec)
            print(f"{f}: 1 x {t} tokens, {args.threads} threads, min of {args.repeats}: forward {sec['forward']:.2f} s; "
                  + ", ".join(f"{m} {sec[m]:.2f} s = {sec[m] / sec['forward']:.1f}x" for m in methods), flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(out, fh, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="the forward pass always runs")
    p.add_argument("--ff-tokens", type=int, nargs="*", default=[256], help="lengths at which FF decomposition is timed")
    p.add_argument("--search-methods", nargs="*", default=["globenc"])
    p.add_argument("--fit-methods", nargs="*", default=["alti", "alti_logit"],
                   help="methods whose 8 GB length is only predicted from the fit (no probes)")
    p.add_argument("--limit-gb", type=float, default=8.0)
    p.add_argument("--search-budget", type=float, default=300.0, help="seconds per searched method")
    p.add_argument("--search-cap", type=int, default=8192)
    p.add_argument("--ratio-tokens", type=int, default=1024, help="length of the in-process ratio table (0: skip it)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ratios-only", action="store_true", help="stop after the ratio table")
    p.add_argument("--family", default="llama", choices=ALL_FAMILIES,
                   help="the model's family, shaped like the Llama config (mixtral, qwen2_moe: 4 experts, top-2; "
                        "the frontier mechanisms gpt_oss, deepseek_v3, llama4_text, granitemoe: _frontier.py)")
    p.add_argument("--families", nargs="+", default=None, choices=ALL_FAMILIES,
                   help="ratio table only: these families one after the other in this process, each against its "
                        "own forward pass (implies --ratios-only)")
    p.add_argument("--config", default="100m", choices=["100m", "small"], help="the Llama shape (small: hidden 256)")
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers instead of the config's")
    p.add_argument("--ratio-lengths", type=int, nargs="+", default=None,
                   help="with --families: lengths of the ratio table (default: --ratio-tokens)")
    p.add_argument("--ratio-methods", nargs="+", default=list(RATIO_METHODS), choices=RATIO_METHODS + ("ff",))
    p.add_argument("--max-tokens", nargs="*", default=[], metavar="METHOD=T",
                   help="with --families: time METHOD only up to T tokens")
    p.add_argument("--no-warm-up", nargs="*", default=[], help="methods timed without a warm-up call")
    p.add_argument("--json", default=None, help="with --families: save the ratio table here")
    p.add_argument("--exactness", action="store_true",
                   help="with --families: also ALTI-Logit's and DecompX's totals against the model's own logit")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_tokens", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_limit", type=float, default=1e12, help=argparse.SUPPRESS)
    args = p.parse_args()
    FAMILY[0] = args.family
    LAYERS[0] = args.layers
    if args.config == "small":
        global CONFIG
        CONFIG = SMALL
    if args.families:
        side_by_side(args)
        return
    if args._child:
        child(args._child, args._tokens, args._limit)
        return
    if args.ratio_tokens:
        sec = ratios(args.ratio_tokens, args.repeats, args.threads)
        print(f"{args.family}: 1 x {args.ratio_tokens} tokens, {args.threads} threads, min of {args.repeats}: "
              f"forward (sdpa) {sec['forward']:.2f} s")
        for m in RATIO_METHODS:
            print(f"  {m:<11} {sec[m]:7.2f} s = {sec[m] / sec['forward']:.2f} x forward (goal <= {GOALS[m]:g})", flush=True)
        if args.ratios_only:
            return
    limit_mb = args.limit_gb * 1024
    n_params = sum(q.numel() for q in _model().parameters())
    print(f"{args.family} model shaped like the Llama config {CONFIG}, {n_params / 1e6:.1f}M parameters, float32, batch 1, 1 thread")
    results = {}
    for t in args.tokens:
        for m in METHODS:
            if m != "forward" and m not in args.methods:
                continue
            if m == "ff" and t not in args.ff_tokens:
                continue
            r = run_child(m, t, limit_mb)
            results[(m, t)] = r
            fwd = results[("forward", t)]["seconds"]
            extra = "" if m == "forward" else f" = {r['seconds'] / fwd:.1f} x forward"
            print(f"  {t:>5} tokens {m:<11} {r['seconds']:8.2f} s{extra:<22} peak extra {r['extra_peak_mb']:8.0f} MB", flush=True)
    for m in args.fit_methods:
        measured = {t: r for (mm, t), r in results.items() if mm == m}
        if len(measured) >= 2:
            search(m, measured, limit_mb, 0.0, args.search_cap)
    for m in args.search_methods:
        measured = {t: r for (mm, t), r in results.items() if mm == m}
        s = search(m, measured, limit_mb, args.search_budget, args.search_cap)
        if s["complete"]:
            print(f"  longest input under {args.limit_gb:g} GB extra for {m}: {s['fits']} tokens ({s['over']} do not fit)")
        else:
            print(f"  longest input under {args.limit_gb:g} GB extra for {m}: >= {s['fits']} tokens, "
                  f"< {s['over']} (search stopped by its budget or cap)")


if __name__ == "__main__":
    main()
