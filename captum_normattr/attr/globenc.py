r"""GlobEnc (Modarressi et al. 2022) and the norm-based maps of Kobayashi et al. 2020/2021."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.attr.base import LayerDecompositionAttribution
from captum_normattr.decompose.decoder import (
    PRE_LN_DEFAULT_MAP,
    PRE_LN_NORM_MAPS,
    check_pre_ln_map,
    pre_ln_completeness_error,
    pre_ln_layer_maps,
)
from captum_normattr.decompose.encoder import GLOBENC_MAPS, NORM_MAPS, post_ln_completeness_error, post_ln_layer_maps
from captum_normattr.decompose.records import LayerTensors


class GlobEncAttribution(LayerDecompositionAttribution):
    r"""Token attributions from norm-based layer maps rolled out over all layers.

    Every row of the GlobEnc table is available by ``map_name``:
    ``W`` (attention weights), ``W_FIXEDRES`` (0.5 W + 0.5 I), ``W_RES`` (W mixed with I by
    the N_ENC mixing ratio), ``N`` (Attn-N), ``N_FIXEDRES``, ``N_RES`` (AttnRes-N),
    ``N_RESLN`` (AttnResLn-N) and ``N_ENC`` (GlobEnc: both LayerNorms; the default).
    Computed exactly from per-token head Gram matrices: no (H, T, T, D) tensor is formed.
    The maps do not depend on ``target`` (class-agnostic).

    Pre-LN decoders (GPT-2, Llama, Mistral, Qwen2): ``W``, ``W_FIXEDRES``, ``N``,
    ``N_FIXEDRES``, ``N_RES`` (attention + residual, h_{i<-j}) and ``N_RESLN`` (the parts of
    the LN2 output, the default) are defined; ``N_ENC`` and ``W_RES`` raise (see
    :mod:`captum_normattr.decompose.decoder`). The explained row defaults to the last token.

    Args:
        model: a supported Hugging Face model (BERT, RoBERTa, ELECTRA, DistilBERT, GPT-2,
            Llama, Mistral, Qwen2).
        map_name: one of :data:`~captum_normattr.GLOBENC_MAPS`; None (default): ``"N_ENC"``
            for post-LN encoders, ``"N_RESLN"`` for pre-LN decoders.
        explained_position: explained row (None: 0 = [CLS] for encoders, ``"last"`` for decoders).
        rollout: ``"raw"`` (default) or ``"row_normalized"``.

    Examples::

        >>> model, tok = load_default_model()
        >>> batch = tok(["a gripping, funny film"], return_tensors="pt")
        >>> globenc = GlobEncAttribution(model)
        >>> scores = globenc.attribute(batch["input_ids"], additional_forward_args=(batch["attention_mask"],))
    """

    def __init__(
        self,
        model: nn.Module,
        map_name: Optional[str] = None,
        explained_position: Union[int, str, Tensor, None] = None,
        rollout: str = "raw",
    ) -> None:
        if map_name is not None and map_name not in GLOBENC_MAPS:
            raise ValueError(f"unknown map_name {map_name!r}; choose from {GLOBENC_MAPS}")
        super().__init__(model, explained_position, rollout)
        if map_name is None:
            map_name = PRE_LN_DEFAULT_MAP if self.adapter.pre_ln else "N_ENC"
        if self.adapter.pre_ln:
            try:
                check_pre_ln_map(map_name)
            except ValueError as e:
                raise ValueError(f"{self.adapter.family}: {e}") from None
        self.map_name = map_name

    def _layer_maps(self, layers: List[LayerTensors], valid: Tensor) -> Tuple[Tensor, Optional[Tensor], Dict[str, Tensor]]:
        maps, ratios = [], []
        errors = []
        if self.adapter.pre_ln:
            for layer in layers:
                m, r = pre_ln_layer_maps(layer, valid, (self.map_name,), self.adapter.causal)
                maps.append(m[self.map_name])
                ratios.append(r.get(self.map_name) if self.map_name in PRE_LN_NORM_MAPS else None)
                errors.append(pre_ln_completeness_error(layer, valid))
            mixing = torch.stack(ratios, 1) if all(r is not None for r in ratios) else None
            return torch.stack(maps, 1), mixing, {"completeness_error": torch.stack(errors)}
        for layer in layers:
            m, r = post_ln_layer_maps(layer, valid, (self.map_name,))
            maps.append(m[self.map_name])
            ratio_name = self.map_name if self.map_name in NORM_MAPS else ("N_ENC" if self.map_name == "W_RES" else None)
            ratios.append(r.get(ratio_name) if ratio_name else None)
            errors.append(post_ln_completeness_error(layer, valid))
        mixing = torch.stack(ratios, 1) if all(r is not None for r in ratios) else None
        return torch.stack(maps, 1), mixing, {"completeness_error": torch.stack(errors)}

    def get_name(self) -> str:
        return f"GlobEnc ({self.map_name})"
