r"""One object per layer kind: what every method asks of a layer, answered once per kind.

A layer kind owns its parts, the outputs of its scopes, its norm handling and its
completeness error. The Captum classes ask the kind of the layer they are given
(:func:`layer_kind`) and never branch on the architecture themselves.

=============  ===============================================================================
kind           layer
=============  ===============================================================================
``post_ln``    z = x + Attn(x), zt = LN1(z), y = LN2(zt + FF(zt)) (BERT-like encoders)
``pre_ln``     h = x + Attn(LN1(x)), y = h + FF(LN2(h)); causal or not (the layer record says)
``parallel``   y = x + Attn(N1(x)) + FF(N2(x)) (N1 and N2 may be one norm)
``sandwich``   h = x + P1(Attn(N1(x))), y = h + P2(FF(N2(h))); P1, P2 frozen at their real
               per-token scale (:mod:`~captum_normattr.decompose.kinds.sandwich`)
=============  ===============================================================================

Which family has which kind: the table of ``docs/architectures.md`` (generated from the registry).

The kind of a layer is chosen from its architecture description
(:attr:`captum_normattr.arch.spec.ArchitectureSpec.topology`); a topology that no kind
decomposes, or a method a kind does not implement, is refused with
:class:`~captum_normattr.arch.spec.UnsupportedModelError` (never decomposed as another kind).
The formulas are in ``docs/design.md`` ("Layer kinds"); the functions that compute them
live in :mod:`~captum_normattr.decompose.kinds.post_ln` (post-LN) and
:mod:`~captum_normattr.decompose.kinds.pre_ln` (pre-LN, with :class:`PreLNKind`); the parallel kind is
:mod:`~captum_normattr.decompose.kinds.parallel`, the sandwich kind :mod:`~captum_normattr.decompose.kinds.sandwich`.
"""
from __future__ import annotations

from typing import Dict, Union

from captum_normattr.arch.spec import TOPOLOGIES, UnsupportedModelError
from captum_normattr.decompose.kinds import post_ln as encoder
from captum_normattr.decompose.kinds.pre_ln import PreLNKind
from captum_normattr.decompose.primitives.feed_forward import component_scope_maps
from captum_normattr.decompose.kinds.base import KIND_METHODS, FFOptions, LayerKind
from captum_normattr.decompose.kinds.parallel import ParallelKind
from captum_normattr.decompose.kinds.sandwich import SandwichKind

__all__ = ["KIND_METHODS", "FFOptions", "LAYER_KINDS", "LayerKind", "ParallelKind", "PostLNKind", "PreLNKind", "SandwichKind", "layer_kind", "register_layer_kind"]


class PostLNKind(LayerKind):
    r"""Post-LN encoder layers (BERT family)."""

    name = "post_ln"
    #: ALTI-Logit splits the logit over additive residual updates, which the stream norms of post-LN
    #: layers rescale token by token: not decomposed (the other methods are)
    methods = frozenset(m for m in KIND_METHODS if m != "alti_logit")
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

    def example_completeness_error(self, layer, valid):
        return encoder.post_ln_example_completeness_error(layer, valid)

    def attention_block_output(self, layer):
        return layer.ln1_out

    def scope_maps(self, layer, valid, options):
        return component_scope_maps(
            layer, valid, options.chunk_rows, options.method, options.steps, options.contribution,
            options.ignore_low_gamma, options.memory_budget_mb,
        )


#: The layer kinds by topology name (a kind module adds its own with :func:`register_layer_kind`).
LAYER_KINDS: Dict[str, LayerKind] = {"post_ln": PostLNKind(), "pre_ln": PreLNKind()}


def register_layer_kind(kind: LayerKind) -> LayerKind:
    r"""Make ``kind`` the kind of the layers of topology ``kind.name`` (one of the description's topologies)."""
    if kind.name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {kind.name!r}; the descriptions know {TOPOLOGIES}")
    LAYER_KINDS[kind.name] = kind
    return kind


register_layer_kind(ParallelKind())
register_layer_kind(SandwichKind())


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
