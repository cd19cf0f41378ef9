r"""Faithfulness of every attribution method on the SST-2 validation set.

Runs :class:`captum_normattr.evaluation.FaithfulnessHarness` on a fine-tuned sequence
classifier (default: the checkpoint written by ``benchmarks/faithfulness/finetune_sst2.py``) over the
SST-2 validation sentences, for every GlobEnc-table map, ALTI, the feed-forward variants
when the installed ``captum_normattr`` has them, and Captum's gradient baselines; scores
them with every preset (GlobEnc Spearman, ERASER AOPC, DecompX [MASK] AOPC, Captum
infidelity and sensitivity_max), writes the full result as JSON and the tables into the
``## Faithfulness on SST-2`` section of ``benchmarks/RESULTS.md`` (between generated-text
markers: the hand-written discussion around them is kept).

Example (the whole run; RESULTS.md lists the exact commands used, split in parts)::

    nice -n 10 python benchmarks/faithfulness/faithfulness_sst2.py --dev ../shared/data/sst2/dev.tsv \
        --checkpoint benchmarks/checkpoints/minilm-sst2

Parts: ``--part baselines`` / ``--part ours`` run subsets and ``--merge`` puts other
runs' JSON into the same tables; ``--presets`` with no name is a timing-only run (every
method on the same batches, for the cost table; pass its JSON as ``--cost-json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/ (this script sits in benchmarks/<group>/)
DEFAULT_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data next to the checkout
sys.path.insert(0, str(BENCHMARKS.parent))
sys.path.insert(0, str(BENCHMARKS))

from finetune_sst2 import read_tsv, seed_everything  # noqa: E402

from captum_normattr.evaluation import (  # noqa: E402
    CaptumInfidelity,
    CaptumSensitivity,
    DecompXMaskAOPC,
    EraserAOPC,
    FaithfulnessHarness,
    HarnessResult,
    SequenceClassifier,
    SpearmanGradXInput,
    baselines,
)

SECTION = "## Faithfulness on SST-2"
START = "<!-- faithfulness_sst2.py: generated, start -->"
END = "<!-- faithfulness_sst2.py: generated, end -->"

# Published figures (docs/design.md, section 15)
PUB_GLOBENC = {"W": -0.11, "N": 0.44, "N_RES": 0.73, "N_RESLN": -0.21, "N_ENC": 0.77}
PUB_DECOMPX = {"N_ENC": 0.307, "ALTI": 0.416, "GradXInput emb-out (L2)": 0.310, "IG": 0.340, "DecompX": 0.627}
PUB_ALTI = {"ALTI": (0.269, 0.057), "IG": (0.223, 0.074), "W_FIXEDRES": (0.076, 0.179)}


def our_methods(model, names):
    r"""Our methods: every GlobEnc-table map, ALTI, GlobEnc+FF, ALTI+FF and DecompX (both bias modes).

    Args:
        model: the fine-tuned sequence classifier.
        names: restrict to these table names (None: all).

    Returns:
        The methods.
    """
    from captum_normattr import GLOBENC_MAPS, FFIntegratedDecomposition

    methods = [baselines.globenc(model, m) for m in GLOBENC_MAPS]
    methods.append(baselines.alti(model))
    methods.append(baselines.normattr_method(FFIntegratedDecomposition(model, contribution="norm")))  # GlobEnc+FF
    methods.append(baselines.normattr_method(FFIntegratedDecomposition(model, contribution="alti")))  # ALTI+FF
    methods.append(baselines.decompx(model, "separate"))
    methods.append(baselines.decompx(model, "spread"))
    return [m for m in methods if not names or m.name in names]


def competitor_methods(model):
    r"""The competitors: AttnLRP (lxt efficient mode, when lxt imports) and Value Zeroing.

    Args:
        model: the fine-tuned BERT sequence classifier.

    Returns:
        (methods, notes).
    """
    from captum_normattr.evaluation.competitors import LXT_INSTALL, attnlrp_classifier, lxt_available

    methods, notes = [], []
    if lxt_available():
        methods.append(attnlrp_classifier(model))
    else:
        notes.append("AttnLRP skipped: " + LXT_INSTALL)
    methods.append(baselines.ours(model, "value-zeroing"))
    return methods, notes


def fmt(x, d=3):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def comparison_tables(res: HarnessResult, ig_name: str) -> str:
    s = res.summary()
    mean = lambda m, k: s[m][k]["mean"] if m in s else float("nan")  # noqa: E731
    out = []

    def table(title, header, rows):
        if rows:
            out.extend([title, "", *header, *rows, ""])
        else:
            out.extend([title + " — none of these methods ran.", ""])

    table("Spearman with gradient x input (GlobEnc protocol), ours vs published (fine-tuned BERT-base):",
          ["| map | ours (MiniLM-L6) | published (BERT-base) |", "|---|---:|---:|"],
          [f"| {m} | {fmt(mean(m, 'spearman'), 2)} ± {fmt(s[m]['spearman']['std'], 2)} | {p:.2f} |"
           for m, p in PUB_GLOBENC.items() if m in s])
    ig_l2 = ig_name.replace("(sum,", "(L2,")
    ig_rows = [(ig_l2, "IG (L2)"), (ig_name, "IG (sum)")]
    rows = []
    for m, p in PUB_DECOMPX.items():
        if m == "IG":  # DecompX Table 1 reports IG with the L2 reduction; the signed sum is shown beside it
            for name, label in ig_rows:
                if name in s:
                    rows.append(f"| {label} | {fmt(mean(name, 'mask_aopc'))} | {p:.3f} (L2) |")
            continue
        label = "N_ENC (GlobEnc)" if m == "N_ENC" else m
        if m in s:
            rows.append(f"| {label} | {fmt(mean(m, 'mask_aopc'))} | {p:.3f} |")
    table("DecompX [MASK] AOPC (higher is better), ours vs DecompX Table 1 (SST-2, BERT-base):",
          ["| method | ours | published |", "|---|---:|---:|"], rows)
    rows = []
    for m, (pc, ps) in PUB_ALTI.items():
        names = ig_rows if m == "IG" else [(m, "W_FIXEDRES (attention rollout)" if m == "W_FIXEDRES" else m)]
        for name, label in names:
            if name in s:
                rows.append(f"| {label} | {fmt(mean(name, 'eraser_comp'))} | {fmt(mean(name, 'eraser_suff'))} | "
                            f"{pc:.3f} | {ps:.3f} |")
    table("ERASER comprehensiveness / sufficiency, ours vs ALTI paper (RoBERTa SST-2; its IG row is compared with "
          "both of our reductions):",
          ["| method | ours comp. ↑ | ours suff. ↓ | published comp. | published suff. |", "|---|---:|---:|---:|---:|"],
          rows)
    # orderings
    checks = []

    def order(desc, names, key, higher=True):
        vals = [(n, mean(n, key)) for n in names if n in s]
        if len(vals) < len(names) or any(math.isnan(v) for _, v in vals):
            return  # a method or its metric did not run: nothing to check
        ok = all((a[1] > b[1]) if higher else (a[1] < b[1]) for a, b in zip(vals, vals[1:]))
        checks.append(f"- {desc}: {' > '.join(f'{n} {v:.3f}' for n, v in vals) if higher else ' < '.join(f'{n} {v:.3f}' for n, v in vals)} "
                      f"— **{'holds' if ok else 'does not hold'}**")

    order("GlobEnc Spearman ordering N_ENC > N_RES > N > W", ["N_ENC", "N_RES", "N", "W"], "spearman")
    order("GlobEnc Spearman: N_RESLN below N (published: negative)", ["N", "N_RESLN"], "spearman")
    for ig, red in ((ig_l2, "L2"), (ig_name, "sum")):
        order(f"ERASER comprehensiveness ALTI > IG ({red}) > rollout", ["ALTI", ig, "W_FIXEDRES"], "eraser_comp")
        order(f"ERASER sufficiency ALTI < IG ({red}) < rollout", ["ALTI", ig, "W_FIXEDRES"], "eraser_suff", higher=False)
    order("DecompX Table 1 [MASK] AOPC ordering DecompX > ALTI > IG (L2) > GxI > GlobEnc",
          ["DecompX", "ALTI", ig_l2, "GradXInput emb-out (L2)", "N_ENC"], "mask_aopc")
    order("issue 7 goal, [MASK] AOPC: DecompX > IG (sum)", ["DecompX", ig_name], "mask_aopc")
    order("issue 7 goal, [MASK] accuracy: DecompX < IG (sum)", ["DecompX", ig_name], "mask_acc", higher=False)
    order("issue 7 goal, ERASER comprehensiveness: DecompX > IG (sum)", ["DecompX", ig_name], "eraser_comp")
    order("issue 7 goal, ERASER sufficiency: DecompX < IG (sum)", ["DecompX", ig_name], "eraser_suff", higher=False)
    if checks:
        out.append("Orderings (computed by the script):\n")
        out.extend(checks)
        out.append("")
    return "\n".join(out)


def cost_table(res: HarnessResult) -> str:
    rows = ["| method | ms / example | × one forward pass |", "|---|---:|---:|"]
    rows.append(f"| forward pass (no grad) | {1000 * res.forward_seconds_per_example:.2f} | 1.0 |")
    for m in sorted(res.methods, key=lambda m: res.seconds_per_example[m]):
        rows.append(f"| {m} | {1000 * res.seconds_per_example[m]:.2f} | {res.cost_vs_forward(m):.1f} |")
    return "\n".join(rows)


def write_results_md(path: Path, generated: str) -> None:
    block = f"{START}\n{generated.rstrip()}\n{END}"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    if SECTION not in text:
        text = text.rstrip() + f"\n\n{SECTION}\n\n{block}\n"
    elif START in text and END in text:
        a, rest = text.split(START, 1)
        _, b = rest.split(END, 1)
        text = a + block + b
    else:
        a, b = text.split(SECTION, 1)
        text = a + SECTION + "\n\n" + block + "\n" + b
    path.write_text(text, encoding="utf-8")


def merge_results(results):
    r"""Combine results of several runs over the same sentences (methods side by side)."""
    if len(results) == 1:
        return results[0]
    base = results[0]
    for r in results[1:]:
        if r.n_examples != base.n_examples:
            raise SystemExit(f"cannot merge runs over {base.n_examples} and {r.n_examples} sentences")
        for m in r.methods:
            if m in base.methods:
                continue
            base.methods.append(m)
            base.per_example[m] = r.per_example[m]
            # the cost of a method is kept relative to the forward pass of its own run
            base.seconds_per_example[m] = r.seconds_per_example[m] * (
                base.forward_seconds_per_example / r.forward_seconds_per_example)
        known = {k.key for k in base.metrics}
        base.metrics += [k for k in r.metrics if k.key not in known]
        base.presets.update({k: v for k, v in r.presets.items() if k not in base.presets})
        base.info.setdefault("merged_commands", []).append(r.info.get("command"))
    for m in base.methods:
        for k in base.metrics:
            base.per_example[m].setdefault(k.key, [float("nan")] * base.n_examples)
    return base


def render(res: HarnessResult, cost: HarnessResult, ig_name: str, json_paths, results_md: Path) -> None:
    ft = res.info.get("finetune", {})
    cmds = [res.info.get("command")] + res.info.get("merged_commands", [])
    if cost is not res:
        cmds.append(cost.info.get("command"))
    gen = ["Commands (from the repository root, in this order):", "", "```"]
    gen += ["nice -n 10 " + ft["command"]] if ft.get("command") else []
    gen += ["nice -n 10 " + c for c in cmds if c] + ["```", ""]
    gen += [
        f"Machine: {res.info.get('machine')}, torch {res.info.get('torch')}; wall time "
        f"{res.info.get('wall_seconds', 0) / 60:.0f} min for the first run. Per-example values: "
        + ", ".join(f"`{j}`" for j in json_paths) + ".",
        "",
        f"Model: `{Path(res.info.get('checkpoint', '')).name}`, validation accuracy **{res.accuracy:.4f}** "
        f"on {res.n_examples} sentences"
        + (f" (all-MiniLM-L6-v2 fine-tuned on {ft.get('train_examples')} SST-2 train sentences, 1 epoch, "
           f"{ft.get('train_minutes', 0):.0f} min)." if ft else "."),
        "",
    ]
    notes = res.info.get("notes") or []
    if notes:
        gen += ["Notes: " + "; ".join(notes) + ".", ""]
    gen += ["### All methods, all presets", "", res.table(cost=False), "", "Presets:", ""]
    for name, cfg in res.presets.items():
        extra = {k: v for k, v in cfg.items() if k not in ("name", "convention", "target") and v is not None}
        gen.append(f"- `{name}` (methods explain the {cfg['target']} class): {cfg['convention']}; {extra}")
    gen += ["", f"### Cost per example relative to one forward pass (one run, same padded batches, "
                f"{cost.n_examples} sentences, batch {cost.info.get('batch_size')})", "",
            cost_table(cost), "", "### Against the published figures", "", comparison_tables(res, ig_name)]
    write_results_md(results_md, "\n".join(gen))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DEFAULT_DATA),
                   help="data folder holding sst2/dev.tsv (default: ../shared/data next to the repository)")
    p.add_argument("--dev", default=None, help="SST-2 dev.tsv (sentence<TAB>label, header; default: DATA/sst2/dev.tsv)")
    p.add_argument("--checkpoint", default=str(BENCHMARKS / "checkpoints" / "minilm-sst2"))
    p.add_argument("--limit", type=int, default=0, help="first N sentences only (0 = all)")
    p.add_argument("--part", choices=("all", "ours", "baselines", "competitors"), default="all",
                   help="which methods to run (competitors: AttnLRP (lxt, skipped without it) and Value Zeroing)")
    p.add_argument("--presets", nargs="*", default=None,
                   help="preset names (default all; give none for a timing-only run)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--ig-steps", type=int, default=50)
    p.add_argument("--infidelity-samples", type=int, default=5)
    p.add_argument("--sensitivity-samples", type=int, default=3)
    p.add_argument("--sensitivity-examples", type=int, default=50, help="sensitivity_max on the first N sentences")
    p.add_argument("--methods", nargs="*", default=None, help="restrict to these method names")
    p.add_argument("--merge", nargs="*", default=[], help="result JSONs of other runs to put in the same tables")
    p.add_argument("--cost-json", default=None, help="result JSON whose timings make the cost table (default: this run)")
    p.add_argument("--json", default=str(BENCHMARKS / "out" / "faithfulness_sst2.json"))
    p.add_argument("--results-md", default=str(BENCHMARKS / "RESULTS.md"), help="'' to skip writing RESULTS.md")
    p.add_argument("--render-only", action="store_true",
                   help="no run: write RESULTS.md from the --merge JSONs (first = main) and --cost-json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.dev is None:
        args.dev = os.path.join(args.data, "sst2", "dev.tsv")

    ig_name = f"IG word emb. (sum, {args.ig_steps} steps)"
    if args.render_only:
        if not args.merge:
            raise SystemExit("--render-only needs --merge JSON [JSON ...]")
        merged = merge_results([HarnessResult.from_json(j) for j in args.merge])
        cost = HarnessResult.from_json(args.cost_json) if args.cost_json else merged
        render(merged, cost, ig_name, [os.path.relpath(j) for j in args.merge], Path(args.results_md))
        print(f"wrote {args.results_md}")
        return merged

    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        raise SystemExit(f"no checkpoint at {ckpt}: run benchmarks/faithfulness/finetune_sst2.py first")
    model = BertForSequenceClassification.from_pretrained(ckpt).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    sentences, labels = read_tsv(args.dev)
    if args.limit:
        sentences, labels = sentences[: args.limit], labels[: args.limit]

    clf = SequenceClassifier(model, tok)
    methods, notes = [], []
    if args.part in ("all", "ours"):
        methods = our_methods(model, args.methods)
    if args.part in ("all", "baselines"):
        base = baselines.default_baselines(clf, ig_steps=args.ig_steps)
        methods += [m for m in base if not args.methods or m.name in args.methods]
    if args.part in ("all", "competitors"):
        comp, comp_notes = competitor_methods(model)
        methods += [m for m in comp if not args.methods or m.name in args.methods]
        notes += comp_notes
    unknown = set(args.methods or ()) - {m.name for m in methods}
    if unknown:  # names no part of this run has (checked once every part is in)
        notes.append(f"unknown method names ignored: {sorted(unknown)}")
    if not methods:
        raise SystemExit("no method to run")
    all_presets = {
        "globenc_spearman": SpearmanGradXInput(),
        "eraser_aopc": EraserAOPC(),
        "decompx_mask": DecompXMaskAOPC(),
        "captum_infidelity": CaptumInfidelity(n_perturb_samples=args.infidelity_samples),
        "captum_sensitivity": CaptumSensitivity(n_perturb_samples=args.sensitivity_samples,
                                                max_examples=args.sensitivity_examples),
    }
    chosen = list(all_presets) if args.presets is None else args.presets
    unknown = set(chosen) - set(all_presets)
    if unknown:
        raise SystemExit(f"unknown presets {sorted(unknown)}; known: {list(all_presets)}")
    presets = [all_presets[n] for n in chosen]
    print(f"{len(sentences)} sentences, {len(methods)} methods: {[m.name for m in methods]}; presets {chosen}",
          flush=True)
    for n in notes:
        print("note:", n, flush=True)
    t0 = time.time()
    harness = FaithfulnessHarness(clf, methods, presets, batch_size=args.batch_size, progress=not args.no_progress,
                                  seed=args.seed)
    res = harness.run_sentences(sentences, labels, tok, max_length=args.max_length)
    wall = time.time() - t0
    argv_rel = [os.path.relpath(a, BENCHMARKS.parent) if os.path.isabs(a) else a for a in sys.argv[1:]]  # no machine paths
    res.info.update({
        "checkpoint": str(ckpt), "dev": args.dev, "wall_seconds": wall, "notes": notes,
        "command": shlex.join(["python", os.path.relpath(sys.argv[0])] + argv_rel),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
    })
    metrics_file = ckpt / "finetune_metrics.json"
    if metrics_file.is_file():
        res.info["finetune"] = json.loads(metrics_file.read_text())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    res.to_json(args.json)
    print(res.table() if res.metrics else "")
    print(cost_table(res))
    print(f"wall time {wall / 60:.1f} min; wrote {args.json}", flush=True)

    if args.results_md:
        merged = merge_results([res] + [HarnessResult.from_json(j) for j in args.merge]) if res.metrics else None
        if merged is None:
            if not args.merge:
                return res
            merged = merge_results([HarnessResult.from_json(j) for j in args.merge])
        cost = HarnessResult.from_json(args.cost_json) if args.cost_json else res
        jsons = [os.path.relpath(args.json)] + [os.path.relpath(j) for j in args.merge]
        render(merged, cost, ig_name, jsons, Path(args.results_md))
        print(f"wrote {args.results_md}")
    return res


if __name__ == "__main__":
    main()
