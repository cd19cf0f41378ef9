r"""Aggregation of layer maps over depth (``docs/design.md``, "Rollout").

The full rollout multiplies the (T, T) maps, O(L T^3). When only the explained rows are
needed, :func:`rollout_rows` carries one row vector down the stored maps, O(L T^2).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from captum_normattr.decompose.mixing import row_normalize

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
        output at token i.

    Examples::

        >>> maps = torch.rand(2, 3, 5, 5)
        >>> rollout(maps).shape
        torch.Size([2, 5, 5])
    """
    check_convention(convention)
    maps = _layers(layer_maps)
    prep = row_normalize if convention == "row_normalized" else (lambda m: m)
    joint = prep(maps[0])
    for m in maps[1:]:
        joint = prep(m) @ joint
    return joint


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
    check_convention(convention)
    maps = _layers(layer_maps)
    prep = row_normalize if convention == "row_normalized" else (lambda m: m)
    ar = torch.arange(positions.shape[0], device=positions.device)
    row = prep(maps[-1])[ar, positions]
    for m in reversed(maps[:-1]):
        row = torch.einsum("bj,bjk->bk", row, prep(m))
    return row


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
        read once for all K rows (what :func:`~captum_normattr.decompose.decoder.alti_logit_terms`
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

    def rollout_rows(self, positions: Tensor, convention: str = "raw") -> Tensor:
        r"""Rows ``positions`` of the rollout (see :func:`rollout_rows`), from the kept maps."""
        check_convention(convention)
        if self._dense is not None:
            t, dtype = self._dense.shape[-1], self._dense.dtype
        else:
            t, dtype = self._blocks[-1][-1][1], self._blocks[-1][-1][2].dtype
        row = torch.nn.functional.one_hot(positions, t).to(dtype)
        for l in range(self.num_layers - 1, -1, -1):
            row = self.row_times_layer(row, l, convention)
        return row
