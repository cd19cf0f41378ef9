r"""``captum-normattr evaluate``: compare attribution methods on a model, a task and items (docs/evaluation.md).

Decoder tasks (``sva``, ``ioi``, ``facts``, ``induction``: generated; ``jsonl``: a user's items
with ``--data FILE``) run the decoder harness
(:mod:`captum_normattr.evaluation.decoder_harness`): evidence top-1 / MRR, deletion and
insertion AOPC, ABPC, sink share and cost, with and without the attention sink, and paired
differences against a reference method. ``sst2`` (``--data`` a TSV or parquet file with
``sentence`` and ``label`` columns) runs the classifier harness
(:class:`~captum_normattr.evaluation.FaithfulnessHarness`) on a sequence classifier.

Module-level imports are argparse only, so ``evaluate --help`` does not import torch.

Examples (shell)::

    captum-normattr evaluate --task sva --methods alti-logit,decompx,ig:16,saliency --items 200 -o out.json
    captum-normattr evaluate --model DIR --task jsonl --data items.jsonl --methods alti-logit,ig:8 \
        --markdown table.md --plot curves.png
    captum-normattr evaluate --model SST2_DIR --task sst2 --data sst2/validation.tsv --methods globenc,alti,saliency
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, List, Optional, Sequence

__all__ = ["DECODER_TASKS", "EvaluateError", "build_parser", "classifier_methods", "evaluate_main", "run_decoder", "run_sst2"]

PROG = "captum-normattr evaluate"
DECODER_TASKS = ("sva", "ioi", "facts", "induction")


class EvaluateError(Exception):
    r"""A usage error: printed as ``captum-normattr evaluate: error: ...``, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    r"""The argument parser of ``captum-normattr evaluate``."""
    p = argparse.ArgumentParser(
        prog=PROG, description="Compare attribution methods on a model and a task: faithfulness (deletion / insertion "
        "AOPC, ABPC), plausibility (evidence top-1, MRR), the attention-sink rule and the cost (docs/evaluation.md).")
    p.add_argument("--model", default=None, help="model folder or Hub name (default: the packaged SmolLM2-135M for "
                   "decoder tasks, the packaged MiniLM for sst2)")
    p.add_argument("--task", default="sva", help="comma-separated: sva, ioi, facts, induction (generated), jsonl "
                   "(--data FILE) or sst2 (--data FILE, a sequence classifier)")
    p.add_argument("--data", default=None, help="the items of --task jsonl (one JSON object per line: prompt, target, "
                   "foil, evidence) or the SST-2 TSV / parquet file of --task sst2")
    p.add_argument("--methods", default="alti-logit,decompx,ig:16,saliency,random",
                   help="comma-separated method specs: alti-logit, decompx, alti, globenc, value-zeroing, saliency, ixg, "
                        "ig:N, ablation, attention, rollout, random, and the competitors attnlrp (needs lxt), "
                        "llm-ablation, llm-lig:N (sst2: the classifier baselines, see docs)")
    p.add_argument("--items", type=int, default=100, help="items per task the model gets right (default 100)")
    p.add_argument("--candidates", type=int, default=None,
                   help="generated candidates per task (default 2 x --items)")
    p.add_argument("--no-filter", action="store_true",
                   help="keep the items the model gets wrong too (jsonl; the generated tasks are always filtered)")
    p.add_argument("--seed", type=int, default=0, help="the generators' seed and the items' seeds (default 0)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="curve steps: tokens deleted / kept (default 1 2 3)")
    p.add_argument("--cost-every", type=int, default=1, help="time the cost on every n-th item (default 1)")
    p.add_argument("--max-seconds", type=float, default=float("inf"), help="stop after whole rounds past this time")
    p.add_argument("--reference", default=None, help="the method of the paired differences (default: the last IG, "
                   "else the first method)")
    p.add_argument("--exclude-sink", action="store_true",
                   help="report only the metrics without the sink (position 0 never ranked nor removed)")
    p.add_argument("--add-special-tokens", action="store_true", help="tokenize --data prompts with the tokenizer's "
                   "special tokens (BOS)")
    p.add_argument("-o", "--output", default=None, help="write the JSON results here")
    p.add_argument("--markdown", default=None, metavar="FILE", help="write the Markdown tables here ('-': print them)")
    p.add_argument("--plot", default=None, metavar="FILE", help="plot the deletion curves here (PNG, PDF; needs matplotlib)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a model folder's own code (only code you trust)")
    return p


def _load_decoder(args: argparse.Namespace) -> Any:
    from captum_normattr.cli.common import is_decoder, load_model, resolve_device

    dev = resolve_device(args.device)
    if args.model is None:
        from captum_normattr.models.loading import load_default_model

        try:
            model, tok = load_default_model("decoder", attn_implementation="eager")
        except ImportError as err:
            raise EvaluateError(str(err)) from None
        return model.to(dev).eval(), tok, "SmolLM2-135M-Instruct (packaged)"
    model, tok, name = load_model(args.model, dev, args.trust_remote_code)
    if not is_decoder(model) or not callable(getattr(model, "get_output_embeddings", None)) \
            or model.get_output_embeddings() is None:
        raise EvaluateError(f"model {args.model!r} is not a causal LM with an LM head; decoder tasks need one "
                            "(--task sst2 takes a sequence classifier)")
    return model, tok, name


def run_decoder(args: argparse.Namespace, tasks: Sequence[str], log: Any = None) -> Any:
    r"""Run the decoder harness for the parsed arguments.

    Args:
        args: :func:`build_parser`'s namespace.
        tasks: decoder task names (``jsonl`` reads ``args.data``).
        log: a callable taking a progress line (default: stderr).

    Returns:
        The :class:`~captum_normattr.evaluation.decoder_harness_report.DecoderResult`.
    """
    import torch

    from captum_normattr.evaluation.decoder_harness import TaskState, keep_correct, make_attributors, run_round_robin
    from captum_normattr.evaluation.decoder_harness_report import DecoderResult
    from captum_normattr.evaluation.decoder_tasks import load_jsonl_task, make_task

    log = log or (lambda msg: print(f"{PROG}: {msg}", file=sys.stderr))
    torch.manual_seed(args.seed)
    model, tok, name = _load_decoder(args)
    try:
        methods = make_attributors(args.methods, model, tokenizer=tok)
    except ValueError as err:
        raise EvaluateError(str(err)) from None
    if not methods:
        raise EvaluateError("--methods names no method")
    states: List[TaskState] = []
    for task in tasks:
        if task == "jsonl":
            try:
                cand = load_jsonl_task(args.data, tok, add_special_tokens=args.add_special_tokens)
            except (OSError, ValueError) as err:
                raise EvaluateError(f"--data {args.data}: {err}") from None
            kept = list(cand) if args.no_filter else keep_correct(model, cand, "jsonl")
        else:
            cand = make_task(task, tok, args.candidates or 2 * args.items, seed=args.seed)
            kept = keep_correct(model, cand, task, tok)
        st = TaskState(task, len(cand), kept[: args.items])
        st.correct = len(kept)
        states.append(st)
        log(f"{task}: {len(kept)} of {len(cand)} items {'kept' if args.no_filter else 'right'}; evaluating {len(st.items)}")
    if not any(st.items for st in states):
        raise EvaluateError("no item left to evaluate (the model gets none right; --no-filter keeps them for jsonl)")
    def progress(n_round: int) -> None:
        log(f"round {n_round}: " + ", ".join(f"{st.name} {st.done}/{len(st.items)}" for st in states))

    run_round_robin(model, states, methods, args.ks, cost_every=args.cost_every, total_seconds=args.max_seconds,
                    save_every=10, on_save=progress, log=log, curves=True)
    return DecoderResult.from_states(states, tokenizer=tok, model=name, seed=args.seed, ks=list(args.ks),
                                     methods=list(methods), cost_every=args.cost_every)


def classifier_methods(clf: Any, specs: str) -> List[Any]:
    r"""Classifier-harness methods (:mod:`captum_normattr.evaluation.baselines`) from comma-separated specs.

    ``globenc``, ``alti``, ``ff``, ``decompx`` (this package), ``saliency`` (L2), ``ixg`` (summed),
    ``ig:N`` (LayerIntegratedGradients, N steps, summed) and ``default`` (the Captum baselines of
    the faithfulness tables).

    Raises:
        EvaluateError: for an unknown spec.
    """
    from captum_normattr.evaluation import baselines

    out: List[Any] = []
    for spec in [s.strip().lower() for s in specs.split(",") if s.strip()]:
        if spec in ("globenc", "alti", "ff", "decompx"):
            out.append(baselines.ours(clf.model, spec))
        elif spec == "saliency":
            out.append(baselines.saliency(clf))
        elif spec in ("ixg", "inputxgradient"):
            out.append(baselines.input_x_gradient(clf, "sum"))
        elif spec == "ig" or spec.startswith("ig:"):
            out.append(baselines.integrated_gradients(clf, n_steps=int(spec[3:]) if len(spec) > 3 else 16))
        elif spec == "default":
            out.extend(baselines.default_baselines(clf))
        else:
            raise EvaluateError(f"unknown method {spec!r} for sst2; known: globenc, alti, ff, decompx, saliency, ixg, "
                                "ig:N, default")
    return out


def run_sst2(args: argparse.Namespace, log: Any = None) -> Any:
    r"""Run the classifier harness on SST-2 sentences (``args.data``: TSV or parquet, ``sentence`` and ``label``).

    The presets are ERASER AOPC and DecompX's [MASK] AOPC (docs/design.md, section 15).

    Returns:
        The :class:`~captum_normattr.evaluation.harness.HarnessResult`.
    """
    from captum_normattr.cli.common import load_model, resolve_device
    from captum_normattr.evaluation import FaithfulnessHarness, SequenceClassifier
    from captum_normattr.evaluation.decoder_tasks import load_sst2

    log = log or (lambda msg: print(f"{PROG}: {msg}", file=sys.stderr))
    if not args.data:
        raise EvaluateError("--task sst2 needs --data FILE (a TSV or parquet file with sentence and label columns)")
    try:
        sentences, labels = load_sst2(args.data, args.items, seed=args.seed)
    except (OSError, ValueError, ImportError) as err:
        raise EvaluateError(f"--data {args.data}: {err}") from None
    model, tok, name = load_model(args.model, resolve_device(args.device), args.trust_remote_code)
    if not type(model).__name__.endswith("ForSequenceClassification"):
        raise EvaluateError(f"model {name!r} is not a sequence classifier; --task sst2 needs one")
    clf = SequenceClassifier(model, tok)
    methods = classifier_methods(clf, args.methods)
    log(f"sst2: {len(sentences)} sentences, methods {', '.join(m.name for m in methods)}")
    harness = FaithfulnessHarness(clf, methods, presets=["eraser_aopc", "decompx_mask"], progress=False,
                                  seed=args.seed)
    return harness.run_sentences(sentences, labels, tok)


def evaluate_main(argv: Optional[Sequence[str]] = None) -> int:
    r"""Entry point of ``captum-normattr evaluate``.

    Args:
        argv: the arguments after ``evaluate`` (default: ``sys.argv[2:]``).

    Returns:
        0 on success, 2 on a usage error (message on stderr), 130 on Ctrl-C.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[2:] if argv is None else argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    from captum_normattr.cli.common import CLIError, write_output

    try:
        tasks = [t.strip().lower() for t in args.task.split(",") if t.strip()]
        bad = [t for t in tasks if t not in DECODER_TASKS + ("jsonl", "sst2")]
        if bad or not tasks:
            raise EvaluateError(f"unknown task(s) {bad or args.task!r}; choose from {', '.join(DECODER_TASKS)}, jsonl, sst2")
        if "jsonl" in tasks and not args.data:
            raise EvaluateError("--task jsonl needs --data FILE (one JSON object per line, docs/evaluation.md)")
        if "sst2" in tasks and len(tasks) > 1:
            raise EvaluateError("--task sst2 runs alone (a sequence classifier, not a causal LM)")
        if args.items < 1 or args.cost_every < 1 or any(k < 1 for k in args.ks):
            raise EvaluateError("--items, --cost-every and --ks take positive integers")
        if tasks == ["sst2"]:
            res = run_sst2(args)
            if args.output:
                res.to_json(args.output)
            md = res.table()
            if args.plot:
                print(f"{PROG}: --plot draws decoder deletion curves; ignored for sst2", file=sys.stderr)
        else:
            res = run_decoder(args, tasks)
            if args.output:
                res.to_json(args.output)
            md = res.markdown(reference=args.reference, exclude_sink_only=args.exclude_sink)
            if args.plot:
                res.plot(args.plot, exclude_sink=True)
        if args.markdown == "-" or not (args.markdown or args.output):
            print(md)
        elif args.markdown:
            write_output(md, args.markdown)
        return 0
    except (EvaluateError, CLIError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(evaluate_main(sys.argv[1:]))
