r"""The capture of Qwen3-VL's DeepStack additions (docs/vlm.md, "Qwen3-VL (DeepStack)").

Qwen3-VL's text model takes ``visual_pos_masks`` (B, T) and ``deepstack_visual_embeds`` (a list of n tensors of
shape (number of visual tokens, D), the tower's merged features of intermediate blocks) and, after decoder layer
l < n, adds the l-th of them to the stream at the visual positions (``_deepstack_process``)::

    x_{l+1, t} = y_{l, t} + D_{l, t},   D_{l, t} = deepstack_visual_embeds[l][k(t)] at a visual position t, else 0

(k(t) the rank of t among the visual positions, row by row). D_{l, t} is a function of token t's image features
alone, like its embedding: it is token t's own input.

:class:`DeepStackCapture` reads both inputs from the text model's call (a forward pre-hook with keywords) and, as
each layer's output is recorded, puts the addition into the layer's record: ``own_after`` (B, T, D) the vectors
D_l, and ``layer_out`` the stream after the addition (the layer's output plus D_l, computed as the model computes
it, so that it is the next layer's real input). The layer kind then gives D_{l, t} to token t's own part
(:attr:`~captum_normattr.decompose.records.LayerTensors.own_after`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

__all__ = ["DeepStackCapture", "refuse_stream_additions", "stream_additions"]


def stream_additions(model: nn.Module) -> Optional[str]:
    r"""What the model's language model adds to the stream between its layers (``"deepstack"``), or None.

    Read from its vision-language description (:attr:`~captum_normattr.arch.families.vlm.VisionLanguage.stream_additions`).
    """
    from captum_normattr.models.adapters import vision_language

    description = vision_language(model)
    return None if description is None else description.stream_additions


def refuse_stream_additions(model: nn.Module, what: str, instead: str) -> None:
    r"""Raise :class:`~captum_normattr.arch.spec.UnsupportedModelError` for a model with stream additions.

    Args:
        model: the model.
        what: the refused computation (``"DecompX's adjoint"``).
        instead: what runs instead.
    """
    from captum_normattr.arch.spec import UnsupportedModelError
    from captum_normattr.models.adapters import vision_language

    description = vision_language(model)
    if description is None or description.stream_additions is None:
        return
    raise UnsupportedModelError(
        f"{description.family}'s language model adds token-own vectors to the stream between its layers "
        f"({description.stream_additions}: after decoder layer l, a feature of each image token is added to that "
        f"token's stream); {what} do not take them yet. {instead} (docs/vlm.md, \"Qwen3-VL (DeepStack)\")")


class DeepStackCapture:
    r"""Records the DeepStack additions of one recorder's forward passes.

    Args:
        recorder: the :class:`~captum_normattr.models.capture.recorder.Recorder` (its ``_mine`` and ``_keep``).
        text_model: the language model module whose ``forward`` takes ``visual_pos_masks`` and
            ``deepstack_visual_embeds`` (``Qwen3VLTextModel``, ``Qwen3VLMoeTextModel``).

    Raises:
        ValueError: the text model's forward takes no such inputs (the description does not match the model).
        UnsupportedModelError: the decoder's layers are not of the pre-LN kind (the one that takes the additions).
    """

    def __init__(self, recorder: Any, text_model: nn.Module) -> None:
        import inspect

        params = inspect.signature(text_model.forward).parameters
        missing = [p for p in ("visual_pos_masks", "deepstack_visual_embeds") if p not in params]
        if missing:
            raise ValueError(f"{type(text_model).__name__}.forward takes no {missing}: the DeepStack description "
                             "(Qwen3-VL's text model) does not match the model")
        kind = getattr(recorder.kind, "name", None)
        if kind != "pre_ln":  # the kind that gives the additions to the own parts (decompose.kinds.pre_ln)
            from captum_normattr.arch.spec import UnsupportedModelError

            raise UnsupportedModelError(
                f"{recorder.adapter.family}: its language model adds DeepStack features between its layers, which the "
                f"pre-LN layer kind gives to each token's own part; its layers are of the {kind!r} kind, which does "
                "not take them (docs/vlm.md, \"Qwen3-VL (DeepStack)\")")
        self.recorder = recorder
        self.text_model = text_model
        self.mask: Optional[Tensor] = None
        self.embeds: List[Tensor] = []

    def hooks(self) -> list:
        r"""Register the pre-hook on the text model that reads the pass's additions; returns its handle."""

        def keep(module, args, kwargs=None):
            if not self.recorder._mine() or kwargs is None:
                return
            embeds = kwargs.get("deepstack_visual_embeds")
            mask = kwargs.get("visual_pos_masks")
            self.mask, self.embeds = (None, []) if embeds is None or mask is None else (mask, list(embeds))

        return [self.text_model.register_forward_pre_hook(keep, with_kwargs=True)]

    def fold(self, idx: int, records: Dict[int, Dict[str, Tensor]]) -> None:
        r"""Add layer ``idx``'s DeepStack vectors to its recorded output, and record them as ``own_after``.

        Called right after the layer's output was recorded (``records[idx]["layer_out"]``); a layer without an
        addition (l >= n, or a pass without images) is left as it is.
        """
        if self.mask is None or idx >= len(self.embeds):
            return
        out = records[idx]["layer_out"]
        mask = self.mask.to(out.device)
        if mask.shape != out.shape[:2]:
            raise ValueError(f"layer {idx}: visual_pos_masks has shape {tuple(mask.shape)}, the stream "
                             f"{tuple(out.shape)}: the DeepStack addition cannot be placed")
        add = self.embeds[idx].to(out.device, out.dtype)
        after = out.clone()
        after[mask, :] = out[mask, :] + add  # as the model's _deepstack_process computes it
        own = torch.zeros_like(out)
        own[mask, :] = add
        self.recorder._keep(idx, "layer_out", after)
        self.recorder._keep(idx, "own_after", own)
