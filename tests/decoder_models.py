r"""Tiny random decoder models (float64) of every supported decoder family, for tests.

Biases and norm weights are perturbed away from 0 and 1 so that bias mistakes show.
``exact_norms=True`` replaces the Llama-family RMSNorm modules (which compute in float32
even in a float64 model) by ``torch.nn.RMSNorm`` with the same weights, so that the
model's own norms are exact in float64 and completeness can be tested to 1e-10.
"""
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Model,
)

VOCAB = 50
DECODER_FAMILIES = ["gpt2", "llama", "mistral", "qwen2"]


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("wte", "wpe", "embed_tokens")):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))  # realistic scale next to the biases
            elif name.endswith("weight") and p.dim() == 2:
                p.mul_(10.0)  # std 0.2: attention and FF visibly mix tokens and gate pre-activations reach O(1)
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif "ln" in name.split(".")[-2] or "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _exact_rms_norms(model: torch.nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                new = torch.nn.RMSNorm(child.weight.shape[0], eps=child.variance_epsilon, dtype=child.weight.dtype)
                with torch.no_grad():
                    new.weight.copy_(child.weight)
                setattr(parent, name, new)


def make_decoder(family: str, attn: str = "sdpa", seed: int = 0, lm_head: bool = True, tied: bool = True,
                 exact_norms: bool = True, layers: int = 2) -> torch.nn.Module:
    r"""A tiny float64 decoder: ``gpt2``, ``llama`` (GQA: 4 query heads, 2 key/value heads),
    ``mistral`` (GQA 4/1) or ``qwen2`` (qkv biases, GQA 4/2)."""
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=24, n_layer=layers, n_head=4, n_inner=40,
                         activation_function="gelu_new", tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
        cls = GPT2LMHeadModel if lm_head else GPT2Model
    else:
        common = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=layers,
                      num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=tied, hidden_act="silu",
                      rms_norm_eps=1e-6)
        if family == "llama":
            cfg, cls = LlamaConfig(num_key_value_heads=2, **common), (LlamaForCausalLM if lm_head else LlamaModel)
        elif family == "mistral":
            cfg, cls = MistralConfig(num_key_value_heads=1, sliding_window=None, **common), MistralForCausalLM
            cls = cls if lm_head else MistralModel
        elif family == "qwen2":
            cfg, cls = Qwen2Config(num_key_value_heads=2, use_sliding_window=False, **common), Qwen2ForCausalLM
            cls = cls if lm_head else Qwen2Model
        else:
            raise ValueError(family)
    cfg._attn_implementation = attn
    model = cls(cfg).double().eval()
    _perturb(model, seed)
    if not tied and hasattr(model, "lm_head"):
        with torch.no_grad():
            model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight) * 0.2)
    if exact_norms and family != "gpt2":
        _exact_rms_norms(model)
    return model


def decoder_batch(lengths, seed=0, t=None, left=True):
    r"""Token ids and mask; padding on the left (``left=True``) or right."""
    g = torch.Generator().manual_seed(seed)
    t = t or max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left:
            mask[i, t - n:] = 1
            ids[i, : t - n] = 0
        else:
            mask[i, :n] = 1
            ids[i, n:] = 0
    return ids, mask
