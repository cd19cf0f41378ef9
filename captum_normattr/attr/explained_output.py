r"""The "explained output" of the signed methods (ALTI-Logit, DecompX): which logit, along which direction.

Two kinds, each parsing ``target`` once for every method that explains it:

- :class:`NextTokenLogit`: the next-token logit of a decoder at the explained position,
  ``<FinalNorm(x_L,i), u> + u_bias`` with u = W_U[target] (or W_U[target] - W_U[foil]) from
  the LM head (or an explicit unembedding matrix). ``target``: a token id, per-example ids,
  or None for the token the model predicts; the contrast is the separate ``foil`` (same forms).
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


#: what a tuple target meant before version 3 for the logit classes, and what to write now
CONTRAST_MOVED = (
    "target={target!r}: a tuple target no longer means (target, foil). Pass the contrast explicitly: "
    "target=<token id(s)>, foil=<token id(s)> (e.g. attribute(ids, target=7, foil=11); per example: lists or (B,) "
    "tensors). In Captum a tuple target indexes the output's dimensions for every example, which this method does not "
    "take; a list or a (B,) tensor gives one id per example."
)


def _plain_int(x: Any) -> Optional[int]:
    r"""``x`` as an int if it is a Python or numpy integer (never a bool), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return None
    if isinstance(x, np.integer):
        return int(x)
    return None


def as_token_ids(x: Any, b: int, name: str, device) -> Tensor:
    r"""(B,) long ids (or class indices) from one id for every example or one id per example.

    Accepted: a Python or numpy integer, a 0-d or (1,) integer tensor / numpy array (the same
    id for every example), a list of B integers, a (B,) integer tensor or numpy array.

    Raises:
        TypeError: floats, bools, tuples and other types (the message says what to pass).
        ValueError: a list or tensor whose length is not B.
    """
    v = _plain_int(x)
    if v is not None:
        return torch.full((b,), v, dtype=torch.long, device=device)
    if isinstance(x, tuple):
        raise TypeError(CONTRAST_MOVED.format(target=x) if name == "target" else
                        f"{name} must be an id, a list of ids or a (B,) tensor, not a tuple ({x!r})")
    if type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "shape"):
        if x.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer ids; got a numpy array of dtype {x.dtype}")
        x = torch.as_tensor(x)
    if isinstance(x, list):
        vals = [_plain_int(v) for v in x]
        if any(v is None for v in vals):
            raise TypeError(f"{name} list must hold integers (one per example); got {x!r}")
        if len(vals) != b:
            raise ValueError(f"{name} list must have one id per example ({b}); got {len(vals)}")
        x = torch.tensor(vals, dtype=torch.long)
    if isinstance(x, Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer ids; got a {x.dtype} tensor")
        if x.dim() == 0 or tuple(x.shape) == (1,):
            return x.reshape(1).expand(b).to(device=device, dtype=torch.long)
        if tuple(x.shape) == (b,):
            return x.to(device=device, dtype=torch.long)
        hint = " (a (B, 2) tensor of (target, foil) rows is now target=t[:, 0], foil=t[:, 1])" if (
            x.dim() == 2 and x.shape[-1] == 2) else ""
        raise ValueError(f"{name} must be one id or a ({b},) tensor of ids (one per example); got shape "
                         f"{tuple(x.shape)}{hint}")
    raise TypeError(
        f"{name} must be an integer id (int or numpy integer), a list of ints or a ({b},) integer tensor; "
        f"got {type(x).__name__}"
    )


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

    def resolve(self, target: Any, final_out: Tensor, foil: Any = None) -> LogitDirection:
        r"""The explained direction of every example.

        Args:
            target: a token id (int, numpy integer, 0-d tensor), per-example ids (list or
                (B,) tensor / array), or None: the token the model predicts (argmax of its
                real logits). A tuple raises a ValueError pointing to ``foil``.
            final_out: (B, D) the real final-norm output at the explained positions.
            foil: None, or token id(s) of the same forms: the explained quantity is then
                logit(target) - logit(foil).

        Returns:
            :class:`LogitDirection` in ``final_out``'s dtype and device.
        """
        b, device, dtype = final_out.shape[0], final_out.device, final_out.dtype
        if isinstance(target, tuple):
            raise ValueError(CONTRAST_MOVED.format(target=target))
        if target is None:
            target = self.logits(final_out).argmax(-1)
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
            target: None (the predicted class, argmax of ``logits``), an int or numpy
                integer, a 1-tuple ``(c,)`` (Captum's output index), a list of ints (one per
                example) or a 0-d / (1,) / (B,) integer tensor or numpy array.
            logits: (B, C) the model's real logits.

        Returns:
            (B,) long class indices on ``logits``' device.

        Raises:
            TypeError / ValueError: for a target of the wrong type, shape or range.
        """
        b, c = logits.shape
        if target is None:
            return logits.argmax(-1)
        if isinstance(target, tuple):  # Captum: the index of the output's non-batch dimensions, for every example
            if len(target) != 1:
                raise ValueError(
                    f"target={target!r}: in Captum a tuple target indexes the output's dimensions for every example; "
                    f"the logits are (B, C), so it takes one index (target=(c,) or target=c). For one class per example "
                    "pass a list or a (B,) tensor (target=[1, 0])."
                )
            target = target[0]
        t = as_token_ids(target, b, "target", logits.device)
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

