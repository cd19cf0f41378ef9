r"""The comparison harness: many attribution methods, one batch, every faithfulness preset.

Usage::

    from captum_normattr.evaluation import FaithfulnessHarness, SequenceClassifier, baselines

    clf = SequenceClassifier(model, tokenizer)
    methods = baselines.default_baselines(clf) + [baselines.globenc(model, "N_ENC"), baselines.alti(model)]
    harness = FaithfulnessHarness(clf, methods, presets="all", batch_size=16)
    result = harness.run_sentences(sentences, labels, tokenizer)
    print(result.table())
    result.to_json("faithfulness.json")

Every preset names the convention it implements (docs/design.md, section 15, faithfulness); the target each
method is asked to explain is the preset's (gold label for the GlobEnc Spearman protocol,
predicted class for the AOPC protocols and Captum's metrics). Target-independent methods
(``Method.uses_target=False``) are called once per batch; target-dependent ones are
called with the predicted class, and again with the gold label only for the rows where
the two differ. The time per example is that of the first call (the predicted-class one)
and the cost is its ratio to one no-grad forward pass of the same padded batch, measured
in the same run.

It is over 700 lines because the harness keeps the protocol, the presets and their reports together: splitting them would scatter one comparison over several files.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import metrics as M
from .baselines import Method, gradient_x_input_embedding_output
from .classifier import SequenceClassifier
from ..progress import progress_iter

__all__ = [
    "MetricInfo",
    "Preset",
    "SpearmanGradXInput",
    "EraserAOPC",
    "DecompXMaskAOPC",
    "CaptumInfidelity",
    "CaptumSensitivity",
    "PRESETS",
    "make_presets",
    "BatchContext",
    "FaithfulnessHarness",
    "HarnessResult",
    "encode",
]


@dataclass(frozen=True)
class MetricInfo:
    r"""A column of the result: key, table label, direction, preset that produces it."""

    key: str
    label: str
    higher_is_better: bool
    preset: str


# ----------------------------------------------------------------------------- context
class BatchContext:
    r"""What the presets of one batch share: inputs, predictions, cached scores and references."""

    def __init__(
        self,
        clf: SequenceClassifier,
        input_ids: Tensor,
        attention_mask: Tensor,
        labels: Optional[Tensor],
        logits: Tensor,
        index: Tensor,
        batch_index: int,
        seed: int,
        max_batch: Optional[int],
    ) -> None:
        self.clf = clf
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.labels = labels
        self.logits = logits
        self.predicted = logits.argmax(-1)
        self.index = index  # (B,) positions of these rows in the whole data set
        self.batch_index = batch_index
        self.seed = seed
        self.max_batch = max_batch
        self.special_mask = clf.special_mask(input_ids, attention_mask)
        self._scores: Dict[Tuple[str, str], Tensor] = {}
        self._refs: Dict[str, Tensor] = {}
        self.timings: Dict[str, float] = {}

    def target(self, kind: str) -> Tensor:
        if kind == "predicted" or self.labels is None:
            return self.predicted
        if kind == "gold":
            return self.labels
        raise ValueError(f"target kind must be 'gold' or 'predicted', got {kind!r}")

    def scores(self, method: Method, kind: str) -> Tensor:
        r"""Scores of ``method`` for target ``kind``, computed at most once per batch."""
        key = (method.name, "any" if not method.uses_target else kind)
        if key in self._scores:
            return self._scores[key]
        if not method.uses_target or kind == "predicted" or self.labels is None:
            t0 = time.perf_counter()
            s = method(self.input_ids, self.attention_mask, self.predicted)
            elapsed = time.perf_counter() - t0
            shared = method.info.get("_cost")  # methods sharing one computation report its time
            self.timings[method.name] = shared.seconds if shared is not None else elapsed
        else:
            base = self.scores(method, "predicted")
            differ = self.labels != self.predicted
            s = base.clone()
            if differ.any():
                rows = torch.nonzero(differ).view(-1)
                ids, mask = M.trim_pad_columns(self.input_ids[rows], self.attention_mask[rows])
                sub = method(ids, mask, self.labels[rows])
                s[rows] = 0.0
                s[rows, : sub.shape[1]] = sub.to(s.dtype)
        self._scores[key] = s
        return s

    def reference(self, name: str, fn: Callable[[], Tensor]) -> Tensor:
        if name not in self._refs:
            self._refs[name] = fn().detach()
        return self._refs[name]


# ----------------------------------------------------------------------------- presets
class Preset:
    r"""A named faithfulness convention. Subclasses define ``metrics`` and ``compute``.

    Args:
        name: the preset's name in results.
        target: ``"gold"`` or ``"predicted"``: which class the methods explain.
        methods: optional set of method names to restrict the (costly) preset to.
        max_examples: optional; compute only for the first ``max_examples`` examples of
            the data set (data-set order, not batch order); the others get NaN.
    """

    name: str = "preset"
    target: str = "predicted"
    convention: str = ""

    def __init__(self, name: Optional[str] = None, target: Optional[str] = None,
                 methods: Optional[Iterable[str]] = None, max_examples: Optional[int] = None) -> None:
        if name is not None:
            self.name = name
        if target is not None:
            if target not in ("gold", "predicted"):
                raise ValueError(f"target must be 'gold' or 'predicted', got {target!r}")
            self.target = target
        self.methods = None if methods is None else set(methods)
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"max_examples must be >= 1, got {max_examples}")
        self.max_examples = max_examples

    @property
    def metrics(self) -> Tuple[MetricInfo, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def applies_to(self, method: Method) -> bool:
        r"""Whether this preset scores ``method`` (see ``methods``)."""
        return self.methods is None or method.name in self.methods

    def rows(self, ctx: BatchContext) -> Tensor:
        if self.max_examples is None:
            return torch.ones_like(ctx.index, dtype=torch.bool)
        return ctx.index < self.max_examples

    def compute(self, ctx: BatchContext, method: Method) -> Dict[str, Tensor]:  # pragma: no cover
        raise NotImplementedError

    def config(self) -> dict:
        out = {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(self).items() if not k.startswith("_")}
        out.update({"name": self.name, "target": self.target, "convention": self.convention})
        return out


class SpearmanGradXInput(Preset):
    r"""GlobEnc protocol: Spearman with gradient x input, per example.

    Reference: gradient of the target logit (gold label by default) w.r.t. the
    embedding-block output (after its LayerNorm) times that output, L2 over features
    (:func:`~captum_normattr.evaluation.baselines.gradient_x_input_embedding_output`).
    Correlation over all positions including [CLS]/[SEP], pads excluded; reported as
    mean and std over examples.
    """

    name = "globenc_spearman"
    target = "gold"
    convention = "Spearman rho with grad x input (embedding output, L2, gold label), all positions incl. special tokens"

    @property
    def metrics(self):
        return (MetricInfo("spearman", "Spearman vs GxI", True, self.name),)

    def compute(self, ctx, method):
        tgt = ctx.target(self.target)
        ref = ctx.reference(
            f"gxi_{self.target}",
            lambda: gradient_x_input_embedding_output(ctx.clf, "l2")(ctx.input_ids, ctx.attention_mask, tgt),
        )
        s = ctx.scores(method, self.target)
        return {"spearman": M.spearman_per_example(s, ref, ctx.attention_mask)}


class EraserAOPC(Preset):
    r"""ERASER comprehensiveness / sufficiency (ALTI paper protocol), see :func:`metrics.eraser_aopc`.

    Args:
        percents: k values in %, default (0, 1, 5, 10, 20, 50) (the bins and k = 0).
        rounding: rounding of k% of the tokens.
        **kwargs: :class:`Preset` arguments.
    """

    name = "eraser_aopc"
    target = "predicted"
    convention = ("ERASER AOPC: delete / keep only the top k% non-special tokens, k in {0,1,5,10,20,50}, "
                  "special tokens kept, predicted-class probability, mean over k")

    def __init__(self, percents: Sequence[float] = (0, 1, 5, 10, 20, 50), rounding: str = "ceil", **kwargs) -> None:
        super().__init__(**kwargs)
        self.percents = tuple(float(k) for k in percents)
        M.check_percents(self.percents, allow_zero=True)
        self.rounding = rounding

    @property
    def metrics(self):
        return (
            MetricInfo("eraser_comp", "ERASER comp.", True, self.name),
            MetricInfo("eraser_suff", "ERASER suff.", False, self.name),
        )

    def compute(self, ctx, method):
        r = M.eraser_aopc(
            ctx.clf.logits, ctx.input_ids, ctx.attention_mask, ctx.scores(method, self.target), ctx.special_mask,
            percents=self.percents, rounding=self.rounding, pad_token_id=ctx.clf.pad_token_id,
            target=ctx.target(self.target), max_batch=ctx.max_batch,
        )
        return {"eraser_comp": r["comprehensiveness"], "eraser_suff": r["sufficiency"]}


class DecompXMaskAOPC(Preset):
    r"""DecompX: top K% non-special tokens replaced by [MASK], K = 10..90; AOPC and accuracy.

    Args:
        percents: K values, default 10, 20, ..., 90.
        rounding: rounding of K% of the tokens.
        **kwargs: :class:`Preset` arguments.
    """

    name = "decompx_mask"
    target = "predicted"
    convention = ("DecompX: replace the top K% non-special tokens by [MASK], K = 10..90; "
                  "AOPC of the predicted class and accuracy vs gold, mean over K")

    def __init__(self, percents: Sequence[float] = tuple(range(10, 100, 10)), rounding: str = "ceil", **kwargs) -> None:
        super().__init__(**kwargs)
        self.percents = tuple(float(k) for k in percents)
        M.check_percents(self.percents, allow_zero=False)
        self.rounding = rounding

    @property
    def metrics(self):
        return (
            MetricInfo("mask_aopc", "[MASK] AOPC", True, self.name),
            MetricInfo("mask_acc", "[MASK] acc.", False, self.name),
        )

    def compute(self, ctx, method):
        r = M.mask_aopc(
            ctx.clf.logits, ctx.input_ids, ctx.attention_mask, ctx.scores(method, self.target), ctx.special_mask,
            ctx.labels, mask_token_id=ctx.clf.require_mask_token(), percents=self.percents,
            rounding=self.rounding, target=ctx.target(self.target), max_batch=ctx.max_batch,
        )
        out = {"mask_aopc": r["aopc"]}
        out["mask_acc"] = r["accuracy"] if "accuracy" in r else torch.full_like(r["aopc"], float("nan"))
        return out


class CaptumInfidelity(Preset):
    r"""Captum ``infidelity`` through a token-presence gate, see :func:`metrics.token_presence_infidelity`.

    Args:
        n_perturb_samples: random token-drop perturbations per example.
        drop_prob: drop probability of each non-special token.
        normalize: Captum's ``normalize`` (scale-invariant; default True).
        **kwargs: :class:`Preset` arguments.
    """

    name = "captum_infidelity"
    target = "predicted"
    convention = ("Captum infidelity (normalize=True) on the predicted-class logit; input = token-presence gate "
                  "mixing word and [MASK] embeddings; perturbation drops each non-special token w.p. drop_prob")

    def __init__(self, n_perturb_samples: int = 10, drop_prob: float = 0.25, normalize: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n_perturb_samples = int(n_perturb_samples)
        self.drop_prob = float(drop_prob)
        self.normalize = bool(normalize)

    @property
    def metrics(self):
        return (MetricInfo("infidelity", "infidelity", False, self.name),)

    def compute(self, ctx, method):
        clf = ctx.clf
        rep = clf.mask_token_id if clf.mask_token_id is not None else clf.pad_token_id
        v = M.token_presence_infidelity(
            clf.logits_from_embeds, clf.embed, ctx.input_ids, ctx.attention_mask,
            ctx.scores(method, self.target).to(clf.dtype), ctx.special_mask, ctx.target(self.target),
            replacement_id=rep, n_perturb_samples=self.n_perturb_samples, drop_prob=self.drop_prob,
            normalize=self.normalize, seed=ctx.seed + 7919 * ctx.batch_index,
            max_examples_per_batch=ctx.max_batch,
        )
        return {"infidelity": v.double()}


class CaptumSensitivity(Preset):
    r"""Captum ``sensitivity_max`` under [MASK] substitution, see :func:`metrics.token_substitution_sensitivity`.

    Costs ``n_perturb_samples`` extra method calls per example: restrict it with
    ``max_examples`` / ``methods`` on long runs.

    Args:
        n_perturb_samples: perturbations per example.
        n_substitutions: tokens replaced per perturbation.
        **kwargs: :class:`Preset` arguments.
    """

    name = "captum_sensitivity"
    target = "predicted"
    convention = ("Captum sensitivity_max (Frobenius, relative to ||s(x)||); perturbation replaces "
                  "n_substitutions random non-special tokens by [MASK]")

    def __init__(self, n_perturb_samples: int = 5, n_substitutions: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n_perturb_samples = int(n_perturb_samples)
        self.n_substitutions = int(n_substitutions)

    @property
    def metrics(self):
        return (MetricInfo("sensitivity_max", "sensitivity max", False, self.name),)

    def compute(self, ctx, method):
        clf = ctx.clf
        rows = self.rows(ctx)
        out = torch.full((ctx.input_ids.shape[0],), float("nan"), dtype=torch.float64)
        if not rows.any():
            return {"sensitivity_max": out}
        idx = torch.nonzero(rows).view(-1)
        ids, mask = M.trim_pad_columns(ctx.input_ids[idx], ctx.attention_mask[idx])
        rep = clf.mask_token_id if clf.mask_token_id is not None else clf.pad_token_id
        v = M.token_substitution_sensitivity(
            method, ids, mask, clf.special_mask(ids, mask), ctx.target(self.target)[idx],
            replacement_id=rep, n_perturb_samples=self.n_perturb_samples, n_substitutions=self.n_substitutions,
            seed=ctx.seed + 104729 * ctx.batch_index,
            max_examples_per_batch=None if ctx.max_batch is None else max(ctx.max_batch, len(idx)),
        )
        out[idx] = v.double().cpu()
        return {"sensitivity_max": out}


PRESETS: Dict[str, type] = {
    "globenc_spearman": SpearmanGradXInput,
    "eraser_aopc": EraserAOPC,
    "decompx_mask": DecompXMaskAOPC,
    "captum_infidelity": CaptumInfidelity,
    "captum_sensitivity": CaptumSensitivity,
}


def make_presets(presets: Union[str, Sequence[Union[str, Preset]]] = "all") -> List[Preset]:
    r"""Preset objects from names (``"all"`` = every preset in :data:`PRESETS`) or objects.

    Examples:
        >>> [p.name for p in make_presets(["eraser_aopc", DecompXMaskAOPC(percents=[50])])]
        ['eraser_aopc', 'decompx_mask']
    """
    if presets is None:
        return []
    if isinstance(presets, str):
        presets = list(PRESETS) if presets == "all" else [presets]
    out: List[Preset] = []
    for p in presets:
        if isinstance(p, Preset):
            out.append(p)
        elif isinstance(p, str):
            if p not in PRESETS:
                raise ValueError(f"unknown preset {p!r}; known: {sorted(PRESETS)}")
            out.append(PRESETS[p]())
        else:
            raise TypeError(f"a preset is a name or a Preset object, got {type(p).__name__}")
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise ValueError(f"preset names must be unique, got {names}")
    keys = [m.key for p in out for m in p.metrics]
    if len(set(keys)) != len(keys):
        raise ValueError(f"two presets produce the same metric keys: {keys}")
    return out


# ------------------------------------------------------------------------------ result
def _nan_stats(values: Sequence[float]) -> dict:
    xs = [v for v in values if v is not None and not math.isnan(v)]
    n = len(xs)
    if n == 0:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "n": n}


@dataclass
class HarnessResult:
    r"""Per-example metric values of every method, timings, and the conventions used.

    Attributes:
        methods: method names, in run order.
        metrics: the metric columns (:class:`MetricInfo`).
        per_example: ``per_example[method][metric_key]`` = list of floats in data-set
            order (NaN where not computed or undefined).
        seconds_per_example: wall time of one attribution call per example, per method.
        forward_seconds_per_example: one no-grad forward pass per example, same batches.
        n_examples: examples evaluated.
        accuracy: model accuracy on them (NaN without labels).
        presets: configuration of each preset (name -> dict).
        info: free-form run information (batch size, torch version, ...).
    """

    methods: List[str]
    metrics: List[MetricInfo]
    per_example: Dict[str, Dict[str, List[float]]]
    seconds_per_example: Dict[str, float]
    forward_seconds_per_example: float
    n_examples: int
    accuracy: float
    presets: Dict[str, dict] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def cost_vs_forward(self, method: str) -> float:
        r"""Cost of one attribution call relative to one forward pass (same batches, same run)."""
        f = self.forward_seconds_per_example
        return self.seconds_per_example[method] / f if f > 0 else float("nan")

    def summary(self) -> Dict[str, Dict[str, dict]]:
        r"""``summary()[method][metric] = {"mean", "std", "n"}`` (NaNs skipped; std with ddof=1)."""
        return {
            m: {k.key: _nan_stats(self.per_example[m].get(k.key, [])) for k in self.metrics} for m in self.methods
        }

    def table(self, metrics: Optional[Sequence[str]] = None, std: Union[bool, Sequence[str]] = ("spearman",),
              cost: bool = True, digits: int = 3, title_note: bool = True) -> str:
        r"""A Markdown table: one row per method, one column per metric (mean, optionally +- std).

        Args:
            metrics: metric keys to show (default all).
            std: True/False, or the metric keys to show with their std.
            cost: add the time per example and the cost relative to one forward pass.
            digits: decimals.
            title_note: add a line explaining arrows and n.
        """
        infos = [m for m in self.metrics if metrics is None or m.key in metrics]
        if metrics is not None:
            unknown = set(metrics) - {m.key for m in self.metrics}
            if unknown:
                raise ValueError(f"unknown metric keys {sorted(unknown)}; known: {[m.key for m in self.metrics]}")
        summ = self.summary()
        head = ["method"] + [f"{m.label} {'↑' if m.higher_is_better else '↓'}" for m in infos]
        if cost:
            head += ["ms / example", "× forward"]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        for name in self.methods:
            row = [name]
            for m in infos:
                s = summ[name][m.key]
                show_std = std is True or (not isinstance(std, bool) and m.key in std)
                if s["n"] == 0:
                    row.append("–")
                elif show_std:
                    row.append(f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}")
                else:
                    row.append(f"{s['mean']:.{digits}f}")
            if cost:
                row.append(f"{1000 * self.seconds_per_example[name]:.2f}")
                row.append(f"{self.cost_vs_forward(name):.1f}")
            lines.append("| " + " | ".join(row) + " |")
        if title_note:
            ns = {m.key: max((summ[x][m.key]["n"] for x in self.methods), default=0) for m in infos}
            note = ", ".join(f"{m.key} n={ns[m.key]}" for m in infos)
            lines.append("")
            lines.append(
                f"↑ higher is better, ↓ lower is better; means over examples ({note}); "
                f"forward pass {1000 * self.forward_seconds_per_example:.2f} ms / example; "
                f"model accuracy {self.accuracy:.4f} on {self.n_examples} examples."
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["summary"] = self.summary()
        d["cost_vs_forward"] = {m: self.cost_vs_forward(m) for m in self.methods}
        return d

    def to_json(self, path: Optional[str] = None, indent: int = 1) -> str:
        r"""JSON text of the result (NaN written as null); also written to ``path`` if given."""

        def clean(x):
            if isinstance(x, float):
                return None if math.isnan(x) or math.isinf(x) else x
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [clean(v) for v in x]
            return x

        text = json.dumps(clean(self.to_dict()), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str) -> "HarnessResult":
        r"""Read back :meth:`to_json` output (a JSON string or a file path)."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path, encoding="utf-8") as f:
                text = f.read()
        d = json.loads(text)
        nan = float("nan")
        per_example = {
            m: {k: [nan if v is None else v for v in vs] for k, vs in d["per_example"][m].items()}
            for m in d["per_example"]
        }
        return cls(
            methods=d["methods"],
            metrics=[MetricInfo(**m) for m in d["metrics"]],
            per_example=per_example,
            seconds_per_example=d["seconds_per_example"],
            forward_seconds_per_example=d["forward_seconds_per_example"],
            n_examples=d["n_examples"],
            accuracy=nan if d["accuracy"] is None else d["accuracy"],
            presets=d.get("presets", {}),
            info=d.get("info", {}),
        )


