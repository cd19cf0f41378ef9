r"""Information-flow routes of the ``sandwich`` and ``parallel`` layer kinds (docs/routes.md).

On tiny float64 models of the zoo (tests/fixtures/zoo*.py):

- sandwich: Gemma 2 (soft-capped logits, a sliding layer, gains 1 + w), OLMo 3 and EXAONE 4 (no pre-norms,
  a sliding layer), GLM-4 (pre-norms, biases on q, k, v; its second norm is ``post_attention_layernorm``
  and its branch post-norms ``post_self_attn_layernorm`` and ``post_mlp_layernorm``);
- parallel: Cohere 2 (a sliding layer, one shared LayerNorm) and GPT-J (rotary on part of each head).

Every edge and importance equals a naive reference built from the model's own modules (hooks on the
attention, its value projection, the branch post-norms or the FF block, the layer), whose edge vectors are
first checked to sum to the model's real tensors: the per-head parts alpha^h_ij v^h_j W_O^h, a sandwich
layer's frozen at the post-norm's real per-token scale (the ratio of the post-norm's real output to its
real input, whatever the norm's formula; the probabilities of a float64 eager copy), to the attention
branch's real output; the residual and the FF
branch to the layer's real output. A parallel layer's FF edge comes from the layer input. At threshold 0
the importances into every node sum to 1 and the token flow to 1; a left-padded example gives the graph
of the example alone; the model is left as found.
"""
import copy

import pytest
import torch

from captum_normattr.attr.routes import InformationFlowRoutes
from captum_normattr.present.interactive import routes_report_html
from route_reference import LayerPieces, naive_prune, padded_and_alone
from route_reference import graph_edges as _edges, model_state as _state, model_unchanged as _unchanged
from zoo import EXACT_ATTENTION, build

#: family -> (layer kind, attention module, output projection, the attention branch's post-norm or None
#: (parallel), the FF branch as it joins the stream: its post-norm or the FF block)
FAMILIES = {
    "gemma2": ("sandwich", "self_attn", "o_proj", "post_attention_layernorm", "post_feedforward_layernorm"),
    "olmo3": ("sandwich", "self_attn", "o_proj", "post_attention_layernorm", "post_feedforward_layernorm"),
    "exaone4": ("sandwich", "self_attn", "o_proj", "post_attention_layernorm", "post_feedforward_layernorm"),
    "glm4": ("sandwich", "self_attn", "o_proj", "post_self_attn_layernorm", "post_mlp_layernorm"),
    "cohere2": ("parallel", "self_attn", "o_proj", None, "mlp"),
    "gptj": ("parallel", "attn", "out_proj", None, "mlp"),
}


