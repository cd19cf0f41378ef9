r"""GlobEnc (Modarressi et al. 2022) and the norm-based maps of Kobayashi et al. 2020/2021."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.attr.base import LayerDecompositionAttribution
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

    Args:
        model: a supported Hugging Face encoder (BERT, RoBERTa, ELECTRA, DistilBERT).
        map_name: one of :data:`~captum_normattr.GLOBENC_MAPS`.
        explained_position: explained row (0 = [CLS]).
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
        map_name: str = "N_ENC",
        explained_position: Union[int, str, Tensor] = 0,
        rollout: str = "raw",
    ) -> None:
        if map_name not in GLOBENC_MAPS:
            raise ValueError(f"unknown map_name {map_name!r}; choose from {GLOBENC_MAPS}")
        super().__init__(model, explained_position, rollout)
        if self.adapter.pre_ln:
            raise ValueError(f"GlobEncAttribution supports post-LN encoders; {self.adapter.family} is pre-LN")
        self.map_name = map_name

    def _layer_maps(self, layers: List[LayerTensors], valid: Tensor) -> Tuple[Tensor, Optional[Tensor], Dict[str, Tensor]]:
        maps, ratios = [], []
        errors = []
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
