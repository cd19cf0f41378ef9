r"""Aggregation of layer maps over depth (``docs/design.md``, "Rollout").

The full rollout multiplies the (T, T) maps, O(L T^3). When only the explained rows are
needed, :func:`rollout_rows` carries one row vector down the stored maps, O(L T^2).

A raw rollout of maps whose rows are not normalised grows like the product of their row
sums and can pass the dtype's largest number (30 layers of row sums ~1e3-1e4 reach 1e107).
Every product here is therefore carried with a per-example power of two: a step whose
result would pass 2**(maxexp - 8) (or overflow) is redone with the running product divided
by an exact power of two, and the exponent is kept (:func:`rollout_scaled`,
:func:`rollout_rows_scaled`, :meth:`LayerMapStore.rollout_rows_scaled`). Where no step
comes near the limit, nothing is rescaled and the numbers are bit for bit those of the
plain product.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.mixing import row_normalize

__all__ = [
    "LayerMapStore",
    "ROLLOUT_CONVENTIONS",
    "carried_rows_times",
    "check_convention",
    "ldexp_exact",
    "rollout",
    "rollout_rows",
    "rollout_rows_scaled",
    "rollout_scaled",
    "unscale",
]

ROLLOUT_CONVENTIONS = ("raw", "row_normalized")


def check_convention(convention: str) -> None:
    r"""Raise a ValueError naming the rollout conventions."""
    if convention not in ROLLOUT_CONVENTIONS:
        raise ValueError(f"rollout convention must be one of {ROLLOUT_CONVENTIONS}, got {convention!r}")


def _layers(layer_maps: Union[Tensor, Sequence[Tensor]]):
    if isinstance(layer_maps, Tensor):
        if layer_maps.dim() != 4 or layer_maps.shape[-1] != layer_maps.shape[-2]:
            raise ValueError(f"layer_maps must be (B, L, T, T), got shape {tuple(layer_maps.shape)}")
        return [layer_maps[:, l] for l in range(layer_maps.shape[1])]
    return list(layer_maps)


def _maxexp(dtype: torch.dtype) -> int:
    r"""The dtype's largest exponent e (its largest number is just below 2**e): 128 for float32."""
    return math.frexp(torch.finfo(dtype).max)[1]


def _exponent(x: Tensor) -> Tensor:
    r"""The integer e with 2**(e-1) <= x < 2**e for finite x > 0, int64 (0 for x = 0; maxexp + 1
    for a non-finite x: beyond the dtype's range)."""
    e = torch.frexp(torch.where(torch.isfinite(x), x, torch.zeros_like(x)))[1].to(torch.int64)
    return torch.where(torch.isfinite(x), e, torch.full_like(e, _maxexp(x.dtype) + 1))


def _ldexp(x: Tensor, k: Tensor) -> Tensor:
    r"""x * 2**k, exactly, with k int64 shaped like x's leading dimensions (broadcast over the rest).

    Applied in steps of at most 2**64 so that every factor is a normal number of x's dtype.
    """
    k = k.view(*k.shape, *([1] * (x.dim() - k.dim()))).to(x.device)
    most = min(64, _maxexp(x.dtype) - 2)
    while bool((k != 0).any()):
        step = k.clamp(-most, most)
        x = x * torch.exp2(step.to(torch.float64)).to(x.dtype)
        k = k - step
    return x


def _limit(dtype: torch.dtype) -> int:
    return _maxexp(dtype) - 8


def _top(x: Tensor, lead: int) -> Tensor:
    r"""max |x| over all but the ``lead`` leading dimensions."""
    return x.abs().flatten(lead).amax(-1)


def _carried_step(x: Tensor, scale: Tensor, step, bound_exp) -> Tuple[Tensor, Tensor]:
    r"""step(x) with x carried with the power of two ``scale`` (one per leading index of x) so that it cannot overflow.

    The plain step is taken first; only the leading indices (examples, or rows) whose result
    is not finite or passes 2**(maxexp - 8) (while x is finite) are redone with x divided by
    the power of two that ``bound_exp(x)`` (shaped like ``scale``) — an exponent bound of
    |step(x)| — says is needed.
    """
    lead = scale.dim()
    out = step(x)
    top = _exponent(_top(out, lead))
    finite_out = torch.isfinite(out).flatten(lead).all(-1)
    over = (~finite_out | (top > _limit(out.dtype))) & torch.isfinite(x).flatten(lead).all(-1)
    if not bool(over.any()):
        return out, scale
    shift = torch.where(over, (bound_exp(x) - _limit(out.dtype)).clamp(min=0), torch.zeros_like(scale))
    x = _ldexp(x, -shift)
    return step(x), scale + shift


