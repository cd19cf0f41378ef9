r"""GlobEnc (Modarressi et al. 2022) and the norm-based maps of Kobayashi et al. 2020/2021."""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor, nn

from captum_normattr.attr.base import LayerDecompositionAttribution
from captum_normattr.decompose.kinds.post_ln import GLOBENC_MAPS
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.engine import LayerContribution

__all__ = ["GlobEncAttribution"]


class GlobEncAttribution(LayerDecompositionAttribution):
    r"""Token attributions from norm-based layer maps rolled out over all layers.

    Every row of the GlobEnc table is available by ``map_name``:
    ``W`` (attention weights), ``W_FIXEDRES`` (0.5 W + 0.5 I), ``W_RES`` (W mixed with I by
    the N_ENC mixing ratio), ``N`` (Attn-N), ``N_FIXEDRES``, ``N_RES`` (AttnRes-N),
    ``N_RESLN`` (AttnResLn-N) and ``N_ENC`` (GlobEnc: both LayerNorms; the default).
    Computed exactly from per-token head Gram matrices: no (H, T, T, D) tensor is formed.
    The maps do not depend on a target (class-agnostic): ``decompose`` and ``attribute`` take
    ``target=None`` only. The convergence delta (``attribute(...,
    return_convergence_delta=True)``, ``decompose(...).delta``) is, per example, the largest
    completeness error of the attention-block parts over layers and real tokens.

    Pre-LN decoders (GPT-2, Llama, Mistral, Qwen2): ``W``, ``W_FIXEDRES``, ``N``,
    ``N_FIXEDRES``, ``N_RES`` (attention + residual, h_{i<-j}) and ``N_RESLN`` (the parts of
    the LN2 output, the default) are defined; ``N_ENC`` and ``W_RES`` raise (see
    :mod:`captum_normattr.decompose.kinds.pre_ln`). The explained row defaults to the last token.

    Args:
        model: a supported Hugging Face model (BERT, RoBERTa, ELECTRA, DistilBERT, GPT-2,
            Llama, Mistral, Qwen2).
        map_name: one of :data:`~captum_normattr.GLOBENC_MAPS`; None (default): ``"N_ENC"``
            for post-LN encoders, ``"N_RESLN"`` for pre-LN decoders.
        explained_position: explained row (None: 0 = [CLS] for encoders, ``"last"`` for decoders).
        rollout: ``"raw"`` (default) or ``"row_normalized"``.
        strict: raise :class:`~captum_normattr.models.guard.ConsistencyError` instead of warning
            (:class:`~captum_normattr.models.guard.ConsistencyWarning`, once per call) when the
            model's real tensors disagree with what the decomposition assumes, or the attention
            block's completeness error is large (docs/reliability.md, "Consistency guards").

    Examples::

        >>> model, tok = load_default_model()
        >>> batch = tok(["a gripping, funny film"], return_tensors="pt")
        >>> globenc = GlobEncAttribution(model)
        >>> scores = globenc.attribute(batch["input_ids"], additional_forward_args=(batch["attention_mask"],))
        >>> res = globenc.decompose(batch["input_ids"], additional_forward_args=(batch["attention_mask"],))
    """

    method_name = "GlobEnc"

    def __init__(
        self,
        model: nn.Module,
        map_name: Optional[str] = None,
        explained_position: Union[int, str, Tensor, None] = None,
        rollout: str = "raw",
        strict: bool = False,
    ) -> None:
        if map_name is not None and map_name not in GLOBENC_MAPS:
            raise ValueError(f"unknown map_name {map_name!r}; choose from {GLOBENC_MAPS}")
        super().__init__(model, explained_position, rollout, strict=strict)
        if map_name is None:
            map_name = self.kind.default_map
        try:
            self.kind.check_map(map_name)
        except ValueError as e:
            raise ValueError(f"{self.adapter.family}: {e}") from None
        self.map_name = map_name

    def layer_contribution(self, layer: LayerTensors, valid: Tensor, keep_maps: bool) -> LayerContribution:
        maps, ratios = self.kind.norm_maps(layer, valid, (self.map_name,))
        ratio_name = self.kind.mixing_ratio_name(self.map_name)
        return LayerContribution(
            map=maps[self.map_name],
            mixing_ratio=ratios.get(ratio_name) if ratio_name else None,
            errors=self.attention_block_errors(layer, valid),
        )

    def get_name(self) -> str:
        return f"GlobEnc ({self.map_name})"