# ----------------------------------------------------------------------------- harness
def encode(tokenizer, sentences: Sequence[str], max_length: int = 128) -> Tuple[Tensor, Tensor]:
    r"""Tokenise sentences into padded ``(input_ids, attention_mask)`` (N, T), right padding.

    Examples:
        >>> ids, mask = encode(tokenizer, ["a fine film", "dull"])  # doctest: +SKIP
    """
    if isinstance(sentences, str):
        raise TypeError("sentences must be a sequence of strings, not one string")
    enc = tokenizer(list(sentences), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


class FaithfulnessHarness:
    r"""Run attribution methods on the same padded batches and score them with every preset.

    Args:
        classifier: a :class:`SequenceClassifier` (or a model, wrapped with ``tokenizer``).
        methods: :class:`Method` objects, or a mapping ``name -> callable`` (plain callables
            are assumed to depend on the target).
        presets: ``"all"``, preset names, or :class:`Preset` objects.
        batch_size: examples per padded batch.
        sort_by_length: batch examples of similar length together (less padding; results
            are reported in the original order).
        max_batch: largest batch given to the model at once by the perturbation metrics
            (None = one call per perturbation set).
        progress: show a progress bar (:func:`captum_normattr.progress.progress_bar`).
        seed: base seed of the random perturbations.
        warmup: call the forward and every method once, untimed, before the run.
        forward_repeats: the forward pass is timed this many times per batch (mean taken).
        tokenizer: used only when ``classifier`` is a bare model.

    Examples:
        >>> harness = FaithfulnessHarness(clf, [baselines.input_x_gradient(clf)], presets=["eraser_aopc"])  # doctest: +SKIP
        >>> res = harness.run(input_ids, attention_mask, labels)  # doctest: +SKIP
        >>> print(res.table())  # doctest: +SKIP
    """

    def __init__(
        self,
        classifier,
        methods: Union[Sequence[Method], Mapping[str, Callable]],
        presets: Union[str, Sequence[Union[str, Preset]]] = "all",
        *,
        batch_size: int = 16,
        sort_by_length: bool = True,
        max_batch: Optional[int] = None,
        progress: bool = True,
        seed: int = 0,
        warmup: bool = True,
        forward_repeats: int = 1,
        tokenizer=None,
    ) -> None:
        if not isinstance(classifier, SequenceClassifier):
            classifier = SequenceClassifier(classifier, tokenizer)
        self.clf = classifier
        if isinstance(methods, Mapping):
            methods = [m if isinstance(m, Method) else Method(name, m) for name, m in methods.items()]
        methods = list(methods)
        if not methods:
            raise ValueError("give at least one method")
        for m in methods:
            if not isinstance(m, Method):
                raise TypeError(f"methods must be Method objects or a name -> callable mapping, got {type(m).__name__}")
        names = [m.name for m in methods]
        if len(set(names)) != len(names):
            raise ValueError(f"method names must be unique, got {names}")
        self.methods = methods
        self.presets = make_presets(presets)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.sort_by_length = sort_by_length
        self.max_batch = max_batch
        self.progress = progress
        self.seed = int(seed)
        self.warmup = warmup
        self.forward_repeats = max(1, int(forward_repeats))

    def run_sentences(self, sentences: Sequence[str], labels: Optional[Sequence[int]], tokenizer,
                      max_length: int = 128) -> HarnessResult:
        r"""Tokenise ``sentences`` with ``tokenizer`` and :meth:`run`."""
        ids, mask = encode(tokenizer, sentences, max_length)
        lab = None if labels is None else torch.as_tensor(list(labels), dtype=torch.long)
        return self.run(ids, mask, lab)

    def run(self, input_ids: Tensor, attention_mask: Tensor, labels: Optional[Tensor] = None) -> HarnessResult:
        r"""Evaluate every method with every preset.

        Args:
            input_ids: (N, T) token ids, padded.
            attention_mask: (N, T).
            labels: (N,) gold labels or None (then the predicted class stands for the gold
                label and the [MASK] accuracy is not computed).

        Returns:
            a :class:`HarnessResult`.
        """
        M.check_token_inputs(input_ids, attention_mask)
        N = input_ids.shape[0]
        if N == 0:
            raise ValueError("no examples given")
        if labels is not None:
            labels = torch.as_tensor(labels, dtype=torch.long).view(-1)
            if labels.shape[0] != N:
                raise ValueError(f"labels must have {N} entries, got {labels.shape[0]}")
        dev = self.clf.device
        input_ids = input_ids.to(dev)
        attention_mask = attention_mask.to(dev)
        if labels is not None:
            labels = labels.to(dev)

        lengths = attention_mask.sum(1)
        order = torch.argsort(lengths, descending=True, stable=True) if self.sort_by_length else torch.arange(N)
        batches = [order[i : i + self.batch_size] for i in range(0, N, self.batch_size)]

        infos = [m for p in self.presets for m in p.metrics]
        nan = float("nan")
        values = {m.name: {k.key: [nan] * N for k in infos} for m in self.methods}
        seconds = {m.name: 0.0 for m in self.methods}
        fwd_seconds = 0.0
        correct = 0

        if self.warmup:
            b = batches[0][:2]
            ids, mask = M.trim_pad_columns(input_ids[b], attention_mask[b])
            with torch.no_grad():
                pred = self.clf.logits(ids, mask).argmax(-1)
            for m in self.methods:
                m(ids, mask, pred)

        for bi, b in enumerate(progress_iter(batches, len(batches), enabled=self.progress, desc="faithfulness",
                                             min_total=1, leave=True)):
            ids, mask = M.trim_pad_columns(input_ids[b], attention_mask[b])
            lab = None if labels is None else labels[b]
            with torch.no_grad():
                t0 = time.perf_counter()
                for _ in range(self.forward_repeats):
                    logits = self.clf.logits(ids, mask)
                fwd_seconds += (time.perf_counter() - t0) / self.forward_repeats
            if lab is not None:
                correct += int((logits.argmax(-1) == lab).sum())
            ctx = BatchContext(self.clf, ids, mask, lab, logits, b.cpu(), bi, self.seed, self.max_batch)
            for m in self.methods:  # the timed calls, back to back, same target for every method
                ctx.scores(m, "predicted")
                seconds[m.name] += ctx.timings[m.name]
            for m in self.methods:
                for p in self.presets:
                    if not p.applies_to(m):
                        continue
                    rows = p.rows(ctx)
                    if not rows.any():
                        continue
                    for key, v in p.compute(ctx, m).items():
                        v = v.detach().double().cpu()
                        for r in torch.nonzero(rows.cpu()).view(-1).tolist():
                            values[m.name][key][int(b[r])] = float(v[r])

        acc = correct / N if labels is not None else nan
        return HarnessResult(
            methods=[m.name for m in self.methods],
            metrics=infos,
            per_example=values,
            seconds_per_example={k: v / N for k, v in seconds.items()},
            forward_seconds_per_example=fwd_seconds / N,
            n_examples=N,
            accuracy=acc,
            presets={p.name: p.config() for p in self.presets},
            info={
                "batch_size": self.batch_size,
                "sort_by_length": self.sort_by_length,
                "seed": self.seed,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "dtype": str(self.clf.dtype),
                "method_descriptions": {m.name: m.description for m in self.methods},
                "method_uses_target": {m.name: m.uses_target for m in self.methods},
            },
        )
