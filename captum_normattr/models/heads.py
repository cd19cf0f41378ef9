r"""Sequence-classification and vision heads, read from the model (DecompX propagates parts through them).

Every supported sequence-classification head reads the last layer's output at one position
(token 0), applies a dense layer, an elementwise activation and an output projection:

    logits = act(h_0 W_d + b_d) W_c + b_c

(dropout is the identity in eval mode). Where each head keeps its pieces is data of the
family's architecture description (``Head.classifier``, a
:class:`~captum_normattr.arch.spec.ClassifierHead`: BERT's pooler, the RoBERTa and ELECTRA
classification heads, DistilBERT's ``pre_classifier``, DeBERTa-v2's pooler, whose activation is
named by the config, ModernBERT's head, which reads the final norm's output of token 0 or the
mean over the real tokens and has a norm after its activation:
logits = N(act(h W_d + b_d)) W_c + b_c); :func:`find_classifier_head` resolves it for one
model and :func:`head_params` reads its weights. Adding a family's head is one
``ClassifierHead`` in its description. Vision classifiers likewise: their heads are linear in
the final-norm output of some tokens, described per classifier class in the family's
``Head.image_classifiers`` (:class:`~captum_normattr.arch.spec.ImageClassifierHead`) and
read by :func:`vision_head`. No family or class name is kept here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.arch.registry import ARCHITECTURES, lookup
from captum_normattr.arch.spec import ClassifierHead, ImageClassifierHead, Norm
from captum_normattr.decompose.records import NormParams
from captum_normattr.models.adapters import UnsupportedModelError, base_model, get_path, linear_params, unwrap_model
from captum_normattr.models.capture.record import norm_params

__all__ = [
    "HeadParams",
    "LinearTokenHead",
    "ResolvedHead",
    "find_classifier_head",
    "find_image_head",
    "head_activation",
    "head_params",
    "image_heads",
    "supported_heads",
    "vision_head",
]


@dataclass(frozen=True)
class ResolvedHead:
    r"""One model's classification head: its family's ``Head.classifier`` resolved against the model's config.

    Attributes:
        family: readable family name.
        description: the family's :class:`~captum_normattr.arch.spec.ClassifierHead` (paths
            from the model with the head; its activation module, fixed function or config name).
        pre_norm: the final norm the head's input passes first (pre-LN encoders), path from
            the base model, or None.
        pooling: ``"first"`` (the head reads token ``position``) or ``"mean"`` (the mean of
            the real tokens' (final-norm) outputs, ModernBERT's ``classifier_pooling="mean"``).
    """

    family: str
    description: ClassifierHead
    pre_norm: Optional[Norm] = None
    pooling: str = "first"

    @property
    def position(self) -> int:
        r"""The token whose last-layer output the head reads."""
        return self.description.position


def supported_heads() -> str:
    r"""Readable list of the supported classification heads (the registry's families that describe one)."""
    return ", ".join(
        f"{s.family} (*ForSequenceClassification, model_type {'/'.join(s.model_types)})"
        for s in ARCHITECTURES.values() if s.head.classifier is not None
    )


@dataclass
class HeadParams:
    r"""Parameters of one classification head in the compute dtype.

    Attributes:
        w_dense: (D, D2) right-multiplied dense weight; b_dense: (D2,) or None.
        act: the elementwise activation.
        w_cls: (D2, C) right-multiplied output weight; b_cls: (C,) or None.
        position: the token the head reads.
        norm: the norm after the activation, or None:
            logits = N(act(h W_d + b_d)) W_c + b_c.
        pre_norm: the final norm before the head (pre-LN encoders), or None: then h is
            that norm's output of the last layer's output.
        pooling: ``"first"`` (h is token ``position``'s) or ``"mean"`` (h is the mean over the
            real tokens).
    """

    w_dense: Tensor
    b_dense: Optional[Tensor]
    act: Callable[[Tensor], Tensor]
    w_cls: Tensor
    b_cls: Optional[Tensor]
    position: int = 0
    norm: Optional[NormParams] = None
    pre_norm: Optional[NormParams] = None
    pooling: str = "first"


def find_classifier_head(model: nn.Module) -> ResolvedHead:
    r"""The classification head of a Hugging Face sequence classifier, from its family's description.

    Args:
        model: e.g. ``BertForSequenceClassification``.

    Returns:
        The :class:`ResolvedHead` of its family's ``Head.classifier``.

    Raises:
        UnsupportedModelError: for a model without a supported classification head (naming
            the supported ones), a head that pools the tokens in a way the decompositions do
            not follow (a ``pooling_config`` value other than ``"cls"`` and ``"mean"``), or a
            model that lacks one of the head's modules.
    """
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__
    spec = lookup(model_type, config)
    desc = None if spec is None else spec.head.classifier
    if desc is None or not name.endswith("ForSequenceClassification"):
        raise UnsupportedModelError(
            f"{name} (model type {model_type!r}) has no supported classification head. "
            f"Supported heads: {supported_heads()}."
        )
    pooling = "first"
    if desc.pooling_config is not None:
        value = getattr(config, desc.pooling_config, None)
        pooling = {"cls": "first", "mean": "mean"}.get(value)
        if pooling is None:
            raise UnsupportedModelError(
                f"{name} pools its tokens with {desc.pooling_config}={value!r}, which the decompositions do not follow "
                f"(supported: 'cls', the head reads token {desc.position}, and 'mean', the mean over the real tokens); "
                "the maps (GlobEnc, ALTI, FF) do not depend on the head"
            )
    head = ResolvedHead(family=spec.family, description=desc, pre_norm=spec.head.final_norm, pooling=pooling)
    try:
        for path in (desc.dense, desc.classifier) + tuple(p for p in (desc.activation, desc.norm and desc.norm.path) if p):
            get_path(model, path)
        if head.pre_norm is not None:
            get_path(base_model(model), head.pre_norm.path)
    except (AttributeError, IndexError) as err:
        raise UnsupportedModelError(f"{name} does not have the expected {head.family} head ({err})") from err
    return head


def head_activation(model: nn.Module, head: ResolvedHead) -> Callable[[Tensor], Tensor]:
    r"""The elementwise activation of a head.

    Args:
        model: the sequence classifier (unwrapped).
        head: its :class:`ResolvedHead`.

    Returns:
        The activation module, the fixed ``torch`` function, or ``ACT2FN`` of the config's name.
    """
    desc = head.description
    if desc.activation:
        return get_path(model, desc.activation)
    if desc.activation_fn is not None:
        return getattr(torch, desc.activation_fn)
    from transformers.activations import ACT2FN

    return ACT2FN[getattr(model.config, desc.activation_config)]


def head_params(
    model: nn.Module, head: ResolvedHead, dtype: torch.dtype, device: Optional[torch.device] = None
) -> HeadParams:
    r"""Read a head's parameters as right-multiplied matrices in ``dtype``.

    Args:
        model: the sequence classifier.
        head: its :class:`ResolvedHead`.
        dtype: compute dtype.
        device: where to put them (None: where they are; the CPU copy for a head offloaded
            by accelerate, whose weights are read from its hook).

    Returns:
        :class:`HeadParams`.
    """
    model = unwrap_model(model)
    cast = lambda t: None if t is None else t.detach().to(device=device, dtype=dtype)
    desc = head.description
    w_d, b_d = linear_params(get_path(model, desc.dense))
    w_c, b_c = linear_params(get_path(model, desc.classifier))
    act = head_activation(model, head)
    norm = None if desc.norm is None else norm_params(get_path(model, desc.norm.path), desc.norm, dtype, device)
    pre = None if head.pre_norm is None else norm_params(
        get_path(base_model(model), head.pre_norm.path), head.pre_norm, dtype, device)
    return HeadParams(cast(w_d), cast(b_d), act, cast(w_c), cast(b_c), head.position, norm, pre, head.pooling)


# --------------------------------------------------------------------------------------
# Vision Transformer classifiers: linear heads on the final-norm output of some tokens
# --------------------------------------------------------------------------------------
@dataclass
class LinearTokenHead:
    r"""A classifier that is linear in the final-norm output y of a set of tokens (rows).

    logits = sum_r y_{rows[r]} @ weight[r] + bias, so that every class logit is a sum of
    per-row dot products (docs/design.md, section 8, "Vision Transformer heads").

    Attributes:
        rows: (R,) long, sorted: the tokens the head reads.
        weight: (R, D, C) right-multiplied weight of every row.
        bias: (C,) or None.
        description: what the head computes, in words.
    """

    rows: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    description: str


def image_heads() -> Tuple[ImageClassifierHead, ...]:
    r"""The image-classification heads the registry's vision families describe (``Head.image_classifiers``), in order."""
    return tuple(h for s in ARCHITECTURES.values() for h in s.head.image_classifiers)


def find_image_head(model: nn.Module) -> ImageClassifierHead:
    r"""The image-classification head of a vision classifier, from its family's description.

    Args:
        model: e.g. ``ViTForImageClassification``.

    Returns:
        The :class:`~captum_normattr.arch.spec.ImageClassifierHead` of the model's class.

    Raises:
        UnsupportedModelError: for other models (a bare ``ViTModel`` has no classes), naming
            the supported heads.
    """
    model = unwrap_model(model)
    name = type(model).__name__
    config = getattr(model, "config", None)
    spec = lookup(getattr(config, "model_type", None), config)
    for head in () if spec is None else spec.head.image_classifiers:
        if head.model_class == name:
            return head
    raise UnsupportedModelError(
        f"{name} has no supported image-classification head. Supported: "
        f"{', '.join(h.model_class for h in image_heads())} "
        "(a bare ViTModel/DeiTModel/Dinov2Model has no classes to explain)."
    )


def vision_head(
    model: nn.Module, num_tokens: int, num_prefix: int, dtype: torch.dtype, device: Optional[torch.device] = None
) -> LinearTokenHead:
    r"""The linear head of a supported vision classifier, as rows and per-row weights.

    Args:
        model: a classifier whose family describes its head (:func:`find_image_head`):
            ``ViTForImageClassification``, ``DeiTForImageClassification``,
            ``DeiTForImageClassificationWithTeacher``, ``Dinov2ForImageClassification`` or
            ``Dinov2WithRegistersForImageClassification``.
        num_tokens: T, the tokens of this input ([CLS], distillation/register tokens, patches).
        num_prefix: the tokens before the first patch.
        dtype: compute dtype.
        device: where to put the head (the inputs' device); None: where the classifier's
            weight is read from (its own device, or the CPU copy an accelerate hook keeps).

    Returns:
        :class:`LinearTokenHead` on ``device``.

    Raises:
        UnsupportedModelError: for other models (a bare ``ViTModel`` has no classes) or a
            head without classes (``num_labels=0``).
    """
    model = unwrap_model(model)
    name = type(model).__name__
    desc = find_image_head(model)

    def linear(path: str):
        module = get_path(model, path)
        if not isinstance(module, nn.Linear):
            raise UnsupportedModelError(f"{name}.{path} is {type(module).__name__}, not a linear classifier (num_labels=0?)")
        w, b = linear_params(module)  # accelerate-safe: never 'meta' (models/weights.py)
        nonlocal device
        if device is None:
            device = w.device
        cast = lambda t: None if t is None else t.detach().to(device=device, dtype=dtype)
        return cast(w), cast(b)

    if desc.readout == "mean_of_heads":
        (w_c, b_c), (w_d, b_d) = (linear(path) for path in desc.classifiers)
        weight = torch.stack([w_c, w_d]) / 2
        bias = None if b_c is None and b_d is None else (
            (b_c if b_c is not None else 0) + (b_d if b_d is not None else 0)
        ) / 2
        rows = torch.tensor([0, 1], device=device)
    elif desc.readout == "cls_and_patch_mean":
        w, bias = linear(desc.classifiers[0])
        d = w.shape[0] // 2
        n_patches = num_tokens - num_prefix
        rows = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(num_prefix, num_tokens)]).to(device)
        weight = torch.cat([w[:d].unsqueeze(0), (w[d:] / n_patches).unsqueeze(0).expand(n_patches, -1, -1)])
    else:
        w, bias = linear(desc.classifiers[0])
        rows, weight = torch.tensor([0], device=device), w.unsqueeze(0)
    return LinearTokenHead(rows, weight, bias, desc.description)
