r"""Plain data records that flow from tensor capture into the decomposition math."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import torch
from torch import Tensor

__all__ = ["FFParams", "LayerTensors", "NormParams"]


@dataclass
class NormParams:
    r"""Parameters of one LayerNorm or RMSNorm.

    Args:
        weight: gamma, shape (D,), or None for no affine scale.
        bias: beta, shape (D,), or None (always None for RMSNorm).
        eps: the epsilon inside the square root.
        kind: ``"layernorm"``, ``"rmsnorm"`` or ``"identity"`` (an ``nn.Identity`` module in a
            norm's place, as ModernBERT's first attention norm: scale 1, no centering, no parameters).
    """

    weight: Optional[Tensor]
    bias: Optional[Tensor]
    eps: float
    kind: str = "layernorm"


@dataclass
class FFParams:
    r"""Weights of one feed-forward block, as right-multiplied matrices.

    FF(u) = act(u W_in + b_in) W_out + b_out, or for a gated block (Llama family)
    FF(u) = (act(u W_gate + b_gate) * (u W_in + b_in)) W_out + b_out.

    Attributes:
        w_in: (D, F). b_in: (F,) or None.
        w_out: (F, D). b_out: (D,) or None.
        act: the elementwise activation (a callable module or function).
        w_gate: (D, F) or None (not gated). b_gate: (F,) or None.
        hidden_scale: (B, T, F) a per-token factor on every hidden neuron, or None (1):
            FF(u_i) = ((g(u_i W_gate + b_gate) * (u_i W_in + b_in)) * hidden_scale_i) W_out + b_out,
            frozen at the real forward pass. A mixture of experts is this FF with the experts'
            hidden neurons side by side (F = E F_e [+ F_shared]) and the factor the routing
            weight of the token's chosen experts (0 for the others; the shared expert's
            sigmoid gate): ``docs/architectures.md``, "Mixtures of experts". Gated FFs only.
        gate_scale: (B, T, F) a per-token factor on every gate pre-activation, or None (1):
            the gate reads g((u_i W_gate + b_gate) * gate_scale_i), frozen at the real forward pass.
            Llama 4's experts read the routing-scaled input, FF_e(r u) = (g(r u W_gate) * (r u W_up)) W_down:
            gate_scale r and hidden_scale r (``docs/frontier.md``, "Input-scaled experts"). Gated FFs only.
    """

    w_in: Tensor
    b_in: Optional[Tensor]
    w_out: Tensor
    b_out: Optional[Tensor]
    act: Callable[[Tensor], Tensor]
    w_gate: Optional[Tensor] = None
    b_gate: Optional[Tensor] = None
    hidden_scale: Optional[Tensor] = None
    gate_scale: Optional[Tensor] = None

    def __post_init__(self) -> None:
        if self.gate_scale is not None and self.w_gate is None:
            raise ValueError("FFParams: a per-token gate scale (input-scaled experts) is supported for gated FFs only")
        if self.hidden_scale is not None and self.w_gate is None:
            raise ValueError("FFParams: a per-token hidden scale (experts) is supported for gated FFs only")

    @property
    def gated(self) -> bool:
        return self.w_gate is not None

    @property
    def width(self) -> int:
        r"""F, the inner width."""
        return int(self.w_out.shape[0])


@dataclass
class LayerTensors:
    r"""Everything the decompositions need from one Transformer layer, for one batch.

    All tensors are in the compute dtype (float32 or float64) and on one device.

    Attributes:
        hidden_in: layer input x, (B, T, D).
        probs: attention probabilities alpha, (B, H, T, T), rows = queries.
        values: value states v per query head (GQA already repeated), (B, H, T, Dh).
            The value bias b_V is inside.
        out_weight: output projection as a right-multiplied matrix, (H * Dh, D).
        out_bias: output projection bias b_O, (D,) or None.
        ln1: parameters of the first norm (post-LN: after attention + residual;
            pre-LN: before attention).
        ln1_in / ln1_out: the real input and output of that norm, (B, T, D).
        ln2: parameters of the second norm.
        ln2_in / ln2_out: the real input and output of that norm, (B, T, D).
        ff_out: the real output of the feed-forward block (before the residual), (B, T, D).
        layer_out: the real output of the layer, (B, T, D).
        ff: the feed-forward weights, :class:`FFParams`.
        causal: True when the self-attention is causal (decoders): every map is
            lower-triangular and chunked paths skip the all-zero upper triangle.
        index: the layer's position in the stack (0 = first).
        context: the attention context sum_j alpha^h_ij v^h_j that the recording attention
            computed, (B, T, H, Dh) (query-major, as it enters W_O), or None (then it is
            recomputed from ``probs`` and ``values`` where needed).
        checks: relative differences (0-dim tensors) between the model's real tensors and the
            ones the decomposition assumes, by check name (attention input, norm rebuilt from
            its input, residual joins, ...; :mod:`captum_normattr.decompose.primitives.guards`), filled by
            the capture and judged by :class:`captum_normattr.models.guard.ConsistencyGuard`.
        source_dtype: the dtype the model computed the recorded tensors in (before the cast
            to the compute dtype); sets the tolerance of the checks. None: the compute dtype.
        topology: the layer's topology kind (``"post_ln"``, ``"pre_ln"``, ``"sandwich"``,
            ``"parallel"``, ``"single_branch"``; :data:`captum_normattr.arch.spec.TOPOLOGIES`), from the description;
            what a method asks of the layer it asks its kind
            (:func:`captum_normattr.decompose.kinds.registry.layer_kind`).
        attn_post / ff_post: parameters of the norms on the branch outputs (sandwich), or None.
        attn_post_in / attn_post_out: the real input (the attention branch output) and output
            (what joins the residual) of the attention post-norm, (B, T, D), or None.
        ff_post_in / ff_post_out: the same for the feed-forward post-norm (its input is
            ``ff_out``), or None.
        attn_branch_out: the real output of the attention branch as it joins the residual
            (the output projection's output; parallel layers, which never form x + Attn), or None.
        ff_input_key: the field holding the feed-forward block's real input (:attr:`ff_input`),
            as the layer's kind declares it (``CaptureRecipe.ff_input``; filled by the capture).
        extras: what a layer kind reads beyond these fields, by name, filled by its capture
            (the per-layer-input kind: the per-layer input, the routing of its expert block, the
            layer module whose weights its step reads, the forward pass's shared value parts;
            :mod:`captum_normattr.decompose.kinds.sandwich_per_layer_input`); empty for the others.
        own_after: (B, T, D) vectors the model adds to the stream right after this layer, each a function of the
            token at its position alone (Qwen3-VL's DeepStack features on the image tokens; 0 elsewhere), or None.
            :attr:`layer_out` already includes them (it is the stream the next layer reads); the pre-LN kind gives
            the vector at position t to token t's own part (docs/vlm.md, "Qwen3-VL (DeepStack)").
    """

    hidden_in: Tensor
    probs: Tensor
    values: Tensor
    out_weight: Tensor
    out_bias: Optional[Tensor]
    ln1: NormParams
    ln1_in: Tensor
    ln1_out: Tensor
    ln2: NormParams
    ln2_in: Tensor
    ln2_out: Tensor
    ff_out: Tensor
    layer_out: Tensor
    ff: Optional[FFParams] = None
    causal: bool = False
    index: int = 0
    context: Optional[Tensor] = None
    checks: Dict[str, Tensor] = field(default_factory=dict)
    source_dtype: Optional[torch.dtype] = None
    topology: str = "post_ln"
    attn_post: Optional[NormParams] = None
    attn_post_in: Optional[Tensor] = None
    attn_post_out: Optional[Tensor] = None
    ff_post: Optional[NormParams] = None
    ff_post_in: Optional[Tensor] = None
    ff_post_out: Optional[Tensor] = None
    attn_branch_out: Optional[Tensor] = None
    ff_input_key: str = "ln2_out"
    extras: Dict[str, Any] = field(default_factory=dict)
    own_after: Optional[Tensor] = None

    @property
    def ff_input(self) -> Tensor:
        r"""The feed-forward branch's real input u, (B, T, D): the field :attr:`ff_input_key` names.

        The second norm's output in a pre-LN, parallel or sandwich layer, the first norm's
        output (the attention block's, which the FF reads) in a post-LN layer.
        """
        return getattr(self, self.ff_input_key)

    @property
    def num_heads(self) -> int:
        return self.probs.shape[1]

    def head_out_weight(self) -> Tensor:
        r"""The output projection split per head: (H, Dh, D)."""
        h = self.num_heads
        return self.out_weight.reshape(h, -1, self.out_weight.shape[-1])

    def attention_sum(self) -> Tensor:
        r"""sum_j sum_h alpha^h_ij v^h_j W_O^h (bias b_O excluded), (B, T, D).

        From the recorded :attr:`context` (the one product the forward pass computed)
        when there is one, else recomputed from ``probs`` and ``values``.
        """
        b, h, t, dh = self.values.shape
        if self.context is not None:
            return self.context.reshape(b, t, h * dh) @ self.out_weight
        ctx = self.probs @ self.values  # (B, H, T, Dh)
        return ctx.transpose(1, 2).reshape(b, t, h * dh) @ self.out_weight
