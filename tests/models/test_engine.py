r"""The streaming engine: one layer alive at a time, explained-row rollout, model state restored, threads."""
import gc
import threading
import weakref

import pytest
import torch

from captum_normattr import (
    ALTIAttribution,
    ALTILogitAttribution,
    DecompXAttribution,
    FFIntegratedDecomposition,
    GlobEncAttribution,
    rollout,
)
from captum_normattr.decompose.kinds.post_ln import post_ln_layer_maps
from captum_normattr.decompose.primitives.mixing import row_normalize
from captum_normattr.decompose.primitives.rollout import rollout_rows
from captum_normattr.models.capture import attention
from captum_normattr.models.capture import recorder as capture
from conftest import make_model, random_batch
from decoder_models import decoder_batch, make_decoder
from layer_capture import capture_layers
from reference import naive_alti, naive_alti_from_parts, naive_pre_ln_parts, naive_rollout, post_ln_whole_layer_parts

ENCODER_METHODS = {
    "globenc": lambda m: GlobEncAttribution(m),
    "alti": lambda m: ALTIAttribution(m),
    "ff": lambda m: FFIntegratedDecomposition(m),
    "decompx": lambda m: DecompXAttribution(m),
}
DECODER_METHODS = dict(ENCODER_METHODS, alti_logit=lambda m: ALTILogitAttribution(m))


def _call(attr, ids, mask):
    return attr.attribute(ids, additional_forward_args=(mask,))  # target None: the predicted class / token


@pytest.mark.parametrize("decoder", [False, True])
@pytest.mark.parametrize("name", sorted(DECODER_METHODS))
def test_one_layer_of_attention_probabilities_alive_at_a_time(monkeypatch, decoder, name):
    if not decoder and name == "alti_logit":
        pytest.skip("ALTI-Logit explains decoder logits")
    model = make_decoder("gpt2", layers=5) if decoder else make_model("bert")
    ids, mask = (decoder_batch([7, 5]) if decoder else random_batch([7, 5]))
    alive = []
    made = []
    original = capture.Recorder.layer_tensors

    def watched(self, idx, rec):
        layer = original(self, idx, rec)
        gc.collect()
        alive.append(sum(r() is not None for r in made))
        if layer.probs is not None:  # DecompX's checkpoint pass records none (its reruns do)
            made.append(weakref.ref(layer.probs))
        return layer

    monkeypatch.setattr(capture.Recorder, "layer_tensors", watched)
    _call(DECODER_METHODS[name](model), ids, mask)
    assert len(made) >= 2
    assert max(alive) == 0, f"earlier layers' attention probabilities still alive when a new layer arrived: {alive}"


def test_explained_rows_equal_full_rollout():
    g = torch.Generator().manual_seed(0)
    maps = torch.rand(3, 4, 6, 6, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 5, 2])
    for conv in ("raw", "row_normalized"):
        full = rollout(maps, conv)
        assert torch.allclose(rollout_rows(maps, pos, conv), full[torch.arange(3), pos], atol=1e-14, rtol=0)
    # the full rollout is the product of the maps, bottom layer first
    assert torch.allclose(rollout(maps), maps[:, 3] @ maps[:, 2] @ maps[:, 1] @ maps[:, 0], atol=1e-14)


@pytest.mark.parametrize("convention", ["raw", "row_normalized"])
def test_scores_are_the_rollout_of_independently_computed_maps(convention):
    model = make_model("roberta")
    ids, mask = random_batch([7, 4], seed=3)
    layers = capture_layers(model, ids, mask)
    valid = mask.bool()
    maps = torch.stack([post_ln_layer_maps(layer, valid, ("N_ENC",))[0]["N_ENC"] for layer in layers], 1)
    prep = row_normalize if convention == "row_normalized" else (lambda m: m)
    joint = prep(maps[:, 0])
    for l in range(1, maps.shape[1]):
        joint = prep(maps[:, l]) @ joint
    attr = GlobEncAttribution(model, rollout=convention)
    scores = attr.attribute(ids, additional_forward_args=(mask,))
    assert torch.allclose(scores, joint[:, 0] * valid, atol=1e-12, rtol=0)
    res = attr.decompose(ids, additional_forward_args=(mask,))
    assert torch.allclose(res.rollout, joint * (valid[:, :, None] & valid[:, None, :]), atol=1e-12, rtol=0)
    other = GlobEncAttribution(model, rollout="raw" if convention == "row_normalized" else "row_normalized")
    assert not torch.allclose(other.attribute(ids, additional_forward_args=(mask,)), scores, atol=1e-6)


