r"""The interface every layer kind implements, and the options they share.

A layer kind (one per topology of :data:`captum_normattr.arch.spec.TOPOLOGIES`) answers
everything a method asks of a layer: its maps, its ALTI map, its completeness error, its FF
scopes (and, for DecompX, its steps). The kinds live in
:mod:`captum_normattr.decompose.kinds.registry` (post-LN, pre-LN) and in one module per further
topology; :mod:`~captum_normattr.decompose.kinds.registry` registers them all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Mapping, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.decompose.primitives.chunking import rows_for_budget
from captum_normattr.decompose.records import LayerTensors, NormParams

__all__ = ["COMMON_RECORD_KEYS", "CaptureRecipe", "FFOptions", "KIND_METHODS", "LayerKind"]

#: What the capture records of every layer, whatever its kind (the record keys of
#: :mod:`captum_normattr.models.capture.recorder`; a kind adds its own, :attr:`CaptureRecipe.extra_keys`).
COMMON_RECORD_KEYS: Tuple[str, ...] = (
    "hidden_in", "probs", "values", "ln1_in", "ln1_out", "ln2_in", "ln2_out", "ff_out", "layer_out",
)


@dataclass(frozen=True)
class CaptureRecipe:
    r"""What the capture records of a layer of one kind, and how it checks and fills the record.

    The recorder (:class:`captum_normattr.models.capture.recorder.Recorder`) never branches on
    the topology: it reads this recipe of the layer's kind. Keys are those of the recorded
    tensors (:data:`COMMON_RECORD_KEYS` plus :attr:`extra_keys`), which are also the names of
    the :class:`~captum_normattr.decompose.records.LayerTensors` fields they become.

    Attributes:
        extra_keys: record keys this kind needs beyond :data:`COMMON_RECORD_KEYS`.
        attention_input: the recorded tensor the attention module reads (its real inputs are
            compared with it); attention_input_name: that tensor in readable words.
        ff_input: the recorded tensor the feed-forward block reads; ff_input_name: in words.
        identity_checks: (check name, real key, assumed key): recorded tensors the
            decomposition assumes to be the same (compared where they are not one tensor).
        attention_join: the recorded tensor where the layer input and the attention output
            join (checked at the last position against x + context W_O + b_O), or None
            where the attention output reaches the stream otherwise.
        branch_output: the key under which the attention branch's output is recorded as it
            joins the stream (the output projection's, or the layer scale's, output), or None.
        post_norms: the :class:`LayerTensors` fields of the norms on the branch outputs
            (``"attn_post"``, ``"ff_post"``), read from the description's post-norms.
        stream_norms: a norm on the residual stream follows every branch's join (post-LN): an
            attention block's output is that norm's output, and its input gives the scale
            (the encoder-decoder capture, :mod:`captum_normattr.models.seq2seq`); else a
            block's output is the raw stream.
    """

    extra_keys: Tuple[str, ...] = ()
    attention_input: str = "ln1_out"
    attention_input_name: str = "the first norm's output"
    ff_input: str = "ln2_out"
    ff_input_name: str = "the second norm's output"
    identity_checks: Tuple[Tuple[str, str, str], ...] = (("first norm input vs the layer input", "ln1_in", "hidden_in"),)
    attention_join: Optional[str] = None
    branch_output: Optional[str] = None
    post_norms: Tuple[str, ...] = ()
    stream_norms: bool = False

    @property
    def record_keys(self) -> Tuple[str, ...]:
        r"""Every key a layer of this kind must have recorded."""
        return COMMON_RECORD_KEYS + self.extra_keys

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
    #: what the capture records of this kind's layers and checks (:class:`CaptureRecipe`)
    capture: CaptureRecipe = CaptureRecipe()
    #: DecompX's adjoint algorithm applies (the kind has :meth:`frozen_layer` and :meth:`frozen_layer_vjp`);
    #: False: DecompX runs its forward propagation on these layers
    adjoint: bool = True
    #: DecompX's step takes the value projection W_V read from the description (False: the kind's step
    #: reads its values itself, and no W_V is read)
    reads_value_projection: bool = True

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

    # --- routes (docs/routes.md) ---------------------------------------------------------
    #: Whether the FF block reads the layer input x_{l,i} rather than the after-attention state m_{l,i}
    #: (a parallel layer): its route edge then runs x_{l,i} -> f_{l,i} -> x_{l+1,i}.
    route_ff_reads_input: bool = False

    def route_form(self, layer: LayerTensors) -> LayerTensors:
        r"""The pre-LN record whose attention parts alpha^h_ij f^h_j are the head edges into m_{l,i} = ``ln2_in``.

        A pre-LN layer is itself; a kind with a norm after the attention folds it in.
        """
        return layer

    def route_output_edges(self, layer: LayerTensors) -> Tuple[Tensor, Tuple[str, ...]]:
        r"""The edges into the layer output x_{l+1,i}: their vectors (B, T, E, D), summing to ``layer_out``,
        and their kinds (:func:`~captum_normattr.decompose.methods.routes.prune_routes`'s ``output_edges``).

        A pre-LN layer: the residual h_i and the FF output.
        """
        return torch.stack([layer.ln2_in, layer.ff_out], -2), ("residual", "ff")

    def route_value_layer(self, layer: LayerTensors) -> int:
        r"""The layer whose input the values of this layer's attention are computed from (itself, unless it
        reuses an earlier layer's keys and values)."""
        return layer.index

    # --- DecompX (docs/design.md, section 8) -----------------------------------------
    def decompx_step(
        self,
        parts: Tensor,
        bias: Tensor,
        layer: LayerTensors,
        value_weight: Tensor,
        value_bias: Optional[Tensor],
        bias_mode: str = "separate",
        rows: Optional[Tensor] = None,
        memory_budget_mb: float = 256.0,
        coefs: Optional[Dict[str, Tensor]] = None,
    ) -> Tuple[Tensor, Tensor]:
        r"""DecompX's forward step: parts of the layer input to parts of its output.

        Args:
            parts: (B, T, K, D) parts of the layer input, entry [b, j, k] = x_{j<-k}.
            bias: (B, T, D) its bias part.
            layer: the layer's real tensors.
            value_weight, value_bias: W_V (D, H_kv Dh) and b_V (or None).
            bias_mode: one of :data:`~captum_normattr.decompose.methods.decompx.parts.BIAS_MODES`.
            rows: (R,) long, the output rows to produce (default all).
            memory_budget_mb: bound on the temporaries.
            coefs: the layer's :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients`
                (computed if None where the step uses them).

        Returns:
            (parts (B, R, K, D), bias part (B, R, D)) of the layer output at ``rows``.
        """
        raise NotImplementedError(f"DecompX has no step for {self.name} layers")

    def frozen_layer(
        self,
        x: Tensor,
        layer: LayerTensors,
        value_weight: Tensor,
        value_bias: Optional[Tensor],
        with_bias: bool,
        coefs: Dict[str, Tensor],
        rows: Optional[Tensor] = None,
    ) -> Tensor:
        r"""The layer with its nonlinear quantities frozen at the real values: (B, R, D).

        Linear in ``x`` without ``with_bias`` (the map of :meth:`decompx_step` applied to one
        part); with it and the real input it reproduces the real output.

        Args:
            x: (B, T, D); layer: the layer's real tensors; value_weight, value_bias: W_V and b_V.
            with_bias: add every bias; coefs: the layer's FF coefficients; rows: (R,) or None.
        """
        raise NotImplementedError(f"DecompX has no frozen layer for {self.name} layers")

    def frozen_layer_vjp(
        self,
        g: Tensor,
        layer: LayerTensors,
        value_weight: Tensor,
        coefs: Dict[str, Tensor],
        rows: Optional[Tensor] = None,
        valid: Optional[Tensor] = None,
    ) -> Tensor:
        r"""The transpose of :meth:`frozen_layer`'s linear part, J^T g.

        Args:
            g: (..., B, R, D) cotangent(s) of the layer output at ``rows`` (all T rows if None).
            layer, value_weight, coefs, rows: as in :meth:`frozen_layer`.
            valid: (B, T) bool real tokens, or None (lets a causal layer skip its zero triangle).

        Returns:
            (..., B, T, D) the cotangent of the layer input.
        """
        raise NotImplementedError(f"DecompX has no transpose for {self.name} layers")

    def frozen_layer_own(self, layer: LayerTensors, rows: Optional[Tensor] = None) -> Optional[Tensor]:
        r"""Token-own vectors in the frozen layer's output, (B, R, D) at ``rows``, or None.

        Constants of the frozen map that DecompX gives to token t's own part at row t (not to the
        bias part): by default the vectors the model adds to the stream right after the layer
        (:attr:`~captum_normattr.decompose.records.LayerTensors.own_after`, Qwen3-VL's DeepStack).
        DecompX's adjoint adds <g_t, own_t> to token t's score, g the cotangent of the layer's output
        (:class:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass`).
        """
        own = layer.own_after
        if own is None:
            return None
        return own if rows is None else own[:, rows.to(own.device)]

    def frozen_value_source(self, layer: LayerTensors) -> Optional[int]:
        r"""The earlier layer whose input the frozen layer's values are computed from (keys and values shared
        across layers, :meth:`route_value_layer`), or None when they are the layer's own."""
        source = self.route_value_layer(layer)
        return None if source == layer.index else source

    def frozen_layer_source_vjp(
        self,
        g: Tensor,
        layer: LayerTensors,
        coefs: Dict[str, Tensor],
        source_input: Tensor,
        rows: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        r"""The transpose of a frozen layer that reads its values from an earlier layer's input x_s.

        Args:
            g: (..., B, R, D) cotangent(s) of the layer output at ``rows``; layer, coefs, rows: as in
                :meth:`frozen_layer_vjp`; source_input: (B, T, D) the real x_s (:meth:`frozen_value_source`).

        Returns:
            ((..., B, T, D) the cotangent of the layer's own input, (..., B, T, D) that of x_s).
        """
        raise NotImplementedError(f"DecompX has no transpose for {self.name} layers that share values")

    # --- capture (models.capture.recorder) ----------------------------------------------
    def join_checks(self, layer: LayerTensors) -> Dict[str, Tensor]:
        r"""This kind's relative-difference checks of a record (its residual joins, its extra norms rebuilt).

        Args:
            layer: the layer's record in the compute dtype.

        Returns:
            check name -> 0-dim relative difference (judged by the consistency guard).
        """
        return {}

    def fill_record(self, layer: LayerTensors, recorded: Mapping[str, Tensor], post_norms: Mapping[str, NormParams]) -> None:
        r"""Fill the record's fields this kind adds (in place): its extra keys, its post-norms and its FF input.

        Args:
            layer: the record, its common fields filled.
            recorded: :attr:`CaptureRecipe.extra_keys` -> the recorded tensor (compute dtype).
            post_norms: :attr:`CaptureRecipe.post_norms` -> the norm's parameters.
        """
        for key in self.capture.extra_keys:
            setattr(layer, key, recorded[key])
        for key in self.capture.post_norms:
            setattr(layer, key, post_norms[key])
        layer.ff_input_key = self.capture.ff_input

    def ff_input(self, layer: LayerTensors) -> Tensor:
        r"""The feed-forward block's real input u, (B, T, D) (:attr:`CaptureRecipe.ff_input`)."""
        return getattr(layer, self.capture.ff_input)