def _unscale(x: Tensor, scale: Tensor) -> Tuple[Tensor, Tensor]:
    r"""Multiply the power of two back where the result fits the dtype; the rest keep theirs."""
    if not bool((scale > 0).any()):
        return x, scale
    top = _exponent(_top(x, scale.dim()))
    fits = (scale > 0) & (top + scale <= _maxexp(x.dtype) - 1)
    x = _ldexp(x, torch.where(fits, scale, torch.zeros_like(scale)))
    return x, torch.where(fits, torch.zeros_like(scale), scale)


def _row_step_bound(row: Tensor, m: Tensor) -> Tensor:
    r"""Exponent bound of row @ m, row (B, ..., T), m (B, T, T): |row @ m|_k <= max|row| * sum_j |m_jk|."""
    cols = torch.linalg.vector_norm(m, 1, dim=-2)
    per_map = _exponent(cols.flatten(1).amax(1)).view(-1, *([1] * (row.dim() - 2)))
    return _exponent(row.abs().amax(-1)) + per_map


def _col_step_bound(m: Tensor, joint: Tensor) -> Tensor:
    r"""Exponent bound of m @ joint per example: |m @ joint|_ik <= max|joint| * sum_j |m_ij|."""
    rows = torch.linalg.vector_norm(m, 1, dim=-1)
    return _exponent(_top(joint, 1)) + _exponent(rows.flatten(1).amax(1))


def carried_rows_times(rows: Tensor, scale: Tensor, m: Tensor) -> Tuple[Tensor, Tensor]:
    r"""One rollout step rows @ m, rows (B, ..., T) carried with the power of two ``scale`` (B, ...) (int64).

    Returns (rows @ m, possibly on a larger power of two, and that scale): rows whose plain
    product would pass 2**(maxexp - 8) are divided by an exact power of two first.
    """
    return _carried_step(rows, scale, lambda r: r @ m if r.dim() > 2 else torch.einsum("bj,bjk->bk", r, m),
                         lambda r: _row_step_bound(r, m))


def ldexp_exact(x: Tensor, k: Tensor) -> Tensor:
    r"""x * 2**k exactly (k int64 shaped like x's leading dimensions): entries beyond the range are ±inf."""
    return _ldexp(x, k)


def unscale(x: Tensor, scale: Tensor) -> Tuple[Tensor, Tensor]:
    r"""(x * 2**scale where that fits the dtype, the scale left elsewhere; 0 where it was multiplied back)."""
    return _unscale(x, scale)


def rollout_scaled(layer_maps: Union[Tensor, Sequence[Tensor]], convention: str = "raw") -> Tuple[Tensor, Tensor]:
    r""":func:`rollout` that cannot overflow: (joint, log2_scale), the rollout = joint * 2**log2_scale.

    A product A_l = M_l A_{l-1} whose result is not finite or passes 2**(maxexp - 8) of the
    dtype is redone with A_{l-1} divided by an exact power of two (from the bound
    max|A_{l-1}| times M_l's largest row sum of |entries|), kept in ``log2_scale``. At the end the power is
    multiplied back wherever the result fits the dtype (``log2_scale`` is then 0): without
    any rescaling the numbers are exactly those of the plain product.

    Args:
        layer_maps: as in :func:`rollout`.
        convention: as in :func:`rollout`.

    Returns:
        (joint (B, T, T), log2_scale (B,) int64).

    Examples::

        >>> maps = torch.full((1, 40, 3, 3), 1e3)
        >>> joint, scale = rollout_scaled(maps)
        >>> bool(torch.isfinite(joint).all()), int(scale[0]) > 0
        (True, True)
    """
    check_convention(convention)
    maps = _layers(layer_maps)
    prep = row_normalize if convention == "row_normalized" else (lambda m: m)
    joint = prep(maps[0])
    scale = torch.zeros(joint.shape[0], dtype=torch.int64, device=joint.device)
    for m in maps[1:]:
        m = prep(m)
        joint, scale = _carried_step(joint, scale, lambda a, m=m: m @ a, lambda a, m=m: _col_step_bound(m, a))
    return _unscale(joint, scale)


def rollout(layer_maps: Union[Tensor, Sequence[Tensor]], convention: str = "raw") -> Tensor:
    r"""Roll layer maps out over depth: A_1 = M_1, A_l = M_l A_{l-1}.

    Args:
        layer_maps: (B, L, T, T) (or a list of L (B, T, T) maps), entry [b, l, i, j] =
            contribution of token j to token i in layer l.
        convention: ``"raw"`` multiplies the maps as they are (what the GlobEnc and ALTI
            reference code ran for every published figure; the default), or
            ``"row_normalized"`` divides each map by its row sums first (what the GlobEnc
            paper's text describes).

    Returns:
        (B, T, T): entry [b, i, j] = contribution of input token j to the last layer's
        output at token i. The product is carried as in :func:`rollout_scaled`, so no
        intermediate overflow turns into NaN; an entry whose true value is beyond the
        dtype's range is ±inf (the scaled result and its power of two:
        :func:`rollout_scaled`).

    Examples::

        >>> maps = torch.rand(2, 3, 5, 5)
        >>> rollout(maps).shape
        torch.Size([2, 5, 5])
    """
    joint, scale = rollout_scaled(layer_maps, convention)
    return _ldexp(joint, scale)


