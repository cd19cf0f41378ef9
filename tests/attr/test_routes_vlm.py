r"""Information-flow routes of vision-language models (docs/routes.md, "Vision-language models").

The routes take the processor's outputs by keyword (``additional_forward_args``), through the same input
preparation as every other method. On tiny float64 models (LLaVA, Qwen2-VL with M-RoPE, PaliGemma with its two-way
prefix, Qwen3-VL with DeepStack, Llama 4 with images, Gemma 4 with its two-way image spans, and the sandwich
decoders Gemma 3 with its two-way image spans and PaliGemma 2 with its Gemma 2 decoder and two-way prefix):

- every edge and importance equals a naive reference built from the model's own modules on the model's own
  forward pass WITH the image (hooks on each layer's input, the attention's probabilities (float64 eager attention),
  the value projection, the second norm's input and the feed-forward output; a sandwich layer's attention post-norm
  frozen at its real per-token scale, the ratio of its real output to its real input, and its feed-forward post-norm's
  output; Qwen3-VL's DeepStack additions read
  from the text model's own call), whose edge vectors are first checked to sum to the model's real tensors; the
  same reference run without the image differs (so a graph built without the image would fail);
- token ids holding image tokens without ``pixel_values`` are refused;
- at threshold 0 the importances into every node sum to 1 and the token flow to 1;
- a left-padded example gives the graph of the example alone; the model is left as found;
- a bad keyword is refused with the message every other method gives.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum_normattr import ALTILogitAttribution  # noqa: E402
from captum_normattr.arch.spec import UnsupportedModelError  # noqa: E402
from captum_normattr.attr.routes import InformationFlowRoutes  # noqa: E402
from captum_normattr.present.interactive import routes_report_html  # noqa: E402
from captum_normattr.models.adapters import get_adapter, layer_modules, vision_language  # noqa: E402
from route_reference import LayerPieces, naive_prune  # noqa: E402
from vlm_checks import check_model_unchanged  # noqa: E402
from vlm_families import gemma3_batch, make_gemma3, make_paligemma, paligemma_batch  # noqa: E402
from vlm_models import QWEN_IMAGE, llava_batch, make_llava, make_qwen2_vl, qwen2_vl_batch  # noqa: E402
from vlm_qwen3 import make_qwen3_vl  # noqa: E402
from vlm_tiled import llama4_batch, make_llama4  # noqa: E402
from zoo import EXACT_ATTENTION  # noqa: E402


def _llava(seed=0):
    ids, mask, pixels = llava_batch([5, 2], seed=seed)
    return ids, mask, {"pixel_values": pixels}


def _qwen(seed=0):
    ids, mask, extra = qwen2_vl_batch([5, 2], seed=seed)
    ids[ids == QWEN_IMAGE - 3] = 5  # the random text holds no video token (refused without pixel_values_videos)
    return ids, mask, extra


def _pali(seed=0):
    return paligemma_batch([4, 2], seed=seed, token_types=True)


def _gemma3(seed=0):
    return gemma3_batch([4, 2], seed=seed)


def _llama4(seed=0):
    return llama4_batch([4, 2], seed=seed, tiles=((1, 1), (1, 1)))


def _slice(extra, b, keep, n_rows):
    r"""Example ``b``'s own inputs: per-token inputs (B, T) cut at ``keep``, per-example ones at ``b``; the Qwen
    route's flattened patches by its grid."""
    out = {}
    for k, v in extra.items():
        if k == "pixel_values" and "image_grid_thw" in extra:
            n = extra["image_grid_thw"].prod(-1)
            start = int(n[:b].sum())
            out[k] = v[start:start + int(n[b])]
        elif v.dim() == 2 and v.shape == (n_rows, keep.numel()):
            out[k] = v[b:b + 1, keep]
        else:
            out[k] = v[b * v.shape[0] // n_rows:(b + 1) * v.shape[0] // n_rows]
    return out


#: name -> (builder, batch (two left-padded examples), the FF module's name in a layer)
CASES = {
    "llava": (lambda: make_llava(seed=1), _llava, "mlp"),
    "qwen2_vl": (lambda: make_qwen2_vl(seed=1), _qwen, "mlp"),
    "paligemma_two_way": (lambda: make_paligemma(seed=1), _pali, "mlp"),
    "qwen3_vl_deepstack": (lambda: make_qwen3_vl(seed=1), _qwen, "mlp"),
    "llama4": (lambda: make_llama4(seed=1)[0], _llama4, "feed_forward"),
    # sandwich decoders: the FF branch as it joins the stream is the FF post-norm's output
    "gemma3_two_way": (lambda: make_gemma3(seed=1), _gemma3, "post_feedforward_layernorm"),
    "paligemma2_two_way": (lambda: make_paligemma(seed=1, text="gemma2"), _pali, "post_feedforward_layernorm"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    make, batch, ff = CASES[request.param]
    model = make()
    model.set_attn_implementation(EXACT_ATTENTION)  # the reference reads float64 probabilities from the modules
    return request.param, model, batch, ff


def _single(batch, b=0, seed=0):
    r"""Example ``b`` of ``batch`` alone (its real tokens only) and its inputs."""
    ids, mask, extra = batch(seed)
    keep = mask[b].bool()
    return ids[b:b + 1, keep], _slice(extra, b, keep, ids.shape[0])


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def naive_edges(model, ids, extra, ff_name, position, tau):
    r"""Every kept edge (source, target, kind, head) -> importance, from the model's own modules on its own forward
    pass with ``extra``; and the worst relative error of the edge vectors' sums against the model's tensors."""
    layers = layer_modules(model, get_adapter(model))
    rec = [dict() for _ in layers]
    seen = {}
    hooks = []

    def put(l, key, value):
        rec[l][key] = value.detach()[0]

    def text_model_inputs(module, args, kwargs):
        if kwargs.get("deepstack_visual_embeds") is not None:
            seen["mask"], seen["embeds"] = kwargs["visual_pos_masks"][0], list(kwargs["deepstack_visual_embeds"])

    text_model = getattr(getattr(model, "model", None), "language_model", None)
    if text_model is not None:
        hooks.append(text_model.register_forward_pre_hook(text_model_inputs, with_kwargs=True))
    for l, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, k, l=l: put(l, "x", a[0] if a else k["hidden_states"]), with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, l=l: put(l, "probs", o[1])))
        hooks.append(layer.self_attn.v_proj.register_forward_hook(lambda m, a, o, l=l: put(l, "v", o)))
        if hasattr(layer, "pre_feedforward_layernorm"):  # sandwich: P1's input a and output, h the second norm's input
            hooks.append(layer.post_attention_layernorm.register_forward_hook(
                lambda m, a, o, l=l: put(l, "a", a[0]) or put(l, "P", o)))
            hooks.append(layer.pre_feedforward_layernorm.register_forward_pre_hook(lambda m, a, l=l: put(l, "h", a[0])))
        else:
            hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a, l=l: put(l, "h", a[0])))
        hooks.append(getattr(layer, ff_name).register_forward_hook(  # experts: (B T, D)
            lambda m, a, o, l=l: put(l, "F", (o[0] if isinstance(o, tuple) else o).reshape(1, -1, o[0].shape[-1]))))
        hooks.append(layer.register_forward_hook(lambda m, a, o, l=l: put(l, "y", o[0] if isinstance(o, tuple) else o)))
    if vision_language(model).positions == "package":  # the positions the package passes (PaliGemma's own count from 1)
        extra = dict(extra, position_ids=torch.arange(ids.shape[1])[None])
    try:
        model(input_ids=ids, **extra)
    finally:
        for h in hooks:
            h.remove()
    worst = [0.0]

    def pieces(l):
        r, attention = rec[l], layers[l].self_attn
        out_parts = {"residual": r["h"], "ff": r["F"]}
        total = rec[l + 1]["x"] if l + 1 < len(layers) else r["y"]  # the stream the next layer reads
        if "embeds" in seen and l < len(seen["embeds"]):  # DeepStack: the model's own addition after layer l
            d = torch.zeros_like(r["h"])
            d[seen["mask"]] = seen["embeds"][l].to(d.dtype)
            out_parts["own_addition"] = d
        worst[0] = max(worst[0], _rel(sum(out_parts.values()), total))
        probs = r["probs"]  # (H, T, T)
        n_heads, t = probs.shape[0], probs.shape[-1]
        wo = attention.o_proj.weight  # (D, H Dh)
        dh = wo.shape[1] // n_heads
        v = r["v"].reshape(t, -1, dh)  # (T, H_kv, Dh)
        f = torch.stack([v[:, h // (n_heads // v.shape[1])] @ wo[:, h * dh:(h + 1) * dh].T for h in range(n_heads)])
        parts = probs[:, :, :, None] * f[:, None, :, :]  # (H, T_i, T_j, D): every source, two-way or causal
        if "P" in r:  # sandwich: P1 frozen at its real per-token scale, a diagonal map P1(a)_i / a_i
            parts = parts * (r["P"] / r["a"])[None, :, None, :]
        bias = attention.o_proj.bias if attention.o_proj.bias is not None else 0.0
        worst[0] = max(worst[0], _rel(r["x"] + parts.sum((0, 2)) + bias, r["h"]))
        return LayerPieces(out_parts, total, r["x"], r["h"], parts, l)

    edges = naive_prune(len(layers), position, tau, pieces)
    return edges, worst[0]


def _edges(graph):
    return {(e["source"], e["target"], e["kind"], e["head"]): e["importance"] for e in graph.edges}


def _image_positions(model, ids):
    config = model.config
    token = next(getattr(config, n) for n in ("image_token_id", "image_token_index") if getattr(config, n, None))
    return set(torch.nonzero(ids[0] == token).flatten().tolist())


def test_every_edge_equals_the_naive_reference_with_the_image(case):
    name, model, batch, ff = case
    ids, extra = _single(batch, seed=2)
    tau = 0.01
    pos = ids.shape[1] - 1
    ref, worst = naive_edges(model, ids, extra, ff, pos, tau)
    assert worst < 1e-12, (name, worst)  # the reference's edge vectors sum to the model's own tensors
    g = InformationFlowRoutes(model).attribute(ids, additional_forward_args=extra, threshold=tau)
    got = _edges(g)
    assert len(ref) > 10 and any(k[2] == "head" for k in ref) and any(k[2] == "ff" for k in ref)
    assert set(got) == set(ref), (name, set(got) ^ set(ref))
    err = max(abs(got[k] - ref[k]) for k in ref)
    print(f"{name}: {len(ref)} edges, reference vectors {worst:.1e}, importances {err:.1e}")
    assert err < 1e-10, (name, err)
    images = _image_positions(model, ids)
    assert images and any(int(e["source"].split("_")[1]) in images for e in g.edges if e["kind"] == "head")
    if name == "qwen3_vl_deepstack":  # the DeepStack additions: leaves at the image tokens of layers 0 and 1
        leaves = {n["id"] for n in g.nodes if n["kind"] == "p"}
        assert leaves and all(int(x[1:].split("_")[0]) < 2 and int(x.split("_")[1]) in images for x in leaves)
    if name.endswith("two_way"):  # the prefix / the image is attended two-way: head edges from later sources
        whole = InformationFlowRoutes(model).attribute(ids, additional_forward_args=extra, threshold=0.0)
        assert any(e["source_position"] > e["target_position"] for e in whole.edges if e["kind"] == "head")
        ref0, _ = naive_edges(model, ids, extra, ff, pos, 0.0)  # and they equal the reference's, every one
        got0 = _edges(whole)
        assert set(got0) == set(ref0) and max(abs(got0[k] - ref0[k]) for k in ref0) < 1e-10, name
    # without the image the model's own graph is another one: a graph that dropped it would fail above
    no_image, _ = naive_edges(model, ids, {k: v for k, v in extra.items() if k != "pixel_values"}, ff, pos, tau)
    diff = max(abs(no_image.get(k, 0.0) - ref.get(k, 0.0)) for k in set(ref) | set(no_image))
    assert diff > 1e-3, (name, diff)


def test_image_tokens_without_pixel_values_are_refused(case):
    name, model, batch, _ = case
    ids, extra = _single(batch)
    with pytest.raises(ValueError, match="no pixel_values"):
        InformationFlowRoutes(model).attribute(ids)
    with pytest.raises(ValueError, match="no pixel_values"):
        InformationFlowRoutes(model).attribute(ids, additional_forward_args={k: v for k, v in extra.items()
                                                                              if k != "pixel_values"})


def test_threshold_zero_conserves_the_flow(case):
    name, model, batch, _ = case
    ids, extra = _single(batch, seed=3)
    g = InformationFlowRoutes(model).attribute(ids, additional_forward_args=extra, threshold=0.0)
    into = {}
    for e in g.edges:
        into[e["target"]] = into.get(e["target"], 0.0) + e["importance"]
    worst = max(abs(v - 1) for v in into.values())
    flow = g.token_flow()
    assert worst < 1e-12 and abs(float(flow.sum()) - 1) < 1e-12 and (flow >= 0).all(), (name, worst)
    assert float(flow[sorted(_image_positions(model, ids))].sum()) > 0
    assert any(n["kind"] == "p" for n in g.nodes) == (name == "qwen3_vl_deepstack")
    assert routes_report_html(g).startswith("<!DOCTYPE html>")  # the report draws the leaves' edges too


def test_padded_equals_single_and_model_unchanged(case):
    name, model, batch, _ = case
    ids, mask, extra = batch(4)
    b = 1  # the shorter example: left-padded
    keep = mask[b].bool()
    assert not keep.all()
    alone = InformationFlowRoutes(model).attribute(ids[b:b + 1, keep], additional_forward_args=_slice(
        extra, b, keep, ids.shape[0]), threshold=0.01)
    full = torch.ones_like(keep)
    padded_extra = dict(_slice(extra, b, full, ids.shape[0]), attention_mask=mask[b:b + 1])

    def run():
        return InformationFlowRoutes(model, memory_budget_mb=1e-6).attribute(
            ids[b:b + 1], additional_forward_args=padded_extra, threshold=0.01)

    padded = run()
    a, p = _edges(alone), _edges(padded)
    assert set(a) == set(p) and len(a) > 5, name
    err = max(abs(a[k] - p[k]) for k in a)
    print(f"{name}: padded vs single {err:.1e}")
    assert err < 1e-10, (name, err)
    check_model_unchanged(model, run, lambda: model(input_ids=ids[b:b + 1], **padded_extra).logits)


def test_a_bad_keyword_is_refused_as_by_the_other_methods(case):
    name, model, batch, _ = case
    ids, extra = _single(batch)
    bad = dict(extra, pixel_value=extra["pixel_values"])
    messages = []
    for call in (lambda: InformationFlowRoutes(model).attribute(ids, additional_forward_args=bad),
                 lambda: ALTILogitAttribution(model).attribute(ids, target=3, additional_forward_args=bad)):
        with pytest.raises(ValueError) as e:
            call()
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "pixel_value'" in messages[0]
    with pytest.raises(ValueError, match="both as arguments"):
        InformationFlowRoutes(model).attribute(ids, attention_mask=torch.ones_like(ids),
                                               additional_forward_args=dict(extra, attention_mask=torch.ones_like(ids)))


def test_video_tokens_without_their_pixels_are_refused():
    model = make_qwen2_vl(seed=2)
    ids, extra = _single(_qwen, seed=5)
    ids = torch.cat([ids, torch.full((1, 2), model.config.video_token_id)], 1)
    extra = dict(extra, mm_token_type_ids=torch.cat([extra["mm_token_type_ids"], torch.full((1, 2), 2)], 1))
    with pytest.raises(ValueError, match="no pixel_values_videos"):
        InformationFlowRoutes(model).attribute(ids, additional_forward_args=extra)


def test_qwen2_vl_uses_the_models_own_m_rope_positions():
    model = make_qwen2_vl(seed=2)
    ids, extra = _single(_qwen, seed=5)
    routes = InformationFlowRoutes(model)
    own = _edges(routes.attribute(ids, additional_forward_args=extra, threshold=0.0))
    counted = torch.arange(ids.shape[1])[None]  # 1-D positions counted over the tokens: not the model's own M-RoPE
    other = _edges(routes.attribute(ids, additional_forward_args=dict(extra, position_ids=counted), threshold=0.0))
    assert max(abs(own.get(k, 0.0) - other.get(k, 0.0)) for k in set(own) | set(other)) > 1e-6


# --- Gemma 4 with images: its own layer kind, two-way image spans on the sliding layers only -----------------------
def _gemma4_single(extra, b, keep):
    return {"pixel_values": extra["pixel_values"][b:b + 1], "image_position_ids": extra["image_position_ids"][b:b + 1],
            "mm_token_type_ids": extra["mm_token_type_ids"][b:b + 1, keep]}


def test_gemma4_two_way_image_spans_flow_padding_and_refusals():
    if not hasattr(transformers, "Gemma4Config"):  # pragma: no cover - older transformers
        pytest.skip("transformers has no Gemma 4")
    from vlm_gemma4 import gemma4_vlm_batch, make_gemma4_vlm

    model = make_gemma4_vlm(seed=1)
    ids, mask, extra = gemma4_vlm_batch([(16, 16), (16, 16)], [4, 2], seed=3)
    keep = mask[1].bool()
    alone_ids, alone = ids[1:2, keep], _gemma4_single(extra, 1, keep)
    routes = InformationFlowRoutes(model)
    g = routes.attribute(alone_ids, additional_forward_args=alone, threshold=0.0)
    into = {}
    for e in g.edges:
        into[e["target"]] = into.get(e["target"], 0.0) + e["importance"]
    worst = max(abs(v - 1) for v in into.values())
    assert worst < 1e-12 and abs(float(g.token_flow().sum()) - 1) < 1e-12
    # the image span is attended two-way on the sliding layers only (mm_token_type_ids came through)
    types = model.config.text_config.layer_types
    later = {e["layer"] for e in g.edges if e["kind"] == "head" and e["source_position"] > e["target_position"]}
    assert later and all(types[l] == "sliding_attention" for l in later)
    causal = routes.attribute(alone_ids, additional_forward_args=dict(alone, mm_token_type_ids=None), threshold=0.0)
    assert not any(e["source_position"] > e["target_position"] for e in causal.edges if e["kind"] == "head")
    # another image, another graph; no image refused
    other = routes.attribute(alone_ids, additional_forward_args=dict(alone, pixel_values=alone["pixel_values"].flip(-1)),
                             threshold=0.0)
    a, o = _edges(g), _edges(other)
    assert max(abs(a.get(k, 0.0) - o.get(k, 0.0)) for k in set(a) | set(o)) > 1e-3
    with pytest.raises(ValueError, match="no pixel_values"):
        routes.attribute(alone_ids)
    # padded == single, the model unchanged
    padded_extra = dict(_gemma4_single(extra, 1, torch.ones_like(keep)), attention_mask=mask[1:2])

    def run():
        return InformationFlowRoutes(model, memory_budget_mb=1e-6).attribute(
            ids[1:2], additional_forward_args=padded_extra, threshold=0.01)

    p, s = _edges(run()), _edges(routes.attribute(alone_ids, additional_forward_args=alone, threshold=0.01))
    assert set(p) == set(s) and len(s) > 5
    err = max(abs(p[k] - s[k]) for k in s)
    print(f"gemma4: padded vs single {err:.1e}, importances into a node {worst:.1e}")
    assert err < 1e-10
    check_model_unchanged(model, run, lambda: model(input_ids=ids[1:2], **padded_extra).logits)
    # a refused input: the message every other method gives
    messages = []
    bad = dict(alone, pixel_values_videos=torch.zeros(1, 2))
    for call in (lambda: routes.attribute(alone_ids, additional_forward_args=bad),
                 lambda: ALTILogitAttribution(model).attribute(alone_ids, target=3, additional_forward_args=bad)):
        with pytest.raises(UnsupportedModelError) as e:
            call()
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "pixel_values_videos" in messages[0]
