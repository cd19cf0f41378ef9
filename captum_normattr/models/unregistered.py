r"""Models the registry does not know: which registered descriptions have their parts, and the
line that registers one (named by :func:`~captum_normattr.models.adapters.get_adapter`'s error).

Nothing here runs a model: :func:`structural_candidates` matches module paths (about a millisecond);
:func:`~captum_normattr.attr.inference.infer_architecture` verifies a proposal on a probe input
and records it in :data:`VERIFIED_PROPOSALS`, which the error then names. Nothing is ever
registered from here (docs/architectures.md, "Does my model work?").
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from captum_normattr.arch.registry import ARCHITECTURES
from captum_normattr.arch.spec import ArchitectureSpec

__all__ = [
    "VERIFIED_PROPOSALS",
    "register_line",
    "find_path",
    "spec_paths",
    "structural_candidates",
    "unregistered_hint",
]


#: ``config.model_type`` -> (registry key, :func:`register_line`) of the description that
#: :func:`~captum_normattr.attr.inference.infer_architecture` verified for it in this session. Read by
#: :func:`get_adapter`'s error only (it names the line); nothing is ever registered from it.
VERIFIED_PROPOSALS: Dict[str, Tuple[str, str]] = {}


def register_line(key: str, model_type: str) -> str:
    r"""The one Python line that registers the description ``key`` for ``model_type``.

    Args:
        key: a registry key (:data:`~captum_normattr.arch.registry.ARCHITECTURES`).
        model_type: the model's ``config.model_type``.

    Returns:
        ``register_architecture(dataclasses.replace(ARCHITECTURES[key], model_types=(model_type,)), key=model_type)``
        (with ``import dataclasses`` and ``from captum_normattr.arch import ARCHITECTURES, register_architecture``).

    Examples::

        >>> register_line("llama", "my_llama")
        "register_architecture(dataclasses.replace(ARCHITECTURES['llama'], model_types=('my_llama',)), key='my_llama')"
    """
    return (f"register_architecture(dataclasses.replace(ARCHITECTURES[{key!r}], model_types=({model_type!r},)), "
            f"key={model_type!r})")


def find_path(root: Any, path: str) -> Optional[Any]:
    r"""Follow a dotted attribute path; ``None`` where a part is missing (never raises)."""
    for part in path.split("."):
        if not hasattr(root, part):
            return None
        root = getattr(root, part)
    return root


def spec_paths(spec: ArchitectureSpec) -> List[str]:
    r"""The module paths of one layer of ``spec`` (relative to the layer)."""
    paths: List[str] = []
    for _, branch in spec.layer.branches():
        if hasattr(branch, "module"):  # attention
            paths += [branch.module, branch.out] + ([branch.value.path] if branch.value is not None else [])
        else:
            paths += [p for p in (branch.up, branch.act, branch.down, branch.gate) if p]
    paths += [n.path for n in spec.norms()]
    return paths


def structural_candidates(model: nn.Module, specs: Optional[Sequence[str]] = None) -> List[str]:
    r"""Keys of the registered one-stack text descriptions whose parts ``model`` has (nothing is run).

    A description matches when its layer list exists with at least one layer, every module
    path of its layer (attention, output and value projections, feed-forward modules, norms)
    exists in the first layer, and its final norm (if any) exists. A match is a proposal only:
    :func:`~captum_normattr.attr.inference.infer_architecture` verifies it on a probe input.

    Args:
        model: a ``transformers`` model (unwrapped: :func:`~captum_normattr.models.adapters.unwrap_model`).
        specs: restrict to these registry keys (default: all).

    Returns:
        matching registry keys, in registry order, one per distinct description.

    Examples::

        >>> structural_candidates(my_llama_clone)[:2]
        ['llama', 'mistral']
    """
    base = getattr(model, "base_model", model)
    out, seen = [], set()
    for key, spec in ARCHITECTURES.items():
        if (specs is not None and key not in specs) or id(spec) in seen or spec.modality != "text":
            continue
        seen.add(id(spec))
        layers = find_path(base, spec.layers)
        if not isinstance(layers, (nn.ModuleList, list, tuple)) or len(layers) == 0:
            continue
        if not all(find_path(layers[0], p) is not None for p in spec_paths(spec)):
            continue
        if spec.head.final_norm is not None and find_path(base, spec.head.final_norm.path) is None:
            continue
        out.append(key)
    return out


def unregistered_hint(model: nn.Module, model_type: Optional[str]) -> str:
    r"""What the error for an unregistered model type says about the registered descriptions.

    A description :func:`~captum_normattr.attr.inference.infer_architecture` verified for this
    model type is named with the line that registers it. Otherwise the descriptions whose parts
    the model has are named as unverified proposals (a module-path match, about a millisecond):
    verifying them runs the model once per proposal (about 0.15 s each on a tiny build, a
    forward pass and a decomposition each on a real model), so the error does not run it and
    names ``infer_architecture(model)`` instead. Nothing is registered either way.
    """
    if model_type in VERIFIED_PROPOSALS:
        key, line = VERIFIED_PROPOSALS[model_type]
        return (f"infer_architecture(model) verified the registered description {key!r} for it (the model's own "
                "tensors and logit reproduced exactly); it is not applied silently: register it with\n"
                "    import dataclasses; from captum_normattr.arch import ARCHITECTURES, register_architecture\n"
                f"    {line}\n")
    try:
        keys = structural_candidates(model) if model_type is not None else []
    except Exception:  # noqa: BLE001 - the hint must never hide the error it belongs to
        keys = []
    if not keys:
        return "No registered description has its parts (layer list, attention and feed-forward modules, norms)."
    named = ", ".join(repr(k) for k in keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    return (f"Registered descriptions with its parts (not verified): {named}. Verify them with "
            "captum_normattr.infer_architecture(model): it runs each on a short probe input with the consistency "
            "guard and the logit check (a forward pass and a decomposition per description, so it is not run "
            "here) and names the one that reproduces the model exactly, with the line that registers it, e.g.\n"
            f"    {register_line(keys[0], model_type)}\n"
            "Nothing is registered silently.")
