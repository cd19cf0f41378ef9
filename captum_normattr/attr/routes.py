r"""Information-flow routes of one prediction (Ferrando and Voita 2024), as a graph.

The math is in :mod:`captum_normattr.decompose.methods.routes`; this module captures the layers
(one recorded forward pass, then the layers rerun top-down from their checkpointed inputs
for the kept rows only) and packages the pruned graph (:class:`RouteGraph`: JSON, networkx).
Its HTML page is presentation: :func:`captum_normattr.present.interactive.routes_report_html`
(this module imports nothing of :mod:`captum_normattr.present` or :mod:`captum_normattr.cli`).
See docs/routes.md.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.arch.registry import supported_causal_families
from captum_normattr.attr.inputs import explained_positions, prepare_inputs
from captum_normattr.decompose.primitives.attention import project_values
from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.decompose.methods.routes import (
    GRANULARITIES,
    ROUTES_MEMORY_BUDGET_MB,
    attention_edge_importances,
    head_importance_totals,
    node_id,
    output_edge_importances,
    prune_routes,
)
from captum_normattr.models.adapters import get_adapter, layer_modules
from captum_normattr.models.engine import streamed_forward
from captum_normattr.models.guard import ConsistencyGuard
from captum_normattr.models.weights import tensors_to
from captum_normattr.options import check_memory_budget

__all__ = ["DEFAULT_THRESHOLD", "InformationFlowRoutes", "RouteGraph"]

#: Default pruning threshold tau (the value of the paper's Llama 2 figures).
DEFAULT_THRESHOLD = 0.04


@dataclass
class RouteGraph:
    r"""The pruned information-flow graph of one prediction.

    Attributes:
        position: the explained position i (index into ``tokens``; real tokens only).
        threshold: tau.
        num_layers, num_heads: L and H of the model.
        tokens: the T real tokens as strings (or None).
        nodes: dicts ``id``, ``kind`` (``"x"`` residual stream before layer ``layer``, ``x{L}``
            the final state; ``"m"`` after the attention of layer ``layer``; ``"f"`` the FF
            block of ``layer``; ``"p"`` token ``position``'s own input to the output of ``layer``, a leaf:
            Gemma 4's per-layer input, Qwen3-VL's DeepStack addition), ``layer``, ``position``.
        edges: dicts ``source``, ``target``, ``kind`` (``"residual"``, ``"head"``, ``"ff"``;
            ``"attention"`` with ``granularity="token"``: one edge per source, heads summed, the
            per-head parts in ``head_importances``), ``layer``, ``head`` (head edges only, else
            None), ``source_position``, ``target_position``, ``importance`` (in [0, 1]; the
            edges into a node sum to at most 1). An FF edge goes from ``m{l}_{i}`` through the
            FF node ``f{l}_{i}`` to ``x{l+1}_{i}`` (from ``x{l}_{i}`` on a parallel layer, whose FF block reads
            the layer input); a ``"per_layer_input"`` edge (Gemma 4) from
            ``p{l}_{i}`` to ``x{l+1}_{i}``, and so does an ``"own_addition"`` edge (Qwen3-VL's DeepStack
            feature added to image token i's stream after layer l). A head edge of a layer that reuses an earlier layer's
            keys and values (Gemma 4's ``num_kv_shared_layers``) comes from that earlier layer's
            input node ``x{l'}_{j}`` (its ``layer`` is the head's layer l).
        meta: dtype, model family, rows computed per layer.
    """

    position: int
    threshold: float
    num_layers: int
    num_heads: int
    tokens: Optional[List[str]] = None
    nodes: List[Dict[str, Any]] = field(default_factory=list)
    edges: List[Dict[str, Any]] = field(default_factory=list)
    meta: Dict[str, Any] = field(default_factory=dict)

    # --- queries ------------------------------------------------------------------
    def head_importance(self) -> Tensor:
        r"""(L, H) float64: the summed importance of each head's kept edges."""
        return head_importance_totals(self.edges, self.num_layers, self.num_heads)

    def head_flow(self) -> Tensor:
        r"""(L, H) float64: the flow of the final state passing through each head's kept edges.

        An edge carries flow(target) x importance (see :meth:`token_flow`); a head's flow is the
        sum over its kept edges (token-level edges: split by their per-head importances). Unlike
        :meth:`head_importance` it weighs an edge by how much of the final state its target holds.
        """
        flow = self._node_flows()
        tot = torch.zeros(self.num_layers, self.num_heads, dtype=torch.float64)
        for e in self.edges:
            f = flow.get(e["target"], 0.0)
            if e["kind"] == "head":
                tot[e["layer"], e["head"]] += f * e["importance"]
            elif e["kind"] == "attention":  # a hybrid's layers may have fewer heads than num_heads
                per_head = torch.tensor(e["head_importances"], dtype=torch.float64)
                tot[e["layer"], :per_head.numel()] += f * per_head
        return tot

    def top_heads(self, k: int = 5, by: str = "flow") -> List[Tuple[int, int, float]]:
        r"""The k heads with the largest ``by`` score: ``(layer, head, score)``.

        Args:
            k: how many.
            by: ``"flow"`` (default; :meth:`head_flow`, the final state's flow through the head's
                kept edges) or ``"importance"`` (:meth:`head_importance`, the plain sum of their
                importances, which favours early heads with many kept edges of little flow; on
                SmolLM2 the flow's top head mattered more, docs/routes.md).
        """
        if by not in ("importance", "flow"):
            raise ValueError(f"by must be 'importance' or 'flow', got {by!r}")
        tot = self.head_importance() if by == "importance" else self.head_flow()
        flat = tot.flatten()
        order = torch.argsort(flat, descending=True)[:k]
        return [(int(i) // self.num_heads, int(i) % self.num_heads, float(flat[i])) for i in order if flat[i] > 0]

    def _node_flows(self) -> Dict[str, float]:
        flow: Dict[str, float] = {node_id("x", self.num_layers, self.position): 1.0}
        for e in self.edges:  # listed top-down: a node's inflow is complete before it passes it on
            flow[e["source"]] = flow.get(e["source"], 0.0) + flow.get(e["target"], 0.0) * e["importance"]
        return flow

    def token_flow(self) -> Tensor:
        r"""(T,) float64: the share of the final state that reaches each input token through the kept edges.

        Top-down, flow(x_{L,i}) = 1 and every kept edge passes flow(target) x importance to its
        source (an FF edge to the state before the FF block); the result is the flow reaching
        each embedding node x_{0,j}, plus the flow reaching token j's leaves p_{l,j} (Gemma 4's
        per-layer inputs, Qwen3-VL's DeepStack additions). With threshold 0 it sums to 1 (the importances into each
        node sum to 1) unless a node on the way has every incoming proximity 0 (every part farther, in L1, from the
        node's state than the state's own L1 norm: ALTI's normalisation leaves that row 0), where the flow reaching
        it stops (seen once, on a tiny random Gemma 4: 0.54 reached the tokens); pruning loses the flow of the
        edges below the threshold.
        """
        n = int(self.meta.get("seq_len", 1 + max([nd["position"] for nd in self.nodes], default=self.position)))
        flow = self._node_flows()
        out = torch.zeros(n, dtype=torch.float64)
        for nd in self.nodes:
            if (nd["kind"] == "x" and nd["layer"] == 0) or nd["kind"] == "p":  # a per-layer input: its token's
                out[nd["position"]] += flow.get(nd["id"], 0.0)
        return out

    # --- exports ------------------------------------------------------------------
    def to_json(self) -> Dict[str, Any]:
        r"""A JSON-serialisable dict (``json.dumps`` it as it is); read back by :meth:`from_json`."""
        return {
            "format": "captum_normattr.routes/1",
            "position": self.position,
            "threshold": self.threshold,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "tokens": list(self.tokens) if self.tokens is not None else None,
            "nodes": [dict(n) for n in self.nodes],
            "edges": [dict(e) for e in self.edges],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, data: Union[str, Dict[str, Any]]) -> "RouteGraph":
        r"""Rebuild a graph from :meth:`to_json` output (a dict or its JSON text)."""
        d = json.loads(data) if isinstance(data, str) else data
        return cls(position=d["position"], threshold=d["threshold"], num_layers=d["num_layers"],
                   num_heads=d["num_heads"], tokens=d.get("tokens"), nodes=list(d["nodes"]),
                   edges=list(d["edges"]), meta=dict(d.get("meta", {})))

    def to_networkx(self):
        r"""A ``networkx.DiGraph`` (networkx is imported here; install it to use this).

        Nodes carry ``kind``, ``layer``, ``position`` (and ``token``). Parallel pieces between
        the same two nodes (the residual and the head edges of a token into itself, several
        heads from one source) become one edge whose ``weight`` is their summed importance and
        whose ``parts`` lists them (``kind``, ``head``, ``importance``). FF edges run
        ``m -> f -> x``, both with the FF importance.
        """
        try:
            import networkx as nx
        except ImportError as e:  # pragma: no cover - optional dependency
            raise ImportError("RouteGraph.to_networkx needs networkx: pip install networkx") from e
        g = nx.DiGraph(position=self.position, threshold=self.threshold, num_layers=self.num_layers,
                       num_heads=self.num_heads)
        for n in self.nodes:
            attrs = {k: v for k, v in n.items() if k != "id"}
            if self.tokens is not None:
                attrs["token"] = self.tokens[n["position"]]
            g.add_node(n["id"], **attrs)

        def add(u: str, v: str, e: Dict[str, Any]) -> None:
            part = {"kind": e["kind"], "head": e["head"], "importance": e["importance"]}
            if "head_importances" in e:
                part["head_importances"] = e["head_importances"]
            if g.has_edge(u, v):
                g[u][v]["weight"] += e["importance"]
                g[u][v]["parts"].append(part)
            else:
                g.add_edge(u, v, weight=e["importance"], layer=e["layer"], parts=[part])

        for e in self.edges:
            if e["kind"] == "ff":
                f = node_id("f", e["layer"], e["target_position"])
                add(e["source"], f, e)
                add(f, e["target"], e)
            else:
                add(e["source"], e["target"], e)
        return g


class InformationFlowRoutes:
    r"""Information-flow routes of a causal decoder's prediction (Ferrando and Voita 2024).

    The model's layer kind must decompose routes
    (:meth:`~captum_normattr.decompose.kinds.base.LayerKind.require`); a bidirectional model is refused.

    For the prediction at one position i the graph starts at the final residual state x_{L,i}
    and is built top-down: at each layer every kept node keeps its incoming edges (the
    residual, each head's part from each source token, the FF block) whose importance
    (normalised ALTI proximity, docs/routes.md) is at least ``threshold``.

    One recorded forward pass keeps each layer's input (B, T, D) and every layer's two FF-edge
    importances per position; the graph is then pruned from the top layer down, each layer
    being recomputed from its input and its per-head parts formed for the kept rows only
    (in cache-sized tiles). Memory: L checkpoints plus one layer's tensors; never a
    (T, T, H, D) tensor.

    Args:
        model: a GPT-2 / Llama / Mistral / Qwen2 model (``*ForCausalLM`` or bare ``*Model``), or a
            vision-language model whose decoder's layer kind has routes (docs/routes.md, "Vision-language models").
        memory_budget_mb: sizes the chunks of kept rows processed together (their per-head
            parts, were they formed at once, would fit it; they never are).

    Examples::

        >>> routes = InformationFlowRoutes(model)
        >>> g = routes.attribute(ids, attention_mask=mask, position=-1, threshold=0.04)
        >>> g.top_heads(3), g.to_json()["edges"][:2]
        >>> g = InformationFlowRoutes(vlm).attribute(batch["input_ids"], additional_forward_args={
        ...     "attention_mask": batch["attention_mask"], "pixel_values": batch["pixel_values"]})
        >>> nxg = g.to_networkx()
        >>> from captum_normattr.present.interactive import routes_report_html
        >>> html = routes_report_html(g)
    """

    def __init__(self, model: nn.Module, memory_budget_mb: float = ROUTES_MEMORY_BUDGET_MB) -> None:
        self.model = model
        self.adapter = get_adapter(model)
        family = self.adapter.family
        kind = self.kind = layer_kind(self.adapter.topology)
        if not self.adapter.causal:
            layers = self.adapter.features()[0]  # the topology, readable ("post-LN", "pre-LN", ...)
            raise NotImplementedError(
                f"information-flow routes are implemented for causal decoders ({supported_causal_families()}); "
                f"the {family} family is bidirectional, with {layers} layers"
            )
        kind.require("routes", family)
        self.memory_budget_mb = check_memory_budget(memory_budget_mb)

    @log_usage()
    def attribute(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        position: Union[int, str] = -1,
        threshold: float = DEFAULT_THRESHOLD,
        tokens: Optional[Sequence[str]] = None,
        granularity: str = "head",
        position_ids: Optional[Tensor] = None,
        additional_forward_args: Any = None,
    ) -> RouteGraph:
        r"""The pruned route graph of the prediction at ``position``.

        Args:
            input_ids: (1, T) token ids (or (1, T, D) input embeddings) of one example.
            attention_mask: optional (1, T) mask (left or right padding).
            position: the explained position: an int (k >= 0 counts from the first real token,
                negative from the last; default -1, the last real token) or ``"last"``.
            threshold: tau in [0, 1]: edges with importance >= tau (and > 0) are kept.
            tokens: optional strings of the T real tokens, stored in the graph (for display).
            granularity: ``"head"`` (default): one attention edge per head and source token;
                ``"token"``: one per source token, its importance summed over heads (thresholded
                as such; kind ``"attention"``, per-head importances in ``head_importances``).
            position_ids: optional (1, T) position ids the model is called with (default: counted
                from the first real token).
            additional_forward_args: the model's further inputs, as for every other method
                (:func:`~captum_normattr.attr.inputs.prepare_inputs`): by name, e.g. a vision-language
                model's ``{"attention_mask": ..., "pixel_values": ..., "image_grid_thw": ...}`` (the
                processor's outputs; docs/vlm.md), checked and refused with the same messages; or the
                attention mask alone. A name given here and as ``attention_mask`` / ``position_ids`` too
                is refused.

        Returns:
            :class:`RouteGraph`, positions counted over the real tokens (0 = first real token).

        Raises:
            ValueError: for a batch of more than one example, a threshold outside [0, 1], a model
                input given twice, or a forward pass with NaN or infinite values.
            UnsupportedModelError: a further input the model's description refuses (docs/vlm.md).

        The graph explains the final residual state at ``position`` (what every logit there is
        read from), so it does not depend on a target token.
        """
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        if not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(f"threshold must lie in [0, 1], got {threshold}")
        if input_ids.shape[0] != 1:
            raise ValueError(f"routes explain one example at a time; got a batch of {input_ids.shape[0]} (call once per example)")
        extra = _forward_args(additional_forward_args, attention_mask=attention_mask, position_ids=position_ids)
        prepared = prepare_inputs(self.model, self.adapter, input_ids, extra)
        valid = prepared.valid
        pos = int(explained_positions(position, valid)[0])
        real = torch.nonzero(valid[0]).flatten()
        first = int(real[0])
        n_real = int(real.numel())
        if int(real[-1]) - first + 1 != n_real:
            raise ValueError("the attention mask must mark one contiguous block of real tokens (left or right padding)")
        if tokens is not None and len(tokens) != n_real:
            raise ValueError(f"tokens has {len(tokens)} strings for {n_real} real tokens")
        n_layers = len(layer_modules(self.model, self.adapter))
        checkpoints: List[Optional[Tensor]] = []
        ff_imp: List[Tensor] = []
        output_kinds: List[Tuple[str, ...]] = []
        value_layers: List[int] = []
        top: Dict[str, Any] = {}
        kind = self.kind
        budget = self.memory_budget_mb

        def on_layer(layer: LayerTensors) -> None:
            layer = tensors_to(layer, valid.device)
            checkpoints.append(layer.hidden_in)
            parts, kinds = kind.route_output_edges(layer)
            ff = output_edge_importances(parts[0], layer.layer_out[0])
            ff_imp.append(ff * valid[0, :, None].to(ff.dtype))
            output_kinds.append(kinds)
            value_layers.append(kind.route_value_layer(layer))
            top["heads"] = max(top.get("heads", 0), layer.num_heads)  # hybrid models: the largest head count
            top["dtype"] = str(layer.hidden_in.dtype).replace("torch.", "")
            if layer.index == n_layers - 1:  # the top layer is needed first: keep it, no rerun
                top["layer"] = layer

        guard = ConsistencyGuard("Routes")
        with streamed_forward(self.model, self.adapter, prepared, on_layer, keep_calls=True, guard=guard) as (rec, _):
            if prepared.finite is not None and not bool(prepared.finite.all()):
                raise ValueError("the forward pass holds NaN or infinite values at real tokens; no route graph is defined")

            def attention(l: int, rows: Tensor) -> Tuple[Tensor, Tensor]:
                layer = top.pop("layer", None) if l == n_layers - 1 else None
                if layer is None:
                    layer = tensors_to(rec.rerun_layer(l, checkpoints[l]), valid.device)
                    # checked against its output in the recorded pass, the next layer's input (docs/reliability.md)
                    guard.check_rerun(layer, checkpoints[l + 1])
                if l + 1 < n_layers:
                    checkpoints[l + 1] = None  # walked top-down: no longer needed
                layer = kind.route_form(layer)
                projected = project_values(layer.values[:1], layer.head_out_weight())
                return attention_edge_importances(layer, rows.to(valid.device), valid, 0, budget, projected)

            pruned = prune_routes(n_layers, pos, threshold, lambda l: ff_imp[l], attention, granularity,
                                  output_edges=lambda l: output_kinds[l], value_layer=lambda l: value_layers[l],
                                  ff_reads_input=lambda l: kind.route_ff_reads_input)
        top.pop("layer", None)
        # positions over the real tokens
        for n in pruned.nodes:
            p = n["position"] - first
            n["position"] = p
            n["id"] = node_id(n["kind"], n["layer"], p)
        for e in pruned.edges:
            e["source_position"] -= first
            e["target_position"] -= first
            e["source"] = _shift(e["source"], first)
            e["target"] = _shift(e["target"], first)
        meta = {"dtype": top.get("dtype"), "family": self.adapter.family, "seq_len": n_real, "granularity": granularity,
                "rows_per_layer": pruned.rows_per_layer, "importance": "normalised L1 proximity (docs/routes.md)"}
        return RouteGraph(position=pos - first, threshold=float(threshold), num_layers=n_layers,
                          num_heads=int(top.get("heads", 0)), tokens=list(tokens) if tokens is not None else None,
                          nodes=pruned.nodes, edges=pruned.edges, meta=meta)


def _forward_args(additional_forward_args: Any, **named: Optional[Tensor]) -> Any:
    r"""``additional_forward_args`` with the inputs ``attribute`` takes by name (``attention_mask``, ``position_ids``)
    joined to it by name; :func:`~captum_normattr.attr.inputs.prepare_inputs` then checks them all.

    Raises:
        ValueError: an input given both ways.
    """
    named = {k: v for k, v in named.items() if v is not None}
    extra = additional_forward_args
    if isinstance(extra, (tuple, list)) and len(extra) == 1 and isinstance(extra[0], Mapping):
        extra = extra[0]  # a mapping wrapped as Captum wraps it
    if not named:
        return extra
    if extra is None:
        return named
    if not isinstance(extra, Mapping):
        raise ValueError(f"{sorted(named)} given as arguments and additional_forward_args given positionally: pass the "
                         "model inputs in one place (by name in additional_forward_args, or the mask as attention_mask)")
    twice = sorted(k for k in named if extra.get(k) is not None)
    if twice:
        raise ValueError(f"{twice} given both as arguments and in additional_forward_args: pass each model input once")
    return {**dict(extra), **named}


def _shift(nid: str, first: int) -> str:
    kind, rest = nid[0], nid[1:]
    layer, pos = rest.split("_")
    return node_id(kind, int(layer), int(pos) - first)
