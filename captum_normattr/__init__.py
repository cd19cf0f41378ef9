r"""captum_normattr: decomposition-based attributions for Transformers, as Captum classes.

GlobEnc, the norm-based maps of Kobayashi et al., ALTI, the FF decomposition and DecompX for
the encoder, decoder and vision families of Hugging Face ``transformers`` described in the
architecture registry (:mod:`captum_normattr.arch`, ``docs/architectures.md``); ALTI-Logit for
next-token logits of the decoders; ALTI+ for encoder-decoders.
"""
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

__version__ = "0.1.0"

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
