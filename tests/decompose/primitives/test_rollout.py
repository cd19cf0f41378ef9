r"""A raw rollout of unnormalised maps that passes float32's range: carried with a power of two, never NaN.

The FF decomposition's whole-layer (RES2) norm maps of a pre-LN decoder have row sums of the
order of the residual stream's norm; their raw rollout is the product of those over the
layers. On a float32 model with a large residual stream it passes 3.4e38: the plain product
became inf, then NaN (inf * 0), and every score was NaN.
"""
import warnings

import pytest
import torch
from decoder_models import decoder_batch, make_decoder

from captum_normattr import FFIntegratedDecomposition, GlobEncAttribution
from captum_normattr.decompose.primitives.rollout import LayerMapStore, rollout, rollout_rows, rollout_rows_scaled, rollout_scaled


def _loud_llama(dtype: torch.dtype) -> torch.nn.Module:
    r"""A tiny Llama (6 layers) whose embeddings are scaled by 1e6: every layer's RES2 row sums are ~1e7."""
    model = make_decoder("llama", layers=6, seed=3)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e6)
    return model.to(dtype)


def _naive_rows(maps: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    maps = maps.double()
    row = maps[:, -1][torch.arange(maps.shape[0]), pos]
    for l in range(maps.shape[1] - 2, -1, -1):
        row = torch.einsum("bj,bjk->bk", row, maps[:, l])
    return row


def test_ff_raw_rollout_past_float32_range_is_finite_and_exact_up_to_its_power_of_two():
    ids, mask = decoder_batch([7, 5], seed=1)
    model32 = _loud_llama(torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = FFIntegratedDecomposition(model32).decompose(ids, additional_forward_args=(mask,), return_layer_maps=True, return_rollout=True)
    messages = [str(w.message) for w in caught]
    # the raw product really is beyond float32 (what made every score NaN)
    naive = _naive_rows(res.layer_maps, res.explained_position)
    assert float(naive.abs().max()) > torch.finfo(torch.float32).max
    assert torch.isfinite(res.scores).all() and torch.isfinite(res.rollout).all()
    scale = res.extras["rollout_log2_scale"]
    assert scale.dtype == torch.int64 and bool((scale > 0).all())
    assert any("exceeds torch.float32's range" in m and "row_normalized" in m for m in messages), messages
    assert not any("inputs or forward pass" in m or "overflowed" in m for m in messages), messages
    real = mask.bool()
    unscaled = res.scores.double() * torch.exp2(scale.double())[:, None]
    assert (res.scores[~real] == 0).all()
    torch.testing.assert_close(unscaled[real], naive[real], rtol=1e-5, atol=0)
    # against the same model in float64, where the raw rollout fits: the same numbers
    ref = FFIntegratedDecomposition(_loud_llama(torch.float64)).decompose(ids, additional_forward_args=(mask,), return_layer_maps=False,
                                                                          return_rollout=False)
    assert "rollout_log2_scale" not in ref.extras and torch.isfinite(ref.scores).all()
    torch.testing.assert_close(unscaled[real], ref.scores[real], rtol=1e-3, atol=0)
    # padded batch == single examples: each example carries its own power of two
    for b, n in enumerate((7, 5)):
        with pytest.warns(RuntimeWarning, match="exceeds"):
            one = FFIntegratedDecomposition(model32).decompose(ids[b : b + 1, -n:], return_rollout=False)
        alone = one.scores[0].double() * 2.0 ** float(one.extras["rollout_log2_scale"][0])
        torch.testing.assert_close(alone, unscaled[b, -n:], rtol=1e-5, atol=0)
    # the full rollout's explained rows agree with the scores
    full = res.rollout.double() * torch.exp2(res.extras["full_rollout_log2_scale"].double())[:, None, None]
    rows = full[torch.arange(2), res.explained_position]
    torch.testing.assert_close(rows[real], unscaled[real], rtol=1e-4, atol=0)


def test_row_normalized_rollout_of_the_same_model_needs_no_scale():
    ids, mask = decoder_batch([7, 5], seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        res = FFIntegratedDecomposition(_loud_llama(torch.float32), rollout="row_normalized").decompose(ids, additional_forward_args=(mask,))
    assert "rollout_log2_scale" not in res.extras and torch.isfinite(res.scores).all()
    torch.testing.assert_close(res.scores.sum(-1), torch.ones(2), rtol=1e-5, atol=0)


@pytest.mark.parametrize("convention", ["raw", "row_normalized"])
def test_carried_rollout_is_bit_for_bit_the_plain_product_when_it_fits(convention):
    g = torch.Generator().manual_seed(0)
    maps = torch.rand(3, 6, 9, 9, generator=g) * 40.0  # row sums ~180: 1e13 over 6 layers, far from the limit
    pos = torch.tensor([0, 4, 8])
    prep = (lambda m: m / m.sum(-1, keepdim=True)) if convention == "row_normalized" else (lambda m: m)
    joint = prep(maps[:, 0])
    for l in range(1, 6):
        joint = prep(maps[:, l]) @ joint
    row = prep(maps[:, -1])[torch.arange(3), pos]
    for l in range(4, -1, -1):
        row = torch.einsum("bj,bjk->bk", row, prep(maps[:, l]))
    assert torch.equal(rollout(maps, convention), joint)
    assert torch.equal(rollout_rows(maps, pos, convention), row)
    scaled, scale = rollout_scaled(maps, convention)
    assert torch.equal(scaled, joint) and (scale == 0).all()
    store = LayerMapStore(6, causal=False, dense=False)
    for l in range(6):
        store.put(l, maps[:, l])
    assert torch.equal(store.rollout_rows(pos, convention), row)


def test_carried_rollout_past_the_range_matches_float64_and_plain_functions_give_inf_not_nan():
    g = torch.Generator().manual_seed(1)
    maps = (torch.rand(2, 40, 6, 6, generator=g) * 2e3).tril()  # causal, row sums up to ~1e4: 1e120 over 40 layers
    maps[1] = maps[1] / maps[1].sum(-1, keepdim=True)  # example 1: rows sum to 1, no scale needed (judged per example)
    pos = torch.tensor([5, 5])
    ref = _naive_rows(maps, pos)
    for rows, scale in (rollout_rows_scaled(maps, pos), _store_rows(maps, pos, causal=True)):
        assert torch.isfinite(rows).all()
        assert int(scale[0]) > 0 and int(scale[1]) == 0
        got = rows.double() * torch.exp2(scale.double())[:, None]
        for b in range(2):  # tolerance scaled to each example's magnitude (float32 underflows below 1e-45)
            torch.testing.assert_close(got[b], ref[b], rtol=1e-5, atol=1e-6 * float(ref[b].abs().max()))
    plain = rollout_rows(maps, pos)
    assert not torch.isnan(plain).any() and torch.isinf(plain[0]).any()
    torch.testing.assert_close(plain[1].double(), ref[1], rtol=1e-5, atol=1e-6 * float(ref[1].abs().max()))
    joint, jscale = rollout_scaled(maps)
    assert torch.isfinite(joint).all() and int(jscale[0]) > 0 and int(jscale[1]) == 0
    assert not torch.isnan(rollout(maps)).any()


def _store_rows(maps, pos, causal):
    store = LayerMapStore(maps.shape[1], causal=causal, dense=False)
    for l in range(maps.shape[1]):
        store.put(l, maps[:, l])
    return store.rollout_rows_scaled(pos)


def test_globenc_on_an_ordinary_model_reports_no_scale():
    ids, mask = decoder_batch([7, 5], seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = GlobEncAttribution(make_decoder("llama")).decompose(ids, additional_forward_args=(mask,))
    assert "rollout_log2_scale" not in res.extras and torch.isfinite(res.scores).all()


def test_explain_positions_of_an_overflowing_raw_rollout_is_finite_and_equals_the_single_position_calls():
    from captum_normattr.attr.llm import explain_positions

    ids, _ = decoder_batch([7], seed=1)
    model = _loud_llama(torch.float32)
    ffd = FFIntegratedDecomposition(model)
    with pytest.warns(RuntimeWarning, match=r"exceeds torch.float32's range.*row_normalized"):
        ex = explain_positions(ffd, ids[0], torch.tensor([3, 6]))
    scale = ex.extras["rollout_log2_scale"]
    assert torch.isfinite(ex.scores).all() and bool((scale > 0).all())
    for k, p in enumerate((3, 6)):
        with pytest.warns(RuntimeWarning, match="exceeds"):
            res = FFIntegratedDecomposition(model, explained_position=p).decompose(ids[:, : p + 1], return_rollout=False)
        single = res.scores[0].double() * 2.0 ** float(res.extras["rollout_log2_scale"][0])
        multi = ex.scores[k, : p + 1].double() * 2.0 ** float(scale[k])
        torch.testing.assert_close(multi, single, rtol=1e-4, atol=0)
