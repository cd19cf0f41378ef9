r"""Pictures and the command line for Vision Transformers (ViT, DeiT, DINOv2).

- :func:`patch_heatmap`: the patch scores of one image as a heat map blended over the image.
- :func:`layer_patch_rows`: the per-layer maps of one token's row (which patches it takes
  from, layer by layer) as patch grids.
- :func:`run_image_cli`: ``captum-normattr --image PATH ... --model DIR``: the model and its
  image processor from a local folder, a table of the most relevant patches per method,
  and with ``--plots DIR`` both pictures per image and method.

Matplotlib is needed for the pictures (``pip install matplotlib``).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor


def image_for_display(pixel_values: Tensor) -> Tensor:
    r"""(C, H, W) pixel values (any normalisation) -> (H, W, C) in [0, 1], min-max scaled per image."""
    x = pixel_values.detach().float().cpu()
    x = (x - x.min()) / (x.max() - x.min()).clamp_min(1e-12)
    x = x.permute(1, 2, 0)
    return x.expand(-1, -1, 3) if x.shape[-1] == 1 else x


def patch_heatmap(
    pixel_values: Tensor,
    patch_grid: Tensor,
    ax: Any = None,
    alpha: float = 0.5,
    cmap: Optional[str] = None,
    title: Optional[str] = None,
):
    r"""The patch scores of one image as a heat map blended over the image.

    Args:
        pixel_values: (C, H, W) the image as the model saw it.
        patch_grid: (H/p, W/p) patch scores (``result.extras["patch_grid"][b]``).
        ax: a matplotlib axis (a new figure if None).
        alpha: opacity of the heat map.
        cmap: colormap; default ``"bwr"`` (centred at 0) for signed scores, ``"viridis"`` otherwise.
        title: axis title.

    Returns:
        The matplotlib figure.

    Examples::

        >>> res = DecompXAttribution(model).decompose(pixel_values)
        >>> fig = patch_heatmap(pixel_values[0], res.extras["patch_grid"][0], title="DecompX")
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(4, 4))
    fig = ax.figure
    img = image_for_display(pixel_values)
    g = patch_grid.detach().float().cpu()
    h, w = img.shape[:2]
    signed = bool((g < 0).any())
    lim = float(g.abs().max()) or 1.0
    ax.imshow(img.numpy())
    im = ax.imshow(
        g.numpy(), cmap=cmap or ("bwr" if signed else "viridis"), alpha=alpha, extent=(0, w, h, 0),
        interpolation="nearest", vmin=-lim if signed else float(g.min()), vmax=lim,
    )
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_axis_off()
    if title:
        ax.set_title(title)
    return fig


