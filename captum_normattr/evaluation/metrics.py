r"""Pure faithfulness metrics for token attributions of sequence classifiers.

Every function here takes plain tensors and callables — no hooks, no model internals:

- ``forward(input_ids (B,T), attention_mask (B,T)) -> logits (B,C)``;
- token scores ``(B, T)`` (higher = more important; pads are ignored);
- ``special_mask (B, T)`` bool, True at special tokens ([CLS], [SEP], ...) *and* pads.

Conventions (docs/design.md, section 15, faithfulness):

- :func:`spearman_per_example` — rank correlation over all valid positions, special
  tokens included (GlobEnc protocol);
- :func:`eraser_aopc` — ERASER comprehensiveness / sufficiency (ALTI paper protocol):
  delete the top k% non-special tokens, or keep only them, special tokens always kept,
  predicted-class probability, averaged over k in {0, 1, 5, 10, 20, 50};
- :func:`mask_aopc` — DecompX: replace the top K% non-special tokens by [MASK],
  K = 10..90, AOPC of the predicted class and accuracy against the gold label;
- :func:`token_presence_infidelity` and :func:`token_substitution_sensitivity` — Captum's
  ``infidelity`` and ``sensitivity_max`` through a float token-presence gate;
- :func:`broadcast_to_embeddings` and :func:`token_drop_perturbation` — for calling
  ``captum.metrics.infidelity`` directly on (B, T, D) embeddings with the package's (B, T)
  token scores (Captum needs attributions of the inputs' shape).

The number of selected tokens for k% of n non-special tokens is ``ceil(k * n / 100)``
by default (``rounding="floor"`` and ``"round"`` are available); ties in the scores are
broken by position (earlier first), so the selection is deterministic.

It is over 700 lines because every metric preset (deletion, insertion, ABPC-style curves, sufficiency, comprehensiveness) shares its masking and curve helpers here, in one place a reader checks against the papers.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch import Tensor

ForwardFn = Callable[[Tensor, Tensor], Tensor]

__all__ = [
    "ForwardFn",
    "check_token_inputs",
    "spearman_per_example",
    "rank_tokens",
    "num_selected",
    "top_k_mask",
    "delete_tokens",
    "predicted_probability",
    "trim_pad_columns",
    "check_percents",
    "eraser_aopc",
    "mask_aopc",
    "token_presence_infidelity",
    "token_substitution_sensitivity",
    "broadcast_to_embeddings",
    "token_drop_perturbation",
]


# --------------------------------------------------------------------------- checks
def check_token_inputs(
    input_ids: Tensor,
    attention_mask: Tensor,
    scores: Optional[Tensor] = None,
    special_mask: Optional[Tensor] = None,
) -> None:
    r"""Raise a clear error unless ids, mask, scores and special mask fit together.

    Args:
        input_ids: token ids (B, T), an integer dtype.
        attention_mask: (B, T), 1 at real tokens and 0 at pads, right or left padded.
        scores: optional token scores (B, T), a float dtype, finite at valid positions.
        special_mask: optional (B, T) bool.

    Raises:
        TypeError: wrong dtypes. ValueError: wrong shapes or non-finite scores.
    """
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (B, T) tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {getattr(attention_mask, 'shape', type(attention_mask))}"
        )
    if scores is not None:
        if not isinstance(scores, Tensor) or scores.shape != input_ids.shape:
            raise ValueError(
                f"scores must be token scores of shape {tuple(input_ids.shape)}, "
                f"got {getattr(scores, 'shape', type(scores))}; reduce feature dimensions first"
            )
        if not scores.dtype.is_floating_point:
            raise TypeError(f"scores must be a float tensor, got {scores.dtype}")
        if not torch.isfinite(scores[attention_mask.bool()]).all():
            raise ValueError("scores contain NaN or inf at non-pad positions")
    if special_mask is not None:
        if not isinstance(special_mask, Tensor) or special_mask.shape != input_ids.shape:
            raise ValueError(f"special_mask must have shape {tuple(input_ids.shape)}")
        if special_mask.dtype != torch.bool:
            raise TypeError(f"special_mask must be a bool tensor, got {special_mask.dtype}")


def check_percents(percents: Iterable[float], allow_zero: bool) -> Tuple[float, ...]:
    r"""The percents as floats, or a ``ValueError`` for an empty list or a value outside (0, 100] ([0, 100] with ``allow_zero``)."""
    out = tuple(float(k) for k in percents)
    if not out:
        raise ValueError("percents must not be empty")
    for k in out:
        if not (0.0 <= k <= 100.0) or (k == 0.0 and not allow_zero):
            raise ValueError(f"percent values must lie in {'[0' if allow_zero else '(0'}, 100], got {k}")
    return out


# ---------------------------------------------------------------------- correlation
def _average_ranks(x: Tensor) -> Tensor:
    r"""Ranks 1..n of a 1-D tensor, ties get their average rank (as scipy's rankdata)."""
    n = x.numel()
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    ranks_sorted = torch.arange(1, n + 1, dtype=torch.float64, device=x.device)
    # group equal values and give each group its mean rank
    new_group = torch.ones(n, dtype=torch.bool, device=x.device)
    new_group[1:] = sorted_x[1:] != sorted_x[:-1]
    group_id = torch.cumsum(new_group.long(), 0) - 1
    n_groups = int(group_id[-1]) + 1 if n else 0
    sums = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, group_id, ranks_sorted)
    counts = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(
        0, group_id, torch.ones(n, dtype=torch.float64, device=x.device)
    )
    ranks = torch.empty(n, dtype=torch.float64, device=x.device)
    ranks[order] = (sums / counts)[group_id]
    return ranks


