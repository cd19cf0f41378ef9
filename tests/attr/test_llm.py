r"""Captum's LLM API for the decompositions: every target position from one forward pass.

Every row equals the single-position call of the method's own class (float64 rounding), the
signed rows are complete against the model's real logits, and the result is Captum's own
``LLMAttributionResult`` whose plots run.
"""
import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from captum.attr import LLMAttributionResult, TextTemplateInput, TextTokenInput

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution, GlobEncAttribution
from captum_normattr.attr.llm import DecompositionLLMAttribution, chat_token_input, explain_positions
from captum_normattr.attr.positions import LOG_PROB_NOT_ADDITIVE
from decoder_models import make_decoder
from llm_tiny import tiny_tokenizer

METHODS = [ALTILogitAttribution, DecompXAttribution, ALTIAttribution, GlobEncAttribution]


@pytest.fixture(scope="module")
def models():
    return {f: make_decoder(f, layers=3, seed=3) for f in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _seq(seed=0, t=9):
    return torch.randint(3, 50, (t,), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_every_row_is_the_single_position_call(models, family, cls):
    model = models[family]
    ids = _seq(1)
    pos, tgt = torch.arange(3, 8), ids[4:9]
    ex = explain_positions(cls(model), ids, pos, tgt)
    assert ex.scores.shape == (5, 9)
    for k in range(5):
        single = cls(model, explained_position=int(pos[k])).attribute(
            ids[None], target=int(tgt[k]) if cls.uses_target else None)[0]  # the maps take no target
        assert _rel(ex.scores[k], single) < 1e-12, (k, _rel(ex.scores[k], single))
        assert (ex.scores[k, int(pos[k]) + 1:] == 0).all()  # later tokens contribute nothing
    if ex.signed:  # completeness per position, against a plain forward pass
        real = model(input_ids=ids[None]).logits[0, pos, tgt]
        scale = real.abs().max()
        assert ((ex.scores.sum(-1) + ex.no_token - real).abs() / scale).max() < 1e-10
        assert (ex.explained - real).abs().max() / scale < 1e-12
        assert (ex.delta.abs() / scale).max() < 1e-10
    lp = torch.log_softmax(model(input_ids=ids[None]).logits[0, pos], -1)[torch.arange(5), tgt]
    assert torch.allclose(ex.log_probs, lp, rtol=0, atol=1e-10 * float(lp.abs().max()))


@pytest.mark.parametrize("cls", [ALTILogitAttribution, DecompXAttribution], ids=lambda c: c.__name__)
def test_foil_and_mean_logit(models, cls):
    model = models["llama"]
    ids = _seq(2)
    pos, tgt = torch.arange(2, 8), ids[3:9]
    ex = explain_positions(cls(model), ids, pos, tgt, foil=torch.tensor(7))
    assert ex.quantity == "logit_minus_foil"
    for k in (0, 5):
        single = cls(model, explained_position=int(pos[k])).attribute(ids[None], target=int(tgt[k]), foil=7)[0]
        assert _rel(ex.scores[k], single) < 1e-12
    logits = model(input_ids=ids[None]).logits[0, pos]
    mean = explain_positions(cls(model), ids, pos, tgt, quantity="logit_minus_mean")
    real = logits[torch.arange(6), tgt] - logits.mean(-1)
    assert ((mean.scores.sum(-1) + mean.no_token - real).abs() / real.abs().max()).max() < 1e-10


def test_decompx_spread_mode_rows(models):
    model = models["gpt2"]
    ids = _seq(3, 7)
    pos, tgt = torch.arange(2, 6), ids[3:7]
    attr = DecompXAttribution(model, bias_mode="spread")
    ex = explain_positions(attr, ids, pos, tgt)
    for k in range(4):
        single = DecompXAttribution(model, bias_mode="spread", explained_position=int(pos[k])).attribute(
            ids[None], target=int(tgt[k]))[0]
        assert _rel(ex.scores[k], single) < 1e-12


def test_log_prob_refused_with_explanation(models, tok):
    llm = DecompositionLLMAttribution(ALTILogitAttribution(models["llama"]), tok)
    with pytest.raises(ValueError, match="not additive"):
        llm.attribute(TextTokenInput("the cat", tok), target="sat", quantity="log_prob")
    assert "logsumexp" in LOG_PROB_NOT_ADDITIVE


@pytest.mark.parametrize("cls", METHODS, ids=lambda c: c.__name__)
def test_token_input_result_is_captums_and_plots(models, tok, cls):
    model = models["llama"]
    llm = DecompositionLLMAttribution(cls(model), tok)
    inp = TextTokenInput("the cat sat on the", tok, skip_tokens=["<s>"])
    ex = llm.decompose(inp, target="mat today")
    res = ex.to_captum()
    assert type(res) is LLMAttributionResult
    assert res.input_tokens == ["the", "cat", "sat", "on", "the"] and res.output_tokens == ["mat", "today"]
    assert res.token_attr.shape == (2, 5)
    assert torch.equal(res.token_attr, ex.scores[:, 1:6])  # BOS skipped: columns 1..5 of the full rows
    assert torch.allclose(res.seq_attr, res.token_attr.sum(0))
    assert res.output_probs.shape == (2,) and ((res.output_probs > 0) & (res.output_probs < 1)).all()
    ids = torch.tensor(tok.encode("the cat sat on the mat today"))
    single = cls(model, explained_position=5).attribute(ids[None], target=int(ids[6]) if cls.uses_target else None)[0]
    assert _rel(ex.scores[0], single) < 1e-12  # row 0 explains "mat" at the last prompt position
    fig, _ = res.plot_token_attr()
    fig2, _ = res.plot_seq_attr()
    import matplotlib.pyplot as plt

    plt.close(fig)
    plt.close(fig2)
    same = llm.attribute(inp, target=torch.tensor(tok.encode("mat today", add_special_tokens=False)))
    assert torch.equal(same.token_attr, res.token_attr)


def test_template_features_are_sums_of_token_scores(models, tok):
    model = models["gpt2"]
    llm = DecompositionLLMAttribution(ALTILogitAttribution(model), tok)
    inp = TextTemplateInput("{} feels {} right now", values=["he", "very sad"], baselines=["she", "happy"])
    with _no_warning():  # no token straddles a value here
        ex = llm.decompose(inp, target="and")
    # tokens: <s> he feels very sad right now -> features: he = [1], very sad = [3, 4]
    assert ex.feature_of_token.tolist() == [-1, 0, -1, 1, 1, -1, -1]
    res = ex.to_captum()
    assert res.input_tokens == ["he", "very sad"]
    expect = torch.stack([ex.scores[:, 1], ex.scores[:, 3] + ex.scores[:, 4]], 1)
    assert torch.allclose(res.token_attr, expect, rtol=0, atol=8 * torch.finfo(expect.dtype).eps * float(expect.abs().max()))
    masked = TextTemplateInput("{} {} {}", values=["the", "cat", "sat"], mask=[0, 1, 0])
    res = llm.attribute(masked, target="on")  # grouped values share the sum (Captum's format_attr)
    e2 = llm.decompose(masked, target="on")
    s = e2.scores
    assert res.token_attr.shape == (1, 3)
    assert torch.allclose(res.token_attr[0], torch.stack([s[0, 1] + s[0, 3], s[0, 2], s[0, 1] + s[0, 3]]))
    named = TextTemplateInput("{who} sat on {what}", values={"who": "the cat", "what": "a mat"})
    assert llm.decompose(named, target="today").feature_of_token.tolist() == [-1, 0, 0, -1, -1, 1, 1]


def test_template_tokens_with_a_leading_space_belong_to_their_value():
    from captum_normattr.attr.llm import template_token_features

    class ByteLevelLike:  # offsets as a byte-level BPE gives them: " sad" starts at the space
        def __init__(self, offsets):
            self.offsets = offsets

        def __call__(self, text, return_offsets_mapping=True):
            return {"offset_mapping": self.offsets}

    inp = TextTemplateInput("{} feels {} ok", values=["he", "sad!"])
    text = inp.to_model_input()  # "he feels sad! ok": "he", " feels", " sad", "!", " ok"
    tok = ByteLevelLike([(0, 2), (2, 8), (8, 12), (12, 13), (13, 16)])
    with _no_warning():
        assert template_token_features(inp, tok, text, 5) == [0, -1, 1, 1, -1]
    with pytest.warns(UserWarning, match="spans a value"):  # "hex": the value "he" and template text
        feats = template_token_features(TextTemplateInput("{}x feels", values=["he"]),
                                         ByteLevelLike([(0, 3), (3, 9)]), "hex feels", 2)
    assert feats == [0, -1]


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


def test_generate_first_equals_teacher_forcing(models, tok):
    model = models["llama"]
    llm = DecompositionLLMAttribution(ALTILogitAttribution(model), tok)
    inp = TextTokenInput("the dog ran", tok)
    ex = llm.decompose(inp, gen_args={"max_new_tokens": 3, "do_sample": False, "min_new_tokens": 3})
    assert ex.target_ids.shape == (3,)
    forced = llm.decompose(inp, target=ex.target_ids)
    assert torch.equal(ex.scores, forced.scores)
    with pytest.raises(ValueError, match="gen_args"):
        llm.attribute(inp, target="home", gen_args={"max_new_tokens": 2})


def test_sink_share_and_exclude_sink(models, tok):
    model = models["llama"]
    llm = DecompositionLLMAttribution(ALTIAttribution(model), tok)
    inp = TextTokenInput("the cat sat", tok)
    ex = llm.decompose(inp, target="on a")
    share = ex.sink_share
    assert share.shape == (2,) and ((share >= 0) & (share <= 1)).all()
    assert torch.allclose(share, ex.scores[:, 0].abs() / ex.scores.abs().sum(-1))
    kept, dropped = ex.to_captum(), ex.to_captum(exclude_sink=True)
    assert kept.input_tokens[0] == "<s>" and dropped.input_tokens == kept.input_tokens[1:]
    assert torch.equal(dropped.token_attr, kept.token_attr[:, 1:])  # the other scores are unchanged
    assert torch.equal(llm.attribute(inp, target="on a", exclude_sink=True).token_attr, dropped.token_attr)


def test_chat_template_input_has_one_bos(models, tok):
    messages = [{"role": "user", "content": "hello world"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert TextTokenInput(rendered, tok).inp_tensor[0, :2].tolist() == [1, 1]  # the pitfall
    inp = chat_token_input(tok, messages)
    assert inp.inp_tensor[0].tolist() == [1] + tok.encode("user hello world you", add_special_tokens=False)
    assert inp.values == tok.convert_ids_to_tokens(inp.inp_tensor[0].tolist())
    llm = DecompositionLLMAttribution("alti-logit", tok, model=models["gpt2"])
    res = llm.attribute(inp, target="good")
    assert res.token_attr.shape == (1, inp.inp_tensor.shape[1])
    with pytest.warns(UserWarning, match="two BOS"):
        llm.attribute(TextTokenInput(rendered, tok), target="good")


def test_errors_say_what_to_do(models, tok):
    with pytest.raises(TypeError, match="ALTILogitAttribution"):
        DecompositionLLMAttribution(object(), tok)  # type: ignore[arg-type]
    llm = DecompositionLLMAttribution(ALTILogitAttribution(models["gpt2"]), tok)
    with pytest.raises(ValueError, match="foil"):
        llm.attribute(TextTokenInput("the cat", tok), target="sat", quantity="logit_minus_foil")
    with pytest.raises(ValueError, match="one token"):
        llm.attribute(TextTokenInput("the cat", tok), target="sat", foil="a cat")
    res = llm.decompose(TextTokenInput("the cat", tok), target="sat on", foil="dog")
    assert res.quantity == "logit_minus_foil" and res.details.foil.tolist() == [7, 7]