def _independent_maps(case, layers, valid):
    r"""(B, L, T, T) layer maps from the naive references of tests/reference.py (no streaming class)."""
    m2 = (valid[:, :, None] & valid[:, None, :]).double()
    out = []
    for layer in layers:
        if case == "alti_bert":
            out.append(naive_alti(layer, valid))
        elif case == "ff_bert":
            parts, _ = post_ln_whole_layer_parts(layer)
            out.append(parts.norm(dim=-1) * m2)
        elif case == "globenc_gpt2":
            out.append(naive_pre_ln_parts(layer)["N_RESLN"].norm(dim=-1) * m2.tril())
        elif case == "alti_gpt2":
            out.append(naive_alti_from_parts(naive_pre_ln_parts(layer)["N_RES"], layer.ln2_in, valid) * m2.tril())
    return torch.stack(out, 1)


ROLLOUT_CASES = {
    "alti_bert": (lambda: make_model("bert"), lambda m, c: ALTIAttribution(m, rollout=c)),
    "ff_bert": (lambda: make_model("bert"), lambda m, c: FFIntegratedDecomposition(m, rollout=c)),
    "globenc_gpt2": (lambda: make_decoder("gpt2"), lambda m, c: GlobEncAttribution(m, rollout=c)),
    "alti_gpt2": (lambda: make_decoder("gpt2"), lambda m, c: ALTIAttribution(m, rollout=c)),
}


@pytest.mark.parametrize("convention", ["raw", "row_normalized"])
@pytest.mark.parametrize("case", sorted(ROLLOUT_CASES))
def test_every_class_rolls_out_independently_computed_maps(case, convention):
    make, build = ROLLOUT_CASES[case]
    model = make()
    decoder = case.endswith("gpt2")
    ids, mask = decoder_batch([7, 4], seed=3) if decoder else random_batch([7, 4], seed=3)
    valid = mask.bool()
    maps = _independent_maps(case, capture_layers(model, ids, mask), valid)
    joint = naive_rollout(maps, convention)
    attr = build(model, convention)
    res = attr.decompose(ids, additional_forward_args=(mask,))
    assert torch.allclose(res.layer_maps, maps, atol=1e-10, rtol=0)
    pos = res.explained_position
    assert pos.tolist() == ([6, 6] if decoder else [0, 0])
    expect = joint[torch.arange(2), pos] * valid
    assert torch.allclose(res.scores, expect, atol=1e-10, rtol=0)
    assert torch.allclose(attr.attribute(ids, additional_forward_args=(mask,)), expect, atol=1e-10, rtol=0)
    assert torch.allclose(res.rollout, joint * (valid[:, :, None] & valid[:, None, :]), atol=1e-10, rtol=0)
    if not case.startswith("alti"):  # ALTI rows sum to 1: both conventions agree there
        other = build(model, "raw" if convention == "row_normalized" else "row_normalized")
        assert not torch.allclose(other.attribute(ids, additional_forward_args=(mask,)), expect, atol=1e-6)


