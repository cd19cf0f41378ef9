r"""The interface every layer kind implements, and the options they share.

A layer kind (one per topology of :data:`captum_normattr.arch.spec.TOPOLOGIES`) answers
everything a method asks of a layer: its maps, its ALTI map, its completeness error, its FF
scopes (and, for DecompX, its steps). The kinds live in
:mod:`captum_normattr.decompose.kinds.registry` (post-LN, pre-LN) and in one module per further
topology; :mod:`~captum_normattr.decompose.kinds.registry` registers them all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple

from torch import Tensor

from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.decompose.primitives.chunking import rows_for_budget
from captum_normattr.decompose.records import LayerTensors

__all__ = ["FFOptions", "KIND_METHODS", "LayerKind"]

#: The methods a layer kind can decompose (:meth:`LayerKind.require`).
KIND_METHODS: Tuple[str, ...] = ("maps", "alti", "ff", "decompx", "alti_logit", "routes")


@dataclass(frozen=True)
class FFOptions:
    r"""How the feed-forward block is decomposed (one record for every method that needs it).

    Attributes:
        method: ``"closed_form"`` or ``"riemann"`` (elementwise activations).
        steps: Riemann steps.
        nodes: Gauss-Legendre nodes of a gated FF (None: the default).
        contribution: ``"norm"`` or ``"alti"``.
        ignore_low_gamma: share of LayerNorm dimensions with the lowest gamma ignored.
        chunk_rows: query rows per chunk (None: from ``memory_budget_mb``).
        memory_budget_mb: budget of one chunk's explicit parts, in MB.
    """

    method: str = "closed_form"
    steps: int = 50
    nodes: Optional[int] = None
    contribution: str = "norm"
    ignore_low_gamma: float = 0.0
    chunk_rows: Optional[int] = None
    memory_budget_mb: float = 128.0


class LayerKind:
    r"""The interface of a layer kind (see the module docstring)."""

    name: str = ""
    #: the methods of :data:`KIND_METHODS` this kind decomposes
    methods: FrozenSet[str] = frozenset(KIND_METHODS)

    def require(self, method: str, family: str) -> None:
        r"""Raise :class:`UnsupportedModelError` if this kind does not decompose ``method``."""
        if method not in self.methods:
            done = ", ".join(sorted(self.methods)) or "none"
            raise UnsupportedModelError(
                f"{family} has {self.name} layers, and the {method!r} decomposition is not implemented for that layer "
                f"kind (it decomposes: {done}); see docs/architectures.md"
            )
    #: the GlobEnc-table maps defined for this kind
    globenc_maps: Tuple[str, ...] = ()
    #: GlobEncAttribution's map when none is named
    default_map: str = ""
    #: the FF scope that covers the whole layer
    whole_layer_scope: str = ""

    def check_map(self, name: str) -> None:
        raise NotImplementedError

    def norm_maps(self, layer: LayerTensors, valid: Tensor, names) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        r"""GlobEnc-table maps (B, T, T) and mixing ratios (B, T) of one layer."""
        raise NotImplementedError

    def mixing_ratio_name(self, map_name: str) -> Optional[str]:
        r"""The ratio reported as the mixing ratio of ``map_name`` (None: no ratio is defined)."""
        raise NotImplementedError

    def alti_map(self, layer: LayerTensors, valid: Tensor, memory_budget_mb: float) -> Tensor:
        r"""The ALTI map (B, T, T) of the attention block, rows summing to 1."""
        raise NotImplementedError

    def completeness_error(self, layer: LayerTensors, valid: Tensor) -> Tensor:
        r"""Largest |parts + bias part - real tensor| of the attention block over real tokens."""
        raise NotImplementedError

    def example_completeness_error(self, layer: LayerTensors, valid: Tensor) -> Tensor:
        r"""Per example (B,): the attention block's completeness error (ALTI-Logit's delta carries it)."""
        raise NotImplementedError

    def attention_block_output(self, layer: LayerTensors) -> Tensor:
        r"""The real tensor (B, T, D) the attention block's parts sum to (the scale of its completeness guard)."""
        raise NotImplementedError

    def scope_maps(self, layer: LayerTensors, valid: Tensor, options: FFOptions):
        r"""Maps of the FF component scopes and their completeness errors (see the kind's function)."""
        raise NotImplementedError

    def check_ff_options(self, options: FFOptions, family: str) -> None:
        r"""Raise a ValueError for options this kind does not support."""

    def logit_form(self, layer: LayerTensors) -> LayerTensors:
        r"""The layer as a pre-LN record with the same attention parts, FF update and residual stream.

        What ALTI-Logit reads per layer (the attention update split over sources, the FF
        update, the attention output bias, h_i): a pre-LN layer is itself; a kind whose
        branches are followed by a frozen linear map folds it in (the sandwich kind).
        """
        raise NotImplementedError(f"the {self.name} layer kind has no pre-LN form for ALTI-Logit")

    def alti_chunk_rows(self, layer: LayerTensors, memory_budget_mb: float) -> int:
        b, t, d = layer.hidden_in.shape
        return rows_for_budget(b, t, d, layer.hidden_in.element_size(), memory_budget_mb, causal=layer.causal)
