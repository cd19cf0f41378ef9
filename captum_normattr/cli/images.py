r"""``captum-normattr --image PATH ... --model DIR``: Vision Transformers on the command line.

:func:`run_image_cli` loads the model and its image processor from a local folder, prints a
table of the most relevant patches per method, and with ``--plots DIR`` writes both pictures
of :mod:`captum_normattr.present.vision` per image and method.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import torch

from captum_normattr.present.vision import layer_patch_rows, patch_heatmap

__all__ = ["run_image_cli"]


def load_image_model(name: Optional[str], trust_remote_code: bool) -> Tuple[Any, Any]:
    r"""The image classifier and its image processor of a local folder, or a ``CLIError`` saying what is wrong.

    ``trust_remote_code`` (``--trust-remote-code``) is passed explicitly: a folder with its own code
    (``auto_map``) is refused without it, and transformers never prompts.
    """
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from captum_normattr.cli.common import CLIError, check_remote_code

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
    from captum_normattr.cli.common import CLIError, model_adapter
    from captum_normattr.cli.output import use_agg_backend
    from captum_normattr.tokens import visible_text

    model, processor = load_image_model(args.model, bool(getattr(args, "trust_remote_code", False)))
    adapter = model_adapter(model, f"--image: the model {args.model!r}")
    plots = Path(args.plots).expanduser() if getattr(args, "plots", None) else None
    if plots is not None:
        use_agg_backend()
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