def spearman_per_example(scores: Tensor, reference: Tensor, attention_mask: Tensor) -> Tensor:
    r"""Spearman rank correlation between two token scorings, one value per example.

    Computed over all positions where ``attention_mask`` is 1 (special tokens included,
    pads excluded), ties given average ranks. An example where either scoring is
    constant has no defined correlation and gets NaN.

    Args:
        scores: (B, T) token scores of the method.
        reference: (B, T) token scores to compare with (e.g. gradient x input).
        attention_mask: (B, T), 1 at real tokens.

    Returns:
        (B,) float64 correlations in [-1, 1].

    Examples:
        >>> m = torch.ones(1, 4)
        >>> spearman_per_example(torch.tensor([[1., 2, 3, 4]]), torch.tensor([[10., 20, 30, 40]]), m)
        tensor([1.], dtype=torch.float64)
    """
    if scores.shape != reference.shape or scores.shape != attention_mask.shape or scores.dim() != 2:
        raise ValueError(
            f"scores {tuple(scores.shape)}, reference {tuple(reference.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must all be (B, T)"
        )
    valid = attention_mask.bool()
    out = torch.full((scores.shape[0],), float("nan"), dtype=torch.float64)
    for b in range(scores.shape[0]):
        x = scores[b][valid[b]].detach().double()
        y = reference[b][valid[b]].detach().double()
        if x.numel() < 2:
            continue
        rx, ry = _average_ranks(x), _average_ranks(y)
        rx, ry = rx - rx.mean(), ry - ry.mean()
        den = torch.sqrt((rx * rx).sum() * (ry * ry).sum())
        if den > 0:
            out[b] = ((rx * ry).sum() / den).clamp(-1.0, 1.0).cpu()
    return out


# ------------------------------------------------------------------------ selection
def rank_tokens(scores: Tensor, special_mask: Tensor) -> Tuple[Tensor, Tensor]:
    r"""Order the non-special tokens of each example by decreasing score.

    Args:
        scores: (B, T) token scores.
        special_mask: (B, T) bool, True at special tokens and pads (never ranked).

    Returns:
        ``(order, n)``: ``order`` (B, T) long, positions sorted by decreasing score with
        the non-special ones first (ties: earlier position first); ``n`` (B,) the number
        of non-special tokens.

    Examples:
        >>> order, n = rank_tokens(torch.tensor([[9., 1., 3., 0.]]), torch.tensor([[True, False, False, True]]))
        >>> order[0, :2].tolist(), n.tolist()
        ([2, 1], [2])
    """
    key = scores.detach().double().masked_fill(special_mask, float("-inf"))
    order = torch.argsort(key, dim=1, descending=True, stable=True)
    return order, (~special_mask).sum(1)


