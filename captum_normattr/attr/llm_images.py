r"""Captum's ``ImageMaskInput`` for a vision-language model: image segments scored from one decomposition pass.

Captum's ``LLMAttribution(FeatureAblation)`` scores the segments of an ``ImageMaskInput`` (an
image, a segment mask and a ``processor_fn`` that turns the image into the model's inputs) with
one forward pass per segment, each with that segment painted over. Here the processor runs once,
the language model of the vision-language model is decomposed once for every target token
(:meth:`~captum_normattr.attr.llm.DecompositionLLMAttribution.attribute`, the same pass as a text
prompt), and the image tokens' scores are laid on the tower's patch grid
(:mod:`captum_normattr.attr.vlm_regions`). A segment's score is the sum of the patch scores
weighted by the share of each patch's pixels inside the segment (pixel overlap):

.. math::

    s_{\text{segment}} = \sum_{\text{patch}} s_{\text{patch}}
    \frac{|\text{pixels of the patch in the segment}|}{|\text{pixels of the patch}|}

so segments that partition the image share out exactly the patch scores' sum. Where the
patch grid lies over the original image is the processor's choice (:data:`LAYOUTS`):
``"stretch"`` (the grid covers the whole image: Qwen2-VL's resize), ``"center_crop"`` (the grid
covers the central square: the CLIP processor of LLaVA 1.5, shortest edge resized then the
centre cropped), or an explicit box. See docs/vlm.md.

The result is Captum's own ``LLMAttributionResult`` (its ``inp`` is the ``ImageMaskInput``, so
``plot_image_heatmap``, ``plot_token_attr`` and ``plot_seq_attr`` work unchanged), with the
per-patch scores as a further attribute (``patch_attr``) and the whole decomposition as
``explanation`` (:class:`ImageGenerationExplanation`).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from captum.attr import LLMAttributionResult
from captum.attr._utils.interpretable_input import ImageMaskInput
from torch import Tensor

from captum_normattr.attr.pixel_overlap import pixel_patches, segment_overlap
from captum_normattr.attr.positions import LOG_PROB_NOT_ADDITIVE, QUANTITIES, PositionExplanation
from captum_normattr.attr.vlm_anyres import anyres_image, anyres_scores, pixel_shares
from captum_normattr.attr.vlm_regions import ImageGeometry, grid_scores, image_geometry, image_token_mask
from captum_normattr.attr.vlm_tiles import image_input_tiles
from captum_normattr.models.adapters import vision_language
from captum_normattr.tokens import display_token, readable_tokens

__all__ = [
    "LAYOUTS",
    "ImageGenerationExplanation",
    "attribute_image_input",
    "decompose_image_input",
    "grid_box",
    "image_model_inputs",
    "pixel_patches",
    "segment_overlap",
    "segment_scores",
]

#: Where the patch grid lies over the original image: ``"auto"`` (``"stretch"`` for a merged grid
#: (Qwen2-VL), a shuffled grid (Idefics3 without splitting: the image squared) or per-image sizes, ``"center_crop"`` for a fixed square tower (LLaVA 1.5's CLIP
#: processor)), ``"stretch"`` (the whole image), ``"center_crop"`` (the central min(H, W) square);
#: or a box ``(top, left, height, width)`` in the original image's pixels.
LAYOUTS: Tuple[str, ...] = ("auto", "stretch", "center_crop")

Layout = Union[str, Tuple[float, float, float, float]]


def grid_box(image_hw: Tuple[int, int], layout: Layout = "stretch") -> Tuple[float, float, float, float]:
    r"""The box ``(top, left, height, width)`` of the original image that the patch grid covers.

    Args:
        image_hw: (H, W) of the original image.
        layout: ``"stretch"``, ``"center_crop"`` or a box (see :data:`LAYOUTS`; ``"auto"`` is
            resolved by the caller).

    Returns:
        The box, in pixels (floats).

    Examples::

        >>> grid_box((20, 30), "center_crop")
        (0.0, 5.0, 20.0, 20.0)
    """
    h, w = float(image_hw[0]), float(image_hw[1])
    if isinstance(layout, str):
        if layout == "stretch":
            return (0.0, 0.0, h, w)
        if layout == "center_crop":
            s = min(h, w)
            return ((h - s) / 2, (w - s) / 2, s, s)
        raise ValueError(f"layout must be one of {LAYOUTS} or a box (top, left, height, width); got {layout!r}")
    box = tuple(float(v) for v in layout)
    if len(box) != 4 or box[2] <= 0 or box[3] <= 0:
        raise ValueError(f"a layout box is (top, left, height, width) with positive height and width; got {layout!r}")
    return box  # type: ignore[return-value]


def segment_scores(patch_scores: Tensor, overlap: Tensor) -> Tensor:
    r"""(..., S): every segment's score, the patch scores weighted by the segment's share of each patch.

    Args:
        patch_scores: (..., rows, cols); NaN (a patch without an image token) counts 0.
        overlap: (S, rows x cols) (:func:`segment_overlap`).
    """
    flat = torch.nan_to_num(patch_scores.reshape(*patch_scores.shape[:-2], -1), nan=0.0)
    return flat @ overlap.to(device=flat.device, dtype=flat.dtype).T


def image_model_inputs(inp: ImageMaskInput) -> Dict[str, Any]:
    r"""The processor's outputs of an ``ImageMaskInput`` (``processor_fn(image)``) as a dict holding ``input_ids``.

    Raises:
        TypeError: ``processor_fn`` gave no mapping with ``input_ids`` (the identity default
            gives the image itself).
    """
    got = inp.to_model_input()
    if not isinstance(got, Mapping) or "input_ids" not in got:
        raise TypeError(
            "the ImageMaskInput's processor_fn must return the model's inputs (a mapping with input_ids, pixel_values, "
            "...), e.g. lambda image: processor(images=image, text=prompt, return_tensors='pt'); got "
            f"{type(got).__name__}")
    return dict(got)


def _forward_args(inputs: Dict[str, Any], prompt_length: int, n_target: int, model: Any) -> Dict[str, Any]:
    r"""The model's further inputs for the prompt followed by n target tokens: per-token inputs extended
    (the attention mask with ones, token-type inputs with zeros; ``token_type_ids`` with the type the model's
    own ``generate`` gives new tokens: 1, the causal suffix, for PaliGemma), floats cast to the model's dtype."""
    param = next(model.parameters())
    description = vision_language(model)
    generated_type = 0 if description is None else description.generated_type
    out: Dict[str, Any] = {}
    for key, value in inputs.items():
        if key == "input_ids":
            continue
        if isinstance(value, Tensor):
            if value.dim() == 2 and value.shape == (1, prompt_length):
                fill = 1 if key == "attention_mask" else generated_type if key == "token_type_ids" else 0
                value = torch.cat([value, value.new_full((1, n_target), fill)], 1)
            value = value.to(device=param.device, dtype=param.dtype if value.is_floating_point() else value.dtype)
        out[key] = value
    out.setdefault("attention_mask", torch.ones(1, prompt_length + n_target, dtype=torch.long, device=param.device))
    return out


