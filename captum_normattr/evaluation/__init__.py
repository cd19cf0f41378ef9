r"""Faithfulness evaluation: metric presets and a harness comparing attribution methods.

- :mod:`~captum_normattr.evaluation.metrics`: pure metric functions (Spearman, ERASER
  AOPC, DecompX [MASK] AOPC, Captum infidelity / sensitivity_max through a token gate);
- :mod:`~captum_normattr.evaluation.baselines`: methods as callables — Captum's
  Saliency, InputXGradient, gradient x input, (Layer)IntegratedGradients, and ours;
- :mod:`~captum_normattr.evaluation.harness`: :class:`FaithfulnessHarness`, the presets
  and :class:`HarnessResult` (Markdown table, JSON).
- :mod:`~captum_normattr.evaluation.alignment`: word alignments from (target x source)
  attribution matrices and the alignment error rate (AER), for encoder-decoders.
- :mod:`~captum_normattr.evaluation.alignment_task`: a synthetic translation task with known
  word alignments (sure and possible links), to score those alignments against;
- :mod:`~captum_normattr.evaluation.decoder_harness`: the decoder harness: any attributor
  (``f(input_ids, target, foil) -> (T,)``; :func:`as_attributor` wraps a Captum attribution),
  per-item evidence ranks, deletion / insertion AOPC and ABPC with and without the sink
  (docs/evaluation.md);
- :mod:`~captum_normattr.evaluation.statistics`: per-item values of several methods summarised
  (mean ± standard error, paired differences, medians, wins).

Examples:
    >>> from captum_normattr.evaluation import FaithfulnessHarness, SequenceClassifier, baselines
    >>> clf = SequenceClassifier(model, tokenizer)  # doctest: +SKIP
    >>> res = FaithfulnessHarness(clf, baselines.default_baselines(clf)).run(ids, mask, labels)  # doctest: +SKIP
    >>> print(res.table())  # doctest: +SKIP
"""

from . import alignment, baselines, decoder_harness, metrics
from .baselines import Method
from .classifier import SequenceClassifier
from .decoder_harness import Attributor, as_attributor, evaluate_item, make_attributor, make_attributors
from .harness import (
    PRESETS,
    CaptumInfidelity,
    CaptumSensitivity,
    DecompXMaskAOPC,
    EraserAOPC,
    FaithfulnessHarness,
    HarnessResult,
    MetricInfo,
    Preset,
    SpearmanGradXInput,
    encode,
    make_presets,
)

__all__ = [
    "alignment",
    "baselines",
    "decoder_harness",
    "Attributor",
    "as_attributor",
    "make_attributor",
    "make_attributors",
    "evaluate_item",
    "metrics",
    "Method",
    "SequenceClassifier",
    "FaithfulnessHarness",
    "HarnessResult",
    "MetricInfo",
    "Preset",
    "PRESETS",
    "SpearmanGradXInput",
    "EraserAOPC",
    "DecompXMaskAOPC",
    "CaptumInfidelity",
    "CaptumSensitivity",
    "make_presets",
    "encode",
]