def rollout_rows_scaled(
    layer_maps: Union[Tensor, Sequence[Tensor]], positions: Tensor, convention: str = "raw"
) -> Tuple[Tensor, Tensor]:
    r""":func:`rollout_rows` that cannot overflow: (rows, log2_scale), the rows of the rollout = rows * 2**log2_scale.

    The row vector is rescaled by exact powers of two as in :func:`rollout_scaled` (a step
    row @ M is bounded by max|row| times M's largest column sum of |entries|).

    Args:
        layer_maps: as in :func:`rollout_rows`.
        positions: (B,) long.
        convention: as in :func:`rollout`.

    Returns:
        (rows (B, T), log2_scale (B,) int64; 0 wherever the rows fit the dtype).

    Examples::

        >>> maps = torch.full((1, 40, 3, 3), 1e3)
        >>> rows, scale = rollout_rows_scaled(maps, torch.tensor([2]))
        >>> bool(torch.isfinite(rows).all()), int(scale[0]) > 0
        (True, True)
    """
    check_convention(convention)
    maps = _layers(layer_maps)
    prep = row_normalize if convention == "row_normalized" else (lambda m: m)
    ar = torch.arange(positions.shape[0], device=positions.device)
    row = prep(maps[-1])[ar, positions]
    scale = torch.zeros(row.shape[0], dtype=torch.int64, device=row.device)
    for m in reversed(maps[:-1]):
        m = prep(m)
        row, scale = _carried_step(row, scale, lambda r, m=m: torch.einsum("bj,bjk->bk", r, m),
                                   lambda r, m=m: _row_step_bound(r, m))
    return _unscale(row, scale)


def rollout_rows(layer_maps: Union[Tensor, Sequence[Tensor]], positions: Tensor, convention: str = "raw") -> Tensor:
    r"""The rows ``positions`` of :func:`rollout`, by vector-matrix products down the maps.

    e_i^T M_L M_{L-1} ... M_1 is computed from the top layer down, O(L T^2) instead of
    the O(L T^3) of the full product.

    Args:
        layer_maps: (B, L, T, T) or a list of L (B, T, T) maps (bottom layer first).
        positions: (B,) long, the row of every example.
        convention: as in :func:`rollout`.

    Returns:
        (B, T): row ``positions[b]`` of the rollout of example b.

    Examples::

        >>> maps = torch.rand(2, 3, 5, 5)
        >>> pos = torch.tensor([0, 4])
        >>> torch.allclose(rollout_rows(maps, pos), rollout(maps)[torch.arange(2), pos])
        True
    """
    row, scale = rollout_rows_scaled(layer_maps, positions, convention)
    return _ldexp(row, scale)


