r"""The package's own attention function, its thread state and the switching of a model to it.

For the duration of one call the model's attention implementation is switched to a
function registered in transformers' ``AttentionInterface`` (:data:`ATTENTION_NAME`). It
computes the usual eager attention (head by head in chunks, so that no more than one
(B, H, T, T) probability tensor and one chunk of scores exist at a time) and records the
probabilities and value states of the modules the calling thread is recording
(:func:`active_recorders`; the recorders are
:class:`~captum_normattr.models.capture.recorder.AttentionRecords`).

Recording is scoped to the calling thread: the attention function records only for
recorders that the current thread opened, and a forward pass that no recorder of its thread
watches (another thread's plain forward pass, say) runs the attention implementation the
model had before. The switch of the implementation is reference-counted per config and the
training flags per module (two models sharing a submodule, attributed at once, give it back
its own flag when the last of them ends), under :data:`LOCK` (:func:`switch_on`,
:func:`switch_off`; the sessions that call them are in
:mod:`captum_normattr.models.capture.session`). No modeling file is copied or edited
(``docs/design.md``, "Streaming engine" and "The house").
"""
from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.decompose.primitives.attention import softmax_with_sinks

__all__ = [
    "ATTENTION_NAME",
    "CAUSAL_ROW_BLOCKS",
    "EXAMPLE_BLOCK_BYTES",
    "LOCK",
    "ModelAttentionWarning",
    "OWN_ATTENTION_IMPLEMENTATIONS",
    "ProbabilityBuffers",
    "SCORE_CHUNK_BYTES",
    "active_recorders",
    "model_configs",
    "register_attention",
    "switch_off",
    "switch_on",
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
#: guards the switched configs, the training flags, the open sessions and the recorders' hook installation
LOCK = threading.RLock()
_SWITCHED: Dict[int, list] = {}  # id(config) -> [config, original implementation, users]
_FLAGS: Dict[int, list] = {}  # id(module) -> [module, its own training flag, users]
_SESSIONS: Dict[int, List[List[nn.Module]]] = {}  # id(model) -> the module lists of its open sessions
_REGISTERED = False


def active_recorders() -> List[Any]:
    r"""The recorders opened by the calling thread, innermost last (the list itself: sessions push and pop)."""
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


def _sink_attention(query, key, value, attention_mask, scaling, dropout, training, sinks: Tensor, keep_probs: bool):
    r"""Eager attention with learned sinks (GPT-OSS; :func:`softmax_with_sinks`), in one piece; as :func:`_eager_attention`."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)).mul_(query.shape[-1] ** -0.5 if scaling is None else scaling)
    _add_bias_and_mask(scores, None, attention_mask, slice(None), slice(None), slice(0, key.shape[-2]))
    soft_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    probs = softmax_with_sinks(scores, sinks, soft_dtype)
    used = probs.to(query.dtype)
    if training and dropout > 0:
        used = nn.functional.dropout(used, p=dropout, training=True)
    out = torch.matmul(used, value).transpose(1, 2).contiguous()
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
    watching = [r for r in active_recorders() if r.watches(module)]
    needs_probs = any(r.record_probabilities for r in watching)
    if watching and not all(getattr(r, "warned_model_attention", False) for r in watching):
        _warn_if_own_eager_fails(module, query, key, value, attention_mask, scaling, watching, kwargs)
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
    if kwargs.get("s_aux") is not None:  # learned sinks (GPT-OSS): a description that does not say so is refused
        undescribed = [r for r in watching if getattr(getattr(r, "adapter", None), "layer", None) is None
                       or r.adapter.layer.attention.sinks is None]
        if undescribed:
            raise NotImplementedError(
                f"{type(module).__name__} passes learned attention sinks (s_aux) but the description does not name "
                "them (Attention.sinks): its probabilities would be taken as summing to 1")
        out, probs, values = _sink_attention(query, key, value, attention_mask, scaling, dropout, module.training,
                                             kwargs["s_aux"], keep_probs=needs_probs)
        for recorder in watching:
            recorder.record_attention(module, probs, values, out if not (module.training and dropout > 0) else None)
        return out, probs
    out, probs, values = _eager_attention(
        query, key, value, attention_mask, scaling, dropout, module.training, keep_probs=needs_probs,
        position_bias=kwargs.get("position_bias"), causal=bool(getattr(module, "is_causal", False)),
        softcap=kwargs.get("softcap"), buffers=getattr(watching[0], "buffers", None) if watching else None,
    )
    for recorder in watching:
        recorder.record_attention(module, probs, values, out if not (module.training and dropout > 0) else None)
    return out, probs


class ModelAttentionWarning(RuntimeWarning):
    r"""The model's own attention implementation gives another (non-finite) value than the package computes."""


#: (weak reference to the last mask judged, its fully masked rows (B, 1 or H, T) or None): see _PLAIN_CAUSAL
_MASKED_ROWS: List[Tuple[Any, Optional[Tensor]]] = [(lambda: None, None)]


def _fully_masked_rows(mask: Optional[Tensor]) -> Optional[Tensor]:
    r"""(B, 1 or H, T) bool: the query rows of an attention mask (B, 1 or H, T, S) that mask every key, or None."""
    if mask is None or mask.dim() != 4:
        return None
    last, answer = _MASKED_ROWS[0]
    if last() is mask:
        return answer
    kept = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    rows = ~kept.any(-1)
    answer = rows if bool(rows.any()) else None
    _MASKED_ROWS[0] = (weakref.ref(mask), answer)
    return answer


def _warn_if_own_eager_fails(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Optional[Tensor], scaling: Optional[float], watching: List[Any],
                             kwargs: Dict[str, Any]) -> None:
    r"""Warn (once per recorder) where the model, configured with its eager attention, would give NaN itself.

    A fully masked query row (a left pad of a causal LM, a pad outside every real token's
    sliding window, as in ModernBERT) is finite in the recording attention (as in sdpa), but a
    model whose own eager code takes the softmax in float32 turns the float64 mask minimum
    into -inf there and gives NaN, which spreads to the real tokens of that example (their
    zero weight on the pads' values times NaN). The model's own eager function is run on
    those rows only; the examples where it is not finite are named.
    """
    entry = _SWITCHED.get(id(getattr(module, "config", None)))
    if entry is None or entry[1] not in (None, "eager"):
        return
    rows = _fully_masked_rows(attention_mask)
    if rows is None:
        return
    own = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if own is None:
        return
    bad = []
    for b in rows.any(1).any(-1).nonzero().flatten().tolist():
        q_rows = rows[b].any(0).nonzero().flatten()
        mask_b = attention_mask[b:b + 1, :, q_rows]
        try:
            out, _ = own(module, query[b:b + 1, :, q_rows], key[b:b + 1], value[b:b + 1], mask_b, scaling=scaling,
                         dropout=0.0, **{k: v for k, v in kwargs.items() if k in ("softcap", "sliding_window")})
        except Exception:  # the model's own code did not take the slice: nothing to say
            return
        if not bool(torch.isfinite(out).all()):
            bad.append(b)
    if not bad:
        return
    for recorder in watching:
        recorder.warned_model_attention = True
    warnings.warn(
        f"the model's own attention implementation ('eager', {type(module).__name__}) gives NaN for example(s) {bad} "
        f"of this {query.dtype} batch: a query row whose every key is masked (a pad), where its softmax, taken in "
        "float32, turns the mask's minimum into -inf; the NaN reaches the real tokens of the example. The package "
        "computes that row finite, as sdpa does, so its logits and scores are those of the finite computation, not the "
        "NaN that model(...) returns. Load the model with attn_implementation='sdpa' (or run it in float32) to have "
        "the model agree (docs/reliability.md, 'Checked reruns').",
        ModelAttentionWarning, stacklevel=2,
    )


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


#: The model attention implementations that the recording hands its own masks to (where nobody needs the
#: probabilities): they read the full eager mask the recording builds, and no mask as causal (sdpa's
#: ``is_causal``). Any other (flex_attention, flash, paged, hub kernels) expects the mask of its own mask
#: function: flex read no mask as no masking (future tokens attended) and crashed on CPU with a padded one;
#: such models run the eager recording attention (docs/reliability.md, "Checked reruns").
OWN_ATTENTION_IMPLEMENTATIONS = ("sdpa",)


def _original_attention(module: nn.Module) -> Optional[Callable]:
    r"""The attention function the model was configured with before the recording, if the recording may run it
    (:data:`OWN_ATTENTION_IMPLEMENTATIONS`, sdpa), or None (eager, flex, flash, ..., or not known to
    transformers: the eager recording attention runs): the one a module runs where nobody needs its probabilities."""
    entry = _SWITCHED.get(id(getattr(module, "config", None)))
    original = entry[1] if entry is not None else None
    if original not in OWN_ATTENTION_IMPLEMENTATIONS:
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get(original) if hasattr(ALL_ATTENTION_FUNCTIONS, "get") else None


def register_attention() -> None:
    r"""Register the recording attention and its (eager) mask function with transformers, once."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, _recording_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
    _REGISTERED = True


def model_configs(model: nn.Module) -> list:
    r"""The distinct transformers configs of ``model``'s modules (each is switched once)."""
    from transformers import PretrainedConfig

    seen = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            seen[id(cfg)] = cfg
    return list(seen.values())


def switch_on(model: nn.Module, configs: List[Any]) -> None:
    r"""Switch the attention of ``configs`` to the recording function and ``model`` to eval mode.

    Reference-counted under the lock: the implementation per config, the training flag per
    module (a submodule shared by two models keeps its own flag until the last call that
    holds it through either model ends). Undone by :func:`switch_off`.

    Args:
        model: the model whose modules go to eval mode.
        configs: the transformers configs to switch (:func:`model_configs`; empty: eval mode only).

    Examples::

        >>> switch_on(model, model_configs(model))
        >>> try:
        ...     model(**batch)
        ... finally:
        ...     switch_off(model, model_configs(model))
    """
    with LOCK:
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


def switch_off(model: nn.Module, configs: List[Any]) -> None:
    r"""Undo one :func:`switch_on` of ``model``: the last holder of a config or module restores it.

    Args:
        model: the model given to :func:`switch_on`.
        configs: the same configs.
    """
    with LOCK:
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

