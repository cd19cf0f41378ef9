r"""Information-flow routes: naive reference from the model's real weights, padding, chunking, exports,
and, on a decoder trained in the test, zeroing the top route's head moves the logit more than zeroing
the other heads of its layer."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from captum_normattr.attr.routes import InformationFlowRoutes, RouteGraph
from captum_normattr.decompose.methods.routes import ff_edge_importances, proximity

from decoder_models import VOCAB, make_decoder


# --- naive reference: every per-head part as an explicit vector, from the HF modules ------------------
def _capture(model, ids):
    r"""Per layer: input x, LN1 output, h (LN2 input), FF output, layer output; eager attention probs."""
    base = model.model if hasattr(model, "model") else model.transformer
    layers = base.layers if hasattr(base, "layers") else base.h
    rec = [dict() for _ in layers]
    hooks = []
    for l, layer in enumerate(layers):
        ln1 = layer.input_layernorm if hasattr(layer, "input_layernorm") else layer.ln_1
        ln2 = layer.post_attention_layernorm if hasattr(layer, "post_attention_layernorm") else layer.ln_2
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, k, l=l: rec[l].__setitem__("x", (a[0] if a else k["hidden_states"])[0].detach()), with_kwargs=True))
        hooks.append(ln1.register_forward_hook(lambda m, a, o, l=l: rec[l].__setitem__("ln1", o[0].detach())))
        hooks.append(ln2.register_forward_hook(lambda m, a, o, l=l: rec[l].__setitem__("h", a[0][0].detach())))
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, o, l=l: rec[l].__setitem__("ff", o[0].detach())))
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, l=l: rec[l].__setitem__("out", (o[0] if isinstance(o, tuple) else o)[0].detach())))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    for l, a in enumerate(out.attentions):
        rec[l]["probs"] = a[0].detach()
    rec = [{k: v.detach() for k, v in r.items()} for r in rec]
    return rec, layers


@torch.no_grad()
def _head_vectors(model, layer, ln1):
    r"""f^h(LN1(x_j)) for every head and token, (H, T, D), from the real weights."""
    cfg = model.config
    if hasattr(layer, "self_attn"):  # Llama family
        at = layer.self_attn
        h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        dh = cfg.hidden_size // h
        v = ln1 @ at.v_proj.weight.T + (at.v_proj.bias if at.v_proj.bias is not None else 0)
        wo = at.o_proj.weight  # (D, H Dh)
        return torch.stack([v[:, (k // (h // hkv)) * dh:(k // (h // hkv) + 1) * dh] @ wo[:, k * dh:(k + 1) * dh].T
                            for k in range(h)])
    at = layer.attn  # GPT-2: Conv1D weights (in, out)
    d, h = cfg.n_embd, cfg.n_head
    dh = d // h
    v = ln1 @ at.c_attn.weight[:, 2 * d:] + at.c_attn.bias[2 * d:]
    return torch.stack([v[:, k * dh:(k + 1) * dh] @ at.c_proj.weight[k * dh:(k + 1) * dh] for k in range(h)])


def _l1prox(c, y):
    return max(0.0, float(y.abs().sum() - (y - c).abs().sum()))


def naive_graph(model, ids, position, tau, granularity="head"):
    rec, layers = _capture(model, ids)
    n_layers, t = len(layers), ids.shape[1]
    edges = {}
    kept_x = {position}
    for l in range(n_layers - 1, -1, -1):
        r = rec[l]
        kept_m = set()
        for k in kept_x:
            pr, pf = _l1prox(r["h"][k], r["out"][k]), _l1prox(r["ff"][k], r["out"][k])
            s = pr + pf
            for kind, p in (("residual", pr), ("ff", pf)):
                w = p / s if s > 0 else 0.0
                if w > 0 and w >= tau:
                    edges[(f"m{l}_{k}", f"x{l + 1}_{k}", kind, None)] = w
                    kept_m.add(k)
        f = _head_vectors(model, layers[l], r["ln1"])  # (H, T, D)
        next_x = set()
        for k in sorted(kept_m):
            y = r["h"][k]
            prox = {("residual", None, k): _l1prox(r["x"][k], y)}
            for hh in range(f.shape[0]):
                for j in range(k + 1):
                    prox[("head", hh, j)] = _l1prox(r["probs"][hh, k, j] * f[hh, j], y)
            s = sum(prox.values())
            weights = {key: (p / s if s > 0 else 0.0) for key, p in prox.items()}
            if granularity == "token":  # heads summed per source
                tok = {}
                for (kind, hh, j), w in weights.items():
                    key = ("residual", None, j) if kind == "residual" else ("attention", None, j)
                    tok[key] = tok.get(key, 0.0) + w
                weights = tok
            for (kind, hh, j), w in weights.items():
                if w > 0 and w >= tau:
                    edges[(f"x{l}_{j}", f"m{l}_{k}", kind, hh)] = w
                    next_x.add(j)
        kept_x = next_x
    return edges


def _edges(graph):
    return {(e["source"], e["target"], e["kind"], e["head"]): e["importance"] for e in graph.edges}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_naive_reference(family):
    model = make_decoder(family, attn="eager", layers=3, seed=2)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    tau = 0.02
    g = InformationFlowRoutes(model).attribute(ids, position=-1, threshold=tau)
    ref = naive_graph(model, ids, 6, tau)
    got = _edges(g)
    assert len(ref) > 10 and any(k[2] == "head" for k in ref)
    assert set(got) == set(ref)
    scale = max(ref.values())
    # the reference's probabilities are HF's eager ones, softmaxed in float32 (the package's in float64)
    assert max(abs(got[k] - ref[k]) for k in ref) < 1e-6 * scale
    # every node but the start has an outgoing edge, every edge's ends are nodes
    ids_ = {n["id"] for n in g.nodes}
    assert all(e["source"] in ids_ and e["target"] in ids_ for e in g.edges)
    assert g.meta["rows_per_layer"][-1] == 1
    # token-level edges (heads summed per source), thresholded as such
    gt = InformationFlowRoutes(model).attribute(ids, threshold=tau, granularity="token")
    reft, gott = naive_graph(model, ids, 6, tau, "token"), _edges(gt)
    assert set(gott) == set(reft) and any(k[2] == "attention" for k in reft)
    assert max(abs(gott[k] - reft[k]) for k in reft) < 1e-6
    e = next(e for e in gt.edges if e["kind"] == "attention")
    assert abs(sum(e["head_importances"]) - e["importance"]) < 1e-12


def test_padding_chunks_and_earlier_position(monkeypatch):
    import captum_normattr.decompose.methods.routes as routes_math

    model = make_decoder("llama", layers=2, seed=4)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    alone = InformationFlowRoutes(model).attribute(ids, position=4, threshold=0.01)
    padded_ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    small = InformationFlowRoutes(model, memory_budget_mb=1e-6)  # one row per chunk
    monkeypatch.setattr(routes_math, "ROUTES_TILE_BYTES", 1000)  # ... and tiles of 1 and 2 sources
    padded = small.attribute(padded_ids, attention_mask=mask, position=4, threshold=0.01)
    monkeypatch.undo()
    a, b = _edges(alone), _edges(padded)
    assert set(a) == set(b) and len(a) > 5
    assert max(abs(a[k] - b[k]) for k in a) < 1e-10
    assert alone.position == padded.position == 4
    assert all(e["source_position"] <= 4 for e in alone.edges)  # causal: nothing after the explained token
    holes = torch.tensor([[1, 1, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="contiguous"):
        small.attribute(ids, attention_mask=holes)


def test_importances_are_normalised_and_threshold_monotone():
    y = torch.randn(5, 8, dtype=torch.float64)
    mid, ff = 0.7 * y + 0.1 * torch.randn_like(y), 0.3 * y
    w = ff_edge_importances(mid, ff, mid + ff)
    assert torch.allclose(w.sum(-1), torch.ones(5, dtype=torch.float64))
    assert (proximity(torch.zeros(2, 8, dtype=torch.float64), y[0]) == 0).all()
    model = make_decoder("gpt2", layers=2, seed=1)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    r = InformationFlowRoutes(model)
    loose, tight = r.attribute(ids, threshold=0.01), r.attribute(ids, threshold=0.1)
    assert set(_edges(tight)) <= set(_edges(loose)) and len(_edges(tight)) < len(_edges(loose))
    everything = r.attribute(ids, threshold=0.0)
    into = {}
    for e in everything.edges:
        into[e["target"]] = into.get(e["target"], 0.0) + e["importance"]
    assert all(abs(v - 1) < 1e-12 for v in into.values())  # tau = 0: every positive edge, summing to 1
    assert abs(float(everything.token_flow().sum()) - 1) < 1e-12  # ... so the flow is conserved
    assert float(tight.token_flow().sum()) < 1 and (tight.token_flow() >= 0).all()
    hf = everything.head_flow()  # per layer, the heads carry part of the flow through that layer's m nodes
    assert (hf >= 0).all() and (hf.sum(-1) <= 1 + 1e-12).all() and (hf.sum(-1) > 0).all()
    assert everything.top_heads(1, by="flow")[0][:2] == tuple(divmod(int(hf.argmax()), hf.shape[1]))
    with pytest.raises(ValueError, match="by must be"):
        everything.top_heads(1, by="x")
    with pytest.raises(ValueError, match="one example"):
        r.attribute(ids.repeat(2, 1))
    with pytest.raises(ValueError, match="threshold"):
        r.attribute(ids, threshold=1.5)
    from conftest import make_model

    with pytest.raises(NotImplementedError, match="post-LN"):
        InformationFlowRoutes(make_model("bert"))
    with torch.no_grad():
        model.transformer.wte.weight[ids[0, 2]] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        r.attribute(ids)


def test_exports():
    model = make_decoder("llama", layers=2, seed=0)
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    toks = ["<s>", "a", "<script>", 'b"c', "$x"]
    g = InformationFlowRoutes(model).attribute(ids, threshold=0.03, tokens=toks)
    d = g.to_json()
    again = RouteGraph.from_json(json.dumps(d))
    assert again.to_json() == d and d["tokens"] == toks
    nxg = g.to_networkx()
    assert set(nxg.nodes) >= {n["id"] for n in g.nodes}
    total = sum(sum(p["importance"] for p in nxg[u][v]["parts"]) for u, v in nxg.edges)
    ff = sum(e["importance"] for e in g.edges if e["kind"] == "ff")
    assert abs(total - (sum(e["importance"] for e in g.edges) + ff)) < 1e-9  # FF edges appear twice (m->f->x)
    from captum_normattr.present.interactive import routes_report_html

    html = routes_report_html(g)
    assert html.startswith("<!DOCTYPE html>") and "<script>" not in html.split("report-data")[1].split("</script>")[0]
    assert "src=" not in html and "https:" not in html  # self-contained: nothing to fetch


# --- a decoder trained here to copy the token at position 1 to the last position ----------------------
def _trained_copier():
    r"""2 layers x 4 heads; a group-lasso penalty on every head's slice of W_O makes few heads do the copy."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=16, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        ids = torch.randint(2, 16, (32, 8), generator=g)
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, -1], ids[:, 1])
        heads = sum(l.self_attn.o_proj.weight.view(32, 4, 8).pow(2).sum((0, 2)).sqrt().sum() for l in model.model.layers)
        opt.zero_grad()
        (loss + 0.03 * heads).backward()
        opt.step()
    return model.double().eval(), float(loss.detach())


