r"""Streaming capture: each layer's tensors are handed over as soon as the forward pass has made them.

For the duration of one call the model's attention implementation is switched to a
function registered in transformers' ``AttentionInterface``. It computes the usual eager
attention (head by head in chunks, so that no more than one (B, H, T, T) probability
tensor and one chunk of scores exist at a time) and records the probabilities and value
states of the modules the calling thread is recording (an attention module that computes its
own probabilities, as BLOOM's with ALiBi, is described with ``probabilities="returned"``: a
forward hook records the probabilities it returns, the value states from its value
projection's output). Forward hooks record the inputs
and outputs of the norms, the feed-forward block and each layer. When a layer's forward
hook fires, its tensors become one :class:`~captum_normattr.decompose.records.LayerTensors`
that is passed to the caller's ``on_layer`` callback and then dropped: the memory of a
call does not grow with depth (see ``docs/design.md``, "Streaming engine").

Recording is scoped to the calling thread: the hooks and the attention function record
only for recorders that the current thread opened, and a forward pass that no recorder of
its thread watches (another thread's plain forward pass, say) runs the attention
implementation the model had before. The switch of the implementation is reference-counted
per config and the training flags per module (two models sharing a submodule, attributed at
once, give it back its own flag when the last of them ends), under a lock, and restored when
the last call ends, also when it raises. No modeling file is copied or edited.

Guards (``docs/reliability.md``, "Consistency guards"): every point where a user's hook can
change the computation is compared with what the decomposition assumes (the attention
module's real inputs, the feed-forward input, the output projection's input, the residual
joins, each norm rebuilt from its input and parameters, one layer's output against the next
layer's input); each layer module must run exactly once per forward pass, in order; and a
recorded tensor that the model changes in place afterwards is detected at hand-over (its
version counter), after which that tensor is recorded as a copy.

It is over 700 lines because the recording attention function, its thread state and the recorder share private state (the per-thread recorder stack, the switched configs); splitting it into attention / record / recorder / session modules is the next step of the layout (docs/design.md, 'The house').
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.arch.spec import ArchitectureSpec, Norm
from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.primitives.guards import norm_rebuild_error, relative_difference
from captum_normattr.decompose.records import FFParams, LayerTensors, NormParams
from captum_normattr.models.adapters import (
    base_model,
    get_path,
    layer_modules,
    layer_scale,
    linear_params,
    value_states,
)
from captum_normattr.models.experts import experts_ff_params, register_expert_hooks
from captum_normattr.models.weights import module_tensor

__all__ = [
    "ATTENTION_NAME",
    "AttentionRecords",
    "CAUSAL_ROW_BLOCKS",
    "EXAMPLE_BLOCK_BYTES",
    "LayerRunError",
    "ProbabilityBuffers",
    "RecordedTensorModifiedError",
    "Recorder",
    "SCORE_CHUNK_BYTES",
    "branch_multiplier",
    "eval_mode",
    "norm_params",
    "recorder_session",
    "recording",
]

ATTENTION_NAME = "captum_normattr_capture"
#: Bytes of one chunk of attention scores in the recording attention.
SCORE_CHUNK_BYTES = 64 * 2**20
#: Bytes of probabilities per block of examples in the one-chunk recording attention (scores,
#: softmax and mixing of a block run while it is in the CPU cache; measured on MiniLM 32 x 128:
#: 8 MB beat 1-4 MB and the whole batch at once).
EXAMPLE_BLOCK_BYTES = 8 * 2**20
#: Row blocks of causal attention in the recording forward (work ~ (n + 1) / (2 n) of the square).
CAUSAL_ROW_BLOCKS = 8
_MIN_BLOCK_ROWS = 16

_LOCAL = threading.local()  # .stack: the recorders opened by this thread, innermost last
_LOCK = threading.RLock()
_SWITCHED: Dict[int, list] = {}  # id(config) -> [config, original implementation, users]
_FLAGS: Dict[int, list] = {}  # id(module) -> [module, its own training flag, users]
_SESSIONS: Dict[int, List[List[nn.Module]]] = {}  # id(model) -> the module lists of its open sessions
_CLONE_KEYS: Dict[type, frozenset] = {}  # layer class -> recorded keys its forward changes in place
_REGISTERED = False


class RecordedTensorModifiedError(RuntimeError):
    r"""A recorded tensor was changed in place by the forward pass after it was recorded.

    Attributes:
        layer: the layer index. keys: the recorded tensors that changed.
        retry: True when nothing of the pass had been handed over yet, so that the caller
            can run it again (the keys are then recorded as copies).
    """

    def __init__(self, message: str, layer: int, keys: Tuple[str, ...], retry: bool):
        super().__init__(message)
        self.layer, self.keys, self.retry = layer, keys, retry


class LayerRunError(RuntimeError):
    r"""A layer module ran more or fewer times than once per forward pass, or out of order."""


def _version(t: Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        return None


def _same(a: Tensor, b: Tensor) -> bool:
    r"""True when ``a`` and ``b`` are the same elements (same memory, shape, strides and dtype)."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        and a.device == b.device
    )


