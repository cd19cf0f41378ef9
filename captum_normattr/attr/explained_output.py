r"""The "explained output" of the signed methods (ALTI-Logit, DecompX): which logit, along which direction.

Two kinds, each parsing ``target`` once for every method that explains it:

- :class:`NextTokenLogit`: the next-token logit of a decoder at the explained position,
  ``<FinalNorm(x_L,i), u> + u_bias`` with u = W_U[target] (or W_U[target] - W_U[foil]) from
  the LM head (or an explicit unembedding matrix). ``target``: a token id, per-example ids,
  ``(target, foil)``, a (B, 2) tensor, or None for the token the model predicts.
- :class:`ClassLogit`: a class logit of a sequence classifier through its classification
  head, ``act(h_p W_d + b_d) W_c + b_c`` on the last layer's output at the head's token p.
  ``target``: a class index, per-example indices, or None for the predicted class.
- :class:`ImageClassLogit`: a class logit of a Vision Transformer classifier, linear in the
  final-norm output of the rows its head reads ([CLS]; [CLS] and distillation token;
  [CLS] and the mean of the patches).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from captum_normattr.models.adapters import ArchitectureAdapter, get_path, unwrap_model
from captum_normattr.models.heads import HeadAdapter, HeadParams, get_head_adapter, head_params
from captum_normattr.models.weights import weight_and_bias


VOCAB_BLOCK = 8192  # unembedding rows cast at a time for the predicted-token logits


def as_token_ids(x: Any, b: int, name: str, device) -> Tensor:
    r"""(B,) long ids from an int, a list of ints, or a 0-d / (B,) integer tensor."""
    if isinstance(x, int) and not isinstance(x, bool):
        return torch.full((b,), x, dtype=torch.long, device=device)
    if isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        x = torch.tensor(x, dtype=torch.long)
    if isinstance(x, Tensor) and not x.is_floating_point() and x.dtype != torch.bool:
        if x.dim() == 0:
            return torch.full((b,), int(x), dtype=torch.long, device=device)
        if tuple(x.shape) == (b,):
            return x.to(device=device, dtype=torch.long)
        raise ValueError(f"{name} must be an int or a ({b},) tensor of token ids; got shape {tuple(x.shape)}")
    raise TypeError(f"{name} must be a token id (int), a list of ints or a ({b},) long tensor; got {type(x).__name__}")


@dataclass
class LogitDirection:
    r"""One explained logit per example.

    Attributes:
        direction: (B, D) u, the unembedding row (or row difference).
        bias: (B,) the LM-head bias along u (0 if none).
        target: (B,) long target ids; foil: (B,) long foil ids or None.
    """

    direction: Tensor
    bias: Tensor
    target: Tensor
    foil: Optional[Tensor]


class NextTokenLogit:
    r"""The next-token logit of a decoder (its LM head, or an explicit unembedding).

    Args:
        model: a decoder with an LM head (``GPT2LMHeadModel``, ``*ForCausalLM``), or a bare
            ``*Model`` together with ``unembedding``.
        adapter: its adapter.
        unembedding: optional (V, D) unembedding matrix (rows = tokens).

    Raises:
        ValueError: for a model without an LM head and no ``unembedding``.
    """

    def __init__(self, model: nn.Module, adapter: ArchitectureAdapter, unembedding: Optional[Tensor] = None) -> None:
        model = unwrap_model(model)
        d = model.config.hidden_size
        if unembedding is not None:
            if not isinstance(unembedding, Tensor) or unembedding.dim() != 2 or unembedding.shape[1] != d:
                raise ValueError(f"unembedding must be a (vocab, {d}) tensor")
            self._weights = (unembedding, None)
            self._head = None
            return
        head = None
        if adapter.lm_head is not None:
            try:
                head = get_path(model, adapter.lm_head)
            except AttributeError:
                head = None
        if head is None:
            raise ValueError(
                f"{type(model).__name__} has no LM head: pass a model with one (GPT2LMHeadModel, "
                f"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) or an explicit unembedding=(vocab, {d}) matrix"
            )
        self._head, self._weights = head, None

    @property
    def weight(self) -> Tensor:
        r"""(V, D) the unembedding (nn.Linear weight), read where it lives (also from an accelerate hook)."""
        return self._head_weights()[0]

    @property
    def weight_bias(self) -> Optional[Tensor]:
        r"""(V,) the LM head's bias, or None."""
        return self._head_weights()[1]

    def _head_weights(self):
        if self._head is None:
            return self._weights
        return weight_and_bias(self._head, "lm_head")  # read at use: an offloaded head is on meta until then

    @property
    def vocab_size(self) -> int:
        return int((self._head.weight if self._head is not None else self._weights[0]).shape[0])  # meta has shapes

    def logits(self, final_out: Tensor) -> Tensor:
        r"""(B, V) next-token logits from the real final-norm output at the explained positions (B, D).

        The unembedding is cast to ``final_out``'s dtype and device :data:`VOCAB_BLOCK` rows at
        a time: a bfloat16 LM head of 128k x 4096 is never copied whole in float32 (2 GB).
        """
        weight, bias = self._head_weights()
        out = final_out.new_empty((final_out.shape[0], weight.shape[0]))
        for start in range(0, weight.shape[0], VOCAB_BLOCK):
            w = weight[start:start + VOCAB_BLOCK].detach().to(device=final_out.device, dtype=final_out.dtype)
            out[:, start:start + w.shape[0]] = final_out @ w.T
        if bias is not None:
            out = out + bias.detach().to(device=final_out.device, dtype=final_out.dtype)
        return out

    def resolve(self, target: Any, final_out: Tensor) -> LogitDirection:
        r"""The explained direction of every example.

        Args:
            target: a token id, per-example ids (list or (B,) tensor), ``(target, foil)`` of
                such, a (B, 2) tensor of (target, foil) rows, or None: the token the model
                predicts (argmax of its real logits).
            final_out: (B, D) the real final-norm output at the explained positions.

        Returns:
            :class:`LogitDirection` in ``final_out``'s dtype and device.
        """
        b, device, dtype = final_out.shape[0], final_out.device, final_out.dtype
        if target is None:
            target = self.logits(final_out).argmax(-1)
        foil = None
        if isinstance(target, tuple):
            if len(target) != 2:
                raise ValueError("a tuple target must be (target, foil)")
            target, foil = target
        elif isinstance(target, Tensor) and target.dim() == 2 and tuple(target.shape) == (b, 2):
            target, foil = target[:, 0], target[:, 1]
        t_ids = as_token_ids(target, b, "target", device)
        f_ids = None if foil is None else as_token_ids(foil, b, "foil", device)
        for ids, name in ((t_ids, "target"), (f_ids, "foil")):
            if ids is not None and bool(((ids < 0) | (ids >= self.vocab_size)).any()):
                raise ValueError(f"{name} token ids must lie in [0, {self.vocab_size - 1}]; got {ids.tolist()}")
        weight, bias = self._head_weights()

        def rows(t: Tensor, ids: Tensor) -> Tensor:  # only the rows used are cast (not the whole head)
            return t.detach()[ids.to(t.device)].to(device=device, dtype=dtype)

        u = rows(weight, t_ids)
        ub = torch.zeros(b, dtype=dtype, device=device)
        if bias is not None:
            ub = rows(bias, t_ids)
        if f_ids is not None:
            u = u - rows(weight, f_ids)
            if bias is not None:
                ub = ub - rows(bias, f_ids)
        return LogitDirection(u, ub, t_ids, f_ids)


