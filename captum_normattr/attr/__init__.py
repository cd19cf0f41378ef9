r"""The Captum ``Attribution`` classes of the package, one per file, and the LLM API over them.

:mod:`captum_normattr.attr.base` holds their two base classes, :mod:`captum_normattr.attr.methods`
the registry of methods, :mod:`captum_normattr.attr.positions` the multi-position answer the
classes give the LLM API (:mod:`captum_normattr.attr.llm`).
"""
from captum_normattr.attr.alti import ALTIAttribution
from captum_normattr.attr.alti_logit import ALTILogitAttribution, ALTILogitResult
from captum_normattr.attr.alti_plus import ALTIPlusAttribution, ALTIPlusResult, explain_generation
from captum_normattr.attr.decompx import DecompXAttribution, DecompXResult
from captum_normattr.attr.ff_decomposition import FFIntegratedDecomposition
from captum_normattr.attr.globenc import GlobEncAttribution
from captum_normattr.attr.llm import DecompositionLLMAttribution, GenerationExplanation
from captum_normattr.attr.positions import PositionExplanation

__all__ = [
    "ALTIAttribution",
    "ALTILogitAttribution",
    "ALTILogitResult",
    "ALTIPlusAttribution",
    "ALTIPlusResult",
    "DecompXAttribution",
    "DecompXResult",
    "DecompositionLLMAttribution",
    "FFIntegratedDecomposition",
    "GenerationExplanation",
    "GlobEncAttribution",
    "PositionExplanation",
    "explain_generation",
]