class LayerMapStore:
    r"""The per-layer (B, T, T) maps of one call, kept for the rollout.

    Maps of causal layers are lower-triangular: unless the dense (B, L, T, T) tensor is
    asked for, they are kept as ``blocks`` row blocks, block k holding its rows and only
    the columns up to its last row, about (1/2 + 1/(2 blocks)) of the dense memory. The
    explained rows are rolled out straight from the blocks (:meth:`rollout_rows`).

    Args:
        num_layers: L.
        causal: the maps are lower-triangular.
        dense: keep a dense (B, L, T, T) tensor (returned as ``layer_maps``).
        blocks: row blocks of a causal map.

    Examples::

        >>> store = LayerMapStore(2, causal=True, dense=False)
        >>> for l in range(2):
        ...     store.put(l, torch.rand(1, 5, 5).tril())
        >>> store.rollout_rows(torch.tensor([4])).shape
        torch.Size([1, 5])
    """

    def __init__(self, num_layers: int, causal: bool, dense: bool, blocks: int = 16) -> None:
        self.num_layers = num_layers
        self.causal = causal
        self.keep_dense = dense or not causal
        self.num_blocks = blocks
        self._dense: Optional[Tensor] = None
        self._blocks: List[Optional[List[Tuple[int, int, Tensor]]]] = [None] * num_layers

    def put(self, index: int, layer_map: Tensor) -> None:
        r"""Keep layer ``index``'s (B, T, T) map."""
        if self.keep_dense:
            if self._dense is None:
                b, t, _ = layer_map.shape
                self._dense = layer_map.new_zeros(b, self.num_layers, t, t)
            self._dense[:, index] = layer_map
            return
        t = layer_map.shape[-1]
        size = max(1, -(-t // self.num_blocks))
        self._blocks[index] = [
            (a, min(t, a + size), layer_map[:, a : min(t, a + size), : min(t, a + size)].clone()) for a in range(0, t, size)
        ]

    def dense(self) -> Optional[Tensor]:
        r"""The (B, L, T, T) maps, or None when they were kept in blocks."""
        return self._dense

    def layer(self, index: int) -> Tensor:
        r"""Layer ``index``'s map as a dense (B, T, T) tensor."""
        if self._dense is not None:
            return self._dense[:, index]
        blocks = self._blocks[index]
        b_, t = blocks[0][2].shape[0], blocks[-1][1]
        out = blocks[0][2].new_zeros(b_, t, t)
        for a, e, block in blocks:
            out[:, a:e, :e] = block
        return out

    def row_times_layer(self, row: Tensor, index: int, convention: str = "raw") -> Tensor:
        r"""row @ M_index (M row-normalised first for ``"row_normalized"``): (B, T) -> (B, T)."""
        if self._dense is not None:
            m = self._dense[:, index]
            m = row_normalize(m) if convention == "row_normalized" else m
            return torch.einsum("bj,bjk->bk", row, m)
        out = torch.zeros_like(row)
        for a, e, block in self._blocks[index]:
            m = row_normalize(block) if convention == "row_normalized" else block
            out[:, :e] += torch.einsum("bj,bjk->bk", row[:, a:e], m)
        return out

    def rows_times_layer(self, rows: Tensor, index: int) -> Tensor:
        r"""Several row vectors per example times M_index at once: (B, K, T) -> (B, K, T).

        One matrix product per row block instead of K vector-matrix products: the map is
        read once for all K rows (what :func:`~captum_normattr.decompose.methods.alti_logit.alti_logit_terms`
        needs for the rows of every layer above).
        """
        if self._dense is not None:
            return torch.matmul(rows, self._dense[:, index])
        out = rows.new_zeros(rows.shape)
        for a, e, block in self._blocks[index]:
            out[..., :e] += torch.matmul(rows[..., a:e], block)
        return out

    def layer_times_column(self, column: Tensor, index: int) -> Tensor:
        r"""M_index times a column vector per example, (B, T) -> (B, T), without building the dense map."""
        if self._dense is not None:
            return torch.einsum("bjk,bk->bj", self._dense[:, index], column)
        parts = [torch.einsum("bjk,bk->bj", block, column[:, :e]) for a, e, block in self._blocks[index]]
        return torch.cat(parts, 1)

    def rollout_rows_scaled(self, positions: Tensor, convention: str = "raw") -> Tuple[Tensor, Tensor]:
        r"""Rows ``positions`` of the rollout carried with a power of two (see :func:`rollout_rows_scaled`).

        Returns:
            (rows (B, T), log2_scale (B,) int64): the rollout rows = rows * 2**log2_scale;
            log2_scale is 0 wherever the rows fit the dtype.
        """
        check_convention(convention)
        if self._dense is not None:
            t, dtype = self._dense.shape[-1], self._dense.dtype
        else:
            t, dtype = self._blocks[-1][-1][1], self._blocks[-1][-1][2].dtype
        row = torch.nn.functional.one_hot(positions, t).to(dtype)
        scale = torch.zeros(row.shape[0], dtype=torch.int64, device=row.device)
        for l in range(self.num_layers - 1, -1, -1):
            row, scale = _carried_step(row, scale, lambda r, l=l: self.row_times_layer(r, l, convention),
                                       lambda r, l=l: self._row_step_bound(r, l, convention))
        return _unscale(row, scale)

    def _row_step_bound(self, row: Tensor, index: int, convention: str) -> Tensor:
        prep = row_normalize if convention == "row_normalized" else (lambda m: m)
        if self._dense is not None:
            return _row_step_bound(row, prep(self._dense[:, index]))
        cols = torch.zeros_like(row)
        for a, e, block in self._blocks[index]:
            cols[:, :e] += torch.linalg.vector_norm(prep(block), 1, dim=-2)
        return _exponent(row.abs().amax(-1)) + _exponent(cols.amax(-1))

    def rollout_rows(self, positions: Tensor, convention: str = "raw") -> Tensor:
        r"""Rows ``positions`` of the rollout (see :func:`rollout_rows`), from the kept maps.

        Entries beyond the dtype's range are ±inf; :meth:`rollout_rows_scaled` gives them
        scaled, with their power of two.
        """
        row, scale = self.rollout_rows_scaled(positions, convention)
        return _ldexp(row, scale)
