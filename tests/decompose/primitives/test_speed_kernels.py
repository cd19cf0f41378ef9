r"""The cache-blocked kernels (docs/performance.md) agree with the plain formulas at any tile size."""
import pytest
import torch

from captum_normattr.decompose.methods.alti import alti_map
from captum_normattr.decompose.primitives.attention import attention_context, part_norms_gram
from captum_normattr.decompose.primitives.chunking import tile_for_cache
from alti_reference import probs_of as _probs, alti_layer as _alti_layer, naive_alti as _naive_alti  # noqa: F401








@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile_bytes", [1, 3000, 2**30])
def test_alti_tiles_match_explicit_parts(causal, tile_bytes):
    # 37 rows: tiles of 16 rows leave a ragged last tile
    probs, projected, residual, output, scale, valid = _alti_layer(0, 3, 2, 37, 5, causal)
    valid[1, -4:] = False
    got = alti_map(probs, projected, residual, output, valid, scale, None, causal, tile_bytes=tile_bytes)
    want = _naive_alti(probs, projected, residual, output, valid, scale, causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_gram_norms_and_context_match_explicit_parts(causal):
    gen = torch.Generator().manual_seed(1)
    b, h, t, dh, d = 2, 3, 70, 4, 6
    probs = _probs(b, h, t, causal, gen)
    values = torch.randn(b, h, t, dh, dtype=torch.float64, generator=gen)
    w = torch.randn(h, dh, d, dtype=torch.float64, generator=gen)
    lin = torch.randn(d, d, dtype=torch.float64, generator=gen)
    diag = torch.randn(b, t, d, dtype=torch.float64, generator=gen)
    projected = torch.einsum("bhtk,hkd->bhtd", values, w)
    parts = torch.einsum("bhij,bhjd->bijd", probs, projected)
    idx = torch.arange(t)
    parts[:, idx, idx] = diag
    want = (parts @ lin).norm(dim=-1)
    got = part_norms_gram(probs, values, w, diag, lin, None, causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    torch.testing.assert_close(attention_context(probs, values, causal), probs @ values, rtol=0, atol=1e-12)


def test_tile_for_cache_respects_the_row_cap():
    assert tile_for_cache(32, 128, 384, 4) == (1, 21, 128)
    assert tile_for_cache(1, 1024, 768, 4)[1] == 16
    assert tile_for_cache(1, 1024, 768, 4, max_rows=4)[1] == 4


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_bytes", [None, 1])
def test_compiled_alti_kernel_matches_explicit_parts(causal, block_bytes, monkeypatch):
    r"""The fused torch.compile kernel (forced on, float64) gives the explicit-parts map to 1e-12,
    in one row block or in the smallest blocks its memory bound allows."""
    from captum_normattr.decompose.methods import alti

    if block_bytes is not None:
        monkeypatch.setattr(alti, "FUSED_BLOCK_BYTES", block_bytes)
    probs, projected, residual, output, scale, valid = _alti_layer(1, 2, 3, 37, 8, causal)
    valid[0, :3] = False
    alti.use_compiled_kernel(True)
    try:
        with _no_fallback_warning():
            got = alti_map(probs, projected, residual, output, valid, scale, None, causal)
    finally:
        alti.use_compiled_kernel(None)
    want = _naive_alti(probs, projected, residual, output, valid, scale, causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _no_fallback_warning():
    import warnings

    class _Guard:
        def __enter__(self):
            self._cm = warnings.catch_warnings(record=True)
            self._rec = self._cm.__enter__()
            warnings.simplefilter("always")

        def __exit__(self, *exc):
            self._cm.__exit__(*exc)
            msgs = [str(w.message) for w in self._rec if "compiled ALTI kernel" in str(w.message)]
            assert not msgs, msgs  # the compiled kernel ran (no silent fallback)

    return _Guard()


# --- causal row blocks of the recording attention (models/capture.py) -------------------------
def _causal_mask(lengths, t, left):
    r"""The additive (B, 1, T, T) float64 mask of a causal model with padding, as transformers builds it."""
    keep = torch.ones(t, t, dtype=torch.bool).tril().expand(len(lengths), 1, t, t).clone()
    for i, n in enumerate(lengths):
        if left:
            keep[i, ..., : t - n] = False
        else:
            keep[i, ..., n:] = False
    return torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min), keep


@pytest.mark.parametrize("case", ["right_pad", "bool", "left_pad", "not_causal", "position_bias"])
def test_causal_row_blocks_equal_the_full_square(case, monkeypatch):
    from captum_normattr.models.capture import attention as capture

    monkeypatch.setattr(capture, "_MIN_BLOCK_ROWS", 2)
    gen = torch.Generator().manual_seed(3)
    b, h, t, dh = 2, 4, 37, 5
    q, k, v = (torch.randn(b, n, t, dh, dtype=torch.float64, generator=gen) for n in (h, 2, 2))  # GQA 4/2
    mask, keep = _causal_mask([37, 30], t, left=case == "left_pad")
    bias = None
    if case == "bool":
        mask = keep
    elif case == "not_causal":
        mask = mask.clone()
        mask[1, 0, 5, 20] = 0.0  # one key after the query is visible: no skipping allowed
    elif case == "position_bias":
        bias = torch.randn(1, h, t, t, dtype=torch.float64, generator=gen)
    expect_blocks = case in ("right_pad", "bool", "position_bias")
    assert (capture._causal_row_blocks(mask, t, t) is not None) == expect_blocks
    full_out, full_p, _ = capture._eager_attention(q, k, v, mask, None, 0.0, False, True, bias, causal=False)
    out, p, _ = capture._eager_attention(q, k, v, mask, None, 0.0, False, True, bias, causal=True)
    torch.testing.assert_close(p, full_p, atol=1e-14, rtol=0)
    torch.testing.assert_close(out, full_out, atol=1e-13, rtol=0)
    if expect_blocks:
        assert not p.triu(1).any()  # the skipped triangle is exactly 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_causal_row_blocks_in_the_decomposition(family, monkeypatch):
    import captum_normattr as cn
    from captum_normattr.models.capture import attention as capture
    from captum_normattr.models.capture.session import recording
    from captum_normattr.models.adapters import get_adapter
    from decoder_models import decoder_batch, make_decoder

    model = make_decoder(family, lm_head=False)
    ids, mask = decoder_batch([30, 23], seed=1, left=False)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
    calls = []
    real = capture._causal_row_blocks
    monkeypatch.setattr(capture, "_MIN_BLOCK_ROWS", 2)
    monkeypatch.setattr(capture, "_causal_row_blocks", lambda *a: calls.append(real(*a)) or calls[-1])
    methods = {"alti": cn.ALTIAttribution(model), "globenc": cn.GlobEncAttribution(model)}
    blocked = {n: m.decompose(ids, additional_forward_args=(mask,)) for n, m in methods.items()}
    assert calls and all(c is not None for c in calls)  # the blocks ran in every layer
    seen = {}
    with recording(model, get_adapter(model), lambda layer: seen.setdefault("n", 0)):
        with torch.no_grad():
            recorded = model(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    torch.testing.assert_close(recorded[valid], plain[valid], atol=1e-12, rtol=0)
    monkeypatch.setattr(capture, "_causal_row_blocks", lambda *a: None)
    for n, m in methods.items():
        full = m.decompose(ids, additional_forward_args=(mask,))
        torch.testing.assert_close(blocked[n].scores, full.scores, atol=1e-12, rtol=0)
        torch.testing.assert_close(blocked[n].layer_maps, full.layer_maps, atol=1e-12, rtol=0)


def test_compiled_kernel_default_selection(monkeypatch):
    from captum_normattr.decompose.methods import alti
    from captum_normattr.decompose.primitives import compiled

    monkeypatch.delenv(alti.COMPILE_ENV, raising=False)
    big, per_example = alti.COMPILE_MIN_ELEMENTS, alti.COMPILE_MIN_EXAMPLE_ELEMENTS
    assert alti._compiled_kernel(torch.float64, 4 * big, 4 * per_example) is None  # float64: eager (exactness)
    assert alti._compiled_kernel(torch.float32, big // 2, 4 * per_example) is None  # small layer
    assert alti._compiled_kernel(torch.float32, 4 * big, per_example // 2) is None  # many short examples
    if not compiled.has_failed(alti._l1_distance_tile):
        assert alti._compiled_kernel(torch.float32, 4 * big, 4 * per_example) is not None
    alti.use_compiled_kernel(False)
    try:
        assert alti._compiled_kernel(torch.float32, 4 * big, 4 * per_example) is None
    finally:
        alti.use_compiled_kernel(None)


@pytest.mark.parametrize("dense", [False, True])
def test_map_store_products_and_alti_logit_rows_match_dense_products(dense):
    r"""The batched products of the rollout store (row blocks or dense) against explicit dense maps,
    and ALTI-Logit's per-layer rows l against e^T R_{l-1} = v_l M_{l-1} ... M_0 product by product."""
    from captum_normattr.decompose.primitives.rollout import LayerMapStore

    g = torch.Generator().manual_seed(0)
    n_layers, t = 4, 11
    maps = [torch.rand(2, t, t, generator=g, dtype=torch.float64).tril_() for _ in range(n_layers)]
    store = LayerMapStore(n_layers, causal=True, dense=dense, blocks=3)
    for l, m in enumerate(maps):
        store.put(l, m)
    rows = torch.randn(2, 3, t, generator=g, dtype=torch.float64)
    col = torch.randn(2, t, generator=g, dtype=torch.float64)
    for l, m in enumerate(maps):
        ref_r, ref_c = rows @ m, (m @ col.unsqueeze(-1)).squeeze(-1)  # tolerances scaled to each product
        assert torch.allclose(store.rows_times_layer(rows, l), ref_r, rtol=0, atol=1e-13 * float(ref_r.abs().max()))
        assert torch.allclose(store.layer_times_column(col, l), ref_c, rtol=0, atol=1e-13 * float(ref_c.abs().max()))
    # the rows of alti_logit_terms: layer l's logit updates carried down by M_{l-1} ... M_0
    from captum_normattr.decompose.methods.alti_logit import alti_logit_terms
    from captum_normattr.decompose.records import NormParams

    d = 5
    upd = torch.randn(2, n_layers, t, d, generator=g, dtype=torch.float64)
    w = torch.ones(d, dtype=torch.float64)
    params = NormParams(weight=w, bias=None, eps=1e-6, kind="rmsnorm")
    final_in = torch.randn(2, d, generator=g, dtype=torch.float64)
    unembed = torch.randn(2, d, generator=g, dtype=torch.float64)
    res = alti_logit_terms(upd, store, torch.zeros(2, d, dtype=torch.float64), torch.zeros(2, n_layers, d, dtype=torch.float64),
                           torch.zeros(n_layers, d, dtype=torch.float64), params, final_in, final_in, unembed,
                           torch.zeros(2, dtype=torch.float64), torch.ones(2, t, dtype=torch.bool), torch.tensor([t - 1, t - 1]))
    logit_updates = res["layer_logit_updates"]
    for l in range(n_layers):
        v = logit_updates[:, l]
        for m in range(l - 1, -1, -1):
            v = torch.einsum("bj,bjk->bk", v, maps[m])
        scale = max(float(v.abs().max()), 1.0)
        assert torch.allclose(res["layer_token_contributions"][:, l], v, rtol=0, atol=1e-12 * scale)
