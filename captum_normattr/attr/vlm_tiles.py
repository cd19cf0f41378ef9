r"""Tiles stitched back onto the image: one heat map per image for processors that split an image into tiles.

Idefics3 / SmolVLM (with ``do_image_splitting``) and Llama 4 cut an image into ``rows x cols`` tiles and add one
global view (the whole image, downscaled to one tile). Each of these sub-images is one token grid
(:func:`~captum_normattr.attr.vlm_regions.image_scores` gives them one by one, in the model's order: the tiles row
by row, then the global view). This module puts them back where they came from:

- **Where the tiles lie.** Idefics3's image processor resizes the image to ``rows x cols`` whole tiles (the whole
  image, stretched a little) and cuts it; the global view is the whole image squared to one tile. Llama 4's resizes
  the image without distortion to fit a canvas of ``rows x cols`` tiles, pads the canvas below and to the right, and
  cuts the canvas; the global view is the whole image squared to one tile (one tile only: the padded canvas is that
  tile, and there is no global view). :func:`view_boxes` gives the box ``(top, left, height, width)`` that the
  tiles' canvas and the global view cover in the image's pixels (the canvas may extend past the image: Llama 4's
  padding).
- **Which layout.** Idefics3 names its tiles in the text (``<row_r_col_c>`` before each tile's tokens,
  ``<global-img>`` before the global view's): read with the tokenizer, or given as ``tiles=[(rows, cols), ...]``.
  Llama 4's layout is in the ids alone: between ``<|image_start|>`` and ``<|image_end|>`` (the config's
  ``boi_token_index`` / ``eoi_token_index``), the tiles' patch tokens are parted by ``<|tile_x_separator|>`` within a
  row and ``<|tile_y_separator|>`` after each row, and ``<|image|>`` goes before the global view's tokens
  (:func:`tile_layouts`).
- **One unit for both views: score per pixel.** A global-view token covers ``rows x cols`` times the pixels of a
  tile token, so the two views' token scores are not comparable pixel by pixel. Every map here spreads each token's
  score evenly over the image pixels whose centres lie in it (the rule of
  :func:`~captum_normattr.attr.pixel_overlap.pixel_patches`), so a map is a density: its sum over any region is the
  region's share of the scores (the pixel-overlap rule of the ``ImageMaskInput`` segments), and over the whole image
  it is the sum of the image tokens' scores. ``combined = tiles + global_view``. A token with no pixel inside the
  image (wholly on Llama 4's padding) is on no pixel: its score is :attr:`TiledHeatmap.off_image`; a token that
  straddles the image's edge gives its whole score to its pixels inside the image.

The token scores themselves stay available, stitched on the token grid: :attr:`TiledHeatmap.tile_grid`
(``rows n x cols n``, the tiles side by side) and :attr:`TiledHeatmap.global_grid` (``n x n``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.attr.pixel_overlap import pixel_patches, segment_overlap
from captum_normattr.attr.vlm_regions import ImageGeometry, grid_scores, image_geometry, image_token_mask
from captum_normattr.models.adapters import unwrap_model, vision_language

__all__ = [
    "TILED_GEOMETRIES",
    "TileLayout",
    "TiledHeatmap",
    "image_input_tiles",
    "llama4_resized_size",
    "spread_density",
    "stitch_heatmap",
    "stitch_tiles",
    "tile_layouts",
    "tiled_heatmaps",
    "view_boxes",
]

#: The geometries whose images may be tiles plus a global view (:class:`TileLayout`): Idefics3 / SmolVLM's
#: ``"shuffled_grid"`` and Llama 4's ``"tiled_grid"``.
TILED_GEOMETRIES: Tuple[str, ...] = ("shuffled_grid", "tiled_grid")

Box = Tuple[float, float, float, float]

_ROW_COL = re.compile(r"<row_(\d+)_col_(\d+)>")


@dataclass(frozen=True)
class TileLayout:
    r"""How one image was cut.

    Attributes:
        rows: tile rows (0: the image was not split).
        cols: tile columns (0: the image was not split).
        global_view: the last sub-image is the whole image squared to one tile (Idefics3 always; Llama 4 when there
            are several tiles: its single tile is the padded canvas itself).
    """

    rows: int
    cols: int
    global_view: bool = True

    @property
    def tiles(self) -> int:
        r"""The number of tiles."""
        return self.rows * self.cols

    @property
    def sub_images(self) -> int:
        r"""Tiles plus the global view: the token grids of this image."""
        return self.tiles + int(self.global_view)


@dataclass
class TiledHeatmap:
    r"""One image's heat maps: the tiles stitched, the global view, and both together, as scores per pixel.

    Attributes:
        combined: (..., H, W) ``tiles + global_view``: every pixel's share of the image tokens' scores; its sum is
            their total less :attr:`off_image`.
        tiles: (..., H, W) the tiles' tokens spread over their pixels (zeros without tiles).
        global_view: (..., H, W) the global view's tokens spread over the whole image (zeros without one).
        tile_grid: (..., rows n, cols n) the tiles' token scores side by side, or None without tiles.
        global_grid: (..., n, n) the global view's token scores, or None without one.
        off_image: (...) the scores of tokens on no pixel of the image (Llama 4's padding only).
        layout: the :class:`TileLayout`.
        tile_box: the box the tiles' canvas covers in the image's pixels (None without tiles).
        global_box: the box the global view covers (the whole image; None without one).
    """

    combined: Tensor
    tiles: Tensor
    global_view: Tensor
    tile_grid: Optional[Tensor]
    global_grid: Optional[Tensor]
    off_image: Tensor
    layout: TileLayout
    tile_box: Optional[Box]
    global_box: Optional[Box]


def _runs(ids: Tensor, token: int) -> List[Tuple[int, int]]:
    r"""(start, end) of every maximal run of ``token`` in the 1-d ``ids``."""
    hit = (ids == token).tolist()
    out, start = [], None
    for i, h in enumerate(hit + [False]):
        if h and start is None:
            start = i
        elif not h and start is not None:
            out.append((start, i))
            start = None
    return out


def _llama4_layouts(ids: Tensor, config: Any, n: int) -> List[TileLayout]:
    r"""Llama 4's layouts from one row of ids: each ``<|image_start|> ... <|image_end|>`` span's tile separators."""
    boi, eoi, patch = (int(getattr(config, k)) for k in ("boi_token_index", "eoi_token_index", "image_token_index"))
    seq = ids.tolist()
    out: List[TileLayout] = []
    i = 0
    while i < len(seq):
        if seq[i] != boi:
            if seq[i] == patch:
                raise ValueError(f"an image token (id {patch}) outside <|image_start|> ... <|image_end|> (ids {boi}, "
                                 f"{eoi}): Llama 4's tile layout is read from the processor's image spans")
            i += 1
            continue
        try:
            j = seq.index(eoi, i)
        except ValueError:
            raise ValueError(f"an <|image_start|> (id {boi}) without its <|image_end|> (id {eoi})") from None
        span = ids[i + 1:j]
        runs = _runs(span, patch)
        if any((e - s) % n for s, e in runs) or not runs:
            raise ValueError(f"an image span whose patch-token runs are not whole tiles of {n} tokens")
        grids = sum((e - s) // n for s, e in runs)
        if grids == 1:
            out.append(TileLayout(1, 1, global_view=False))
        else:
            y_sep = int(span[runs[-1][0] - 2])  # the last row's <|tile_y_separator|>, then <|image|>
            gaps = [span[e:s2].tolist() for (_, e), (s2, _) in zip(runs[:-1], runs[1:])]
            rows = sum(g.count(y_sep) for g in gaps)
            tiles = grids - 1
            if rows < 1 or tiles % rows:
                raise ValueError(f"an image span of {tiles} tiles in {rows} separated rows: not Llama4Processor's layout")
            out.append(TileLayout(rows, tiles // rows, global_view=True))
        i = j + 1
    return out


def _idefics3_layouts(ids: Tensor, token: int, n: int, tokenizer: Any) -> List[TileLayout]:
    r"""Idefics3's layouts from one row of ids: the text token before each sub-image (``<row_r_col_c>`` or not)."""
    out: List[TileLayout] = []
    rows = cols = count = 0
    for start, end in _runs(ids, token):
        if (end - start) % n:
            raise ValueError(f"a run of {end - start} image tokens is not whole sub-images of {n} tokens")
        for k in range((end - start) // n):
            tag = tokenizer.convert_ids_to_tokens(int(ids[start - 1])) if start > 0 and k == 0 else None
            hit = _ROW_COL.fullmatch(str(tag)) if tag is not None else None
            if hit is not None:
                rows, cols, count = max(rows, int(hit.group(1))), max(cols, int(hit.group(2))), count + 1
                continue
            if count != rows * cols:
                raise ValueError(f"{count} tiles tagged up to <row_{rows}_col_{cols}>: not Idefics3's layout")
            out.append(TileLayout(rows, cols, global_view=True))
            rows = cols = count = 0
    if count:
        raise ValueError("tiles without their global view: the ids end inside a split image")
    return out


def tile_layouts(input_ids: Tensor, model: nn.Module, tiles: Optional[Sequence[Tuple[int, int]]] = None,
                 tokenizer: Any = None) -> List[TileLayout]:
    r"""Every image's tile layout, in the model's order of images (example by example).

    Args:
        input_ids: (B, T) the ids (pads anywhere).
        model: an Idefics3 / SmolVLM or Llama 4 model (:data:`TILED_GEOMETRIES`).
        tiles: (rows, cols) per image, ``(0, 0)`` for an image not split (Idefics3; Llama 4's single tile is
            ``(1, 1)``); default: read from the ids.
        tokenizer: Idefics3: the tokenizer that reads the ``<row_r_col_c>`` tags; without it (and without ``tiles``)
            only unsplit images are read (a split image is refused, never guessed).

    Returns:
        One :class:`TileLayout` per image.

    Raises:
        ValueError: a model without tiles, or ids that are not the processor's layout.

    Examples::

        >>> tile_layouts(batch["input_ids"], llama4)   # an image cut into 2 x 3 tiles
        [TileLayout(rows=2, cols=3, global_view=True)]
    """
    model = unwrap_model(model)
    description = vision_language(model)
    if description is None or description.geometry not in TILED_GEOMETRIES:
        raise ValueError(f"{type(model).__name__} does not cut images into tiles (tiled families: Idefics3, SmolVLM, "
                         "Llama 4)")
    geometry = image_geometry(model)
    n = geometry.tokens(0)
    llama4 = description.geometry == "tiled_grid"
    if tiles is not None:
        return [TileLayout(int(r), int(c), global_view=not (llama4 and int(r) * int(c) == 1)) for r, c in tiles]
    ids = torch.as_tensor(input_ids).reshape(-1, torch.as_tensor(input_ids).shape[-1]).cpu()
    out: List[TileLayout] = []
    for row in ids:
        if llama4:
            out += _llama4_layouts(row, model.config, n)
        elif tokenizer is not None:
            out += _idefics3_layouts(row, geometry.image_token_id, n, tokenizer)
        else:
            out += _unsplit_layouts(row, geometry.image_token_id, n)
    return out


def _unsplit_layouts(ids: Tensor, token: int, n: int) -> List[TileLayout]:
    r"""Idefics3 without a tokenizer: unsplit images only, known by the same tag (``<global-img>``) before every
    sub-image; a split image's tiles carry other tags, which need the tokenizer (or ``tiles=``) to be read."""
    runs = _runs(ids, token)
    tags = {int(ids[s - 1]) if s > 0 else None for s, _ in runs}
    if len(tags) > 1 or any((e - s) != n for s, e in runs):
        raise ValueError("these ids hold an image split into tiles (its sub-images carry different tags): give the "
                         "tokenizer (it reads the <row_r_col_c> tags) or tiles=[(rows, cols), ...]")
    return [TileLayout(0, 0)] * len(runs)


def llama4_resized_size(image_hw: Tuple[int, int], canvas_hw: Tuple[int, int], tile: int,
                        resize_to_max_canvas: bool = False) -> Tuple[int, int]:
    r"""The size Llama 4's image processor resizes an image to before padding it to its canvas of tiles.

    The processor fits the image into the canvas without distortion; without ``resize_to_max_canvas`` (its
    default) it never upscales a side past ``max(side, tile)``.

    Args:
        image_hw: (H, W) of the original image.
        canvas_hw: (rows tile, cols tile) of the canvas the processor chose (the tiles' layout times the tile size).
        tile: the tile's side (the processor's ``size``, the tower's ``image_size``).
        resize_to_max_canvas: the processor's option of that name.

    Returns:
        (height, width) of the resized image, at the canvas's top left.

    Examples::

        >>> llama4_resized_size((200, 300), (448, 448), 448)
        (298, 448)
    """
    h, w = int(image_hw[0]), int(image_hw[1])
    ch, cw = int(canvas_hw[0]), int(canvas_hw[1])
    if not resize_to_max_canvas:
        ch, cw = min(max(h, tile), ch), min(max(w, tile), cw)
    if cw / w < ch / h:
        new_h, new_w = min(int(h * (cw / w)), ch), cw
    else:
        new_h, new_w = ch, min(int(w * (ch / h)), cw)
    return max(new_h, 1), max(new_w, 1)


def view_boxes(model: nn.Module, layout: TileLayout, image_hw: Optional[Tuple[int, int]] = None,
               resize_to_max_canvas: bool = False) -> Tuple[Tuple[int, int], Optional[Box], Optional[Box]]:
    r"""The frame of an image's heat maps and the boxes its tiles' canvas and its global view cover there.

    Args:
        model: the tiled model.
        layout: the image's :class:`TileLayout`.
        image_hw: (H, W) of the original image: the maps are over its pixels. Default (Idefics3 only): the image
            the tiles were cut from (rows S x cols S, or S x S unsplit).
        resize_to_max_canvas: Llama 4's image-processor option (:func:`llama4_resized_size`).

    Returns:
        ((H, W), tile box or None, global box or None).

    Raises:
        ValueError: Llama 4 without ``image_hw`` (its padding depends on the original size).
    """
    model = unwrap_model(model)
    description = vision_language(model)
    vision = getattr(model.config, description.vision_config)
    side = int(vision.image_size)
    canvas = (max(layout.rows, 1) * side, max(layout.cols, 1) * side)
    if image_hw is None:
        if description.geometry == "tiled_grid":
            raise ValueError("Llama 4 pads its canvas of tiles past the resized image: give image_hw (the original "
                             "image's height and width) to place the tiles on it")
        image_hw = canvas
    h, w = int(image_hw[0]), int(image_hw[1])
    whole: Box = (0.0, 0.0, float(h), float(w))
    tile_box: Optional[Box] = None
    if layout.tiles:
        if description.geometry == "tiled_grid":  # the resized image at the canvas's top left, padding beyond
            rh, rw = llama4_resized_size((h, w), canvas, side, resize_to_max_canvas)
            tile_box = (0.0, 0.0, canvas[0] * h / rh, canvas[1] * w / rw)
        else:  # Idefics3: the image resized to whole tiles
            tile_box = whole
    return (h, w), tile_box, whole if layout.global_view else None


def spread_density(grid: Tensor, image_hw: Tuple[int, int], box: Box) -> Tuple[Tensor, Tensor]:
    r"""A token grid as scores per pixel: every token's score spread evenly over the pixels whose centres it covers.

    Args:
        grid: (..., rows, cols) token scores; NaN counts 0.
        image_hw: (H, W) of the image.
        box: ``(top, left, height, width)`` the grid covers (may extend past the image).

    Returns:
        ((..., H, W) the density, zero on pixels the box does not cover; (...) the scores of tokens on no pixel).

    Examples::

        >>> spread_density(torch.tensor([[4.0, 8.0]]), (2, 4), (0, 0, 2, 4))[0]
        tensor([[1., 1., 2., 2.],
                [1., 1., 2., 2.]])
    """
    rows, cols = grid.shape[-2], grid.shape[-1]
    idx = pixel_patches(image_hw, (rows, cols), box).to(grid.device)
    inside = idx >= 0
    count = torch.bincount(idx[inside], minlength=rows * cols).to(grid.dtype)
    flat = torch.nan_to_num(grid.reshape(*grid.shape[:-2], rows * cols), nan=0.0)
    per_pixel = flat / count.clamp_min(1.0)
    out = per_pixel[..., idx.clamp_min(0)] * inside.to(grid.dtype)
    off = (flat * (count == 0).to(grid.dtype)).sum(-1)
    return out, off


def stitch_tiles(sub_grids: Sequence[Tensor], layout: TileLayout) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    r"""One image's sub-image grids (tiles row by row, then the global view) as (tile grid, global grid).

    Args:
        sub_grids: :attr:`TileLayout.sub_images` grids (..., n, n), in the model's order.
        layout: the image's :class:`TileLayout`.

    Returns:
        ((..., rows n, cols n) the tiles side by side or None, (..., n, n) the global view or None).

    Examples:
        >>> t, g = stitch_tiles([torch.full((1, 1), float(k)) for k in range(3)], TileLayout(1, 2))
        >>> t, g
        (tensor([[0., 1.]]), tensor([[2.]]))
    """
    if len(sub_grids) != layout.sub_images:
        raise ValueError(f"{len(sub_grids)} sub-image grids for a layout of {layout.sub_images}")
    tile_grid = None
    if layout.tiles:
        rows = [torch.cat(list(sub_grids[r * layout.cols:(r + 1) * layout.cols]), dim=-1) for r in range(layout.rows)]
        tile_grid = torch.cat(rows, dim=-2)
    return tile_grid, sub_grids[-1] if layout.global_view else None


def tiled_heatmaps(result: Any, input_ids: Tensor, model: nn.Module,
                   image_hw: Optional[Sequence[Tuple[int, int]]] = None,
                   tiles: Optional[Sequence[Tuple[int, int]]] = None, tokenizer: Any = None,
                   resize_to_max_canvas: bool = False) -> List[TiledHeatmap]:
    r"""One heat map per image over its pixels: the tiles stitched, the global view, and both (scores per pixel).

    Args:
        result: a result of the package (its ``scores``, (B, T) or (B, ..., T)) or the scores themselves.
        input_ids: (B, T) the ids the result explains.
        model: an Idefics3 / SmolVLM or Llama 4 model.
        image_hw: (H, W) of every original image (Llama 4: needed); default the image the tiles were cut from.
        tiles, tokenizer: the layouts (:func:`tile_layouts`).
        resize_to_max_canvas: Llama 4's image-processor option.

    Returns:
        One :class:`TiledHeatmap` per image, in the model's order of images.

    Examples::

        >>> res = ALTILogitAttribution(llama4).decompose(ids, target=t, additional_forward_args={
        ...     "attention_mask": mask, "pixel_values": pixels})
        >>> heat = tiled_heatmaps(res, ids, llama4, image_hw=[(480, 640)])[0]
        >>> heat.combined.shape, heat.tile_grid.shape   # (480, 640), (2 n, 3 n)
    """
    layouts = tile_layouts(input_ids, model, tiles, tokenizer)
    geometry: ImageGeometry = image_geometry(model)
    scores = getattr(result, "scores", result)
    found = grid_scores(scores, image_token_mask(input_ids, geometry).to(scores.device), geometry)
    if sum(lay.sub_images for lay in layouts) != len(found.grids):
        raise ValueError(f"the ids hold {len(found.grids)} sub-images; the layouts "
                         f"{[(lay.rows, lay.cols) for lay in layouts]} need {sum(lay.sub_images for lay in layouts)}")
    if image_hw is not None and len(image_hw) != len(layouts):
        raise ValueError(f"image_hw has {len(image_hw)} sizes for {len(layouts)} images")
    out: List[TiledHeatmap] = []
    start = 0
    for i, layout in enumerate(layouts):
        subs = found.grids[start:start + layout.sub_images]
        start += layout.sub_images
        out.append(stitch_heatmap(subs, layout, model, None if image_hw is None else image_hw[i],
                                  resize_to_max_canvas))
    return out


def stitch_heatmap(sub_grids: Sequence[Tensor], layout: TileLayout, model: nn.Module,
                   image_hw: Optional[Tuple[int, int]] = None, resize_to_max_canvas: bool = False) -> TiledHeatmap:
    r"""One image's :class:`TiledHeatmap` from its sub-image grids (:func:`stitch_tiles`, :func:`view_boxes`,
    :func:`spread_density`)."""
    frame, tile_box, global_box = view_boxes(model, layout, image_hw, resize_to_max_canvas)
    tile_grid, global_grid = stitch_tiles(sub_grids, layout)
    ref = sub_grids[0]
    zeros = torch.zeros(*ref.shape[:-2], *frame, dtype=ref.dtype, device=ref.device)
    off = torch.zeros(ref.shape[:-2], dtype=ref.dtype, device=ref.device)
    tile_map, global_map = zeros, zeros.clone()
    if tile_grid is not None:
        tile_map, lost = spread_density(tile_grid, frame, tile_box)
        off = off + lost
    if global_grid is not None:
        global_map, lost = spread_density(global_grid, frame, global_box)
        off = off + lost
    return TiledHeatmap(combined=tile_map + global_map, tiles=tile_map, global_view=global_map, tile_grid=tile_grid,
                        global_grid=global_grid, off_image=off, layout=layout, tile_box=tile_box,
                        global_box=global_box)


def image_input_tiles(model: nn.Module, input_ids: Tensor, sub_grids: Sequence[Tensor], image_hw: Tuple[int, int],
                      masks: Sequence[Tensor], tokenizer: Any = None, layout: Any = "auto"
                      ) -> Optional[Tuple[Tensor, Tensor, Box, Tensor, TiledHeatmap]]:
    r"""The segments of a tiled image (Captum's ``ImageMaskInput``): every segment's score is its pixels' sum of the
    :class:`TiledHeatmap`'s ``combined`` map (each token's score shared by its pixels in the segment).

    Args:
        model: the vision-language model.
        input_ids: (1, T) the processor's ids (one image).
        sub_grids: the image's sub-image grids (..., n, n) in the model's order.
        image_hw: (H, W) of the original image.
        masks: the segments' boolean (H, W) masks.
        tokenizer: reads Idefics3's ``<row_r_col_c>`` tags (:func:`tile_layouts`).
        layout: must be ``"auto"``: the tiles' places are the processor's.

    Returns:
        None when the image is not tiled (a model without tiles, or Idefics3's unsplit image: one grid over the
        squared image); else (patch_attr: the tile grid (..., rows n, cols n) or the global grid without tiles,
        overlap (S, tile tokens + global tokens), the box of ``patch_attr``, segment_attr (..., S), the heat map).

    Raises:
        ValueError: several images, or a layout other than ``"auto"``.
    """
    description = vision_language(unwrap_model(model))
    if description is None or description.geometry not in TILED_GEOMETRIES:
        return None
    if description.geometry != "tiled_grid" and len(sub_grids) == 1:
        return None
    if not (isinstance(layout, str) and layout == "auto"):
        raise ValueError(f"a tiled image's tiles lie where {description.family}'s processor put them: layout must be "
                         f"'auto'; got {layout!r}")
    layouts = tile_layouts(input_ids, model, tokenizer=tokenizer)
    if len(layouts) != 1:
        raise ValueError(f"an ImageMaskInput holds one image; the processor's ids hold {len(layouts)}")
    heat = stitch_heatmap(sub_grids, layouts[0], model, image_hw)
    views = [(g, b) for g, b in ((heat.tile_grid, heat.tile_box), (heat.global_grid, heat.global_box)) if g is not None]
    overlap = torch.cat([segment_overlap(masks, pixel_patches(image_hw, g.shape[-2:], b), g.shape[-2] * g.shape[-1])
                         for g, b in views], dim=1)
    flat = torch.cat([torch.nan_to_num(g.reshape(*g.shape[:-2], -1), nan=0.0) for g, _ in views], dim=-1)
    segment_attr = flat @ overlap.to(device=flat.device, dtype=flat.dtype).T
    return views[0][0], overlap, views[0][1], segment_attr, heat
