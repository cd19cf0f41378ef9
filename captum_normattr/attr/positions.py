r"""n explained positions of one sequence from one forward pass: the request, the answer, the shared helpers.

Every attribution class that explains positions of a causal LM implements one hook,
``explain_positions(input_ids, positions, target=None, quantity="logit", foil=None)``
(:meth:`~captum_normattr.ALTILogitAttribution.explain_positions`,
:meth:`~captum_normattr.DecompXAttribution.explain_positions`, and the rollout methods'
:meth:`~captum_normattr.attr.base.LayerDecompositionAttribution.explain_positions`). Each
validates its request with :func:`position_request` and answers with a
:class:`PositionExplanation`; the LLM API (:mod:`captum_normattr.attr.llm`) only asks the class.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.attr.explained_output import VOCAB_BLOCK, NextTokenLogit
from captum_normattr.models.prepared import PreparedInputs
from captum_normattr.arch.spec import ArchitectureSpec

__all__ = [
    "LOG_PROB_NOT_ADDITIVE",
    "PositionExplanation",
    "PositionRequest",
    "QUANTITIES",
    "check_ids",
    "explained_directions",
    "next_token_output",
    "position_log_probs",
    "position_request",
    "warn_non_finite",
]

#: The explained quantities of the signed methods (ALTI-Logit, DecompX).
QUANTITIES: Tuple[str, ...] = ("logit", "logit_minus_foil", "logit_minus_mean")

LOG_PROB_NOT_ADDITIVE = (
    "log_prob = logit(target) - logsumexp(all logits) is not additive over the residual stream (logsumexp is "
    "not linear), so no decomposition splits it exactly into token scores. Explain quantity='logit' (the default), "
    "'logit_minus_mean' (the target logit minus the mean logit, the linear part of the log-probability's "
    "dependence on the logits) or 'logit_minus_foil'; the log-probabilities are reported alongside "
    "(GenerationExplanation.log_probs, LLMAttributionResult.output_probs)."
)


@dataclass
class PositionExplanation:
    r"""What one multi-position call computed, for one sequence of T tokens.

    Attributes:
        method: the method's readable name.
        scores: (n, T) row k: the score of every token of the sequence for explained
            position ``positions[k]`` (tokens after it exactly 0).
        positions: (n,) long explained positions.
        signed: the scores are signed logit contributions (ALTI-Logit, DecompX); False for
            the rollout rows of ALTI / GlobEnc (class-agnostic, no target).
        target: (n,) long target ids (or None); foil: (n,) long foil ids (or None).
        quantity: one of :data:`QUANTITIES` (signed methods) or ``"rollout"``.
        explained: (n,) the model's real explained quantity (signed methods), else None.
        no_token: (n,) the terms that belong to no token (embedding at i, FF updates,
            biases; DecompX: its bias score), else None.
        delta: (n,) ``explained - (scores.sum(-1) + no_token)``, the completeness error.
        log_probs: (n,) log p(target) at each position, when the model has an LM head.
        extras: per-method tensors, e.g. ALTI-Logit's ``layer_token_contributions`` (n, L, T).
    """

    method: str
    scores: Tensor
    positions: Tensor
    signed: bool
    target: Optional[Tensor] = None
    foil: Optional[Tensor] = None
    quantity: str = "logit"
    explained: Optional[Tensor] = None
    no_token: Optional[Tensor] = None
    delta: Optional[Tensor] = None
    log_probs: Optional[Tensor] = None
    extras: Dict[str, Tensor] = field(default_factory=dict)


class PositionRequest(NamedTuple):
    r"""A validated ``explain_positions`` request, on the model's device.

    Attributes:
        ids: (T,) long token ids; positions: (n,) long; target: (n,) long or None;
        quantity: one of :data:`QUANTITIES` (``"logit_minus_foil"`` whenever a foil is given
        with ``"logit"``); foil: (n,) long or None.
    """

    ids: Tensor
    positions: Tensor
    target: Optional[Tensor]
    quantity: str
    foil: Optional[Tensor]


def check_ids(ids: Any, name: str) -> Tensor:
    r"""``ids`` flattened to a long tensor; a TypeError unless it is an integer tensor.

    Args:
        ids: token ids (any shape).
        name: named in the error.

    Returns:
        (N,) long tensor.
    """
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids")
    return ids.reshape(-1).long()


def position_request(
    model: nn.Module,
    input_ids: Tensor,
    positions: Tensor,
    target: Optional[Tensor] = None,
    quantity: str = "logit",
    foil: Any = None,
) -> PositionRequest:
    r"""Validate the arguments of an ``explain_positions`` hook and move them to the model's device.

    Args:
        model: the attribution's model (its first parameter's device is used).
        input_ids: (T,) or (1, T) token ids (one sequence, no padding).
        positions: (n,) the explained positions, each in [0, T - 1].
        target: (n,) the explained token at each position, or None.
        quantity: one of :data:`QUANTITIES` (``"log_prob"`` raises: it is not additive).
        foil: None, one id or (n,) ids; with ``quantity="logit"`` it makes the quantity
            ``"logit_minus_foil"``.

    Returns:
        :class:`PositionRequest`.
    """
    ids = check_ids(input_ids, "input_ids")
    pos = check_ids(positions, "positions")
    t = ids.shape[0]
    if pos.numel() == 0:
        raise ValueError("give at least one explained position")
    if bool(((pos < 0) | (pos >= t)).any()):
        raise ValueError(f"explained positions must lie in [0, {t - 1}]; got {pos.tolist()}")
    if quantity == "log_prob":
        raise ValueError(LOG_PROB_NOT_ADDITIVE)
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {QUANTITIES}; got {quantity!r}")
    tgt = None if target is None else check_ids(target, "target")
    if tgt is not None and tgt.shape[0] != pos.shape[0]:
        raise ValueError(f"target must have one token per explained position ({pos.shape[0]}); got {tgt.shape[0]}")
    fl = None
    if foil is not None:
        fl = check_ids(torch.as_tensor(foil), "foil")
        fl = fl.expand(pos.shape[0]).clone() if fl.numel() == 1 else fl
        if fl.shape[0] != pos.shape[0]:
            raise ValueError(f"foil must be one id or one per explained position ({pos.shape[0]}); got {fl.shape[0]}")
        if quantity == "logit":
            quantity = "logit_minus_foil"
    device = next(model.parameters()).device
    return PositionRequest(ids.to(device), pos.to(device), None if tgt is None else tgt.to(device), quantity, fl)


def _mean_unembedding(output: NextTokenLogit, dtype: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor]:
    r"""(mean row of W_U (D,), mean LM-head bias ()), cast :data:`VOCAB_BLOCK` rows at a time."""
    weight, bias = output.weight, output.weight_bias
    total = torch.zeros(weight.shape[1], dtype=dtype, device=device)
    for start in range(0, weight.shape[0], VOCAB_BLOCK):
        total += weight[start:start + VOCAB_BLOCK].detach().to(device=device, dtype=dtype).sum(0)
    mean_b = torch.zeros((), dtype=dtype, device=device)
    if bias is not None:
        mean_b = bias.detach().to(device=device, dtype=dtype).mean()
    return total / weight.shape[0], mean_b


def explained_directions(
    output: NextTokenLogit, target: Tensor, quantity: str, foil: Optional[Tensor], dtype: torch.dtype, device
) -> Tuple[Tensor, Tensor]:
    r"""The unembedding direction u (n, D) and bias (n,) of every explained position.

    Args:
        output: the model's :class:`~captum_normattr.attr.explained_output.NextTokenLogit`.
        target: (n,) target ids; foil: (n,) foil ids for ``"logit_minus_foil"``.
        quantity: one of :data:`QUANTITIES`.
        dtype, device: of the result.

    Returns:
        (u, bias): ``"logit"`` W_U[t], b[t]; ``"logit_minus_foil"`` W_U[t] - W_U[f],
        b[t] - b[f]; ``"logit_minus_mean"`` W_U[t] - mean_v W_U[v], b[t] - mean_v b[v].
    """
    n = target.shape[0]
    probe = torch.zeros(n, 1, dtype=dtype, device=device)
    if quantity == "logit_minus_foil":
        if foil is None:
            raise ValueError("quantity='logit_minus_foil' needs foil= (a token id, a string of one token, or n ids)")
        got = output.resolve(target.to(device), probe, foil=foil.to(device))
        return got.direction, got.bias
    got = output.resolve(target.to(device), probe)
    if quantity == "logit_minus_mean":
        mean_u, mean_b = _mean_unembedding(output, dtype, device)
        return got.direction - mean_u, got.bias - mean_b
    return got.direction, got.bias


def position_log_probs(output: Optional[NextTokenLogit], final_out: Tensor, target: Optional[Tensor]) -> Optional[Tensor]:
    r"""(n,) log p(target) from the real final-norm output (n, D) at the explained positions.

    Args:
        output: the model's next-token logit, or None (no LM head: returns None).
        final_out: (n, D) the final norm's real output at the positions.
        target: (n,) ids, or None (returns None).

    Returns:
        (n,) log-probabilities, or None.
    """
    if output is None or target is None:
        return None
    logits = output.logits(final_out)  # (n, V)
    return torch.log_softmax(logits, -1).gather(1, target.to(logits.device).view(-1, 1)).squeeze(1)


def next_token_output(model: nn.Module, adapter: ArchitectureSpec) -> Optional[NextTokenLogit]:
    r"""The model's :class:`~captum_normattr.attr.explained_output.NextTokenLogit`, or None without an LM head.

    Args:
        model: the model; adapter: its description.

    Returns:
        The next-token logit, or None.
    """
    try:
        return NextTokenLogit(model, adapter)
    except ValueError:
        return None


def warn_non_finite(prepared: PreparedInputs) -> bool:
    r"""Warn and return True when the forward pass of ``prepared`` held NaN or infinite values.

    Args:
        prepared: the inputs after their recorded forward pass (``finite`` filled).

    Returns:
        True when the scores must be NaN.
    """
    if prepared.finite is not None and not bool(prepared.finite.all()):
        warnings.warn("the forward pass holds NaN or infinite values; the scores are NaN", RuntimeWarning, stacklevel=3)
        return True
    return False