def _ids(t=7, seed=3):
    return torch.randint(3, 50, (1, t), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _layers(model):
    base = getattr(model, "model", None) or getattr(model, "transformer")
    return base.layers if hasattr(base, "layers") else base.h


# --- naive reference: the model's own modules, hooked ---------------------------------------------------
@torch.no_grad()
def _capture(model, ids, family):
    r"""Per layer: x, a (attention branch output), probs, v (value projection), P (the attention post-norm's
    output), F (the FF branch as it joins the stream), y; on a copy whose eager attention returns the probabilities."""
    _, attn_name, _, post, ff = FAMILIES[family]
    model = copy.deepcopy(model)
    model.config._attn_implementation = EXACT_ATTENTION  # eager, the softmax in float64
    layers = _layers(model)
    rec = [dict() for _ in layers]

    def put(l, key, value):
        rec[l][key] = value.detach()[0]

    for l, layer in enumerate(layers):
        attn = getattr(layer, attn_name)
        layer.register_forward_pre_hook(
            lambda m, a, k, l=l: put(l, "x", a[0] if a else k["hidden_states"]), with_kwargs=True)
        attn.register_forward_hook(lambda m, a, o, l=l: put(l, "a", o[0]) or put(l, "probs", o[1]))
        attn.v_proj.register_forward_hook(lambda m, a, o, l=l: put(l, "v", o))
        if post is not None:
            getattr(layer, post).register_forward_hook(lambda m, a, o, l=l: put(l, "P", o))
        getattr(layer, ff).register_forward_hook(lambda m, a, o, l=l: put(l, "F", o))
        layer.register_forward_hook(lambda m, a, o, l=l: put(l, "y", o[0] if isinstance(o, tuple) else o))
    model(input_ids=ids)
    return rec, layers


@torch.no_grad()
def naive_edges(model, ids, position, tau, family):
    r"""Every kept edge (source, target, kind, head) -> importance, and the worst completeness of the edge vectors."""
    rec, layers = _capture(model, ids, family)
    kind, attn_name, out_name, post, _ = FAMILIES[family]
    n_heads = model.config.num_attention_heads
    worst = [0.0]

    def pieces(l):
        r = rec[l]
        wo = getattr(getattr(layers[l], attn_name), out_name).weight  # (D, H Dh)
        dh = wo.shape[1] // n_heads
        v = r["v"].reshape(r["v"].shape[0], -1, dh)  # (T, H_kv, Dh)
        f = torch.stack([v[:, h // (n_heads // v.shape[1])] @ wo[:, h * dh:(h + 1) * dh].T for h in range(n_heads)])
        parts = r["probs"][:, :, :, None] * f[:, None, :, :]  # (H, T_i, T_j, D) heads' parts of the attention output
        branch = r["a"]
        if post is not None:  # the post-norm frozen at its real per-token scale: a diagonal map, P(a)_i / a_i
            parts = parts * (r["P"] / r["a"])[None, :, None, :]
            branch = r["P"]
        worst[0] = max(worst[0], _rel(parts.sum((0, 2)), branch))
        h = r["x"] + branch
        out_parts = {"residual": h, "ff": r["F"]}
        worst[0] = max(worst[0], _rel(sum(out_parts.values()), r["y"]))
        return LayerPieces(out_parts, r["y"], r["x"], h, parts, l, ff_from_input=kind == "parallel")

    return naive_prune(len(layers), position, tau, pieces), worst[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_edge_equals_the_naive_reference(family):
    model = build(family)
    state = _state(model)
    routes = InformationFlowRoutes(model)
    assert routes.kind.name == FAMILIES[family][0]
    ids = _ids()
    tau = 0.01
    ref, worst = naive_edges(model, ids, 6, tau, family)
    assert worst < 1e-12, (family, worst)  # the reference's edge vectors sum to the model's own tensors
    g = routes.attribute(ids, threshold=tau)
    got = _edges(g)
    assert len(ref) > 15 and any(k[2] == "head" for k in ref) and any(k[2] == "ff" for k in ref)
    assert set(got) == set(ref), (family, set(got) ^ set(ref))
    err = max(abs(got[k] - ref[k]) for k in ref)
    print(f"{family}: {len(ref)} edges, reference vectors {worst:.1e}, importances {err:.1e}")
    assert err < 1e-10 * max(ref.values()), (family, err)
    nodes = {n["id"] for n in g.nodes}
    assert all(e["source"] in nodes and e["target"] in nodes for e in g.edges)
    ff_sources = {e["source"][0] for e in g.edges if e["kind"] == "ff"}
    assert ff_sources == ({"x"} if FAMILIES[family][0] == "parallel" else {"m"})
    assert _unchanged(model, state)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_threshold_zero_conserves_the_flow(family):
    model = build(family)
    g = InformationFlowRoutes(model).attribute(_ids(), threshold=0.0)
    into = {}
    for e in g.edges:
        into[e["target"]] = into.get(e["target"], 0.0) + e["importance"]
    worst = max(abs(v - 1) for v in into.values())
    flow = g.token_flow()
    print(f"{family}: importances into a node {worst:.1e}, token flow {abs(float(flow.sum()) - 1):.1e}")
    assert into and worst < 1e-12, (family, worst)
    assert abs(float(flow.sum()) - 1) < 1e-12 and (flow >= 0).all()
    hf = g.head_flow()
    assert (hf >= 0).all() and (hf.sum(-1) > 0).all()
    assert routes_report_html(g).startswith("<!DOCTYPE html>")  # the report draws a parallel layer's x -> x FF edge
    tight = InformationFlowRoutes(model).attribute(_ids(), threshold=0.1)
    assert set(_edges(tight)) < set(_edges(g)) and float(tight.token_flow().sum()) < 1


@pytest.mark.parametrize("family", ["gemma2", "glm4", "cohere2", "gptj"])
def test_padded_equals_single(family):
    model = build(family)
    state = _state(model)
    ids = _ids(6, seed=5)
    a, b = padded_and_alone(model, ids)
    assert set(a) == set(b) and len(a) > 5
    err = max(abs(a[k] - b[k]) for k in a)
    print(f"{family}: padded vs single {err:.1e}")
    assert err < 1e-10, (family, err)
    assert _unchanged(model, state)
