r"""Value Zeroing (Mohebbi et al., EACL 2023): context mixing measured by rerunning each layer without one value.

For layer l with its real input x (the hidden states the forward pass gave it) and its real
output y, every real source token j gives one rerun of the whole layer module on the same
input with token j's value vector zeroed in every head (the value projection's output row j,
bias included; queries, keys and attention probabilities unchanged), whose output is
y^{(-j)}. The layer map is

    C_l[i, j] = 1 - cos(y_i, y_i^{(-j)}),     M_l[i, j] = C_l[i, j] / sum_{k real} C_l[i, k],

and the token scores are the explained row of the rollout M_L ... M_1 (no identity is added:
the rerun layer includes its residual connections). ``docs/value_zeroing.md`` gives the
definition, what the official code does, the cost and a comparison with ALTI and GlobEnc.

The T reruns of a layer are batched: the layer input of every example is repeated once per
zeroed source, in chunks under a memory budget, and the layer module is called with the
arguments the model gave it (masks, rotary embeddings, position ids, ...: a per-example
tensor is repeated with its example). One more copy per example and layer is rerun without
zeroing, and its relative difference from the real output is the convergence delta: it
proves that the reruns reproduce the real layer.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.arch.spec import ArchitectureSpec, UnsupportedModelError, ValueProjection
from captum_normattr.attr.base import DecompositionAttribution, format_output
from captum_normattr.attr.images import image_extras, pixel_attributions
from captum_normattr.attr.inputs import explained_positions, prepare_inputs
from captum_normattr.models.prepared import PreparedInputs
from captum_normattr.decompose.primitives.guards import guard_tolerance
from captum_normattr.decompose.primitives.rollout import rollout, rollout_rows
from captum_normattr.models.adapters import (
    base_model,
    get_adapter,
    get_path,
    layer_modules,
    linear_params,
    value_projection,
)
from captum_normattr.models.capture.session import eval_mode
from captum_normattr.models.engine import mark_non_finite
from captum_normattr.models.guard import GROSS_RELATIVE, ConsistencyError, ConsistencyWarning
from captum_normattr.options import check_explained_position, check_memory_budget
from captum_normattr.result import DecompositionResult

__all__ = [
    "VALUE_ZEROING_MEMORY_BUDGET_MB",
    "ValueZeroingAttribution",
    "attention_shape",
    "value_columns",
    "latent_value_columns",
    "value_module_path",
    "repeat_examples",
    "cosine_distances",
    "normalize_rows",
]

#: Default memory of one chunk of layer reruns (the activations of the repeated examples), in MB.
VALUE_ZEROING_MEMORY_BUDGET_MB = 512.0


def attention_shape(attention: nn.Module, model: nn.Module) -> Tuple[int, int]:
    r"""(H query heads, H_kv key/value heads) of an attention module.

    Read from the module's attributes (``num_heads``, ``num_attention_heads``, ``n_head``,
    ``n_heads``; ``num_key_value_heads``, ``num_kv_heads``), else from its or the model's config.

    Args:
        attention: the attention module.
        model: the model (its config is the last resort).

    Returns:
        (H, H_kv); H_kv is H without grouped-query attention.
    """
    configs = [c for c in (getattr(attention, "config", None), getattr(model, "config", None)) if c is not None]
    configs = [getattr(c, "text_config", None) or c for c in configs]

    def find(names: Tuple[str, ...]) -> Optional[int]:
        for owner in [attention, *configs]:
            for name in names:
                value = getattr(owner, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return None

    heads = find(("num_heads", "num_attention_heads", "n_head", "n_heads"))
    if heads is None:
        raise ValueError(f"cannot find the number of heads of {type(attention).__name__} (no num_heads or config)")
    return heads, find(("num_key_value_heads", "num_kv_heads")) or heads


def value_columns(layer: nn.Module, adapter: ArchitectureSpec, model: nn.Module) -> Tensor:
    r"""The output columns of a layer's value projection that hold the value states.

    The layouts of :class:`~captum_normattr.arch.spec.ValueProjection`: every column
    (``plain``), slice ``index`` of ``count`` (``fused``, GPT-2's ``c_attn``), each head's value
    block (``interleaved``, GPT-NeoX), the value columns after the query and key ones
    (``fused_gqa``, Phi-3), each key/value group's value head (``grouped``, Falcon's new
    decoder architecture). Checked against
    :func:`~captum_normattr.models.adapters.value_projection`: the projection's weight at
    these columns must be exactly the value weight W_V it reads.

    Args:
        layer: one layer module.
        adapter: its description (its attention names a value projection).
        model: the model (its config gives the head counts where the module does not).

    Returns:
        (n,) int64: the value columns, in W_V's order.

    Raises:
        ValueError: the layout and the head counts do not give W_V.
    """
    spec: ValueProjection = adapter.layer.attention.value
    if spec.layout == "latent":
        return latent_value_columns(layer, adapter, model)
    weight, _ = linear_params(get_path(layer, spec.path), adapter.transposed_weights)  # (D, W)
    width = weight.shape[1]
    cols = torch.arange(width)
    if spec.layout == "fused":
        size = width // spec.count
        cols = cols[spec.index * size:(spec.index + 1) * size]
    elif spec.layout != "plain":
        heads, kv_heads = attention_shape(get_path(layer, adapter.attention), model)
        if spec.layout == "interleaved":
            cols = cols.reshape(heads, spec.count, width // (heads * spec.count))[:, spec.index].flatten()
        elif spec.layout == "fused_gqa":
            dh = width // (heads + 2 * kv_heads)
            sizes = (heads * dh, kv_heads * dh, kv_heads * dh)
            start = sum(sizes[: spec.index])
            cols = cols[start:start + sizes[spec.index]]
        else:  # grouped: per key/value head [its query heads | k | v]
            per = heads // kv_heads + 2
            block = {0: slice(0, per - 2), 1: slice(per - 2, per - 1), 2: slice(per - 1, per)}[spec.index]
            cols = cols.reshape(kv_heads, per, width // (kv_heads * per))[:, block].flatten()
    w_v, _ = value_projection(layer, adapter)
    if tuple(w_v.shape) != (weight.shape[0], cols.numel()) or not torch.equal(weight[:, cols.to(weight.device)], w_v):
        raise ValueError(
            f"the {adapter.family} value projection {spec.path!r} ({spec.layout}): the value columns found from the head "
            "counts are not the value weight the description reads")
    return cols


def latent_value_columns(layer: nn.Module, adapter: ArchitectureSpec, model: nn.Module) -> Tensor:
    r"""The value columns of a multi-head latent attention's up-projection (``latent`` layout).

    The up-projection (``ValueProjection.latent_up``, DeepSeek-V3's ``kv_b_proj``) gives each head
    [its non-rotary key part (``qk_nope_head_dim``) | its value (``v_head_dim``)]; zeroing a token's
    value is zeroing these columns of the up-projection's output at that token
    (:func:`value_module_path`), the value v_j itself, whatever the latent's norm did before.

    Args:
        layer: one layer module.
        adapter: its description (a ``latent`` value projection).
        model: the model (its config gives the head sizes where the attention module does not).

    Returns:
        (n,) int64: the value columns of the up-projection's output, in head order.

    Raises:
        ValueError: the head sizes do not give the up-projection's width.
    """
    spec: ValueProjection = adapter.layer.attention.value
    attn = get_path(layer, adapter.attention)
    up, _ = linear_params(get_path(layer, spec.latent_up), adapter.transposed_weights)  # (r, W)
    heads = attention_shape(attn, model)[0]
    config = getattr(model, "config", None)
    nope = getattr(attn, "qk_nope_head_dim", getattr(config, "qk_nope_head_dim", None))
    v_dim = getattr(attn, "v_head_dim", getattr(config, "v_head_dim", None))
    width = up.shape[1]
    if nope is None or v_dim is None or width != heads * (nope + v_dim):
        raise ValueError(
            f"the {adapter.family} latent up-projection {spec.latent_up!r}: its {width} outputs are not {heads} heads of "
            f"[key part ({nope}) | value ({v_dim})]")
    return torch.arange(width).reshape(heads, nope + v_dim)[:, nope:].flatten()


def value_module_path(spec: ValueProjection) -> str:
    r"""The module whose output holds the value states: the up-projection of a ``latent`` layout,
    else the value projection itself (``spec.path``)."""
    return spec.latent_up if spec.layout == "latent" else spec.path


def repeat_examples(value: Any, rows: Tensor, batch: int, heads: int = 1) -> Any:
    r"""A layer call's argument with every per-example tensor taken at ``rows`` (examples repeated).

    A tensor of two or more dimensions whose first dimension is the batch size B > 1 is
    per-example (attention masks (B, 1, T, S), rotary embeddings (B, T, Dh), position ids
    (B, T), ...); anything else (one-dimensional tensors such as ``cache_position``,
    broadcast tensors with a first dimension of 1, non-tensors) is kept. With B = 1 a first
    dimension of 1 cannot tell an example from a broadcast (DeBERTa's relative positions
    (1, 1, T, T) must stay so): every such tensor is kept and broadcasts over the reruns. A tensor
    of three or more dimensions whose first dimension is B * H (``heads`` > 1) is per example
    and head (BLOOM's ALiBi bias (B * H, 1, S)): its blocks of H are taken at ``rows``.
    Tuples, lists and dicts are rebuilt.

    Args:
        value: an argument of the layer call.
        rows: (n,) int64 example of every rerun.
        batch: B.
        heads: H, the attention heads.

    Returns:
        The argument for a batch of n reruns.
    """
    if isinstance(value, Tensor):
        if batch > 1 and value.dim() >= 2 and value.shape[0] == batch:
            return value.index_select(0, rows.to(value.device))
        if heads > 1 and value.dim() >= 3 and value.shape[0] == batch * heads:
            blocks = value.reshape(batch, heads, *value.shape[1:]).index_select(0, rows.to(value.device))
            return blocks.reshape(rows.shape[0] * heads, *value.shape[1:])
        return value
    if isinstance(value, tuple):
        items = [repeat_examples(v, rows, batch, heads) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [repeat_examples(v, rows, batch, heads) for v in value]
    if isinstance(value, dict):
        return {k: repeat_examples(v, rows, batch, heads) for k, v in value.items()}
    return value


def cosine_distances(real: Tensor, rerun: Tensor) -> Tensor:
    r"""1 - cos(real, rerun) over the last dimension, computed as |u - u'|^2 / 2 of the unit vectors in float64.

    The form of the unit vectors has no cancellation (1 - cos of two nearly equal vectors
    would lose every digit below the dtype's epsilon) and is never negative. A zero vector
    has cosine 0 with anything (distance 1).

    Args:
        real: (..., D).
        rerun: (..., D), broadcastable with ``real``.

    Returns:
        (...) float64 in [0, 2].
    """
    def unit(x: Tensor) -> Tensor:
        x = x.to(torch.float64)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return torch.where(norm > 0, x / norm.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(x))

    u, w = unit(real), unit(rerun)
    both = (u != 0).any(-1) & (w != 0).any(-1)
    d = (u - w).pow(2).sum(-1).mul(0.5)
    return torch.where(both, d, torch.ones_like(d))


def normalize_rows(distances: Tensor, valid: Tensor) -> Tensor:
    r"""Each row of the distances divided by its sum over the real sources (a zero row stays 0).

    Args:
        distances: (B, T, T) cosine distances, pad columns already 0.
        valid: (B, T) bool, the real tokens.

    Returns:
        (B, T, T): rows of real tokens sum to 1 (where they have any mixing), pad rows and
        columns exactly 0.
    """
    v = valid.to(distances.dtype)
    m = distances * v[:, None, :] * v[:, :, None]
    total = m.sum(-1, keepdim=True)
    return torch.where(total > 0, m / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(m))


def _first_tensor(output: Any) -> Tensor:
    r"""The hidden states in a layer's output (a tensor, or the first tensor of a tuple or a model output)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    for item in output:
        if isinstance(item, Tensor):
            return item
    raise TypeError(f"the layer returned no tensor ({type(output).__name__})")


class _ZeroingRun:
    r"""The hooks of one call: each layer's real input and output, its reruns, the value zeroing.

    Hooks act only for the thread that made the call and only while it is not rerunning a
    layer itself; everything is removed by :meth:`remove`.
    """

    def __init__(self, owner: "ValueZeroingAttribution", prepared: PreparedInputs) -> None:
        self.owner = owner
        self.model = owner.model
        self.adapter = owner.adapter
        self.layers = layer_modules(self.model, self.adapter)
        self.valid = prepared.valid
        self.causal = bool(self.adapter.causal) and not prepared.two_way  # two-way spans: full maps (docs/vlm.md)
        self.thread = threading.get_ident()
        self.rerunning = False
        self.zero_rows: Optional[Tensor] = None  # (n,) source zeroed in every rerun (-1: none)
        self.zero_cols: Dict[int, Tensor] = {}  # layer -> its value projection's value columns
        self.heads: Dict[int, int] = {}  # layer -> its query heads
        self.inputs: Dict[int, Tensor] = {}
        self.distances: List[Optional[Tensor]] = [None] * len(self.layers)
        self.errors: List[Optional[Tensor]] = [None] * len(self.layers)
        self.finite = torch.ones(self.valid.shape[0], dtype=torch.bool, device=self.valid.device)
        self.dtype = next(self.model.parameters()).dtype
        self.handles: list = []

    def mine(self) -> bool:
        return threading.get_ident() == self.thread and not self.rerunning

    def install(self) -> None:
        spec: ValueProjection = self.adapter.layer.attention.value
        for idx, layer in enumerate(self.layers):
            self.zero_cols[idx] = value_columns(layer, self.adapter, self.model)
            self.heads[idx] = attention_shape(get_path(layer, self.adapter.attention), self.model)[0]
            self.handles.append(layer.register_forward_pre_hook(self._pre_hook(idx), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._post_hook(idx), with_kwargs=True))
            self.handles.append(get_path(layer, value_module_path(spec)).register_forward_hook(self._zero_hook(idx)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # --- hooks -------------------------------------------------------------------
    def _pre_hook(self, idx: int):
        def hook(module, args, kwargs):
            if self.mine():
                x = args[0] if args else kwargs["hidden_states"]
                self.inputs[idx] = x.detach().clone()  # the layer might change its input in place
        return hook

    def _post_hook(self, idx: int):
        def hook(module, args, kwargs, output):
            if not self.mine():
                return
            if self.distances[idx] is not None:
                raise RuntimeError(
                    f"layer {idx} ({type(module).__name__}) ran twice in one forward pass (a shared layer, as in "
                    "ALBERT): Value Zeroing reruns each layer once per source and does not support it")
            self.rerun_layer(idx, module, args, kwargs, _first_tensor(output).detach())
        return hook

    def _zero_hook(self, idx: int):
        def hook(module, args, output):
            if self.zero_rows is None or not self.rerunning or threading.get_ident() != self.thread:
                return None
            out = output
            shape = out.shape
            n = self.zero_rows.shape[0]
            if out.dim() == 2 and out.shape[0] % n == 0:  # a projection run on flattened tokens (n * T, W)
                out = out.reshape(n, out.shape[0] // n, out.shape[1])
            elif out.dim() == 4 and out.shape[1] == 1:  # (n, 1, T, W): DeepSeek-V3's latent up-projection
                out = out.reshape(n, out.shape[2], out.shape[3])
            cols = self.zero_cols[idx].to(out.device)
            k = (self.zero_rows >= 0).nonzero().flatten().to(out.device)
            j = self.zero_rows.to(out.device)[k]
            out = out.clone()
            out[k[:, None], j[:, None], cols[None, :]] = 0
            return out.reshape(shape)
        return hook

    # --- the reruns ---------------------------------------------------------------
    def rerun_layer(self, idx: int, module: nn.Module, args: tuple, kwargs: dict, real_out: Tensor) -> None:
        r"""Every zeroed rerun of layer ``idx`` (one per real source, and one unzeroed copy per example)."""
        valid = self.valid.to(real_out.device)
        b, t = valid.shape
        x = self.inputs.pop(idx)
        from_args = bool(args)
        rest = args[1:] if from_args else args
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        self.finite &= ((torch.isfinite(x).all(-1) | ~valid).all(-1) & (torch.isfinite(real_out).all(-1) | ~valid).all(-1)
                        ).to(self.finite.device)
        # the pairs (example, zeroed source); source -1: the unzeroed copy that checks the rerun
        ex, src = valid.nonzero(as_tuple=True)
        ex = torch.cat([torch.arange(b, device=valid.device), ex])
        src = torch.cat([torch.full((b,), -1, dtype=torch.long, device=valid.device), src])
        distances = torch.zeros(b, t, t, dtype=torch.float64, device=real_out.device)
        errors = torch.zeros(b, dtype=torch.float64, device=real_out.device)
        real64 = real_out.to(torch.float64)
        scale = torch.linalg.vector_norm(real64, dim=-1).mul(valid).amax(-1).clamp_min(torch.finfo(torch.float64).tiny)
        step = self.owner.chunk_size(t, real_out.shape[-1], real_out.element_size())
        for c0 in range(0, ex.shape[0], step):
            rows, zero = ex[c0:c0 + step], src[c0:c0 + step]
            xs = x.index_select(0, rows.to(x.device))
            r_rest, r_kw = repeat_examples(rest, rows, b, self.heads[idx]), repeat_examples(kw, rows, b, self.heads[idx])
            self.zero_rows, self.rerunning = zero, True
            try:
                out = module(xs, *r_rest, **r_kw) if from_args else module(*r_rest, hidden_states=xs, **r_kw)
            finally:
                self.zero_rows, self.rerunning = None, False
            y = _first_tensor(out).detach().to(real_out.device)
            del out
            ref = real64.index_select(0, rows)
            check = zero < 0
            if bool(check.any()):
                diff = torch.linalg.vector_norm(y[check].to(torch.float64) - ref[check], dim=-1)
                diff = (diff * valid[rows[check]]).amax(-1) / scale[rows[check]]
                errors[rows[check]] = diff
            zeroed = ~check
            if bool(zeroed.any()):
                d = cosine_distances(ref[zeroed], y[zeroed])  # (n, T): row i of example rows[k], source zero[k]
                distances[rows[zeroed], :, zero[zeroed]] = d
        if self.causal:  # i does not attend to j > i: exactly 0 (the reruns give rounding noise at most)
            distances = distances.tril()
        v = valid.to(torch.float64)
        self.distances[idx] = distances * v[:, :, None] * v[:, None, :]
        self.errors[idx] = errors


class ValueZeroingAttribution(DecompositionAttribution):
    r"""Value Zeroing token attributions (Mohebbi et al. 2023): layer reruns without one value, rolled out.

    For every layer and real source token j the layer module is run again on its real input
    with j's value vector zeroed in every head (the value projection's output row j; queries,
    keys and attention probabilities unchanged). C_l[i, j] = 1 - cos(y_i, y_i^{(-j)}) between
    the layer's real output and that rerun's output; each row is divided by its sum over the
    real sources (the diagonal included: zeroing a token's own value counts, as in the
    official code) and the maps are rolled out without adding the identity (the layer
    includes its residual connections): scores = row ``explained_position`` of M_L ... M_1.
    Pad rows and columns are exactly 0; a causal decoder's maps are lower triangular.

    Works for every registered architecture whose description names its value projection
    (``Attention.value``; fused ``c_attn``, interleaved and grouped-query layouts included), with
    any attention implementation (sdpa, eager, ...: no probabilities are recorded). Does not
    depend on a target. The convergence delta is, per example, the largest relative
    difference (over layers, max-norm over real tokens divided by the largest real output
    norm) between an unzeroed batched rerun and the layer's real output: it shows that the
    reruns compute the real layer. A delta above the dtype's guard tolerance warns
    (:class:`~captum_normattr.attr.base.ConsistencyWarning`), or raises with ``strict=True``.

    Cost: one forward pass plus, per layer, (real tokens + 1) reruns of the layer per
    example, batched in chunks under ``memory_budget_mb`` (``docs/value_zeroing.md``).

    Args:
        model: a supported Hugging Face model (``*Model``, ``*ForSequenceClassification``,
            ``*ForCausalLM``).
        explained_position: explained row (None: 0 = [CLS] for encoders, ``"last"`` for
            decoders); see :func:`captum_normattr.options.check_explained_position`.
        memory_budget_mb: memory of one chunk of reruns (estimated from the width, the
            length and the heads).
        strict: raise :class:`~captum_normattr.attr.base.ConsistencyError` when the reruns
            do not reproduce the layer's real output.

    Examples::

        >>> vz = ValueZeroingAttribution(model)
        >>> scores = vz.attribute(ids, additional_forward_args=(mask,))
        >>> res = vz.decompose(ids, additional_forward_args=(mask,))
        >>> res.layer_maps.shape, res.extras["cosine_distances"].shape
        (torch.Size([B, L, T, T]), torch.Size([B, L, T, T]))
    """

    method_name = "Value Zeroing"
    uses_target = False

    def __init__(
        self,
        model: nn.Module,
        explained_position: Union[int, str, Tensor, None] = None,
        memory_budget_mb: float = VALUE_ZEROING_MEMORY_BUDGET_MB,
        strict: bool = False,
    ) -> None:
        self.adapter = get_adapter(model)
        if self.adapter.layer.mixers:  # a hybrid model (LFM2): its other mixers have no value vectors to zero
            raise UnsupportedModelError(
                f"Value Zeroing is not supported for {self.adapter.family}: its layers mix tokens with other mixers "
                f"({', '.join(m.mixer for _, m in self.adapter.layer.mixers)}) beside attention, whose value rerun "
                "is not implemented; use ALTI, GlobEnc, DecompX or ALTI-Logit, which decompose every mixer")
        if self.adapter.layer.single_branches:  # Nemotron-H: one branch per layer, Mamba-2 mixers among them
            raise UnsupportedModelError(
                f"Value Zeroing is not supported for {self.adapter.family}: its layers are single branches (a mixer "
                f"or a feed-forward, by layer type: {', '.join(dict(self.adapter.layer.single_branches))}) and its "
                "value rerun is implemented for attention beside a feed-forward only; use ALTI, GlobEnc, DecompX or "
                "ALTI-Logit, which decompose every layer")
        if self.adapter.layer.per_layer_input is not None:  # Gemma 4: values reused across layers, keys as values
            raise UnsupportedModelError(
                f"Value Zeroing is not supported for {self.adapter.family}: its last layers reuse the values of earlier "
                "layers (num_kv_shared_layers) and its full-attention layers may use their keys as values "
                "(attention_k_eq_v), so zeroing one layer's value projection output is not zeroing that layer's value "
                "vectors alone. DecompXAttribution, ALTILogitAttribution, GlobEncAttribution and ALTIAttribution "
                "decompose it exactly (docs/frontier.md, \"Gemma 4\")")
        if self.adapter.layer.attention.value is None:
            raise ValueError(
                f"Value Zeroing needs the value projection of the {self.adapter.family} layers, which its architecture "
                "description does not name (Attention.value)")
        value_columns(layer_modules(model, self.adapter)[0], self.adapter, model)  # the layout is understood
        explained_position = check_explained_position(explained_position)
        if explained_position is None:
            explained_position = "last" if self.adapter.causal else 0
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        super().__init__(model)
        self.model = model
        self.explained_position = explained_position
        self.memory_budget_mb = check_memory_budget(memory_budget_mb)
        self.strict = strict

    def chunk_size(self, tokens: int, width: int, element_size: int) -> int:
        r"""How many layer reruns run at once under the memory budget.

        One rerun's activations are estimated at T * (16 D + 3 H T) elements (the layer's
        projections, feed-forward and attention scores) plus its float64 output.

        Args:
            tokens: T. width: D. element_size: bytes of one element of the model's dtype.

        Returns:
            The chunk size, at least 1.
        """
        heads = attention_shape(get_path(layer_modules(self.model, self.adapter)[0], self.adapter.attention), self.model)[0]
        per_rerun = tokens * (16 * width + 3 * heads * tokens) * max(element_size, 4) + 8 * tokens * width
        return max(1, int(self.memory_budget_mb * 2**20 // per_rerun))

    def decompose(  # type: ignore[override]
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        target: None = None,
        additional_forward_args: Any = None,
        return_layer_maps: bool = True,
        return_rollout: bool = True,
    ) -> DecompositionResult:
        r"""Rerun every layer once per real source with its value zeroed, and roll the maps out.

        Args:
            inputs: token ids (B, T) (or word embeddings (B, T, D), or pixel values for a
                Vision Transformer), or a 1-tuple.
            target: None: the maps are class-agnostic (anything else raises a ValueError).
            additional_forward_args: attention_mask (B, T), or the model inputs by name,
                ``{"attention_mask": ..., "token_type_ids": ..., "position_ids": ...}``
                (``(attention_mask, token_type_ids)`` positionally for BERT-like encoders only;
                docs/reliability.md, "Position ids and every other model input by name").
            return_layer_maps: keep the (B, L, T, T) row-normalised maps (``layer_maps``) and
                the raw cosine distances (``extras["cosine_distances"]``).
            return_rollout: also form the full (B, T, T) rollout.

        Returns:
            :class:`~captum_normattr.DecompositionResult`: ``scores`` (B, T) (pads 0),
            ``layer_maps``, ``rollout``, ``delta`` (B,) (the reruns' largest relative error)
            and ``extras["rerun_error"]`` (B, L).
        """
        self.check_target(target, inputs)
        prepared = prepare_inputs(self.model, self.adapter, inputs, additional_forward_args)
        valid = prepared.valid
        pos = explained_positions(self.explained_position, valid)
        run = _ZeroingRun(self, prepared)
        try:
            run.install()
            with torch.no_grad(), eval_mode(self.model):
                base_model(self.model)(**prepared.forward_kwargs())
        finally:
            run.remove()
        missing = [i for i, d in enumerate(run.distances) if d is None]
        if missing:
            raise RuntimeError(
                f"the forward pass did not run layer(s) {missing}; the model's structure does not match the "
                f"{self.adapter.family} adapter")
        dev = valid.device
        distances = torch.stack([d.to(dev) for d in run.distances], 1)  # (B, L, T, T) float64
        errors = torch.stack([e.to(dev) for e in run.errors], 1)  # (B, L)
        self._judge(errors, valid)
        with torch.no_grad():
            maps = torch.stack([normalize_rows(distances[:, l], valid) for l in range(distances.shape[1])], 1)
            scores = rollout_rows(maps, pos) * valid.to(maps.dtype)
            joint = rollout(maps) if return_rollout else None
        dtype = torch.float64 if run.dtype == torch.float64 else torch.float32
        extras: Dict[str, Tensor] = {"rerun_error": errors.to(dtype)}
        if return_layer_maps:
            extras["cosine_distances"] = distances.to(dtype)
        scores = scores.to(dtype)
        extras.update(image_extras(prepared, scores))
        finite = run.finite if prepared.finite is None else run.finite & prepared.finite.to(run.finite.device)
        result = DecompositionResult(
            method=self.get_name(),
            scores=scores,
            attention_mask=prepared.attention_mask,
            explained_position=pos,
            delta=errors.amax(1).to(dtype),
            extras=extras,
            layer_maps=maps.to(dtype) if return_layer_maps else None,
            rollout=None if joint is None else joint.to(dtype),
            rollout_convention="raw",
        )
        return mark_non_finite(result, finite)

    def _judge(self, errors: Tensor, valid: Tensor) -> None:
        r"""Warn (or raise, ``strict``) when an unzeroed rerun did not reproduce the layer's real output."""
        tol = guard_tolerance(next(self.model.parameters()).dtype)
        worst = errors.amax(0)  # (L,)
        bad = [f"layer {l}: {float(e):.3g}" for l, e in enumerate(worst.tolist()) if e > tol]
        if not bad:
            return
        msg = (f"{self.get_name()}: rerunning a layer on its real input does not reproduce its real output (relative "
               f"differences above {tol:g} at {', '.join(bad)}): the layer's call depends on more than its input and "
               "arguments (a hook with state, an argument that is not per example), so the zeroed reruns measure "
               "another computation")
        if self.strict:
            raise ConsistencyError(msg)
        if float(worst.max()) > GROSS_RELATIVE:  # as the consistency guard: no rounding explains it
            raise ConsistencyError(msg + f"; differences above {GROSS_RELATIVE:g} are refused even without strict=True "
                                   "(docs/reliability.md, 'Checked reruns')")
        warnings.warn(msg, ConsistencyWarning, stacklevel=4)

    def attribution_and_delta(self, inputs, target, additional_forward_args, **options):
        res = self.decompose(inputs, target, additional_forward_args, return_layer_maps=False, return_rollout=False,
                             **options)
        return format_output(inputs, pixel_attributions(inputs, res)), res.delta

    def get_name(self) -> str:
        return self.method_name
