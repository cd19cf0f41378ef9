r"""Vision Transformers (ViT, DeiT-distilled, DINOv2 with layer scale and registers): exact parts, Captum image contract."""
import pytest
import torch
from captum.attr import NoiseTunnel
from layer_capture import capture_layers
from reference import ln2_parts
from transformers import (
    DeiTConfig,
    ViTConfig,
    ViTModel,
)

from captum_normattr import (
    ALTIAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
    UnsupportedModelError,
)
from captum_normattr.attr.images import spread_over_pixels
from captum_normattr.decompose.kinds.pre_ln import pre_ln_alti_map, pre_ln_layer_maps, residual_parts
from captum_normattr.decompose.primitives.feed_forward import ff_parts
from vision_models import SMALL, images, make_vision, perturb as _perturb  # noqa: F401

FAMILIES = ["vit", "deit", "dinov2", "dinov2_reg"]








def _prefix(family):
    return {"vit": 1, "deit": 2, "dinov2": 1, "dinov2_reg": 3}[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_of_every_layer_equal_real_tensors(family):
    model = make_vision(family)
    x = images()
    layers = capture_layers(model, x)
    t = _prefix(family) + 16
    v = torch.ones(2, t, dtype=torch.bool)
    for layer in layers:
        assert layer.topology == "pre_ln" and not layer.causal and layer.hidden_in.shape[1] == t
        assert (layer.probs.triu(1) > 0).any()  # bidirectional
        # the real tensors of the model: layer output = h + (layer-scaled) FF output
        assert (layer.ln2_in + layer.ff_out - layer.layer_out).abs().max() < 1e-12
        h = residual_parts(layer)
        assert (h.sum(2) + layer.out_bias - layer.ln2_in).abs().max() < 1e-10  # layer scale 1 folded into W_O, b_O
        u, u_b = ln2_parts(layer)
        assert (u.sum(2) + u_b - layer.ln2_out).abs().max() < 1e-10
        f = layer.ff
        parts, bias = ff_parts(u, u_b, f.w_in, f.b_in, f.act, f.w_out, f.b_out)
        assert (parts.sum(2) + bias - layer.ff_out).abs().max() < 1e-10  # layer scale 2 folded into W_out, b_out
        maps, _ = pre_ln_layer_maps(layer, v, causal=False)
        assert torch.allclose(maps["N_RES"], h.norm(dim=-1), atol=1e-12)
        assert torch.allclose(maps["N_RESLN"], u.norm(dim=-1), atol=1e-12)
        c = (layer.ln2_in.abs().sum(-1)[:, :, None] - (layer.ln2_in[:, :, None] - h).abs().sum(-1)).clamp_min(0)
        naive_alti = c / c.sum(-1, keepdim=True)
        for chunk in (None, 1, 5):
            assert torch.allclose(pre_ln_alti_map(layer, v, chunk, causal=False), naive_alti, atol=1e-12)


def test_layer_scale_is_needed():
    r"""Without folding the layer scale, the parts would miss the real tensors: the test above can fail."""
    model = make_vision("dinov2")
    layer = capture_layers(model, images())[0]
    scale = model.dinov2.encoder.layer[0].layer_scale1.lambda1.detach()
    unscaled_o = layer.out_weight / scale
    h = layer.hidden_in + torch.einsum("bhij,bjhe->bihe", layer.probs, layer.values.transpose(1, 2)).flatten(2) @ unscaled_o
    assert (h + layer.out_bias / scale - layer.ln2_in).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_methods_complete_and_image_shaped(family):
    model = make_vision(family)
    x = images()
    for attr in (GlobEncAttribution(model), ALTIAttribution(model), FFIntegratedDecomposition(model)):
        res = attr.decompose(x)
        assert res.extras["completeness_error"].max() < 1e-10
        if "layer_completeness_error" in res.extras:
            assert res.extras["layer_completeness_error"].max() < 1e-10
        assert res.layer_maps.shape == (2, 2, res.scores.shape[1], res.scores.shape[1])
        assert res.extras["patch_grid"].shape == (2, 4, 4)
        assert torch.equal(res.extras["patch_grid"].flatten(1), res.scores[:, _prefix(family) :])
        out = attr.attribute(x)
        assert out.shape == x.shape and out.dtype == x.dtype
        # each patch's pixels sum to its token score
        patch = out.sum(1).reshape(2, 4, 4, 4, 4).sum((2, 4))
        assert torch.allclose(patch, res.extras["patch_grid"], atol=1e-12)
        assert isinstance(attr.attribute((x,)), tuple)


@pytest.mark.parametrize("family", FAMILIES)
def test_decompx_complete_to_the_logit(family):
    model = make_vision(family)
    x = images()
    adj = DecompXAttribution(model).decompose(x)
    fwd = DecompXAttribution(model, algorithm="forward").decompose(x)
    assert adj.delta.max() <= 1e-10 and adj.extras["all_class_delta"].max() <= 1e-10
    assert fwd.delta.max() <= 1e-10 and fwd.extras["all_class_delta"].max() <= 1e-10
    assert fwd.layer_errors.max() <= 1e-10
    assert torch.allclose(adj.class_scores, fwd.class_scores, atol=1e-10)  # adjoint = explicit parts
    assert torch.allclose(adj.logits, model(pixel_values=x).logits, atol=1e-12)
    assert (adj.scores[:, : _prefix(family)].abs() > 0).all()  # [CLS]/distillation/registers get scores too
    spread = DecompXAttribution(model, bias_mode="spread").decompose(x)
    assert spread.delta.max() <= 1e-10 and spread.bias_scores.abs().max() == 0
    scores, delta = DecompXAttribution(model).attribute(x, target=1, return_convergence_delta=True)
    assert scores.shape == x.shape and delta.max() <= 1e-10
    assert torch.allclose(scores.sum((1, 2, 3)), fwd.class_scores[:, _prefix(family) :, 1].sum(1), atol=1e-12)


def test_heads_define_the_explained_rows():
    r"""DeiT-distilled: [CLS] and distillation rows, weights halved; DINOv2: [CLS] + mean of patches (no registers)."""
    deit = make_vision("deit")
    res = DecompXAttribution(deit, algorithm="forward", full_last_layer=True).decompose(images())
    cls_only = deit.cls_classifier(deit.deit(pixel_values=images()).last_hidden_state[:, 0])
    dist_only = deit.distillation_classifier(deit.deit(pixel_values=images()).last_hidden_state[:, 1])
    assert torch.allclose(res.logits, (cls_only + dist_only) / 2, atol=1e-12)
    dino = make_vision("dinov2_reg")
    head = DecompXAttribution(dino).output.linear_head(19, 3, torch.float64)
    assert head.rows.tolist() == [0] + list(range(3, 19))


@pytest.mark.parametrize("family", ["vit", "deit", "dinov2_reg"])
def test_batch_equals_single(family):
    model = make_vision(family)
    x = images(3, seed=4)
    for attr in (GlobEncAttribution(model), ALTIAttribution(model), FFIntegratedDecomposition(model), DecompXAttribution(model)):
        batch = attr.attribute(x)
        for i in range(3):
            assert torch.allclose(attr.attribute(x[i : i + 1]), batch[i : i + 1], atol=1e-12)


def test_other_image_sizes_interpolate_positions():
    for family in ("vit", "deit", "dinov2_reg"):
        model = make_vision(family)
        x = images(1, side=24)
        res = DecompXAttribution(model).decompose(x)
        assert res.delta.max() <= 1e-10 and res.extras["patch_grid"].shape == (1, 6, 6)
        kw = {} if family.startswith("dinov2") else {"interpolate_pos_encoding": True}  # DINOv2 always interpolates
        assert torch.allclose(res.logits, model(pixel_values=x, **kw).logits, atol=1e-12)
        assert GlobEncAttribution(model).attribute(x).shape == x.shape
        assert ALTIAttribution(model).decompose(x).scores.shape == (1, _prefix(family) + 36)


def test_deit_without_teacher_reads_cls_only():
    from transformers import DeiTForImageClassification

    torch.manual_seed(0)
    model = _perturb(DeiTForImageClassification(DeiTConfig(intermediate_size=24, **SMALL)).double().eval())
    x = images()
    res = DecompXAttribution(model).decompose(x)
    assert res.delta.max() <= 1e-10 and res.extras["num_prefix_tokens"] == 2
    assert torch.allclose(res.logits, model(pixel_values=x).logits, atol=1e-12)
    head = DecompXAttribution(model).output.linear_head(18, 2, torch.float64)
    assert head.rows.tolist() == [0]  # the distillation token is read by no head here


def test_swiglu_dinov2_complete_up_to_quadrature():
    model = make_vision("dinov2", swiglu=True)
    x = images()
    res = FFIntegratedDecomposition(model).decompose(x)
    assert res.extras["completeness_error"].max() < 1e-6
    dx = DecompXAttribution(model).decompose(x)
    assert dx.delta.max() < 1e-6


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_model_unchanged_and_captum_tools(attn):
    model = make_vision("dinov2")
    model.config._attn_implementation = attn
    x = images()
    before = model(pixel_values=x).logits
    model.train()
    model.dinov2.encoder.layer[0].eval()
    flags = {n: m.training for n, m in model.named_modules()}
    hooks = _hook_count(model)
    for attr in (GlobEncAttribution(model), ALTIAttribution(model), FFIntegratedDecomposition(model), DecompXAttribution(model)):
        attr.attribute(x)
        with torch.no_grad():
            nt = NoiseTunnel(attr).attribute(x, nt_type="smoothgrad", nt_samples=2, stdevs=0.1)
        assert nt.shape == x.shape
    assert {n: m.training for n, m in model.named_modules()} == flags
    assert model.config._attn_implementation == attn and _hook_count(model) == hooks
    model.eval()
    torch.testing.assert_close(model(pixel_values=x).logits, before, rtol=0, atol=0)


def test_visualize_image_attr():
    import matplotlib

    matplotlib.use("Agg")
    from captum.attr import visualization as viz

    model = make_vision("vit")
    x = images(1)
    a = DecompXAttribution(model).attribute(x)
    fig, _ = viz.visualize_image_attr(
        a[0].permute(1, 2, 0).numpy(), x[0].permute(1, 2, 0).numpy(), method="blended_heat_map", sign="all", use_pyplot=False
    )
    assert fig is not None


def test_spread_over_pixels():
    g = torch.arange(6.0).view(1, 2, 3)
    out = spread_over_pixels(g, 2, 3)
    assert out.shape == (1, 3, 4, 6)
    assert torch.allclose(out.sum(1).reshape(1, 2, 2, 3, 2).sum((2, 4)), g)


def test_clear_errors():
    from transformers import BeitConfig, BeitForImageClassification, SwinConfig, SwinForImageClassification

    swin = SwinForImageClassification(SwinConfig(image_size=16, patch_size=4, embed_dim=8, depths=[1], num_heads=[2], window_size=2))
    beit = BeitForImageClassification(
        BeitConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                   use_relative_position_bias=True)
    )
    for m in (swin, beit):
        with pytest.raises(UnsupportedModelError, match="Supported vision families: ViT, DeiT, DINOv2"):
            GlobEncAttribution(m)
    with pytest.raises(UnsupportedModelError, match="no supported image-classification head"):
        DecompXAttribution(ViTModel(ViTConfig(**{k: v for k, v in SMALL.items() if k != "num_labels"})))
    model = make_vision("vit")
    g = GlobEncAttribution(model)
    x = images()
    bad = [
        (x.long(), TypeError, "float tensor"),
        (x[0], ValueError, "batch"),
        (x.permute(0, 2, 3, 1)[:, :, :, :3].contiguous()[:, :, :, :].reshape(2, 16, 16, 3), ValueError, "channels"),
        (images(1, side=18), ValueError, "multiples of the patch size 4"),
    ]
    for inp, err, msg in bad:
        with pytest.raises(err, match=msg):
            g.attribute(inp)
    with pytest.raises(ValueError, match="no additional_forward_args"):
        g.attribute(x, additional_forward_args=torch.ones(2, 17))
    # GlobEnc's plain readings still work on the bare ViTModel
    bare = _perturb(ViTModel(ViTConfig(**{k: v for k, v in SMALL.items() if k != "num_labels"})).double().eval())
    assert GlobEncAttribution(bare).attribute(x).shape == x.shape


