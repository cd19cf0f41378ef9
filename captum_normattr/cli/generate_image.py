r"""``captum-normattr generate --image FILE``: a vision-language model's generation explained, with the image's heat map.

The image is loaded with PIL and passed, with the prompt, through the model folder's own processor
(``AutoProcessor``; a folder without one is refused, naming the files it lacks). Every method
decomposes the language model once for all generated tokens
(:func:`~captum_normattr.attr.llm_images.decompose_image_input`); the image tokens' scores, summed
over the generated tokens, are spread over the image's pixels (:func:`pixel_heatmap`) and written as
a PNG next to the text output (:func:`write_heatmap_png`); the HTML report is the interactive page
with its image panel (:func:`interactive_image_panel`: the image, and each generated token's patch
grid drawn over it as the token is hovered), the PNGs embedded under it (:func:`html_with_images`).
See docs/cli.md, docs/vlm.md and docs/interactive.md.
"""
from __future__ import annotations

import base64
import io
import os
from typing import Any, Dict, List, Optional, Tuple

from captum_normattr.tokens import readable_tokens


class GenerateError(Exception):
    r"""A usage error of ``generate --image`` (the command prints it as its own usage errors, exit code 2)."""

__all__ = [
    "GenerateError",
    "explain_image_generation",
    "heatmap_paths",
    "heatmap_png_bytes",
    "html_with_images",
    "image_prompt",
    "interactive_image_panel",
    "load_image",
    "load_vision_language",
    "pixel_heatmap",
    "processor_fn",
    "write_heatmap_png",
]


def load_image(path: str) -> Any:
    r"""The image file as an RGB ``PIL.Image``.

    Raises:
        GenerateError: the file is missing or not an image PIL reads.
    """
    from PIL import Image, UnidentifiedImageError


    if not os.path.isfile(path):
        raise GenerateError(f"--image {path!r}: no such file")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise GenerateError(f"--image {path!r} is not an image PIL can read: {err}") from None


def load_vision_language(name: str, trust_remote_code: bool = False, dtype: Optional[str] = None,
                         device: str = "cpu") -> Tuple[Any, Any]:
    r"""(model in eval mode, processor) of a vision-language model folder (or Hub name).

    Raises:
        GenerateError: no processor in the folder (naming the files a processor is saved as), or a
            model that is not an image-text-to-text model the package describes.
    """
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from captum_normattr.cli.common import check_remote_code
    from captum_normattr.models.adapters import vision_language

    if os.path.isdir(name):
        from pathlib import Path

        from captum_normattr.cli.common import CLIError

        try:
            check_remote_code(Path(name), name, trust_remote_code)
        except CLIError as err:
            raise GenerateError(str(err)) from None
        if not any(os.path.isfile(os.path.join(name, f)) for f in ("processor_config.json", "preprocessor_config.json")):
            raise GenerateError(
                f"--image needs the model's processor: {name!r} has no processor_config.json or "
                "preprocessor_config.json (save it there with processor.save_pretrained(folder))")
    try:
        processor = AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise GenerateError(f"--image needs the model's processor; loading it from {name!r} failed: {err}") from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise GenerateError(f"{name!r}'s processor ({type(processor).__name__}) has no image processor and tokenizer; "
                            "--image needs a vision-language processor")
    try:
        model = AutoModelForImageTextToText.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise GenerateError(f"--image: {name!r} is not an image-text-to-text model: {err}") from None
    if vision_language(model) is None:
        raise GenerateError(f"--image: {type(model).__name__} is not a vision-language model the package describes "
                            "(LLaVA, Qwen2-VL: docs/vlm.md)")
    model = model.to(torch.device(device))
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    return model.eval(), processor


def image_prompt(processor: Any, prompt: str) -> str:
    r"""The prompt with the processor's image placeholder in front, unless it holds one already."""
    token = getattr(processor, "image_token", None) or "<image>"
    return prompt if token in prompt else f"{token} {prompt}"


