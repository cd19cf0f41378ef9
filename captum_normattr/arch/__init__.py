r"""Architectures as data: the description of every supported family, and its registry.

See :mod:`captum_normattr.arch.spec` for the description and ``docs/architectures.md`` for
the table of registered families and how to add one.
"""
from captum_normattr.arch.registry import (
    ARCHITECTURES,
    ENCODER_DECODERS,
    lookup,
    lookup_encoder_decoder,
    register_architecture,
    supported_causal_families,
    supported_families,
)
from captum_normattr.arch.spec import (
    TOPOLOGIES,
    ArchitectureSpec,
    Attention,
    ClassifierHead,
    Experts,
    FeedForward,
    Head,
    Inputs,
    Layer,
    Norm,
    ValueProjection,
    Variant,
)

__all__ = [
    "ARCHITECTURES",
    "ENCODER_DECODERS",
    "ArchitectureSpec",
    "Attention",
    "ClassifierHead",
    "Experts",
    "FeedForward",
    "Head",
    "Inputs",
    "Layer",
    "Norm",
    "TOPOLOGIES",
    "ValueProjection",
    "Variant",
    "lookup",
    "lookup_encoder_decoder",
    "register_architecture",
    "supported_causal_families",
    "supported_families",
]
