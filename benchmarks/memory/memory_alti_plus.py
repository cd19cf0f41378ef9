r"""Peak extra memory of one ALTI+ call by depth, and its speed at a moderate size, for any checkout.

The "before / after" benchmark of streamed ALTI+ (``docs/seq2seq.md``, "Memory and speed"). The
measured checkout is chosen by ``--package-root`` (default: the repository that holds this
script); it is put first on ``sys.path`` of every child and the package actually imported is
checked and recorded.

Model: a Marian-shaped random ``MarianMTModel`` (d_model 256, 8 heads per attention, FF 1024,
vocabulary 1000 shared by both sides, max_position_embeddings 2048, random weights, seed 0,
float32, eager attention), ``--layers`` (4 and 8) layers per stack.

* ``memory``: one ``ALTIPlusAttribution(model).attribute((src, tgt))`` call at ``--src-tokens``
  (1024) source + ``--tgt-tokens`` (1024) target tokens, batch 1: peak extra memory =
  resident-set growth over the loaded model, attribution object and inputs, polled every 2 ms
  (``_bench.measure_peak``), in a fresh child process per figure (1 torch thread, niceness >= 10).
  ``attribute`` is the call form every version of the package has.
* ``speed``: wall time of the same call at ``--speed-tokens`` (256 + 256) tokens, 4 layers, batch
  ``--speed-batch`` (2): each child times ``--repeats`` calls after one warm-up and reports the
  median; with ``--compare-root`` the two checkouts' children alternate (before, after, before,
  after, ...) ``--rounds`` times so that machine noise hits both alike, and the ratio of the
  medians of their medians is printed.

``--compile 0|1|default`` sets ``CAPTUM_NORMATTR_COMPILE`` in the children (the compiled ALTI
kernel; versions without it ignore the variable).

Reproduce ("before" = a copy of the package as of the commit before streamed ALTI+, e.g.
``git archive <commit> captum_normattr | tar -x -C ../alti-plus-before``):

    nice -n 10 python benchmarks/memory/memory_alti_plus.py --package-root ../alti-plus-before --compare-root . \
        --labels before after --json benchmarks/results/memory_alti_plus.json
    nice -n 10 python benchmarks/memory/memory_alti_plus.py --package-root ../alti-plus-before --compare-root . \
        --labels before after --compile 0 --json benchmarks/results/memory_alti_plus_eager.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ (this script sits in benchmarks/<group>/)
sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402

from _bench import measure_peak, print_json, random_ids, run_child  # noqa: E402

MARIAN = dict(d_model=256, encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=1024,
              decoder_ffn_dim=1024, vocab_size=1000, decoder_vocab_size=1000, max_position_embeddings=2048,
              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout=0.0, attention_dropout=0.0)


def _rel(path: str) -> str:
    r"""A path relative to this repository (results carry no absolute path of a machine)."""
    return os.path.relpath(os.path.abspath(path), os.path.dirname(BENCHMARKS))


def use_package(root: str) -> str:
    r"""Put ``root`` first on ``sys.path``, import ``captum_normattr`` and check it came from there."""
    root = os.path.abspath(root)
    sys.path.insert(0, root)
    import captum_normattr

    got = os.path.abspath(captum_normattr.__file__)
    if not got.startswith(os.path.join(root, "")):
        raise RuntimeError(f"--package-root {root}: captum_normattr was imported from {got} instead")
    return got


def marian(layers: int):
    r"""The seeded random Marian-shaped model of this benchmark, ``layers`` layers per stack, float32."""
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    cfg = MarianConfig(**MARIAN, encoder_layers=layers, decoder_layers=layers)
    cfg._attn_implementation = "eager"
    return MarianMTModel(cfg).eval()


def child(args, package_file: str) -> None:
    if os.nice(0) < 10:
        os.nice(10 - os.nice(0))
    torch.set_num_threads(1)
    from captum_normattr import ALTIPlusAttribution

    model = marian(args._layers)
    src = random_ids(args._batch, args._src, low=3, high=1000, cls=None, seed=0)
    tgt = random_ids(args._batch, args._tgt, low=3, high=1000, cls=0, seed=1)
    alti = ALTIPlusAttribution(model)
    record = {"mode": args._child, "layers": args._layers, "src_tokens": args._src, "tgt_tokens": args._tgt,
              "batch": args._batch, "threads": torch.get_num_threads(), "package_file": _rel(package_file),
              "compile": os.environ.get("CAPTUM_NORMATTR_COMPILE", "default")}
    call = lambda: alti.attribute((src, tgt))  # noqa: E731
    if args._child == "memory":
        extra_mb, seconds = measure_peak(call)
        print_json({**record, "extra_peak_mb": extra_mb, "seconds": seconds})
        return
    with torch.no_grad():
        call()  # warm-up (and any compilation)
        times = []
        for _ in range(args._repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    print_json({**record, "seconds": statistics.median(times), "all_seconds": times})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--package-root", default=os.path.dirname(BENCHMARKS), help="checkout measured (default: this one)")
    p.add_argument("--compare-root", default=None, help="a second checkout measured the same way (the 'after')")
    p.add_argument("--sections", nargs="+", default=["memory", "speed"], choices=["memory", "speed"])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--src-tokens", type=int, default=1024)
    p.add_argument("--tgt-tokens", type=int, default=1024)
    p.add_argument("--speed-tokens", type=int, default=256, help="source and target tokens of the speed section")
    p.add_argument("--speed-batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per speed child")
    p.add_argument("--rounds", type=int, default=3, help="speed children per checkout (alternating)")
    p.add_argument("--compile", default="default", choices=["default", "0", "1"])
    p.add_argument("--labels", nargs="+", default=None,
                   help="names of the checkouts in the tables and the JSON (default: their paths, relative)")
    p.add_argument("--json", default=None)
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_layers", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--_src", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_tgt", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--_repeats", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        child(args, use_package(args.package_root))
        return
    if args.compile != "default":
        os.environ["CAPTUM_NORMATTR_COMPILE"] = args.compile
    else:
        os.environ.pop("CAPTUM_NORMATTR_COMPILE", None)
    roots = [os.path.abspath(args.package_root)] + ([os.path.abspath(args.compare_root)] if args.compare_root else [])
    labels = dict(zip(roots, args.labels or [_rel(r) for r in roots]))
    import transformers

    out = {"meta": {"roots": [labels[r] for r in roots], "torch": torch.__version__,
                    "transformers": transformers.__version__, "python": platform.python_version(),
                    "cpus": os.cpu_count(), "compile": args.compile, "argv": sys.argv[1:]},
           "memory": [], "speed": []}

    def save():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    def run(root, mode, layers, s, t, b, repeats=1):
        argv = ["--package-root", root, "--_child", mode, "--_layers", layers, "--_src", s, "--_tgt", t,
                "--_batch", b, "--_repeats", repeats]
        r = run_child(__file__, argv, what=f"{mode} {_rel(root)} {layers} layers {s}+{t} x {b}")
        r["root"] = labels[root]
        r.pop("package_file", None)  # a path of this machine where the checkout lies outside the repository
        r["package"] = labels[root]
        out[mode].append(r)
        save()
        extra = f", {r['extra_peak_mb']:.0f} MB extra" if "extra_peak_mb" in r else ""
        print(f"  {mode:<6} {labels[root]:<24} {layers} layers {s}+{t} x {b}: {r['seconds']:.2f} s{extra}", flush=True)
        return r

    if "memory" in args.sections:
        print(f"## memory: {args.src_tokens} source + {args.tgt_tokens} target tokens, batch 1", flush=True)
        mem = {(root, n): run(root, "memory", n, args.src_tokens, args.tgt_tokens, 1) for root in roots
               for n in args.layers}
        lo, hi = args.layers[0], args.layers[-1]
        print(f"\n| checkout | " + " | ".join(f"{n} layers" for n in args.layers) + f" | ratio {hi}:{lo} |")
        print("|:---|" + "---:|" * (len(args.layers) + 1))
        for root in roots:
            cells = [f"{mem[(root, n)]['extra_peak_mb']:.0f} MB ({mem[(root, n)]['seconds']:.0f} s)" for n in args.layers]
            ratio = mem[(root, hi)]["extra_peak_mb"] / mem[(root, lo)]["extra_peak_mb"]
            print(f"| {labels[root]} | " + " | ".join(cells) + f" | {ratio:.2f} |", flush=True)
    if "speed" in args.sections:
        n = args.speed_tokens
        print(f"\n## speed: {n} source + {n} target tokens, batch {args.speed_batch}, {args.layers[0]} layers, "
              f"median of {args.repeats} calls per child, {args.rounds} alternating children per checkout", flush=True)
        med = {root: [] for root in roots}
        for _ in range(args.rounds):
            for root in roots:
                med[root].append(run(root, "speed", args.layers[0], n, n, args.speed_batch, args.repeats)["seconds"])
        for root in roots:
            print(f"| {labels[root]} | {statistics.median(med[root]):.3f} s |")
        if len(roots) == 2:
            ratio = statistics.median(med[roots[1]]) / statistics.median(med[roots[0]])
            out["speed_ratio_compare_over_package"] = ratio
            print(f"time ratio {labels[roots[1]]} / {labels[roots[0]]}: {ratio:.3f}", flush=True)
    save()


if __name__ == "__main__":
    main()
