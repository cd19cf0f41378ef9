r"""Short labels the pages show: the model's readable name (never an absolute path)."""
from __future__ import annotations

from pathlib import PurePath
from typing import Any, Optional

__all__ = ["model_display_name"]


def model_display_name(model: Any = None, name_or_path: Optional[str] = None) -> str:
    r"""The model's name as a page shows it: a Hub name as it is, a folder by its last part.

    A folder of the Hugging Face cache (``.../models--Org--Name/snapshots/<hash>``) is shown
    as ``Org/Name``; any other local folder by its base name; a Hub name (``Org/Name``) as it
    is. With a model and no name, its ``config._name_or_path`` is read.

    Args:
        model: a model (its ``config._name_or_path`` is the default name), or None.
        name_or_path: what the user passed (``--model``), or None.

    Returns:
        The label ("model" when nothing is known).

    Examples:
        >>> model_display_name(name_or_path="/opt/hf/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/12ab")
        'HuggingFaceTB/SmolLM2-135M'
        >>> model_display_name(name_or_path="/data/models/tiny_llama/")
        'tiny_llama'
        >>> model_display_name(name_or_path="gpt2")
        'gpt2'
    """
    name = name_or_path
    if name is None and model is not None:
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        return "model"
    name = str(name).rstrip("/\\")
    parts = PurePath(name).parts
    for part in reversed(parts):
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    looks_local = name.startswith(("/", "~", ".", "\\")) or (len(name) > 1 and name[1] == ":") or len(parts) > 2
    return parts[-1] if (looks_local and parts) else name
