r"""ValueZeroingAttribution against inseq's own value zeroing (``inseq.attr.feat.ops.value_zeroing``).

inseq is optional (the ``[baselines]`` extra): every test here skips without it, naming the install.
docs/value_zeroing.md ("Against inseq") says what differs between the two implementations and why
the comparison below is set up as it is:

- inseq compares the LAST layer after the model's final norm (``ln_f`` / ``norm``), this package
  compares every layer's own output: the final norm is replaced by the identity in both runs;
- inseq computes ``1 - cos`` in float32 (its states are cast with ``.float()``), so the tolerance
  of a normalised row is the float32 rounding of ``1 - cos`` divided by the row's sum;
- inseq sets distances below ``min_score_threshold`` (1e-5) to 0 before it normalises, and leaves
  the future positions of a causal row NaN (here: 0);
- transformers 5 returns a tensor from a decoder layer where inseq's block hook expects a tuple,
  and names GPT-2's value tensor ``value_states`` where inseq's GPT-2 entry says ``value``: the
  op is driven through a small adapter that fixes both (:class:`_InseqAdapter`, :class:`_TensorBlockOp`).
"""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from captum_normattr.attr.value_zeroing import ValueZeroingAttribution

__all__: list = []

INSEQ_INSTALL = 'pip install "captum-normattr[baselines]" (inseq>=0.7.1)'
pytestmark = pytest.mark.skipif(importlib.util.find_spec("inseq") is None,
                                reason="the inseq comparison needs inseq, which is not installed: " + INSEQ_INSTALL)

#: a bound on float32's error in 1 - cos of two float32 vectors (inseq's nn.CosineSimilarity): a few eps_32
FLOAT32_COSINE_ERROR = 16 * torch.finfo(torch.float32).eps
INSEQ_THRESHOLD = 1e-5


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=3, n_embd=24, n_head=4, n_positions=64, vocab_size=50, bos_token_id=0, eos_token_id=0,
                     initializer_range=0.5, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).eval()
    model.transformer.ln_f = nn.Identity()
    return model, model.transformer, "attn"


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0, initializer_range=0.5, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    model.model.norm = nn.Identity()
    return model, model.model, "self_attn"


BUILDERS = {"gpt2": _gpt2, "llama_gqa": _llama}


def _inseq_op():
    from inseq.attr.feat.ops.value_zeroing import ValueZeroing

    class _TensorBlockOp(ValueZeroing):
        r"""inseq's op with a block hook that also accepts the plain tensor a transformers 5 layer returns."""

        def get_states_extract_and_patch_hook(self, block_idx: int, hidden_state_idx: int = 0):
            def hook(module, args, output):
                out = output if torch.is_tensor(output) else output[hidden_state_idx]
                self.corrupted_block_output_states[block_idx] = out.clone().float().detach().cpu()
                clean = self.clean_block_output_states[block_idx].to(out.device)
                if torch.is_tensor(output):
                    return clean
                return output[:hidden_state_idx] + (clean,) + output[hidden_state_idx + 1:]
            return hook

    return _TensorBlockOp


class _InseqAdapter(nn.Module):
    r"""The few members of inseq's ``HuggingfaceDecoderOnlyModel`` that its value-zeroing op reads."""

    def __init__(self, model: nn.Module, decoder: nn.Module, attention: str) -> None:
        super().__init__()
        self.model, self.decoder = model, decoder
        self.config = SimpleNamespace(value_vector="value_states", self_attention_module=attention)
        self.is_encoder_decoder = False

    def get_decoder(self) -> nn.Module:
        return self.decoder

    def forward_with_output(self, ids: torch.Tensor, **kwargs):
        return self.model(ids, **kwargs)

    @staticmethod
    def get_hidden_states_dict(output) -> dict:
        return {"decoder_hidden_states": torch.stack(output.hidden_states, dim=1)}


def _run_both(family: str, tokens: int = 17):
    model, decoder, attention = BUILDERS[family]()
    ids = torch.randint(1, 50, (1, tokens), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hidden = torch.stack(model(ids, output_hidden_states=True).hidden_states, dim=1)
    op = _inseq_op()(_InseqAdapter(model, decoder, attention))
    # (B, T_attributed, T_generated, L) -> (L, i, j); NaN (future positions of a causal row) -> 0
    def layers_rows(scores: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(scores[0].permute(2, 1, 0).double(), nan=0.0)

    unthresholded = layers_rows(op.compute_modules_post_zeroing_similarity(
        (ids,), (), hidden, attention, use_causal_mask=True, min_score_threshold=-1.0))
    (thresholded,) = op.attribute((ids,), (), decoder_hidden_states=hidden)
    ours = ValueZeroingAttribution(model).decompose(ids)
    return ours.extras["cosine_distances"][0].double(), unthresholded, layers_rows(thresholded)


def _normalised(distances: torch.Tensor) -> torch.Tensor:
    return distances / distances.sum(-1, keepdim=True).clamp_min(torch.finfo(distances.dtype).tiny)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_layer_row_matches_inseq_to_float32_rounding(family):
    distances, inseq_rows, _ = _run_both(family)
    assert distances.shape == inseq_rows.shape == (3, 17, 17)
    assert float(distances.amax()) > 1e-3, "the random model mixes too little for a meaningful comparison"
    tolerance = FLOAT32_COSINE_ERROR / distances.sum(-1, keepdim=True)  # per row: 1 - cos's rounding / the row sum
    error = (_normalised(distances) - inseq_rows).abs()
    assert bool((error <= tolerance).all()), (
        f"{family}: max error {float(error.amax()):.3g}, worst excess {float((error - tolerance).amax()):.3g}")
    assert bool((torch.triu(inseq_rows, diagonal=1) == 0).all())  # both causal


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_inseq_threshold_reproduced(family):
    r"""inseq's default output (distances under 1e-5 set to 0, then normalised) from our raw distances, on every
    row where no distance lies within float32 rounding of the threshold (there a flip is rounding, not a bug)."""
    distances, _, inseq_rows = _run_both(family)
    kept = torch.where(distances < INSEQ_THRESHOLD, torch.zeros_like(distances), distances)
    causal = torch.ones_like(distances, dtype=torch.bool).tril()
    ambiguous = (((distances - INSEQ_THRESHOLD).abs() < FLOAT32_COSINE_ERROR) & causal).any(-1)
    assert float(ambiguous.double().mean()) < 0.4  # most rows are checked
    rows = ~ambiguous
    tolerance = FLOAT32_COSINE_ERROR / kept.sum(-1, keepdim=True).clamp_min(INSEQ_THRESHOLD)
    error = (_normalised(kept) - inseq_rows).abs()
    assert bool((error <= tolerance)[rows].all()), f"{family}: max error {float(error[rows].amax()):.3g}"
