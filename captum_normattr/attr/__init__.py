r"""One Captum ``Attribution`` class per file."""
from captum_normattr.attr.alti import ALTIAttribution
from captum_normattr.attr.alti_plus import ALTIPlusAttribution, ALTIPlusResult, explain_generation
from captum_normattr.attr.alti_logit import ALTILogitAttribution, ALTILogitResult
from captum_normattr.attr.decompx import DecompXAttribution, DecompXResult
from captum_normattr.attr.ff_decomposition import FFIntegratedDecomposition
from captum_normattr.attr.globenc import GlobEncAttribution

__all__ = [
    "ALTIAttribution",
    "ALTILogitAttribution",
    "ALTILogitResult",
    "ALTIPlusAttribution",
    "ALTIPlusResult",
    "explain_generation",
    "DecompXAttribution",
    "DecompXResult",
    "FFIntegratedDecomposition",
    "GlobEncAttribution",
]
