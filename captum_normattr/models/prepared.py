r"""What a validated call hands to the forward pass: :class:`PreparedInputs`, and Captum's one-input rule.

Shared by the token inputs (:mod:`captum_normattr.attr.inputs`) and the pixel inputs
(:mod:`captum_normattr.attr.images`), which both build on it; neither imports the other's checks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from torch import Tensor

__all__ = ["PreparedInputs", "single_input"]


@dataclass
class PreparedInputs:
    r"""Validated model inputs of one call."""

    input_ids: Optional[Tensor]
    inputs_embeds: Optional[Tensor]
    attention_mask: Tensor  # (B, T) long
    token_type_ids: Optional[Tensor]
    is_tuple: bool
    causal: bool = False
    #: pass ``use_cache=False`` (the model's forward takes it): no key/value cache is built, so a
    #: recorded layer call can be run again (e.g. BERT with ``is_decoder=True``)
    no_cache: bool = False
    #: (B,) bool: False for an example whose input or recorded forward tensors hold a
    #: non-finite value at a real token (updated layer by layer by ``streamed_forward``)
    finite: Optional[Tensor] = None
    #: (B, T) long position ids the caller gave by keyword (``additional_forward_args={"position_ids": ...}``),
    #: passed to the model as they are; None: the default (:attr:`position_ids`)
    given_position_ids: Optional[Tensor] = None
    #: further model inputs given by keyword and passed to the forward unchanged (a vision-language
    #: model's ``pixel_values``: docs/vlm.md)
    extra_inputs: Dict[str, Tensor] = field(default_factory=dict)
    #: the model computes its own positions (a vision-language model's M-RoPE): none are passed unless given
    model_positions: bool = False
    #: the decoder's attention is two-way over part of this call's sequence (a vision-language model's
    #: ``token_type_ids``: Gemma 3's image spans, PaliGemma's prefix; docs/vlm.md, "Two-way spans"): its layers
    #: are recorded as not causal (full maps, no triangular shortcuts); positions and cache stay a decoder's
    two_way: bool = False

    @property
    def valid(self) -> Tensor:
        return self.attention_mask.bool()

    @property
    def shape(self) -> Tuple[int, int]:
        x = self.input_ids if self.input_ids is not None else self.inputs_embeds
        return int(x.shape[0]), int(x.shape[1])

    def forward_kwargs(self) -> dict:
        kw = {"attention_mask": self.attention_mask}
        if self.input_ids is not None:
            kw["input_ids"] = self.input_ids
        else:
            kw["inputs_embeds"] = self.inputs_embeds
        if self.token_type_ids is not None:
            kw["token_type_ids"] = self.token_type_ids
        if (self.causal and not self.model_positions) or self.given_position_ids is not None:
            kw["position_ids"] = self.position_ids
        if self.causal or self.no_cache:
            kw["use_cache"] = False
        kw.update(self.extra_inputs)
        return kw

    @property
    def position_ids(self) -> Tensor:
        r"""Decoder positions counted over real tokens only (cumsum of the mask - 1; pads get 0).

        A left-padded example thereby gets the positions it has alone (GPT-2's absolute
        positions and the rotary positions of the Llama family alike). Position ids given by
        keyword (:attr:`given_position_ids`) replace them.
        """
        if self.given_position_ids is not None:
            return self.given_position_ids
        return (self.attention_mask.cumsum(-1) - 1).clamp_min(0)


def single_input(inputs: Any, what: str, shape: str) -> Tuple[Tensor, bool]:
    r"""The one input tensor of a Captum call, given as a tensor or a 1-tuple.

    Args:
        inputs: what the caller passed.
        what: what the tensor holds, for the messages (``"token ids"``, ``"pixel values"``).
        shape: its expected shape, for the messages (``"(B, T)"``).

    Returns:
        (the tensor, True if it came in a tuple: Captum returns a tuple then).

    Raises:
        ValueError: a tuple of more than one element. TypeError: not a tensor.
    """
    is_tuple = isinstance(inputs, tuple)
    if is_tuple:
        if len(inputs) != 1:
            raise ValueError(f"inputs must be one tensor of {what} (or a 1-tuple); got a tuple of {len(inputs)}")
        inputs = inputs[0]
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a torch.Tensor of {what} {shape}; got {type(inputs).__name__}")
    return inputs, is_tuple
