r"""Exact token-to-token mixing of linear-attention and state-space mixers (docs/linear_mixers.md).

A gated linear recurrence is linear in its values once its data-dependent coefficients (decays,
the delta rule's :math:`\beta`, the short convolution's activation slope, the gated output norm's
per-target scale) are taken from the real forward pass, exactly as softmax attention is linear in
its values once its probabilities are recorded. This module turns those recorded coefficients
into the implicit per-channel mixing tensor

.. math::

    \mathrm{out}_{t,c} = \sum_s G_{t,s,c}\, u_{s,c} + n_{t,c}

where :math:`u` are the mixer's values *before* its causal convolution (a linear projection of the
layer input, so a family composes :math:`G` with that projection as attention composes its
probabilities with :math:`W_V`), and :math:`n` is the no-token term (the convolution's bias).

Two recurrences are covered, both as pure tensor functions (no model is imported here):

* **Gated DeltaNet** (transformers ``qwen3_next`` / Qwen3.5 ``Qwen3NextGatedDeltaNet``):
  :math:`S_t = \alpha_t (I - \beta_t k_t k_t^\top) S_{t-1} + \beta_t k_t v_t^\top`,
  :math:`o_t = S_t^\top q_t` (:func:`delta_rule_mixing`);
* **Mamba-2** SSD (transformers ``mamba2`` / ``granitemoehybrid`` / ``nemotron_h``):
  :math:`h_t = e^{\Delta_t A} h_{t-1} + \Delta_t B_t x_t^\top`, :math:`y_t = C_t^\top h_t + D x_t`
  (:func:`ssd_mixing`).

Both then pass through :func:`conv_composed_mixing` (the value path's depthwise causal convolution,
its SiLU slope and the gated RMSNorm's per-target scale composed in), and
:func:`apply_channel_mixing` reproduces the mixer's output from :math:`G` and the values
(completeness). :func:`gated_delta_net_mixing` and :func:`mamba2_mixing` chain the steps.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "apply_channel_mixing",
    "conv_composed_mixing",
    "delta_rule_mixing",
    "gated_delta_net_mixing",
    "gated_rmsnorm_scale",
    "mamba2_mixing",
    "silu_slope",
    "ssd_mixing",
]


def silu_slope(pre_activation: Tensor) -> Tensor:
    r"""The activation slope :math:`\mathrm{silu}(a)/a` of a SiLU, recorded at its real input.

    :math:`\mathrm{silu}(a) = a\,\sigma(a)`, so the slope is exactly :math:`\sigma(a)` (no division,
    defined at :math:`a = 0`): ``silu(a) == silu_slope(a) * a``.

    Args:
        pre_activation: any shape, the input of the SiLU (the causal convolution's output).

    Returns:
        Same shape, :math:`\sigma(a)`.

    Examples::

        >>> a = torch.tensor([-1.0, 0.0, 2.0])
        >>> torch.allclose(silu_slope(a) * a, torch.nn.functional.silu(a))
        True
    """
    return torch.sigmoid(pre_activation)


def _head_of_channel(mixing: Tensor, channels: int) -> Tensor:
    r"""(B, H, T, S) per head -> (B, T, S, C), each head's matrix repeated over its C / H channels."""
    heads = mixing.shape[1]
    if channels % heads:
        raise ValueError(f"{channels} value channels do not split into {heads} heads")
    return mixing.permute(0, 2, 3, 1).repeat_interleave(channels // heads, dim=-1)


def delta_rule_mixing(query: Tensor, key: Tensor, beta: Tensor, log_decay: Tensor,
                      scale: Optional[float] = None, block: int = 64) -> Tensor:
    r"""Implicit value mixing :math:`M_h[t, s]` of the gated delta rule (Gated DeltaNet).

    The recurrence of transformers' ``torch_recurrent_gated_delta_rule`` (and of the chunked kernel,
    which computes the same function) is, per value head, with the state :math:`S` of shape
    (d_k, d_v), :math:`\alpha_t = e^{g_t}` and :math:`\tilde q_t = \text{scale}\cdot q_t`:

    .. math::

        S_t = (I - \beta_t k_t k_t^\top)\,\alpha_t S_{t-1} + \beta_t k_t v_t^\top, \qquad
        o_t = S_t^\top \tilde q_t,

    (decay first, then the delta update, then the read), hence
    :math:`o_t = \sum_{s \le t} M[t, s]\, v_s` with the scalar

    .. math::

        M[t, s] = \beta_s\, k_s^\top A_{s+1} A_{s+2} \cdots A_t\, \tilde q_t, \qquad
        A_r = \alpha_r (I - \beta_r k_r k_r^\top)

    (:math:`A_r` is symmetric). Kimi Delta Attention (KDA, Kimi Linear) decays each key channel
    by its own gate, :math:`S_t = (I - \beta_t k_t k_t^\top)\,\mathrm{diag}(\alpha_t) S_{t-1} +
    \beta_t k_t v_t^\top`: then :math:`A_r = (I - \beta_r k_r k_r^\top)\mathrm{diag}(\alpha_r)` and
    :math:`M[t, s] = \beta_s\, \tilde q_t^\top A_t \cdots A_{s+1} k_s` (pass a (B, T, H, d_k)
    ``log_decay``). It is computed backwards over blocks of sources
    :math:`[s_0, s_1)`: a (B, H, T, d_k) buffer holds :math:`A_{s_1} \cdots A_t \tilde q_t` for
    every later target; the block's columns are :math:`\beta_s y_s \cdot` that buffer with
    :math:`y_s = A_{s_1-1} \cdots A_{s+1} k_s`, the targets inside the block come from a
    per-source sweep, and the buffer moves on by the block's product
    :math:`A_{s_0} \cdots A_{s_1-1}` (a d_k x d_k matrix). Cost :math:`O(T^2 d_k (1 + d_k /
    \text{block}))` per head in matrix products; memory that of the output.

    Args:
        query: (B, T, H_k, d_k) queries as the kernel reads them (after the convolution, SiLU and
            L2 normalisation, before the :math:`d_k^{-1/2}` scaling).
        key: (B, T, H_k, d_k) keys, likewise (L2-normalised).
        beta: (B, T, H) the writing strength :math:`\beta = \sigma(b)`, one per value head
            (``H`` a multiple of ``H_k``: each query/key head serves ``H // H_k`` consecutive
            value heads, as ``repeat_interleave`` in the kernel).
        log_decay: (B, T, H) :math:`g_t \le 0` (:math:`\alpha_t = e^{g_t}`), or (B, T, H, d_k) for
            a per-key-channel decay (KDA).
        scale: the query scaling; default :math:`d_k^{-1/2}` as in the kernel.
        block: sources per block (any value gives the same numbers up to rounding).

    Returns:
        (B, H, T, S) with ``S == T``, zero above the diagonal (causal).

    Examples::

        >>> q = torch.nn.functional.normalize(torch.randn(1, 5, 2, 4, dtype=torch.float64), dim=-1)
        >>> k = torch.nn.functional.normalize(torch.randn(1, 5, 2, 4, dtype=torch.float64), dim=-1)
        >>> m = delta_rule_mixing(q, k, torch.rand(1, 5, 2, dtype=torch.float64),
        ...                       -torch.rand(1, 5, 2, dtype=torch.float64))
        >>> tuple(m.shape)
        (1, 2, 5, 5)
    """
    if query.shape != key.shape or query.dim() != 4:
        raise ValueError(f"query and key must both be (B, T, H_k, d_k); got {tuple(query.shape)} and {tuple(key.shape)}")
    batch, length, key_heads, key_dim = key.shape
    heads = beta.shape[-1]
    if beta.shape != (batch, length, heads) or log_decay.shape not in (beta.shape, (*beta.shape, key_dim)):
        raise ValueError(f"beta must be (B, T, H) = {(batch, length, heads)} and log_decay (B, T, H) or "
                         f"(B, T, H, d_k); got {tuple(beta.shape)} and {tuple(log_decay.shape)}")
    if heads % key_heads:
        raise ValueError(f"{heads} value heads are not a multiple of {key_heads} key heads")
    if heads != key_heads:
        query = query.repeat_interleave(heads // key_heads, dim=2)
        key = key.repeat_interleave(heads // key_heads, dim=2)
    if block < 1:
        raise ValueError(f"block must be a positive number of tokens; got {block}")
    scale = key_dim ** -0.5 if scale is None else scale
    q = (query * scale).transpose(1, 2).contiguous()  # (B, H, T, d_k); contiguous: strided views make the
    k = key.transpose(1, 2).contiguous()  # small products below orders of magnitude slower
    b = beta.transpose(1, 2).contiguous()  # (B, H, T)
    # (B, H, T, 1) for a scalar decay per head, (B, H, T, d_k) for a per-channel one (KDA)
    alpha = (log_decay if log_decay.dim() == 4 else log_decay.unsqueeze(-1)).transpose(1, 2).exp().contiguous()
    mixing = q.new_zeros(batch, heads, length, length)
    # carried[..., t, :] = A_{s1}^T ... A_t^T q_t for every target t >= s1 of the blocks done so far.
    carried = q.clone()
    eye = torch.eye(key_dim, dtype=q.dtype, device=q.device)
    for s0 in range(((length - 1) // block) * block, -1, -block):
        s1 = min(s0 + block, length)
        kb, bb, ab = k[:, :, s0:s1], b[:, :, s0:s1], alpha[:, :, s0:s1]
        # targets inside the block: the per-source sweep on the block alone
        local = carried[:, :, s0:s1].clone()
        mixing[:, :, s0:s1, s0:s1] = _delta_rule_sweep(local, kb, bb, ab)  # local_t <- A_{s0} ... A_t q_t
        if s1 < length:
            # y_s = A_{s1-1} ... A_{s+1} k_s and P = A_{s0}^T ... A_{s1-1}^T, by rank-one steps
            y = kb.clone()
            product = eye.expand(batch, heads, key_dim, key_dim).clone()
            for r in range(s1 - s0):
                k_r, b_r, a_r = kb[:, :, r], bb[:, :, r, None], ab[:, :, r].unsqueeze(2)  # a_r: (B, H, 1, d_k | 1)
                head = y[:, :, :r]
                head.mul_(a_r)  # A_r y = (I - beta_r k_r k_r^T)(alpha_r * y)
                head.sub_(b_r.unsqueeze(-1) * (head @ k_r.unsqueeze(-1)) * k_r.unsqueeze(2))
                product = product * a_r  # P A_r^T = (P diag(alpha_r)) (I - beta_r k_r k_r^T)
                product = product - b_r.unsqueeze(-1) * (product @ k_r.unsqueeze(-1)) * k_r.unsqueeze(-2)
            # targets after the block: M[t, s] = beta_s y_s . (A_{s1}^T ... A_t^T q_t)
            mixing[:, :, s1:, s0:s1] = (carried[:, :, s1:] @ y.transpose(-1, -2)) * bb.unsqueeze(2)
            carried[:, :, s1:] = carried[:, :, s1:] @ product.transpose(-1, -2)
        carried[:, :, s0:s1] = local
    return mixing


def _delta_rule_sweep(carried: Tensor, k: Tensor, b: Tensor, alpha: Tensor) -> Tensor:
    r"""M[t, s] for targets and sources of one block; ``carried`` (queries in) becomes A_first^T..A_t^T q_t."""
    length = k.shape[2]
    mixing = k.new_zeros(*k.shape[:2], length, length)
    # carried[..., t, :] = A_{s+1}^T ... A_t^T q_t for every target t >= s (untouched for t < s).
    for s in range(length - 1, -1, -1):
        k_s = k[:, :, s]  # (B, H, d_k)
        tail = carried[:, :, s:]  # (B, H, T - s, d_k), a view
        along = (tail @ k_s.unsqueeze(-1)).squeeze(-1)  # k_s^T A_{s+1..t} q_t
        mixing[:, :, s:, s] = b[:, :, s, None] * along
        # carried_t <- A_s^T carried_t = alpha_s * (carried_t - beta_s k_s (k_s^T carried_t))
        tail.sub_((b[:, :, s, None] * along).unsqueeze(-1) * k_s.unsqueeze(2)).mul_(alpha[:, :, s].unsqueeze(2))
    return mixing


def ssd_mixing(dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor] = None) -> Tensor:
    r"""Implicit value mixing :math:`M_h[t, s]` of the Mamba-2 state-space dual (SSD) scan.

    With the per-head state :math:`h \in \mathbb{R}^{N \times P}`,

    .. math::

        h_t = e^{\Delta_t A_h} h_{t-1} + \Delta_t B_t x_t^\top, \qquad y_t = h_t^\top C_t + D_h x_t,

    so :math:`y_t = \sum_{s \le t} M[t, s]\, x_s` with

    .. math::

        M[t, s] = (C_t \cdot B_s)\, \exp\Big(\sum_{r=s+1}^{t} \Delta_r A_h\Big)\, \Delta_s
        + D_h\, [s = t].

    Args:
        dt: (B, T, H) the time steps as the scan uses them (after ``dt_bias``, softplus and the
            ``time_step_limit`` clamp).
        A: (H,) the negative state decays :math:`A = -e^{A_{\log}}`.
        B: (B, T, G, N) the input projections per group (``H`` a multiple of ``G``; each group
            serves ``H // G`` consecutive heads).
        C: (B, T, G, N) the output projections per group.
        D: (H,) the skip coefficients, or ``None``.

    Returns:
        (B, H, T, S) with ``S == T``, zero above the diagonal.

    Examples::

        >>> m = ssd_mixing(torch.rand(1, 4, 2, dtype=torch.float64), -torch.ones(2, dtype=torch.float64),
        ...                torch.randn(1, 4, 1, 3, dtype=torch.float64), torch.randn(1, 4, 1, 3, dtype=torch.float64))
        >>> tuple(m.shape)
        (1, 2, 4, 4)
    """
    batch, length, heads = dt.shape
    groups = B.shape[2]
    if B.shape != C.shape or B.shape[:2] != (batch, length) or heads % groups:
        raise ValueError(f"B and C must be (B, T, G, N) with G dividing {heads} heads; "
                         f"got {tuple(B.shape)} and {tuple(C.shape)}")
    if A.shape != (heads,) or (D is not None and D.shape != (heads,)):
        raise ValueError(f"A and D must be ({heads},)")
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)
    mixing = torch.einsum("bthn,bshn->bhts", C, B)  # C_t . B_s
    log_step = (dt * A).transpose(1, 2)  # (B, H, T)
    cum = log_step.cumsum(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=dt.device).tril()
    # exp(cum_t - cum_s) <= 1 below the diagonal (A < 0, dt >= 0); masked to 0 above it. In place, one head
    # at a time: a (B, T, T) temporary beside the result (four (B, H, T, T) ones made the capture's peak).
    for h in range(heads):
        decay = cum[:, h].unsqueeze(-1) - cum[:, h].unsqueeze(-2)
        mixing[:, h].mul_(decay.masked_fill_(~causal, float("-inf")).exp_())
    del decay
    mixing.mul_(dt.transpose(1, 2).unsqueeze(-2))
    if D is not None:
        mixing.diagonal(dim1=-2, dim2=-1).add_(D.to(mixing.dtype)[None, :, None])
    return mixing


def gated_rmsnorm_scale(core: Tensor, gate: Tensor, weight: Tensor, eps: float, group_size: int,
                        norm_before_gate: bool) -> Tensor:
    r"""Per-target, per-channel scale :math:`\gamma_{t,c}` of a gated RMSNorm, recorded at its real input.

    The norm is held at its recorded statistics (as the other kinds hold LayerNorm's), so that
    ``norm(core, gate) == gated_rmsnorm_scale(core, gate, ...) * core``:

    * norm before gate (Gated DeltaNet's ``Qwen3NextRMSNormGated``):
      :math:`\gamma = w\,\mathrm{silu}(z) / \sqrt{\overline{o^2} + \epsilon}`;
    * gate before norm (Mamba-2's ``MambaRMSNormGated``, ``norm_before_gate=False``):
      :math:`\gamma = w\,\mathrm{silu}(z) / \sqrt{\overline{(o\,\mathrm{silu}(z))^2} + \epsilon}`,

    the mean taken over consecutive groups of ``group_size`` channels (a head for Gated DeltaNet,
    ``intermediate_size // n_groups`` for Mamba-2).

    Args:
        core: (B, T, C) the norm's input (the recurrence's output).
        gate: (B, T, C) the gate :math:`z`.
        weight: (C,) the norm's weight, or (group_size,) when it is shared by the groups.
        eps: the norm's epsilon.
        group_size: channels per normalisation group.
        norm_before_gate: which of the two forms above.

    Returns:
        (B, T, C) :math:`\gamma`.

    Examples::

        >>> o, z = torch.randn(1, 3, 4, dtype=torch.float64), torch.randn(1, 3, 4, dtype=torch.float64)
        >>> g = gated_rmsnorm_scale(o, z, torch.ones(4, dtype=torch.float64), 1e-6, 2, True)
        >>> tuple(g.shape)
        (1, 3, 4)
    """
    channels = core.shape[-1]
    if channels % group_size:
        raise ValueError(f"{channels} channels do not split into groups of {group_size}")
    gated = F.silu(gate)
    normed = core if norm_before_gate else core * gated
    grouped = normed.reshape(*normed.shape[:-1], channels // group_size, group_size)
    inv = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps).expand_as(grouped).reshape(normed.shape)
    if weight.shape[-1] == group_size and channels != group_size:
        weight = weight.repeat(channels // group_size)
    return weight * gated * inv


def conv_composed_mixing(mixing: Tensor, slope: Tensor, conv_weight: Tensor, target_scale: Optional[Tensor] = None,
                         conv_bias: Optional[Tensor] = None,
                         rows: Optional[slice] = None) -> Tuple[Tensor, Optional[Tensor]]:
    r"""Compose a per-head mixing with the value path's causal depthwise convolution and output scale.

    The values the recurrence mixes are :math:`v_{s,c} = \sigma_{s,c}\,(\sum_j w_{c,j}\,
    u_{s+j-K+1,c} + b_c)` (a causal depthwise convolution of kernel ``K`` and its SiLU, held at its
    recorded slope :math:`\sigma`); the output is :math:`\gamma_{t,c} \sum_s M_{h(c)}[t,s]\, v_{s,c}`.
    Hence, with :math:`P[t,s,c] = M_{h(c)}[t,s]\,\sigma_{s,c}`,

    .. math::

        G[t, s', c] = \gamma_{t,c} \sum_{j=0}^{K-1} w_{c,j}\, P[t, s' + K - 1 - j, c], \qquad
        n_{t,c} = \gamma_{t,c}\, b_c \sum_s P[t, s, c].

    Args:
        mixing: (B, H, T, T) the per-head mixing (:func:`delta_rule_mixing`, :func:`ssd_mixing`).
        slope: (B, T, C) the convolution's activation slope on the value channels
            (:func:`silu_slope`; ones for a convolution without activation).
        conv_weight: (C, K) the depthwise kernel of the value channels (``conv1d.weight[:, 0]``).
        target_scale: (B, T, C) the per-target output scale (:func:`gated_rmsnorm_scale`), or
            ``None`` for the bare recurrence.
        conv_bias: (C,) the convolution's bias of the value channels, or ``None``.
        rows: a slice of the targets to compute (a tile of ``t``; G of a whole sequence is
            T x S x C per example, docs/linear_mixers.md "Cost"); default all.

    Returns:
        ``(G, no_token)``: (B, T_rows, S, C) and (B, T_rows, C) (``None`` without a bias).

    Examples::

        >>> m = torch.eye(3, dtype=torch.float64).expand(1, 2, 3, 3)
        >>> g, n = conv_composed_mixing(m, torch.ones(1, 3, 4, dtype=torch.float64),
        ...                             torch.tensor([[0.0, 1.0]] * 4, dtype=torch.float64))
        >>> torch.equal(g[0, :, :, 0], torch.eye(3, dtype=torch.float64)), n is None
        (True, True)
    """
    batch, length, channels = slope.shape
    if mixing.shape[0] != batch or mixing.shape[2:] != (length, length):
        raise ValueError(f"mixing must be (B, H, T, T) = ({batch}, H, {length}, {length}); got {tuple(mixing.shape)}")
    if conv_weight.dim() != 2 or conv_weight.shape[0] != channels:
        raise ValueError(f"conv_weight must be (C, K) with C = {channels}; got {tuple(conv_weight.shape)}")
    kernel = conv_weight.shape[1]
    if rows is not None:
        mixing = mixing[:, :, rows]
        target_scale = target_scale[:, rows] if target_scale is not None else None
    mixed = _head_of_channel(mixing, channels) * slope.unsqueeze(1)  # P: (B, T_rows, S, C)
    composed = torch.zeros_like(mixed)
    for j in range(kernel):
        lag = kernel - 1 - j  # u_{s'} reaches the convolution output at s = s' + lag
        if lag < length:
            composed[:, :, :length - lag] += conv_weight[:, j] * mixed[:, :, lag:]
    no_token = mixed.sum(2) * conv_bias if conv_bias is not None else None
    if target_scale is not None:
        composed.mul_(target_scale.unsqueeze(2))
        no_token = no_token * target_scale if no_token is not None else None
    return composed, no_token


def apply_channel_mixing(mixing: Tensor, values: Tensor, no_token: Optional[Tensor] = None) -> Tensor:
    r"""Reproduce a mixer's output from its per-channel mixing: :math:`\sum_s G[t,s,c]\, u_{s,c} + n_{t,c}`.

    Args:
        mixing: (B, T, S, C) from :func:`conv_composed_mixing` (or the chained functions).
        values: (B, S, C) the values before the convolution.
        no_token: (B, T, C) or ``None``.

    Returns:
        (B, T, C) the mixer's output (before its output projection).

    Examples::

        >>> g = torch.ones(1, 2, 2, 3)
        >>> apply_channel_mixing(g, torch.ones(1, 2, 3)).tolist()
        [[[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]]
    """
    out = torch.einsum("btsc,bsc->btc", mixing, values)
    return out + no_token if no_token is not None else out


def gated_delta_net_mixing(query: Tensor, key: Tensor, beta: Tensor, log_decay: Tensor, value_pre_activation: Tensor,
                           conv_weight: Tensor, target_scale: Optional[Tensor] = None,
                           conv_bias: Optional[Tensor] = None,
                           rows: Optional[slice] = None) -> Tuple[Tensor, Optional[Tensor]]:
    r"""Per-channel mixing :math:`G` of a Gated DeltaNet layer over its pre-convolution values.

    :func:`delta_rule_mixing`, then :func:`conv_composed_mixing` with the SiLU slope of the value
    channels' convolution output. ``out_proj(apply_channel_mixing(G, u, n))`` is the layer's output,
    ``u`` the value channels of ``in_proj_qkvz`` (docs/linear_mixers.md).

    Args:
        query: (B, T, H_k, d_k) L2-normalised queries (see :func:`delta_rule_mixing`).
        key: (B, T, H_k, d_k) L2-normalised keys.
        beta: (B, T, H) :math:`\sigma(b)`.
        log_decay: (B, T, H) :math:`g = -e^{A_{\log}}\,\mathrm{softplus}(a + \text{dt\_bias})`.
        value_pre_activation: (B, T, C) the convolution's output on the value channels, before
            the SiLU (``C = H * d_v``).
        conv_weight: (C, K) the value channels' depthwise kernel.
        target_scale: (B, T, C) :func:`gated_rmsnorm_scale` with ``norm_before_gate=True``, or ``None``.
        conv_bias: (C,) or ``None`` (Qwen3-Next's convolution has none).
        rows: a tile of targets, as :func:`conv_composed_mixing`.

    Returns:
        ``(G, no_token)`` as :func:`conv_composed_mixing`.

    Examples::

        >>> b, t, h, dk, dv = 1, 4, 2, 3, 2
        >>> q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, dtype=torch.float64), dim=-1)
        >>> g, n = gated_delta_net_mixing(q, q, torch.rand(b, t, h, dtype=torch.float64),
        ...                               -torch.rand(b, t, h, dtype=torch.float64),
        ...                               torch.randn(b, t, h * dv, dtype=torch.float64),
        ...                               torch.randn(h * dv, 3, dtype=torch.float64))
        >>> tuple(g.shape)
        (1, 4, 4, 4)
    """
    mixing = delta_rule_mixing(query, key, beta, log_decay)
    return conv_composed_mixing(mixing, silu_slope(value_pre_activation), conv_weight, target_scale, conv_bias, rows)


def mamba2_mixing(dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], x_pre_activation: Tensor,
                  conv_weight: Tensor, target_scale: Optional[Tensor] = None,
                  conv_bias: Optional[Tensor] = None,
                  rows: Optional[slice] = None) -> Tuple[Tensor, Optional[Tensor]]:
    r"""Per-channel mixing :math:`G` of a Mamba-2 mixer over its pre-convolution ``x`` channels.

    :func:`ssd_mixing` (with ``D`` as the :math:`s = t` term), then :func:`conv_composed_mixing`
    with the SiLU slope of the ``x`` channels' convolution output. ``out_proj(apply_channel_mixing(
    G, u, n))`` is the mixer's output, ``u`` the ``x`` channels of ``in_proj`` (docs/linear_mixers.md).

    Args:
        dt: (B, T, H) time steps after bias, softplus and clamp.
        A: (H,) :math:`-e^{A_{\log}}`.
        B: (B, T, G, N) after the convolution and SiLU.
        C: (B, T, G, N) after the convolution and SiLU.
        D: (H,) or ``None``.
        x_pre_activation: (B, T, C) the convolution's output on the ``x`` channels, before the SiLU
            (``C = H * head_dim``).
        conv_weight: (C, K) the ``x`` channels' depthwise kernel.
        target_scale: (B, T, C) :func:`gated_rmsnorm_scale` with ``norm_before_gate=False``, or ``None``.
        conv_bias: (C,) the ``x`` channels' convolution bias, or ``None``.
        rows: a tile of targets, as :func:`conv_composed_mixing`.

    Returns:
        ``(G, no_token)`` as :func:`conv_composed_mixing`.

    Examples::

        >>> g, n = mamba2_mixing(torch.rand(1, 4, 2, dtype=torch.float64), -torch.ones(2, dtype=torch.float64),
        ...                      torch.randn(1, 4, 1, 3, dtype=torch.float64), torch.randn(1, 4, 1, 3, dtype=torch.float64),
        ...                      torch.ones(2, dtype=torch.float64), torch.randn(1, 4, 6, dtype=torch.float64),
        ...                      torch.randn(6, 4, dtype=torch.float64), conv_bias=torch.zeros(6, dtype=torch.float64))
        >>> tuple(g.shape), tuple(n.shape)
        ((1, 4, 4, 6), (1, 4, 6))
    """
    mixing = ssd_mixing(dt, A, B, C, D)
    return conv_composed_mixing(mixing, silu_slope(x_pre_activation), conv_weight, target_scale, conv_bias, rows)
