r"""One object per layer kind: what every method asks of a layer, answered once per kind.

A layer kind owns its parts, the outputs of its scopes, its norm handling and its
completeness error. The Captum classes ask the kind of the layer they are given
(:func:`layer_kind`) and never branch on the architecture themselves.

=============  ===============================================================  ==========================
kind           layer                                                            families
=============  ===============================================================  ==========================
``post_ln``    z = x + Attn(x), zt = LN1(z), y = LN2(zt + FF(zt))                BERT, RoBERTa, ELECTRA,
                                                                                DistilBERT
``pre_ln``     h = x + Attn(LN1(x)), y = h + FF(LN2(h)); causal or not (the     GPT-2, Llama, Mistral,
               layer record says)                                               Qwen2
=============  ===============================================================  ==========================

The kind of a layer is chosen from its architecture description
(:attr:`captum_normattr.arch.spec.ArchitectureSpec.topology`); a topology that no kind
decomposes, or a method a kind does not implement, is refused with
:class:`~captum_normattr.arch.spec.UnsupportedModelError` (never decomposed as another kind).
The formulas are in ``docs/design.md`` ("Layer kinds"); the functions that compute them
live in :mod:`~captum_normattr.decompose.encoder` (post-LN) and
:mod:`~captum_normattr.decompose.decoder` (pre-LN).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple, Union

from torch import Tensor

from captum_normattr.arch.spec import TOPOLOGIES, UnsupportedModelError
from captum_normattr.decompose import decoder, encoder
from captum_normattr.decompose.chunking import rows_for_budget
from captum_normattr.decompose.feed_forward import component_scope_maps
from captum_normattr.decompose.records import LayerTensors


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


#: The methods a layer kind can decompose (:meth:`LayerKind.require`).
KIND_METHODS: Tuple[str, ...] = ("maps", "alti", "ff", "decompx", "alti_logit", "routes")


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

    def scope_maps(self, layer: LayerTensors, valid: Tensor, options: FFOptions):
        r"""Maps of the FF component scopes and their completeness errors (see the kind's function)."""
        raise NotImplementedError

    def check_ff_options(self, options: FFOptions, family: str) -> None:
        r"""Raise a ValueError for options this kind does not support."""

    def alti_chunk_rows(self, layer: LayerTensors, memory_budget_mb: float) -> int:
        b, t, d = layer.hidden_in.shape
        return rows_for_budget(b, t, d, layer.hidden_in.element_size(), memory_budget_mb, causal=layer.causal)


class PostLNKind(LayerKind):
    r"""Post-LN encoder layers (BERT family)."""

    name = "post_ln"
    globenc_maps = encoder.GLOBENC_MAPS
    default_map = "N_ENC"
    whole_layer_scope = "LN2"

    def check_map(self, name: str) -> None:
        if name not in self.globenc_maps:
            raise ValueError(f"unknown map_name {name!r}; choose from {self.globenc_maps}")

    def norm_maps(self, layer, valid, names):
        return encoder.post_ln_layer_maps(layer, valid, names)

    def mixing_ratio_name(self, map_name):
        if map_name in encoder.NORM_MAPS:
            return map_name
        return "N_ENC" if map_name == "W_RES" else None

    def alti_map(self, layer, valid, memory_budget_mb):
        return encoder.post_ln_alti_map(layer, valid, self.alti_chunk_rows(layer, memory_budget_mb))

    def completeness_error(self, layer, valid):
        return encoder.post_ln_completeness_error(layer, valid)

    def scope_maps(self, layer, valid, options):
        return component_scope_maps(
            layer, valid, options.chunk_rows, options.method, options.steps, options.contribution,
            options.ignore_low_gamma, options.memory_budget_mb,
        )


class PreLNKind(LayerKind):
    r"""Pre-LN layers (GPT-2 and Llama families; causal or bidirectional by the layer record)."""

    name = "pre_ln"
    globenc_maps = decoder.PRE_LN_MAPS
    default_map = decoder.PRE_LN_DEFAULT_MAP
    whole_layer_scope = "RES2"

    def check_map(self, name: str) -> None:
        decoder.check_pre_ln_map(name)

    def norm_maps(self, layer, valid, names):
        return decoder.pre_ln_layer_maps(layer, valid, names, layer.causal)

    def mixing_ratio_name(self, map_name):
        return map_name if map_name in decoder.PRE_LN_NORM_MAPS else None

    def alti_map(self, layer, valid, memory_budget_mb):
        return decoder.pre_ln_alti_map(layer, valid, self.alti_chunk_rows(layer, memory_budget_mb), layer.causal)

    def completeness_error(self, layer, valid):
        return decoder.pre_ln_completeness_error(layer, valid)

    def scope_maps(self, layer, valid, options):
        return decoder.pre_ln_component_scope_maps(
            layer, valid, options.chunk_rows, options.method, options.steps, options.nodes, layer.causal,
            options.memory_budget_mb, options.contribution,
        )

    def check_ff_options(self, options, family):
        if options.ignore_low_gamma:
            raise ValueError(
                f"{family} is a pre-LN model: ignore_low_gamma is not supported there. The LayerNorm-gamma "
                "ablation of Kobayashi et al. 2023 acts on the LayerNorms that close the attention block and the "
                "layer of a post-LN encoder; a pre-LN layer's norms sit before its blocks and no norm follows its "
                "residuals. Use ignore_low_gamma=0 (contribution='norm' or 'alti' both work)"
            )


#: The layer kinds by topology name (a kind module adds its own with :func:`register_layer_kind`).
LAYER_KINDS: Dict[str, LayerKind] = {"post_ln": PostLNKind(), "pre_ln": PreLNKind()}


def register_layer_kind(kind: LayerKind) -> LayerKind:
    r"""Make ``kind`` the kind of the layers of topology ``kind.name`` (one of the description's topologies)."""
    if kind.name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {kind.name!r}; the descriptions know {TOPOLOGIES}")
    LAYER_KINDS[kind.name] = kind
    return kind


def layer_kind(topology: Union[str, bool], family: str = "this model") -> LayerKind:
    r"""The kind object of a layer.

    Args:
        topology: the description's topology (``ArchitectureSpec.topology``) or a layer
            record's ``topology``; a bool is read as the older ``pre_ln`` flag.
        family: named in the error.

    Raises:
        UnsupportedModelError: no kind decomposes that topology.
    """
    if isinstance(topology, bool):
        topology = "pre_ln" if topology else "post_ln"
    kind = LAYER_KINDS.get(topology)
    if kind is None:
        raise UnsupportedModelError(
            f"{family} has {topology} layers (described in the architecture registry), but no layer kind decomposes "
            f"that topology yet; implemented: {', '.join(LAYER_KINDS)}"
        )
    return kind
