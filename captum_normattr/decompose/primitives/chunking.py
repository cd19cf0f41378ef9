r"""The one rule that sizes row chunks under a memory budget (in MB) for every chunked path.

Explicit parts are built for a chunk of receiving tokens (query rows) at a time. A chunk
of R rows holds ``temporaries`` tensors of shape (B, R, T, width); the rule picks the
largest R that keeps them within ``budget_mb``. With causal attention, row i has parts
from j <= i only, so smaller chunks skip more of the all-zero upper triangle: the chunk
is capped at max(16, T / 8) rows.

The budget bounds memory; speed asks for less. A chunk whose temporaries fall out of the
CPU caches is written to and read back from main memory once per elementwise pass, and a
fresh large temporary per chunk costs page faults. :func:`tile_for_cache` therefore
picks (examples, rows, columns) tiles of about :data:`CACHE_TILE_BYTES` for the kernels that
make several passes over their parts (ALTI), inside the memory budget.
"""
from __future__ import annotations

from typing import Optional

__all__ = [
    "CACHE_TILE_BYTES",
    "GRAM_CHUNK_MB",
    "MIN_TILE_ROWS",
    "VECTOR_BLOCK_BYTES",
    "row_chunks",
    "rows_for_budget",
    "tile_for_cache",
    "token_blocks",
]

#: Bytes of one tile of explicit parts in the cache-blocked kernels (about an L2/L3 share per core).
CACHE_TILE_BYTES = 4 * 2**20
#: Fewest rows (and columns) of a cache tile: smaller matrix products run below the BLAS's speed.
MIN_TILE_ROWS = 16

#: Budget of the row-chunked Gram products of the norm maps (one (B, R, T, H) temporary).
GRAM_CHUNK_MB = 64.0

#: Bytes of one (tokens, D) block of the per-token vector work (norm scales, diagonal parts,
#: mixing ratios, completeness): every pass after the first reads the block from the CPU
#: cache instead of main memory (docs/performance.md, "GlobEnc on MiniLM, memory passes and the quadratic forms").
VECTOR_BLOCK_BYTES = 2**20


def rows_for_budget(
    batch: int, tokens: int, width: int, itemsize: int, budget_mb: float, temporaries: int = 2, causal: bool = False
) -> int:
    r"""Rows per chunk so that ``temporaries`` tensors (B, R, T, width) fit in ``budget_mb``.

    Args:
        batch, tokens: B and T.
        width: the last dimension of the temporaries (D, F, H, ...).
        itemsize: bytes per element of the compute dtype.
        budget_mb: the memory budget in MB (2**20 bytes).
        temporaries: how many such tensors live at once.
        causal: cap the chunk at max(16, ceil(T / 8)) rows (see the module docstring).

    Returns:
        Rows per chunk, between 1 and ``tokens``.

    Examples::

        >>> rows_for_budget(1, 2048, 256, 4, 256.0)
        64
    """
    if budget_mb <= 0:
        raise ValueError(f"the memory budget must be positive, got {budget_mb} MB")
    per_row = temporaries * batch * tokens * width * itemsize
    rows = max(1, min(tokens, int(budget_mb * 2**20 // max(per_row, 1))))
    if causal:
        rows = min(rows, max(16, -(-tokens // 8)))
    return rows


def tile_for_cache(
    batch: int, tokens: int, width: int, itemsize: int, max_rows: int | None = None, tile_bytes: int = CACHE_TILE_BYTES
) -> tuple:
    r"""(examples, rows, columns) of a tile of parts (b, R, C, width) of about ``tile_bytes``.

    Rows first (at least :data:`MIN_TILE_ROWS`, at most ``max_rows``, the memory-budget
    chunk), then source columns, then examples fill the tile.

    Args:
        batch, tokens: B and T.
        width: the last dimension of the parts (D).
        itemsize: bytes per element.
        max_rows: cap on the rows (e.g. :func:`rows_for_budget`); None: no cap.
        tile_bytes: the tile size in bytes.

    Returns:
        (examples, rows, columns), each at least 1.

    Examples::

        >>> tile_for_cache(32, 128, 384, 4)
        (1, 21, 128)
        >>> tile_for_cache(1, 1024, 768, 4)
        (1, 16, 85)
    """
    pairs = max(1, tile_bytes // max(1, width * itemsize))  # (i, j) pairs per tile
    rows = min(tokens, max(MIN_TILE_ROWS, pairs // tokens))
    if max_rows is not None:
        rows = max(1, min(rows, int(max_rows)))
    cols = min(tokens, max(MIN_TILE_ROWS, pairs // rows))
    examples = max(1, min(batch, pairs // (rows * cols)))
    return examples, rows, cols


def row_chunks(tokens: int, chunk: int):
    r"""Consecutive slices of at most ``chunk`` rows covering range(tokens)."""
    for start in range(0, tokens, chunk):
        yield slice(start, min(tokens, start + chunk))


def token_blocks(tokens: int, row_bytes: int, block_bytes: Optional[int] = None):
    r"""Consecutive slices of the (flattened) tokens, each about ``block_bytes`` of rows.

    Args:
        tokens: the number of rows (e.g. B * T).
        row_bytes: bytes of one row (D * itemsize).
        block_bytes: the block size in bytes (None: :data:`VECTOR_BLOCK_BYTES`).

    Returns:
        An iterator of slices covering range(tokens).

    Examples::

        >>> [(s.start, s.stop) for s in token_blocks(1000, 384 * 4)]
        [(0, 682), (682, 1000)]
    """
    block_bytes = VECTOR_BLOCK_BYTES if block_bytes is None else block_bytes
    return row_chunks(tokens, max(1, block_bytes // max(1, row_bytes)))
