r"""DecompX's cost model and the algorithm the LLM API chooses for n explained logits at T tokens (issue 35, item 4)."""
from __future__ import annotations

import pytest
import torch

from captum_normattr import DecompXAttribution
from captum_normattr.attr import decompx as dx
from captum_normattr.attr.llm import explain_positions
from decoder_models import make_decoder


def test_cost_model_reproduces_the_measured_coefficients():
    for t, aa, ba, af, bf in dx.DECOMPX_COST_MODEL:
        for n in (1, 7):
            assert dx.decompx_cost("adjoint", n, t) == pytest.approx(aa + ba * n, rel=1e-12)
            assert dx.decompx_cost("forward", n, t) == pytest.approx(af + bf * n, rel=1e-12)
    # between two measured lengths: between their costs; beyond the last: the forward propagation grows with T
    (t0, *_), (t1, *_) = dx.DECOMPX_COST_MODEL[:2]
    mid = dx.decompx_cost("forward", 4, (t0 + t1) // 2)
    assert min(dx.decompx_cost("forward", 4, t0), dx.decompx_cost("forward", 4, t1)) <= mid
    assert mid <= max(dx.decompx_cost("forward", 4, t0), dx.decompx_cost("forward", 4, t1))
    t_last = dx.DECOMPX_COST_MODEL[-1][0]
    assert dx.decompx_cost("forward", 1, 2 * t_last) > 1.9 * dx.decompx_cost("forward", 1, t_last) - 1
    with pytest.raises(ValueError, match="algorithm"):
        dx.decompx_cost("spread", 1, 8)


def test_chooser_picks_the_cheaper_and_switches_once_in_n():
    for t in (8, 32, 100, 128, 300, 512, 2048):
        picks = [dx.choose_decompx_algorithm(n, t) for n in range(1, t + 1)]
        for n, pick in zip(range(1, t + 1), picks):
            cheaper = min(("adjoint", "forward"), key=lambda a: dx.decompx_cost(a, n, t))
            assert pick == cheaper
        # adjoint for few targets; once the forward propagation is cheaper it stays so for more targets
        assert picks[0] == "adjoint"
        if "forward" in picks:
            first = picks.index("forward")
            assert set(picks[first:]) == {"forward"}
    # the forward propagation is chosen where the table says it is cheaper (many targets on a short sequence)
    assert dx.choose_decompx_algorithm(64, 32) == "forward"
    with pytest.raises(ValueError):
        dx.choose_decompx_algorithm(0, 10)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_auto_follows_the_chooser_and_both_algorithms_agree(family, monkeypatch):
    model = make_decoder(family)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 50, (12,), generator=g)
    positions = torch.arange(4, 12)
    target = torch.randint(3, 50, (8,), generator=g)
    ran = []
    original = DecompXAttribution._run

    def spy(self, prepared, readout, algorithm):
        ran.append(algorithm)
        return original(self, prepared, readout, algorithm)

    monkeypatch.setattr(DecompXAttribution, "_run", spy)
    got = {}
    for forced in ("adjoint", "forward"):
        monkeypatch.setattr(dx, "choose_decompx_algorithm", lambda n, t, forced=forced: forced)
        got[forced] = explain_positions(DecompXAttribution(model), ids, positions, target)
        assert ran[-1] == forced
    # an algorithm the user forces is kept whatever the chooser says
    explain_positions(DecompXAttribution(model, algorithm="adjoint"), ids, positions, target)
    assert ran[-1] == "adjoint"
    a, f = got["adjoint"], got["forward"]
    scale = float(f.scores.abs().max())
    assert torch.allclose(a.scores, f.scores, rtol=0, atol=1e-10 * scale)
    assert torch.allclose(a.no_token, f.no_token, rtol=0, atol=1e-10 * scale)
    assert float(a.delta.max()) <= 1e-10 * scale and float(f.delta.max()) <= 1e-10 * scale
