r"""Information-flow routes of Gemma 4 (the ``sandwich_per_layer_input`` kind; docs/routes.md, "Gemma 4").

On tiny float64 Gemma 4 text models (tests/fixtures/zoo_gemma4.py: sliding and full layers, layer
scalars in [0.5, 1.5], norm gains away from 1), with and without the expert block, with and without
shared keys and values, with and without per-layer inputs:

- every edge and importance equals a naive reference built from the model's own modules (hooks on the
  norms, the attention's probabilities and the value norm's output; the per-head parts written out
  from W_O), whose edge vectors are first checked to sum to the model's real tensors (the heads and
  the residual to h_i = the pre-feed-forward norm's input, the residual, the feed-forward branch and
  the per-layer-input branch, each times the layer scalar, to the layer's output);
- a layer reusing keys and values has its head edges from the input of the layer that computed them;
- at threshold 0 the importances into every node sum to 1 and the token flow to 1;
- a left-padded example gives the graph of the example alone; the model is left as found.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4TextConfig"):  # pragma: no cover - older transformers
    pytest.skip("transformers has no Gemma 4", allow_module_level=True)

from captum_normattr.attr.routes import InformationFlowRoutes  # noqa: E402
from captum_normattr.present.interactive import routes_report_html  # noqa: E402
from route_reference import LayerPieces, naive_prune, padded_and_alone  # noqa: E402
from route_reference import graph_edges as _edges, model_state as _state, model_unchanged as _unchanged  # noqa: E402
from zoo_gemma4 import MOE, build_gemma4  # noqa: E402

#: keywords of build_gemma4: experts on and off, keys and values shared or not, per-layer inputs or not
CONFIGS = {
    "plain": dict(num_kv_shared_layers=0),
    "shared_kv": dict(num_kv_shared_layers=2),
    "experts": dict(num_kv_shared_layers=0, **MOE),
    "experts_shared_kv": dict(num_kv_shared_layers=2, **MOE),
    "shared_kv_k_eq_v": dict(num_kv_shared_layers=2, attention_k_eq_v=True),
    "no_per_layer_input": dict(num_kv_shared_layers=2, hidden_size_per_layer_input=0),
}


def _ids(t=7, seed=3):
    return torch.randint(3, 50, (1, t), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# --- naive reference: the model's own modules, hooked ---------------------------------------------------
def _capture(model, ids):
    r"""Per layer: x, a (attention output), probs, v (the value norm's output), h, F, B, y."""
    layers = model.model.layers
    rec = [dict() for _ in layers]
    hooks = []

    def put(l, key, value):
        rec[l][key] = value.detach()[0]

    for l, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, k, l=l: put(l, "x", a[0] if a else k["hidden_states"]), with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(
            lambda m, a, o, l=l: put(l, "a", o[0]) or put(l, "probs", o[1])))
        if not layer.self_attn.is_kv_shared_layer:
            hooks.append(layer.self_attn.v_norm.register_forward_hook(lambda m, a, o, l=l: put(l, "v", o)))
        hooks.append(layer.pre_feedforward_layernorm.register_forward_pre_hook(lambda m, a, l=l: put(l, "h", a[0])))
        hooks.append(layer.post_feedforward_layernorm.register_forward_hook(lambda m, a, o, l=l: put(l, "F", o)))
        if layer.hidden_size_per_layer_input:
            hooks.append(layer.post_per_layer_input_norm.register_forward_hook(lambda m, a, o, l=l: put(l, "B", o)))
        hooks.append(layer.register_forward_hook(lambda m, a, o, l=l: put(l, "y", o[0] if isinstance(o, tuple) else o)))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return rec, layers


def _source_layer(config, l):
    r"""The layer whose values layer l reads: l, or the last non-reusing layer of its type (written out here)."""
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    if l < first_shared:
        return l
    return max(k for k in range(first_shared) if config.layer_types[k] == config.layer_types[l])


