r"""A vision-language model's image tokens split into its images: the one walk every image geometry shares.

The image tokens of a batch (the ids equal to the image token's) are read example by example, left to right, and
cut into whole images, each as many tokens as its geometry says (:mod:`captum_normattr.attr.vlm_regions`'s grids,
:mod:`captum_normattr.attr.vlm_anyres`'s base views, tiles and newlines).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from torch import Tensor

__all__ = ["split_images"]


def split_images(scores: Tensor, image_mask: Tensor, tokens: Callable[[int], int],
                 describe: Callable[[int], str]) -> List[Tuple[int, Tensor]]:
    r"""Every image's tokens' scores, in the model's order of images.

    Args:
        scores: (B, T) or (B, ..., T) per-token scores (the middle axes are kept).
        image_mask: (B, T) bool, the image tokens.
        tokens: image index -> its number of tokens (it may raise ValueError for an image past the last).
        describe: image index -> a few words on its geometry, for the error message.

    Returns:
        (example, (..., tokens) scores) per image.

    Raises:
        ValueError: a mask that is not (B, T) of the scores, or tokens that do not split into whole images.

    Examples:
        >>> ids = torch.tensor([[1, 9, 9, 9, 9, 5]])
        >>> [(b, p.tolist()) for b, p in split_images(torch.arange(6.0)[None], ids == 9, lambda i: 2, str)]
        [(0, [1.0, 2.0]), (0, [3.0, 4.0])]
    """
    if image_mask.shape != (scores.shape[0], scores.shape[-1]):
        raise ValueError(f"the image-token mask {tuple(image_mask.shape)} must be (B, T) of the scores "
                         f"{tuple(scores.shape)}")
    out: List[Tuple[int, Tensor]] = []
    for b in range(scores.shape[0]):
        found = scores[b][..., image_mask[b].to(scores.device)]
        start = 0
        while start < found.shape[-1]:
            n = tokens(len(out))
            if start + n > found.shape[-1]:
                raise ValueError(
                    f"example {b} has {found.shape[-1] - start} image tokens left for image {len(out)}, which needs {n} "
                    f"({describe(len(out))}): the ids do not hold whole images of this model")
            out.append((b, found[..., start:start + n]))
            start += n
    return out
