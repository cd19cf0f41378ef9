r"""The LLM API's results carry readable tokens: no ``Ġ`` / ``▁`` in ``input_tokens`` / ``output_tokens``.

``DecompositionLLMAttribution(...).attribute(...)`` returns Captum's ``LLMAttributionResult``
whose labels are the tokens' text (:func:`captum_normattr.tokens.readable_tokens`), so Captum's
``plot_token_attr`` labels its axes with words; the tokenizer's spellings are kept in
``raw_input_tokens`` / ``raw_output_tokens``. Checked with a byte-level BPE (GPT-2 style) and a
SentencePiece BPE (Llama style) tokenizer on tiny float64 decoders of their vocabulary size.
"""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import torch
from captum.attr import LLMAttributionResult, TextTemplateInput, TextTokenInput
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from captum_normattr import ALTIAttribution, ALTILogitAttribution
from captum_normattr.attr.llm import DecompositionLLMAttribution
from captum_normattr.tokens import display_token, readable_tokens
from tiny_tokenizers import byte_level_bpe, sentencepiece_bpe

PROMPT = "The keys to the old wooden cabinet"
TARGET = " are on the table."


def _model(kind, vocab):
    torch.manual_seed(0)
    if kind == "byte-level":
        cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=24, n_layer=2, n_head=4, n_inner=40,
                         bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                          pad_token_id=None)
        model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return model.double().eval()


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def setup(request):
    tok = byte_level_bpe() if request.param == "byte-level" else sentencepiece_bpe()
    marker = "\u0120" if request.param == "byte-level" else "\u2581"
    return request.param, tok, marker, _model(request.param, len(tok))


@pytest.mark.parametrize("cls", [ALTILogitAttribution, ALTIAttribution], ids=lambda c: c.__name__)
def test_result_tokens_are_readable_and_the_raw_ones_are_kept(setup, cls):
    kind, tok, marker, model = setup
    inp = TextTokenInput(PROMPT, tok)
    llm = DecompositionLLMAttribution(cls(model), tok)
    res = llm.attribute(inp, target=TARGET)
    assert type(res) is LLMAttributionResult  # Captum's own class
    raw_in, raw_out = res.raw_input_tokens, res.raw_output_tokens
    assert raw_in == list(inp.values)  # the tokenizer's spelling, as Captum's input holds it
    target_ids = tok.encode(TARGET, add_special_tokens=False)
    assert raw_out == tok.convert_ids_to_tokens(target_ids)
    assert any(marker in t for t in raw_in) and any(marker in t for t in raw_out)  # the markers were there
    labels = res.input_tokens + res.output_tokens
    assert not any(marker in t for t in labels), labels
    # each label is the token's text: the marker (the space before a word) dropped, the letters kept;
    # a token that is a space alone shows as "␣" (display_token), never as nothing
    assert res.input_tokens == [t.replace(marker, "") or "\u2423" for t in raw_in]
    assert res.output_tokens == [t.replace(marker, "") or "\u2423" for t in raw_out]
    assert res.input_tokens == [display_token(t) for t in readable_tokens(tok, inp.itp_tensor[0])]
    assert "".join(res.output_tokens).replace("\u2423", "") == TARGET.replace(" ", "")
    assert res.token_attr.shape == (len(target_ids), len(raw_in))
    fig, ax = res.plot_token_attr()  # Captum's plot: clean axis labels
    try:
        shown = [t.get_text() for t in ax.get_xticklabels()] + [t.get_text() for t in ax.get_yticklabels()]
        assert not any(marker in t for t in shown) and "keys" in " ".join(shown)
    finally:
        plt.close(fig)


def test_exclude_sink_drops_the_same_column_of_both_spellings(setup):
    _, tok, _, model = setup
    inp = TextTokenInput(PROMPT, tok)
    ex = DecompositionLLMAttribution(ALTIAttribution(model), tok).decompose(inp, target=TARGET)
    kept, dropped = ex.to_captum(), ex.to_captum(exclude_sink=True)
    if ex.sink_feature() is None:  # no BOS: the first word is the sink and a feature of its own
        pytest.skip("the tokenizer adds no BOS")
    assert dropped.input_tokens == kept.input_tokens[1:] and dropped.raw_input_tokens == kept.raw_input_tokens[1:]
    assert len(dropped.input_tokens) == dropped.token_attr.shape[1]


def test_template_values_are_kept_as_given(setup):
    _, tok, _, model = setup
    inp = TextTemplateInput("{} keys to {}", values=["The", "the old cabinet"])
    res = DecompositionLLMAttribution(ALTILogitAttribution(model), tok).attribute(inp, target=TARGET)
    assert res.input_tokens == res.raw_input_tokens == ["The", "the old cabinet"]