def layer_patch_rows(
    layer_maps: Tensor, row: int, grid: Tuple[int, int], num_prefix: int, cmap: str = "viridis", title: Optional[str] = None
):
    r"""The per-layer maps of one token's row as patch grids, one panel per layer.

    Args:
        layer_maps: (L, T, T) one example's layer maps (``result.layer_maps[b]``).
        row: the receiving token (0 = [CLS]; patch (r, c) is ``num_prefix + r * W/p + c``).
        grid: (H/p, W/p).
        num_prefix: tokens before the first patch (``result.extras["num_prefix_tokens"]``).
        cmap: colormap.
        title: figure title.

    Returns:
        The matplotlib figure; the panel titles give the share of the row's total that goes
        to the prefix tokens ([CLS], distillation, registers), which the grids do not show.
    """
    import matplotlib.pyplot as plt

    maps = layer_maps.detach().float().cpu()
    n = maps.shape[0]
    cols = min(n, 6)
    rows_ = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows_, cols, figsize=(2.2 * cols, 2.3 * rows_), squeeze=False)
    for l in range(rows_ * cols):
        ax = axes[l // cols][l % cols]
        ax.set_axis_off()
        if l >= n:
            continue
        r = maps[l, row]
        ax.imshow(r[num_prefix:].reshape(grid).numpy(), cmap=cmap, interpolation="nearest")
        total = float(r.sum())
        share = float(r[:num_prefix].sum()) / total if total else 0.0
        ax.set_title(f"layer {l + 1} (prefix {share:.0%})", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _load_image_model(name: Optional[str], trust_remote_code: bool) -> Tuple[Any, Any]:
    r"""The image classifier and its image processor of a local folder, or a ``CLIError`` saying what is wrong.

    ``trust_remote_code`` (``--trust-remote-code``) is passed explicitly: a folder with its own code
    (``auto_map``) is refused without it, and transformers never prompts.
    """
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from captum_normattr.cli_common import CLIError, check_remote_code

    if not name:
        raise CLIError("--image needs --model DIR: a local folder with an image classifier and its image processor")
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise CLIError(f"model folder not found: {name}" if not folder.exists() else
                       f"model path {name!r} is a file; give a model folder (with config.json)")
    if not (folder / "config.json").exists():
        raise CLIError(f"model folder {name!r} has no config.json")
    check_remote_code(folder, name, trust_remote_code)
    kwargs = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    try:
        model = AutoModelForImageClassification.from_pretrained(str(folder), **kwargs).eval()
    except Exception as err:  # noqa: BLE001 - a text model, broken weights ...: one line, exit code 2
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CLIError(f"--image needs an image classifier (ViT, DeiT, DINOv2 ...); cannot load {name!r} as one: "
                       f"{first}") from None
    try:
        processor = AutoImageProcessor.from_pretrained(str(folder), **kwargs)
    except Exception as err:  # noqa: BLE001
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CLIError(f"cannot load the image processor of {name!r} (preprocessor_config.json): {first}") from None
    return model, processor


def run_image_cli(args: Any, specs: Sequence[Any]) -> int:
    r"""``captum-normattr --image PATH [PATH ...] --model DIR -m METHOD ...``.

    Loads ``AutoModelForImageClassification`` and ``AutoImageProcessor`` from ``--model``
    (a local folder; nothing is downloaded), explains every image with every method (target:
    ``--target`` or the predicted class), prints the [CLS]-and-prefix scores and the five
    most relevant patches, and with ``--plots DIR`` writes ``<image>_<method>_heatmap`` and
    ``<image>_<method>_layers`` pictures (the per-layer rows of [CLS]).

    Returns:
        The exit code (0).
    """
    from PIL import Image, UnidentifiedImageError

    from captum_normattr.attr.images import token_names
    from captum_normattr.cli_common import CLIError
    from captum_normattr.models.adapters import get_adapter
    from captum_normattr.tokens import visible_text

    model, processor = _load_image_model(args.model, bool(getattr(args, "trust_remote_code", False)))
    try:
        adapter = get_adapter(model)
    except (ValueError, TypeError, NotImplementedError) as err:
        raise CLIError(f"--image: the model {args.model!r} cannot be explained: {err}") from None
    plots = Path(args.plots).expanduser() if getattr(args, "plots", None) else None
    if plots is not None:
        import matplotlib

        matplotlib.use("Agg")
        plots.mkdir(parents=True, exist_ok=True)
    labels = getattr(model.config, "id2label", {}) or {}
    out = sys.stdout
    for path in args.image:
        try:
            image = Image.open(path).convert("RGB" if getattr(model.config, "num_channels", 3) == 3 else "L")
        except (OSError, UnidentifiedImageError) as err:
            raise CLIError(f"cannot read the image {path}: {getattr(err, 'strerror', None) or err}") from None
        x = processor(images=image, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            pred = int(model(pixel_values=x).logits.argmax(-1))
        target = args.target if args.target is not None else pred
        label = labels.get(pred, labels.get(str(pred), pred))  # the model config's text: neutralised for the terminal
        print(visible_text(f"{path}: predicted {pred} ({label}), explained class {target}"), file=out)
        for spec in specs:
            try:
                attr = spec.build(model, args)
                res = attr.decompose(x, target=target) if spec.uses_target else attr.decompose(x)
            except (ValueError, TypeError, NotImplementedError) as err:
                raise CLIError(f"method {spec.key!r} cannot explain {path}: {err}") from None
            grid = res.extras["patch_grid"][0]
            prefix = int(res.extras["num_prefix_tokens"])
            names = token_names(model, adapter, tuple(grid.shape))
            s = res.scores[0]
            top = torch.argsort(s[prefix:], descending=True)[:5] + prefix
            pre = ", ".join(f"{names[i]} {float(s[i]):+.4f}" for i in range(prefix))
            best = ", ".join(f"{names[i]} {float(s[i]):+.4f}" for i in top.tolist())
            print(visible_text(f"  {attr.get_name():12s} {pre}; top patches: {best}"), file=out)
            if plots is not None:
                import matplotlib.pyplot as plt

                stem = f"{Path(path).stem}_{spec.key}"
                fig = patch_heatmap(x[0], grid, title=attr.get_name())
                fig.savefig(plots / f"{stem}_heatmap.{args.plot_format}")
                plt.close(fig)
                maps = getattr(res, "layer_maps", None)
                if maps is not None:
                    fig = layer_patch_rows(maps[0], 0, tuple(grid.shape), prefix, title=f"{attr.get_name()}: [CLS] row")
                    fig.savefig(plots / f"{stem}_layers.{args.plot_format}")
                    plt.close(fig)
    return 0


__all__ = ["image_for_display", "layer_patch_rows", "patch_heatmap", "run_image_cli"]
