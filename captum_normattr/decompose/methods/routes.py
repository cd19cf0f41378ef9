r"""Information-flow routes (Ferrando and Voita 2024): edge importances and top-down pruning.

Pure math on recorded layer tensors (docs/routes.md). A pre-LN layer l has, at every
position i, three residual-stream states (nodes): its input x_{l,i} (x_{0,i} the embedding),
the state after attention m_{l,i} = h_i (the real LN2 input) and its output x_{l+1,i}.
The edges into a node are the additive pieces of the node's real vector y:

* into m_{l,i} (y = h_i): the residual x_{l,i} (from x_{l,i}) and, for every head h and
  source j, alpha^h_ij f^h(LN1(x_{l,j})) (from x_{l,j}); b_O is inside y but is no edge;
* into x_{l+1,i} (y = the real layer output): the residual h_i and the FF output FF(LN2(h_i))
  (both from m_{l,i}; the FF edge passes through the FF node of (l, i)).

Other layer kinds give their own edge vectors (:class:`~captum_normattr.decompose.kinds.base.LayerKind`'s
route hooks): a sandwich layer's post-norms frozen at their real per-token scale, a parallel layer's
FF edge from x_{l,i} (its FF block reads the layer input), docs/routes.md.

The importance of edge e with vector c_e into a node with total y is its proximity, normalised
over every edge into that node:

    prox(c_e, y) = max(0, |y|_1 - |y - c_e|_1),    importance_e = prox(c_e, y) / sum_e' prox(c_e', y)

Per-head parts are formed only for the rows asked for, in cache-sized tiles (or fused by a
compiled kernel): never a (T, T, H, D) tensor.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.channel_mixing import head_rows, is_channel_mixing
from captum_normattr.decompose.primitives import compiled
from captum_normattr.decompose.primitives.attention import project_values
from captum_normattr.decompose.records import LayerTensors

__all__ = [
    "EDGE_KINDS",
    "GRANULARITIES",
    "LEAF_EDGES",
    "OUTPUT_EDGES",
    "PrunedRoutes",
    "ROUTES_COMPILE_AFTER_SECONDS",
    "ROUTES_MEMORY_BUDGET_MB",
    "ROUTES_TILE_BYTES",
    "attention_edge_importances",
    "ff_edge_importances",
    "head_importance_totals",
    "head_part_distances",
    "node_id",
    "output_edge_importances",
    "proximity",
    "prune_routes",
]

#: Default memory budget (MB) that sizes the chunks of kept rows (their parts (R, H, T, D) would fit it).
ROUTES_MEMORY_BUDGET_MB = 128.0
#: Seconds the eager per-head distance kernel may take in a process before the compiled one replaces
#: it by default (float32 only; see :func:`head_part_distances`).
ROUTES_COMPILE_AFTER_SECONDS = 10.0
_EAGER_SECONDS = [0.0]
#: Bytes of one tile of the eager per-head distance kernel (one row, all heads, a block of sources).
ROUTES_TILE_BYTES = 2**20
#: Edge kinds of a route graph.
EDGE_KINDS: Tuple[str, ...] = ("residual", "head", "attention", "ff", "per_layer_input", "own_addition")
#: Edges into a layer output x_{l+1,i} that come from a leaf p_{l,i}, token i's own input to the layer: Gemma 4's
#: per-layer input, and a vector the model adds to token i's stream after the layer (Qwen3-VL's DeepStack feature).
LEAF_EDGES: Tuple[str, ...] = ("per_layer_input", "own_addition")
#: The edges into a layer output x_{l+1,i} of a pre-LN layer (:func:`ff_edge_importances`'s columns).
OUTPUT_EDGES: Tuple[str, ...] = ("residual", "ff")


def proximity(parts: Tensor, total: Tensor) -> Tensor:
    r"""max(0, |y|_1 - |y - c|_1) of every part c of a total y.

    Args:
        parts: (..., N, D) the part vectors of each total.
        total: (..., D) the totals y.

    Returns:
        (..., N).
    """
    return (total.abs().sum(-1, keepdim=True) - (total.unsqueeze(-2) - parts).abs().sum(-1)).clamp_min(0)


def _normalise(*proxes: Tensor) -> Tuple[Tensor, ...]:
    r"""Divide every proximity tensor (N, ...) by the per-row sum over all of them (0 where it is 0)."""
    total = sum(p.reshape(p.shape[0], -1).sum(-1) for p in proxes)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = []
    for p in proxes:
        shape = (p.shape[0],) + (1,) * (p.dim() - 1)
        out.append(torch.where(total.view(shape) > 0, p / safe.view(shape), torch.zeros_like(p)))
    return tuple(out)


def output_edge_importances(parts: Tensor, layer_out: Tensor) -> Tensor:
    r"""Importances of the E edges into every layer output x_{l+1,i}, from their vectors.

    Args:
        parts: (..., T, E) D-vectors, (..., T, E, D): the pieces of the layer output, in the order of the
            layer kind's :meth:`~captum_normattr.decompose.kinds.base.LayerKind.route_output_edges`
            (a pre-LN layer: the residual h_i and the FF output).
        layer_out: (..., T, D) the real layer output (their sum).

    Returns:
        (..., T, E); each row sums to 1 (or is 0).
    """
    prox = proximity(parts, layer_out)  # (..., T, E)
    s = prox.sum(-1, keepdim=True)
    return torch.where(s > 0, prox / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(prox))


def ff_edge_importances(mid: Tensor, ff_out: Tensor, layer_out: Tensor) -> Tensor:
    r"""Importances of the two edges into every layer output x_{l+1,i}: residual h_i and FF block.

    Args:
        mid: (..., T, D) the state after attention h_i (the real LN2 input).
        ff_out: (..., T, D) the real FF output.
        layer_out: (..., T, D) the real layer output (= mid + ff_out).

    Returns:
        (..., T, 2): [..., i, 0] residual, [..., i, 1] FF; each row sums to 1 (or is 0).
    """
    return output_edge_importances(torch.stack([mid, ff_out], -2), layer_out)


def attention_edge_importances(
    layer: LayerTensors,
    rows: Tensor,
    valid: Tensor,
    example: int = 0,
    memory_budget_mb: float = ROUTES_MEMORY_BUDGET_MB,
    projected: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    r"""Importances of every edge into the after-attention states m_{l,i} of the given rows.

    Edges into m_{l,i}: the residual x_{l,i} and, per head h and source j, the part
    alpha^h_ij f^h(LN1(x_{l,j})), against the real total y = h_i (b_O inside y, no edge).
    Rows are taken in chunks of R rows whose parts (R, H, C, D) (C the sources up to the
    chunk's last row, causal, or all T) would fit ``memory_budget_mb``; the parts themselves
    are never formed for a whole chunk (:func:`head_part_distances`: cache-sized tiles, or a
    fused compiled kernel).

    Args:
        layer: the layer's tensors (pre-LN).
        rows: (K,) long positions i (in the padded tensor) of one example.
        valid: (B, T) bool, real tokens.
        example: the example (batch index) the rows belong to.
        memory_budget_mb: sizes the chunks of rows (see above), in MB.
        projected: optional (B, H, T, D) values through W_O^h (:func:`project_values`), reused.

    Returns:
        (heads (K, H, T), residual (K,)): importances, summing to 1 over heads, sources and the
        residual for every row (0 where every proximity is 0); pad sources and, for causal
        layers, sources j > i are exactly 0.
    """
    if rows.numel() == 0:
        h, t = layer.probs.shape[1], layer.probs.shape[-1]
        return layer.hidden_in.new_zeros(0, h, t), layer.hidden_in.new_zeros(0)
    b = example
    if projected is None:
        projected = project_values(layer.values[b : b + 1], layer.head_out_weight())
        pb = 0
    else:
        pb = b
    _, n_heads, t, d = projected.shape
    total = layer.ln2_in[b]  # h_i, the real LN2 input (b_O inside)
    resid = layer.hidden_in[b]
    item = projected.element_size()
    per_row = max(1, n_heads * t * d * item)
    chunk = max(1, int(memory_budget_mb * 2**20 // per_row))
    srcmask = valid[b].to(projected.dtype)
    heads_out = layer.hidden_in.new_zeros(rows.numel(), n_heads, t)
    resid_prox = layer.hidden_in.new_zeros(rows.numel())
    order = torch.argsort(rows)
    sorted_rows = rows[order]
    for c0 in range(0, rows.numel(), chunk):
        sel = order[c0 : c0 + chunk]
        r = sorted_rows[c0 : c0 + chunk]
        cols = int(r.max()) + 1 if layer.causal else t
        one = layer.probs.select(slice(b, b + 1)) if is_channel_mixing(layer.probs) else layer.probs[b:b + 1]
        alpha = head_rows(one, r)[0, :, :, :cols].transpose(0, 1)  # (R, H, C)
        y = total[r]  # (R, D)
        dist = head_part_distances(alpha, projected[pb, :, :cols], y)  # (R, H, C)
        prox = (y.abs().sum(-1)[:, None, None] - dist).clamp_min_(0)
        prox = prox * srcmask[:cols]
        if layer.causal:
            prox = prox * (torch.arange(cols, device=r.device)[None, :] <= r[:, None]).to(prox.dtype).unsqueeze(1)
        heads_out[sel, :, :cols] = prox
        resid_prox[sel] = proximity(resid[r].unsqueeze(-2), y).squeeze(-1)
    heads_out, resid_imp = _normalise(heads_out, resid_prox)
    return heads_out, resid_imp


def _head_part_distances_fused(alpha: Tensor, projected: Tensor, y: Tensor) -> Tensor:
    r"""|y_r - alpha[r, h, c] projected[h, c]|_1 as one expression (compiled: no part is written out)."""
    return (alpha.unsqueeze(-1) * projected.unsqueeze(0) - y[:, None, None, :]).abs().sum(-1)


def head_part_distances(alpha: Tensor, projected: Tensor, y: Tensor) -> Tensor:
    r"""L1 distances |y_r - alpha^h_rc f^h_c|_1 of every per-head part of a chunk of rows to the row's total.

    Eager: the parts are formed in cache-sized tiles (:data:`ROUTES_TILE_BYTES`: one row, every
    head, a block of sources) in one reused buffer and reduced in place. A compiled
    kernel (``torch.compile`` via :mod:`~captum_normattr.decompose.primitives.compiled`) fuses product,
    difference and sum so that no part is written out (several times faster than the eager tiles for many rows in float32);
    its compilation costs about 10 s once per process, so by default it is bought only after
    the eager kernel has cost :data:`ROUTES_COMPILE_AFTER_SECONDS` in this process, and only for
    float32 (a rent-or-buy rule, as for the attention quadratic forms, docs/performance.md).
    ``CAPTUM_NORMATTR_COMPILE=0`` / ``=1`` (or :func:`~captum_normattr.decompose.primitives.compiled.use_compiled_kernels`)
    fixes the choice. The two agree to float32 rounding.

    Args:
        alpha: (R, H, C) the probabilities of the rows' queries on the C sources.
        projected: (H, C, D) the sources' values through W_O^h.
        y: (R, D) the rows' totals.

    Returns:
        (R, H, C).
    """
    wanted = alpha.dtype == torch.float32 and _EAGER_SECONDS[0] >= ROUTES_COMPILE_AFTER_SECONDS
    kernel = compiled.compiled_kernel(_head_part_distances_fused, wanted)
    if kernel is not None:
        try:
            return kernel(alpha, projected, y)
        except Exception as e:  # compilation failed (no C++ compiler, unsupported device, ...)
            compiled.kernel_failed(_head_part_distances_fused, e)
    t0 = time.perf_counter()
    n_rows, n_heads, n_src = alpha.shape
    d = projected.shape[-1]
    # cache-sized tiles (one row, every head, a block of sources) in one reused buffer: the
    # product, difference, abs and sum then run on data still in cache (measured 5x faster than
    # forming a row chunk's parts at once, and bitwise the same)
    nc = max(1, ROUTES_TILE_BYTES // max(1, n_heads * d * projected.element_size()))
    out = alpha.new_empty(n_rows, n_heads, n_src)
    buf = projected.new_empty(n_heads * min(nc, n_src) * d)
    for r in range(n_rows):
        yr = y[r]
        for c0 in range(0, n_src, nc):
            c1 = min(n_src, c0 + nc)
            part = buf[: n_heads * (c1 - c0) * d].view(n_heads, c1 - c0, d)
            torch.mul(projected[:, c0:c1], alpha[r, :, c0:c1, None], out=part)
            torch.sum(part.sub_(yr).abs_(), -1, out=out[r, :, c0:c1])
    _EAGER_SECONDS[0] += time.perf_counter() - t0
    return out


def node_id(kind: str, layer: int, position: int) -> str:
    r"""Node name: ``x{l}_{i}`` (input of layer l; ``x{L}_{i}`` the final state), ``m{l}_{i}``
    (after the attention of layer l), ``f{l}_{i}`` (the FF block of layer l) or ``p{l}_{i}``
    (token i's own input to the output of layer l, a leaf whose flow is token i's: Gemma 4's per-layer-input branch,
    Qwen3-VL's DeepStack addition)."""
    return f"{kind}{layer}_{position}"


@dataclass
class PrunedRoutes:
    r"""The nodes and edges kept by :func:`prune_routes`.

    Attributes:
        nodes: dicts ``id``, ``kind`` (``"x"``, ``"m"``, ``"f"`` or ``"p"``), ``layer``, ``position``.
        edges: dicts ``source``, ``target``, ``kind`` (``"residual"``, ``"head"``, ``"attention"``, ``"ff"``,
            ``"per_layer_input"``, ``"own_addition"``), ``layer``, ``head`` (None unless a head edge), ``source_position``,
            ``target_position``, ``importance``.
        rows_per_layer: number of after-attention rows whose head importances were computed.
    """

    nodes: List[Dict] = field(default_factory=list)
    edges: List[Dict] = field(default_factory=list)
    rows_per_layer: List[int] = field(default_factory=list)


#: Granularities of the attention edges: one edge per head and source, or per source (heads summed).
GRANULARITIES: Tuple[str, ...] = ("head", "token")


def prune_routes(
    num_layers: int,
    position: int,
    threshold: float,
    ff_importances: Callable[[int], Tensor],
    attention_importances: Callable[[int, Tensor], Tuple[Tensor, Tensor]],
    granularity: str = "head",
    output_edges: Callable[[int], Sequence[str]] = lambda l: OUTPUT_EDGES,
    value_layer: Callable[[int], int] = lambda l: l,
    ff_reads_input: Callable[[int], bool] = lambda l: False,
) -> PrunedRoutes:
    r"""Top-down pruning: from the final state x_{L,i}, keep every incoming edge with importance >= tau.

    For l = L-1, ..., 0: for every kept output x_{l+1,k}, the residual edge (from m_{l,k}) and
    the FF edge (m_{l,k} -> FF node -> x_{l+1,k}; x_{l,k} -> FF node -> x_{l+1,k} where the FF block
    reads the layer input, ``ff_reads_input``) are kept where their importance is >= tau
    (and > 0); a kept edge keeps its source (a :data:`LEAF_EDGES` edge's source is the leaf
    p_{l,k}). Then for every kept m_{l,k} the residual edge from x_{l,k} and every head edge
    from x_{l',j} with importance >= tau are kept, keeping their sources; l' = ``value_layer(l)``
    is the layer whose input the values of layer l are computed from (l itself, or, where a layer
    reuses an earlier layer's keys and values, that earlier layer: the edge skips the layers
    between). A kept node whose incoming edges are all below tau ends its route.

    Args:
        num_layers: L.
        position: the explained position i.
        threshold: tau.
        ff_importances: ``l -> (T, E)`` the importance of every edge into every output of layer l,
            in the order of ``output_edges(l)`` (:func:`output_edge_importances`).
        attention_importances: ``(l, rows (K,)) -> (heads (K, H, T), residual (K,))`` for the
            after-attention states of layer l at ``rows`` (:func:`attention_edge_importances`);
            called once per layer with kept rows, top layer first.
        granularity: ``"head"`` (default): one edge per head and source j (kind ``"head"``);
            ``"token"``: one edge per source j whose importance is the sum over heads (kind
            ``"attention"``, with the per-head importances in ``head_importances``), the
            token-level edges of the authors' tool.
        output_edges: ``l -> `` the kinds of the edges into layer l's outputs: ``"residual"`` (from
            m_{l,k}), ``"ff"`` (from m_{l,k} through the FF node f_{l,k}), ``"per_layer_input"`` and
            ``"own_addition"`` (from the leaf p_{l,k}, :data:`LEAF_EDGES`); default :data:`OUTPUT_EDGES`.
        value_layer: ``l -> l'`` (see above); default the identity.
        ff_reads_input: ``l -> `` whether layer l's FF block reads the layer input (a parallel layer): its
            FF edge then comes from x_{l,k} (through f_{l,k}), which it keeps, instead of m_{l,k}; default False.

    Returns:
        :class:`PrunedRoutes`.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    tau = float(threshold)
    out = PrunedRoutes()
    seen = set()

    def add_node(kind: str, layer: int, pos: int) -> None:
        nid = node_id(kind, layer, pos)
        if nid not in seen:
            seen.add(nid)
            out.nodes.append({"id": nid, "kind": kind, "layer": layer, "position": pos})

    def keep(w: float) -> bool:
        return w > 0 and w >= tau

    def add_edge(src: str, dst: str, kind: str, layer: int, head, sp: int, tp: int, w: float) -> None:
        out.edges.append({"source": src, "target": dst, "kind": kind, "layer": layer, "head": head,
                          "source_position": sp, "target_position": tp, "importance": w})

    add_node("x", num_layers, position)
    # kept inputs x_{l,k} per layer l (a layer reusing an earlier layer's values keeps that layer's inputs)
    kept_inputs: Dict[int, set] = {num_layers: {position}}
    out.rows_per_layer = [0] * num_layers
    for l in range(num_layers - 1, -1, -1):
        kept_x = sorted(kept_inputs.pop(l + 1, ()))
        if not kept_x:
            if any(kept_inputs.values()):
                continue
            break
        ffi = ff_importances(l)
        kinds = tuple(output_edges(l))
        ff_from_x = bool(ff_reads_input(l))
        kept_m = []
        for k in kept_x:
            for e, kind in enumerate(kinds):
                w = float(ffi[k, e])
                if not keep(w):
                    continue
                if kind in LEAF_EDGES:  # token k's own input to the layer's output: a leaf
                    add_node("p", l, k)
                    add_edge(node_id("p", l, k), node_id("x", l + 1, k), kind, l, None, k, k, w)
                    continue
                if kind == "ff" and ff_from_x:  # the FF block reads x_{l,k}: x_{l,k} -> f_{l,k} -> x_{l+1,k}
                    add_node("x", l, k)
                    add_node("f", l, k)
                    kept_inputs.setdefault(l, set()).add(k)
                    add_edge(node_id("x", l, k), node_id("x", l + 1, k), kind, l, None, k, k, w)
                    continue
                add_node("m", l, k)
                if kind == "ff":
                    add_node("f", l, k)
                add_edge(node_id("m", l, k), node_id("x", l + 1, k), kind, l, None, k, k, w)
                kept_m.append(k)
        kept_m = sorted(set(kept_m))
        out.rows_per_layer[l] = len(kept_m)
        if not kept_m:
            continue
        rows = torch.tensor(kept_m, dtype=torch.long)
        heads, resid = attention_importances(l, rows)
        heads, resid = heads.cpu(), resid.cpu()
        src = int(value_layer(l))
        if not 0 <= src <= l:
            raise ValueError(f"layer {l} reads the values of layer {src}: a layer reads its own or an earlier layer's")
        here, there = kept_inputs.setdefault(l, set()), kept_inputs.setdefault(src, set())
        for r, k in enumerate(kept_m):
            w = float(resid[r])
            if keep(w):
                add_node("x", l, k)
                here.add(k)
                add_edge(node_id("x", l, k), node_id("m", l, k), "residual", l, None, k, k, w)
            if granularity == "token":
                tok = heads[r].sum(0)  # (T,)
                for j in torch.nonzero((tok >= tau) & (tok > 0)).flatten().tolist():
                    add_node("x", src, j)
                    there.add(j)
                    add_edge(node_id("x", src, j), node_id("m", l, k), "attention", l, None, j, k, float(tok[j]))
                    out.edges[-1]["head_importances"] = [float(v) for v in heads[r, :, j]]
                continue
            hs, js = torch.nonzero((heads[r] >= tau) & (heads[r] > 0), as_tuple=True)
            for h, j in zip(hs.tolist(), js.tolist()):
                add_node("x", src, j)
                there.add(j)
                add_edge(node_id("x", src, j), node_id("m", l, k), "head", l, h, j, k, float(heads[r, h, j]))
    return out


def head_importance_totals(edges: Sequence[Dict], num_layers: int, num_heads: int) -> Tensor:
    r"""(L, H) sum of the importances of every kept head edge of each head (token-level edges: their
    per-head importances). A hybrid model's layers have different head counts (LFM2's short-convolution
    layers: one head per channel): H is the largest, a layer's columns past its own heads stay 0."""
    tot = torch.zeros(num_layers, num_heads, dtype=torch.float64)
    for e in edges:
        if e["kind"] == "head":
            tot[e["layer"], e["head"]] += e["importance"]
        elif e["kind"] == "attention":  # token-level edge: its per-head breakdown
            per_head = torch.tensor(e["head_importances"], dtype=torch.float64)
            tot[e["layer"], :per_head.numel()] += per_head
    return tot
