r"""Images in, images out: pixel values for Vision Transformers and token scores spread back over pixels.

A Vision Transformer cuts a (C, H, W) image into (H/p) x (W/p) patches of p x p pixels;
its tokens are [CLS], then (DeiT) a distillation token or (DINOv2 with registers) the
register tokens, then the patches in row-major order. The decompositions score tokens.
:func:`pixel_attributions` turns token scores into the Captum image convention: every
patch token's score is spread evenly over its p * p * C pixel values, so that a patch's
attributions sum to its token score. The prefix tokens ([CLS], distillation, registers)
cover no pixel: their scores stay in the token-level result (``decompose()``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.models.prepared import PreparedInputs, single_input
from captum_normattr.arch.spec import ArchitectureSpec
from captum_normattr.models.weights import input_device


def patch_size(model: nn.Module) -> int:
    r"""The patch side p of a Vision Transformer (square patches)."""
    p = model.config.patch_size
    if isinstance(p, (tuple, list)):
        if p[0] != p[1]:
            raise ValueError(f"only square patches are supported; the model has patch_size {tuple(p)}")
        p = p[0]
    return int(p)


def image_size(model: nn.Module) -> Tuple[int, int]:
    r"""The (H, W) the model was configured for."""
    s = model.config.image_size
    return (int(s[0]), int(s[1])) if isinstance(s, (tuple, list)) else (int(s), int(s))


def num_prefix_tokens(model: nn.Module, adapter: ArchitectureSpec) -> int:
    r"""Tokens before the first patch: the description's prefix tokens ([CLS], DeiT's distillation token) and registers."""
    return adapter.inputs.prefix_tokens + int(getattr(model.config, "num_register_tokens", 0) or 0)


def token_names(model: nn.Module, adapter: ArchitectureSpec, grid: Tuple[int, int]) -> list:
    r"""Readable names of the tokens: ``[CLS]``, ``[DIST]``, ``[REG0]``..., then ``(row,col)`` patches."""
    names = list(adapter.inputs.prefix_names)
    names += [f"[REG{i}]" for i in range(num_prefix_tokens(model, adapter) - len(names))]
    return names + [f"({r},{c})" for r in range(grid[0]) for c in range(grid[1])]


@dataclass
class PreparedImageInputs(PreparedInputs):
    r"""Validated pixel values of one call (all tokens are real: the mask is all 1)."""

    pixel_values: Tensor = None
    interpolate: bool = False
    patch: int = 16
    grid: Tuple[int, int] = (1, 1)
    num_prefix: int = 1
    accepts_interpolate: bool = True

    @property
    def shape(self) -> Tuple[int, int]:
        return int(self.pixel_values.shape[0]), int(self.attention_mask.shape[1])

    def forward_kwargs(self) -> dict:
        kw = {"pixel_values": self.pixel_values}
        if self.accepts_interpolate:
            kw["interpolate_pos_encoding"] = self.interpolate
        return kw


def prepare_pixel_values(
    model: nn.Module, adapter: ArchitectureSpec, inputs: Union[Tensor, Tuple[Tensor, ...]], additional_forward_args: Any = None
) -> PreparedImageInputs:
    r"""Check pixel values (B, C, H, W) against a Vision Transformer.

    Args:
        model: a supported Vision Transformer.
        adapter: its adapter.
        inputs: float pixel values (B, C, H, W) (as the model's image processor makes them),
            or a 1-tuple holding them. H and W must be multiples of the patch size; other
            sizes than the configured one use ``interpolate_pos_encoding``.
        additional_forward_args: must be None (images have no padding).

    Returns:
        :class:`PreparedImageInputs` on the model's device (a model dispatched by
        accelerate: the device the inputs have; its hooks move them).

    Raises:
        ValueError / TypeError with a message saying what to change.
    """
    inputs, is_tuple = single_input(inputs, "pixel values", "(B, C, H, W)")
    if not inputs.is_floating_point():
        raise TypeError(
            f"pixel values must be a float tensor (B, C, H, W), as the model's image processor returns them; got dtype "
            f"{inputs.dtype}"
        )
    c = int(getattr(model.config, "num_channels", 3))
    if inputs.dim() == 3:
        raise ValueError(f"pixel values must be a batch (B, C, H, W); got shape {tuple(inputs.shape)} — use x.unsqueeze(0)")
    if inputs.dim() != 4:
        raise ValueError(f"pixel values must have shape (B, C, H, W); got {tuple(inputs.shape)}")
    b, ch, h, w = (int(v) for v in inputs.shape)
    if ch != c:
        hint = " (channels last? use x.permute(0, 3, 1, 2))" if int(inputs.shape[-1]) == c else ""
        raise ValueError(f"pixel values must have {c} channels in dim 1; got shape {tuple(inputs.shape)}{hint}")
    if b == 0:
        raise ValueError("pixel values are empty: give at least one image")
    p = patch_size(model)
    if h % p or w % p or h == 0 or w == 0:
        raise ValueError(
            f"image height and width must be positive multiples of the patch size {p}; got {h} x {w} "
            "(resize or crop with the model's image processor)"
        )
    if additional_forward_args is not None:
        raise ValueError("Vision Transformers take no additional_forward_args (images have no padding); pass None")
    params = next(model.parameters())
    # a model dispatched by accelerate keeps offloaded parameters on 'meta': its inputs stay where they are
    device = input_device(model, inputs)
    x = inputs.to(device=device, dtype=params.dtype)
    grid = (h // p, w // p)
    prefix = num_prefix_tokens(model, adapter)
    t = prefix + grid[0] * grid[1]
    accepts = adapter.inputs.interpolates_positions == "flag"  # DINOv2 always interpolates its position embeddings
    interpolate = (h, w) != image_size(model)
    mask = torch.ones(b, t, dtype=torch.long, device=device)
    return PreparedImageInputs(
        input_ids=None, inputs_embeds=None, attention_mask=mask, token_type_ids=None, is_tuple=is_tuple, causal=False,
        pixel_values=x, interpolate=interpolate, patch=p, grid=grid, num_prefix=prefix, accepts_interpolate=accepts,
    )


def image_extras(prepared: PreparedInputs, scores: Tensor) -> Dict[str, Tensor]:
    r"""For pixel inputs, the result extras ``patch_grid`` (B, H/p, W/p) of patch scores and ``patch_size``; else {}."""
    if not isinstance(prepared, PreparedImageInputs):
        return {}
    b = scores.shape[0]
    grid = scores[:, prepared.num_prefix :].reshape(b, *prepared.grid)
    return {
        "patch_grid": grid,
        "patch_size": torch.tensor(prepared.patch),
        "num_prefix_tokens": torch.tensor(prepared.num_prefix),
    }


def spread_over_pixels(patch_grid: Tensor, patch: int, channels: int, dtype: torch.dtype = None) -> Tensor:
    r"""(B, H/p, W/p) patch scores -> (B, C, H, W): each score divided evenly over its p * p * C pixel values.

    Args:
        patch_grid: (B, H/p, W/p).
        patch: p.
        channels: C.
        dtype: output dtype (default: the grid's).

    Returns:
        (B, C, H, W); summing a patch's p x p x C block gives its score back.
    """
    g = patch_grid / float(patch * patch * channels)
    g = g.repeat_interleave(patch, dim=1).repeat_interleave(patch, dim=2)
    out = g.unsqueeze(1).expand(-1, channels, -1, -1).contiguous()
    return out if dtype is None else out.to(dtype)


def pixel_attributions(inputs: Any, result: Any) -> Tensor:
    r"""The attributions in the shape of the inputs: pixels for images, the token scores otherwise.

    Args:
        inputs: what the caller passed to ``attribute`` (a tensor or a 1-tuple).
        result: the method's result (its ``extras`` hold ``patch_grid`` for images).

    Returns:
        (B, C, H, W) for pixel inputs (in the inputs' dtype); ``result.scores`` otherwise.
    """
    extras = getattr(result, "extras", None) or {}
    if "patch_grid" not in extras:
        return result.scores
    x = inputs[0] if isinstance(inputs, tuple) else inputs
    return spread_over_pixels(extras["patch_grid"], int(extras["patch_size"]), int(x.shape[1]), x.dtype).to(x.device)


__all__ = [
    "PreparedImageInputs",
    "image_extras",
    "num_prefix_tokens",
    "patch_size",
    "pixel_attributions",
    "prepare_pixel_values",
    "spread_over_pixels",
    "token_names",
]
