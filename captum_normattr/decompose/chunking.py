r"""The one rule that sizes row chunks under a memory budget (in MB) for every chunked path.

Explicit parts are built for a chunk of receiving tokens (query rows) at a time. A chunk
of R rows holds ``temporaries`` tensors of shape (B, R, T, width); the rule picks the
largest R that keeps them within ``budget_mb``. With causal attention, row i has parts
from j <= i only, so smaller chunks skip more of the all-zero upper triangle: the chunk
is capped at max(16, T / 8) rows.
"""
from __future__ import annotations

#: Budget of the row-chunked Gram products of the norm maps (one (B, R, T, H) temporary).
GRAM_CHUNK_MB = 64.0


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


def row_chunks(tokens: int, chunk: int):
    r"""Consecutive slices of at most ``chunk`` rows covering range(tokens)."""
    for start in range(0, tokens, chunk):
        yield slice(start, min(tokens, start + chunk))
