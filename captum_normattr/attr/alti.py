r"""ALTI (Ferrando et al. 2022): L1-distance contributions rolled out over layers."""
from __future__ import annotations

from typing import Union

from torch import Tensor, nn

from captum_normattr.attr.base import LayerDecompositionAttribution
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.engine import LayerContribution
from captum_normattr.options import check_memory_budget

__all__ = ["ALTIAttribution", "ALTI_MEMORY_BUDGET_MB"]

#: Default memory for the explicit parts of one chunk of query rows, in MB.
ALTI_MEMORY_BUDGET_MB = 256.0


class ALTIAttribution(LayerDecompositionAttribution):
    r"""ALTI token attributions: c_ij = max(0, |y_i|_1 - |y_i - T_i(x_j)|_1), rolled out.

    Parts are built in chunks of query rows under ``memory_budget_mb``. Rows already
    sum to 1, so both rollout conventions agree. Does not depend on a target: ``decompose``
    and ``attribute`` take ``target=None`` only. The convergence delta is, per example, the
    largest completeness error of the attention-block parts over layers and real tokens.
    Post-LN encoders: T_i(x_j) are the LN1-output parts. Pre-LN decoders (GPT-2, Llama,
    Mistral, Qwen2): T_i(x_j) = h_{i<-j} = [i=j] x_i + sum_h alpha^h_ij f^h(LN1(x_j)) and
    y_i = h_i, the real residual stream after attention (b_O inside); the maps are causal.

    Args:
        model: a supported Hugging Face model.
        explained_position: explained row (None: 0 = [CLS] for encoders, ``"last"`` for decoders).
        rollout: ``"raw"`` (default) or ``"row_normalized"``.
        memory_budget_mb: memory for the explicit parts of one chunk of rows.
        strict: raise :class:`~captum_normattr.models.guard.ConsistencyError` instead of warning
            (:class:`~captum_normattr.models.guard.ConsistencyWarning`, once per call) when the
            model's real tensors disagree with what the decomposition assumes, or the attention
            block's completeness error is large (docs/reliability.md, "Consistency guards").

    Examples::

        >>> alti = ALTIAttribution(model)
        >>> scores = alti.attribute(ids, additional_forward_args=(mask,))
    """

    method_name = "ALTI"
    kind_method = "alti"

    def __init__(
        self,
        model: nn.Module,
        explained_position: Union[int, str, Tensor, None] = None,
        rollout: str = "raw",
        memory_budget_mb: float = ALTI_MEMORY_BUDGET_MB,
        strict: bool = False,
    ) -> None:
        super().__init__(model, explained_position, rollout, strict=strict)
        self.memory_budget_mb = check_memory_budget(memory_budget_mb)

    def layer_contribution(self, layer: LayerTensors, valid: Tensor, keep_maps: bool) -> LayerContribution:
        return LayerContribution(
            map=self.kind.alti_map(layer, valid, self.memory_budget_mb),
            errors=self.attention_block_errors(layer, valid),
        )
