r"""ALTI (Ferrando et al. 2022): L1-distance contributions rolled out over layers."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.attr.base import LayerDecompositionAttribution
from captum_normattr.decompose.alti import rows_per_chunk
from captum_normattr.decompose.decoder import pre_ln_alti_map, pre_ln_completeness_error
from captum_normattr.decompose.encoder import post_ln_alti_map, post_ln_completeness_error
from captum_normattr.decompose.records import LayerTensors


class ALTIAttribution(LayerDecompositionAttribution):
    r"""ALTI token attributions: c_ij = max(0, |y_i|_1 - |y_i - T_i(x_j)|_1), rolled out.

    Parts are built in chunks of query rows under ``memory_budget_mb``. Rows already
    sum to 1, so both rollout conventions agree. Does not depend on ``target``.
    Post-LN encoders: T_i(x_j) are the LN1-output parts. Pre-LN decoders (GPT-2, Llama,
    Mistral, Qwen2): T_i(x_j) = h_{i<-j} = [i=j] x_i + sum_h alpha^h_ij f^h(LN1(x_j)) and
    y_i = h_i, the real residual stream after attention (b_O inside); the maps are causal.

    Args:
        model: a supported Hugging Face model.
        explained_position: explained row (None: 0 = [CLS] for encoders, ``"last"`` for decoders).
        rollout: ``"raw"`` (default) or ``"row_normalized"``.
        memory_budget_mb: memory for the explicit parts of one chunk of rows.

    Examples::

        >>> alti = ALTIAttribution(model)
        >>> scores = alti.attribute(ids, additional_forward_args=(mask,))
    """

    method_name = "ALTI"

    def __init__(
        self,
        model: nn.Module,
        explained_position: Union[int, str, Tensor, None] = None,
        rollout: str = "raw",
        memory_budget_mb: float = 1024.0,
    ) -> None:
        super().__init__(model, explained_position, rollout)
        if memory_budget_mb <= 0:
            raise ValueError("memory_budget_mb must be positive")
        self.memory_budget_mb = memory_budget_mb

    def _layer_maps(self, layers: List[LayerTensors], valid: Tensor) -> Tuple[Tensor, Optional[Tensor], Dict[str, Tensor]]:
        maps, errors = [], []
        for layer in layers:
            b, t, d = layer.hidden_in.shape
            chunk = rows_per_chunk(b, t, d, layer.hidden_in.element_size(), int(self.memory_budget_mb * 2**20))
            if layer.pre_ln:
                maps.append(pre_ln_alti_map(layer, valid, chunk, self.adapter.causal))
                errors.append(pre_ln_completeness_error(layer, valid))
            else:
                maps.append(post_ln_alti_map(layer, valid, chunk))
                errors.append(post_ln_completeness_error(layer, valid))
        return torch.stack(maps, 1), None, {"completeness_error": torch.stack(errors)}
