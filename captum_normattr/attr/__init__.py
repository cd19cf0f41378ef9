r"""One Captum ``Attribution`` class per file."""
from captum_normattr.attr.alti import ALTIAttribution
from captum_normattr.attr.alti_logit import ALTILogitAttribution, ALTILogitResult
from captum_normattr.attr.decompx import DecompXAttribution, DecompXResult
from captum_normattr.attr.ff_decomposition import FFIntegratedDecomposition
from captum_normattr.attr.globenc import GlobEncAttribution

__all__ = [
    "ALTIAttribution",
    "ALTILogitAttribution",
    "ALTILogitResult",
    "DecompXAttribution",
    "DecompXResult",
    "FFIntegratedDecomposition",
    "GlobEncAttribution",
]
