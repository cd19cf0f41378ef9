r"""captum_normattr: decomposition-based attributions for Transformers, as Captum classes.

GlobEnc, the norm-based maps of Kobayashi et al., ALTI, the FF decomposition and DecompX for
the encoder, decoder and vision families of Hugging Face ``transformers`` described in the
architecture registry (:mod:`captum_normattr.arch`, ``docs/architectures.md``); ALTI-Logit for
next-token logits of the decoders; ALTI+ for encoder-decoders.

The names below are imported when first used (PEP 562 ``__getattr__``): ``import
captum_normattr`` itself imports neither torch, transformers, Captum nor matplotlib, so the
command line (``captum-normattr --help``, usage errors) answers at once, and
``from captum_normattr import GlobEncAttribution`` pays for what that class needs. What
each costs is measured by ``benchmarks/speed/import_cost.py`` (docs/cli.md, "Start-up time").
"""
import importlib
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

__version__ = "0.1.0"

#: every exported name -> (the module that defines it, its name there)
_EXPORTS: Dict[str, Tuple[str, str]] = {
    "ValueZeroingAttribution": ("captum_normattr.attr.value_zeroing", "ValueZeroingAttribution"),
    "infer_architecture": ("captum_normattr.attr.inference", "infer_architecture"),
    "ArchitectureInference": ("captum_normattr.attr.inference", "ArchitectureInference"),
    "QuantizedActivationsError": ("captum_normattr.models.quantization", "QuantizedActivationsError"),
    "ALTIAttribution": ("captum_normattr.attr", "ALTIAttribution"),
    "ALTILogitAttribution": ("captum_normattr.attr", "ALTILogitAttribution"),
    "ALTILogitResult": ("captum_normattr.attr", "ALTILogitResult"),
    "ALTIPlusAttribution": ("captum_normattr.attr", "ALTIPlusAttribution"),
    "ALTIPlusResult": ("captum_normattr.attr", "ALTIPlusResult"),
    "explain_generation": ("captum_normattr.attr", "explain_generation"),
    "GlobEncAttribution": ("captum_normattr.attr", "GlobEncAttribution"),
    "FFIntegratedDecomposition": ("captum_normattr.attr", "FFIntegratedDecomposition"),
    "DecompXAttribution": ("captum_normattr.attr", "DecompXAttribution"),
    "DecompXResult": ("captum_normattr.attr", "DecompXResult"),
    "DecompositionLLMAttribution": ("captum_normattr.attr", "DecompositionLLMAttribution"),
    "GenerationExplanation": ("captum_normattr.attr", "GenerationExplanation"),
    "InformationFlowRoutes": ("captum_normattr.attr.routes", "InformationFlowRoutes"),
    "RouteGraph": ("captum_normattr.attr.routes", "RouteGraph"),
    "interactive_report_html": ("captum_normattr.present.interactive", "interactive_report_html"),
    "write_interactive_report": ("captum_normattr.present.interactive", "write_interactive_report"),
    "FF_SCOPES": ("captum_normattr.decompose.primitives.feed_forward", "SCOPES"),
    "contextualization_change": ("captum_normattr.decompose.primitives.feed_forward", "contextualization_change"),
    "scope_contextualization_changes": ("captum_normattr.decompose.methods.ff_analysis", "scope_contextualization_changes"),
    "amplification_scores": ("captum_normattr.decompose.methods.ff_analysis", "amplification_scores"),
    "top_amplified_pairs": ("captum_normattr.decompose.methods.ff_analysis", "top_amplified_pairs"),
    "DecompositionResult": ("captum_normattr.result", "DecompositionResult"),
    "GLOBENC_MAPS": ("captum_normattr.decompose.kinds.post_ln", "GLOBENC_MAPS"),
    "rollout": ("captum_normattr.decompose.primitives.rollout", "rollout"),
    "UnsupportedModelError": ("captum_normattr.models.adapters", "UnsupportedModelError"),
    "UnsupportedAdapterLayerError": ("captum_normattr.models.weights", "UnsupportedAdapterLayerError"),
    "ConsistencyWarning": ("captum_normattr.models.guard", "ConsistencyWarning"),
    "ConsistencyError": ("captum_normattr.models.guard", "ConsistencyError"),
    "ExplainedOutputMismatchWarning": ("captum_normattr.attr.explained_output", "ExplainedOutputMismatchWarning"),
    "ExplainedOutputMismatchError": ("captum_normattr.attr.explained_output", "ExplainedOutputMismatchError"),
    "LayerRunError": ("captum_normattr.models.capture.recorder", "LayerRunError"),
    "RecordedTensorModifiedError": ("captum_normattr.models.capture.recorder", "RecordedTensorModifiedError"),
    "supported_families": ("captum_normattr.models.adapters", "supported_families"),
    "default_model_path": ("captum_normattr.models.loading", "default_model_path"),
    "load_default_model": ("captum_normattr.models.loading", "load_default_model"),
    "aggregate_to_words": ("captum_normattr.aggregation", "aggregate_to_words"),
    "aggregate_to_sentences": ("captum_normattr.aggregation", "aggregate_to_sentences"),
    "aggregate_to_spans": ("captum_normattr.aggregation", "aggregate_to_spans"),
    "aggregate_map": ("captum_normattr.aggregation", "aggregate_map"),
    "aggregate_map_to_words": ("captum_normattr.aggregation", "aggregate_map_to_words"),
}

