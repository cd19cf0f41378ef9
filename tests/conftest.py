r"""Tiny random models of every supported family, float64, with perturbed biases and norms."""
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    ElectraConfig,
    ElectraForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)

# the shared test helpers (tiny-model zoo, references, tokenizers) live in tests/fixtures/
sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

VOCAB = 60


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif "LayerNorm" in name or "layer_norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def make_model(family: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, max_position_embeddings=24, num_labels=2)
    if family == "bert":
        cfg = BertConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, hidden_act="gelu", **common)
        cls = BertForSequenceClassification
    elif family == "roberta":
        cfg = RobertaConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40, hidden_act="gelu_new", pad_token_id=1, **common)
        cls = RobertaForSequenceClassification
    elif family == "electra":
        cfg = ElectraConfig(embedding_size=16, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, hidden_act="relu", **common)
        cls = ElectraForSequenceClassification
    elif family == "distilbert":
        cfg = DistilBertConfig(dim=24, n_layers=2, n_heads=4, hidden_dim=40, activation="gelu", **common)
        cls = DistilBertForSequenceClassification
    else:
        raise ValueError(family)
    cfg._attn_implementation = attn
    model = cls(cfg).double().eval()
    return _perturb(model, seed)


FAMILIES = ["bert", "roberta", "electra", "distilbert"]


@pytest.fixture(params=FAMILIES)
def tiny_model(request):
    return make_model(request.param)


def random_batch(lengths, seed=0, t=None):
    g = torch.Generator().manual_seed(seed)
    t = t or max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        ids[i, n:] = 0
    return ids, mask
