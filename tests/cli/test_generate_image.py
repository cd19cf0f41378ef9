r"""``captum-normattr generate --image``: a tiny LLaVA saved with its processor, the heat map PNG and the HTML image;
the refusals (no processor, no image file, a text model's folder)."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from captum_normattr.cli import main as cli
from captum_normattr.cli.generate_image import html_with_images, pixel_heatmap
from vlm_models import make_llava
from vlm_processors import llava_processor


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_llava")
    model = make_llava(seed=2)
    model.config.text_config.bos_token_id, model.config.text_config.eos_token_id = 1, 2
    model.save_pretrained(folder)
    llava_processor().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("img") / "cat.png"
    Image.fromarray((np.random.RandomState(0).rand(16, 24, 3) * 255).astype("uint8")).save(path)
    return str(path)


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_and_png(capsys, tiny_llava, image_file, tmp_path):
    out_file = tmp_path / "out.json"
    code, _, err = run(capsys, "generate", "--model", tiny_llava, "--image", image_file, "w3 w4", "--target-text",
                       "w5 w6", "-m", "alti-logit", "decompx", "--dtype", "float64", "--format", "json", "-o", out_file)
    assert code == 0, err
    rec = json.loads(out_file.read_text())
    assert rec["prompt"].startswith("<image>") and len(rec["generated_ids"]) == 2
    for name, m in rec["methods"].items():
        img = rec["image"]["methods"][name]
        f64 = dict(dtype=torch.float64)
        rows, explained = torch.tensor(m["rows"], **f64), torch.tensor(m["explained"], **f64)
        total = rows.sum(-1) + torch.tensor(m["no_token"], **f64)
        # transformers' Llama RMSNorm computes in float32 even in a float64 model: 1e-6, not float64's 1e-10
        assert float((total - explained).abs().max()) < 1e-6 * float(explained.abs().max())
        patch = torch.tensor(img["patch_attr"], **f64)
        assert patch.shape == (2, 4, 4)
        assert torch.allclose(patch.sum((1, 2)), torch.tensor(img["image_total"], **f64))
    for key in ("alti-logit", "decompx"):
        png = tmp_path / f"out.{key}.heatmap.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert rec["image"]["heatmaps"][key] == png.name


def test_html_has_the_image_and_table(capsys, tiny_llava, image_file, tmp_path):
    out_file = tmp_path / "report.html"
    code, _, err = run(capsys, "generate", "--model", tiny_llava, "--image", image_file, "w3", "--max-new-tokens", "2",
                       "--format", "html", "-o", out_file)
    assert code == 0, err
    page = out_file.read_text()
    assert "data:image/png;base64," in page and "image-heatmaps" in page
    code, out, err = run(capsys, "generate", "--model", tiny_llava, "--image", image_file, "w3", "--target-text", "w5")
    assert code == 0, err
    assert "ALTI-Logit" in out and "heat map" in err


def test_pixel_heatmap_follows_the_crop():
    class Ex:  # the fields pixel_heatmap reads
        patch_attr = torch.arange(4.0).reshape(1, 2, 2)
        inp = type("I", (), {"image": Image.new("RGB", (6, 4))})()
        box = (0.0, 1.0, 4.0, 4.0)

    heat = pixel_heatmap(Ex())
    assert torch.isnan(heat[:, 0]).all() and torch.isnan(heat[:, 5]).all()
    assert torch.equal(heat[:, 1:5], torch.tensor([[0.0, 0, 1, 1]] * 2 + [[2.0, 2, 3, 3]] * 2, dtype=torch.float64))
    page = html_with_images("<html><body>x</body></html>", [("m", b"png")])
    assert page.index("data:image/png") < page.index("</body>")


def test_refusals(capsys, tiny_llava, image_file, tmp_path):
    bare = tmp_path / "no_processor"
    make_llava(seed=2).save_pretrained(bare)
    code, _, err = run(capsys, "generate", "--model", bare, "--image", image_file, "w3", "--target-text", "w5")
    assert code == 2 and "processor_config.json" in err and "processor" in err
    code, _, err = run(capsys, "generate", "--model", tiny_llava, "--image", image_file, "w3", "--chat")
    assert code == 2 and "--chat not supported with --image" in err
    code, _, err = run(capsys, "generate", "--model", tiny_llava, "--image", tmp_path / "missing.png", "w3")
    assert code == 2 and "no such file" in err
    not_image = tmp_path / "x.png"
    not_image.write_text("hello")
    code, _, err = run(capsys, "generate", "--model", tiny_llava, "--image", not_image, "w3")
    assert code == 2 and "not an image" in err


def test_html_is_the_interactive_page_with_the_image_panel(capsys, tiny_llava, image_file, tmp_path):
    import base64

    common = ["generate", "--model", tiny_llava, "--image", image_file, "w3 w4", "--target-text", "w5 w6",
              "-m", "alti-logit", "decompx", "--dtype", "float64"]
    code, _, err = run(capsys, *common, "--format", "json", "-o", tmp_path / "out.json")
    assert code == 0, err
    rec = json.loads((tmp_path / "out.json").read_text())
    code, _, err = run(capsys, *common, "--format", "html", "-o", tmp_path / "out.html")
    assert code == 0, err
    page = (tmp_path / "out.html").read_text()
    assert "image-heatmaps" in page and 'id="image-canvas"' in page  # the PNG figures are kept
    data = json.loads(page.split('id="image-data">')[1].split("</script>")[0])
    report = json.loads(page.split('id="report-data">')[1].split("</script>")[0])
    assert data["orig"] == [16, 24] and data["src"].startswith("data:image/png;base64,")
    assert data["box"] == pytest.approx(rec["image"]["methods"]["ALTI-Logit"]["box"])
    assert sorted(data["grids"]) == sorted(rec["image"]["methods"]) == sorted(report["methods"])
    for name, enc in data["grids"].items():
        grid = np.frombuffer(base64.b64decode(enc["f32"]), dtype="<f4").reshape(enc["n"], enc["rows"], enc["cols"])
        want = np.asarray(rec["image"]["methods"][name]["patch_attr"], dtype=np.float64).astype(np.float32)
        assert np.array_equal(grid, want, equal_nan=True) and enc["n"] == report["methods"][name]["rows"] == 2
