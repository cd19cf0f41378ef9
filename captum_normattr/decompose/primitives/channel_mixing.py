r"""The per-channel mixing of a hybrid layer's mixer kept factored (docs/linear_mixers.md, "The factored form").

Every mixer the hybrid families record as attention with one head of size 1 per channel (the Gated
DeltaNet, Kimi delta attention, Mamba-2, the gated short convolution, a softmax attention with a
per-channel output gate) has a mixing tensor of one shape:

.. math::

    G[n, t, s] = \gamma_{t,n}\, \rho_{s,n} \sum_{j=0}^{K-1} w_{n,j}\,
                 M_{h(n)}[t, s + \ell_j]\, \sigma_{s + \ell_j, n}, \qquad \ell_j = K - 1 - j,

with :math:`M_h` the per-head token mixing (the delta rule's, the SSD scan's, the softmax
probabilities, or the identity of a short convolution), :math:`w` the causal depthwise
convolution of the values (a single tap of 1 where there is none), :math:`\sigma` the
convolution's activation slope at its output, :math:`\gamma` the per-target scale (the gated
norm, an output gate) and :math:`\rho` the per-source scale (a short convolution's input gate,
the zero of a padding token). Stored as these factors, :class:`ChannelMixing` holds
:math:`O(H T^2 + N T)` numbers where the dense tensor holds :math:`N T^2` (N the channels, 256 to
1024, H the heads, 4 to 16): 16 GiB per layer for 256 channels at 4096 tokens in float32 against
0.5 GiB. The operations the methods need run on the factors:

* :meth:`ChannelMixing.context` :math:`\sum_s G[n,t,s]\, u_{s,n}` and its transpose
  :meth:`ChannelMixing.transposed_context` :math:`\sum_t G[n,t,s]\, y_{t,n}` (DecompX's adjoint):
  one per-head product with :math:`M_h`, :math:`O(T^2 N)`;
* :meth:`ChannelMixing.rows`: a block of rows of G, dense, for the per-pair methods (GlobEnc's
  norms, ALTI's distances), which then take the parts of the block by one matrix product with the
  output projection (:func:`channel_parts_rows`);
* :meth:`ChannelMixing.diagonal`, :meth:`ChannelMixing.truncate`, :meth:`ChannelMixing.select`.

Anything else (a torch function, an index, an attribute of a tensor) is answered on the dense
tensor :meth:`ChannelMixing.dense`, so that no code path gives another number; with
``CAPTUM_NORMATTR_DENSE_MIXING=error`` such a use raises instead (the tests use it to prove that
the methods' paths never build the dense tensor).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["ChannelMixing", "DENSE_MIXING_ENV", "channel_part_distances", "channel_part_norms_squared", "channel_parts_rows",
           "channel_rows_for_budget", "head_mean", "head_rows", "is_channel_mixing"]

#: ``error``: any use of a :class:`ChannelMixing` that needs its dense tensor raises (tests); unset: it is built
DENSE_MIXING_ENV = "CAPTUM_NORMATTR_DENSE_MIXING"
#: bytes of one block of dense rows (B, R, S, N) and of its parts (B, R, S, D) that the per-pair paths aim at
ROW_BLOCK_BYTES = 64 * 2**20


def is_channel_mixing(probs: Any) -> bool:
    r"""Whether ``probs`` is a :class:`ChannelMixing` (a hybrid mixer's factored mixing) rather than a tensor."""
    return isinstance(probs, ChannelMixing)


def channel_rows_for_budget(batch: int, sources: int, width: int, element_size: int,
                            budget: Optional[int] = None) -> int:
    r"""Rows per block so that a (B, R, S, width) block takes about ``budget`` bytes (default :data:`ROW_BLOCK_BYTES`)."""
    budget = ROW_BLOCK_BYTES if budget is None else budget
    return max(1, budget // max(1, batch * sources * width * element_size))


@dataclass
class ChannelMixing:
    r"""A mixer's per-channel mixing tensor G (B, N, T, T) kept as its factors (see the module docstring).

    Args:
        mixing: (B, H, T, T) the per-head token mixing :math:`M_h`, or None for the identity (a
            short convolution: G is then banded, K non-zero diagonals).
        head_ranges: per head h, the channel range [n0, n1) it serves (a channel may appear in
            several ranges of the same head: Mamba-2's convolution-bias heads repeat the channels).
        conv_weight: (N, K) the depthwise kernel on each channel, tap K - 1 on the current token.
        slope: (B, T, N) :math:`\sigma`, the convolution's activation slope at its output, or None (ones).
        target_scale: (B, T, N) :math:`\gamma`, or None (ones).
        source_scale: (B, T, N) :math:`\rho`, or None (ones).
        columns: only the sources s < columns are kept (None: all T); rows are unchanged.

    Examples::

        >>> g = ChannelMixing(None, [(0, 0, 2)], torch.ones(2, 1), None, torch.full((1, 3, 2), 2.0), None)
        >>> g.shape, g.diagonal()[0, 0].tolist()
        (torch.Size([1, 2, 3, 3]), [2.0, 2.0, 2.0])
    """

    mixing: Optional[Tensor]
    head_ranges: List[Tuple[int, int, int]]
    conv_weight: Tensor
    slope: Optional[Tensor]
    target_scale: Optional[Tensor]
    source_scale: Optional[Tensor]
    columns: Optional[int] = None

    #: no version counter (a fresh object built from the recorded tensors; the recorder's checks skip it)
    _version = None

    # ----------------------------------------------------------------- shape
    def _batch_and_tokens(self) -> Tuple[int, int]:
        for t in (self.slope, self.target_scale, self.source_scale):
            if t is not None:
                return t.shape[0], t.shape[1]
        if self.mixing is not None:
            return self.mixing.shape[0], self.mixing.shape[2]
        raise ValueError("the mixing has no token count: give mixing, slope, target_scale or source_scale")

    @property
    def shape(self) -> torch.Size:
        r"""(B, N, T, S) as the dense tensor's."""
        b, t = self._batch_and_tokens()
        return torch.Size((b, self.conv_weight.shape[0], t, t if self.columns is None else self.columns))

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.conv_weight.device

    @property
    def ndim(self) -> int:
        return 4

    def dim(self) -> int:
        return 4

    def size(self, dim: Optional[int] = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def element_size(self) -> int:
        return self.conv_weight.element_size()

    @property
    def kernel(self) -> int:
        return self.conv_weight.shape[1]

    # ----------------------------------------------------------------- conversions
    def _map(self, fn, per_token: Optional[Any] = None) -> "ChannelMixing":
        r"""``fn`` applied to every factor; with ``per_token``, that function to the per-example factors instead
        (M (B, H, T, T) and the (B, T, N) scales) and the kernel kept."""
        tok = fn if per_token is None else per_token
        opt = lambda t: None if t is None else tok(t)
        return replace(self, mixing=opt(self.mixing), slope=opt(self.slope), target_scale=opt(self.target_scale),
                       source_scale=opt(self.source_scale),
                       conv_weight=self.conv_weight if per_token is not None else fn(self.conv_weight))

    def to(self, *args: Any, **kwargs: Any) -> "ChannelMixing":
        r"""The factors moved or cast as :meth:`torch.Tensor.to` (floating factors only)."""
        return self._map(lambda t: t.to(*args, **kwargs))

    def cpu(self) -> "ChannelMixing":
        return self.to("cpu")

    def double(self) -> "ChannelMixing":
        return self.to(torch.float64)

    def float(self) -> "ChannelMixing":
        return self.to(torch.float32)

    def detach(self) -> "ChannelMixing":
        return self._map(lambda t: t.detach())

    def contiguous(self) -> "ChannelMixing":
        return self

    def clone(self) -> "ChannelMixing":
        return self._map(lambda t: t.clone())

    def select(self, index: Tensor) -> "ChannelMixing":
        r"""The examples ``index`` (a (B',) long tensor or a slice) of the batch."""
        return self._map(None, per_token=lambda t: t[index])

    def truncate(self, length: int) -> "ChannelMixing":
        r"""The mixing of the first ``length`` tokens alone (exact for a causal mixer: earlier tokens see no later one)."""
        if self.columns is not None:
            raise ValueError("truncate a mixing whose columns are not restricted")

        return self._map(None, per_token=lambda t: t[:, :, :length, :length] if t is self.mixing else t[:, :length])

    def with_columns(self, columns: int) -> "ChannelMixing":
        r"""The same rows restricted to the sources s < ``columns`` (``probs[..., :columns]``)."""
        return replace(self, columns=min(columns, self.shape[2]) if self.columns is None else min(columns, self.columns))

    def scale_sources(self, scale: Tensor) -> "ChannelMixing":
        r"""G[n, t, s] scale[b, s]: ``probs * scale[:, None, None, :]`` (scale (B, T))."""
        s = scale[..., None].to(self.dtype)
        src = s.expand(*s.shape[:2], self.shape[1]) if self.source_scale is None else self.source_scale * s
        return replace(self, source_scale=src)

    # ----------------------------------------------------------------- the factors applied
    def _convolved(self, x: Tensor, transpose: bool = False) -> Tensor:
        r"""V[s', n] = sigma[s', n] sum_j w[n, j] (rho x)[s' - l_j, n] for x (..., B, T, N) source-indexed; with
        ``transpose``, its transpose out[s, n] = rho[s, n] sum_j w[n, j] (sigma x)[s + l_j, n]."""
        before, after = (self.slope, self.source_scale) if transpose else (self.source_scale, self.slope)
        if before is not None:
            x = x * before
        k, t = self.kernel, x.shape[-2]
        out = x * self.conv_weight[:, k - 1]
        for j in range(k - 1):
            lag = k - 1 - j
            if lag < t:
                if transpose:  # source s reads the convolution outputs at s + lag
                    out[..., : t - lag, :] += x[..., lag:, :] * self.conv_weight[:, j]
                else:  # output s' reads the sources at s' - lag
                    out[..., lag:, :] += x[..., : t - lag, :] * self.conv_weight[:, j]
        return out * after if after is not None else out

    def _per_head(self, x: Tensor, transpose: bool) -> Tensor:
        r"""out[..., n] = M_{h(n)} x[..., n] (or M^T) over the token axis, x (..., B, T, N)."""
        if self.mixing is None:
            return x
        out = torch.zeros_like(x)
        m = self.mixing
        for h, n0, n1 in self.head_ranges:
            mh = m[:, h].transpose(-1, -2) if transpose else m[:, h]  # (B, T, T)
            out[..., n0:n1] += mh @ x[..., n0:n1]
        return out

    def _check_columns(self) -> None:
        if self.columns is not None:
            raise ValueError("apply the mixing of all sources (its columns are restricted)")

    def context(self, values: Tensor) -> Tensor:
        r""":math:`\sum_s G[n, t, s]\, u_{s,n}`: the mixer's output before its projection.

        Args:
            values: (B, N, T, 1) as the recorded values (or (B, T, N)).

        Returns:
            The same layout as ``values``.

        Examples::

            >>> g = ChannelMixing(None, [(0, 0, 2)], torch.tensor([[0.5, 1.0]] * 2), None, None, torch.ones(1, 3, 2))
            >>> g.context(torch.ones(1, 3, 2))[0, :, 0].tolist()
            [1.0, 1.5, 1.5]
        """
        self._check_columns()
        token_major = values.dim() == 3
        u = values if token_major else values[..., 0].transpose(1, 2)
        out = self._per_head(self._convolved(u.to(self.dtype)), transpose=False)
        if self.target_scale is not None:
            out = out * self.target_scale
        return out if token_major else out.transpose(1, 2).unsqueeze(-1)

    def transposed_context(self, cotangent: Tensor) -> Tensor:
        r""":math:`\sum_t G[n, t, s]\, y_{t,n}`, the transpose of :meth:`context`.

        Args:
            cotangent: (..., B, T, N) per target (leading stack dimensions allowed).

        Returns:
            (..., B, T, N) per source.
        """
        self._check_columns()
        y = cotangent * self.target_scale if self.target_scale is not None else cotangent
        return self._convolved(self._per_head(y, transpose=True), transpose=True)

    def diagonal(self) -> Tensor:
        r"""G[n, t, t], (B, N, T)."""
        b, n, t, _ = self.shape
        k = self.kernel
        acc = self.conv_weight.new_zeros(b, t, n)
        for j in range(k):
            lag = k - 1 - j
            if lag >= t:
                continue
            # M_h[t, t + lag] sigma[t + lag] for t < T - lag
            sig = self.slope[:, lag:] if self.slope is not None else None
            if self.mixing is None:
                if lag:
                    continue  # the identity has no off-diagonal entry
                band = acc.new_ones(b, t, n)
            else:
                band = acc.new_zeros(b, t - lag, n)
                for h, n0, n1 in self.head_ranges:
                    band[..., n0:n1] += torch.diagonal(self.mixing[:, h], offset=lag, dim1=-2, dim2=-1)[..., None]
            term = band * self.conv_weight[:, j] if sig is None else band * sig * self.conv_weight[:, j]
            acc[:, : t - lag] += term
        if self.target_scale is not None:
            acc = acc * self.target_scale
        if self.source_scale is not None:
            acc = acc * self.source_scale
        return acc.transpose(1, 2)

    def rows(self, start: int, stop: int, sources: Optional[int] = None,
             source_factor: Optional[Tensor] = None, first: int = 0) -> Tensor:
        r"""Rows [start, stop) of G, dense and token-major: (B, R, S, N), entry [b, r, s, n] = G[n, start + r, first + s].

        Args:
            start, stop: the target rows.
            sources: only the sources s < ``sources`` (default: all, or :attr:`columns`).
            source_factor: (B, S', N) with S' >= ``sources``, a factor per source and channel multiplied in (the
                values, for the parts: folded into the per-source coefficients, no pass over the block).
            first: only the sources s >= ``first`` (a banded mixing's block needs a few).

        Returns:
            (B, R, S, N) with S = ``sources - first``.
        """
        b, n, t, s_all = self.shape
        s = s_all if sources is None else min(sources, s_all)
        first = max(0, min(first, s))
        r = stop - start
        per_source = self.source_scale[:, first:s] if self.source_scale is not None else None
        if source_factor is not None:
            f = source_factor[:, first:s].to(self.dtype)
            per_source = f if per_source is None else per_source * f
        out = self.conv_weight.new_zeros(b, r, s - first, n)
        k = self.kernel
        size = self._uniform_range_size()
        for j in range(k):
            lag = k - 1 - j
            width = min(s, t - lag) - first  # sources first <= s' < first + width with s' + lag < T
            if width <= 0:
                continue
            coef = self.conv_weight[:, j].expand(b, width, n)  # w[n, j] sigma[s + lag, n] rho[s, n] f[s, n]
            if self.slope is not None:
                coef = coef * self.slope[:, first + lag: first + lag + width]
            if per_source is not None:
                coef = coef * per_source[:, :width]
            if self.mixing is None:  # identity: target t reads source t - lag only
                tgt = torch.arange(start, stop, device=out.device)
                src = tgt - lag - first
                ok = (src >= 0) & (src < width)
                rr, ss = (tgt - start)[ok], src[ok]
                out[:, rr, ss] += coef[:, ss]
                continue
            coef = coef.unsqueeze(1)  # (B, 1, width, N)
            cols = slice(first + lag, first + lag + width)
            if size:  # ranges of one size tiling the channels in order: one product over all of them
                heads = [h for h, _, _ in self.head_ranges]
                m = self.mixing[:, :, start:stop, cols]
                m = m if heads == list(range(m.shape[1])) else m[:, heads]
                m = m.permute(0, 2, 3, 1).contiguous().unsqueeze(-1)  # (B, R, width, ranges, 1)
                out[:, :, :width].view(b, r, width, -1, size).addcmul_(m, coef.view(b, 1, width, -1, size))
                continue
            for h, n0, n1 in self.head_ranges:
                m = self.mixing[:, h, start:stop, cols].unsqueeze(-1)  # (B, R, width, 1)
                out[:, :, :width, n0:n1].addcmul_(m, coef[..., n0:n1])
        if self.target_scale is not None:
            out.mul_(self.target_scale[:, start:stop, None, :])
        return out

    def _uniform_range_size(self) -> int:
        r"""The size of every channel range when they tile [0, N) in order with one size, else 0."""
        size = self.head_ranges[0][2] - self.head_ranges[0][1] if self.head_ranges else 0
        ok = size > 0 and all(n0 == i * size and n1 == n0 + size for i, (_, n0, n1) in enumerate(self.head_ranges))
        return size if ok and size * len(self.head_ranges) == self.conv_weight.shape[0] else 0

    def dense(self) -> Tensor:
        r"""The dense tensor (B, N, T, S): for uses no factored path covers (raises under ``DENSE_MIXING_ENV=error``)."""
        if os.environ.get(DENSE_MIXING_ENV, "") == "error":
            raise RuntimeError(f"the dense per-channel mixing was requested ({DENSE_MIXING_ENV}=error)")
        t = self.shape[2]
        return self.rows(0, t).permute(0, 3, 1, 2).contiguous()

    def mean_over_heads(self) -> Tensor:
        r"""(B, T, S) the mean of G over its channels (the ``W`` map), in blocks of rows."""
        b, n, t, s = self.shape
        out = self.conv_weight.new_empty(b, t, s)
        step = channel_rows_for_budget(b, s, n, self.element_size())
        for r0 in range(0, t, step):
            out[:, r0: r0 + step] = self.rows(r0, min(t, r0 + step)).mean(-1)
        return out

    # ----------------------------------------------------------------- the dense fallback
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        densify = lambda a: a.dense() if isinstance(a, ChannelMixing) else (
            type(a)(densify(x) for x in a) if isinstance(a, (list, tuple)) else a)
        return func(*densify(args), **{k: densify(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ChannelMixing.__dataclass_fields__:
            raise AttributeError(name)
        return getattr(self.dense(), name)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, tuple) and len(key) == 2 and key[0] is Ellipsis and isinstance(key[1], slice) \
                and key[1].start in (None, 0) and key[1].step in (None, 1) and key[1].stop is not None:
            return self.with_columns(key[1].stop)
        return self.dense()[key]

    def __mul__(self, other: Any) -> Any:
        return self.dense() * other

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Any:
        return self.dense() / other


def channel_parts_rows(mixing: ChannelMixing, values: Tensor, weight: Tensor, start: int, stop: int,
                       sources: Optional[int] = None, first: int = 0) -> Tensor:
    r"""The parts :math:`\sum_n G[n, t, s]\, u_{s,n} W[n, :]` of targets [start, stop): (B, R, S, D).

    One dense block of rows (:meth:`ChannelMixing.rows`) times the values, then one matrix product
    with the projection: :math:`O(R S N D)` in a BLAS product, no (N, T, D) tensor.

    Args:
        mixing: the factored mixing.
        values: (B, N, T, 1) the recorded values (head size 1).
        weight: (N, D) the output projection (times any linear map), or (N, 1, D).
        start, stop: the target rows.
        sources: only the sources s < ``sources`` (default: all).
        first: only the sources s >= ``first``.

    Returns:
        (B, R, S, D), S = ``sources - first``.
    """
    block = mixing.rows(start, stop, sources, values[..., 0].transpose(1, 2), first)  # (B, R, S, N), G u
    w = weight.reshape(weight.shape[0], weight.shape[-1]) if weight.dim() == 3 else weight
    return block @ w.to(block.dtype)


def head_rows(probs: Any, rows: Any) -> Tensor:
    r"""Rows of attention probabilities as a dense (B, H, R, S) tensor, for a tensor or a :class:`ChannelMixing`.

    Args:
        probs: (B, H, T, S) probabilities or a factored mixing.
        rows: a slice or an (R,) long tensor of target rows.

    Returns:
        (B, H, R, S): ``probs[:, :, rows]`` (for a factored mixing, only the block from the first to the last
        row is built).
    """
    if not is_channel_mixing(probs):
        return probs[:, :, rows]
    t = probs.shape[2]
    if isinstance(rows, slice):
        start, stop, step = rows.indices(t)
        return probs.rows(start, stop).permute(0, 3, 1, 2)[:, :, ::step]
    if rows.numel() == 0:
        return probs.conv_weight.new_zeros(probs.shape[0], probs.shape[1], 0, probs.shape[3])
    lo, hi = int(rows.min()), int(rows.max()) + 1
    if hi - lo <= 2 * rows.numel():  # about as many rows as asked: one block
        return probs.rows(lo, hi).permute(0, 3, 1, 2)[:, :, rows.to(probs.device) - lo]
    return torch.cat([probs.rows(r, r + 1) for r in rows.tolist()], dim=1).permute(0, 3, 1, 2)  # scattered rows


#: target rows per block of a banded mixing (a short convolution): its sources are the block's and the K - 1 before
BAND_BLOCK_ROWS = 32


def _block_rows(mixing: ChannelMixing, width: int, causal: bool):
    r"""(start, stop, first, sources) of the blocks of target rows the per-pair paths walk: the sources
    [first, sources) that can have a non-zero part (a short convolution's banded mixing: the K - 1 before the block)."""
    b, n, t, s_all = mixing.shape
    band = mixing.mixing is None
    step = BAND_BLOCK_ROWS if band else channel_rows_for_budget(b, s_all, n + width, mixing.element_size())
    step = min(t, max(step, 1))
    for r0 in range(0, t, step):
        r1 = min(t, r0 + step)
        first = max(0, r0 - mixing.kernel + 1) if band else 0
        yield r0, r1, first, (min(r1, s_all) if causal or band else s_all)


def channel_part_norms_squared(mixing: ChannelMixing, values: Tensor, weight: Tensor, causal: bool) -> Tuple[Tensor, Tensor]:
    r"""Squared norms of the mixer's parts through ``weight`` and every token's part in itself.

    GlobEnc's norms for a per-channel mixing: the Gram algorithm of softmax attention forms an N x N
    matrix per token (N the channels), so the parts are formed instead, in blocks of rows
    (:func:`channel_parts_rows`), O(T^2 N D) in BLAS products and O(block) memory.

    Args:
        mixing: the factored mixing (B, N, T, T).
        values: (B, N, T, 1).
        weight: (N, 1, D) or (N, D): the output projection times any linear map.
        causal: only the sources s <= t are formed (the others are 0).

    Returns:
        ``(sq, own)``: (B, T, T) squared norms of sum_n G[n, t, s] u_{s,n} W[n] (0 where not formed) and
        (B, T, D) the part of every token in itself.
    """
    b, _, t, s_all = mixing.shape
    w = weight.reshape(weight.shape[0], weight.shape[-1]) if weight.dim() == 3 else weight
    sq = w.new_zeros(b, t, s_all)
    for r0, r1, first, s in _block_rows(mixing, w.shape[-1], causal):
        sq[:, r0:r1, first:s] = channel_parts_rows(mixing, values, w, r0, r1, s, first).pow_(2).sum(-1)
    u = values[..., 0].transpose(1, 2).to(w.dtype)  # (B, T, N)
    own = (mixing.diagonal().transpose(1, 2) * u) @ w
    return sq, own


def channel_part_distances(mixing: ChannelMixing, values: Tensor, weight: Tensor, residual: Optional[Tensor],
                           target: Tensor, causal: bool) -> Tensor:
    r"""ALTI's distances :math:`|y_t - \mathrm{part}_{t \leftarrow s}|_1` for a per-channel mixing, in blocks of rows.

    Args:
        mixing: the factored mixing (B, N, T, T).
        values: (B, N, T, 1).
        weight: (N, 1, D) or (N, D) the output projection (times any linear map).
        residual: (B, T, D) the residual term added to every token's part in itself, or None.
        target: (B, T, D) the vectors y_t the parts are measured against.
        causal: only the sources s <= t are formed (the distances of the others are left 0).

    Returns:
        (B, T, T) the distances.
    """
    b, _, t, s_all = mixing.shape
    w = weight.reshape(weight.shape[0], weight.shape[-1]) if weight.dim() == 3 else weight
    dist = target.new_zeros(b, t, s_all)
    for r0, r1, first, s in _block_rows(mixing, w.shape[-1], causal):
        parts = channel_parts_rows(mixing, values, w, r0, r1, s, first)  # (B, R, S, D)
        lo, hi = max(r0, first), min(r1, s)
        if residual is not None and lo < hi:
            idx = torch.arange(lo, hi, device=parts.device)
            parts[:, idx - r0, idx - first] += residual[:, lo:hi].to(parts.dtype)
        dist[:, r0:r1, first:s] = parts.sub_(target[:, r0:r1, None, :]).abs_().sum(-1)
        if first or (not causal and s < s_all):  # sources out of the band: a zero part, at distance |y_t|_1
            y1 = target[:, r0:r1].abs().sum(-1, keepdim=True)
            dist[:, r0:r1, :first] = y1
            if not causal:
                dist[:, r0:r1, s:] = y1
    return dist


def head_mean(probs: Any) -> Tensor:
    r"""(B, T, S) the mean of the probabilities over the heads (the ``W`` map), for a tensor or a :class:`ChannelMixing`."""
    return probs.mean_over_heads() if is_channel_mixing(probs) else probs.mean(1)
