r"""The architecture registry: every supported family's description, by key.

The docs' supported-models table, every error message that names the supported families
and the engine's lookup (:func:`lookup`) read this registry; nothing keeps a list of its own.
:func:`register_architecture` adds a family at run time. The descriptions are data: which
methods decompose a family is the layer kinds' to say, one floor up
(:func:`captum_normattr.models.adapters.family_methods`, which also renders the docs' tables).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from captum_normattr.arch.families import decoders as family_decoders

from captum_normattr.arch.families import encoders as family_encoders

from captum_normattr.arch.families import frontier as family_frontier

from captum_normattr.arch.families import gemma4 as family_gemma4
from captum_normattr.arch.families import hybrid as family_hybrid

from captum_normattr.arch.families import kimi as family_kimi

from captum_normattr.arch.families import moe as family_moe

from captum_normattr.arch.families import parallel as family_parallel

from captum_normattr.arch.families import seq2seq as family_seq2seq

from captum_normattr.arch.families import state_space as family_state_space
from captum_normattr.arch.families.vlm import VISION_LANGUAGE
from captum_normattr.arch.families.vlm_anyres import ANYRES_VISION_LANGUAGE
from captum_normattr.arch.families import base as family_base
from captum_normattr.arch.families.base import BUILTIN
from captum_normattr.arch.spec import ArchitectureSpec

__all__ = [
    "ARCHITECTURES",
    "ENCODER_DECODERS",
    "lookup_encoder_decoder",
    "REFUSED",
    "refusal",
    "refused_table_markdown",
    "lookup",
    "register_architecture",
    "supported_causal_families",
    "supported_families",
    "VISION_LANGUAGE",
]

#: The registered descriptions by key (built-ins first, then :func:`register_architecture`'s).
#: Order (the docs' table): the text families of ``families``, the family groups, the vision families.
ARCHITECTURES: Dict[str, ArchitectureSpec] = dict(
    [e for e in BUILTIN if e[1].modality == "text"]
    + [e for group in (family_parallel, family_moe, family_decoders, family_frontier, family_gemma4, family_hybrid,
                    family_kimi,
                    family_state_space, family_encoders)
       for e in group.BUILTIN]
    + [e for e in BUILTIN if e[1].modality != "text"]
)
VISION_LANGUAGE.update(ANYRES_VISION_LANGUAGE)  # LLaVA-NeXT / OneVision (any-resolution tiles)
#: The registered encoder-decoder (two-stack) descriptions by key, explained by ALTIPlusAttribution.
ENCODER_DECODERS: Dict[str, ArchitectureSpec] = dict(family_seq2seq.BUILTIN)
#: ``config.model_type`` -> (family, why it is not supported): the family groups' refusals
REFUSED: Dict[str, Tuple[str, str]] = {k: v for k, v in {**family_base.REFUSED, **family_frontier.REFUSED,
                                                                   **family_gemma4.REFUSED}.items()
                                       if k not in ARCHITECTURES}


def register_architecture(spec: ArchitectureSpec, key: Optional[str] = None, replace: bool = False) -> ArchitectureSpec:
    r"""Add (or, with ``replace``, overwrite) a family description.

    Args:
        spec: the :class:`~captum_normattr.arch.spec.ArchitectureSpec`.
        key: the registry key (default: the first model type).
        replace: allow overwriting a key, or serving a model type another entry serves.

    Returns:
        ``spec``.

    Raises:
        ValueError: the key or one of the model types is taken and ``replace`` is False.

    Examples::

        >>> spec = dataclasses.replace(ARCHITECTURES["llama"], family="MyLlama", model_types=("my_llama",))
        >>> register_architecture(spec) is spec
        True
    """
    if not isinstance(spec, ArchitectureSpec):
        raise TypeError(f"register_architecture takes an ArchitectureSpec, got {type(spec).__name__}")
    key = key or spec.model_types[0]
    registry = ENCODER_DECODERS if spec.is_encoder_decoder else ARCHITECTURES  # two stacks: ALTI+'s registry
    if not replace:
        if key in ARCHITECTURES or key in ENCODER_DECODERS:
            raise ValueError(f"architecture {key!r} is already registered (pass replace=True to overwrite it)")
        taken = [(t, k) for k, s in {**ARCHITECTURES, **ENCODER_DECODERS}.items() for t in spec.model_types
                 if t in s.model_types]
        if taken:
            raise ValueError(
                f"model type(s) {[t for t, _ in taken]} are already served by {sorted({k for _, k in taken})} "
                "(pass replace=True to take them over)"
            )
    else:
        for reg in (ARCHITECTURES, ENCODER_DECODERS):
            for k in [k for k, s in reg.items() if (k == key and reg is not registry)
                      or (k != key and set(s.model_types) & set(spec.model_types))]:
                del reg[k]
    registry[key] = spec
    return spec


def _variant(spec: ArchitectureSpec, config: Any) -> ArchitectureSpec:
    r"""The first variant of ``spec`` that ``config`` selects, itself refined by its own variants (Falcon's
    architecture flags select a layout, then a norm arrangement), or ``spec``."""
    for variant in spec.variants:
        got = getattr(config, variant.attribute, None) if config is not None else None
        if config is not None and hasattr(config, variant.attribute) and (
                bool(got) if variant.value is ... else got == variant.value):
            return _variant(variant.spec, config)
    return spec


def _lookup(registry: Dict[str, ArchitectureSpec], model_type: Optional[str], config: Any) -> Optional[ArchitectureSpec]:
    for spec in reversed(list(registry.values())):  # a later registration wins
        if model_type in spec.model_types:
            return _variant(spec, config)
    return None


def lookup(model_type: Optional[str], config: Any = None) -> Optional[ArchitectureSpec]:
    r"""The one-stack description serving ``model_type`` (its config variant when ``config`` selects one, and that
    variant's own variant, and so on), or None."""
    return _lookup(ARCHITECTURES, model_type, config)


def lookup_encoder_decoder(model_type: Optional[str], config: Any = None) -> Optional[ArchitectureSpec]:
    r"""The encoder-decoder description serving ``model_type`` (its config variant, as :func:`lookup`), or None."""
    return _lookup(ENCODER_DECODERS, model_type, config)


def supported_families(modality: Optional[str] = None, model_types: bool = True) -> str:
    r"""Readable list of the registered families (of one modality, or all), with their model types."""
    return ", ".join(
        f"{s.family} ({'/'.join(s.model_types)})" if model_types else s.family
        for s in ARCHITECTURES.values() if modality in (None, s.modality)
    )


def supported_causal_families() -> str:
    r"""Readable list of the registered causal (decoder) families, for messages about LM heads and decoders."""
    return ", ".join(s.family for s in ARCHITECTURES.values() if s.causal)


def refusal(model_type: Optional[str], config: Any = None) -> Optional[str]:
    r"""Why a model type without a description is not supported, or None when nothing is known about it.

    The families refused on purpose (:data:`REFUSED`: state-space and recurrent models, Swin, Funnel,
    ALBERT, and the frontier families that need a mechanism no layer kind expresses), a config that
    looks like a state-space model (a ``state_size`` and no attention heads), and encoder-decoder
    models (explained by :class:`~captum_normattr.ALTIPlusAttribution`, not by the encoder/decoder
    methods).
    """
    if model_type in REFUSED:
        family, why = REFUSED[model_type]
        return f"{family} ({model_type}) is not supported: {why}."
    heads = any(getattr(config, name, None) for name in ("num_attention_heads", "n_head", "num_heads"))
    if config is not None and getattr(config, "state_size", None) is not None and not heads:
        return f"{model_type!r} is not supported: it is not an attention model (a state-space model, no attention heads)."
    if getattr(config, "is_encoder_decoder", False):
        return (
            f"{model_type!r} is an encoder-decoder model: GlobEnc, ALTI, DecompX and ALTI-Logit explain encoders and "
            "decoders; use ALTIPlusAttribution for encoder-decoder models (docs/seq2seq.md; supported: "
            + ", ".join(s.family for s in ENCODER_DECODERS.values()) + ")."
        )
    return None


def refused_table_markdown() -> str:
    r"""The docs' table of the families refused on purpose and why, rendered from :data:`REFUSED`."""
    rows = ["| family | model type | why it is refused |", "|---|---|---|"]
    for model_type, (family, why) in REFUSED.items():
        rows.append(f"| {family} | `{model_type}` | {why} |")
    return "\n".join(rows)
