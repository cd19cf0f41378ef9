r"""Parts of the attention block and their norms (docs/design.md, sections 3, 4 and 10).

Token j's part of the attention output of token i is
a_{i<-j} = sum_h alpha^h_ij f^h(x_j), with f^h(x_j) = v^h_j W_O^h (the value bias inside).
Nothing here builds a per-head (H, T, T, D) tensor: norms of linearly transformed
parts come from per-token H x H Gram matrices, and explicit parts are produced in row
chunks from per-head projected values (B, H, T, D).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.primitives import compiled
from captum_normattr.decompose.primitives.channel_mixing import channel_part_norms_squared, is_channel_mixing
from captum_normattr.decompose.primitives.chunking import CACHE_TILE_BYTES, GRAM_CHUNK_MB, MIN_TILE_ROWS, rows_for_budget, token_blocks
from captum_normattr.decompose.primitives.mixing import mixing_ratio

__all__ = [
    "QUAD_COMPILE_AFTER_SECONDS",
    "QUAD_COMPILE_MIN_ELEMENTS",
    "attention_context",
    "attention_parts_rows",
    "diagonal_attention_parts",
    "heads_through_out",
    "norm_maps_and_ratios",
    "part_norms_gram",
    "project_values",
    "softmax_with_sinks",
]

#: Probabilities (B H T^2) of a float32 layer from which the compiled quadratic-form kernel may be
#: used by default. Measured on MiniLM 32 x 128 (6.3 M per layer): 3 ms against 12-20 ms for the
#: eager blocks, about 0.1 s of a 1.2 s GlobEnc call.
QUAD_COMPILE_MIN_ELEMENTS = 2**22
#: Seconds the eager quadratic forms of such layers may take in a process before the compiled
#: kernel replaces them by default. Its compilation costs about 10 s once per process on 2 cores
#: (less from torch's disk cache): no single call repays it, so it is bought only once the eager
#: kernel has cost as much (a rent-or-buy rule: never more than about twice the better choice).
#: The two kernels agree to rounding (about 1e-7 relative in float32), so a process's numbers
#: may change in their last bits when it switches; ``CAPTUM_NORMATTR_COMPILE=0`` or ``=1`` fixes
#: the kernel for bitwise-reproducible runs.
QUAD_COMPILE_AFTER_SECONDS = 10.0
#: Most heads for which the compiled kernel is used by default: it unrolls a loop over the heads,
#: which compiles in about 10 s for up to a few dozen heads, but the hybrid mixers record one head
#: per channel (256-512 at a width of 256), where the compilation alone stalled a 1024-token GlobEnc
#: call for over 600 s (37 s eager; benchmarks/RESULTS.md, "Hybrid mixers at 1024 and 4096 tokens").
QUAD_COMPILE_MAX_HEADS = 64
_EAGER_QUAD_SECONDS = [0.0]


def project_values(values: Tensor, head_weight: Tensor, lin_map: Optional[Tensor] = None, token_major: bool = False) -> Tensor:
    r"""Project every head's values through its slice of W_O (and optionally a map A).

    Args:
        values: (B, H, T, Dh) value states (bias included).
        head_weight: (H, Dh, D) the output projection per head.
        lin_map: optional (D, D) right-multiplied linear map A applied after W_O (or a
            :class:`~captum_normattr.decompose.primitives.layer_norm.NormLinearMap`).
        token_major: store the result token by token, (B, T, H, D) in memory (the
            returned tensor is its (B, H, T, D) view): one product per head written
            straight into its strided slot, so that a token-major consumer (the ALTI
            kernels) needs no permuted copy of a tensor H times the hidden states.

    Returns:
        (B, H, T, D): f^h(x_j) A for every head h and token j.
    """
    w = head_weight if lin_map is None else head_weight @ lin_map
    if not token_major:
        return torch.einsum("bhtk,hkd->bhtd", values, w)
    b, h, t, dh = values.shape
    out = values.new_empty(b * t, h, w.shape[-1])
    flat = values.transpose(1, 2).reshape(b * t, h, dh)  # (B T, H, Dh), one small copy
    for k in range(h):  # rows of out[:, k] are H D apart: a strided output BLAS writes in place
        torch.mm(flat[:, k], w[k], out=out[:, k])
    return out.view(b, t, h, -1).transpose(1, 2)


def softmax_with_sinks(scores: Tensor, sinks: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    r"""Attention probabilities with learned sinks: p_ij = exp(z_ij) / (sum_k exp(z_ik) + exp(s_h)).

    Each head h's softmax row has one more logit, the sink s_h, whose probability is dropped
    (GPT-OSS): the probabilities over the tokens sum to 1 - p_sink < 1. Everything downstream is
    linear in the probabilities (the context sum_j p_ij v_j, the parts p_ij f(x_j)), so no
    method needs the rows to sum to 1 (``docs/frontier.md``, "Attention sinks").

    Args:
        scores: (B, H, T, S) scaled scores, the mask already added.
        sinks: (H,) the sink logits.
        dtype: of the softmax (None: the scores').

    Returns:
        (B, H, T, S) the probabilities over the tokens.

    Examples::

        >>> p = softmax_with_sinks(torch.zeros(1, 2, 1, 3), torch.tensor([0.0, -50.0]))
        >>> [round(float(x), 4) for x in p.sum(-1).flatten()]
        [0.75, 1.0]
    """
    b, h, t, _ = scores.shape
    sink = sinks.to(scores.dtype).reshape(1, h, 1, 1).expand(b, h, t, 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=dtype or scores.dtype)[..., :-1]


def diagonal_attention_parts(probs: Tensor, values: Tensor, head_weight: Tensor) -> Tensor:
    r"""Each token's own part of its attention output, a_{i<-i}.

    Args:
        probs: (B, H, T, T) attention probabilities.
        values: (B, H, T, Dh).
        head_weight: (H, Dh, D).

    Returns:
        (B, T, D): sum_h alpha^h_ii f^h(x_i).
    """
    diag = torch.diagonal(probs, dim1=-2, dim2=-1)  # (B, H, T)
    return heads_through_out(values * diag.unsqueeze(-1), head_weight)


def heads_through_out(per_head: Tensor, head_weight: Tensor) -> Tensor:
    r"""sum_h per_head[:, h] W_O^h as one (B T, H Dh) @ (H Dh, D) product.

    Args:
        per_head: (B, H, T, Dh).
        head_weight: (H, Dh, D).

    Returns:
        (B, T, D).
    """
    b, h, t, dh = per_head.shape
    return per_head.transpose(1, 2).reshape(b, t, h * dh) @ head_weight.reshape(h * dh, -1)


def attention_context(probs: Tensor, values: Tensor, causal: bool = False) -> Tensor:
    r"""sum_j alpha^h_ij v^h_j per head, (B, H, T, Dh); causal: row blocks skip the sources j > i.

    Args:
        probs: (B, H, T, T); values: (B, H, T, Dh).
        causal: the probabilities are lower-triangular (entries j > i exactly 0).

    Returns:
        (B, H, T, Dh).
    """
    t = probs.shape[-1]
    if not causal or t <= 2 * MIN_TILE_ROWS:
        return torch.matmul(probs, values)
    out = values.new_empty(values.shape)
    step = max(MIN_TILE_ROWS, -(-t // 8))
    for r0 in range(0, t, step):
        r1 = min(t, r0 + step)
        torch.matmul(probs[:, :, r0:r1, :r1], values[:, :, :r1], out=out[:, :, r0:r1])
    return out


def attention_parts_rows(probs: Tensor, projected: Tensor, rows: slice) -> Tensor:
    r"""Explicit parts a_{i<-j} for a chunk of query rows.

    Args:
        probs: (B, H, T, T) attention probabilities.
        projected: (B, H, T, D) from :func:`project_values` (any linear map A applied).
        rows: the query rows i to produce.

    Returns:
        (B, R, T, D): entry [b, i, j] = sum_h alpha^h_ij projected[b, h, j].
    """
    if is_channel_mixing(probs):  # a hybrid mixer's factored mixing: the block of rows alone is built
        start, stop, _ = rows.indices(probs.shape[2])
        return torch.einsum("brsn,bnsd->brsd", probs.rows(start, stop, projected.shape[2]), projected)
    return torch.einsum("bhij,bhjd->bijd", probs[:, :, rows], projected)


def _gram_and_diagonal(probs: Tensor, values: Tensor, w: Tensor) -> Tuple[Tensor, Tensor]:
    r"""Per-token Gram matrices (B, T, H, H) of the vectors f^h(x_j) A = v^h_j w^h, and the
    attention part of every token in itself, sum_h alpha^h_jj f^h(x_j) A, (B, T, D).

    Built from cache-sized blocks of tokens: the (tokens, H, D) projections are H times
    larger than the hidden states and never exist for all tokens at once.
    """
    b, h, t = values.shape[:3]
    d = w.shape[-1]
    gram = values.new_empty(b, t, h, h)
    diag = values.new_empty(b, t, d)
    # (B T, 1, H), contiguous: a strided view (B = 1) made bmm copy every token's operands one by one
    alpha_jj = torch.diagonal(probs, dim1=-2, dim2=-1).transpose(1, 2).reshape(b * t, 1, h).contiguous()
    # (H, B T, Dh) view of the values: per head, token rows H Dh apart (a strided BLAS operand)
    heads_v, flat_g = values.transpose(1, 2).reshape(b * t, h, -1).transpose(0, 1), gram.view(b * t, h, h)
    flat_d = diag.view(b * t, 1, d)
    step = min(b * t, max(MIN_TILE_ROWS, CACHE_TILE_BYTES // max(1, h * d * values.element_size())))
    # one head-major buffer for every block's projections: a fresh one per block, between the
    # callback's small temporaries, came from new pages and halved the products' speed
    buf = values.new_empty(h, step, d)
    for s0 in range(0, b * t, step):
        s1 = min(b * t, s0 + step)
        projected = torch.bmm(heads_v[:, s0:s1], w, out=buf[:, : s1 - s0]).transpose(0, 1)  # (n, H, D): f^h(x_j) A
        torch.matmul(projected, projected.transpose(-1, -2), out=flat_g[s0:s1])
        torch.matmul(alpha_jj[s0:s1], projected, out=flat_d[s0:s1])
    return gram, diag


def _quadratic_forms_tile(probs: Tensor, gram_sym: Tensor) -> Tensor:
    r"""sum_{h <= h'} alpha^h_ij g_j[h, h'] alpha^h'_ij for every (example, row i, column j): the fused kernel.

    Args:
        probs: (n, H, R, C) probabilities in their own layout.
        gram_sym: (n, H, H, C) the Gram matrices of the C source tokens, token last, with
            the entries above the diagonal doubled (those below are not read).

    Returns:
        (n, R, C): alpha_ij^T G_j alpha_ij.
    """
    h = probs.shape[1]
    acc = None
    for a in range(h):  # unrolled over the first head, a reduction over the second (h' >= a):
        # compiles in about 10 s on 2 cores (a fully unrolled H^2 / 2-term sum took 20-35 s, same speed)
        term = probs[:, a] * (gram_sym[:, a, a:, None, :] * probs[:, a:]).sum(1)
        acc = term if acc is None else acc + term
    return acc


def _fused_quadratic_norms(kernel: Callable, probs: Tensor, gram: Tensor, causal: bool) -> Tensor:
    r""":func:`_quadratic_norms` by the compiled :func:`_quadratic_forms_tile` (no copy of the probabilities).

    The whole batch per call (one compilation serves every batch size above 1, a second one
    batches of 1); causal: blocks of max(16, T / 8) rows whose sources stop at the block's last row.
    """
    b, h, t = probs.shape[:3]
    weight = torch.full((h, h), 2.0, dtype=gram.dtype, device=gram.device).triu_(1)
    weight.diagonal().fill_(1.0)
    gram_sym = (gram.permute(0, 2, 3, 1) * weight[:, :, None]).contiguous()  # (B, H, H, T)
    if not causal or t <= 2 * MIN_TILE_ROWS:
        return kernel(probs, gram_sym)
    sq = probs.new_zeros(b, t, t)
    step = max(MIN_TILE_ROWS, -(-t // 8))
    for r0 in range(0, t, step):
        r1 = min(t, r0 + step)
        sq[:, r0:r1, :r1] = kernel(probs[:, :, r0:r1, :r1], gram_sym[..., :r1])
    return sq


def _quadratic_norms(probs: Tensor, gram: Tensor, causal: bool) -> Tensor:
    r"""(B, T, T) squared norms alpha_ij^T G_j alpha_ij of the attention parts (diagonal included).

    Float32 layers of at least :data:`QUAD_COMPILE_MIN_ELEMENTS` probabilities and at most
    :data:`QUAD_COMPILE_MAX_HEADS` heads use the compiled kernel :func:`_quadratic_forms_tile` once such layers have spent
    :data:`QUAD_COMPILE_AFTER_SECONDS` in the eager one (or always, with
    :func:`~captum_normattr.decompose.primitives.compiled.use_compiled_kernels`). The eager one works on
    blocks of query rows i, their probabilities laid out (B, C, R, H) once per block so
    that both products read contiguous memory (a block of rows is copied from runs of
    contiguous columns: measured 2-3x faster than blocks of columns on long inputs);
    causal: a block's sources stop at its last row (entries j > i are 0).
    """
    b, h, t = probs.shape[:3]
    large = probs.dtype == torch.float32 and probs.numel() >= QUAD_COMPILE_MIN_ELEMENTS and h <= QUAD_COMPILE_MAX_HEADS
    kernel = compiled.compiled_kernel(_quadratic_forms_tile, large and _EAGER_QUAD_SECONDS[0] >= QUAD_COMPILE_AFTER_SECONDS)
    if kernel is not None:
        try:
            return _fused_quadratic_norms(kernel, probs, gram, causal)
        except Exception as e:  # compilation failed (no C++ compiler, unsupported device, ...)
            compiled.kernel_failed(_quadratic_forms_tile, e)
    start = time.perf_counter()
    sq = probs.new_zeros(b, t, t) if causal else probs.new_empty(b, t, t)
    rows = rows_for_budget(b, t, h, probs.element_size(), GRAM_CHUNK_MB, temporaries=2)
    rows = min(t, max(MIN_TILE_ROWS, min(rows, CACHE_TILE_BYTES // max(1, b * t * h * probs.element_size()))))
    for r0 in range(0, t, rows):
        r1 = min(t, r0 + rows)
        c1 = r1 if causal else t
        mix = probs[:, :, r0:r1, :c1].permute(0, 3, 2, 1).contiguous()  # (B, C, R, H)
        quad = torch.matmul(mix, gram[:, :c1]).mul_(mix).sum(-1)  # (B, C, R): alpha^T G alpha
        sq[:, r0:r1, :c1] = quad.transpose(1, 2)
        del mix, quad
    if large:
        _EAGER_QUAD_SECONDS[0] += time.perf_counter() - start
    return sq


def _squared_part_norms(probs, values: Tensor, w: Tensor, causal: bool) -> Tuple[Tensor, Tensor]:
    r"""(B, T, T) squared norms of the attention parts through ``w`` (diagonal to be replaced) and (B, T, D) the
    attention part of every token in itself: by the Gram algorithm, or, for a hybrid mixer's factored per-channel
    mixing, from its parts in blocks of rows (:func:`~captum_normattr.decompose.primitives.channel_mixing.channel_part_norms_squared`)."""
    if is_channel_mixing(probs):
        return channel_part_norms_squared(probs, values, w, causal)
    gram, attn_diag = _gram_and_diagonal(probs, values, w)
    sq = _quadratic_norms(probs, gram, causal)
    return sq, attn_diag


def _finish_norms(sq: Tensor, diag_sq: Tensor, row_scale: Optional[Tensor]) -> Tensor:
    t = sq.shape[-1]
    idx = torch.arange(t, device=sq.device)
    sq[:, idx, idx] = diag_sq
    if row_scale is not None:
        sq.div_(row_scale.pow(2).unsqueeze(-1))
    return sq.clamp_min_(0).sqrt_()


def part_norms_gram(
    probs: Tensor,
    values: Tensor,
    head_weight: Tensor,
    diagonal_parts: Tensor,
    lin_map: Optional[Tensor] = None,
    row_scale: Optional[Tensor] = None,
    causal: bool = False,
) -> Tensor:
    r"""L2 norms of the parts (sum_h alpha^h_ij f^h(x_j) + [i=j] delta_i) A / s_i.

    Off-diagonal entries are alpha_ij^T G_j alpha_ij with G_j the H x H Gram matrix of
    the vectors f^h(x_j) A; diagonal entries are taken from the explicit diagonal parts
    (which may hold a residual term). Cost O(T H Dh D + T H^2 D + T^2 H^2); no (T, T, D)
    tensor is formed.

    Args:
        probs: (B, H, T, T).
        values: (B, H, T, Dh).
        head_weight: (H, Dh, D).
        diagonal_parts: (B, T, D) the full part of token i in itself, before A.
        lin_map: optional map A: a (D, D) matrix or a
            :class:`~captum_normattr.decompose.primitives.layer_norm.NormLinearMap` (centering and
            gamma scalings of the norms).
        row_scale: optional (B, T) divisor s_i per receiving token.
        causal: the probabilities are lower-triangular: the blocks skip the rows i < j
            (their entries are 0).

    Returns:
        (B, T, T) norms, entry [b, i, j].
    """
    w = head_weight if lin_map is None else head_weight @ lin_map
    sq, _ = _squared_part_norms(probs, values, w, causal)
    diag = diagonal_parts if lin_map is None else diagonal_parts @ lin_map
    return _finish_norms(sq, diag.pow(2).sum(-1), row_scale)


def norm_maps_and_ratios(
    probs: Tensor,
    values: Tensor,
    head_weight: Tensor,
    residual: Tensor,
    total_with_residual: Tensor,
    names: Iterable[str],
    spec: Callable[[str], Tuple[Optional[Tensor], Optional[Tensor], bool]],
    mask2d: Tensor,
    valid: Tensor,
    causal: bool = False,
    total_bias: Optional[Tensor] = None,
) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    r"""Norm maps (Gram algorithm) and Kobayashi mixing ratios for several map definitions.

    Every map is the norm of (sum_h alpha^h_ij f^h(x_j) + [i=j, with residual] residual_i) A / s_i
    for the (A, s, with_residual) that ``spec(name)`` returns; post-LN and pre-LN layers
    differ only in their ``spec`` and in what the residual and the total are. The
    attention part of each token in itself is taken from the Gram blocks' projections
    (no separate product through W_O), and A is applied to vectors only (O(D) per vector
    for a :class:`~captum_normattr.decompose.primitives.layer_norm.NormLinearMap`). Every per-token
    vector (own part, total, their norms and ratio) is worked out in cache-sized blocks of
    tokens (:func:`~captum_normattr.decompose.primitives.chunking.token_blocks`): no (B, T, D)
    temporary is made beyond the own attention parts.

    Args:
        probs: (B, H, T, T); values: (B, H, T, Dh); head_weight: (H, Dh, D).
        residual: (B, T, D) the residual term of token i (its layer input).
        total_with_residual: (B, T, D) sum over j of the parts including the residual
            (bias parts excluded), taken from the real tensors; with ``total_bias``, the
            real tensor that still holds that bias part.
        names: the maps to compute.
        spec: name -> (A (D, D) matrix, NormLinearMap or None, row scale (B, T) or None, with_residual).
        mask2d: (B, T, T) mask applied to every map.
        valid: (B, T) bool.
        causal: lower-triangular probabilities (see :func:`part_norms_gram`).
        total_bias: optional (D,) bias part subtracted from ``total_with_residual`` block by block.

    Returns:
        (maps name -> (B, T, T), ratios name -> (B, T)).
    """
    b, t, d = residual.shape
    flat_res, flat_total = residual.reshape(b * t, d), total_with_residual.reshape(b * t, d)
    maps: Dict[str, Tensor] = {}
    ratios: Dict[str, Tensor] = {}
    for name in names:
        lin, scale, with_res = spec(name)
        w = head_weight if lin is None else head_weight @ lin
        sq, attn_diag = _squared_part_norms(probs, values, w, causal)  # attn_diag: already through A
        flat_diag = attn_diag.view(b * t, d)
        own_sq, ratio = residual.new_empty(b * t), residual.new_empty(b * t)
        for rows in token_blocks(b * t, d * residual.element_size()):  # cache-sized blocks of tokens
            res = flat_res[rows]
            total = flat_total[rows] if total_bias is None else flat_total[rows] - total_bias
            if not with_res:
                total = total - res
            own = flat_diag[rows] + (res if lin is None else res @ lin) if with_res else flat_diag[rows]
            own_sq[rows] = own.pow(2).sum(-1)
            ratio[rows] = mixing_ratio(total if lin is None else total @ lin, own)
        del attn_diag, flat_diag
        maps[name] = _finish_norms(sq, own_sq.view(b, t), scale).mul_(mask2d)
        ratios[name] = ratio.view(b, t) * valid.to(ratio.dtype)
    return maps, ratios