def test_long_input_switches_off_maps_and_rollout():
    model = make_decoder("llama")
    ids, mask = decoder_batch([9, 6], seed=2)
    attr = ALTIAttribution(model)
    full = attr.decompose(ids, additional_forward_args=(mask,))
    lean = attr.decompose(ids, additional_forward_args=(mask,), return_layer_maps=False, return_rollout=False)
    assert lean.layer_maps is None and lean.rollout is None
    assert torch.allclose(full.scores, lean.scores, atol=1e-14, rtol=0)
    assert torch.allclose(full.rollout[torch.arange(2), full.explained_position], full.scores, atol=1e-12, rtol=0)


def _flags(model):
    return {name: m.training for name, m in model.named_modules()}


@pytest.mark.parametrize("name", sorted(DECODER_METHODS))
def test_per_module_training_flags_restored(name):
    model = make_decoder("gpt2") if name == "alti_logit" else make_model("bert")
    ids, mask = decoder_batch([6, 4]) if name == "alti_logit" else random_batch([6, 4])
    model.train()
    first = next(iter(model.children()))
    first.eval()  # MC-dropout style: flags set per module
    before = _flags(model)
    assert len(set(before.values())) == 2
    _call(DECODER_METHODS[name](model), ids, mask)
    assert _flags(model) == before
    assert model.config._attn_implementation == "sdpa"


def test_flags_and_implementation_restored_after_error_inside_a_layer():
    model = make_model("bert")
    model.train()
    model.bert.embeddings.eval()
    before = _flags(model)
    attr = ALTIAttribution(model)

    def boom(*a, **k):
        raise RuntimeError("boom")

    attr.layer_contribution = boom
    ids, mask = random_batch([5])
    with pytest.raises(RuntimeError, match="boom"):
        attr.attribute(ids, additional_forward_args=(mask,))
    assert _flags(model) == before
    assert model.config._attn_implementation == "sdpa"
    assert not attention._SWITCHED and not attention._FLAGS


