r"""A thin view of a Hugging Face sequence classifier for the metrics and the harness.

It knows only what the evaluation needs: logits from token ids or from word embeddings,
the word-embedding table, the embedding block (whose output, after the embedding
LayerNorm, is where GlobEnc's gradient x input is taken), and which ids are special.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor, nn

from captum_normattr.models.capture.session import eval_mode as model_eval_mode

__all__ = ["SequenceClassifier", "logits_of"]


def logits_of(output) -> Tensor:
    r"""The logits of a model output: ``.logits``, the first item of a tuple, or the tensor."""
    if isinstance(output, Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in a model output of type {type(output).__name__}")


class SequenceClassifier:
    r"""Wrap a sequence classifier (e.g. ``BertForSequenceClassification``) for evaluation.

    The model is never modified: every forward pass of this wrapper runs in eval mode
    (dropout off), and afterwards every submodule gets back its own training flag
    (reference-counted with the attribution classes, see
    :func:`captum_normattr.models.capture.session.recording`).

    Args:
        model: an ``nn.Module`` whose ``forward(input_ids=..., attention_mask=...)`` and
            ``forward(inputs_embeds=..., attention_mask=...)`` return logits (B, C) or an
            output with ``.logits``, and that has ``get_input_embeddings()``.
        tokenizer: optional; supplies the special, [MASK] and pad ids not given explicitly.
        special_token_ids: ids never ranked, deleted or masked ([CLS], [SEP], <s>, </s>,
            pad). Default: the tokenizer's cls/sep/bos/eos/pad ids ([UNK] and [MASK]
            count as ordinary tokens).
        mask_token_id: the [MASK] id (DecompX masking; absent-token embedding).
        pad_token_id: id used to re-pad shortened sequences; default the tokenizer's or
            ``model.config.pad_token_id`` or 0.

    Examples:
        >>> clf = SequenceClassifier(model, tokenizer)  # doctest: +SKIP
        >>> clf.logits(batch["input_ids"], batch["attention_mask"]).shape  # doctest: +SKIP
        torch.Size([8, 2])
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        *,
        special_token_ids: Optional[Iterable[int]] = None,
        mask_token_id: Optional[int] = None,
        pad_token_id: Optional[int] = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not hasattr(model, "get_input_embeddings") or not isinstance(model.get_input_embeddings(), nn.Module):
            raise TypeError("model must expose its word embeddings through get_input_embeddings()")
        self.model = model
        config = getattr(model, "config", None)
        if special_token_ids is None:
            ids = set()
            if tokenizer is not None:
                for name in ("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
                    v = getattr(tokenizer, name, None)
                    if v is not None:
                        ids.add(int(v))
            elif config is not None:
                for name in ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id"):
                    v = getattr(config, name, None)
                    if isinstance(v, int):
                        ids.add(v)
            special_token_ids = ids
        self.special_token_ids = sorted(int(i) for i in special_token_ids)
        if mask_token_id is None and tokenizer is not None:
            mask_token_id = getattr(tokenizer, "mask_token_id", None)
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad_token_id is None and config is not None:
            pad_token_id = getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0

    # ------------------------------------------------------------------ forwards
    @property
    def device(self) -> torch.device:
        return self.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.word_embeddings.weight.dtype

    @property
    def word_embeddings(self) -> nn.Module:
        r"""The word-embedding table (``model.get_input_embeddings()``)."""
        return self.model.get_input_embeddings()

    @property
    def embedding_layer(self) -> nn.Module:
        r"""The embedding block whose output (after its LayerNorm) enters the first layer.

        ``model.base_model.embeddings`` for Hugging Face encoders; falls back to the word
        embeddings when the model has no such block.
        """
        base = getattr(self.model, "base_model", self.model)
        emb = getattr(base, "embeddings", None)
        return emb if isinstance(emb, nn.Module) else self.word_embeddings

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        r"""Run the block with the model in eval mode; restore every submodule's flag afterwards."""
        with model_eval_mode(self.model):
            yield

    def logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        r"""Logits (B, C) of token ids (B, T) with their attention mask (eval mode)."""
        with self.eval_mode():
            return logits_of(self.model(input_ids=input_ids, attention_mask=attention_mask))

    def logits_from_embeds(self, inputs_embeds: Tensor, attention_mask: Tensor) -> Tensor:
        r"""Logits (B, C) from word embeddings (B, T, D) (position/type embeddings added by the model; eval mode)."""
        with self.eval_mode():
            return logits_of(self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask))

    def embed(self, input_ids: Tensor) -> Tensor:
        r"""Word embeddings (B, T, D) of token ids."""
        return self.word_embeddings(input_ids)

    def special_mask(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        r"""(B, T) bool: True at special tokens and at pads."""
        special = torch.zeros_like(input_ids, dtype=torch.bool)
        for i in self.special_token_ids:
            special |= input_ids == i
        return special | ~attention_mask.bool()

    def require_mask_token(self) -> int:
        if self.mask_token_id is None:
            raise ValueError("this metric needs a [MASK] id: pass a tokenizer or mask_token_id to SequenceClassifier")
        return self.mask_token_id