def processor_fn(processor: Any, prompt: str, model: Any) -> Any:
    r"""A Captum ``processor_fn``: the image and the prompt through the processor, floats in the model's dtype."""
    dtype = next(model.parameters()).dtype

    def process(image: Any) -> Dict[str, Any]:
        out = dict(processor(images=image, text=prompt, return_tensors="pt"))
        return {k: (v.to(dtype) if hasattr(v, "is_floating_point") and v.is_floating_point() else v)
                for k, v in out.items()}

    return process


def pixel_heatmap(explanation: Any) -> Any:
    r"""(H, W) over the original image: the image tokens' scores summed over the explained tokens, each pixel
    its patch's score (NaN where no patch covers it; the grid's place from the explanation's ``box``).

    Args:
        explanation: an :class:`~captum_normattr.attr.llm_images.ImageGenerationExplanation`.
    """
    import torch

    from captum_normattr.attr.llm_images import pixel_patches

    grid = explanation.patch_attr.sum(0)
    image = explanation.inp.image
    hw = (image.size[1], image.size[0])
    where = pixel_patches(hw, tuple(grid.shape), explanation.box)
    flat = torch.cat([grid.reshape(-1).double().cpu(), torch.tensor([float("nan")], dtype=torch.float64)])
    return flat[torch.where(where >= 0, where, torch.full_like(where, flat.numel() - 1))]