def test_threads_attributing_and_plain_forward_passes():
    model = make_model("bert")
    batches = [random_batch([n, max(2, n - 3)], seed=n) for n in (5, 7, 9, 11)]
    attr = GlobEncAttribution(model)
    expected = [attr.attribute(ids, additional_forward_args=(mask,)) for ids, mask in batches]
    with torch.no_grad():
        plain_ids, plain_mask = random_batch([8, 6], seed=99)
        plain_expected = model(input_ids=plain_ids, attention_mask=plain_mask).logits
    errors = []

    def attribute_many(offset):
        try:
            for k in range(12):
                i = (k + offset) % len(batches)
                ids, mask = batches[i]
                got = GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))
                if not torch.allclose(got, expected[i], atol=1e-12 * float(expected[i].abs().max()), rtol=0):  # scaled: other BLAS
                    errors.append(f"attribution {i} differs")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    def forward_many():
        try:
            for _ in range(12):
                with torch.no_grad():
                    out = model(input_ids=plain_ids, attention_mask=plain_mask).logits
                if not torch.allclose(out, plain_expected, atol=1e-12 * float(plain_expected.abs().max()), rtol=0):
                    errors.append("plain forward differs")
        except Exception as e:  # pragma: no cover
            errors.append(repr(e))

    threads = [threading.Thread(target=attribute_many, args=(o,)) for o in range(3)] + [threading.Thread(target=forward_many)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert model.config._attn_implementation == "sdpa"
    assert not attention._SWITCHED and not attention._FLAGS


def test_flags_saved_per_module_for_models_sharing_a_submodule():
    r"""Two classifiers share one encoder; A's call starts, B's call starts, A's ends, B's ends
    (the order pinned with events in hooks). B must run in eval mode throughout, and every
    module must get its own flag back (issue 27 item 10)."""
    a = make_model("bert")
    b = make_model("bert", seed=1)
    b.bert = a.bert
    a.train()
    b.train()
    before = (_flags(a), _flags(b))
    b_started, a_done = threading.Event(), threading.Event()
    seen_by_b, errors = [], []

    def hook(module, args):
        if threading.current_thread().name == "A":
            assert b_started.wait(10), "B did not start"
        elif threading.current_thread().name == "B" and not b_started.is_set():
            b_started.set()
            assert a_done.wait(10), "A did not finish"
            seen_by_b.append(sorted(name for name, m in a.bert.named_modules() if m.training))

    a.bert.encoder.layer[0].register_forward_pre_hook(hook)
    ids, mask = random_batch([6, 4])

    def run(model, name):
        try:
            GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(f"{name}: {e!r}")
        finally:
            if name == "A":
                a_done.set()

    threads = [threading.Thread(target=run, args=(m, n), name=n) for m, n in ((a, "A"), (b, "B"))]
    threads[0].start()
    threads[1].start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert seen_by_b == [[]], f"modules in training mode during B's call: {seen_by_b}"
    assert (_flags(a), _flags(b)) == before
    assert not attention._FLAGS and not attention._SESSIONS


def test_hooks_never_seen_half_registered_by_other_threads():
    r"""torch adds and removes a with_kwargs pre-hook in two steps, and a forward pass calls the
    hooks it listed when it started: a plain forward pass P that listed an attribution's hook
    calls it without kwargs once the attribution removed it (issue 27 item 11: `pre_hook()
    missing 1 required positional argument: 'kwargs'`). Pinned with events, then a short stress
    run with a tiny switch interval."""
    import sys

    model = make_model("bert")
    ids, mask = random_batch([5, 3])
    expected = GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))
    errors = []
    registered, removed = threading.Event(), threading.Event()

    def user_hook(module, args):
        if threading.current_thread().name == "A":
            registered.set()  # the attribution's hooks are in place
        elif threading.current_thread().name == "P":
            assert removed.wait(10), "the attribution did not end"

    handle = model.bert.encoder.layer[1].register_forward_pre_hook(user_hook)

    def attribution():
        try:
            GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))
        finally:
            registered.set()
            removed.set()

    def plain():
        try:
            assert registered.wait(10)
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=plain, name="P"), threading.Thread(target=attribution, name="A")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    handle.remove()
    assert not errors, errors

    stop = threading.Event()

    def attribute_many():
        try:
            for _ in range(10):
                got = GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))
                if not torch.allclose(got, expected, atol=1e-12, rtol=0):
                    errors.append("attribution differs")
        except Exception as e:
            errors.append(repr(e))

    def forward_many():
        try:
            with torch.no_grad():
                while not stop.is_set():
                    model(input_ids=ids, attention_mask=mask)
        except Exception as e:
            errors.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=attribute_many) for _ in range(3)]
        plains = [threading.Thread(target=forward_many) for _ in range(2)]
        for t in workers + plains:
            t.start()
        for t in workers:
            t.join(60)
        stop.set()
        for t in plains:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert not attention._SWITCHED and not attention._FLAGS


def test_reentrant_attribution_gives_a_clear_error():
    model = make_model("bert")
    ids, mask = random_batch([5])
    inner = GlobEncAttribution(model)
    handle = model.bert.encoder.layer[1].register_forward_hook(
        lambda m, a, out: inner.attribute(ids, additional_forward_args=(mask,)) and None)
    with pytest.raises(RuntimeError, match="while one of its own recorded forward passes is running"):
        GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))
    handle.remove()
    assert not attention._SWITCHED and not attention._FLAGS
    GlobEncAttribution(model).attribute(ids, additional_forward_args=(mask,))


def test_the_engine_and_the_guard_live_in_models():
    r"""attr/base.py keeps the two base classes; the engine and the guard are imported from their own modules."""
    from captum_normattr.attr import base
    from captum_normattr.models import engine, guard

    for name in ("streamed_forward", "LayerContribution", "MapCollector", "layer_finite", "mark_non_finite",
                 "compute_dtype"):
        assert name in engine.__all__ and name not in base.__all__
    for name in ("ConsistencyGuard", "ConsistencyWarning", "ConsistencyError"):
        assert name in guard.__all__ and name not in base.__all__
    assert set(base.__all__) >= {"DecompositionAttribution", "LayerDecompositionAttribution"}
