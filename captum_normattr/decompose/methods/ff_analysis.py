r"""The analyses of Kobayashi et al. 2023 on component-scope maps: tensors in, tensors out.

* contextualization change between successive scopes (ATB -> +FF -> +RES2 -> +LN2), per layer;
* FF amplification: how much more of token i's map goes to token j after the FF block than
  before, each map normalised first, and the most amplified token pairs;
* the low-gamma LayerNorm ablation is computed with the maps
  (``component_scope_maps(..., ignore_low_gamma=0.01)``, keys ``ATB_ablated``/``LN2_ablated``);
  :func:`scope_contextualization_changes` uses them with ``ablated=True``.

Maps come from :func:`~captum_normattr.decompose.primitives.feed_forward.component_scope_maps` or from a
:class:`~captum_normattr.FFIntegratedDecomposition` result (``res.extras``, keys ``scope_<NAME>``).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.feed_forward import contextualization_change
from captum_normattr.decompose.primitives.mixing import row_normalize

__all__ = [
    "AMPLIFICATION_NORMALIZATIONS",
    "SCOPE_STEPS",
    "amplification_scores",
    "scope_contextualization_changes",
    "top_amplified_pairs",
]

#: Successive scopes: (before, after, name of the step).
SCOPE_STEPS: Tuple[Tuple[str, str, str], ...] = (("ATB", "FF", "+FF"), ("FF", "RES2", "+RES2"), ("RES2", "LN2", "+LN2"))
AMPLIFICATION_NORMALIZATIONS = ("row", "sum")


def _get(maps: Mapping[str, Tensor], name: str) -> Tensor:
    for key in (name, f"scope_{name}"):
        if key in maps:
            return maps[key]
    raise KeyError(f"no map {name!r} (or 'scope_{name}') among {sorted(maps)}")


def scope_contextualization_changes(maps: Mapping[str, Tensor], valid: Tensor, ablated: bool = False) -> Dict[str, Tensor]:
    r"""Contextualization change (1 - Spearman rho of the flattened valid maps) of every scope step.

    Args:
        maps: scope name -> (B, L, T, T) or (B, T, T) maps; keys ``"ATB"``, ``"FF"``, ``"RES2"``,
            ``"LN2"`` or ``"scope_<NAME>"`` (a result's ``extras`` works as is).
        valid: (B, T) bool, non-pad tokens.
        ablated: use ``ATB_ablated`` and ``LN2_ablated`` (the low-gamma ablation) for the
            LN-output scopes: the steps +FF (from ATB) and +LN2 change.

    Returns:
        ``{"+FF": c, "+RES2": c, "+LN2": c, "ATB->LN2": c}``, each (B, L) (or (B,) for
        (B, T, T) maps): change from ATB to FF, FF to RES2, RES2 to LN2, and the net change
        of the whole FF sub-block, ATB to LN2 (small when RES2 and LN2 cancel the FF's change).
    """
    out: Dict[str, Tensor] = {}
    for before, after, step in SCOPE_STEPS + (("ATB", "LN2", "ATB->LN2"),):
        a = _get(maps, f"{before}_ablated" if ablated and before in ("ATB", "LN2") else before)
        b = _get(maps, f"{after}_ablated" if ablated and after in ("ATB", "LN2") else after)
        if a.dim() == 3:
            out[step] = contextualization_change(a, b, valid)
        else:
            out[step] = torch.stack([contextualization_change(a[:, l], b[:, l], valid) for l in range(a.shape[1])], 1)
    return out


def amplification_scores(before: Tensor, after: Tensor, valid: Tensor, normalize: str = "row") -> Tensor:
    r"""FF amplification: the normalised map after the FF block minus the normalised map before.

    The FF output and its input live on different scales, so both maps are normalised before
    they are compared. ``"row"`` (default) divides every row i by its sum, so entry (i, j) is
    the share of token i's map that comes from token j, and the score says how many
    percentage points of token i's mixing the FF block moves to (> 0) or away from (< 0)
    token j; every valid row of the scores sums to 0. ``"sum"`` divides each whole
    example's map by its total instead (the scores then sum to 0 per example). Diagonal
    entries take part in the normalisation. (The exact normalisation of Kobayashi et al. 2023
    could not be checked offline; both choices are offered and the default is stated.)
    For the FF block of layer l pass ``before=extras["scope_ATB"][:, l]`` (its input's map)
    and ``after=extras["scope_FF"][:, l]`` (its output's map).

    Args:
        before: (B, ..., T, T) map before the FF block (e.g. scope ATB).
        after: (B, ..., T, T) map after it (e.g. scope FF).
        valid: (B, T) bool, non-pad tokens.
        normalize: ``"row"`` or ``"sum"``.

    Returns:
        (B, ..., T, T) scores, 0 at pad rows and columns.
    """
    if normalize not in AMPLIFICATION_NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {AMPLIFICATION_NORMALIZATIONS}, got {normalize!r}")
    m = (valid.unsqueeze(-1) & valid.unsqueeze(-2)).to(before.dtype)
    m = m.reshape(m.shape[:1] + (1,) * (before.dim() - 3) + m.shape[1:])
    before, after = before * m, after * m

    def norm(x: Tensor) -> Tensor:
        if normalize == "row":
            return row_normalize(x)
        total = x.sum((-2, -1), keepdim=True)
        return torch.where(total > 0, x / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(x))

    return (norm(after) - norm(before)) * m


def top_amplified_pairs(
    scores: Tensor, valid: Tensor, k: int = 10, include_diagonal: bool = False
) -> List[List[Tuple[int, int, float]]]:
    r"""The k most amplified token pairs of every example.

    Args:
        scores: (B, T, T) from :func:`amplification_scores` (one layer).
        valid: (B, T) bool.
        k: pairs per example (fewer if the example has fewer valid pairs).
        include_diagonal: also rank the pairs (i, i).

    Returns:
        One list per example of (i, j, score), score descending; i receives, j is the source.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must be (B, T, T) (select one layer), got shape {tuple(scores.shape)}")
    t = scores.shape[-1]
    out = []
    for b in range(scores.shape[0]):
        ok = valid[b].bool().unsqueeze(-1) & valid[b].bool().unsqueeze(-2)
        if not include_diagonal:
            ok = ok & ~torch.eye(t, dtype=torch.bool, device=scores.device)
        flat = scores[b].masked_fill(~ok, float("-inf")).flatten()
        n = min(k, int(ok.sum()))
        vals, idx = flat.topk(n)
        out.append([(int(i) // t, int(i) % t, float(v)) for v, i in zip(vals, idx)])
    return out
