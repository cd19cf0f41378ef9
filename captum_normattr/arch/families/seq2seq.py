r"""Encoder-decoder family descriptions (two stacks; the decoder layer has a cross-attention branch).

Explained by ``ALTIPlusAttribution`` (``docs/seq2seq.md``): the engine reads, per attention
block, the branch module (its real probabilities and values), the output projection, the
residual the block adds and the block's real output, all derived from these descriptions
(:func:`captum_normattr.models.seq2seq.seq2seq_adapter`). ``BUILTIN`` lists them by registry
key; :mod:`captum_normattr.arch.registry` keeps them apart from the one-stack families
(:data:`~captum_normattr.arch.registry.ENCODER_DECODERS`).
"""
from __future__ import annotations

from typing import Tuple

from captum_normattr.arch.spec import (
    ArchitectureSpec,
    Attention,
    FeedForward,
    Head,
    Layer,
    Norm,
    ValueProjection,
    Variant,
)

__all__ = ["BART", "BUILTIN", "M2M100", "MARIAN", "MBART", "PEGASUS", "T5"]


def _bart_attention(module: str, pre_norm: Norm = None) -> Attention:
    return Attention(module, out=f"{module}.out_proj", value=ValueProjection(f"{module}.v_proj"), pre_norm=pre_norm)


def _bart_like(family: str, model_type: str, pre_ln: bool, notes: str) -> ArchitectureSpec:
    r"""BART's layer layout; post-LN (BART, Marian: a LayerNorm after each residual join) or pre-LN
    (mBART, M2M100/NLLB, Pegasus: each branch's LayerNorm on its input)."""
    self_norm, cross_norm, ff_norm = Norm("self_attn_layer_norm"), Norm("encoder_attn_layer_norm"), Norm("final_layer_norm")
    ff = FeedForward(up="fc1", act="activation_fn", down="fc2", pre_norm=ff_norm if pre_ln else None)
    if pre_ln:
        encoder = Layer(attention=_bart_attention("self_attn", self_norm), ff=ff)
        decoder = Layer(attention=_bart_attention("self_attn", self_norm), ff=ff,
                        cross_attention=_bart_attention("encoder_attn", cross_norm))
    else:
        encoder = Layer(attention=_bart_attention("self_attn"), ff=ff, stream_norms=(self_norm, ff_norm))
        decoder = Layer(attention=_bart_attention("self_attn"), ff=ff, cross_attention=_bart_attention("encoder_attn"),
                        stream_norms=(self_norm, cross_norm, ff_norm))
    final = Head(final_norm=Norm("decoder.layer_norm") if pre_ln else None, lm_head="lm_head")
    return ArchitectureSpec(family=family, model_types=(model_type,), layers="encoder.layers", layer=encoder,
                            decoder_layers="decoder.layers", decoder_layer=decoder, head=final, notes=notes)


def _t5_attention(sub: int, module: str) -> Attention:
    path = f"layer.{sub}.{module}"
    return Attention(path, out=f"{path}.o", value=ValueProjection(f"{path}.v"),
                     pre_norm=Norm(f"layer.{sub}.layer_norm", "rmsnorm"))


def _t5(gated: bool) -> ArchitectureSpec:
    r"""T5 / mT5: sub-layers ``layer.0`` (self-attention), ``layer.1`` (cross-attention, decoder),
    then the FF sub-layer; T5's scale-only norm (an RMSNorm without bias); no biases; relative
    position bias (inside the recorded probabilities); mT5 / T5 v1.1 use a gated FF."""
    def ff(sub: int) -> FeedForward:
        dense = f"layer.{sub}.DenseReluDense"
        norm = Norm(f"layer.{sub}.layer_norm", "rmsnorm")
        if gated:
            return FeedForward(up=f"{dense}.wi_1", gate=f"{dense}.wi_0", act=f"{dense}.act", down=f"{dense}.wo", pre_norm=norm)
        return FeedForward(up=f"{dense}.wi", act=f"{dense}.act", down=f"{dense}.wo", pre_norm=norm)

    return ArchitectureSpec(
        family="T5/mT5", model_types=("t5", "mt5"), layers="encoder.block",
        layer=Layer(attention=_t5_attention(0, "SelfAttention"), ff=ff(1)),
        decoder_layers="decoder.block",
        decoder_layer=Layer(attention=_t5_attention(0, "SelfAttention"), cross_attention=_t5_attention(1, "EncDecAttention"),
                            ff=ff(2)),
        head=Head(final_norm=Norm("decoder.final_layer_norm", "rmsnorm"), lm_head="lm_head"),
        notes="relative position bias (recorded)" + ("; gated FF" if gated else ""),
        variants=() if gated else (Variant("is_gated_act", True, _t5(True)),),
    )


BART = _bart_like("BART", "bart", False, "learned positions, counted from the first slot")
MARIAN = _bart_like("Marian", "marian", False, "sinusoidal positions, counted from the first slot")
MBART = _bart_like("mBART", "mbart", True, "learned positions, counted from the first slot")
M2M100 = _bart_like("M2M100/NLLB", "m2m_100", True, "sinusoidal positions, counted over non-pad tokens")
PEGASUS = _bart_like("Pegasus", "pegasus", True, "sinusoidal positions, counted from the first slot")
T5 = _t5(False)

#: Every built-in encoder-decoder description, by registry key.
BUILTIN: Tuple[Tuple[str, ArchitectureSpec], ...] = (
    ("bart", BART), ("marian", MARIAN), ("mbart", MBART), ("m2m_100", M2M100), ("pegasus", PEGASUS), ("t5", T5),
)
