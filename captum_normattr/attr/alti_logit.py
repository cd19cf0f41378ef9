r"""ALTI-Logit (Ferrando et al. 2023): signed token contributions to a next-token logit."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Tuple, Union

import torch
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.attr.base import LayerDecompositionAttribution, format_output
from captum_normattr.attr.inputs import explained_positions, prepare_inputs
from captum_normattr.decompose.alti import rows_per_chunk
from captum_normattr.decompose.decoder import alti_logit_terms, pre_ln_completeness_error
from captum_normattr.models.adapters import get_path


@dataclass
class ALTILogitResult:
    r"""Everything ALTI-Logit computed for one batch.

    Attributes:
        method: ``"ALTI-Logit"``.
        scores: (B, T) signed contribution of every input token to the logit; pads exactly 0.
        layer_token_contributions: (B, L, T) the same per layer (sums over L to ``scores``).
        layer_logit_updates: (B, L, T) logit of the attention update of layer l at the
            explained position coming from source position j, before the rollout.
        embedding: (B,) logit of the embedding x_{0,i} at the explained position (no token).
        ff: (B, L) logit of every feed-forward update at i (no token).
        attention_bias: (B, L) logit of every attention output bias b_O (no token).
        final_bias: (B,) final-norm beta and LM-head bias along the unembedding (no token).
        logit: (B,) the model's real logit (target, or target minus foil).
        delta: (B,) ``logit`` minus (token scores + no-token terms): the completeness error.
        target: (B,) token ids; foil: (B,) or None.
        attention_mask: (B, T); explained_position: (B,).
        extras: e.g. ``"completeness_error"`` (L,) of the attention-block parts.
    """

    method: str
    scores: Tensor
    layer_token_contributions: Tensor
    layer_logit_updates: Tensor
    embedding: Tensor
    ff: Tensor
    attention_bias: Tensor
    final_bias: Tensor
    logit: Tensor
    delta: Tensor
    target: Tensor
    foil: Optional[Tensor]
    attention_mask: Tensor
    explained_position: Tensor
    extras: Dict[str, Tensor] = field(default_factory=dict)

    @property
    def no_token_total(self) -> Tensor:
        r"""(B,) the sum of all terms that belong to no token."""
        return self.embedding + self.ff.sum(-1) + self.attention_bias.sum(-1) + self.final_bias

    def to(self, device) -> "ALTILogitResult":
        r"""A copy with every tensor moved to ``device``."""
        kw = {k: v.to(device) for k, v in self.__dict__.items() if isinstance(v, Tensor)}
        return replace(self, extras={k: v.to(device) for k, v in self.extras.items()}, **kw)


def _as_ids(x: Any, b: int, name: str, device) -> Tensor:
    if isinstance(x, int) and not isinstance(x, bool):
        return torch.full((b,), x, dtype=torch.long, device=device)
    if isinstance(x, list) and all(isinstance(v, int) for v in x):
        x = torch.tensor(x, dtype=torch.long)
    if isinstance(x, Tensor) and not x.is_floating_point():
        if x.dim() == 0:
            return torch.full((b,), int(x), dtype=torch.long, device=device)
        if tuple(x.shape) == (b,):
            return x.to(device=device, dtype=torch.long)
        raise ValueError(f"{name} must be an int or a ({b},) tensor of token ids; got shape {tuple(x.shape)}")
    raise TypeError(f"{name} must be a token id (int), a list of ints or a ({b},) long tensor; got {type(x).__name__}")


class ALTILogitAttribution(LayerDecompositionAttribution):
    r"""Signed contributions of every input token to the logit of a target token (Ferrando et al. 2023).

    At the explained position i (default: the last real token) the logit is
    u . FinalNorm(x_{L,i}) + bias, u = W_U[target] (or W_U[target] - W_U[foil]). The final norm
    is linearised at the real scale of x_{L,i}, so each additive piece of the residual stream
    has its own logit. The attention update of layer l splits exactly over the source
    positions j; its logit is carried to the input tokens by the ALTI rollout of the layers
    below l (rows summing to 1). The pieces that belong to no token (embedding at i, every
    feed-forward update, attention output biases, final-norm beta and LM-head bias) are kept
    apart, so that token scores plus these terms equal the model's logit; the remaining
    difference is the convergence delta.

    Args:
        model: a GPT-2 / Llama / Mistral / Qwen2 model with its LM head
            (``GPT2LMHeadModel``, ``*ForCausalLM``), or a bare ``*Model`` together with
            ``unembedding``.
        unembedding: optional (V, D) unembedding matrix (rows = tokens), used instead of the
            model's LM head (needed for a bare ``*Model``).
        explained_position: the position whose next-token logit is explained: ``"last"``
            (default), an int or a (B,) tensor.
        memory_budget_mb: memory for the explicit parts of the ALTI maps, per chunk of rows.

    Examples::

        >>> model = AutoModelForCausalLM.from_pretrained("gpt2")
        >>> ids = tok(["The capital of France is"], return_tensors="pt")["input_ids"]
        >>> al = ALTILogitAttribution(model)
        >>> scores, delta = al.attribute(ids, target=tok(" Paris")["input_ids"][0],
        ...                              return_convergence_delta=True)
        >>> res = al.decompose(ids, target=(paris_id, london_id))   # target minus foil
    """

    method_name = "ALTI-Logit"

    def __init__(
        self,
        model: nn.Module,
        unembedding: Optional[Tensor] = None,
        explained_position: Union[int, str, Tensor, None] = "last",
        memory_budget_mb: float = 1024.0,
    ) -> None:
        super().__init__(model, explained_position, "raw")
        if not self.adapter.pre_ln or self.adapter.final_norm is None:
            raise ValueError(
                f"ALTILogitAttribution explains next-token logits of pre-LN decoders (GPT-2, Llama, Mistral, Qwen2); "
                f"{self.adapter.family} is not one"
            )
        if memory_budget_mb <= 0:
            raise ValueError("memory_budget_mb must be positive")
        self.memory_budget_mb = memory_budget_mb
        d = model.config.hidden_size
        if unembedding is not None:
            if not isinstance(unembedding, Tensor) or unembedding.dim() != 2 or unembedding.shape[1] != d:
                raise ValueError(f"unembedding must be a (vocab, {d}) tensor")
            self._unembed, self._unembed_bias = unembedding, None
        else:
            head = None
            if self.adapter.lm_head is not None:
                try:
                    head = get_path(model, self.adapter.lm_head)
                except AttributeError:
                    head = None
            if head is None:
                raise ValueError(
                    f"{type(model).__name__} has no LM head: pass a model with one (GPT2LMHeadModel, "
                    f"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) or an explicit unembedding=(vocab, {d}) matrix"
                )
            self._unembed, self._unembed_bias = head.weight, getattr(head, "bias", None)  # nn.Linear: (V, D)

    def predicted_tokens(self, final_norm_out: Tensor, pos: Tensor) -> Tensor:
        r"""The argmax next token at the explained positions, from the real final-norm output.

        Args:
            final_norm_out: (B, T, D) the real output of the final norm.
            pos: (B,) explained positions.

        Returns:
            (B,) long token ids.
        """
        h = final_norm_out[torch.arange(final_norm_out.shape[0], device=pos.device), pos]
        logits = h @ self._unembed.to(h.dtype).T
        if self._unembed_bias is not None:
            logits = logits + self._unembed_bias.to(h.dtype)
        return logits.argmax(-1)

    def _direction(self, target: Any, b: int, device, dtype) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        if target is None:
            raise ValueError("ALTILogitAttribution needs target: a token id, a (B,) tensor of ids, or (target, foil)")
        foil = None
        if isinstance(target, tuple):
            if len(target) != 2:
                raise ValueError("a tuple target must be (target, foil)")
            target, foil = target
        elif isinstance(target, Tensor) and target.dim() == 2 and target.shape == (b, 2):
            target, foil = target[:, 0], target[:, 1]
        t_ids = _as_ids(target, b, "target", device)
        f_ids = None if foil is None else _as_ids(foil, b, "foil", device)
        vocab = self._unembed.shape[0]
        for ids, name in ((t_ids, "target"), (f_ids, "foil")):
            if ids is not None and bool(((ids < 0) | (ids >= vocab)).any()):
                raise ValueError(f"{name} token ids must lie in [0, {vocab - 1}]; got {ids.tolist()}")
        W = self._unembed.detach().to(device=device, dtype=dtype)
        u = W[t_ids]
        ub = torch.zeros(b, dtype=dtype, device=device)
        if self._unembed_bias is not None:
            ub = self._unembed_bias.detach().to(device=device, dtype=dtype)[t_ids]
        if f_ids is not None:
            u = u - W[f_ids]
            if self._unembed_bias is not None:
                ub = ub - self._unembed_bias.detach().to(device=device, dtype=dtype)[f_ids]
        return u, ub, t_ids, f_ids

    def decompose(  # type: ignore[override]
        self, inputs: Union[Tensor, Tuple[Tensor]], target: Any = None, additional_forward_args: Any = None
    ) -> ALTILogitResult:
        r"""All terms of the ALTI-Logit decomposition.

        Args:
            inputs: token ids (B, T) (or input embeddings (B, T, D)), or a 1-tuple.
            target: token id (int), per-example ids (list or (B,) tensor), or a tuple
                (target, foil) of such (explains logit(target) - logit(foil)); a (B, 2) tensor
                gives (target, foil) per example; None (default): the token the model predicts
                at the explained position (argmax of its real logits).
            additional_forward_args: attention_mask (B, T) (left or right padding).

        Returns:
            :class:`ALTILogitResult`.
        """
        prepared = prepare_inputs(self.model, self.adapter, inputs, additional_forward_args)
        valid = prepared.valid
        pos = explained_positions(self.explained_position, valid)
        with torch.no_grad():
            layers, (fparams, f_in, f_out) = self.capture_full(prepared)
            b, t, d = layers[0].hidden_in.shape
            if target is None:  # the model's own next-token prediction at the explained position
                target = self.predicted_tokens(f_out, pos)
            u, ub, t_ids, f_ids = self._direction(target, b, f_in.device, f_in.dtype)
            chunk = rows_per_chunk(b, t, d, f_in.element_size(), int(self.memory_budget_mb * 2**20))
            terms = alti_logit_terms(layers, fparams, f_in, f_out, u, ub, valid, pos, chunk, self.adapter.causal)
            errors = torch.stack([pre_ln_completeness_error(layer, valid) for layer in layers])
        return ALTILogitResult(
            method=self.get_name(),
            scores=terms["scores"],
            layer_token_contributions=terms["layer_token_contributions"],
            layer_logit_updates=terms["layer_logit_updates"],
            embedding=terms["embedding"],
            ff=terms["ff"],
            attention_bias=terms["attention_bias"],
            final_bias=terms["final_bias"],
            logit=terms["logit"],
            delta=terms["delta"],
            target=t_ids,
            foil=f_ids,
            attention_mask=prepared.attention_mask,
            explained_position=pos,
            extras={"completeness_error": errors},
        )

    @log_usage()
    def attribute(
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        target: Any = None,
        additional_forward_args: Any = None,
        return_convergence_delta: bool = False,
    ) -> Union[Tensor, Tuple[Tensor], Tuple[Union[Tensor, Tuple[Tensor]], Tensor]]:
        r"""Signed token contributions to the target logit at the explained position.

        Args:
            inputs: token ids (B, T) (or input embeddings (B, T, D)), or a 1-tuple of them.
            target: token id, (B,) ids, or (target, foil) — see :meth:`decompose`; None (default):
                the token the model predicts at the explained position.
            additional_forward_args: attention_mask (B, T).
            return_convergence_delta: also return delta (B,): the real logit minus token
                scores minus the no-token terms.

        Returns:
            (B, T) scores (a 1-tuple for tuple inputs); pads exactly 0; with
            ``return_convergence_delta``, (scores, delta).
        """
        res = self.decompose(inputs, target, additional_forward_args)
        return format_output(inputs, res.scores, res.delta, return_convergence_delta)

    def has_convergence_delta(self) -> bool:
        return True

    def get_name(self) -> str:
        return "ALTI-Logit"
