r"""The decoder faithfulness harness: attributors, per-item metrics (AOPC, ABPC) against naive references."""
import pytest
import torch
from captum.attr import InputXGradient, IntegratedGradients, Saliency

from decoder_models import make_decoder

from captum_normattr import ALTIAttribution, ALTILogitAttribution, DecompXAttribution
from captum_normattr.evaluation.decoder_harness import (
    AttentionAttributor,
    CallableAttributor,
    RandomAttributor,
    TaskState,
    as_attributor,
    evaluate_item,
    keep_correct,
    last_logit_diff,
    last_logits,
    make_attributor,
    make_attributors,
    run_round_robin,
)
from captum_normattr.evaluation.decoder_tasks import TaskItem


@pytest.fixture(scope="module")
def model():
    return make_decoder("llama")


def _item(ids=(1, 5, 7, 9, 11, 13, 17), target=3, foil=4, evidence=(2,)):
    return TaskItem(task="t", text="", input_ids=list(ids), target=target, foil=foil, evidence=list(evidence))


def _d(model, ids, target, foil):
    lg = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    return float(lg[target] - (lg[foil] if foil is not None else 0.0))


def _embeds(model, ids):
    return model.get_input_embeddings()(torch.tensor([ids])).detach()


def _f(model, target, foil):
    def f(e):
        lg = model(inputs_embeds=e).logits[:, -1]
        return lg[:, target] - lg[:, foil]
    return f


def test_last_logits_match_each_prompt_alone(model):
    prompts = [[1, 5, 7], [1, 9, 11, 13, 2], [1, 4], [1, 6, 8, 10, 12, 14, 16]]
    lg = last_logits(model, prompts, chunk=3)
    for p, row in zip(prompts, lg):
        ref = model(input_ids=torch.tensor([p])).logits[0, -1]
        assert torch.allclose(row, ref, rtol=1e-9, atol=1e-9 * float(ref.abs().max()))
    d = last_logit_diff(model, prompts, 3, None)
    assert torch.allclose(d, lg[:, 3].double())


def test_captum_attributors_match_captum_on_embeddings(model):
    it = _item()
    x = _embeds(model, it.input_ids)
    f = _f(model, it.target, it.foil)
    ids = torch.tensor(it.input_ids)
    sal = Saliency(model)
    got = as_attributor(sal)(ids, it.target, it.foil)
    assert sal.forward_func is model  # restored
    ref = Saliency(f).attribute(x, abs=True)[0].norm(dim=-1)
    assert torch.allclose(got, ref, rtol=1e-10)
    got = as_attributor(IntegratedGradients(model), n_steps=8)(ids, it.target, it.foil)
    ref = IntegratedGradients(f).attribute(x, baselines=torch.zeros_like(x), n_steps=8)[0].sum(-1)
    assert torch.allclose(got, ref, rtol=1e-8, atol=1e-10)
    ixg = make_attributor("ixg", model)
    assert ixg.name == "InputXGradient" and ixg.signed
    assert torch.allclose(ixg(ids, it.target, it.foil), InputXGradient(f).attribute(x)[0].sum(-1), rtol=1e-10)
    fa = make_attributor("ablation", model)
    with torch.no_grad():
        ref = torch.stack([f(x)[0] - f(torch.cat([x[:, :t], torch.zeros_like(x[:, :1]), x[:, t + 1:]], 1))[0]
                           for t in range(x.shape[1])])
        got = fa(ids, it.target, it.foil)
    assert torch.allclose(got, ref, rtol=1e-8, atol=1e-10 * float(ref.abs().max()))
    assert make_attributor("ig:4", model).name == "IG-4" and make_attributor("IG", model).name == "IG-16"


def test_forward_func_restored_after_an_error(model):
    sal = Saliency(model)
    with pytest.raises(Exception):
        as_attributor(sal)(torch.tensor([1, 5, 7]), 10 ** 6, None)  # target out of the vocabulary
    assert sal.forward_func is model


def test_package_attributors_explain_target_minus_foil(model):
    it = _item()
    ids = torch.tensor(it.input_ids)
    al = as_attributor(ALTILogitAttribution(model))
    assert al.name == "ALTI-Logit" and al.signed
    ref = ALTILogitAttribution(model).attribute(ids[None], target=it.target, foil=it.foil)[0]
    assert torch.allclose(al(ids, it.target, it.foil), ref)
    dx = as_attributor(DecompXAttribution(model), name="DX")
    assert dx.name == "DX" and dx(ids, it.target, None).shape == (len(it.input_ids),)
    alti = as_attributor(ALTIAttribution(model))
    assert alti.name == "ALTI" and not alti.signed
    s = alti(ids, it.target, it.foil)
    assert torch.allclose(s, ALTIAttribution(model).attribute(ids[None])[0])


def test_attention_and_random_attributors():
    eager = make_decoder("gpt2", attn="eager")
    ids = torch.tensor([1, 5, 7, 9, 11])
    with torch.no_grad():
        att = AttentionAttributor(eager)(ids, 3, 4)
        roll = make_attributor("rollout", eager)(ids, 3, 4)
    assert att.shape == roll.shape == (5,)
    assert abs(float(att.sum()) - 1) < 1e-9 and abs(float(roll.sum()) - 1) < 1e-9
    a = RandomAttributor()(ids, 3, 4)
    assert a.shape == (5,) and a.dtype == torch.float64