class ClassLogit:
    r"""The class logits of a sequence classifier, through its classification head.

    Args:
        model: a classifier with a supported head
            (:func:`~captum_normattr.models.heads.supported_heads`).

    Raises:
        UnsupportedModelError: for a model without a supported classification head.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = unwrap_model(model)
        self.head: HeadAdapter = get_head_adapter(self.model)

    @property
    def position(self) -> int:
        r"""The token whose last-layer output the head reads."""
        return self.head.position

    def params(self, dtype: torch.dtype, device: Optional[torch.device] = None) -> HeadParams:
        r"""The head's parameters as right-multiplied matrices in ``dtype`` (on ``device`` if given)."""
        return head_params(self.model, self.head, dtype, device)

    def resolve(self, target: Any, logits: Tensor) -> Tensor:
        r"""The explained class of every example.

        Args:
            target: None (the predicted class, argmax of ``logits``), an int, a list of ints
                (one per example) or a 0-d / (1,) / (B,) integer tensor.
            logits: (B, C) the model's real logits.

        Returns:
            (B,) long class indices on ``logits``' device.

        Raises:
            TypeError / ValueError: for a target of the wrong type, shape or range.
        """
        b, c = logits.shape
        if target is None:
            return logits.argmax(-1)
        if isinstance(target, int) and not isinstance(target, bool):
            t = torch.full((b,), target, dtype=torch.long, device=logits.device)
        elif isinstance(target, Tensor):
            if target.is_floating_point() or target.dtype == torch.bool:
                raise TypeError(f"target must be an integer class index; got a {target.dtype} tensor")
            if target.dim() == 0 or tuple(target.shape) == (1,):
                t = target.reshape(1).expand(b).to(logits.device, torch.long)
            elif tuple(target.shape) == (b,):
                t = target.to(logits.device, torch.long)
            else:
                raise ValueError(
                    f"target tensor must have shape ({b},) (one class per example); got {tuple(target.shape)}"
                )
        elif isinstance(target, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in target):
            if len(target) != b:
                raise ValueError(f"target list must have one class per example ({b}); got {len(target)}")
            t = torch.tensor(list(target), dtype=torch.long, device=logits.device)
        else:
            raise TypeError(
                "target must be None (predicted class), an int, a list of ints or a (B,) long tensor of class indices; "
                f"got {type(target).__name__}"
            )
        if bool(((t < 0) | (t >= c)).any()):
            raise ValueError(f"target class(es) {t.tolist()} out of range: the model has {c} classes (0..{c - 1})")
        return t