def heatmap_png_bytes(explanation: Any, title: str = "") -> bytes:
    r"""The image in grey with the heat map over it (the package's diverging scale, symmetric), as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    heat = pixel_heatmap(explanation).numpy()
    m = float(np.nanmax(np.abs(heat))) if np.isfinite(heat).any() else 1.0
    fig, ax = plt.subplots(figsize=(4, 4))
    try:
        ax.imshow(np.asarray(explanation.inp.image).mean(axis=2), cmap="gray")
        shown = ax.imshow(heat, cmap="RdBu_r", vmin=-(m or 1.0), vmax=m or 1.0, alpha=0.6)
        fig.colorbar(shown, ax=ax, fraction=0.046)
        ax.set_title(title, fontsize=9)
        ax.axis("off")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight", dpi=100)
    finally:
        plt.close(fig)
    return buf.getvalue()


def write_heatmap_png(explanation: Any, path: str, title: str = "") -> str:
    r"""Write :func:`heatmap_png_bytes` to ``path``; returns the path."""
    with open(path, "wb") as f:
        f.write(heatmap_png_bytes(explanation, title))
    return path


def html_with_images(page: str, images: List[Tuple[str, bytes]]) -> str:
    r"""The HTML page with each (caption, PNG) as an ``<img>`` data URI before ``</body>``."""
    import html

    figs = "".join(
        f"<figure style='display:inline-block;margin:1em'><img alt='{html.escape(c)}' "
        f"src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'><figcaption>{html.escape(c)}"
        "</figcaption></figure>" for c, png in images)
    block = f"<section id='image-heatmaps'><h2>Image heat maps</h2>{figs}</section>"
    at = page.rfind("</body>")
    return page + block if at < 0 else page[:at] + block + page[at:]


def interactive_image_panel(page: str, found: List[Tuple[str, Any]], caption: str = "") -> str:
    r"""The interactive report with its image panel: the image, and each method's patch grid per generated token
    drawn over it as the tokens are hovered (:func:`~captum_normattr.present.interactive_images.add_image_panel`).

    Args:
        page: :func:`~captum_normattr.cli.generate.render_html` of the record.
        found: [(method key, :class:`~captum_normattr.attr.llm_images.ImageGenerationExplanation`), ...] (the
            second value of :func:`explain_image_generation`); the page's maps are named by ``ex.method``.
        caption: a line under the image (plain text).

    Returns:
        The HTML text.

    Examples::

        >>> record, found = explain_image_generation(args)
        >>> page = interactive_image_panel(render_html(record), found, caption="cat.png")
    """
    from captum_normattr.present.interactive_images import add_image_panel

    if not found:
        return page
    first = found[0][1]
    grids = {ex.details.method: ex.patch_attr for _, ex in found}
    return add_image_panel(page, first.inp.image, grids, box=first.box, caption=caption)


def explain_image_generation(args: Any) -> Tuple[Dict[str, Any], List[Tuple[str, Any]]]:
    r"""``generate --image``: load, generate (or take ``--target-text``), explain with every method.

    Returns:
        (the JSON-able record, as the text route's, with an ``"image"`` entry; [(method, explanation), ...]).
    """
    import torch
    from captum.attr._utils.interpretable_input import ImageMaskInput

    from captum_normattr.attr.llm import DecompositionLLMAttribution
    from captum_normattr.attr.methods import get_method

    unused = [o for o, on in (("--chat", args.chat), ("--skip-special", args.skip_special),
                              ("--quantity", args.quantity != "logit"), ("--foil", args.foil is not None)) if on]
    if unused:
        raise GenerateError(f"--image explains the target logits of the prompt as given: {', '.join(unused)} not "
                            "supported with --image yet (put the processor's chat text in the prompt itself)")
    image = load_image(args.image)
    model, processor = load_vision_language(args.model, args.trust_remote_code, args.dtype, args.device)
    tok = processor.tokenizer
    prompt = image_prompt(processor, args.prompt)
    inp = ImageMaskInput(image, processor_fn=processor_fn(processor, prompt, model))
    if args.target_text is not None:
        target: Any = args.target_text
    else:
        if args.max_new_tokens < 1:
            raise GenerateError("--max-new-tokens must be at least 1")
        feed = {k: v.to(next(model.parameters()).device) for k, v in inp.to_model_input().items()}
        with torch.no_grad():
            out = model.generate(**feed, max_new_tokens=args.max_new_tokens, do_sample=False)
        target = out[0, feed["input_ids"].shape[1]:].cpu()
        if target.numel() == 0:
            raise GenerateError("the model generated no token")
    record: Dict[str, Any] = {"model": args.model, "prompt": prompt, "exclude_sink": bool(args.exclude_sink),
                              "methods": {}, "image": {"file": os.path.basename(args.image), "methods": {}}}
    found: List[Tuple[str, Any]] = []
    for key in args.method:
        spec = get_method(key)
        try:
            llm = DecompositionLLMAttribution(spec.build(model), tok)
            ex = llm.decompose(inp, target=target)
        except (ValueError, TypeError) as err:
            raise GenerateError(f"{key}: {err}") from None
        found.append((key, ex))
        if "tokens" not in record:
            tokens = tok.convert_ids_to_tokens(ex.input_ids.tolist())
            record.update(tokens=tokens, token_text=readable_tokens(tok, ex.input_ids.tolist()), prompt_length=ex.prompt_length,
                          generated=list(ex.output_tokens), generated_ids=ex.target_ids.tolist(), sink_index=0)
        d = ex.details
        signed = bool(d.signed)
        sink = ex.scores[:, 0].abs() / ex.scores.abs().sum(-1).clamp_min(1e-300)
        record["methods"][d.method] = {
            "key": key, "signed": signed, "quantity": d.quantity if signed else "rollout",
            "rows": ex.scores.tolist(),
            "explained": None if d.explained is None else d.explained.tolist(),
            "no_token": None if d.no_token is None else d.no_token.tolist(),
            "delta": None if d.delta is None else d.delta.tolist(),
            "log_probs": None if d.log_probs is None else d.log_probs.tolist(),
            "sink_share": sink.tolist(),
            "token_attr": ex.scores[:, :ex.prompt_length].tolist(),
            "input_features": tokens[:ex.prompt_length], "seq_attr": ex.scores[:, :ex.prompt_length].sum(0).tolist(),
        }
        record["image"]["methods"][d.method] = {
            "patch_attr": ex.patch_attr.tolist(), "image_total": ex.image_total.tolist(),
            "text_total": ex.text_total.tolist(), "box": list(ex.box),
        }
    return record, found


def heatmap_paths(args: Any, found: List[Tuple[str, Any]]) -> Dict[str, str]:
    r"""Where the PNGs go: next to ``-o`` (``OUT.METHOD.heatmap.png``), else next to the image."""
    base = args.output if args.output else args.image
    stem = os.path.splitext(base)[0]
    return {key: f"{stem}.{key}.heatmap.png" for key, _ in found}