if TYPE_CHECKING:  # what type checkers and IDEs read: the same names, imported eagerly
    from captum_normattr.aggregation import aggregate_map, aggregate_map_to_words, aggregate_to_sentences, aggregate_to_spans, aggregate_to_words
    from captum_normattr.attr import (
        ALTIAttribution,
        ALTILogitAttribution,
        ALTILogitResult,
        ALTIPlusAttribution,
        ALTIPlusResult,
        DecompositionLLMAttribution,
        DecompXAttribution,
        DecompXResult,
        FFIntegratedDecomposition,
        GenerationExplanation,
        GlobEncAttribution,
        explain_generation,
    )
    from captum_normattr.attr.inference import ArchitectureInference, infer_architecture
    from captum_normattr.attr.routes import InformationFlowRoutes, RouteGraph
    from captum_normattr.attr.value_zeroing import ValueZeroingAttribution
    from captum_normattr.models.quantization import QuantizedActivationsError
    from captum_normattr.decompose.kinds.post_ln import GLOBENC_MAPS
    from captum_normattr.decompose.primitives.feed_forward import SCOPES as FF_SCOPES
    from captum_normattr.decompose.primitives.feed_forward import contextualization_change
    from captum_normattr.decompose.methods.ff_analysis import amplification_scores, scope_contextualization_changes, top_amplified_pairs
    from captum_normattr.decompose.primitives.rollout import rollout
    from captum_normattr.present.interactive import interactive_report_html, write_interactive_report
    from captum_normattr.models.adapters import UnsupportedModelError, supported_families
    from captum_normattr.models.loading import default_model_path, load_default_model
    from captum_normattr.result import DecompositionResult
    from captum_normattr.models.guard import ConsistencyError, ConsistencyWarning
    from captum_normattr.attr.explained_output import ExplainedOutputMismatchError, ExplainedOutputMismatchWarning
    from captum_normattr.models.capture.recorder import LayerRunError, RecordedTensorModifiedError
    from captum_normattr.models.weights import UnsupportedAdapterLayerError


def __getattr__(name: str) -> Any:
    r"""An exported name, imported from its module on first use (then cached in this module);
    a subpackage or module of the package (``captum_normattr.attr``) is imported too."""
    where = _EXPORTS.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where[0]), where[1])
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "ValueZeroingAttribution",
    "infer_architecture",
    "ArchitectureInference",
    "QuantizedActivationsError",
    "ALTIAttribution",
    "ALTILogitAttribution",
    "ALTILogitResult",
    "ALTIPlusAttribution",
    "ALTIPlusResult",
    "explain_generation",
    "GlobEncAttribution",
    "FFIntegratedDecomposition",
    "DecompXAttribution",
    "DecompXResult",
    "DecompositionLLMAttribution",
    "GenerationExplanation",
    "InformationFlowRoutes",
    "RouteGraph",
    "interactive_report_html",
    "write_interactive_report",
    "FF_SCOPES",
    "contextualization_change",
    "scope_contextualization_changes",
    "amplification_scores",
    "top_amplified_pairs",
    "DecompositionResult",
    "GLOBENC_MAPS",
    "rollout",
    "UnsupportedModelError",
    "UnsupportedAdapterLayerError",
    "ConsistencyWarning",
    "ConsistencyError",
    "ExplainedOutputMismatchWarning",
    "ExplainedOutputMismatchError",
    "LayerRunError",
    "RecordedTensorModifiedError",
    "supported_families",
    "default_model_path",
    "load_default_model",
    "aggregate_to_words",
    "aggregate_to_sentences",
    "aggregate_to_spans",
    "aggregate_map",
    "aggregate_map_to_words",
]