class ImageClassLogit(ClassLogit):
    r"""The class logits of a Vision Transformer classifier: a linear head on final-norm outputs.

    ViT/DeiT: the [CLS] row; the distilled DeiT: the mean of its [CLS] and distillation
    heads (both rows are explained together); DINOv2: [CLS] concatenated with the mean of
    the patch rows (:data:`~captum_normattr.models.heads.VISION_HEADS`). The head, not an
    explained position, defines what is explained.

    Args:
        model: a supported vision classifier.

    Raises:
        UnsupportedModelError: for a model without a supported head.
    """

    def __init__(self, model: nn.Module) -> None:
        from captum_normattr.models.heads import VISION_HEADS, vision_head

        model = unwrap_model(model)
        self.model = model
        self.head = None
        self._build = vision_head
        name = type(model).__name__
        if name not in VISION_HEADS:
            vision_head(model, 1, 1, torch.float32)  # raises the error naming the supported heads

    @property
    def position(self) -> int:
        return 0

    def linear_head(self, num_tokens: int, num_prefix: int, dtype: torch.dtype, device: Optional[torch.device] = None):
        r"""The :class:`~captum_normattr.models.heads.LinearTokenHead` for inputs of ``num_tokens`` tokens (on ``device``)."""
        return self._build(self.model, num_tokens, num_prefix, dtype, device)


def check_logit_model(adapter: ArchitectureAdapter, method: str) -> None:
    r"""Raise a ValueError unless the model is a pre-LN decoder with a final norm."""
    if not adapter.pre_ln or adapter.final_norm is None:
        raise ValueError(
            f"{method} explains next-token logits of pre-LN decoders (GPT-2, Llama, Mistral, Qwen2) through their "
            f"final norm; {adapter.family} is not one"
        )


__all__ = ["ClassLogit", "ImageClassLogit", "NextTokenLogit", "LogitDirection", "as_token_ids", "check_logit_model"]