def test_pictures_and_cli(tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from PIL import Image
    from transformers import ViTImageProcessor

    from captum_normattr.cli.main import main
    from captum_normattr.present.vision import layer_patch_rows, patch_heatmap

    model = make_vision("vit").float()
    res = GlobEncAttribution(model).decompose(images().float())
    assert patch_heatmap(images()[0], res.extras["patch_grid"][0], title="GlobEnc") is not None
    assert layer_patch_rows(res.layer_maps[0], 0, (4, 4), 1) is not None
    model.save_pretrained(tmp_path / "m")
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(tmp_path / "m")
    png = tmp_path / "digit.png"
    Image.fromarray((np.random.default_rng(0).random((20, 20, 3)) * 255).astype("uint8")).save(png)
    code = main(["--image", str(png), "--model", str(tmp_path / "m"), "-m", "globenc", "decompx", "--plots", str(tmp_path / "p")])
    assert code == 0
    out = capsys.readouterr().out
    assert "top patches" in out and "[CLS]" in out
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "digit_decompx_heatmap.png", "digit_globenc_heatmap.png", "digit_globenc_layers.png"
    ]



def test_image_cli_neutralises_label_names_and_paths(tmp_path, capsys):
    r"""The model config's label names and the image's file name reach the terminal neutralised."""
    import numpy as np
    from PIL import Image
    from transformers import ViTImageProcessor

    from captum_normattr.cli.main import main

    model = make_vision("vit").float()
    evil = "cat\x1b[31m red \u202eevil"
    model.config.id2label = {i: evil for i in range(model.config.num_labels)}
    model.config.label2id = {evil: 0}
    model.save_pretrained(tmp_path / "m")
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(tmp_path / "m")
    png = tmp_path / "a\u202egnp.png"
    Image.fromarray((np.random.default_rng(0).random((20, 20, 3)) * 255).astype("uint8")).save(png)
    assert main(["--image", str(png), "--model", str(tmp_path / "m"), "-m", "globenc", "-q"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    assert "cat\\x1b[31m red \\u202eevil" in out and "a\\u202egnp.png" in out

@pytest.mark.parametrize("mode", ["cpu_offload", "disk_offload"])
def test_dinov2_under_accelerate_equals_the_plain_model(mode, tmp_path):
    r"""DINOv2's layer scales are read through the accelerate-safe weight reader like every other weight."""
    import copy

    from accelerate import cpu_offload, disk_offload

    model = make_vision("dinov2_reg")
    x = images()
    m = copy.deepcopy(model)
    m = cpu_offload(m) if mode == "cpu_offload" else disk_offload(m, str(tmp_path / "offload"))
    lambda1 = m.base_model.encoder.layer[0].layer_scale1.lambda1
    if mode == "disk_offload":
        assert lambda1.device.type == "meta"  # the scale really is off the module
    for build in (GlobEncAttribution, ALTIAttribution, FFIntegratedDecomposition, DecompXAttribution):
        plain, dispatched = build(model).decompose(x), build(m).decompose(x)
        assert (plain.scores - dispatched.scores).abs().max() <= 1e-12, build.__name__
        if getattr(plain, "layer_maps", None) is not None:
            assert (plain.layer_maps - dispatched.layer_maps).abs().max() <= 1e-12, build.__name__
        if plain.delta is not None:
            assert dispatched.delta.max() <= 1e-10, build.__name__
    torch.testing.assert_close(m(pixel_values=x).logits, model(pixel_values=x).logits, rtol=0, atol=1e-12)
