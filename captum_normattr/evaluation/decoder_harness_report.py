r"""Results of the decoder harness: JSON, a Markdown table with paired differences, and deletion-curve plots.

:class:`DecoderResult` gathers the evaluated tasks (:class:`~captum_normattr.evaluation.decoder_harness.TaskState`)
and writes what a paper or a method choice needs (docs/evaluation.md, "Compare methods on your model"):

- :meth:`DecoderResult.to_json`: per task, every method's mean ± s.e. of every metric and the
  per-item values of the main ones (:data:`~captum_normattr.evaluation.decoder_harness.PER_ITEM`);
- :meth:`DecoderResult.markdown`: per task a table of the metrics with the sink ranked and
  without it, then the paired differences of every method against a reference method (mean ±
  s.e. of the per-item differences and on how many items it is ahead);
- :meth:`DecoderResult.plot`: the mean deletion curves (most- and least-relevant-first), one panel
  per task (matplotlib, imported only here).

Examples:
    >>> res = DecoderResult.from_states(states, model="SmolLM2-135M")  # doctest: +SKIP
    >>> print(res.markdown(reference="IG-16"))  # doctest: +SKIP
    >>> res.to_json("out.json"); res.plot("curves.png")  # doctest: +SKIP
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .decoder_harness import PER_ITEM, TaskState
from .statistics import format_mean_se, mean_se, median

__all__ = ["DecoderResult", "TABLE_COLUMNS", "PAIRED_METRICS", "paired_rows"]

#: The columns of :meth:`DecoderResult.markdown`: (metric, header).
TABLE_COLUMNS = [
    ("top1_with_sink", "top-1 (sink ranked)"), ("top1_no_sink", "top-1 (no sink)"),
    ("mrr_with_sink", "MRR (sink ranked)"), ("mrr_no_sink", "MRR (no sink)"),
    ("deletion_aopc_with_sink", "deletion AOPC (sink removable)"), ("deletion_aopc_no_sink", "deletion AOPC (no sink)"),
    ("insertion_aopc_with_sink", "insertion AOPC (sink removable)"), ("insertion_aopc_no_sink", "insertion AOPC (no sink)"),
    ("abpc_with_sink", "ABPC (sink removable)"), ("abpc_no_sink", "ABPC (no sink)"),
    ("sink_share", "sink share"), ("cost_forwards", "× forward"),
]

#: The metrics compared pairwise against the reference method.
PAIRED_METRICS = ["deletion_aopc_no_sink", "deletion_aopc_with_sink", "abpc_no_sink", "abpc_with_sink"]


def paired_rows(per_item: Mapping[str, Mapping[str, Sequence[float]]], reference: str,
                metrics: Sequence[str] = PAIRED_METRICS) -> Dict[str, Dict[str, Dict[str, float]]]:
    r"""Every method against ``reference`` on the same items: the mean ± s.e. of the differences, the median and wins.

    Args:
        per_item: method -> metric -> per-item values (the same items, in order).
        reference: the reference method.
        metrics: the metrics compared.

    Returns:
        method -> metric -> ``{"mean", "se", "n", "median", "wins"}`` (wins: items where the
        method is strictly above the reference); the reference and methods without the metric left out.
    """
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    ref = per_item.get(reference, {})
    for m, rec in per_item.items():
        if m == reference:
            continue
        for k in metrics:
            if k in rec and k in ref and len(rec[k]) == len(ref[k]) and rec[k]:
                diff = [a - b for a, b in zip(rec[k], ref[k])]
                out.setdefault(m, {})[k] = {**mean_se(diff), "median": median(diff), "wins": sum(x > 0 for x in diff)}
    return out


class DecoderResult:
    r"""The harness's results on one model: tasks, methods, summaries and per-item values.

    Args:
        tasks: task name -> ``{"candidates", "correct", "evaluated", "methods": {method: {metric:
            mean_se}}, "per_item": {method: {metric: [values]}}, "curves": {method: {metric: mean}}}``
            (what :meth:`from_states` builds; ``from_json`` reads it back).
        meta: free-form run information (model, seed, arguments).
    """

    def __init__(self, tasks: Dict[str, Dict[str, Any]], meta: Optional[Dict[str, Any]] = None) -> None:
        self.tasks = tasks
        self.meta = dict(meta or {})

    @classmethod
    def from_states(cls, states: Sequence[TaskState], per_item: Sequence[str] = PER_ITEM, tokenizer: Any = None,
                    **meta: Any) -> "DecoderResult":
        r"""The result of evaluated tasks.

        Args:
            states: the tasks (:func:`~captum_normattr.evaluation.decoder_harness.run_round_robin` filled them).
            per_item: the metrics whose per-item values are kept.
            tokenizer: decodes the items' target and foil tokens into the JSON (optional).
            **meta: run information kept in the JSON (model, seed, ...).

        Returns:
            The :class:`DecoderResult` (tasks with no evaluated item left out).
        """
        tasks: Dict[str, Dict[str, Any]] = {}
        for st in states:
            if not st.done:
                continue
            summary = st.summary()
            curves = {m: {k: v["mean"] for k, v in rec.items() if k.split("_")[0] in ("morf", "lerf", "ins", "logit")}
                      for m, rec in summary.items()}
            items = []
            for it in st.items[: st.done]:
                row: Dict[str, Any] = {"text": it.text, "target": it.target, "foil": it.foil, "evidence": it.evidence}
                if tokenizer is not None:
                    row["target_text"] = tokenizer.decode([it.target])
                    row["foil_text"] = tokenizer.decode([it.foil]) if it.foil is not None else None
                items.append(row)
            tasks[st.name] = {
                "candidates": st.candidates, "correct": st.correct, "evaluated": st.done,
                "methods": {m: {k: v for k, v in rec.items() if k not in curves[m]} for m, rec in summary.items()},
                "curves": {m: c for m, c in curves.items() if c},
                "per_item": {m: {k: [round(x, 6) for x in v] for k, v in rec.items() if k in per_item}
                             for m, rec in st.values.items()},
                "items": items,
            }
        return cls(tasks, meta)

    @property
    def methods(self) -> List[str]:
        r"""The methods, in the order of the first task that has them."""
        out: List[str] = []
        for t in self.tasks.values():
            out.extend(m for m in t["methods"] if m not in out)
        return out

    def to_dict(self) -> Dict[str, Any]:
        r"""``{"meta", "tasks"}`` (JSON-ready)."""
        return {"meta": self.meta, "tasks": self.tasks}

    def to_json(self, path: Optional[str] = None) -> str:
        r"""The JSON text; written to ``path`` too (atomically: a reader never sees half a file) when given."""
        text = json.dumps(self.to_dict(), indent=1, default=str)
        if path:
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        return text

    @classmethod
    def from_json(cls, text_or_path: str) -> "DecoderResult":
        r"""Read :meth:`to_json`'s output (a path or the text)."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path, encoding="utf-8") as fh:
                text = fh.read()
        data = json.loads(text)
        return cls(data["tasks"], data.get("meta"))

    def markdown(self, reference: Optional[str] = None, exclude_sink_only: bool = False,
                 paired_metrics: Sequence[str] = PAIRED_METRICS) -> str:
        r"""Per task: the metrics table (mean ± s.e.), then the paired differences against ``reference``.

        Args:
            reference: the method the others are compared with (default: the last method whose
                name starts with ``IG``, else the first method). None of the items -> no paired table.
            exclude_sink_only: show only the columns without the sink (plus sink share and cost).
            paired_metrics: the metrics of the paired table.

        Returns:
            The Markdown text.
        """
        methods = self.methods
        if reference is None:
            igs = [m for m in methods if m.startswith("IG")]
            reference = igs[-1] if igs else (methods[0] if methods else None)
        cols = [c for c in TABLE_COLUMNS if not (exclude_sink_only and c[0].endswith("_with_sink"))]
        if exclude_sink_only:
            paired_metrics = [m for m in paired_metrics if not m.endswith("_with_sink")]
        out: List[str] = []
        for task, t in self.tasks.items():
            present = [(k, h) for k, h in cols if any(k in r for r in t["methods"].values())]
            out.append(f"\n### {task}: {t['evaluated']} items (of {t['correct']} right among {t['candidates']} candidates)\n")
            out.append("| method | " + " | ".join(h for _, h in present) + " |")
            out.append("|---|" + "---:|" * len(present))
            for m, r in t["methods"].items():
                out.append(f"| {m} | " + " | ".join(format_mean_se(r[k]) if k in r else "—" for k, _ in present) + " |")
            rows = paired_rows(t.get("per_item", {}), reference, paired_metrics) if reference else {}
            shown = [k for k in paired_metrics if any(k in r for r in rows.values())]
            if rows and shown:
                out.append(f"\nPaired differences against {reference} (method − {reference} on the same items: "
                           "mean ± s.e., median; items where the method is ahead):\n")
                headers = dict(TABLE_COLUMNS)
                out.append("| method | " + " | ".join(headers.get(k, k) for k in shown) + " |")
                out.append("|---|" + "---:|" * len(shown))
                for m, rec in rows.items():
                    cells = [f"{format_mean_se(rec[k])}, median {rec[k]['median']:.3f}; {rec[k]['wins']}/{rec[k]['n']}"
                             if k in rec else "—" for k in shown]
                    out.append(f"| {m} | " + " | ".join(cells) + " |")
        return "\n".join(out).lstrip("\n") + "\n"

    def plot(self, path: Optional[str] = None, exclude_sink: bool = True) -> Any:
        r"""The mean deletion curves of every method, one panel per task (needs ``curves=True`` in the run).

        Solid: most-relevant-first (d after deleting the top k, over |d|); dashed: least-relevant-first.
        The area between a method's two curves is its ABPC.

        Args:
            path: save the figure there (PNG, PDF, ... by the extension).
            exclude_sink: plot the curves without the sink (else with it).

        Returns:
            The matplotlib figure.

        Raises:
            ValueError: when no task kept its curve points.
        """
        import matplotlib

        if path is not None and os.environ.get("MPLBACKEND") is None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tag = "no_sink" if exclude_sink else "with_sink"
        tasks = [(name, t) for name, t in self.tasks.items() if t.get("curves")]
        if not tasks:
            raise ValueError("no curve points: run the harness with curves=True (the CLI does with --plot)")
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
        for ax, (name, t) in zip(axes[0], tasks):
            for i, (m, c) in enumerate(t["curves"].items()):
                ks = sorted({int(k.split("_")[1]) for k in c if k.startswith("morf_") and k.endswith(tag)})
                if not ks:
                    continue
                start = c.get("logit_sign", 1.0)
                color = f"C{i % 10}"
                ax.plot([0] + ks, [start] + [c[f"morf_{k}_{tag}"] for k in ks], "-o", color=color, ms=3, label=m)
                ax.plot([0] + ks, [start] + [c[f"lerf_{k}_{tag}"] for k in ks], "--", color=color, lw=1)
                ax.set_xticks([0] + ks)
            ax.set_title(f"{name} ({t['evaluated']} items)")
            ax.set_xlabel("tokens deleted" + (" (sink kept)" if exclude_sink else ""))
            ax.set_ylabel("d / |d|")
            ax.axhline(0, color="0.7", lw=0.5)
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig
