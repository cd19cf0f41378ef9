r"""One object per layer kind: what every method asks of a layer, answered once per kind.

A layer kind owns its parts, the outputs of its scopes, its norm handling and its
completeness error. The Captum classes ask the kind of the layer they are given
(:func:`layer_kind`) and never branch on the architecture themselves.

============================  ===============================================================================
kind                          layer
============================  ===============================================================================
``post_ln``                   z = x + Attn(x), zt = LN1(z), y = LN2(zt + FF(zt)) (BERT-like encoders)
``pre_ln``                    h = x + Attn(LN1(x)), y = h + FF(LN2(h)); causal or not (the layer record says)
``parallel``                  y = x + Attn(N1(x)) + FF(N2(x)) (N1 and N2 may be one norm)
``sandwich``                  h = x + P1(Attn(N1(x))), y = h + P2(FF(N2(h))); P1, P2 frozen at their real
                              per-token scale (:mod:`~captum_normattr.decompose.kinds.sandwich`)
``single_branch``             y = x + B(N(x)), one branch per layer (a mixer or a feed-forward): the pre-LN
                              layer whose other branch is 0 (:mod:`~captum_normattr.decompose.kinds.single_branch`)
``sandwich_per_layer_input``  a sandwich layer plus Gemma 4's per-layer-input branch and layer scalar,
                              y = c (z + N(act(z W_g) * e_t) W_p)), values normalised per head and shared across
                              layers (:mod:`~captum_normattr.decompose.kinds.sandwich_per_layer_input`)
============================  ===============================================================================

Which family has which kind: the table of ``docs/architectures.md`` (generated from the registry).

The kind of a layer is chosen from its architecture description
(:attr:`captum_normattr.arch.spec.ArchitectureSpec.topology`); a topology that no kind
decomposes, or a method a kind does not implement, is refused with
:class:`~captum_normattr.arch.spec.UnsupportedModelError` (never decomposed as another kind).
The formulas are in ``docs/design.md`` ("Layer kinds"). Each kind is one module that owns
everything about its topology (maps, ALTI map, FF scopes, completeness, logit form, DecompX's
step, frozen layer and transpose, and its capture recipe):
:mod:`~captum_normattr.decompose.kinds.post_ln` (:class:`PostLNKind`),
:mod:`~captum_normattr.decompose.kinds.pre_ln` (:class:`PreLNKind`),
:mod:`~captum_normattr.decompose.kinds.parallel` (:class:`ParallelKind`),
:mod:`~captum_normattr.decompose.kinds.sandwich` (:class:`SandwichKind`) and
:mod:`~captum_normattr.decompose.kinds.single_branch` (:class:`SingleBranchKind`),

:mod:`~captum_normattr.decompose.kinds.sandwich_per_layer_input` (:class:`SandwichPerLayerInputKind`). :data:`LAYER_KINDS`
lists them, one line each; a user's own kind is added with :func:`register_layer_kind`.
"""
from __future__ import annotations

from typing import Dict, Union

from captum_normattr.arch.spec import TOPOLOGIES, UnsupportedModelError
from captum_normattr.decompose.kinds.base import KIND_METHODS, FFOptions, LayerKind
from captum_normattr.decompose.kinds.parallel import ParallelKind
from captum_normattr.decompose.kinds.post_ln import PostLNKind
from captum_normattr.decompose.kinds.pre_ln import PreLNKind
from captum_normattr.decompose.kinds.sandwich import SandwichKind
from captum_normattr.decompose.kinds.sandwich_per_layer_input import SandwichPerLayerInputKind
from captum_normattr.decompose.kinds.single_branch import SingleBranchKind

__all__ = [
    "KIND_METHODS", "FFOptions", "LAYER_KINDS", "LayerKind", "ParallelKind", "PostLNKind", "PreLNKind", "SandwichKind",
    "SandwichPerLayerInputKind", "SingleBranchKind", "layer_kind", "register_layer_kind",
]

#: The layer kinds by topology name: one instance per topology of the descriptions.
LAYER_KINDS: Dict[str, LayerKind] = {
    "post_ln": PostLNKind(),
    "pre_ln": PreLNKind(),
    "parallel": ParallelKind(),
    "sandwich": SandwichKind(),
    "single_branch": SingleBranchKind(),
    "sandwich_per_layer_input": SandwichPerLayerInputKind(),
}


def register_layer_kind(kind: LayerKind) -> LayerKind:
    r"""Make ``kind`` the kind of the layers of topology ``kind.name`` (one of the description's topologies).

    Args:
        kind: the kind object (a :class:`LayerKind`), replacing the listed one of that topology.

    Returns:
        ``kind``.

    Raises:
        ValueError: for a topology the descriptions do not know.
    """
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