@dataclass
class ImageGenerationExplanation:
    r"""One decomposition of a prompt with an image and its target tokens, with the image's segments.

    Attributes:
        method: the method's readable name.
        input_ids: (T,) the prompt (P tokens, the image tokens among them) then the n targets.
        prompt_length: P.
        target_ids: (n,) the explained tokens.
        scores: (n, T) every token's score for every target (the method's own, untouched).
        output_tokens: the n targets as readable text.
        patch_attr: (n, rows, cols) the image tokens' scores on the patch grid (NaN: a patch
            without a token, e.g. the first patch that LLaVA's ``"default"`` strategy drops with
            a SigLIP tower); an image cut into tiles (Idefics3 split, Llama 4): the tiles' tokens side
            by side, (n, rows n, cols n), or the global view's without tiles (:mod:`~captum_normattr.attr.vlm_tiles`).
        leading: (n,) the tower's [CLS] feature's score where the image tokens keep it
            (LLaVA, ``"full"``, CLIP), else None; it lies on no pixel and is in no segment.
        segment_attr: (n, S) every segment's score (:func:`segment_scores`).
        overlap: (S, rows x cols) the share of each patch's pixels in each segment (tiles: the tiles'
            tokens, then the global view's; any-resolution tiles: (S, the image's tokens),
            :func:`~captum_normattr.attr.vlm_anyres.anyres_image`).
        box: the original image's box the grid covers (:func:`grid_box`; tiles: the tiles' canvas).
        geometry: the model's :class:`~captum_normattr.attr.vlm_regions.ImageGeometry` (LLaVA-NeXT / OneVision:
            :class:`~captum_normattr.attr.vlm_anyres.AnyresGeometry`, whose ``patch_attr`` is (n, H, W) over the
            original image's pixels: every token's score shared out over the pixels it covers, both views summed).
        details: the :class:`~captum_normattr.attr.positions.PositionExplanation` (explained
            quantity, no-token terms, deltas, log-probabilities).
        inp: the ``ImageMaskInput``.
        image_token_mask: (T,) bool, the image tokens of :attr:`input_ids`.
    """

    method: str
    input_ids: Tensor
    prompt_length: int
    target_ids: Tensor
    scores: Tensor
    output_tokens: List[str]
    patch_attr: Tensor
    leading: Optional[Tensor]
    segment_attr: Tensor
    overlap: Tensor
    box: Tuple[float, float, float, float]
    geometry: ImageGeometry
    details: PositionExplanation
    inp: ImageMaskInput
    image_token_mask: Tensor

    @property
    def image_total(self) -> Tensor:
        r"""(n,) the sum of the image tokens' scores (the [CLS] feature's included)."""
        return self.scores[:, self.image_token_mask.to(self.scores.device)].sum(-1)

    @property
    def text_total(self) -> Tensor:
        r"""(n,) the sum of the other tokens' scores (prompt text, earlier targets)."""
        return self.scores[:, ~self.image_token_mask.to(self.scores.device)].sum(-1)

    def to_captum(self) -> LLMAttributionResult:
        r"""Captum's ``LLMAttributionResult``, as ``LLMAttribution`` builds it for an ``ImageMaskInput``.

        ``token_attr`` (n, segments), ``seq_attr`` its column sums, ``input_tokens`` the
        input's own segment names (``inp.values``), ``inp`` the ``ImageMaskInput`` (so
        ``plot_image_heatmap`` works); further attributes: ``patch_attr`` (n, rows, cols),
        ``raw_output_tokens`` and ``explanation`` (this object).
        """
        attr = self.segment_attr
        full = self.inp.format_attr(torch.cat([attr.sum(0, keepdim=True), attr], 0))
        d = self.details
        res = LLMAttributionResult(
            seq_attr=full[0], token_attr=full[1:], input_tokens=list(self.inp.values),
            output_tokens=[display_token(t) for t in self.output_tokens],
            output_probs=None if d.log_probs is None else d.log_probs.exp(), inp=self.inp,
        )
        res.patch_attr = self.patch_attr
        res.raw_output_tokens = list(getattr(self.output_tokens, "raw", self.output_tokens))
        res.explanation = self
        return res


