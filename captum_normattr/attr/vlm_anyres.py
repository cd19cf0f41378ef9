r"""LLaVA-NeXT / LLaVA-OneVision image tokens mapped back to the original image's pixels (geometry ``"anyres_tiles"``).

An image of H x W pixels (``image_sizes``, the processor's) becomes, in this order (S the tower's
``vision_config.image_size``, p its ``patch_size``, n = S / p):

1. **the base view**: the image resized to S x S (a stretch), n x n tokens row by row; token (r, c) covers the
   original pixels whose centre (y + 1/2, x + 1/2) has ``floor((y + 1/2) n / H) = r`` and
   ``floor((x + 1/2) n / W) = c``;
2. **the tiles**: the best resolution (B_h, B_w) of ``image_grid_pinpoints`` (transformers'
   ``select_best_resolution``); the processor resizes the image to (h', w') inside it, keeping its aspect ratio
   (``get_patch_output_size``: the limiting side exact, the other ``ceil``), pastes it at
   (t, l) = (floor((B_h - h') / 2), floor((B_w - w') / 2)) on a zero canvas and cuts the canvas into S x S tiles; the
   model stitches the tiles' patches into one (B_h / p) x (B_w / p) grid and unpads it to the image's aspect ratio
   (``unpad_image``: rows [r0, r1) and columns [c0, c1) kept, computed in grid cells, which may cut a little more
   or less than the processor padded); LLaVA-OneVision then downscales the kept (u_h, u_w) cells bilinearly to
   (o_h, o_w) = (floor(u_h / rho), floor(u_w / rho)) when rho = sqrt(u_h u_w / (N n^2)) > 1.1
   (``vision_aspect_ratio = "anyres_max_N"``), else (o_h, o_w) = (u_h, u_w). Tile token (i, j) covers the original
   pixels whose centre, carried onto the canvas (v = t + (y + 1/2) h' / H, likewise across), falls in its cell:
   ``floor((v / p - r0) o_h / u_h) = i`` (and the same for j with l, w', c0, u_w, o_w); a downscaled token covers
   the box of the kept cells it stands for (its bilinear sample is that box's centre);
3. **a newline token** (the model's learned ``image_newline``) after each of the o_h rows of tiles: it has the image
   token's id and gets a score of its own, but it is no patch of the image and covers no pixel.

So an image holds n^2 + o_h (o_w + 1) image tokens. An image that is not tiled (OneVision with several images in one
prompt, ``batch_num_images`` > 1) is its base view and one newline token.

Heat maps (:func:`anyres_heatmaps`) are over the ORIGINAL image's H x W pixels: each pixel carries the score of the
token covering it in the view asked for. The default is the sum of the two views (``view="sum"``: the base token's
score plus the tile token's, the tile part 0 where unpadding left no tile token over the pixel), the one heat map over
the user's image; ``view="base"`` and ``view="tiles"`` give the views apart (tiles: NaN where no tile token covers the
pixel). Captum's ``ImageMaskInput`` route (:func:`anyres_image`) shares every token's score out over the pixels
it covers, in both views, and sums the shares per segment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.attr.image_tokens import split_images
from captum_normattr.models.adapters import unwrap_model, vision_language

__all__ = [
    "VIEWS",
    "AnyresGeometry",
    "AnyresImage",
    "AnyresScores",
    "anyres_geometry",
    "anyres_heatmaps",
    "anyres_image",
    "anyres_layout",
    "anyres_scores",
    "pixel_shares",
]

#: The heat map views of :func:`anyres_heatmaps`: the sum of both (default), the base view, the tiles.
VIEWS: Tuple[str, ...] = ("sum", "base", "tiles")


@dataclass(frozen=True)
class AnyresImage:
    r"""Where one image's tokens lie over its original pixels (the quantities of the module's equations).

    Attributes:
        size: (H, W) of the original image.
        side: n = S / p, the base view's grid side.
        patch: p, pixels per patch of the tower's input.
        tiled: False for an image given as its base view only (OneVision, several images per prompt).
        canvas: (B_h, B_w) the best pinpoint resolution in pixels.
        resized: (h', w') the image's size inside the canvas.
        offset: (t, l) where the resized image is pasted on the canvas.
        kept: (r0, r1, c0, c1) the big grid's cells kept by unpadding.
        grid: (o_h, o_w) the tile tokens (after OneVision's downscaling).
    """

    size: Tuple[int, int]
    side: int
    patch: int
    tiled: bool = True
    canvas: Tuple[int, int] = (0, 0)
    resized: Tuple[int, int] = (0, 0)
    offset: Tuple[int, int] = (0, 0)
    kept: Tuple[int, int, int, int] = (0, 0, 0, 0)
    grid: Tuple[int, int] = (0, 0)

    @property
    def tokens(self) -> int:
        r"""The image's tokens: n^2 base, then o_h (o_w + 1) tiles and newlines (1 newline when not tiled)."""
        oh, ow = self.grid
        return self.side ** 2 + (oh * (ow + 1) if self.tiled else 1)

    def newline_mask(self) -> Tensor:
        r"""(tokens,) bool: the newline tokens among the image's tokens."""
        out = torch.zeros(self.tokens, dtype=torch.bool)
        if not self.tiled:
            out[-1] = True
            return out
        oh, ow = self.grid
        out[self.side ** 2 + ow + (ow + 1) * torch.arange(oh)] = True
        return out

    def pixel_tokens(self) -> Tuple[Tensor, Tensor]:
        r"""((H, W), (H, W)) long: the token (its index among the image's tokens) over every original pixel in the
        base view and in the tiles; -1 where none (the tiles, outside the unpadded grid; an untiled image)."""
        h, w = self.size
        n = self.side
        ys = torch.arange(h, dtype=torch.float64) + 0.5
        xs = torch.arange(w, dtype=torch.float64) + 0.5
        base = torch.floor(ys * n / h).long()[:, None] * n + torch.floor(xs * n / w).long()[None, :]
        tiles = torch.full((h, w), -1, dtype=torch.long)
        if not self.tiled:
            return base, tiles
        (t, l), (rh, rw), (r0, r1, c0, c1), (oh, ow) = self.offset, self.resized, self.kept, self.grid
        i = torch.floor((((t + ys * rh / h) / self.patch) - r0) * oh / (r1 - r0)).long()
        j = torch.floor((((l + xs * rw / w) / self.patch) - c0) * ow / (c1 - c0)).long()
        inside = ((i >= 0) & (i < oh))[:, None] & ((j >= 0) & (j < ow))[None, :]
        index = n * n + i[:, None] * (ow + 1) + j[None, :]
        return base, torch.where(inside, index, tiles)


def anyres_layout(size: Sequence[int], pinpoints: Sequence[Sequence[int]], image_size: int, patch: int,
                  max_patches: Optional[int] = None, tiled: bool = True) -> AnyresImage:
    r"""One image's :class:`AnyresImage` from the numbers (the module's equations).

    Args:
        size: (H, W) of the original image (``image_sizes``).
        pinpoints: ``image_grid_pinpoints`` (the model config's, which the processor must share).
        image_size: S, the tower's square input.
        patch: p, the tower's patch size.
        max_patches: N of OneVision's ``anyres_max_N`` (None: LLaVA-NeXT, no downscaling).
        tiled: False for an image given as its base view only.

    Returns:
        :class:`AnyresImage`.

    Examples:
        >>> anyres_layout((12, 20), [[8, 16], [16, 8], [16, 16]], 8, 2).kept  # a 16 x 16 canvas, rows 2 to 5 kept
        (2, 6, 0, 8)
    """
    from transformers.image_processing_utils import select_best_resolution

    h, w = int(size[0]), int(size[1])
    n = int(image_size) // int(patch)
    if not tiled:
        return AnyresImage((h, w), n, int(patch), tiled=False)
    bh, bw = (int(v) for v in select_best_resolution((h, w), [list(p) for p in pinpoints]))
    if bw / w < bh / h:  # the processor's get_patch_output_size: the limiting side exact
        rh, rw = min(math.ceil(h * (bw / w)), bh), bw
    else:
        rh, rw = bh, min(math.ceil(w * (bh / h)), bw)
    ch, cw = bh // image_size * n, bw // image_size * n
    if w / h > cw / ch:  # the model's unpad_image, in grid cells
        pad = (ch - int(round(h * (cw / w), 7))) // 2
        kept = (pad, ch - pad, 0, cw)
    else:
        pad = (cw - int(round(w * (ch / h), 7))) // 2
        kept = (0, ch, pad, cw - pad)
    uh, uw = kept[1] - kept[0], kept[3] - kept[2]
    grid = (uh, uw)
    if max_patches is not None:
        ratio = math.sqrt(uh * uw / (max_patches * n ** 2))
        if ratio > 1.1:
            grid = (int(uh // ratio), int(uw // ratio))
    return AnyresImage((h, w), n, int(patch), True, (bh, bw), (rh, rw), ((bh - rh) // 2, (bw - rw) // 2), kept, grid)


@dataclass(frozen=True)
class AnyresGeometry:
    r"""A LLaVA-NeXT / OneVision model's image tokens over its images.

    Attributes:
        image_token_id: the image placeholder's id (the newline tokens have it too).
        images: one :class:`AnyresImage` per image, in the model's order.
    """

    image_token_id: int
    images: Tuple[AnyresImage, ...]


def anyres_geometry(model: nn.Module, image_sizes: Tensor, batch_num_images: Optional[Tensor] = None) -> AnyresGeometry:
    r"""The geometry of a LLaVA-NeXT / OneVision model's images, from its config and the processor's ``image_sizes``.

    Args:
        model: a model whose description's geometry is ``"anyres_tiles"``.
        image_sizes: (n_images, 2) the original images' (H, W).
        batch_num_images: OneVision's images per example; an example with more than one gives its images untiled
            (as the model's forward does); None: every image tiled.

    Returns:
        :class:`AnyresGeometry`.

    Raises:
        ValueError: not such a model, no ``image_sizes``, or a tower whose features are not its patches
            (``"default"`` needs a [CLS] feature to drop, ``"full"`` none: the model's own packing fails otherwise).
    """
    model = unwrap_model(model)
    description = vision_language(model)
    if description is None or description.geometry != "anyres_tiles":
        raise ValueError(f"{type(model).__name__} has no any-resolution tiles (LLaVA-NeXT, LLaVA-OneVision)")
    if image_sizes is None:
        raise ValueError(f"{description.family}'s images are tiled by their size: pass image_sizes (the processor's)")
    config = model.config
    vision = getattr(config, description.vision_config)
    class_token = getattr(vision, "model_type", None) in description.class_token_towers
    strategy = getattr(config, description.strategy, "default")
    if class_token != (strategy == "default"):
        raise ValueError(f"{description.family} with a {vision.model_type} tower and the {strategy!r} feature strategy "
                         "gives tiles whose features are not their patches (the model's own packing refuses it)")
    aspect = getattr(config, "vision_aspect_ratio", None)
    max_patches = None if aspect is None else int(str(aspect).strip("anyres_max_"))  # as the model reads it
    sizes = torch.as_tensor(image_sizes).reshape(-1, 2).tolist()
    tiled = [True] * len(sizes)
    if batch_num_images is not None:
        tiled = [int(k) == 1 for k in torch.as_tensor(batch_num_images).reshape(-1).tolist() for _ in range(int(k))]
        if len(tiled) != len(sizes):
            raise ValueError(f"batch_num_images counts {len(tiled)} images; image_sizes holds {len(sizes)}")
    token = next(getattr(config, n) for n in description.image_token if getattr(config, n, None) is not None)
    images = tuple(anyres_layout(s, config.image_grid_pinpoints, int(vision.image_size), int(vision.patch_size),
                                 max_patches, t) for s, t in zip(sizes, tiled))
    return AnyresGeometry(int(token), images)


@dataclass
class AnyresScores:
    r"""The image tokens' scores of every image, split into its views.

    Attributes:
        tokens: one (..., tokens) tensor per image: its image tokens' scores in sequence order.
        base: one (..., n, n) base-view grid per image.
        tiles: one (..., o_h, o_w) tile grid per image (None: not tiled).
        newline: one (..., rows) tensor per image: the newline tokens' scores (on no pixel).
        example: (n_images,) the example each image belongs to.
        images: the :class:`AnyresImage` of each.
    """

    tokens: List[Tensor]
    base: List[Tensor]
    tiles: List[Optional[Tensor]]
    newline: List[Tensor]
    example: Tensor
    images: Tuple[AnyresImage, ...]


def anyres_scores(scores: Tensor, image_mask: Tensor, geometry: AnyresGeometry) -> AnyresScores:
    r"""Split every example's image-token scores into images and their views.

    Args:
        scores: (B, T) or (B, ..., T) per-token scores (middle axes kept).
        image_mask: (B, T) bool, the image tokens (the newlines included).
        geometry: the :class:`AnyresGeometry`.

    Returns:
        :class:`AnyresScores`.

    Raises:
        ValueError: the image tokens do not split into the geometry's images.
    """
    def tokens(image: int) -> int:
        if image >= len(geometry.images):
            raise ValueError(f"the ids hold image tokens past the {len(geometry.images)} images of image_sizes")
        return geometry.images[image].tokens

    found = split_images(scores, image_mask, tokens, lambda image: f"image_sizes {geometry.images[image].size}")
    out = AnyresScores([], [], [], [], torch.tensor([b for b, _ in found], dtype=torch.long), geometry.images)
    for (_, part), im in zip(found, geometry.images):
        n, (oh, ow) = im.side, im.grid
        out.tokens.append(part)
        out.base.append(part[..., :n * n].reshape(*part.shape[:-1], n, n))
        rows = part[..., n * n:].reshape(*part.shape[:-1], oh, ow + 1) if im.tiled else None
        out.tiles.append(None if rows is None else rows[..., :ow])
        out.newline.append(part[..., -1:] if rows is None else rows[..., ow])
    if len(found) != len(geometry.images):
        raise ValueError(f"the ids hold {len(found)} images; image_sizes holds {len(geometry.images)}")
    return out


def _gather(values: Tensor, index: Tensor) -> Tensor:
    r"""(..., H, W): ``values[..., index]`` with NaN where the index is -1."""
    padded = torch.cat([values, values.new_full((*values.shape[:-1], 1), float("nan"))], -1)
    where = torch.where(index >= 0, index, torch.full_like(index, values.shape[-1])).to(values.device)
    return padded[..., where.reshape(-1)].reshape(*values.shape[:-1], *index.shape)


def anyres_heatmaps(result: Any, input_ids: Tensor, model: nn.Module, image_sizes: Tensor,
                    batch_num_images: Optional[Tensor] = None, view: str = "sum") -> List[Tensor]:
    r"""Heat maps over the original images' pixels (LLaVA-NeXT, LLaVA-OneVision).

    Args:
        result: a result (its ``scores``) or per-token scores, (B, T) or (B, ..., T).
        input_ids: (B, T) token ids.
        model: the model.
        image_sizes: (n_images, 2) the original images' (H, W) (the processor's).
        batch_num_images: OneVision's images per example (:func:`anyres_geometry`).
        view: ``"sum"`` (default: base + tiles, the tiles counting 0 on a pixel no tile token covers), ``"base"``
            or ``"tiles"`` (NaN on a pixel no tile token covers) (:data:`VIEWS`).

    Returns:
        One (..., H, W) tensor per image, in the model's order.

    Examples::

        >>> batch = processor(images=image, text=prompt, return_tensors="pt")
        >>> res = ALTILogitAttribution(model).decompose(batch["input_ids"], target=t, additional_forward_args={
        ...     "attention_mask": batch["attention_mask"], "pixel_values": batch["pixel_values"],
        ...     "image_sizes": batch["image_sizes"]})
        >>> heat = anyres_heatmaps(res, batch["input_ids"], model, batch["image_sizes"])[0]  # (H, W) of the image
    """
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}; got {view!r}")
    geometry = anyres_geometry(model, image_sizes, batch_num_images)
    scores = getattr(result, "scores", result)
    if not isinstance(scores, Tensor):
        raise TypeError(f"expected per-token scores (a tensor, or a result with .scores); got {type(result).__name__}")
    found = anyres_scores(scores, (input_ids == geometry.image_token_id).to(scores.device), geometry)
    maps = []
    for values, im in zip(found.tokens, found.images):
        base, tiles = (_gather(values, index) for index in im.pixel_tokens())
        maps.append(base if view == "base" else tiles if view == "tiles" else base + torch.nan_to_num(tiles, nan=0.0))
    return maps


def pixel_shares(values: Tensor, image: AnyresImage) -> Tensor:
    r"""(..., H, W): every token's score shared out equally over the original pixels it covers, both views summed
    (a token covering no pixel adds nothing; the newline tokens cover none). Its sum over a set of pixels is that set's
    score by pixel overlap (:func:`anyres_image`)."""
    out = values.new_zeros((*values.shape[:-1], *image.size))
    for index in image.pixel_tokens():
        count = torch.bincount(index[index >= 0], minlength=values.shape[-1]).to(values.dtype).to(values.device)
        out = out + torch.nan_to_num(_gather(values / count.clamp_min(1.0), index), nan=0.0)
    return out


def anyres_image(geometry: AnyresGeometry, image_hw: Tuple[int, int], layout: Any = "auto") -> AnyresImage:
    r"""The one image of an ``ImageMaskInput`` route (:mod:`captum_normattr.attr.llm_images`), checked.

    There a segment's score is :math:`\sum_{\text{token}} s_{\text{token}} |\text{its pixels in the segment}| /
    |\text{its pixels}|` over the base tokens and the tile tokens (:meth:`AnyresImage.pixel_tokens`), the newline
    tokens in no segment; the explanation's ``patch_attr`` is :func:`pixel_shares` (n, H, W), a grid of single pixels
    over the whole image, whose sum over a segment's pixels is the segment's score.

    Args:
        geometry: the :class:`AnyresGeometry` of the processor's inputs.
        image_hw: (H, W) of the ``ImageMaskInput``'s image: it must be the processor's ``image_sizes``.
        layout: only ``"auto"`` (the geometry places the tokens itself).

    Returns:
        The :class:`AnyresImage`.

    Raises:
        ValueError: not one image, an image whose size is not the processor's ``image_sizes``, or a layout.
    """
    if not (isinstance(layout, str) and layout == "auto"):
        raise ValueError(f"an any-resolution model places its tokens over the original image itself: layout must be "
                         f"'auto', got {layout!r}")
    if len(geometry.images) != 1:
        raise ValueError(f"an ImageMaskInput holds one image; image_sizes holds {len(geometry.images)}")
    image = geometry.images[0]
    if tuple(image.size) != tuple(int(v) for v in image_hw):
        raise ValueError(f"the processor's image_sizes {image.size} is not the image's size {tuple(image_hw)}: the "
                         "processor_fn must give the model the image itself")
    return image