@torch.no_grad()
def naive_edges(model, ids, position, tau):
    r"""Every kept edge (source, target, kind, head) -> importance, and the worst completeness of the edge vectors."""
    rec, layers = _capture(model, ids)
    config = model.config
    worst = [0.0]

    def pieces(l):
        r, layer = rec[l], layers[l]
        c = layer.layer_scalar.reshape(())
        out_parts = {"residual": c * r["h"], "ff": c * r["F"]}
        if "B" in r:
            out_parts["per_layer_input"] = c * r["B"]
        worst[0] = max(worst[0], _rel(sum(out_parts.values()), r["y"]))
        # per-head parts into h_i: gamma_pa * alpha^h_ij v^h_j W_O^h / rms(a_i)
        src = _source_layer(config, l)
        v = rec[src]["v"]  # (T, H_kv, Dh)
        n_heads, dh = config.num_attention_heads, v.shape[-1]
        wo = layer.self_attn.o_proj.weight  # (D, H Dh)
        f = torch.stack([v[:, h // (n_heads // v.shape[1])] @ wo[:, h * dh:(h + 1) * dh].T for h in range(n_heads)])
        norm = layer.post_attention_layernorm
        scale = norm.weight / (r["a"].pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()  # (T, D)
        parts = r["probs"][:, :, :, None] * f[:, None, :, :] * scale[None, :, None, :]  # (H, T_i, T_j, D)
        worst[0] = max(worst[0], _rel(r["x"] + parts.sum((0, 2)), r["h"]))
        return LayerPieces(out_parts, r["y"], r["x"], r["h"], parts, src)

    return naive_prune(len(layers), position, tau, pieces), worst[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_edge_equals_the_naive_reference(name):
    model = build_gemma4(**CONFIGS[name])
    state = _state(model)
    ids = _ids()
    tau = 0.01
    ref, worst = naive_edges(model, ids, 6, tau)
    assert worst < 1e-12, (name, worst)  # the reference's edge vectors sum to the model's own tensors
    g = InformationFlowRoutes(model).attribute(ids, threshold=tau)
    got = _edges(g)
    assert len(ref) > 20 and any(k[2] == "head" for k in ref) and any(k[2] == "ff" for k in ref)
    assert any(k[2] == "per_layer_input" for k in ref) == ("no_per_layer_input" != name)
    assert set(got) == set(ref), (name, set(got) ^ set(ref))
    err = max(abs(got[k] - ref[k]) for k in ref)
    assert err < 1e-10 * max(ref.values()), (name, err)
    nodes = {n["id"] for n in g.nodes}
    assert all(e["source"] in nodes and e["target"] in nodes for e in g.edges)
    assert all(n["kind"] != "p" or not any(e["target"] == n["id"] for e in g.edges) for n in g.nodes)  # leaves
    assert _unchanged(model, state)


@pytest.mark.parametrize("name", ["shared_kv", "experts_shared_kv"])
def test_a_layer_reusing_keys_and_values_reads_the_input_of_the_layer_that_computed_them(name):
    model = build_gemma4(**CONFIGS[name])  # layers 2 (sliding) and 3 (full) reuse those of layers 0 and 1
    g = InformationFlowRoutes(model).attribute(_ids(), threshold=0.0)
    sources = {}
    for e in g.edges:
        if e["kind"] == "head":
            sources.setdefault(e["layer"], set()).add(int(e["source"][1:].split("_")[0]))
    assert sources == {0: {0}, 1: {1}, 2: {0}, 3: {1}}
    html = routes_report_html(g)  # the report draws an edge that skips layers
    assert html.startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("name", ["plain", "experts_shared_kv", "no_per_layer_input"])
def test_threshold_zero_conserves_the_flow(name):
    model = build_gemma4(**CONFIGS[name])
    g = InformationFlowRoutes(model).attribute(_ids(), threshold=0.0)
    into = {}
    for e in g.edges:
        into[e["target"]] = into.get(e["target"], 0.0) + e["importance"]
    assert into and all(abs(v - 1) < 1e-12 for v in into.values())
    flow = g.token_flow()
    assert abs(float(flow.sum()) - 1) < 1e-12 and (flow >= 0).all()
    leaves = sum(1 for n in g.nodes if n["kind"] == "p")
    assert (leaves > 0) == (name != "no_per_layer_input")
    hf = g.head_flow()
    assert (hf >= 0).all() and (hf.sum(-1) <= 1 + 1e-12).all() and (hf.sum(-1) > 0).all()
    tight = InformationFlowRoutes(model).attribute(_ids(), threshold=0.1)
    assert set(_edges(tight)) < set(_edges(g)) and float(tight.token_flow().sum()) < 1


@pytest.mark.parametrize("name", ["shared_kv", "experts_shared_kv"])
def test_padded_equals_single(name):
    model = build_gemma4(**CONFIGS[name])
    state = _state(model)
    ids = _ids(6, seed=5)
    a, b = padded_and_alone(model, ids)
    assert set(a) == set(b) and len(a) > 5
    assert max(abs(a[k] - b[k]) for k in a) < 1e-10
    assert _unchanged(model, state)