def num_selected(n: Tensor, percent: float, rounding: str = "ceil") -> Tensor:
    r"""How many tokens ``percent`` % of ``n`` tokens is.

    Args:
        n: (B,) token counts.
        percent: in [0, 100].
        rounding: ``"ceil"`` (default: 1% of 20 tokens is 1 token), ``"floor"`` or ``"round"``.

    Returns:
        (B,) long, between 0 and n.

    Examples:
        >>> num_selected(torch.tensor([20, 3]), 10).tolist()
        [2, 1]
    """
    frac = n.double() * float(percent) / 100.0
    if rounding == "ceil":
        k = torch.ceil(frac - 1e-9)
    elif rounding == "floor":
        k = torch.floor(frac + 1e-9)
    elif rounding == "round":
        k = torch.floor(frac + 0.5)
    else:
        raise ValueError(f"rounding must be 'ceil', 'floor' or 'round', got {rounding!r}")
    return torch.minimum(k.long().clamp(min=0), n.long())


def top_k_mask(order: Tensor, k: Tensor) -> Tensor:
    r"""(B, T) bool mask of the first ``k[b]`` positions of ``order[b]``."""
    B, T = order.shape
    rank_pos = torch.arange(T, device=order.device).expand(B, T) < k.to(order.device)[:, None]
    mask = torch.zeros(B, T, dtype=torch.bool, device=order.device)
    mask.scatter_(1, order, rank_pos)
    return mask


def delete_tokens(
    input_ids: Tensor, attention_mask: Tensor, keep: Tensor, pad_token_id: int = 0
) -> Tuple[Tensor, Tensor]:
    r"""Remove tokens from each sequence (shortening it) and re-pad the batch on the right.

    Args:
        input_ids: (B, T).
        attention_mask: (B, T).
        keep: (B, T) bool, True where a (valid) token stays; pads are dropped anyway.
        pad_token_id: id written at the new padded positions.

    Returns:
        ``(ids, mask)`` of shape (B, T') with T' the longest kept sequence (at least 1).

    Examples:
        >>> ids = torch.tensor([[101, 5, 6, 102]])
        >>> delete_tokens(ids, torch.ones_like(ids), torch.tensor([[True, False, True, True]]))[0]
        tensor([[101,   6, 102]])
    """
    keep = keep & attention_mask.bool()
    lengths = keep.sum(1)
    T_new = max(int(lengths.max()) if lengths.numel() else 0, 1)
    # stable sort puts kept positions first, in their original order
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :T_new]
    ids = torch.gather(input_ids, 1, order)
    new_mask = torch.arange(T_new, device=input_ids.device)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~new_mask, pad_token_id)
    return ids, new_mask.to(attention_mask.dtype)


