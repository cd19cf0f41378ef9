r"""The competitor attributors (captum_normattr.evaluation.competitors) on the tiny float64 decoders.

AttnLRP needs the optional lxt package (benchmark-only): its tests skip, naming the install,
where it is absent (CI). The rest runs everywhere.
"""
import sys

import pytest
import torch

from captum_normattr.attr.value_zeroing import ValueZeroingAttribution
from captum_normattr.evaluation.competitors import (
    LXT_INSTALL,
    Attributor,
    attnlrp,
    captum_feature_ablation,
    captum_layer_integrated_gradients,
    check_prompt,
    contrastive_logit,
    lxt_available,
    lxt_patched,
    value_zeroing,
)
from decoder_models import VOCAB, make_decoder

needs_lxt = pytest.mark.skipif(not lxt_available(), reason="AttnLRP needs lxt, which is not installed: " + LXT_INSTALL)

IDS = torch.tensor([3, 5, 7, 9, 11, 4, 8, 21])
TARGET, FOIL = 5, 6


def word_tokenizer():
    r"""A real fast tokenizer over the tiny models' vocabulary: token i is the word ``w{i}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def d_of(model, ids: torch.Tensor, target=TARGET, foil=FOIL) -> torch.Tensor:
    with torch.no_grad():
        lg = model(input_ids=ids[None] if ids.dim() == 1 else ids).logits[:, -1]
    return contrastive_logit(lg, target, foil)


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-300)
    return float((a.double() - b.double()).abs().max()) <= rel * scale


# ----------------------------------------------------------------------------- protocol
def test_check_prompt_and_attributor_protocol():
    assert torch.equal(check_prompt(torch.tensor([[4, 5]])), torch.tensor([4, 5]))
    for bad in (torch.zeros(2, 3, dtype=torch.long), torch.tensor([]).long(), torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="one prompt"):
            check_prompt(bad)
    wrong = Attributor(lambda ids, t, f: torch.zeros(ids.numel() + 1), "wrong", signed=True, needs_grad=False)
    with pytest.raises(RuntimeError, match="shape"):
        wrong(IDS, TARGET, FOIL)
    assert "wrong" in repr(wrong)


@pytest.fixture(scope="module")
def llama():
    return make_decoder("llama", exact_norms=False)


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


# ----------------------------------------------------------------------------- Captum's LLM wrappers
def test_captum_feature_ablation_is_contrastive_ablation(llama, tok):
    f = captum_feature_ablation(llama, tok, baseline=0)
    assert (f.name, f.signed, f.needs_grad) == ("Captum FeatureAblation (LLM)", True, False)
    scores = f(IDS, TARGET, FOIL)
    assert scores.shape == IDS.shape and scores.dtype == torch.float64
    d = d_of(llama, IDS)
    naive = []
    for i in range(IDS.numel()):  # token i replaced by the baseline id, the change of d
        ablated = IDS.clone()
        ablated[i] = 0
        naive.append(float(d - d_of(llama, ablated)))
    assert close(scores, torch.tensor(naive), 1e-5)  # Captum accumulates its LLM attributions in float32
    # the contrastive sign convention: swapping target and foil flips every score
    assert close(f(IDS, FOIL, TARGET), -scores, 1e-5)
    assert "difference of two calls" in f.details["explains"]


def test_captum_feature_ablation_without_foil_explains_log_prob(llama, tok):
    f = captum_feature_ablation(llama, tok, baseline=0)
    scores = f(IDS, TARGET, None)
    with torch.no_grad():
        lp = torch.log_softmax(llama(input_ids=IDS[None]).logits[0, -1], -1)[TARGET]
        ablated = IDS.clone()
        ablated[2] = 0
        lp2 = torch.log_softmax(llama(input_ids=ablated[None]).logits[0, -1], -1)[TARGET]
    assert abs(float(scores[2]) - float(lp - lp2)) <= 1e-5 * abs(float(lp - lp2)) + 1e-6


def test_captum_layer_ig_is_contrastive_ig(llama, tok):
    from captum.attr import IntegratedGradients

    f = captum_layer_integrated_gradients(llama, tok, n_steps=12, baseline=0)
    assert (f.name, f.signed, f.needs_grad) == ("Captum LayerIG-12 (LLM)", True, True)
    scores = f(IDS, TARGET, FOIL)
    assert scores.shape == IDS.shape
    emb = llama.get_input_embeddings()

    def d_embeds(x):
        return contrastive_logit(llama(inputs_embeds=x).logits[:, -1], TARGET, FOIL)

    with torch.no_grad():
        x, x0 = emb(IDS[None]), emb(torch.zeros_like(IDS)[None])
    ref = IntegratedGradients(d_embeds).attribute(x, baselines=x0, n_steps=12)[0].sum(-1)
    assert close(scores, ref, 1e-6)  # Captum's LLM result holds its attributions in float32
    # completeness of IG (approximate with 12 points): sum = d(x) - d(baseline)
    with torch.no_grad():
        gap = float(d_embeds(x) - d_embeds(x0))
    assert abs(float(scores.sum()) - gap) <= 0.01 * float(scores.abs().sum())  # the scores cancel: scale by their mass
    assert close(f(IDS, FOIL, TARGET), -scores, 1e-6)
    with pytest.raises(ValueError, match="n_steps"):
        captum_layer_integrated_gradients(llama, tok, n_steps=0)


def test_captum_text_input_keeps_ids_that_do_not_round_trip(llama, tok):
    r"""A tokenizer that encodes the decoded prompt to other ids (here: it adds a BOS) still gets the given prompt."""
    from llm_tiny import tiny_tokenizer

    bos_tok = tiny_tokenizer()
    assert bos_tok.encode(bos_tok.decode(IDS.tolist())) != IDS.tolist()  # the round trip adds <s>
    for make in (captum_feature_ablation, captum_layer_integrated_gradients):
        a = make(llama, bos_tok, baseline=0)(IDS, TARGET, FOIL)
        b = make(llama, tok, baseline=0)(IDS, TARGET, FOIL)
        assert a.shape == IDS.shape and close(a, b, 1e-6)


# ----------------------------------------------------------------------------- Value Zeroing
def test_value_zeroing_is_the_last_rollout_row(llama):
    f = value_zeroing(llama)
    assert (f.name, f.signed, f.needs_grad) == ("Value Zeroing", False, False)
    scores = f(IDS, TARGET, FOIL)
    ref = ValueZeroingAttribution(llama, explained_position="last").decompose(IDS[None]).rollout[0, -1]
    assert close(scores, ref, 1e-12)
    assert abs(float(scores.sum()) - 1.0) < 1e-10 and bool((scores >= 0).all())
    assert torch.equal(f(IDS, FOIL, None), scores)  # target-agnostic


# ----------------------------------------------------------------------------- AttnLRP
def test_attnlrp_refuses_without_lxt_naming_the_install(llama, monkeypatch):
    for name in ("lxt.efficient.core", "lxt.efficient.models"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of a None entry raises ImportError
    with pytest.raises(ImportError, match="pip install"):
        attnlrp(llama)


def _state(module, cls_list):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ({c: dict(vars(c)) for c in cls_list}, module.eager_attention_forward,
            {k: ALL_ATTENTION_FUNCTIONS[k] for k in ALL_ATTENTION_FUNCTIONS})


@needs_lxt
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_attnlrp_contrastive_and_patch_undone(family):
    import importlib

    model = make_decoder(family, exact_norms=False)
    module = importlib.import_module(type(model).__module__)
    classes = [torch.nn.Dropout, torch.nn.LayerNorm] + [type(m) for m in model.modules()
                                                        if type(m).__module__ == module.__name__]
    before = _state(module, classes)
    ref = model(input_ids=IDS[None]).logits.detach()
    f = attnlrp(model)
    assert (f.name, f.signed, f.needs_grad) == ("AttnLRP", True, True)
    assert f.details["lxt_commit"] and f.details["patched"]
    scores = f(IDS, TARGET, FOIL)
    assert scores.shape == IDS.shape and bool(torch.isfinite(scores).all())
    # linear in the explained logit: d's scores are the target's minus the foil's, and flip with the roles
    # (to float32 rounding: lxt's patched RMSNorm computes in float32 even in a float64 model)
    assert close(scores, f(IDS, TARGET, None) - f(IDS, FOIL, None), 1e-5)
    assert close(f(IDS, FOIL, TARGET), -scores, 1e-12)
    # the patch was active: plain input x gradient differs
    emb = model.get_input_embeddings()
    x = emb(IDS[None]).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(contrastive_logit(model(inputs_embeds=x).logits[0, -1], TARGET, FOIL), x)
    assert not close((x * g).sum(-1)[0].detach(), scores, 1e-3)
    # and it is undone: the same classes, functions and registry, the same forward
    after = _state(module, classes)
    assert after[0] == before[0] and after[1] is before[1] and after[2] == before[2]
    assert torch.equal(model(input_ids=IDS[None]).logits, ref)


@needs_lxt
def test_attnlrp_patch_undone_after_an_error(llama):
    import importlib

    module = importlib.import_module(type(llama).__module__)
    classes = [torch.nn.Dropout, type(llama.model.layers[0].mlp), type(llama.model.norm)]
    before = _state(module, classes)
    f = attnlrp(llama)
    with pytest.raises(IndexError):
        f(IDS, VOCAB + 10, None)  # the target is out of the vocabulary: fails inside the patched block
    after = _state(module, classes)
    assert after[0] == before[0] and after[1] is before[1] and after[2] == before[2]
    with lxt_patched(llama):
        assert importlib.import_module(type(llama).__module__).eager_attention_forward is not before[1]
    assert _state(module, classes)[1] is before[1]


@needs_lxt
def test_attnlrp_refuses_a_family_lxt_does_not_patch():
    with pytest.raises(ValueError, match="no patch"):
        attnlrp(make_decoder("mistral", exact_norms=False))


def test_the_harness_specs_build_the_competitors():
    r"""``make_attributor("llm-ablation" | "llm-lig:N", tokenizer=...)`` are these factories (same scores);
    without the tokenizer the spec is refused with the keyword to give."""
    from captum_normattr.evaluation.decoder_harness import make_attributor

    model = make_decoder("llama", attn="eager")
    tok = word_tokenizer()
    ids = torch.tensor([5, 9, 13, 17, 21, 25])
    direct = captum_feature_ablation(model, tok)(ids, TARGET, FOIL)
    assert torch.equal(make_attributor("llm-ablation", model, tokenizer=tok)(ids, TARGET, FOIL), direct)
    lig = make_attributor("llm-lig:4", model, tokenizer=tok)
    assert torch.allclose(lig(ids, TARGET, FOIL), captum_layer_integrated_gradients(model, tok, n_steps=4)(ids, TARGET, FOIL))
    with pytest.raises(ValueError, match="tokenizer=tok"):
        make_attributor("llm-ablation", model)
    with pytest.raises(ValueError, match="N >= 1"):
        make_attributor("llm-lig:0", model, tokenizer=tok)
