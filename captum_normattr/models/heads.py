r"""Declarative adapters for sequence-classification heads (DecompX propagates parts through them).

Every supported head reads the last layer's output at one position (token 0), applies a
dense layer, an elementwise activation and an output projection:

    logits = act(h_0 W_d + b_d) W_c + b_c

(dropout is the identity in eval mode). Paths are dotted attribute paths from the model
with the head (``*ForSequenceClassification``). Adding a family is one
:class:`HeadAdapter` entry in :data:`HEAD_ADAPTERS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.models.adapters import UnsupportedModelError, get_path, linear_params


@dataclass(frozen=True)
class HeadAdapter:
    r"""Where one family's classification head keeps its pieces.

    Attributes:
        family: readable family name.
        model_types: the ``config.model_type`` values it serves.
        model_class_suffix: the class-name suffix of the models with this head.
        position: the token whose last-layer output the head reads.
        dense: path of the first dense layer (BERT: the pooler's), from the model.
        classifier: path of the output projection, from the model.
        activation: path of the activation module, from the model, or None when the
            head applies a fixed function (see ``activation_fn``).
        activation_fn: the fixed elementwise activation when ``activation`` is None.
    """

    family: str
    model_types: Tuple[str, ...]
    dense: str
    classifier: str
    activation: Optional[str] = None
    activation_fn: Optional[Callable[[Tensor], Tensor]] = None
    model_class_suffix: str = "ForSequenceClassification"
    position: int = 0


HEAD_ADAPTERS: Dict[str, HeadAdapter] = {
    "bert": HeadAdapter(
        family="BERT", model_types=("bert",),
        dense="base_model.pooler.dense", activation="base_model.pooler.activation", classifier="classifier",
    ),
    "roberta": HeadAdapter(
        family="RoBERTa", model_types=("roberta", "xlm-roberta", "camembert"),
        dense="classifier.dense", activation_fn=torch.tanh, classifier="classifier.out_proj",
    ),
    "electra": HeadAdapter(
        family="ELECTRA", model_types=("electra",),
        dense="classifier.dense", activation="classifier.activation", classifier="classifier.out_proj",
    ),
    "distilbert": HeadAdapter(
        family="DistilBERT", model_types=("distilbert",),
        dense="pre_classifier", activation_fn=torch.relu, classifier="classifier",
    ),
}


def supported_heads() -> str:
    r"""Readable list of the supported classification heads."""
    return ", ".join(
        f"{a.family} (*{a.model_class_suffix}, model_type {'/'.join(a.model_types)})" for a in HEAD_ADAPTERS.values()
    )


@dataclass
class HeadParams:
    r"""Parameters of one classification head in the compute dtype.

    Attributes:
        w_dense: (D, D2) right-multiplied dense weight; b_dense: (D2,) or None.
        act: the elementwise activation.
        w_cls: (D2, C) right-multiplied output weight; b_cls: (C,) or None.
        position: the token the head reads.
    """

    w_dense: Tensor
    b_dense: Optional[Tensor]
    act: Callable[[Tensor], Tensor]
    w_cls: Tensor
    b_cls: Optional[Tensor]
    position: int = 0


def get_head_adapter(model: nn.Module) -> HeadAdapter:
    r"""The head adapter of a Hugging Face sequence classifier.

    Args:
        model: e.g. ``BertForSequenceClassification``.

    Returns:
        The matching :class:`HeadAdapter`.

    Raises:
        UnsupportedModelError: for a model without a supported classification head,
            naming the supported ones.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = type(model).__name__
    for head in HEAD_ADAPTERS.values():
        if model_type in head.model_types and name.endswith(head.model_class_suffix):
            try:
                for path in (head.dense, head.classifier) + ((head.activation,) if head.activation else ()):
                    get_path(model, path)
            except (AttributeError, IndexError) as err:
                raise UnsupportedModelError(f"{name} does not have the expected {head.family} head ({err})") from err
            return head
    raise UnsupportedModelError(
        f"{name} (model type {model_type!r}) has no supported classification head. "
        f"Supported heads: {supported_heads()}."
    )


def head_params(
    model: nn.Module, head: HeadAdapter, dtype: torch.dtype, device: Optional[torch.device] = None
) -> HeadParams:
    r"""Read a head's parameters as right-multiplied matrices in ``dtype``.

    Args:
        model: the sequence classifier.
        head: its :class:`HeadAdapter`.
        dtype: compute dtype.
        device: where to put them (None: where they are; the CPU copy for a head offloaded
            by accelerate, whose weights are read from its hook).

    Returns:
        :class:`HeadParams`.
    """
    cast = lambda t: None if t is None else t.detach().to(device=device, dtype=dtype)
    w_d, b_d = linear_params(get_path(model, head.dense))
    w_c, b_c = linear_params(get_path(model, head.classifier))
    act = get_path(model, head.activation) if head.activation else head.activation_fn
    return HeadParams(cast(w_d), cast(b_d), act, cast(w_c), cast(b_c), head.position)
