r"""Peak extra memory (and wall time) of one ``attribute()`` call: decoders by depth and by length, encoders.

The "before / after" benchmark of the streaming engine: the same script measures any checkout
of the package, chosen by ``--package-root`` (default: the repository that holds this script),
which is put at ``sys.path[0]`` of the parent and of every child (the package actually imported
is checked and printed).

Sections (``--sections``, default all three):

* ``depth``: a small Llama-family decoder (bare ``LlamaModel``: hidden 256, 8 heads, 4 key/value
  heads, intermediate 704, vocab 1000, sdpa, max_position_embeddings 16384, random weights,
  seed 0) at ``--depth-tokens`` (2048) tokens with ``--layers`` (4 and 8) layers: plain forward,
  GlobEnc (the pre-LN default map), ALTI, ALTI-Logit and DecompX (both with
  ``unembedding=model.embed_tokens.weight``, ``target=42``; DecompX takes the bare model with an
  unembedding, no LM head needed). Table: method x (4 layers, 8 layers, ratio 8:4).
* ``length``: the ~100M config ``_bench.LLAMA_100M``, also that of ``speed_decoder.py`` (hidden 768, 12 layers, 12 heads,
  4 key/value heads, FF 2048, vocab 32000, bare ``LlamaModel``) at ``--lengths`` tokens, the same
  methods. A child aborts as soon as its extra memory passes ``--limit-gb`` (shown as "> 8 GB");
  a method over the limit is not run at longer lengths (shown as "> 8 GB (not run)").
* ``encoder``: a BERT-base-sized ``BertForSequenceClassification`` (hidden 768, 12 layers, 12 heads,
  FF 3072, 2 labels, random weights, seed 0) at ``--encoder-tokens`` (512) tokens, batch
  ``--encoder-batch`` (8), all-ones attention mask: GlobEnc (N_ENC), ALTI, GlobEnc+FF
  (``FFIntegratedDecomposition()``), ALTI+FF (``contribution="alti"``) and DecompX. The FF methods
  are slow on CPU: ``--skip ff ff_alti`` leaves them out, ``--ff-timeout`` bounds them.

Every figure comes from a fresh child process (``_bench.run_child``), batch as above, float32,
1 torch thread, niceness >= 10: one call, its wall time, and its peak extra memory = resident-set
growth over the loaded model, attribution object and inputs, polled every 2 ms
(``_bench.measure_peak``). A child past ``--timeout`` (``--ff-timeout`` for FF) prints what it
knows and exits; the table says "timeout". ``--json`` saves every record (rewritten after each
child, so an interrupted run keeps what it measured).

Reproduce, from the repository root ("before" = a checkout of the package as of commit 5e4d66c, the
version that recorded every layer before decomposing; benchmarks/results/memory_engine_before.json
holds its figures; the length section was measured at 1024 and 2048 tokens only, as 4096 tokens did not
fit the time budget of a shared 2-core machine):

    git worktree add ../captum-normattr-before 5e4d66c
    PYTHONPATH=../captum-normattr-before nice -n 10 python benchmarks/memory/memory_engine.py \
        --package-root ../captum-normattr-before --sections depth length --lengths 1024 2048 \
        --json benchmarks/results/memory_engine_before.json
    PYTHONPATH=../captum-normattr-before nice -n 10 python benchmarks/memory/memory_engine.py \
        --package-root ../captum-normattr-before --sections encoder --skip ff ff_alti \
        --json benchmarks/results/memory_engine_before.json --merge-json

"after" (this checkout):

    nice -n 10 python benchmarks/memory/memory_engine.py --json benchmarks/results/memory_engine_after.json

Options: ``--family llama|mixtral|qwen2_moe`` (the decoder sections' model, shaped like the Llama one:
``_bench.family_model``; a mixture of experts has 4 experts, top-2, of half the Llama FF width),
``--sections depth length encoder kinds`` (``kinds``: ``--families llama gpt_neox gemma2 mixtral`` side by side
on the depth section's small shape, or the frontier mechanisms ``gpt_oss deepseek_v3 llama4_text granitemoe``
(``_frontier.frontier_model``), ``--kinds-layers`` 2 layers (several, e.g. ``2 4``, to see the memory against depth), at ``--kinds-lengths 1024 4096``, ``--max-tokens
alti=1024`` to run a slow method at the shorter lengths only), ``--lengths 1024 2048 4096 8192``, ``--layers 4 8``,
``--limit-gb 8``, ``--skip METHOD ...`` (any of forward globenc alti alti_logit decompx ff ff_alti),
``--timeout``/``--ff-timeout`` (seconds per child), ``--json out.json`` (with ``--merge-json``: keep the
file's records of the sections not run now, to fill a file over several runs), ``--package-root DIR``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402

from _bench import (  # noqa: E402
    LLAMA_100M, decoder_runner, measure_peak, print_json, random_ids, rss_mb, run_child)
from _frontier import ALL_FAMILIES, any_family_model  # noqa: E402

SMALL_LLAMA = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=704,
                   vocab_size=1000, max_position_embeddings=16384, hidden_act="silu")
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=512, num_labels=2)
DECODER_METHODS = ("forward", "globenc", "alti", "alti_logit", "decompx")
ENCODER_METHODS = ("forward", "globenc", "alti", "ff", "ff_alti", "decompx")
LABELS = {"forward": "forward", "globenc": "GlobEnc", "alti": "ALTI", "alti_logit": "ALTI-Logit",
          "decompx": "DecompX", "ff": "GlobEnc+FF", "ff_alti": "ALTI+FF"}
EXIT_OVER, EXIT_TIMEOUT = 3, 4


# ----------------------------------------------------------------------------------- package

def _rel(path) -> str:
    r"""A path relative to this repository (results files carry no absolute path of a machine)."""
    if not path:
        return path
    return os.path.relpath(os.path.abspath(str(path)), os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

def use_package(root: str) -> str:
    r"""Put ``root`` first on ``sys.path``, import ``captum_normattr`` and check it came from there."""
    root = os.path.abspath(root)
    sys.path.insert(0, root)
    import captum_normattr

    got = os.path.abspath(captum_normattr.__file__)
    if not got.startswith(os.path.join(root, "")):
        raise RuntimeError(f"--package-root {root}: captum_normattr was imported from {got} instead "
                           f"(is there a captum_normattr/ folder under the root?)")
    return got


# ------------------------------------------------------------------------------------ models
def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(**BERT_BASE)
    cfg._attn_implementation = "sdpa"
    return BertForSequenceClassification(cfg).eval()


def _encoder_runner(name: str, model):
    from captum_normattr import ALTIAttribution, DecompXAttribution, FFIntegratedDecomposition, GlobEncAttribution

    if name == "forward":
        return lambda ids, mask: model(input_ids=ids, attention_mask=mask)
    if name == "globenc":
        a = GlobEncAttribution(model)  # N_ENC, the post-LN default
    elif name == "alti":
        a = ALTIAttribution(model)
    elif name == "ff":
        a = FFIntegratedDecomposition(model)  # GlobEnc+FF (scope LN2, norm contribution)
    elif name == "ff_alti":
        a = FFIntegratedDecomposition(model, contribution="alti")  # ALTI+FF
    elif name == "decompx":
        a = DecompXAttribution(model)  # target None: the predicted class
    else:
        raise ValueError(f"unknown encoder method {name!r}")
    return lambda ids, mask: a.attribute(ids, additional_forward_args=(mask,))


# ------------------------------------------------------------------------------------- child
def child(args, package_file: str) -> None:
    if os.nice(0) < 10:
        os.nice(10 - os.nice(0))
    torch.set_num_threads(1)
    section, name = args._child.split(":")
    if section == "encoder":
        model = _bert()
        ids = random_ids(args._batch, args._tokens, sep=102)
        inputs = (ids, torch.ones_like(ids))
        fn = _encoder_runner(name, model)
    else:
        small = section in ("depth", "kinds")
        model = any_family_model(args.family, SMALL_LLAMA if small else LLAMA_100M, layers=args._layers)
        inputs = (random_ids(args._batch, args._tokens, low=1 if small else 100,
                             high=1000 if small else 30000, cls=None),)
        fn = decoder_runner(name, model)
    record = {"section": section, "family": args.family, "method": name, "layers": args._layers if section != "encoder" else 12,
              "tokens": args._tokens, "batch": args._batch, "threads": torch.get_num_threads(),
              "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
              "package_file": _rel(package_file), "exceeded": False, "timed_out": False}
    base = [rss_mb()]
    start = [time.perf_counter()]

    def abort(extra_mb: float) -> None:  # from the polling thread, before the machine sees much more
        print_json({**record, "exceeded": True, "extra_peak_mb": extra_mb,
                    "seconds_until_abort": time.perf_counter() - start[0]})
        os._exit(EXIT_OVER)

    def timeout() -> None:
        print_json({**record, "timed_out": True, "timeout_s": args._timeout,
                    "extra_mb_at_timeout": rss_mb() - base[0]})
        os._exit(EXIT_TIMEOUT)

    timer = threading.Timer(args._timeout, timeout)
    timer.daemon = True
    base[0], start[0] = rss_mb(), time.perf_counter()
    timer.start()
    extra_mb, seconds = measure_peak(fn, *inputs, limit_mb=args._limit, on_exceed=abort)
    timer.cancel()
    print_json({**record, "seconds": seconds, "extra_peak_mb": extra_mb})


# ------------------------------------------------------------------------------------ parent
class Runner:
    def __init__(self, args, meta: dict) -> None:
        self.args = args
        self.limit_mb = args.limit_gb * 1024
        self.out = {"meta": meta, "runs": [meta], "depth": [], "length": [], "encoder": [], "kinds": []}
        if args.merge_json and args.json and os.path.exists(args.json):  # keep the sections not run now
            with open(args.json) as f:
                old = json.load(f)
            self.out["runs"] = old.get("runs", [old.get("meta", {})]) + [meta]
            for s in ("depth", "length", "encoder", "kinds"):
                if s not in args.sections:
                    self.out[s] = old.get(s, [])

    def save(self) -> None:
        if self.args.json:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.json)), exist_ok=True)
            with open(self.args.json, "w") as f:
                json.dump(self.out, f, indent=1)

    def run(self, section: str, name: str, *, layers: int, tokens: int, batch: int, family: str | None = None) -> dict:
        timeout = self.args.ff_timeout if name.startswith("ff") else self.args.timeout
        family = family or self.args.family
        argv = ["--package-root", self.args.package_root, "--family", family, "--_child", f"{section}:{name}", "--_layers", layers,
                "--_tokens", tokens, "--_batch", batch, "--_limit", self.limit_mb, "--_timeout", timeout]
        what = f"{section} {family} {name} ({layers} layers, {tokens} tokens, batch {batch})"
        t0 = time.perf_counter()
        try:
            r = run_child(__file__, argv, ok_returncodes=(0, EXIT_OVER, EXIT_TIMEOUT), what=what)
        except RuntimeError as e:  # report and go on with the next figure
            r = {"section": section, "family": family, "method": name, "layers": layers, "tokens": tokens,
                 "batch": batch, "failed": True, "error": str(e)[-1500:]}
        r["child_wall_s"] = time.perf_counter() - t0
        self.out[section].append(r)
        self.save()
        print(f"  {what:<48} {cell(r, self.args.limit_gb, seconds=True)}  [child {r['child_wall_s']:.0f} s]",
              flush=True)
        if r.get("failed"):
            print("    " + r["error"].strip().splitlines()[-1], flush=True)
        return r


def cell(r: dict | None, limit_gb: float, seconds: bool = False) -> str:
    if r is None:
        return "skipped"
    if r.get("failed"):
        return "failed"
    if r.get("not_run"):
        return f"> {limit_gb:g} GB (not run)"
    if r.get("exceeded"):
        return f"> {limit_gb:g} GB"
    if r.get("timed_out"):
        return f"timeout (> {r['timeout_s']:g} s)"
    s = f"{r['extra_peak_mb']:.0f} MB"
    return f"{s} ({r['seconds']:.1f} s)" if seconds else s


def _ok(r) -> bool:
    return r is not None and not any(r.get(k) for k in ("failed", "exceeded", "timed_out", "not_run"))


def table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def section_depth(R: Runner, methods: list) -> None:
    a = R.args
    print(f"\n## depth: bare {a.family} model shaped like {SMALL_LLAMA}, {a.depth_tokens} tokens, batch 1, layers {a.layers}", flush=True)
    res = {}
    for n_layers in a.layers:
        for m in methods:
            res[(m, n_layers)] = R.run("depth", m, layers=n_layers, tokens=a.depth_tokens, batch=1)
    lo, hi = a.layers[0], a.layers[-1]
    for what, key, unit in (("peak extra memory", "extra_peak_mb", "MB"), ("seconds", "seconds", "s")):
        rows = []
        for m in methods:
            r_lo, r_hi = res[(m, lo)], res[(m, hi)]
            cells = [cell(res[(m, n)], a.limit_gb) if key == "extra_peak_mb" or not _ok(res[(m, n)])
                     else f"{res[(m, n)][key]:.2f} s" for n in a.layers]
            ratio = f"{r_hi[key] / r_lo[key]:.2f}" if _ok(r_lo) and _ok(r_hi) and r_lo[key] > 0 else "-"
            rows.append([LABELS[m], *cells, ratio])
        print(f"\n{what} of one call, {a.depth_tokens} tokens:\n"
              + table(["method", *[f"{n} layers" for n in a.layers], f"ratio {hi}:{lo}"], rows), flush=True)


def section_length(R: Runner, methods: list) -> None:
    a = R.args
    print(f"\n## length: bare {a.family} model shaped like {LLAMA_100M}, batch 1, tokens {a.lengths}, limit {a.limit_gb:g} GB",
          flush=True)
    res, over = {}, set()
    for t in a.lengths:
        for m in methods:
            if m in over:
                res[(m, t)] = {"section": "length", "method": m, "layers": 12, "tokens": t, "batch": 1,
                               "not_run": True, "why": "over the limit at a shorter length"}
                R.out["length"].append(res[(m, t)])
                continue
            res[(m, t)] = r = R.run("length", m, layers=12, tokens=t, batch=1)
            if r.get("exceeded") or r.get("timed_out"):
                over.add(m)
    R.save()
    for what, key in (("peak extra memory", "extra_peak_mb"), ("seconds", "seconds")):
        rows = [[LABELS[m], *[cell(res[(m, t)], a.limit_gb) if key == "extra_peak_mb" or not _ok(res[(m, t)])
                              else f"{res[(m, t)][key]:.1f} s" for t in a.lengths]] for m in methods]
        print(f"\n{what} of one call (~100M decoder):\n" + table(["method", *[f"{t} tokens" for t in a.lengths]], rows),
              flush=True)


def section_kinds(R: Runner, methods: list) -> None:
    r"""Families side by side (``--families``) on the small Llama shape, at ``--kinds-lengths``, ``--kinds-layers`` layers.

    With several ``--kinds-layers`` (e.g. ``2 4``: is the memory flat in depth?), every length runs at each depth,
    the shallowest first, and a table is printed per (length, depth).
    """
    a = R.args
    cap = dict(kv.split("=") for kv in a.max_tokens)
    print(f"\n## kinds: bare {a.families} models shaped like {SMALL_LLAMA}, {a.kinds_layers} layers, batch 1, "
          f"tokens {a.kinds_lengths}", flush=True)
    res = {}
    for t in a.kinds_lengths:  # the shortest length of every family first
        for n in a.kinds_layers:
            for f in a.families:
                for m in methods:
                    if m in cap and t > int(cap[m]):
                        continue
                    res[(f, m, t, n)] = R.run("kinds", m, layers=n, tokens=t, batch=1, family=f)
    for t in a.kinds_lengths:
        for n in a.kinds_layers:
            rows = []
            for m in methods:
                cells = []
                for f in a.families:
                    r, fwd = res.get((f, m, t, n)), res.get((f, "forward", t, n))
                    if r is None:
                        cells.append("not run")
                    elif not _ok(r):
                        cells.append(cell(r, a.limit_gb))
                    else:
                        ratio = f", {r['seconds'] / fwd['seconds']:.1f}x fwd" if m != "forward" and _ok(fwd) else ""
                        cells.append(f"{r['extra_peak_mb']:.0f} MB ({r['seconds']:.1f} s{ratio})")
                rows.append([LABELS[m], *cells])
            depth = f", {n} layers" if len(a.kinds_layers) > 1 else ""
            print(f"\npeak extra memory (seconds) of one call, {t} tokens{depth}:\n"
                  + table(["method", *a.families], rows), flush=True)


def section_encoder(R: Runner, methods: list) -> None:
    a = R.args
    print(f"\n## encoder: BertForSequenceClassification {BERT_BASE}, {a.encoder_tokens} tokens, "
          f"batch {a.encoder_batch}", flush=True)
    res = {m: R.run("encoder", m, layers=12, tokens=a.encoder_tokens, batch=a.encoder_batch) for m in methods}
    rows = [[LABELS[m], cell(res.get(m), a.limit_gb), f"{res[m]['seconds']:.1f}" if _ok(res.get(m)) else "-"]
            for m in ENCODER_METHODS]
    print(f"\npeak extra memory of one call, {a.encoder_tokens} tokens x batch {a.encoder_batch}:\n"
          + table(["method", "peak extra memory", "seconds"], rows), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", nargs="+", default=["depth", "length", "encoder"],
                   choices=["depth", "length", "encoder", "kinds"])
    p.add_argument("--package-root", default=os.path.dirname(BENCHMARKS),
                   help="checkout whose captum_normattr is measured (default: the repository holding this script)")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8], help="depth section: layer counts")
    p.add_argument("--family", default="llama", choices=ALL_FAMILIES,
                   help="decoder sections: the family of the model, shaped like the Llama config (_bench.family_model)")
    p.add_argument("--depth-tokens", type=int, default=2048)
    p.add_argument("--families", nargs="+", default=["llama", "gpt_neox", "gemma2", "mixtral"], choices=ALL_FAMILIES,
                   help="kinds section: the families side by side (small Llama shape)")
    p.add_argument("--kinds-lengths", type=int, nargs="+", default=[1024, 4096], help="kinds section: tokens")
    p.add_argument("--kinds-layers", type=int, nargs="+", default=[2],
                   help="kinds section: layers (several, e.g. 2 4: memory against depth)")
    p.add_argument("--max-tokens", nargs="*", default=[], metavar="METHOD=T",
                   help="kinds section: run METHOD only up to T tokens (e.g. alti=1024)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="length section: tokens")
    p.add_argument("--encoder-tokens", type=int, default=512)
    p.add_argument("--encoder-batch", type=int, default=8)
    p.add_argument("--skip", nargs="*", default=[], choices=sorted(set(DECODER_METHODS) | set(ENCODER_METHODS)),
                   help="methods left out of every section (e.g. --skip ff ff_alti)")
    p.add_argument("--limit-gb", type=float, default=8.0, help="a child aborts past this much extra memory")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per child (non-FF methods)")
    p.add_argument("--ff-timeout", type=float, default=600.0, help="seconds per FF child (GlobEnc+FF, ALTI+FF)")
    p.add_argument("--json", default=None, help="save every record here")
    p.add_argument("--merge-json", action="store_true",
                   help="if the --json file exists, keep its records of the sections not run now (and its run metadata)")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_layers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_tokens", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--_limit", type=float, default=1e12, help=argparse.SUPPRESS)
    p.add_argument("--_timeout", type=float, default=1e9, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.package_root = os.path.abspath(args.package_root)
    package_file = use_package(args.package_root)
    if args._child:
        child(args, package_file)
        return
    import transformers

    commit = None
    try:
        import subprocess

        commit = subprocess.run(["git", "-C", args.package_root, "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        pass
    meta = {"package_root": _rel(args.package_root), "package_file": _rel(package_file), "package_commit": commit,
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "parent_torch_threads": torch.get_num_threads(), "child_torch_threads": 1, "niceness": os.nice(0),
            "cpus": os.cpu_count(), "limit_gb": args.limit_gb, "sections": args.sections, "argv": sys.argv[1:],
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    print(f"package root: {args.package_root} (captum_normattr from {package_file}, commit {commit})")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; torch threads: parent "
          f"{torch.get_num_threads()}, every child 1; niceness {os.nice(0)}; limit {args.limit_gb:g} GB extra")
    R = Runner(args, meta)
    t0 = time.perf_counter()
    dec = [m for m in DECODER_METHODS if m not in args.skip]
    if "depth" in args.sections:
        section_depth(R, dec)
    if "length" in args.sections:
        section_length(R, dec)
    if "encoder" in args.sections:
        section_encoder(R, [m for m in ENCODER_METHODS if m not in args.skip])
    if "kinds" in args.sections:
        section_kinds(R, dec + ([] if "ff" in args.skip else ["ff"]))
    R.out["meta"]["total_wall_s"] = time.perf_counter() - t0
    R.save()
    print(f"\ntotal {time.perf_counter() - t0:.0f} s" + (f"; saved {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
