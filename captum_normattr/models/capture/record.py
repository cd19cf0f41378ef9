r"""What a layer's recorded tensors become: its :class:`~captum_normattr.decompose.records.LayerTensors`.

The recorder (:mod:`captum_normattr.models.capture.recorder`) keeps each layer's raw
tensors; :func:`layer_record` turns them into the record the decomposition reads, in the
compute dtype, with the weights read from the layer and folded (a layer scale, a branch
multiplier, the halves of a fused gate-up projection) and the kind's own fields filled
(its ``CaptureRecipe`` and ``fill_record``). :func:`record_checks` adds the consistency
checks that need only the record: each norm rebuilt from its input and parameters, the
kind's residual joins, the feed-forward output rebuilt from its weights and the attention
output joined to the stream (``docs/reliability.md``, "Consistency guards").
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.arch.spec import FUNCTIONAL_ACT, ArchitectureSpec, Norm
from captum_normattr.decompose.kinds.single_branch import absent_attention_out, absent_feed_forward, absent_norm
from captum_normattr.decompose.primitives.guards import norm_rebuild_error, relative_difference
from captum_normattr.decompose.records import FFParams, LayerTensors, NormParams
from captum_normattr.models.adapters import get_path, layer_scale, linear_params
from captum_normattr.models.capture.per_layer_input import per_layer_input_extras
from captum_normattr.models.experts import experts_ff_params
from captum_normattr.models.weights import module_tensor

__all__ = ["branch_multiplier", "input_keeper", "layer_record", "norm_params", "record_checks"]


def input_keeper(mine, got: Dict[str, Any], key: str = "context"):
    r"""A forward pre-hook that keeps a module's first positional input, detached, as ``got[key]``.

    The mixer captures (short convolution, Gated DeltaNet, Kimi delta attention, Mamba-2) keep their
    output projection's real input so (the recorded context) with it.

    Args:
        mine: a callable telling whether the current forward pass is the recorder's own.
        got: the capture's dictionary of kept tensors.
        key: the key the input is kept under.

    Returns:
        The hook ``(module, args) -> None``.
    """

    def hook(module, args):
        if mine() and args and isinstance(args[0], Tensor):
            got[key] = args[0].detach()

    return hook


def norm_params(
    module: nn.Module, kind: Union[str, Norm], dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None
) -> NormParams:
    r"""The parameters of a LayerNorm/RMSNorm module, cast to ``dtype`` and moved to ``device`` (kept if None).

    Args:
        module: the norm module.
        kind: its description (:class:`~captum_normattr.arch.spec.Norm`: kind and gain
            offset) or just the kind, ``"layernorm"`` / ``"rmsnorm"``.
        dtype, device: of the returned tensors (None: kept).

    Returns:
        :class:`NormParams` whose ``weight`` is the effective gain (``weight + weight_offset``:
        Gemma's ``1 + w``); an ``nn.Identity`` in the norm's place gives the identity norm
        (kind ``"identity"``).

    The parameters are read wherever they live (:func:`~captum_normattr.models.weights.module_tensor`),
    also from the hook of a module offloaded by accelerate.
    """
    if isinstance(module, nn.Identity):  # no norm in this layer (ModernBERT's first attention norm)
        return NormParams(weight=None, bias=None, eps=0.0, kind="identity")
    offset, described_eps = 0.0, None
    if kind == "identity" or (isinstance(kind, Norm) and kind.kind == "identity"):
        return NormParams(weight=None, bias=None, eps=0.0, kind="identity")  # a branch without a pre-norm
    if isinstance(kind, Norm):
        kind, offset, described_eps = kind.kind, kind.weight_offset, kind.eps
    eps = getattr(module, "eps", None)
    if eps is None:
        eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = described_eps  # a module without an epsilon attribute (OLMo's fixed 1e-5): the description's
    if eps is None and isinstance(module, getattr(nn, "RMSNorm", ())):
        eps = torch.finfo(module.weight.dtype if module.weight is not None else torch.float32).eps  # torch's default
    if eps is None:
        raise ValueError(
            f"cannot find the epsilon of norm module {type(module).__name__} (no eps or variance_epsilon attribute): "
            "give it in the description, Norm(..., eps=...)"
        )

    def cast(t):
        if t is None or (dtype is None and device is None):
            return t
        return t.detach().to(device=device, dtype=dtype)

    weight = cast(module_tensor(module, "weight"))
    if offset:
        if weight is None:
            raise ValueError(f"norm module {type(module).__name__} has no weight for its gain offset {offset}")
        weight = weight + offset
    return NormParams(
        weight=weight,
        bias=cast(module_tensor(module, "bias")) if kind == "layernorm" else None,
        eps=float(eps),
        kind=kind,
    )


def _scaled(w: Tensor, b: Optional[Tensor], scale: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    r"""(W diag(scale), b * scale): a right-multiplied projection followed by a per-channel scale."""
    if scale is None:
        return w, b
    scale = scale.detach()
    return w.detach() * scale.to(w.dtype), None if b is None else b.detach() * scale.to(b.dtype)


def _split_gate_up(w: Tensor, b: Optional[Tensor], gate_first: bool):
    r"""(W_up, b_up, W_gate, b_gate) from a fused gate-up projection (in, 2 I): its two column halves."""
    half = w.shape[1] // 2
    if w.shape[1] != 2 * half:
        raise ValueError(f"a fused gate-up projection has an even number of outputs, got {w.shape[1]}")
    first, second = (slice(0, half), slice(half, 2 * half))
    g, u = (first, second) if gate_first else (second, first)
    pick = lambda t, cols: None if t is None else t[..., cols]
    return w[:, u], pick(b, u), w[:, g], pick(b, g)


def branch_multiplier(model: nn.Module, attribute: Optional[str]) -> Optional[float]:
    r"""The scalar a branch output is multiplied by (config ``attribute``, Granite's ``residual_multiplier``), or None.

    Raises:
        ValueError: the config has no such attribute, or it is not a number.
    """
    if attribute is None:
        return None
    config = getattr(model, "config", None)
    value = getattr(config, attribute, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"the description names the branch multiplier config.{attribute}, but {type(model).__name__}'s config has "
            f"{'no such attribute' if value is None else repr(value)}; fix the description's multiplier"
        )
    return None if float(value) == 1.0 else float(value)


def _times(t: Optional[Tensor], m: Optional[float]) -> Optional[Tensor]:
    r"""``t * m`` (a new tensor), ``t`` itself when there is no multiplier."""
    return t if t is None or m is None else t * m


def _ff_rebuild_error(t: LayerTensors) -> Tensor:
    r"""Relative difference of the real FF output at the last position from FF(u) rebuilt from the read weights.

    One row per example (cost B x D x F): it catches weights read in the wrong way (a fused
    gate-up projection split in the wrong order, a branch multiplier or layer scale the
    description misses, a wrong activation), which the residual joins alone do not see.
    """
    ff = t.ff
    u = t.ff_input[:, -1:]

    def linear(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
        return x @ w if b is None else x @ w + b

    pre = linear(u, ff.w_in, ff.b_in)
    if ff.hidden_scale is not None:  # experts: the recorded routing weights (and shared gate) of the last token
        pre = pre * ff.hidden_scale[:, -1:]
    if ff.w_gate is None:
        h = ff.act(pre)
    else:
        a = linear(u, ff.w_gate, ff.b_gate)
        h = ff.act(a if ff.gate_scale is None else a * ff.gate_scale[:, -1:]) * pre
    out = linear(h, ff.w_out, ff.b_out)
    return relative_difference(t.ff_out[:, -1:], out, temporary=True)


def _attention_join_error(t: LayerTensors, joined_key: str) -> Tensor:
    r"""Relative difference of the real residual join after attention from the layer input plus
    context W_O + b_O at the last position (``joined_key``: the field where the kind joins them,
    ``CaptureRecipe.attention_join``; pre-LN: the second norm's input; post-LN: the first's).

    Compared relative to the residual stream, as the other joins: it catches an output scale
    (a branch multiplier, a layer scale) that the description misses.
    """
    ctx = t.context[:, -1].reshape(t.context.shape[0], -1)
    attn = ctx @ t.out_weight if t.out_bias is None else ctx @ t.out_weight + t.out_bias
    joined = getattr(t, joined_key)
    return relative_difference(joined[:, -1], t.hidden_in[:, -1] + attn, temporary=True)


def layer_record(adapter: ArchitectureSpec, kind: Any, layer: nn.Module, base: nn.Module, idx: int,
                 rec: Dict[str, Tensor], dtype: torch.dtype) -> LayerTensors:
    r"""One layer's :class:`LayerTensors` in the compute dtype, from its recorded tensors (without checks).

    Every tensor, weights included, is put on the device the layer's attention ran on
    (its execution device under accelerate; weights of offloaded modules are read from
    their hook, :mod:`captum_normattr.models.weights`).

    Args:
        adapter: the model's :class:`~captum_normattr.arch.spec.ArchitectureSpec`.
        kind: its layer kind (:func:`~captum_normattr.decompose.kinds.registry.layer_kind`),
            whose capture recipe names the extra recorded tensors and post-norms.
        layer: the layer module (its weights are read here).
        base: the base model (its config holds the branch multipliers).
        idx: the layer's index.
        rec: the layer's raw recorded tensors (``hidden_in``, ``values``, ``ln1_in``, ...).
        dtype: the compute dtype.

    Returns:
        The layer's :class:`LayerTensors`; its ``checks`` are left to the caller
        (:func:`record_checks` and the recorder's hook checks).

    Examples::

        >>> t = layer_record(spec, layer_kind(spec.topology, spec.family), layers[0], base, 0, rec, torch.float64)
    """
    a = adapter
    device = (rec["probs"] if rec.get("probs") is not None else rec["values"]).device
    cast = lambda t: None if t is None else t.detach().to(device=device, dtype=dtype)
    b, t_len = rec["hidden_in"].shape[:2]

    def tokens(t: Optional[Tensor]) -> Optional[Tensor]:
        # a layer that flattens its tokens (OPT's FF runs on (B * T, D)): back to (B, T, D)
        if t is not None and t.dim() == 2 and t.shape[0] == b * t_len:
            t = t.reshape(b, t_len, t.shape[-1])
        return cast(t)

    branch = a.layer.branch  # a single-branch layer (Nemotron-H): its absent branch is 0 (decompose.kinds.single_branch)
    width = rec["hidden_in"].shape[-1]
    if branch == "feed_forward":  # no attention: one head of size 1 whose W_O is 0
        w_o, b_o = absent_attention_out(width, dtype, device), None
    else:
        w_o, b_o = linear_params(get_path(layer, a.attn_out), a.transposed_weights)
        if a.layer.attention.mixer == "mamba2" and get_path(layer, a.layer.attention.conv).bias is not None:
            w_o = torch.cat([w_o, w_o], 0)  # a Mamba-2 convolution bias's heads read W_O again (capture.mamba2)
    experts = a.layer.ff.kind == "experts"  # the sparse block's weights are read by experts_ff_params below
    absent_ff = branch == "self_attention"  # no feed-forward: the zero FF
    skip = experts or absent_ff
    w_in, b_in = (None, None) if skip else linear_params(get_path(layer, a.ff_in), a.transposed_weights)
    w_out, b_out = (None, None) if skip else linear_params(get_path(layer, a.ff_out), a.transposed_weights)
    if a.attn_scale is not None or a.ff_scale is not None:  # DINOv2 layer scale, folded (a per-channel scale is linear)
        w_o, b_o = _scaled(w_o, b_o, layer_scale(layer, a.attn_scale))
        w_out, b_out = _scaled(w_out, b_out, layer_scale(layer, a.ff_scale))
    # Granite's residual multipliers h = x + m * Attn(..), y = h + m * FF(..): scalars, folded like the layer
    # scales; the recorded branch outputs (the projections' outputs) are scaled below to what joins the stream
    m_attn = None if branch == "feed_forward" else branch_multiplier(base, a.layer.attention.multiplier)
    m_ff = None if absent_ff else branch_multiplier(base, a.layer.ff.multiplier)
    if m_attn is not None:
        w_o, b_o = _scaled(w_o, b_o, torch.tensor(m_attn, dtype=torch.float64))
    if m_ff is not None and not experts:  # the experts' W_down is scaled once read (below)
        w_out, b_out = _scaled(w_out, b_out, torch.tensor(m_ff, dtype=torch.float64))
    w_g = b_g = None
    if a.layer.ff.kind == "fused_gate_up" and not absent_ff:  # Phi-3's gate_up_proj: the gate and up halves of one
        w_in, b_in, w_g, b_g = _split_gate_up(w_in, b_in, a.layer.ff.gate_first)  # projection
    elif a.ff_gate is not None and not absent_ff:
        w_g, b_g = linear_params(get_path(layer, a.ff_gate), a.transposed_weights)
    if absent_ff:
        ff = absent_feed_forward(width, dtype, device)
    elif experts:
        ff = experts_ff_params(layer, a.layer.ff, rec, dtype, device)
        if m_ff is not None:  # Granite-MoE: y = h + m * MoE(u), folded into the stacked experts' W_down
            ff = replace(ff, w_out=ff.w_out * m_ff, b_out=_times(ff.b_out, m_ff))
    else:
        act = (getattr(torch.nn.functional, a.ff_act[len(FUNCTIONAL_ACT):]) if a.ff_act.startswith(FUNCTIONAL_ACT)
               else get_path(layer, a.ff_act))  # a feed-forward calling torch's function (LFM2: F.silu)
        ff = FFParams(cast(w_in), cast(b_in), cast(w_out), cast(b_out), act, cast(w_g), cast(b_g))
    tensors = LayerTensors(
        hidden_in=cast(rec["hidden_in"]),
        probs=cast(rec.get("probs")),
        values=cast(rec["values"]),
        context=cast(rec.get("context")),
        out_weight=cast(w_o),
        out_bias=cast(b_o),
        ln1=absent_norm() if branch == "feed_forward" else norm_params(get_path(layer, a.ln1), a.norm1, dtype, device),
        ln1_in=tokens(rec["ln1_in"]),
        ln1_out=tokens(rec["ln1_out"]),
        ln2=absent_norm() if absent_ff else norm_params(get_path(layer, a.ln2), a.norm2, dtype, device),
        ln2_in=tokens(rec["ln2_in"]),
        ln2_out=tokens(rec["ln2_out"]),
        ff_out=_times(_with_shared(tokens, rec, a.layer.ff), m_ff),
        layer_out=tokens(rec["layer_out"]),
        ff=ff,
        causal=a.causal,
        index=idx,
        source_dtype=rec["layer_out"].dtype,
        topology=a.topology,
        own_after=tokens(rec.get("own_after")),  # a token-own addition after the layer (DeepStack), folded in layer_out
    )
    value = a.layer.attention.value
    if value is not None and value.layout == "latent":  # multi-head latent attention: fold the latent's norm scale
        _fold_latent_scale(tensors, layer, a, dtype, device)
    # what the kind adds to the record (its capture recipe): its extra recorded tensors (the attention
    # branch output, as it joins the stream, times the branch multiplier) and the norms on the branch outputs
    recipe = kind.capture
    extra = {k: tokens(rec[k]) for k in recipe.extra_keys}
    if recipe.branch_output is not None:
        extra[recipe.branch_output] = _times(extra[recipe.branch_output], m_attn)
    described = {"attn_post": a.layer.attention.post_norm, "ff_post": a.layer.ff.post_norm}
    post_norms = {k: norm_params(get_path(layer, described[k].path), described[k], dtype, device) for k in recipe.post_norms}
    kind.fill_record(tensors, extra, post_norms)
    if a.layer.per_layer_input is not None:  # Gemma 4: what its kind's step reads beyond the record
        config = getattr(base, "config", None)  # a vision-language model's: its decoder's (Gemma 4 with images)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        width = int(getattr(config, a.layer.per_layer_input, 0) or 0)
        tensors.extras = per_layer_input_extras(layer, list(get_path(base, a.layers)), idx, rec, cast, width)
    return tensors


def _with_shared(tokens: Callable[[Optional[Tensor]], Optional[Tensor]], rec: Dict[str, Tensor], ff: Any) -> Tensor:
    r"""The FF output: the recorded ``ff_out``, plus the shared expert's output where the layer adds it itself
    (``Experts.shared_beside``, Granite 4)."""
    out = tokens(rec["ff_out"])
    if ff.experts is None or ff.experts.shared_beside is None:
        return out
    if "shared_out" not in rec:
        raise RuntimeError(f"the forward pass recorded no output of the shared expert {ff.experts.shared_beside!r}")
    return out + tokens(rec["shared_out"])


def _fold_latent_scale(tensors: LayerTensors, layer: nn.Module, a: ArchitectureSpec, dtype: torch.dtype,
                       device: torch.device) -> None:
    r"""Multi-head latent attention: v_j = s_j v~_j with s_j = 1 / rms(c_j) the latent's norm scale and v~_j linear in
    the attention input x_j; record p_ij s_j as the probabilities and v~_j = v_j / s_j as the values (the products
    p_ij v_j, the context and every part are unchanged). s_j is the latent norm's scale at the real attention input."""
    spec = a.layer.attention.value
    w, b = linear_params(get_path(layer, spec.path), a.transposed_weights)
    rank = int(getattr(get_path(layer, a.attention), "kv_lora_rank"))
    c = tensors.ln1_out @ w[:, :rank].to(device=device, dtype=dtype)
    if b is not None:
        c = c + b[:rank].to(device=device, dtype=dtype)
    eps = norm_params(get_path(layer, spec.latent_norm.path), spec.latent_norm).eps
    s = torch.rsqrt(c.pow(2).mean(-1) + eps)  # (B, T)
    tensors.values = tensors.values / s[:, None, :, None]
    if tensors.probs is not None:
        tensors.probs = tensors.probs * s[:, None, None, :]


def record_checks(kind: Any, t: LayerTensors, checks: Optional[Dict[str, Tensor]] = None) -> Dict[str, Tensor]:
    r"""Add a layer's record checks to ``checks``: the norms rebuilt, the kind's joins, the FF and attention rebuilt.

    Args:
        kind: the layer kind (its ``join_checks`` and ``capture.attention_join``).
        t: the layer's record in the compute dtype (:func:`layer_record`).
        checks: the checks collected so far (the recorder's hook checks), filled in place;
            None: a new dictionary.

    Returns:
        ``checks``: check name -> relative difference per example.

    Examples::

        >>> worst = max(float(v.max()) for v in record_checks(kind, t).values())
    """
    checks = {} if checks is None else checks
    checks["first norm rebuilt from its input"] = norm_rebuild_error(t.ln1_in, t.ln1_out, t.ln1)
    checks["second norm rebuilt from its input"] = norm_rebuild_error(t.ln2_in, t.ln2_out, t.ln2)
    checks.update(kind.join_checks(t))
    checks["feed-forward output rebuilt from its input and weights (last position)"] = _ff_rebuild_error(t)
    attention_join = kind.capture.attention_join
    if attention_join is not None and t.context is not None:
        checks["residual join vs the layer input plus the attention output rebuilt from its weights (last position)"] = (
            _attention_join_error(t, attention_join))
    return checks