def _resolve_layout(layout: Layout, geometry: ImageGeometry, model: Any, inputs: Dict[str, Any]) -> Layout:
    if not (isinstance(layout, str) and layout == "auto"):
        return layout
    from captum_normattr.models.adapters import vision_language

    description = vision_language(model)
    per_image = description is not None and description.geometry != "patch_grid" or "image_sizes" in inputs
    return "stretch" if per_image else "center_crop"


def _target_ids(llm: Any, inputs: Dict[str, Any], target: Any, gen_args: Optional[Dict[str, Any]]) -> Tensor:
    if target is not None:
        return llm._target_ids(None, inputs["input_ids"].reshape(-1), target, gen_args)
    model = llm.model
    if not callable(getattr(model, "generate", None)):
        raise ValueError("the model has no generate(): give target (a string or token ids)")
    args = dict(gen_args) if gen_args else {"max_new_tokens": 25, "do_sample": False}  # the LLM API passes its own
    param = next(model.parameters())
    feed = {k: (v.to(device=param.device, dtype=param.dtype if v.is_floating_point() else v.dtype)
                if isinstance(v, Tensor) else v) for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(**feed, **args)
    return out[0, feed["input_ids"].shape[1]:].detach().cpu()


def decompose_image_input(
    llm: Any,
    inp: ImageMaskInput,
    target: Union[str, Tensor, Sequence[int], None] = None,
    gen_args: Optional[Dict[str, Any]] = None,
    quantity: str = "logit",
    foil: Union[str, int, Tensor, None] = None,
    layout: Layout = "auto",
) -> ImageGenerationExplanation:
    r"""Every target token of a prompt with an image explained from one pass, and the image's segments scored.

    Args:
        llm: the :class:`~captum_normattr.attr.llm.DecompositionLLMAttribution` (its method, model
            and tokenizer).
        inp: Captum's ``ImageMaskInput`` whose ``processor_fn`` gives the model's inputs (one image).
        target, gen_args, quantity, foil: as in
            :meth:`~captum_normattr.attr.llm.DecompositionLLMAttribution.decompose`.
        layout: where the patch grid lies over the original image (:data:`LAYOUTS`).

    Returns:
        :class:`ImageGenerationExplanation`.

    Raises:
        TypeError: ``processor_fn`` gives no model inputs.
        ValueError: a text model, several images, no image token, or an unknown quantity.

    Examples::

        >>> inp = ImageMaskInput(image, mask=mask, processor_fn=lambda im: processor(images=im, text=prompt,
        ...                                                                          return_tensors="pt"))
        >>> ex = decompose_image_input(DecompositionLLMAttribution(ALTILogitAttribution(llava), tok), inp, " a cat")
        >>> ex.segment_attr.shape  # (targets, segments)
    """
    if quantity == "log_prob":
        raise ValueError(LOG_PROB_NOT_ADDITIVE)
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {QUANTITIES}; got {quantity!r}")
    if quantity == "logit_minus_foil" and foil is None:
        raise ValueError("quantity='logit_minus_foil' needs foil=")
    model = llm.model
    try:
        geometry = None
        inputs = image_model_inputs(inp)
        geometry = image_geometry(model, inputs.get("image_sizes"), inputs.get("image_grid_thw"),
                                  inputs.get("image_position_ids"))
    except ValueError as err:
        if geometry is None:
            raise ValueError(f"an ImageMaskInput needs a vision-language model the package describes: {err}") from None
        raise
    prompt = torch.as_tensor(inputs["input_ids"])
    if prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError("an ImageMaskInput's processor_fn must give one sequence (input_ids of shape (1, T)); got "
                         f"{tuple(prompt.shape)}")
    prompt = prompt.cpu()
    target_ids = _target_ids(llm, inputs, target, gen_args)
    n, p = int(target_ids.shape[0]), int(prompt.shape[1])
    if n == 0:
        raise ValueError("no target tokens: the target text is empty or generation produced nothing")
    ids = torch.cat([prompt[0], target_ids])
    image_mask = torch.cat([image_token_mask(prompt, geometry)[0], torch.zeros(n, dtype=torch.bool)])
    if not bool(image_mask.any()):
        raise ValueError(f"the processor's input_ids hold no image token (id {geometry.image_token_id}): does the "
                         "prompt have the processor's image placeholder?")
    fl = llm._foil_ids(foil, n)
    q = "logit_minus_foil" if fl is not None and quantity == "logit" else quantity
    details = llm.attr_method.explain_positions(ids, torch.arange(p - 1, p - 1 + n), target_ids, q, fl,
                                                additional_forward_args=_forward_args(inputs, p, n, model))
    scores = details.scores
    image_hw = (inp.image.size[1], inp.image.size[0])
    if isinstance(geometry, ImageGeometry):
        found = grid_scores(scores.unsqueeze(0), image_mask.unsqueeze(0), geometry)
        leading = None if found.leading is None else found.leading[0]
        tiled = image_input_tiles(model, prompt, found.grids, image_hw, inp.get_mask_list(), llm.tokenizer, layout)
        if tiled is not None:  # tiles and a global view (Idefics3 split, Llama 4): stitched onto the image
            patch, overlap, box, segment_attr, _ = tiled
        else:
            if len(found.grids) != 1:
                raise ValueError(f"an ImageMaskInput holds one image; the processor's ids hold {len(found.grids)}")
            patch = found.grids[0]
            box = grid_box(image_hw, _resolve_layout(layout, geometry, model, inputs))
            rows, cols = geometry.grid(0)
            overlap = segment_overlap(inp.get_mask_list(), pixel_patches(image_hw, (rows, cols), box), rows * cols)
            segment_attr = segment_scores(patch, overlap)
    else:  # any-resolution tiles (LLaVA-NeXT / OneVision): placed over the original image by the geometry itself
        image = anyres_image(geometry, image_hw, layout)
        values = anyres_scores(scores.unsqueeze(0), image_mask.unsqueeze(0), geometry).tokens[0]
        overlap = sum(segment_overlap(inp.get_mask_list(), index, image.tokens) for index in image.pixel_tokens())
        patch, segment_attr = pixel_shares(values, image), segment_scores(values.unsqueeze(-2), overlap)
        leading, box = None, (0.0, 0.0, float(image_hw[0]), float(image_hw[1]))
    return ImageGenerationExplanation(
        method=details.method, input_ids=ids, prompt_length=p, target_ids=target_ids, scores=scores,
        output_tokens=readable_tokens(llm.tokenizer, target_ids), patch_attr=patch, leading=leading,
        segment_attr=segment_attr, overlap=overlap, box=box, geometry=geometry, details=details, inp=inp,
        image_token_mask=image_mask,
    )


def attribute_image_input(
    llm: Any,
    inp: ImageMaskInput,
    target: Union[str, Tensor, Sequence[int], None] = None,
    gen_args: Optional[Dict[str, Any]] = None,
    quantity: str = "logit",
    foil: Union[str, int, Tensor, None] = None,
    layout: Layout = "auto",
    **kwargs: Any,
) -> LLMAttributionResult:
    r"""Captum's ``LLMAttributionResult`` of an ``ImageMaskInput``: :func:`decompose_image_input`, then
    :meth:`ImageGenerationExplanation.to_captum`.

    Args:
        llm, inp, target, gen_args, quantity, foil, layout: see :func:`decompose_image_input`.
        **kwargs: Captum's keywords that mean nothing here (``num_trials``, ``exclude_sink``, ...):
            ignored with a warning.
    """
    kwargs.pop("exclude_sink", None)  # the sink is a text token: never a segment
    if kwargs:
        warnings.warn(f"ignored (they mean nothing for a decomposition): {sorted(kwargs)}", UserWarning, stacklevel=3)
    return decompose_image_input(llm, inp, target, gen_args, quantity, foil, layout).to_captum()
