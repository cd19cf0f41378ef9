r"""Pure tensor mathematics of the decompositions: no hooks, no models.

Every function takes tensors and returns tensors. Shapes use B (batch), T (tokens),
H (heads), D (model width), Dh (head width), L (layers).
"""
from captum_normattr.decompose.records import LayerTensors, NormParams

__all__ = ["LayerTensors", "NormParams"]