def _active() -> List["Recorder"]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def _storage_users(t: Tensor, storage: Any) -> Optional[int]:
    r"""How many tensors and storage objects hold ``t``'s memory (None: torch cannot tell)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        return int(count(storage._cdata))
    except Exception:  # pragma: no cover - a torch without the private counter
        return None


class ProbabilityBuffers:
    r"""The recording attention's large buffers, handed out again once nothing else holds them.

    Every layer's probabilities (B, H, T, S) are a fresh allocation the size of the layer's
    attention square (0.6 GB at 4096 tokens on SmolLM2): the operating system maps new zeroed
    pages for it, and that page-faulting costs as much as writing the square once
    (docs/performance.md, "Long prompts on real weights"). A recorder keeps the buffer of the
    last layer and gives it to the next layer **only when no tensor refers to its memory any
    more** (the consumer dropped the layer's record, as the streaming engine does): a caller
    that keeps a layer's probabilities, or any view of them, gets a fresh buffer, so nothing
    it holds is ever overwritten. Used without autograd only; cleared when the recording ends.
    """

    def __init__(self) -> None:
        self._kept: Dict[Tuple, Tuple[Tensor, Any, int]] = {}  # key -> (tensor, its storage, users when free)

    def take(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device, name: str = "probs") -> Tensor:
        r"""An uninitialised tensor of ``shape``: a view of the kept one of that name when free, else a new one.

        The kept tensor itself is never handed out, only views of it, so that every tensor a
        caller holds counts as a user of its memory.
        """
        key = (name, tuple(shape), dtype, str(device))
        entry = self._kept.get(key)
        if entry is not None and not torch.is_grad_enabled() and _storage_users(entry[0], entry[1]) == entry[2]:
            return entry[0].view(shape)  # nothing but this pool refers to its memory
        for k in [k for k in self._kept if k[0] == name]:  # one kept buffer per name
            del self._kept[k]
        t = torch.empty(shape, dtype=dtype, device=device)
        if torch.is_grad_enabled():  # autograd may save it for the backward pass: never reused
            return t
        storage = t.untyped_storage()
        users = _storage_users(t, storage)
        if users is None:
            return t
        self._kept[key] = (t, storage, users)
        return t.view(shape)

    def clear(self) -> None:
        self._kept.clear()


def _causal_row_blocks(attention_mask: Optional[Tensor], t: int, s: int) -> Optional[List[Tuple[int, int]]]:
    r"""Row blocks [r0, r1) whose key columns >= r1 are all masked, or None (no skipping).

    Skipping those columns is exact when every query row also keeps at least one key
    before r1: the masked scores' exponentials are exactly 0 in the full softmax. A fully
    masked row (e.g. a left pad) normalises over every column, so its presence disables
    the skipping, as does any unmasked entry above a block.
    """
    if attention_mask is None or t != s or t <= 4 * _MIN_BLOCK_ROWS:
        return None
    m = attention_mask[..., :s]
    kept = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    step = max(_MIN_BLOCK_ROWS, -(-t // CAUSAL_ROW_BLOCKS))
    blocks = [(r0, min(t, r0 + step)) for r0 in range(0, t, step)]
    if not bool(kept.any(-1).all()) or any(bool(kept[..., r0:r1, r1:].any()) for r0, r1 in blocks):
        return None
    return blocks


def _eager_attention(query, key, value, attention_mask, scaling, dropout, training, keep_probs: bool, position_bias=None,
                     causal: bool = False, softcap: Optional[float] = None, buffers: Optional[ProbabilityBuffers] = None):
    r"""Eager attention computed in chunks of heads; returns (output (B, T, H, Dh), probs or None).

    ``position_bias``: an additive (B or 1, H or 1, T, S) score bias added before the mask
    (T5's relative position bias), or None. ``causal``: the module declares causal
    attention; where the mask confirms it (:func:`_causal_row_blocks`), blocks of query
    rows compute scores, softmax and mixing only over the keys up to their last row (the
    rest of the probabilities is exactly 0), about half the work of the full square.
    ``softcap``: attention-score soft-capping (Gemma 2): the scaled scores become
    ``softcap * tanh(scores / softcap)`` before the bias and the mask, as in the model's eager code.
    ``buffers``: the recorder's :class:`ProbabilityBuffers` (the probabilities and the scores'
    scratch are taken from it, reused across layers when free), or None (fresh tensors).
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: one key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    b, h, t, _ = query.shape
    s = key.shape[-2]
    soft_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    dropping = training and dropout > 0
    blocks = _causal_row_blocks(attention_mask, t, s) if causal and not dropping else None
    per_head = max(1, b * t * s * max(query.element_size(), 4))
    step = max(1, min(h, SCORE_CHUNK_BYTES // per_head))
    if step >= h and blocks is None and query.dtype == soft_dtype and not dropping:
        return _attention_by_examples(query, key, value, attention_mask, scaling, keep_probs, position_bias, softcap,
                                      buffers)
    # one chunk of every head and row: the softmax output is the probabilities (no copy into them)
    whole = step >= h and blocks is None
    if whole:
        probs = None
    elif buffers is not None:
        probs = buffers.take((b, h, t, s), soft_dtype, query.device)
    else:
        probs = torch.empty(b, h, t, s, dtype=soft_dtype, device=query.device)
    # the scores of a block in one reused scratch buffer, soft-maxed in place (same bits as out of place)
    in_place = buffers is not None and not whole and query.dtype == soft_dtype
    scratch = buffers.take((b * step * max(r1 - r0 for r0, r1 in blocks or [(0, t)]) * s,), query.dtype, query.device,
                           "scores") if in_place else None
    for h0 in range(0, h, step):
        sl = slice(h0, min(h, h0 + step))
        for r0, r1, c1 in ((0, t, s),) if blocks is None else ((r0, r1, r1) for r0, r1 in blocks):
            q, k = query[:, sl, r0:r1], key[:, sl, :c1].transpose(2, 3)
            if in_place:
                shape = (b, sl.stop - sl.start, r1 - r0, c1)
                scores = torch.matmul(q, k, out=scratch[: b * shape[1] * shape[2] * c1].view(shape)).mul_(scaling)
            else:
                scores = torch.matmul(q, k).mul_(scaling)
            _soft_cap(scores, softcap)
            _add_bias_and_mask(scores, position_bias, attention_mask, sl, slice(r0, r1), slice(0, c1))
            if whole:
                probs = torch.softmax(scores, dim=-1, dtype=soft_dtype)
            elif in_place:
                probs[:, sl, r0:r1, :c1] = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
            else:
                probs[:, sl, r0:r1, :c1] = torch.softmax(scores, dim=-1, dtype=soft_dtype)
            if c1 < s:
                probs[:, sl, r0:r1, c1:] = 0
            del scores
    used = probs if probs.dtype == query.dtype else probs.to(query.dtype)
    if dropping:
        used = nn.functional.dropout(used, p=dropout, training=True)
    if blocks is None:
        out = torch.matmul(used, value)
    else:
        out = value.new_empty(b, h, t, value.shape[-1])
        for r0, r1 in blocks:
            torch.matmul(used[:, :, r0:r1, :r1], value[:, :, :r1], out=out[:, :, r0:r1])
    out = out.transpose(1, 2).contiguous()
    del used
    return out, (probs if keep_probs else None), value


def _add_bias_and_mask(scores: Tensor, position_bias: Optional[Tensor], attention_mask: Optional[Tensor],
                       heads: slice, rows: slice, cols: slice, examples: slice = slice(None)) -> None:
    r"""Add the position bias and the mask (additive or boolean) to a block of scores, in place.

    Either may have one row per head (B or 1, H, T, S): T5's position bias, or a mask that carries a
    per-head bias (Falcon's ALiBi models add theirs to the mask); the block's heads are taken from it.
    """
    for extra in (position_bias, attention_mask):
        if extra is None:
            continue
        e = extra[..., rows, cols]
        if e.dim() == scores.dim() and e.shape[0] > 1:  # (B, H or 1, T, S): this block's examples
            e = e[examples]
        if e.dim() == scores.dim() and e.shape[1] > 1:  # one row per head: this block's heads
            e = e[:, heads]
        if extra is position_bias:
            scores.add_(e)
        elif e.dtype == torch.bool:
            scores.masked_fill_(~e, torch.finfo(scores.dtype).min)
        else:
            scores.add_(e)


def _soft_cap(scores: Tensor, softcap: Optional[float]) -> None:
    r"""``softcap * tanh(scores / softcap)`` in place (nothing when ``softcap`` is None)."""
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)


def _attention_by_examples(query, key, value, attention_mask, scaling, keep_probs: bool, position_bias, softcap=None,
                           buffers: Optional[ProbabilityBuffers] = None):
    r"""Eager attention in blocks of examples of about :data:`EXAMPLE_BLOCK_BYTES` of probabilities.

    Each block's scores are written straight into the probabilities' buffer, the softmax runs
    in place (bitwise the out-of-place result) and the block is mixed into the context while
    it is still in the CPU cache: one fresh (B, H, T, S) buffer per layer and one pass over it
    through main memory, instead of two buffers and four passes (docs/performance.md, "GlobEnc on MiniLM, memory passes and the quadratic forms").
    """
    b, h, t, _ = query.shape
    s = key.shape[-2]
    probs = query.new_empty(b, h, t, s) if buffers is None else buffers.take((b, h, t, s), query.dtype, query.device)
    out = value.new_empty(b, h, t, value.shape[-1])
    step = max(1, EXAMPLE_BLOCK_BYTES // max(1, h * t * s * query.element_size()))
    for b0 in range(0, b, step):
        ex = slice(b0, min(b, b0 + step))
        scores = torch.matmul(query[ex], key[ex].transpose(2, 3), out=probs[ex]).mul_(scaling)
        _soft_cap(scores, softcap)
        _add_bias_and_mask(scores, position_bias, attention_mask, slice(None), slice(None), slice(None), ex)
        torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        torch.matmul(scores, value[ex], out=out[ex])
    return out.transpose(1, 2).contiguous(), (probs if keep_probs else None), value


def _recording_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
):
    r"""Eager attention that records probabilities and values for the current thread's recorders.

    A module that no recorder of this thread watches runs the model's original
    implementation (sdpa, flash, ...), so other threads are unaffected.
    """
    watching = [r for r in _active() if r.watches(module)]
    needs_probs = any(r.record_probabilities for r in watching)
    # nobody watches, or the watchers need no probabilities: the model's own attention, where it computes what the
    # recording attention would (a soft-cap or a position bias that the model's sdpa ignores keeps the eager code,
    # so that a pass without probabilities agrees with the reruns that record them)
    same = not watching or (kwargs.get("softcap") is None and kwargs.get("position_bias") is None)
    if not needs_probs and same:
        fn = _original_attention(module)
        if fn is not None:
            if (getattr(module, "is_causal", False) and query.shape[2] == key.shape[2] and query.shape[2] > 1
                    and kwargs.get("position_bias") is None and _plain_causal(attention_mask)):
                attention_mask = None  # as the model's own mask function gives sdpa: its causal kernel skips the triangle
            out, _ = fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            if watching:
                groups = query.shape[1] // key.shape[1]
                values = value.repeat_interleave(groups, dim=1) if groups > 1 else value
                for recorder in watching:
                    recorder.record_attention(module, None, values, out if not (module.training and dropout > 0) else None)
            return out, None
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("learned attention sinks (s_aux) are not supported by captum_normattr")
    out, probs, values = _eager_attention(
        query, key, value, attention_mask, scaling, dropout, module.training, keep_probs=needs_probs,
        position_bias=kwargs.get("position_bias"), causal=bool(getattr(module, "is_causal", False)),
        softcap=kwargs.get("softcap"), buffers=getattr(watching[0], "buffers", None) if watching else None,
    )
    for recorder in watching:
        recorder.record_attention(module, probs, values, out if not (module.training and dropout > 0) else None)
    return out, probs


#: (weak reference to the last mask judged, the answer): one tuple, replaced whole (threads), and no
#: strong reference, so a (B, 1, T, T) mask is never kept alive after its pass
_PLAIN_CAUSAL: List[Tuple[Any, bool]] = [(lambda: None, False)]


def _plain_causal(mask: Optional[Tensor]) -> bool:
    r"""Whether an attention mask (B, 1 or H, T, T) is exactly the causal mask of unpadded examples.

    The recording switches the model's mask function to the eager one (a full additive mask);
    where that mask says no more than causality, the model's own attention is called without
    it, as the model itself would be (sdpa's causal path). The answer for the last mask seen
    is kept (every layer of a pass gets the same mask tensor).
    """
    if mask is None or mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        return False
    last, answer = _PLAIN_CAUSAL[0]
    if last() is mask:
        return answer
    t = mask.shape[-1]
    kept = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    want = torch.ones(t, t, dtype=torch.bool, device=mask.device).tril_()
    answer = bool((kept == want).all())
    if answer and mask.dtype != torch.bool:
        answer = bool((mask.masked_select(want.expand_as(mask)) == 0).all())  # no additive bias on the kept keys
    _PLAIN_CAUSAL[0] = (weakref.ref(mask), answer)
    return answer


def _original_attention(module: nn.Module) -> Optional[Callable]:
    r"""The attention function the model was configured with (sdpa, flash, ...) before the recording, or None
    (eager, or not known to transformers): the one a module runs where nobody needs its probabilities."""
    entry = _SWITCHED.get(id(getattr(module, "config", None)))
    original = entry[1] if entry is not None else None
    if original in (None, "eager", ATTENTION_NAME):
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get(original) if hasattr(ALL_ATTENTION_FUNCTIONS, "get") else None


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, _recording_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
    _REGISTERED = True


def _configs(model: nn.Module):
    from transformers import PretrainedConfig

    seen = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            seen[id(cfg)] = cfg
    return list(seen.values())


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
    h = ff.act(pre) if ff.w_gate is None else ff.act(linear(u, ff.w_gate, ff.b_gate)) * pre
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


def _first_tensor(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class AttentionRecords:
    r"""What a recorder does when the recording attention runs a module: the shared part of
    :class:`Recorder` and the encoder-decoder recorder.

    A subclass sets ``_attn_keys`` (id of each watched attention module -> the key of its
    record in ``records``) and ``keeps_context`` (whether the attention context is kept).
    """

    _attn_keys: Dict[int, Any]
    records: Dict[Any, Dict[str, Tensor]]
    keeps_context: bool = True
    #: the recording attention's reusable buffers (:class:`ProbabilityBuffers`; None: fresh tensors)
    buffers: Optional[ProbabilityBuffers] = None
    #: False: the watched modules run the model's own attention (sdpa, ...) and record no probabilities
    #: (values and context only); a rerun of a layer (:meth:`Recorder.rerun_layer`) records them
    record_probabilities: bool = True

    def watches(self, module: nn.Module) -> bool:
        return id(module) in self._attn_keys

    def _mine(self) -> bool:
        return self in _active()

    def record_attention(self, module: nn.Module, probs: Optional[Tensor], values: Tensor,
                         context: Optional[Tensor] = None) -> None:
        r"""Keep a watched module's probabilities (None: not recorded, :attr:`record_probabilities`), values and
        (if kept and given) attention context (B, T, H, Dh)."""
        key = self._attn_keys.get(id(module))
        if key is not None:
            rec = self.records.setdefault(key, {})
            if probs is not None:
                rec["probs"] = probs.detach()
            rec["values"] = values.detach()
            if context is not None and self.keeps_context:
                rec["context"] = context.detach()
            self._recorded(key, rec, ("probs", "values", "context"))

    def _recorded(self, key: Any, rec: Dict[str, Tensor], names: Tuple[str, ...]) -> None:
        r"""Called after ``names`` were stored in ``rec`` (a subclass keeps their versions)."""


class Recorder(AttentionRecords):
    r"""Records one forward pass layer by layer and hands each layer to ``on_layer``.

    Args:
        model: a supported ``transformers`` model.
        adapter: its :class:`~captum_normattr.models.adapters.ArchitectureSpec`.
        dtype: the compute dtype of the handed-over tensors (float32 or float64).
        on_layer: called with every layer's :class:`LayerTensors` as soon as the layer has
            run; the recorder keeps nothing of it afterwards.
        keep_calls: keep each layer's call arguments (masks and position embeddings, shared
            between layers) so that :meth:`rerun_layer` can recompute a layer later.
        clone_keys: recorded tensors kept as copies (None: those that the forward pass of
            this layer class was seen to change in place, :class:`RecordedTensorModifiedError`).

    Raises:
        LayerRunError: the model's layer list holds one module more than once (shared layers).
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: ArchitectureSpec,
        dtype: torch.dtype,
        on_layer: Callable[[LayerTensors], None],
        keep_calls: bool = False,
        clone_keys: Optional[frozenset] = None,
    ):
        self.model = model
        self.adapter = adapter
        #: the layer kind: what is recorded of each layer and checked (its ``capture`` recipe)
        self.kind = layer_kind(adapter.topology, adapter.family)
        self.dtype = dtype
        self.on_layer = on_layer
        self.keep_calls = keep_calls
        self.layers = layer_modules(model, adapter)
        if len({id(m) for m in self.layers}) != len(self.layers):
            raise LayerRunError(
                f"the {adapter.family} model's layer list holds the same module more than once (shared layers, as in "
                "ALBERT): a layer that runs several times per forward pass is not supported"
            )
        self.base = base_model(model)
        self._attn_keys = {id(get_path(layer, adapter.attention)): i for i, layer in enumerate(self.layers)}
        self.records: Dict[int, Dict[str, Tensor]] = {}
        self.versions: Dict[int, Dict[str, Optional[int]]] = {}
        self.checks: Dict[int, Dict[str, Tensor]] = {}
        self.calls: Dict[int, Tuple[tuple, dict, bool]] = {}
        self.final: Dict[str, Tensor] = {}
        self.final_versions: Dict[str, Optional[int]] = {}
        self.layers_done = 0
        self.handed_over = 0
        self.clone_keys = _CLONE_KEYS.get(type(self.layers[0]), frozenset()) if clone_keys is None else clone_keys
        self._ran = [False] * len(self.layers)
        self._rerunning = False
        self._last_out: Optional[Tuple[int, Tensor]] = None  # (index, raw output) of the last layer that ran

    # --- recording --------------------------------------------------------------
    def _keep(self, idx: int, key: str, t: Tensor) -> None:
        t = t.detach()
        if key in self.clone_keys:
            t = t.clone()
        rec = self.records.setdefault(idx, {})
        rec[key] = t
        self.versions.setdefault(idx, {})[key] = _version(t)

    def _recorded(self, key: Any, rec: Dict[str, Tensor], names: Tuple[str, ...]) -> None:
        versions = self.versions.setdefault(key, {})
        for name in names:
            if name in rec:
                if name in self.clone_keys:
                    rec[name] = rec[name].clone()
                versions[name] = _version(rec[name])

    def _check(self, idx: int, name: str, real: Tensor, expected: Optional[Tensor]) -> None:
        r"""Keep the relative difference of a real tensor from the assumed one (0 when they are the same memory)."""
        if expected is None or _same(real, expected):
            return
        rel = relative_difference(real.detach().to(self.dtype), expected.detach())
        checks = self.checks.setdefault(idx, {})
        checks[name] = torch.maximum(checks[name], rel) if name in checks else rel

    def _start_layer(self, idx: int, x: Tensor) -> None:
        r"""Guard the order of the layers (each once per pass) and the hand-over of the stream."""
        if self._rerunning:
            return
        if idx == 0 and all(self._ran):  # a new forward pass inside the same recording
            self._ran = [False] * len(self._ran)
            self._last_out = None
        if self._ran[idx]:
            raise LayerRunError(
                f"layer {idx} ({type(self.layers[idx]).__name__}) ran twice in one forward pass (a shared layer, as in "
                "ALBERT, or a wrapper calling it again): its tensors would be decomposed once; this is not supported"
            )
        skipped = [j for j in range(idx) if not self._ran[j]]
        if skipped:
            raise LayerRunError(
                f"layer {idx} ran before layer(s) {skipped} in one forward pass: the layers must run once each, in order"
            )
        self._ran[idx] = True
        if self._last_out is not None and self._last_out[0] == idx - 1:
            self._check(idx, "layer input vs the previous layer's output", x, self._last_out[1])
        self._last_out = None

    def check_complete(self) -> None:
        r"""Raise :class:`LayerRunError` if the last forward pass did not run every layer."""
        missing = [i for i, ran in enumerate(self._ran) if not ran]
        if missing:
            raise LayerRunError(
                f"the forward pass ran {len(self._ran) - len(missing)} of {len(self._ran)} layers (not layer(s) "
                f"{missing}); the model's structure does not match the {self.adapter.family} adapter"
            )

    def _hooks(self) -> list:
        a = self.adapter
        handles = []

        def store(idx: int, key: str, what: str):
            def hook(module, args, output):
                if not self._mine():
                    return
                if what in ("in", "both"):
                    self._keep(idx, key + "_in", _first_tensor(args))
                if what in ("out", "both"):
                    self._keep(idx, key + "_out", _first_tensor(output))

            return hook

        def compare_inputs(idx: int, name: str, assumed_key: str, all_tensors: bool, first_only: bool = False):
            # kwargs=None: torch adds a with_kwargs hook in two steps, so another thread's forward pass may call
            # it without kwargs in between; it is not that thread's recording, so the hook does nothing then
            def pre_hook(module, args, kwargs=None):
                if not self._mine():
                    return
                rec = self.records.get(idx, {})
                assumed = rec.get(assumed_key)
                if assumed is None:
                    return
                given = list(args) + (list((kwargs or {}).values()) if all_tensors else [])
                if first_only:  # the module's first input is its input (BLOOM's attention takes the residual too)
                    given = given[:1] if args else [(kwargs or {}).get("hidden_states")]
                for x in given:
                    if isinstance(x, Tensor) and x.shape == assumed.shape:
                        self._check(idx, name, x, assumed)

            return pre_hook

        def context_check(idx: int):
            def pre_hook(module, args):
                if not self._mine() or not args or not isinstance(args[0], Tensor):
                    return
                ctx = self.records.get(idx, {}).get("context")
                if ctx is not None and args[0].numel() == ctx.numel():
                    x = args[0]
                    if not (x.data_ptr() == ctx.data_ptr() and x.is_contiguous() and ctx.is_contiguous()):
                        self._check(idx, "output projection input vs the attention context", x, ctx)

            return pre_hook

        def identity_norm(idx: int, key: str):
            # a branch without a pre-norm (OLMo 2): the "norm" output is the branch module's input
            def pre_hook(module, args, kwargs=None):
                if not self._mine():
                    return
                x = args[0] if args else (kwargs or {}).get("hidden_states")
                self._keep(idx, key + "_in", x)
                self._keep(idx, key + "_out", x)

            return pre_hook

        def norm_hook(module: nn.Module, norm: Norm, idx: int, key: str):
            if norm.kind == "identity":
                return module.register_forward_pre_hook(identity_norm(idx, key), with_kwargs=True)
            return module.register_forward_hook(store(idx, key, "both"))

        returned = a.layer.attention.probabilities == "returned"

        def returned_attention(idx: int, layer: nn.Module):
            # a module computing its own attention (BLOOM): (output, probabilities) returned, values from the projection
            attention = get_path(layer, a.attention)

            def value_hook(module, args, output):
                if self._mine():
                    self.records.setdefault(idx, {})["_projection"] = _first_tensor(output).detach()

            def context_hook(module, args):
                if self._mine() and args and isinstance(args[0], Tensor):
                    self.records.setdefault(idx, {})["_context"] = args[0].detach()

            def attention_hook(module, args, output):
                if not self._mine():
                    return
                rec = self.records.setdefault(idx, {})
                probs = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
                projection = rec.pop("_projection", None)
                if not isinstance(probs, Tensor) or probs.dim() != 4 or projection is None:
                    raise RuntimeError(
                        f"layer {idx}: the {a.family} description says the attention module returns (output, "
                        "probabilities) and reads its value projection, but the forward pass gave "
                        f"{type(probs).__name__} probabilities" + (" and no value projection output" if projection is None
                                                                    else ""))
                values = value_states(projection, layer, a, probs.shape[1])
                ctx = rec.pop("_context", None)
                if ctx is not None and ctx.numel() == values.numel():
                    ctx = ctx.reshape(values.shape[0], values.shape[2], values.shape[1], values.shape[3])
                else:
                    ctx = None
                self.record_attention(module, probs, values, ctx)

            return [get_path(layer, a.layer.attention.value.path).register_forward_hook(value_hook),
                    get_path(layer, a.attn_out).register_forward_pre_hook(context_hook),
                    attention.register_forward_hook(attention_hook)]

        recipe = self.kind.capture

        def keep_output(idx: int, key: str):
            def hook(module, args, output):
                if self._mine():
                    self._keep(idx, key, _first_tensor(output))

            return hook

        with _LOCK:
            for i, layer in enumerate(self.layers):

                def pre_hook(module, args, kwargs=None, idx=i):  # kwargs=None: see compare_inputs
                    if not self._mine() or kwargs is None:
                        return
                    from_args = bool(args)
                    x = args[0] if from_args else kwargs.get("hidden_states")
                    self._start_layer(idx, x)
                    self._keep(idx, "hidden_in", x)
                    if self.keep_calls:
                        rest = args[1:] if from_args else args
                        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                        self.calls[idx] = (rest, kw, from_args)

                def post_hook(module, args, output, idx=i):
                    if not self._mine():
                        return
                    self._keep(idx, "layer_out", _first_tensor(output))
                    if a.final_norm is None and idx == len(self.layers) - 1 and not self._rerunning:
                        # no final norm (post-LN OPT): the LM head reads the last layer's output (an identity "norm")
                        out = self.records[idx]["layer_out"]
                        self.final["in"] = self.final["out"] = out
                        self.final_versions["in"] = self.final_versions["out"] = _version(out)
                    self._finish_layer(idx)

                handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
                handles.append(norm_hook(get_path(layer, a.ln1), a.norm1, i, "ln1"))
                handles.append(norm_hook(get_path(layer, a.ln2), a.norm2, i, "ln2"))
                if returned:
                    handles.extend(returned_attention(i, layer))
                for key, norm in (("attn_post", a.layer.attention.post_norm), ("ff_post", a.layer.ff.post_norm)):
                    if norm is not None:  # the norms on the branch outputs that the description has
                        handles.append(get_path(layer, norm.path).register_forward_hook(store(i, key, "both")))
                if recipe.branch_output is not None:  # the attention branch output as it joins the stream (parallel)
                    attn_branch = get_path(layer, a.attn_scale if a.attn_scale is not None else a.attn_out)
                    handles.append(attn_branch.register_forward_hook(keep_output(i, recipe.branch_output)))
                if a.layer.ff.kind == "experts":  # the routing the experts module is called with, and the shared gate
                    handles.extend(register_expert_hooks(
                        layer, a.layer.ff, self._mine, lambda key, t, idx=i: self._keep(idx, key, t),
                        lambda name, real, assumed, idx=i: self._check(idx, name, real, assumed),
                        lambda idx=i: self.records.get(idx, {}).get(recipe.ff_input)))
                ff_out_module = get_path(layer, a.ff_scale if a.ff_scale is not None else a.ff_out)  # FF(u), layer scale inside
                handles.append(ff_out_module.register_forward_hook(store(i, "ff", "out")))
                handles.append(get_path(layer, a.attention).register_forward_pre_hook(
                    compare_inputs(i, "attention input vs " + recipe.attention_input_name, recipe.attention_input, True,
                                   returned), with_kwargs=True))
                for path in (a.ff_in, a.ff_gate):
                    if path is not None:
                        handles.append(get_path(layer, path).register_forward_pre_hook(compare_inputs(
                            i, "feed-forward input vs " + recipe.ff_input_name, recipe.ff_input, False)))
                handles.append(get_path(layer, a.attn_out).register_forward_pre_hook(context_check(i)))
                if a.layer.attention.probabilities == "module_output":  # DeBERTa: the module computes its attention
                    handles.extend(self._module_output_hooks(layer))
                handles.append(layer.register_forward_hook(post_hook))
            if a.final_norm is not None:

                def final_hook(module, args, output):
                    if not self._mine():
                        return
                    for key, t in (("in", _first_tensor(args)), ("out", _first_tensor(output))):
                        t = t.detach()
                        self.final[key] = t.clone() if "final_" + key in self.clone_keys else t
                        self.final_versions[key] = _version(self.final[key])

                handles.append(get_path(self.base, a.final_norm).register_forward_hook(final_hook))
        return handles

    def _module_output_hooks(self, layer: nn.Module) -> list:
        r"""Hooks that record the probabilities an attention module computes itself (``probabilities="module_output"``).

        The module is called with ``output_attentions=True`` (its own forward then returns
        ``(context, probabilities)``; what its caller receives does not change, DeBERTa's
        attention block drops the probabilities unless it asked for them); its value
        projection's output, reshaped per head, is recorded as the values, and its context
        output (B, T, H * Dh) as the attention context.
        """
        a = self.adapter
        module = get_path(layer, a.attention)
        value_module = get_path(layer, a.attn_value)
        signature = inspect.signature(module.forward)
        if "output_attentions" not in signature.parameters:
            raise ValueError(
                f"the {a.family} description records the probabilities from the output of {type(module).__name__}, "
                "whose forward takes no output_attentions argument"
            )
        got: Dict[str, Tensor] = {}

        def ask(mod, args, kwargs):
            if not self._mine():
                return None
            bound = signature.bind(*args, **kwargs)
            bound.arguments["output_attentions"] = True
            return bound.args, bound.kwargs

        def keep_values(mod, args, output):
            if self._mine():
                got["values"] = _first_tensor(output)

        def record(mod, args, output):
            if not self._mine():
                return
            values = got.pop("values", None)
            if not isinstance(output, (tuple, list)) or len(output) < 2 or output[1] is None or values is None:
                raise RuntimeError(
                    f"{type(mod).__name__} returned no attention probabilities with output_attentions=True (or its value "
                    f"projection did not run); the {a.family} description does not match the model"
                )
            probs, context = output[1], output[0]
            b, h, t, s = probs.shape
            values = values.reshape(b, s, h, -1).transpose(1, 2)
            self.record_attention(mod, probs, values, context.reshape(b, t, h, -1))

        return [
            module.register_forward_pre_hook(ask, with_kwargs=True),
            value_module.register_forward_hook(keep_values),
            module.register_forward_hook(record),
        ]

    def _changed_in_place(self, idx: int, rec: Dict[str, Tensor]) -> None:
        versions = self.versions.pop(idx, {})
        changed = tuple(k for k, v in versions.items() if v is not None and k in rec and _version(rec[k]) != v)
        if not changed:
            return
        layer_type = type(self.layers[idx])
        with _LOCK:
            _CLONE_KEYS[layer_type] = _CLONE_KEYS.get(layer_type, frozenset()) | frozenset(changed)
        retry = self.handed_over == 0 and not self._rerunning
        raise RecordedTensorModifiedError(
            f"layer {idx}: the forward pass changed the recorded tensor(s) {list(changed)} in place after they were "
            f"recorded (an in-place operation of the model's code or of a hook, such as `mlp_output += attention_output`); "
            + ("they are recorded as copies from now on: run the call again" if not retry else "retrying with copies"),
            idx, changed, retry,
        )

    def _finish_layer(self, idx: int) -> None:
        rec = self.records.pop(idx, {})
        missing = [k for k in self.kind.capture.record_keys if k not in rec
                   and not (k == "probs" and not self.record_probabilities)]
        if missing:
            raise RuntimeError(
                f"layer {idx}: the forward pass recorded no {missing}; the model's structure does not match the "
                f"{self.adapter.family} adapter"
            )
        self._changed_in_place(idx, rec)
        tensors = self.layer_tensors(idx, rec)
        self._last_out = (idx, rec["layer_out"])
        del rec
        self.layers_done = max(self.layers_done, idx + 1)
        if not self._rerunning:
            self.handed_over += 1
        self.on_layer(tensors)

    def _layer_checks(self, idx: int, rec: Dict[str, Tensor], t: LayerTensors) -> Dict[str, Tensor]:
        r"""The layer's consistency checks: those of its hooks, the norms rebuilt, the residual joins.

        ``rec``: the raw recorded tensors (identical memory needs no arithmetic); ``t``: the
        same in the compute dtype.
        """
        recipe = self.kind.capture
        for name, real, assumed in recipe.identity_checks:
            self._check(idx, name, rec[real], rec[assumed])
        checks = self.checks.pop(idx, {})
        checks["first norm rebuilt from its input"] = norm_rebuild_error(t.ln1_in, t.ln1_out, t.ln1)
        checks["second norm rebuilt from its input"] = norm_rebuild_error(t.ln2_in, t.ln2_out, t.ln2)
        checks.update(self.kind.join_checks(t))
        checks["feed-forward output rebuilt from its input and weights (last position)"] = _ff_rebuild_error(t)
        if recipe.attention_join is not None and t.context is not None:
            checks["residual join vs the layer input plus the attention output rebuilt from its weights (last position)"] = (
                _attention_join_error(t, recipe.attention_join))
        return checks

    # --- what the recorded tensors become ---------------------------------------
    def layer_tensors(self, idx: int, rec: Dict[str, Tensor]) -> LayerTensors:
        r"""One layer's :class:`LayerTensors` in the compute dtype, from its recorded tensors.

        Every tensor, weights included, is put on the device the layer's attention ran on
        (its execution device under accelerate; weights of offloaded modules are read from
        their hook, :mod:`captum_normattr.models.weights`).
        """
        a, dtype = self.adapter, self.dtype
        layer = self.layers[idx]
        device = (rec["probs"] if rec.get("probs") is not None else rec["values"]).device
        cast = lambda t: None if t is None else t.detach().to(device=device, dtype=dtype)
        b, t_len = rec["hidden_in"].shape[:2]

        def tokens(t: Optional[Tensor]) -> Optional[Tensor]:
            # a layer that flattens its tokens (OPT's FF runs on (B * T, D)): back to (B, T, D)
            if t is not None and t.dim() == 2 and t.shape[0] == b * t_len:
                t = t.reshape(b, t_len, t.shape[-1])
            return cast(t)

        w_o, b_o = linear_params(get_path(layer, a.attn_out), a.transposed_weights)
        experts = a.layer.ff.kind == "experts"  # the sparse block's weights are read by experts_ff_params below
        w_in, b_in = (None, None) if experts else linear_params(get_path(layer, a.ff_in), a.transposed_weights)
        w_out, b_out = (None, None) if experts else linear_params(get_path(layer, a.ff_out), a.transposed_weights)
        if a.attn_scale is not None or a.ff_scale is not None:  # DINOv2 layer scale, folded (a per-channel scale is linear)
            w_o, b_o = _scaled(w_o, b_o, layer_scale(layer, a.attn_scale))
            w_out, b_out = _scaled(w_out, b_out, layer_scale(layer, a.ff_scale))
        # Granite's residual multipliers h = x + m * Attn(..), y = h + m * FF(..): scalars, folded like the layer
        # scales; the recorded branch outputs (the projections' outputs) are scaled below to what joins the stream
        m_attn = branch_multiplier(self.base, a.layer.attention.multiplier)
        m_ff = branch_multiplier(self.base, a.layer.ff.multiplier)
        if m_attn is not None:
            w_o, b_o = _scaled(w_o, b_o, torch.tensor(m_attn, dtype=torch.float64))
        if m_ff is not None:
            w_out, b_out = _scaled(w_out, b_out, torch.tensor(m_ff, dtype=torch.float64))
        w_g = b_g = None
        if a.layer.ff.kind == "fused_gate_up":  # Phi-3's gate_up_proj: the gate and up halves of one projection
            w_in, b_in, w_g, b_g = _split_gate_up(w_in, b_in, a.layer.ff.gate_first)
        elif a.ff_gate is not None:
            w_g, b_g = linear_params(get_path(layer, a.ff_gate), a.transposed_weights)
        if experts:
            ff = experts_ff_params(layer, a.layer.ff, rec, dtype, device)
        else:
            ff = FFParams(cast(w_in), cast(b_in), cast(w_out), cast(b_out), get_path(layer, a.ff_act), cast(w_g), cast(b_g))
        tensors = LayerTensors(
            hidden_in=cast(rec["hidden_in"]),
            probs=cast(rec.get("probs")),
            values=cast(rec["values"]),
            context=cast(rec.get("context")),
            out_weight=cast(w_o),
            out_bias=cast(b_o),
            ln1=norm_params(get_path(layer, a.ln1), a.norm1, dtype, device),
            ln1_in=tokens(rec["ln1_in"]),
            ln1_out=tokens(rec["ln1_out"]),
            ln2=norm_params(get_path(layer, a.ln2), a.norm2, dtype, device),
            ln2_in=tokens(rec["ln2_in"]),
            ln2_out=tokens(rec["ln2_out"]),
            ff_out=_times(tokens(rec["ff_out"]), m_ff),
            layer_out=tokens(rec["layer_out"]),
            ff=ff,
            causal=a.causal,
            index=idx,
            source_dtype=rec["layer_out"].dtype,
            topology=a.topology,
        )
        # what the kind adds to the record (its capture recipe): its extra recorded tensors (the attention
        # branch output, as it joins the stream, times the branch multiplier) and the norms on the branch outputs
        recipe = self.kind.capture
        extra = {k: tokens(rec[k]) for k in recipe.extra_keys}
        if recipe.branch_output is not None:
            extra[recipe.branch_output] = _times(extra[recipe.branch_output], m_attn)
        described = {"attn_post": a.layer.attention.post_norm, "ff_post": a.layer.ff.post_norm}
        post_norms = {k: norm_params(get_path(layer, described[k].path), described[k], dtype, device) for k in recipe.post_norms}
        self.kind.fill_record(tensors, extra, post_norms)
        tensors.checks = self._layer_checks(idx, rec, tensors)
        return tensors

    def final_norm_tensors(self) -> Tuple[NormParams, Tensor, Tensor]:
        r"""The final norm of a pre-LN model: (parameters, real input, real output), in the compute dtype.

        A model whose LM head reads the last layer's output (a post-LN decoder without a final
        norm, OPT with ``do_layer_norm_before=False``) gives the identity norm over that output.

        Raises:
            RuntimeError: if the forward pass did not reach the final norm (or the last layer).
        """
        if "in" not in self.final:
            raise RuntimeError(f"the forward pass recorded no final norm for the {self.adapter.family} adapter")
        changed = [k for k, v in self.final_versions.items() if v is not None and _version(self.final[k]) != v]
        if changed:
            with _LOCK:
                layer_type = type(self.layers[0])
                _CLONE_KEYS[layer_type] = _CLONE_KEYS.get(layer_type, frozenset()) | {"final_" + k for k in changed}
            raise RecordedTensorModifiedError(
                f"the forward pass changed the recorded final norm {changed} in place after it was recorded; it is "
                "recorded as a copy from now on: run the call again", len(self.layers), tuple(changed), False)
        device = self.final["out"].device
        if self.adapter.final_norm is None:  # the LM head reads the last layer's output: an identity final norm
            p = norm_params(None, "identity")
        else:
            p = norm_params(get_path(self.base, self.adapter.final_norm), self.adapter.head.final_norm, self.dtype, device)
        return p, self.final["in"].to(device=device, dtype=self.dtype), self.final["out"].to(self.dtype)

    def rerun_layer(self, idx: int, hidden_in: Tensor) -> LayerTensors:
        r"""Run layer ``idx`` again on ``hidden_in`` (its checkpointed input) and return its tensors.

        Needs ``keep_calls=True`` and the forward pass to have reached the layer; used by
        algorithms that walk the layers top-down (the DecompX adjoint) instead of keeping
        every layer's attention probabilities.
        """
        if idx not in self.calls:
            raise RuntimeError(f"layer {idx} cannot be recomputed: its call was not recorded (keep_calls=True)")
        rest, kw, from_args = self.calls[idx]
        got: List[LayerTensors] = []
        saved, saved_probs = self.on_layer, self.record_probabilities
        self.on_layer = got.append
        self._rerunning = True
        self.record_probabilities = True  # the rerun is what needs them
        try:
            x = hidden_in.to(next(self.layers[idx].parameters()).dtype)
            if from_args:
                self.layers[idx](x, *rest, **kw)
            else:
                self.layers[idx](*rest, hidden_states=x, **kw)
        finally:
            self.on_layer, self.record_probabilities = saved, saved_probs
            self._rerunning = False
        return got[0]


def _switch_on(model: nn.Module, configs) -> None:
    r"""Switch the attention of ``configs`` to the recording function and ``model`` to eval mode.

    Reference-counted under the lock: the implementation per config, the training flag per
    module (a submodule shared by two models keeps its own flag until the last call that
    holds it through either model ends). Undone by :func:`_switch_off`.
    """
    with _LOCK:
        for cfg in configs:
            entry = _SWITCHED.get(id(cfg))
            if entry is None:
                _SWITCHED[id(cfg)] = [cfg, cfg.__dict__.get("_attn_implementation_internal"), 1]
                cfg.__dict__["_attn_implementation_internal"] = ATTENTION_NAME
            else:
                entry[2] += 1
        modules = list(model.modules())
        for m in modules:
            entry = _FLAGS.get(id(m))
            if entry is None:
                _FLAGS[id(m)] = [m, m.training, 1]
            else:
                entry[2] += 1
        _SESSIONS.setdefault(id(model), []).append(modules)
        model.eval()


def _switch_off(model: nn.Module, configs) -> None:
    r"""Undo one :func:`_switch_on` of ``model``: the last holder of a config or module restores it."""
    with _LOCK:
        for cfg in configs:
            entry = _SWITCHED.get(id(cfg))
            if entry is None:
                continue
            entry[2] -= 1
            if entry[2] == 0:
                cfg.__dict__["_attn_implementation_internal"] = entry[1]
                del _SWITCHED[id(cfg)]
        sessions = _SESSIONS.get(id(model))
        if not sessions:
            return
        modules = sessions.pop()
        if not sessions:
            del _SESSIONS[id(model)]
        for m in modules:
            entry = _FLAGS.get(id(m))
            if entry is None:
                continue
            entry[2] -= 1
            if entry[2] == 0:
                m.training = entry[1]
                del _FLAGS[id(m)]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    r"""Run the block with ``model`` in eval mode; every submodule's training flag is restored afterwards.

    Reference-counted together with the recorded forward passes (:func:`recording`), so that a
    block nested in a recording (or a recording in the block) restores the flags only when the
    last of them ends.
    """
    _switch_on(model, ())
    try:
        yield
    finally:
        _switch_off(model, ())


@contextlib.contextmanager
def recording(
    model: nn.Module,
    adapter: ArchitectureSpec,
    on_layer: Callable[[LayerTensors], None],
    dtype: torch.dtype = torch.float32,
    keep_calls: bool = False,
    probabilities: bool = True,
) -> Iterator[Recorder]:
    r"""Record the forward passes run inside the block, handing each layer to ``on_layer``.

    Inside the block the model runs in eval mode with the recording attention function;
    afterwards its hooks, attention implementation and the training flag of every
    submodule are as before (also after an error, and with several threads recording or
    running the model at once).

    Args:
        model: a supported ``transformers`` model.
        adapter: its :class:`ArchitectureSpec`.
        on_layer: callback receiving each layer's :class:`LayerTensors` in the compute dtype.
        dtype: the compute dtype.
        keep_calls: allow :meth:`Recorder.rerun_layer`.
        probabilities: False: the attention modules run the model's own attention function
            (sdpa, ...; the eager recording attention where the model was configured eager) and
            the handed-over layers have ``probs=None``; :meth:`Recorder.rerun_layer` still
            records them. For passes that keep only checkpoints (the DecompX adjoint).

    Yields:
        The :class:`Recorder`.

    Examples::

        >>> maps = []
        >>> with recording(model, get_adapter(model), lambda layer: maps.append(layer.probs.mean(1))) as rec:
        ...     model(input_ids=ids, attention_mask=mask)
    """
    recorder = Recorder(model, adapter, dtype, on_layer, keep_calls)
    recorder.record_probabilities = probabilities
    with recorder_session(model, recorder, recorder._hooks):
        try:
            yield recorder
        finally:
            recorder.records.clear()
            recorder.calls.clear()
            recorder.versions.clear()
            recorder.checks.clear()


@contextlib.contextmanager
def recorder_session(model: nn.Module, recorder: Any, install_hooks: Callable[[], list]) -> Iterator[Any]:
    r"""Make ``recorder`` the recording of this thread for the block, with its hooks installed.

    The one place that switches a model's attention to the recording function and back: on
    exit (also after an error) the hooks are removed, the recorder leaves this thread's
    stack and the model's attention implementation and per-module flags are restored.

    Args:
        model: the recorded model.
        recorder: an object with ``record_attention(module, probs, values, context=None)``
            and ``watches(module)`` (:class:`Recorder`, or the encoder-decoder recorder).
        install_hooks: registers the recorder's hooks and returns their handles.

    Yields:
        ``recorder``.
    """
    _register()
    stack = _active()
    if any(getattr(r, "model", None) is model for r in stack):
        raise RuntimeError(
            "an attribution of this model was started while one of its own recorded forward passes is running (from a "
            "forward hook or a module of the model?): nested attributions of one model are not supported; run the "
            "second attribution after the first call returns (e.g. collect the inputs in the hook, attribute them after)"
        )
    configs = _configs(model)
    handles: list = []
    _switch_on(model, configs)
    try:
        handles = install_hooks()
        if getattr(recorder, "buffers", None) is None:
            recorder.buffers = ProbabilityBuffers()
        stack.append(recorder)
        yield recorder
    finally:
        if recorder in stack:
            stack.remove(recorder)
        if getattr(recorder, "buffers", None) is not None:
            recorder.buffers.clear()  # the kept buffers go with the recording
        for h in handles:
            h.remove()
        _switch_off(model, configs)