def _forward_unique(forward: ForwardFn, ids: Tensor, mask: Tensor, max_batch: Optional[int]) -> Tensor:
    r"""``forward`` on the distinct rows only (perturbations often coincide on short inputs).

    Rows are deduplicated, sorted by length, run in chunks of ``max_batch`` (all at once
    if None) with all-pad columns trimmed, and the logits scattered back: (N, C).
    """
    ids = ids.masked_fill(~mask.bool(), 0)
    key = torch.cat([ids, mask.to(ids.dtype)], 1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    u_ids, u_mask = uniq[:, : ids.shape[1]], uniq[:, ids.shape[1] :].to(mask.dtype)
    order = torch.argsort(u_mask.sum(1), descending=True, stable=True)
    step = len(order) if max_batch is None else max_batch
    chunks = []
    for i in range(0, len(order), step):
        rows = order[i : i + step]
        ci, cm = trim_pad_columns(u_ids[rows], u_mask[rows])
        chunks.append(forward(ci, cm))
    logits = torch.cat(chunks)
    back = torch.empty_like(logits)
    back[order] = logits
    return back[inverse]


def trim_pad_columns(ids: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
    r"""Drop all-pad columns at the right end (after masking, lengths do not change).

    Examples:
        >>> ids, mask = trim_pad_columns(torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]]))
        >>> ids.tolist()
        [[5, 6]]
    """
    cols = mask.bool().any(0)
    if not cols.any():
        return ids[:, :1], mask[:, :1]
    last = int(torch.nonzero(cols)[-1]) + 1
    return ids[:, :last], mask[:, :last]


_trim = trim_pad_columns  # the former name (tests/test_evaluation.py uses it)


def predicted_probability(logits: Tensor, target: Tensor) -> Tensor:
    r"""Softmax probability of class ``target[b]`` for every row: (B,)."""
    return torch.softmax(logits.double(), dim=-1).gather(1, target.view(-1, 1).to(logits.device)).squeeze(1)


# --------------------------------------------------------------------------- ERASER
@torch.no_grad()
def eraser_aopc(
    forward: ForwardFn,
    input_ids: Tensor,
    attention_mask: Tensor,
    scores: Tensor,
    special_mask: Tensor,
    *,
    percents: Sequence[float] = (0, 1, 5, 10, 20, 50),
    rounding: str = "ceil",
    pad_token_id: int = 0,
    target: Optional[Tensor] = None,
    max_batch: Optional[int] = None,
) -> Dict[str, Tensor]:
    r"""ERASER comprehensiveness and sufficiency (AOPC over k%), per example.

    For each k in ``percents``, the top ``k``% non-special tokens by score (the
    rationale r_k) are deleted from the sequence (comprehensiveness,
    ``p(y|x) - p(y|x \ r_k)``) or are the only non-special tokens kept (sufficiency,
    ``p(y|x) - p(y|r_k)``); special tokens are always kept and y is the predicted class
    on the full input. Each AOPC is the mean over ``percents``; the default includes
    k = 0 (ERASER's 1/(|B|+1) sum), so comprehensiveness gets a 0 term and sufficiency
    the "special tokens only" term. Comprehensiveness: higher is better; sufficiency:
    lower is better.

    Args:
        forward: ``(input_ids, attention_mask) -> logits (B, C)``.
        input_ids: (B, T) token ids.
        attention_mask: (B, T).
        scores: (B, T) token scores.
        special_mask: (B, T) bool, True at special tokens and pads.
        percents: the k values in %, each in [0, 100].
        rounding: how k% of n tokens is rounded, see :func:`num_selected`.
        pad_token_id: used when re-padding shortened sequences.
        target: (B,) class to score; default the predicted class.
        max_batch: largest batch given to ``forward`` at once (None = all perturbations
            of the batch in one call).

    Returns:
        dict with ``comprehensiveness`` (B,), ``sufficiency`` (B,),
        ``comprehensiveness_per_k`` and ``sufficiency_per_k`` (B, K), ``full_probability``
        (B,), ``target`` (B,), ``percents`` (K,).

    Examples:
        >>> fwd = lambda ids, m: torch.stack([torch.zeros(len(ids)), 4.0 * (ids == 7).any(1).float()], 1)
        >>> ids = torch.tensor([[101, 7, 5, 102]]); m = torch.ones_like(ids)
        >>> sp = torch.tensor([[True, False, False, True]])
        >>> r = eraser_aopc(fwd, ids, m, torch.tensor([[0., 1., 0., 0.]]), sp, percents=[50])
        >>> round(float(r["comprehensiveness"]), 4)  # sigmoid(4) - 0.5
        0.482
    """
    check_token_inputs(input_ids, attention_mask, scores, special_mask)
    ks = check_percents(percents, allow_zero=True)
    special_mask = special_mask | ~attention_mask.bool()
    full = forward(input_ids, attention_mask)
    if target is None:
        target = full.argmax(-1)
    target = target.view(-1).to(full.device)
    p_full = predicted_probability(full, target)
    order, n = rank_tokens(scores, special_mask)
    specials_kept = special_mask & attention_mask.bool()

    comp_ids, suff_ids = [], []
    for k in ks:
        top = top_k_mask(order, num_selected(n, k, rounding))
        comp_ids.append(delete_tokens(input_ids, attention_mask, attention_mask.bool() & ~top, pad_token_id))
        suff_ids.append(delete_tokens(input_ids, attention_mask, specials_kept | top, pad_token_id))
    B = input_ids.shape[0]

    pairs = comp_ids + suff_ids
    T = max(p[0].shape[1] for p in pairs)
    ids = torch.cat([torch.nn.functional.pad(p[0], (0, T - p[0].shape[1]), value=pad_token_id) for p in pairs])
    msk = torch.cat([torch.nn.functional.pad(p[1], (0, T - p[1].shape[1]), value=0) for p in pairs])
    logits = _forward_unique(forward, ids, msk, max_batch)
    probs = predicted_probability(logits, target.repeat(len(pairs))).view(len(pairs), B).T  # (B, 2K)
    comp = p_full[:, None] - probs[:, : len(ks)]
    suff = p_full[:, None] - probs[:, len(ks) :]
    return {
        "comprehensiveness": comp.mean(1),
        "sufficiency": suff.mean(1),
        "comprehensiveness_per_k": comp,
        "sufficiency_per_k": suff,
        "full_probability": p_full,
        "target": target,
        "percents": torch.tensor(ks, dtype=torch.float64),
    }


# -------------------------------------------------------------------------- DecompX
@torch.no_grad()
def mask_aopc(
    forward: ForwardFn,
    input_ids: Tensor,
    attention_mask: Tensor,
    scores: Tensor,
    special_mask: Tensor,
    labels: Optional[Tensor],
    *,
    mask_token_id: int,
    percents: Sequence[float] = (10, 20, 30, 40, 50, 60, 70, 80, 90),
    rounding: str = "ceil",
    target: Optional[Tensor] = None,
    max_batch: Optional[int] = None,
) -> Dict[str, Tensor]:
    r"""DecompX-style [MASK] AOPC and accuracy over K%, per example.

    For each K, the top K% non-special tokens by score are replaced by ``mask_token_id``
    (sequence length unchanged). AOPC is the mean over K of
    ``p(y|x) - p(y|x_masked)`` for the predicted class y (higher is better); accuracy
    is the mean over K of ``argmax f(x_masked) == label`` (lower is better).

    Args:
        forward: ``(input_ids, attention_mask) -> logits (B, C)``.
        input_ids: (B, T).
        attention_mask: (B, T).
        scores: (B, T) token scores.
        special_mask: (B, T) bool, True at special tokens and pads.
        labels: (B,) gold labels, or None to skip the accuracy.
        mask_token_id: the [MASK] id.
        percents: the K values, in (0, 100].
        rounding: see :func:`num_selected`.
        target: (B,) class for the AOPC; default the predicted class.
        max_batch: largest batch given to ``forward`` at once.

    Returns:
        dict with ``aopc`` (B,), ``accuracy`` (B,) (absent without labels),
        ``aopc_per_k`` / ``accuracy_per_k`` (B, K), ``target``, ``percents``.

    Examples:
        >>> fwd = lambda ids, m: torch.stack([torch.zeros(len(ids)), 4.0 * (ids == 7).any(1).float()], 1)
        >>> ids = torch.tensor([[101, 7, 5, 102]]); m = torch.ones_like(ids)
        >>> sp = torch.tensor([[True, False, False, True]])
        >>> r = mask_aopc(fwd, ids, m, torch.tensor([[0., 1., 0., 0.]]), sp, torch.tensor([1]), mask_token_id=103)
        >>> float(r["accuracy"])
        0.0
    """
    check_token_inputs(input_ids, attention_mask, scores, special_mask)
    ks = check_percents(percents, allow_zero=False)
    special_mask = special_mask | ~attention_mask.bool()
    full = forward(input_ids, attention_mask)
    if target is None:
        target = full.argmax(-1)
    target = target.view(-1).to(full.device)
    p_full = predicted_probability(full, target)
    order, n = rank_tokens(scores, special_mask)
    masked = []
    for k in ks:
        top = top_k_mask(order, num_selected(n, k, rounding))
        masked.append(input_ids.masked_fill(top, mask_token_id))
    B = input_ids.shape[0]
    logits = _forward_unique(forward, torch.cat(masked), attention_mask.repeat(len(ks), 1), max_batch)
    probs = predicted_probability(logits, target.repeat(len(ks))).view(len(ks), B).T
    aopc = p_full[:, None] - probs
    out = {
        "aopc": aopc.mean(1),
        "aopc_per_k": aopc,
        "target": target,
        "percents": torch.tensor(ks, dtype=torch.float64),
    }
    if labels is not None:
        labels = labels.view(-1).to(logits.device)
        acc = (logits.argmax(-1).view(len(ks), B).T == labels[:, None]).double()
        out["accuracy"] = acc.mean(1)
        out["accuracy_per_k"] = acc
    return out


# --------------------------------------------------------- Captum through a token gate
def _gate_forward(
    forward_embeds: Callable[[Tensor, Tensor], Tensor],
    embed: Callable[[Tensor], Tensor],
    replacement_id: int,
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    def fwd(gate: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        e = embed(input_ids)
        r = embed(torch.full_like(input_ids[:, :1], replacement_id))
        g = gate.to(e.dtype)[..., None]
        return forward_embeds(g * e + (1.0 - g) * r, attention_mask)

    return fwd


def token_presence_infidelity(
    forward_embeds: Callable[[Tensor, Tensor], Tensor],
    embed: Callable[[Tensor], Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    scores: Tensor,
    special_mask: Tensor,
    target: Tensor,
    *,
    replacement_id: int,
    n_perturb_samples: int = 10,
    drop_prob: float = 0.25,
    normalize: bool = True,
    seed: int = 0,
    max_examples_per_batch: Optional[int] = None,
) -> Tensor:
    r"""Captum ``infidelity`` of token scores, through a float token-presence input.

    The model is fed ``g * E(x) + (1 - g) * E(replacement)`` with ``E`` the word
    embeddings and ``g`` (B, T) a gate in [0, 1]: at ``g = 1`` the real input, at
    ``g = 0`` the token replaced (by [MASK] by default). The explained input is ``g = 1``
    and the token scores are the attributions of ``g``. A perturbation drops every
    non-special token independently with probability ``drop_prob`` (``g -> 0``), so
    ``I = 1`` at dropped tokens and infidelity is
    ``E[(sum_t I_t s_t - (f(x) - f(x with drops)))^2]`` on the class logit ``target``.
    With ``normalize=True`` (default) the scores are rescaled by the least-squares
    factor first, which makes the value invariant to the scale of the scores
    (necessary to compare norm-based with gradient-based scores). Lower is better.

    Args:
        forward_embeds: ``(word_embeddings (B,T,D), attention_mask) -> logits (B, C)``.
        embed: ``input_ids -> word_embeddings (B, T, D)``.
        input_ids: (B, T).
        attention_mask: (B, T).
        scores: (B, T) token scores.
        special_mask: (B, T) bool, never dropped (special tokens and pads).
        target: (B,) class whose logit is explained.
        replacement_id: token id whose embedding stands for an absent token.
        n_perturb_samples: perturbations per example.
        drop_prob: probability of dropping each non-special token.
        normalize: Captum's ``normalize``.
        seed: seed of the perturbations (a local generator; global RNG untouched).
        max_examples_per_batch: Captum's batching of the perturbed forwards.

    Returns:
        (B,) infidelity values.
    """
    check_token_inputs(input_ids, attention_mask, scores, special_mask)
    if not 0.0 < drop_prob <= 1.0:
        raise ValueError(f"drop_prob must lie in (0, 1], got {drop_prob}")
    from captum.metrics import infidelity

    B = input_ids.shape[0]
    perturbable = ~(special_mask | ~attention_mask.bool())
    gen = torch.Generator().manual_seed(seed)
    dtype = scores.dtype

    def perturb(gate: Tensor) -> Tuple[Tensor, Tensor]:
        rep = gate.shape[0] // B
        pm = perturbable.repeat_interleave(rep, 0)
        drop = (torch.rand(gate.shape, generator=gen, dtype=torch.float64) < drop_prob).to(gate.device) & pm
        perturbed = gate.masked_fill(drop, 0.0)
        return gate - perturbed, perturbed

    gate = torch.ones(input_ids.shape, dtype=dtype, device=input_ids.device)
    fwd = _gate_forward(forward_embeds, embed, replacement_id)
    return infidelity(
        fwd,
        perturb,
        gate,
        scores.detach(),
        additional_forward_args=(input_ids, attention_mask),
        target=target,
        n_perturb_samples=n_perturb_samples,
        max_examples_per_batch=max_examples_per_batch,
        normalize=normalize,
    )


def token_substitution_sensitivity(
    explain: Callable[[Tensor, Tensor, Tensor], Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    special_mask: Tensor,
    target: Tensor,
    *,
    replacement_id: int,
    n_perturb_samples: int = 5,
    n_substitutions: int = 1,
    seed: int = 0,
    max_examples_per_batch: Optional[int] = None,
) -> Tensor:
    r"""Captum ``sensitivity_max`` of a token attribution method under token substitution.

    Captum's default perturbation adds float noise, which means nothing for token ids.
    Here the explained input is the token-presence gate ``g = 1`` (B, T) and a
    perturbation sets ``g = 0`` at ``n_substitutions`` random non-special tokens, i.e.
    replaces them by ``replacement_id`` ([MASK] by default); the method is then run on
    the substituted ids. The value is Captum's
    ``max over perturbations of ||s(x') - s(x)|| / ||s(x)||`` (Frobenius norm over the
    tokens), relative and so independent of the scale of the scores. Lower is better.

    Args:
        explain: the method, ``(input_ids, attention_mask, target) -> (B, T) scores``.
        input_ids: (B, T).
        attention_mask: (B, T).
        special_mask: (B, T) bool, never substituted.
        target: (B,) passed to ``explain``.
        replacement_id: the substitute token id.
        n_perturb_samples: perturbations per example (each needs one method call).
        n_substitutions: tokens substituted per perturbation (fewer if the sentence is shorter).
        seed: seed of the perturbations (local generator).
        max_examples_per_batch: Captum's batching of the perturbed explanation calls.

    Returns:
        (B,) sensitivity values.
    """
    check_token_inputs(input_ids, attention_mask, None, special_mask)
    if n_substitutions < 1:
        raise ValueError(f"n_substitutions must be >= 1, got {n_substitutions}")
    from captum.metrics import sensitivity_max

    B = input_ids.shape[0]
    perturbable = ~(special_mask | ~attention_mask.bool())
    gen = torch.Generator().manual_seed(seed)

    def perturb(gate):
        g = gate[0] if isinstance(gate, tuple) else gate
        rep = g.shape[0] // B
        pm = perturbable.repeat_interleave(rep, 0)
        key = torch.rand(g.shape, generator=gen, dtype=torch.float64).to(g.device).masked_fill(~pm, -1.0)
        order = torch.argsort(key, dim=1, descending=True)
        k = torch.clamp(pm.sum(1), max=n_substitutions)
        chosen = top_k_mask(order, k)
        out = g.masked_fill(chosen, 0.0)
        return (out,) if isinstance(gate, tuple) else out

    def explanation(inputs, additional_forward_args, target):
        g = inputs[0] if isinstance(inputs, tuple) else inputs
        ids, mask = additional_forward_args
        ids = torch.where(g > 0.5, ids, torch.full_like(ids, replacement_id))
        s = explain(ids, mask, target)
        if s.shape != ids.shape:
            raise ValueError(f"the method returned scores of shape {tuple(s.shape)}, expected {tuple(ids.shape)}")
        s = s.detach().double().masked_fill(~mask.bool(), 0.0)
        return (s,) if isinstance(inputs, tuple) else s

    gate = torch.ones(input_ids.shape, dtype=torch.float64, device=input_ids.device)
    return sensitivity_max(
        explanation,
        gate,
        perturb_func=perturb,
        n_perturb_samples=n_perturb_samples,
        max_examples_per_batch=max_examples_per_batch,
        additional_forward_args=(input_ids, attention_mask),
        target=target,
    )


# --------------------------------------------------- Captum on embeddings, called directly
def broadcast_to_embeddings(
    scores: Tensor,
    embeddings: Tensor,
    baseline: Optional[Tensor] = None,
    *,
    mode: str = "direction",
) -> Tensor:
    r"""(B, T) token scores as (B, T, D) attributions of the embeddings, for Captum's metrics.

    Captum's ``infidelity`` (and every metric that multiplies attributions with input
    perturbations) needs attributions of the inputs' shape, and the package's methods
    return one score per token. This spreads every token's score over its D embedding
    coordinates without changing what it says about the token:

    - ``mode="direction"`` (default): along the token's displacement from the baseline,
      ``a[b, t] = s[b, t] * (x[b, t] - x0[b, t]) / ||x[b, t] - x0[b, t]||^2`` (0 where the
      two coincide). Then ``sum_d a[b, t, d] * (x[b, t, d] - x0[b, t, d]) = s[b, t]``: a
      perturbation that replaces token t by the baseline (``I = x - x0`` at the dropped
      tokens, :func:`token_drop_perturbation`) is credited with exactly the scores of the
      dropped tokens, and Captum's ``infidelity`` equals
      :func:`token_presence_infidelity` with the same baseline, drops and seed.
    - ``mode="uniform"``: ``a[b, t, d] = s[b, t] / D`` (the sum over d is the token's
      score; meant for perturbations that move every coordinate alike).

    Args:
        scores: (B, T) token scores (pads should be 0).
        embeddings: (B, T, D) the explained input embeddings.
        baseline: (B, T, D), (1, 1, D) or (D,) embeddings that stand for an absent
            token (e.g. the [MASK] embedding); default zeros.
        mode: ``"direction"`` or ``"uniform"``.

    Returns:
        (B, T, D) attributions in the dtype of ``embeddings``.

    Raises:
        ValueError: for shapes that do not fit or an unknown mode.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])
        >>> a = broadcast_to_embeddings(torch.tensor([[2.0, 5.0]]), x)
        >>> (a * x).sum(-1).tolist()
        [[2.0, 5.0]]
    """
    if embeddings.dim() != 3:
        raise ValueError(f"expected (B, T, D) embeddings, got shape {tuple(embeddings.shape)}")
    if tuple(scores.shape) != tuple(embeddings.shape[:2]):
        raise ValueError(f"scores of shape {tuple(scores.shape)} do not fit embeddings of shape "
                         f"{tuple(embeddings.shape)}: expected ({embeddings.shape[0]}, {embeddings.shape[1]})")
    s = scores.detach().to(embeddings.dtype)
    if mode == "uniform":
        return (s / embeddings.shape[-1])[..., None].expand_as(embeddings).clone()
    if mode != "direction":
        raise ValueError(f"mode must be 'direction' or 'uniform', got {mode!r}")
    x0 = torch.zeros_like(embeddings) if baseline is None else baseline.to(embeddings)
    diff = (embeddings - x0.expand_as(embeddings)).detach()
    sq = (diff * diff).sum(-1, keepdim=True)
    safe = torch.where(sq > 0, sq, torch.ones_like(sq))
    return torch.where(sq > 0, s[..., None] * diff / safe, torch.zeros_like(diff))


def token_drop_perturbation(
    perturbable: Tensor,
    baseline: Optional[Tensor] = None,
    *,
    drop_prob: float = 0.25,
    seed: int = 0,
) -> Callable[[Tensor], Tuple[Tensor, Tensor]]:
    r"""A ``perturb_func`` for ``captum.metrics.infidelity`` on (B, T, D) embeddings: drop tokens.

    Every perturbable token is replaced by the baseline independently with probability
    ``drop_prob``; the perturbation is ``I = x - x_perturbed`` (``x - x0`` at the dropped
    tokens, 0 elsewhere). The draws are those of :func:`token_presence_infidelity` with
    the same ``seed``, so both give the same infidelity.

    Args:
        perturbable: (B, T) bool, True where a token may be dropped (no special tokens,
            no pads).
        baseline: the embedding of an absent token, broadcastable to (B, T, D); default zeros.
        drop_prob: probability of dropping each perturbable token.
        seed: seed of a local generator (the global RNG is untouched).

    Returns:
        ``perturb(x) -> (perturbation, perturbed x)`` for Captum.
    """
    if not 0.0 < drop_prob <= 1.0:
        raise ValueError(f"drop_prob must lie in (0, 1], got {drop_prob}")
    gen = torch.Generator().manual_seed(seed)
    B = perturbable.shape[0]

    def perturb(x: Tensor) -> Tuple[Tensor, Tensor]:
        rep = x.shape[0] // B
        pm = perturbable.to(x.device).repeat_interleave(rep, 0)
        drop = (torch.rand(x.shape[:2], generator=gen, dtype=torch.float64) < drop_prob).to(x.device) & pm
        x0 = torch.zeros_like(x) if baseline is None else baseline.to(x).expand_as(x)
        perturbed = torch.where(drop[..., None], x0, x)
        return x - perturbed, perturbed

    return perturb
