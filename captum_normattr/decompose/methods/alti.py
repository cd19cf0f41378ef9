r"""ALTI contributions (Ferrando et al. 2022; docs/design.md, section 5).

c_ij = max(0, |y_i|_1 - |y_i - T_i(x_j)|_1), rows normalised to sum to 1, where T_i(x_j)
is token j's part of the block output y_i (bias parts are inside y_i but belong to no
token). Two kernels compute the distances |s_i y_i - part_ij|_1 (docs/performance.md):

* a fused one (float32 layers large enough to repay a compilation, see
  :func:`use_compiled_kernel`): for every pair (i, j) it forms the part
  sum_h alpha^h_ij projected[h, j] in registers and accumulates the L1 distance, so no
  part is ever written to memory. On the CPU it is the native C kernel of
  :mod:`~captum_normattr.decompose.primitives.native` (fused multiply-adds, the probabilities read in
  place); elsewhere, or where no C compiler builds it, the ``torch.compile`` kernel;
* the eager one (float64, small layers, or wherever compilation is unavailable): parts
  are produced in tiles (examples x query rows x source tokens,
  :func:`~captum_normattr.decompose.primitives.chunking.tile_for_cache`) into one reused buffer, so
  that memory stays bounded and the L1 passes run on data still in cache.

Both skip the all-zero causal triangle (row blocks stop at their last row).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from captum_normattr.decompose.primitives import compiled

from captum_normattr.decompose.primitives import native
from captum_normattr.decompose.primitives.chunking import MIN_TILE_ROWS, tile_for_cache
from captum_normattr.decompose.primitives.mixing import row_normalize

__all__ = [
    "ALTI_TILE_BYTES",
    "COMPILE_ENV",
    "COMPILE_MIN_ELEMENTS",
    "COMPILE_MIN_EXAMPLE_ELEMENTS",
    "FUSED_BLOCK_BYTES",
    "alti_map",
    "contributions_from_distances",
    "l1_contributions",
    "use_compiled_kernel",
]

#: Bytes of one tile of the eager kernel's reused parts buffer (measured: larger tiles mean
#: fewer, larger batched products; 16 MB beat 1-4 MB on MiniLM 32 x 128).
ALTI_TILE_BYTES = 16 * 2**20
#: Pairs x width (B T^2 D) of a layer from which the compiled kernel is used by default: smaller
#: layers never repay a compilation (seconds, once per process, cached on disk by torch).
COMPILE_MIN_ELEMENTS = 2**24
#: Pairs x width (T^2 D) of one example from which the compiled kernel is used by default: it
#: runs one example per call, and below this size the per-call overhead makes the eager tile
#: kernel as fast or faster (measured: 256 x 32 tokens, width 384: 2.0 vs 1.5 ns per pair
#: and channel; equal at 64 tokens).
COMPILE_MIN_EXAMPLE_ELEMENTS = 2**20
#: Bytes of the parts of one call of the compiled kernel, were they written out: the fused kernel
#: keeps them in registers, but bounding its row blocks keeps memory bounded too where torch
#: runs the function eagerly instead (e.g. after too many recompilations).
FUSED_BLOCK_BYTES = 256 * 2**20
#: Environment variable: ``0`` disables the compiled kernels, ``1`` uses them at every size.
COMPILE_ENV = compiled.COMPILE_ENV


def use_compiled_kernel(enabled: Optional[bool] = None) -> None:
    r"""Choose the ALTI distance kernel (and every other compiled kernel) for the whole process.

    The same switch as :func:`~captum_normattr.decompose.primitives.compiled.use_compiled_kernels`.

    Args:
        enabled: True: the compiled kernel for every layer (float64 too); False: the eager kernel
            always; None (default): float32 layers of at least :data:`COMPILE_MIN_ELEMENTS`
            pairs x width, and :data:`COMPILE_MIN_EXAMPLE_ELEMENTS` per example, use the
            compiled kernel. The environment variable
            ``CAPTUM_NORMATTR_COMPILE`` (``0``/``1``) gives the default of this setting.

    Examples::

        >>> use_compiled_kernel(False)  # e.g. a one-off call on a machine without a C++ compiler
        >>> use_compiled_kernel(None)
    """
    compiled.use_compiled_kernels(enabled)


def _l1_distance_tile(mix: Tensor, projected: Tensor, target: Tensor) -> Tensor:
    r"""|target_r - sum_h mix[c, r, h] projected[c, h]|_1 for every (c, r): the fused computation.

    Args:
        mix: (n, C, R, H) probabilities alpha^h_ij laid out (source j, query i, head).
        projected: (n, C, H, D) values of the source tokens through W_O (and a map A).
        target: (n, R, D) s_i y_i.

    Returns:
        (n, C, R).
    """
    acc = mix[..., 0, None] * projected[:, :, None, 0, :]
    for h in range(1, mix.shape[-1]):  # unrolled: the compiler keeps the part in registers
        acc = acc + mix[..., h, None] * projected[:, :, None, h, :]
    return (acc - target[:, None]).abs().sum(-1)


def _compiled_kernel(dtype: torch.dtype, elements: int, example_elements: Optional[int] = None
                     ) -> Optional[Callable[[Tensor, Tensor, Tensor], Tensor]]:
    r"""The compiled :func:`_l1_distance_tile` if it should and can be used, else None.

    ``elements``: pairs x width of the layer (B T^2 D); ``example_elements``: of one example
    (T^2 D; None: not checked).
    """
    small = elements < COMPILE_MIN_ELEMENTS or (example_elements or elements) < COMPILE_MIN_EXAMPLE_ELEMENTS
    return compiled.compiled_kernel(_l1_distance_tile, dtype == torch.float32 and not small)


def l1_contributions(parts: Tensor, output: Tensor) -> Tensor:
    r"""Unnormalised ALTI contributions of explicit parts.

    Args:
        parts: (B, R, T, D) part of source token j in receiving token i.
        output: (B, R, D) the real output y_i of the block at the receiving tokens.

    Returns:
        (B, R, T): max(0, |y_i|_1 - |y_i - part_ij|_1).
    """
    y_l1 = output.abs().sum(-1, keepdim=True)
    dist = (output.unsqueeze(2) - parts).abs().sum(-1)
    return (y_l1 - dist).clamp_min(0)


def alti_map(
    probs: Tensor,
    projected: Tensor,
    residual: Optional[Tensor],
    output: Tensor,
    valid: Tensor,
    row_scale: Optional[Tensor] = None,
    chunk_rows: Optional[int] = None,
    causal: bool = False,
    tile_bytes: Optional[int] = None,
    valid_k: Optional[Tensor] = None,
    extra_parts: Optional[Tensor] = None,
    l1_eps: float = 0.0,
) -> Tensor:
    r"""ALTI layer map from attention probabilities and per-head projected values.

    The part of token j in token i is
    (sum_h alpha^h_ij projected[h, j] + [i = j] residual_i) / row_scale_i.

    The queries may attend to other keys than themselves (cross-attention: Q queries, K keys,
    no ``residual``); further parts of every query that belong to no key (cross-attention's
    residual stream) come as ``extra_parts`` and are the last columns of the map.

    Args:
        probs: (B, H, T, T) attention probabilities ((B, H, Q, K) for cross-attention).
        projected: (B, H, T, D) values through W_O and any linear map (see
            :func:`~captum_normattr.decompose.primitives.attention.project_values`); (B, H, K, D).
        residual: (B, T, D) the residual term of token i (already mapped), or None.
        output: (B, T, D) real block output y_i (bias parts included); (B, Q, D).
        valid: (B, T) bool, non-pad tokens (the queries).
        row_scale: optional (B, T) divisor per receiving token (a norm's real scale).
        chunk_rows: at most this many query rows per tile of the eager kernel (the
            memory-budget chunk of :func:`~captum_normattr.decompose.primitives.chunking.rows_for_budget`;
            None: no cap). The tiles are smaller still, sized for the cache.
        causal: causal attention (decoders): row i has parts only from j <= i, so each block
            of rows works on the source tokens before its end only (entries j > i are 0).
        tile_bytes: bytes of one tile of the eager kernel (None: :data:`ALTI_TILE_BYTES`).
        valid_k: (B, K) bool, non-pad keys, where they are not the queries (cross-attention);
            None: ``valid``.
        extra_parts: optional (B, Q, E, D) parts of every query that belong to no key (unscaled
            like the others: divided by ``row_scale``); their contributions are the last E
            columns of the map (never masked).
        l1_eps: a constant added to every coordinate of part_ij - y_i inside the L1 distance
            (the official ALTI+ code's ``pairwise_distance``); 0 (default): the plain distance.
            The same constant enters the distances of the all-zero parts, so with ``l1_eps``
            and ``causal`` the entries j > i are still set to 0.

    Returns:
        (B, Q, K + E) contributions (self-attention: (B, T, T)), valid rows summing to 1, pad
        rows and pad key columns 0.
    """
    b, _, k, d = projected.shape
    q = output.shape[1]
    if q != k and (residual is not None or causal):
        raise ValueError(f"{q} queries but {k} keys: a residual on the diagonal or causal attention needs Q == K")
    if causal and extra_parts is not None:
        raise ValueError("extra_parts are not supported with causal attention")
    # Source-token-major layout (B, T_j, H, D): a free view where ``projected`` was made
    # token-major (:func:`~captum_normattr.decompose.primitives.attention.project_values`), else a copy.
    proj_j = projected.permute(0, 2, 1, 3).contiguous()
    y_l1 = output.abs().sum(-1)  # (B, Q)
    # |y_i - part_ij / s_i + eps|_1 = |s_i (y_i - eps) - part_ij|_1 / s_i
    shifted = output - l1_eps if l1_eps else output
    target = shifted if row_scale is None else shifted * row_scale[..., None]
    kernel = None if tile_bytes is not None else _compiled_kernel(projected.dtype, b * q * k * d, q * k * d)
    dist = None
    native_fn = _native_kernel(probs, projected) if kernel is not None else None
    if native_fn is not None:
        dist = _native_distances(native_fn, probs, proj_j, residual, target, causal)
    elif kernel is not None:
        try:
            dist = _fused_distances(kernel, probs, proj_j, residual, target, causal)
        except Exception as e:  # compilation failed (no C++ compiler, unsupported device, ...)
            compiled.kernel_failed(_l1_distance_tile, e)
    if dist is None:
        dist = _tiled_distances(probs, proj_j, residual, target, chunk_rows, causal, tile_bytes or ALTI_TILE_BYTES)
    return contributions_from_distances(dist, y_l1, valid, row_scale, causal, valid_k, extra_parts, target)


def contributions_from_distances(dist: Tensor, y_l1: Tensor, valid: Tensor, row_scale: Optional[Tensor] = None,
                                 causal: bool = False, valid_k: Optional[Tensor] = None,
                                 extra_parts: Optional[Tensor] = None, target: Optional[Tensor] = None) -> Tensor:
    r"""ALTI contributions max(0, |y_i|_1 - d_ij) row-normalised, from the distances d_ij (changed in place).

    Args:
        dist: (B, Q, K) distances |s_i y_i - part_ij|_1 (scaled by s_i; see :func:`alti_map`).
        y_l1: (B, Q) |y_i|_1.
        valid, row_scale, causal, valid_k, extra_parts: as in :func:`alti_map`.
        target: (B, Q, D) s_i y_i, needed with ``extra_parts``.

    Returns:
        (B, Q, K + E) contributions, valid rows summing to 1.
    """
    b = dist.shape[0]
    if extra_parts is not None:
        dist = torch.cat([dist, (extra_parts - target.unsqueeze(2)).abs().sum(-1)], dim=-1)  # (B, Q, K + E)
    if row_scale is not None:
        dist.div_(row_scale[..., None])
    out = dist.neg_().add_(y_l1[..., None]).clamp_min_(0)  # y_l1 - dist in place (the same bits)
    cols = valid if valid_k is None else valid_k
    if not (bool(valid.all()) and bool(cols.all())):  # pad rows and columns to 0 (no mask pass without pads)
        if extra_parts is not None:
            cols = torch.cat([cols, cols.new_ones(b, extra_parts.shape[2])], dim=1)
        out.mul_((valid.unsqueeze(-1) & cols.unsqueeze(-2)).to(out.dtype))
    if causal:
        out.tril_()
    return row_normalize(out, inplace=True)  # ``out`` is this function's own (dist): no second (B, Q, K) map


def _native_kernel(probs: Tensor, projected: Tensor) -> Optional[Callable]:
    r"""The native C kernel (:mod:`~captum_normattr.decompose.primitives.native`) for CPU tensors of one dtype, else None."""
    if probs.device.type != "cpu" or projected.device.type != "cpu" or probs.dtype != projected.dtype:
        return None
    return native.alti_l1_kernel(projected.dtype, projected.shape[1])


def _native_distances(fn: Callable, probs: Tensor, proj_j: Tensor, residual: Optional[Tensor], target: Tensor,
                      causal: bool) -> Tensor:
    r"""(B, T, T) distances |s_i y_i - part_ij|_1 by the native kernel: one example per call, the
    probabilities read through their strides (no copy); the diagonal as in :func:`_fused_distances`."""
    b, t = target.shape[:2]
    k = proj_j.shape[1]
    dist = target.new_zeros(b, t, k)
    target = target.contiguous()
    for e in range(b):
        native.native_distances(fn, probs[e], proj_j[e], target[e], dist[e], causal)
    if residual is not None:
        _residual_diagonal(dist, probs, proj_j, residual, target)
    return dist


def _residual_diagonal(dist: Tensor, probs: Tensor, proj_j: Tensor, residual: Tensor, target: Tensor) -> None:
    r"""Recompute the diagonal of ``dist`` in place: the part of token i in itself also holds its residual term."""
    t = dist.shape[1]
    diag = torch.diagonal(probs, dim1=-2, dim2=-1).transpose(1, 2)  # (B, T, H)
    own = torch.einsum("bth,bthd->btd", diag, proj_j) + residual
    idx = torch.arange(t, device=dist.device)
    dist[:, idx, idx] = (target - own).abs().sum(-1)


def _fused_distances(kernel, probs: Tensor, proj_j: Tensor, residual: Optional[Tensor], target: Tensor, causal: bool) -> Tensor:
    r"""(B, T, T) distances |s_i y_i - part_ij|_1 by the compiled kernel (see the module docstring).

    One example at a time; row blocks of max(16, T / 16) rows for causal attention (source
    tokens up to the block's last row only), and never more rows than
    :data:`FUSED_BLOCK_BYTES` of one example's parts would fill. The diagonal, whose part
    also holds the residual term, is recomputed afterwards, O(B T H D).
    """
    b, t = target.shape[:2]  # queries
    k = proj_j.shape[1]  # keys (== t for self-attention)
    dist = target.new_zeros(b, t, k)
    per_row = k * proj_j.shape[-1] * proj_j.element_size()  # bytes of one query row's parts
    step = max(MIN_TILE_ROWS, FUSED_BLOCK_BYTES // max(1, per_row))
    if causal:
        step = min(step, max(MIN_TILE_ROWS, -(-t // 16)))
    # One example per call, probabilities copied to a contiguous (1, C, R, H) block: the kernel
    # then loops source token > query row > width, reusing each source's projected values
    # (H x D) for every row while they are in cache. Measured (docs/performance.md): read
    # through the permuted view, or with several examples per call (where inductor splits
    # the sum over heads into two loops and writes the parts out), it ran 1.5-5x slower.
    # Fixed layout and batch size also mean one compilation for every call.
    heads = probs.shape[1]
    # One block's (H, C, R) and (C, R, H) copies in two reused buffers (no page faults per block). Two plain
    # transposes, (H, R, C) -> (H, C, R) per head, then (H, C R) -> (C R, H), cost half of one 3-D permuted
    # copy (measured at 2048 tokens, 9 heads: 0.09 -> 0.04 s per layer).
    size = k * min(step, t) * heads
    by_head, scratch = probs.new_empty(size), probs.new_empty(size)
    for e in range(b):
        for r0 in range(0, t, step):
            r1 = min(t, r0 + step)
            last = r1 if causal else k
            n = last * (r1 - r0) * heads
            cols = by_head[:n].view(heads, last, r1 - r0)
            cols.copy_(probs[e, :, r0:r1, :last].transpose(1, 2))
            mix = scratch[:n].view(1, last, r1 - r0, heads)
            mix[0].copy_(cols.permute(1, 2, 0))  # (1, C, R, H) contiguous
            dist[e : e + 1, r0:r1, :last] = kernel(mix, proj_j[e : e + 1, :last], target[e : e + 1, r0:r1]).transpose(1, 2)
    if residual is not None:
        _residual_diagonal(dist, probs, proj_j, residual, target)
    return dist


def _tiled_distances(
    probs: Tensor, proj_j: Tensor, residual: Optional[Tensor], target: Tensor, chunk_rows: Optional[int], causal: bool,
    tile_bytes: int,
) -> Tensor:
    r"""(B, T, T) distances |s_i y_i - part_ij|_1 by the eager tile kernel (see the module docstring)."""
    b, k, _, d = proj_j.shape  # keys
    t = target.shape[1]  # queries (== k for self-attention)
    nb, nr, nc = tile_for_cache(b, k, d, proj_j.element_size(), chunk_rows, tile_bytes)
    nr = min(nr, t)
    dist_all = target.new_zeros(b, t, k)
    # One buffer reused by every tile: no page faults, and the passes of sub/abs/sum read
    # what the product has just written while it is still in cache.
    buf = proj_j.new_empty(nb * nr * nc * d)
    for b0 in range(0, b, nb):
        bs = slice(b0, min(b, b0 + nb))
        n_b = bs.stop - bs.start
        for r0 in range(0, t, nr):
            r1 = min(t, r0 + nr)
            tgt = target[bs, r0:r1].unsqueeze(1)  # (b, 1, R, D)
            last = r1 if causal else k  # causal: sources j < r1 only (entries j > i are 0)
            for c0 in range(0, last, nc):
                c1 = min(last, c0 + nc)
                parts = buf[: n_b * (c1 - c0) * (r1 - r0) * d].view(n_b, c1 - c0, r1 - r0, d)
                mix = probs[bs, :, r0:r1, c0:c1].permute(0, 3, 2, 1)  # (b, C, R, H)
                torch.matmul(mix, proj_j[bs, c0:c1], out=parts)  # unscaled part of j in i
                lo, hi = max(r0, c0), min(r1, c1)
                if residual is not None and lo < hi:
                    r_idx = torch.arange(lo, hi, device=parts.device)
                    parts[:, r_idx - c0, r_idx - r0] += residual[bs, lo:hi]
                dist_all[bs, r0:r1, c0:c1] = parts.sub_(tgt).abs_().sum(-1).transpose(1, 2)  # (b, R, C)
    return dist_all