def test_evaluate_item_against_naive_removals(model):
    it = _item()
    names = make_attributors("alti-logit,saliency,random", model)
    res = evaluate_item(model, names, it, ks=(1, 2, 3), seed=3, time_cost=True, curves=True)
    d = _d(model, it.input_ids, it.target, it.foil)
    T = len(it.input_ids)
    for name, fn in names.items():
        torch.manual_seed(3)
        scores = fn(torch.tensor(it.input_ids), it.target, it.foil).detach().double()
        rec = res[name]
        assert rec["cost_forwards"] > 0
        for ex in (False, True):
            tag = "no_sink" if ex else "with_sink"
            cand = [t for t in range(T - 1) if not (ex and t == 0)]
            morf = sorted(cand, key=lambda t: (-float(scores[t]), t))
            lerf = sorted(cand, key=lambda t: (float(scores[t]), t))
            dele, ins, abpc = [], [], []
            for k in (1, 2, 3):
                d_m = _d(model, [x for t, x in enumerate(it.input_ids) if t not in morf[:k]], it.target, it.foil)
                d_l = _d(model, [x for t, x in enumerate(it.input_ids) if t not in lerf[:k]], it.target, it.foil)
                keep = set(morf[:k]) | {T - 1} | ({0} if ex else set())
                d_i = _d(model, [x for t, x in enumerate(it.input_ids) if t in keep], it.target, it.foil)
                dele.append((d - d_m) / abs(d))
                ins.append(d_i / abs(d))
                abpc.append((d_l - d_m) / abs(d))
                assert rec[f"morf_{k}_{tag}"] == pytest.approx(d_m / abs(d), rel=1e-7, abs=1e-9)
            for key, vals in (("deletion_aopc", dele), ("insertion_aopc", ins), ("abpc", abpc)):
                assert rec[f"{key}_{tag}"] == pytest.approx(sum(vals) / 3, rel=1e-7, abs=1e-9), (name, key, tag)
            rank = 1 + sum(float(scores[t]) > float(scores[2]) for t in cand)
            assert rec[f"mrr_{tag}"] == pytest.approx(1.0 / rank)


def test_abpc_is_antisymmetric_and_random_is_reproducible(model):
    it = _item(ids=(1, 5, 7, 9, 11, 13, 17, 19, 23))
    g = torch.Generator().manual_seed(0)
    s = torch.randn(len(it.input_ids), generator=g, dtype=torch.float64)
    pos = CallableAttributor(lambda ids, t, f: s, name="s")
    neg = CallableAttributor(lambda ids, t, f: -s, name="-s")
    res = evaluate_item(model, {"s": pos, "-s": neg, "Random": RandomAttributor()}, it, seed=11, time_cost=False)
    for tag in ("with_sink", "no_sink"):
        assert res["s"][f"abpc_{tag}"] == pytest.approx(-res["-s"][f"abpc_{tag}"], rel=1e-9, abs=1e-12)
        assert res["s"][f"abpc_{tag}"] != 0.0
    res2 = evaluate_item(model, {"Random": RandomAttributor()}, it, seed=11, time_cost=False)
    expected = torch.rand(len(it.input_ids), generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    got = evaluate_item(model, {"r": CallableAttributor(lambda ids, t, f: expected)}, it, seed=0, time_cost=False)
    for other in (res2["Random"], got["r"]):  # the item seed drives the global generator, as a fresh Generator would
        assert other.keys() == res["Random"].keys()  # (batches of other sizes: the last bits may differ)
        for k, v in res["Random"].items():
            assert other[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_bad_attributors_raise(model):
    it = _item()
    with pytest.raises(ValueError, match="one score per token"):
        evaluate_item(model, {"bad": lambda ids, t, f: torch.zeros(3)}, it, time_cost=False)
    with pytest.raises(TypeError, match="Captum Attribution or a callable"):
        as_attributor(42)
    with pytest.raises(ValueError, match="unknown method"):
        make_attributor("nope", model)


def test_keep_correct_and_round_robin(model):
    items = [_item(ids=(1, 5 + i, 7, 9), target=3, foil=4) for i in range(6)]
    d = [_d(model, it.input_ids, 3, 4) for it in items]
    kept = keep_correct(model, items, "t")
    assert [it.input_ids for it in kept] == [it.input_ids for it, x in zip(items, d) if x > 0]
    top = int(model(input_ids=torch.tensor([items[0].input_ids])).logits[0, -1].argmax())
    no_foil = [_item(ids=items[0].input_ids, target=top, foil=None), _item(ids=items[0].input_ids, target=(top + 1) % 50,
                                                                             foil=None)]
    assert len(keep_correct(model, no_foil, "t")) == 1
    states = [TaskState("a", 3, items[:3]), TaskState("b", 2, items[3:5])]
    saves = []
    rounds = run_round_robin(model, states, {"Random": RandomAttributor()}, cost_every=2, save_every=1, on_save=saves.append)
    assert rounds == 3 and saves == [1, 2, 3]
    assert [st.done for st in states] == [3, 2]
    assert len(states[0].values["Random"]["cost_forwards"]) == 2  # items 0 and 2