def _zeroed_logit(model, ids, layer, head, target):
    at = model.model.layers[layer].self_attn
    dh = model.config.hidden_size // model.config.num_attention_heads

    def pre(m, args):
        x = args[0].clone()
        x[..., head * dh:(head + 1) * dh] = 0
        return (x,)

    hook = at.o_proj.register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            return float(model(input_ids=ids).logits[0, -1, target])
    finally:
        hook.remove()


@pytest.fixture(scope="module")
def copier():
    return _trained_copier()


@pytest.mark.parametrize("by", ["flow", "importance"])
def test_top_route_head_matters_on_a_trained_model(copier, by):
    model, loss = copier
    assert loss < 0.2, f"the copy task was not learned (loss {loss:.3f})"
    wins, moved_all, others_all = 0, [], []
    for seed in range(5):
        ids = torch.randint(2, 16, (1, 8), generator=torch.Generator().manual_seed(seed))
        target = int(ids[0, 1])
        with torch.no_grad():
            base = float(model(input_ids=ids).logits[0, -1, target])
        g = InformationFlowRoutes(model).attribute(ids, threshold=0.04)
        (layer, head, _), = g.top_heads(1, by=by)
        moved = abs(_zeroed_logit(model, ids, layer, head, target) - base)
        others = [abs(_zeroed_logit(model, ids, layer, h, target) - base) for h in range(4) if h != head]
        wins += moved > max(others)
        moved_all.append(moved)
        others_all += others
        # the top head's strongest kept edge reads the copied token (position 1)
        best = max((e for e in g.edges if e["kind"] == "head" and e["layer"] == layer and e["head"] == head),
                   key=lambda e: e["importance"])
        assert best["source_position"] == 1
    assert wins >= 4, (moved_all, others_all)
    assert sum(moved_all) / 5 > 3 * sum(others_all) / len(others_all)
