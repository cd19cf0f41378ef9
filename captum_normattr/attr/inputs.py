r"""Validation of what users pass to ``attribute``/``decompose``: clear errors, never silent numbers."""
from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.models.prepared import PreparedInputs, single_input
from captum_normattr.arch.spec import ArchitectureSpec, UnsupportedModelError
from captum_normattr.models.adapters import base_model, language_config, max_positions, vision_language
from captum_normattr.models.weights import input_device
from captum_normattr.options import check_explained_position

__all__ = [
    "FORWARD_KEYWORDS",
    "check_target_is_not_forward_args",
    "explained_positions",
    "has_gaps",
    "is_integer",
    "model_inputs",
    "positional_token_types",
    "prepare_inputs",
    "require_images",
    "split_forward_args",
    "warn_if_padded",
]


#: The keyword form of ``additional_forward_args``: the model inputs it may name.
FORWARD_KEYWORDS: Tuple[str, ...] = ("attention_mask", "token_type_ids", "position_ids")

_KEYWORD_FORM = (
    "pass the model's inputs by name instead: additional_forward_args={'attention_mask': mask, "
    "'token_type_ids': types, 'position_ids': positions} (any of them; a tokenizer's output works too)"
)


def positional_token_types(model: nn.Module, adapter: ArchitectureSpec) -> bool:
    r"""Whether the positional form ``(attention_mask, token_type_ids)`` cannot be misread for this model.

    True for a bidirectional text encoder with a token-type embedding (``config.type_vocab_size``,
    BERT-like: its forward's third argument is ``token_type_ids``). A causal LM is refused: the
    natural guess ``(mask, position_ids)`` would be read as token types (GPT-2 embeds token
    types with its word embeddings), so its extras must be given by name.
    """
    config = language_config(model)
    return (not adapter.causal and adapter.inputs.token_types == "embedding"
            and int(getattr(config, "type_vocab_size", 0) or 0) > 0)


def _takes(model: nn.Module, name: str) -> bool:
    r"""Whether the base model's forward takes the keyword ``name`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(base_model(model).forward).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def split_forward_args(
    additional_forward_args: Any, model: nn.Module, adapter: ArchitectureSpec, inputs: Optional[Tensor] = None
) -> Dict[str, Optional[Tensor]]:
    r"""The model inputs of ``additional_forward_args``, by name: ``attention_mask``, ``token_type_ids``, ``position_ids``.

    Two forms are read. By name (the documented form for everything beyond the mask): a
    mapping ``{"attention_mask": mask, "token_type_ids": types, "position_ids": positions}``
    (any subset; a tokenizer's ``BatchEncoding`` works, its ``input_ids`` must then be the
    ``inputs``). Positionally (Captum's form): the mask ``(B, T)`` or ``(mask,)``, and
    ``(mask, token_type_ids)`` only for a model where it cannot be misread
    (:func:`positional_token_types`); every other positional extra is refused with a message
    naming the keyword form (``(mask, position_ids)`` to GPT-2 used to explain
    ``model(token_type_ids=positions)``).

    Args:
        additional_forward_args: what the caller passed.
        model: the model (its forward's keywords, its config).
        adapter: its description.
        inputs: the token ids, to check a mapping's ``input_ids`` against.

    Returns:
        ``{name: tensor or None}`` for the three names, and the further inputs a vision-language
        model's description names (:func:`model_inputs`: ``pixel_values``, ...) where given.

    Raises:
        ValueError / TypeError: naming the keyword form.
        UnsupportedModelError: an input the vision-language description refuses, with why
            (:attr:`~captum_normattr.arch.families.vlm.VisionLanguage.refused`).

    Examples:
        >>> split_forward_args({"attention_mask": mask, "position_ids": pos}, model, adapter)["position_ids"] is pos
        True
    """
    got: Dict[str, Optional[Tensor]] = {k: None for k in FORWARD_KEYWORDS}
    extras = additional_forward_args
    if isinstance(extras, (tuple, list)) and len(extras) == 1 and isinstance(extras[0], Mapping):
        extras = extras[0]  # a mapping wrapped by Captum (a 1-tuple)
    if extras is None:
        return got
    if isinstance(extras, Tensor):
        got["attention_mask"] = extras
        return got
    if isinstance(extras, Mapping):
        description = vision_language(model)
        for name, why in (() if description is None else description.refused):
            if extras.get(name) is not None:
                raise UnsupportedModelError(f"captum_normattr cannot attribute {description.family} with {name}: {why}.")
        further = model_inputs(model)
        unknown = sorted(str(k) for k in extras if k not in FORWARD_KEYWORDS + further and k != "input_ids")
        if unknown:
            raise ValueError(f"additional_forward_args names {unknown}; the model inputs it may name are "
                             f"{list(FORWARD_KEYWORDS + further)} (the token ids are the inputs)")
        for k in further:
            v = extras.get(k)
            if v is not None and not isinstance(v, Tensor):
                raise TypeError(f"additional_forward_args['{k}'] must be a tensor or None, got {type(v).__name__}")
            if v is not None:
                got[k] = v
        ids = extras.get("input_ids")
        if ids is not None and not (inputs is not None and isinstance(ids, Tensor) and tuple(ids.shape) == tuple(
                inputs.shape) and bool((ids.to(inputs.device) == inputs).all())):
            raise ValueError("additional_forward_args['input_ids'] is not the inputs: pass the token ids as inputs and "
                             "the other model inputs by name")
        for k in FORWARD_KEYWORDS:
            v = extras.get(k)
            if v is not None and not isinstance(v, Tensor):
                raise TypeError(f"additional_forward_args['{k}'] must be a tensor or None, got {type(v).__name__}")
            got[k] = v
        for k in ("token_type_ids", "position_ids"):
            if got[k] is not None and not _takes(model, k):
                raise ValueError(f"the {adapter.family} model's forward takes no {k}")
        return got
    if isinstance(extras, (tuple, list)):
        items = list(extras)
        for e in items:
            if e is not None and not isinstance(e, Tensor):
                raise TypeError(f"additional_forward_args must hold tensors or None, got {type(e).__name__}")
        if len(items) > 2 or (len(items) == 2 and items[1] is not None and not positional_token_types(model, adapter)):
            why = ("a second positional item would be read as token_type_ids" if len(items) == 2 else
                   f"got a sequence of {len(items)} items")
            raise ValueError(
                f"additional_forward_args of the {adapter.family} model takes the attention mask as its only positional "
                f"item ({why}, not position_ids); {_KEYWORD_FORM}"
            )
        items += [None] * (2 - len(items))
        got["attention_mask"], got["token_type_ids"] = items[0], items[1]
        return got
    raise TypeError(
        "additional_forward_args must be the attention_mask (B, T), a tuple (attention_mask,), or a mapping of model "
        f"inputs by name; got {type(additional_forward_args).__name__}. {_KEYWORD_FORM[0].upper()}{_KEYWORD_FORM[1:]}"
    )


def model_inputs(model: nn.Module) -> Tuple[str, ...]:
    r"""The model inputs ``additional_forward_args`` may name besides :data:`FORWARD_KEYWORDS`.

    A vision-language model's own inputs (``pixel_values``, ...: its description's
    :attr:`~captum_normattr.arch.families.vlm.VisionLanguage.inputs`), passed to its forward
    unchanged; none for a text model.
    """
    description = vision_language(model)
    return () if description is None else tuple(description.inputs)


def _check_position_ids(position_ids: Tensor, model: nn.Module, adapter: ArchitectureSpec, shape) -> Tensor:
    r"""Position ids as long, after checking shape, dtype and range (0 to the model's position limit)."""
    if tuple(position_ids.shape) != tuple(shape):
        raise ValueError(f"position_ids must have shape {tuple(shape)} (one per token); got {tuple(position_ids.shape)}")
    if not is_integer(position_ids):
        raise TypeError(f"position_ids must be an integer tensor; got dtype {position_ids.dtype}")
    lo, hi = int(position_ids.min()), int(position_ids.max())
    limit = max_positions(model, adapter)
    if lo < 0 or (limit is not None and hi >= limit):
        top = f"{limit - 1} (the model's position limit)" if limit is not None else "any"
        raise ValueError(f"position_ids must lie in [0, {top}]; got values in [{lo}, {hi}]")
    return position_ids.to(dtype=torch.long)


def prepare_inputs(
    model: nn.Module,
    adapter: ArchitectureSpec,
    inputs: Union[Tensor, Tuple[Tensor, ...]],
    additional_forward_args: Any = None,
) -> PreparedInputs:
    r"""Check token ids (or embeddings), attention mask and token types against the model.

    Args:
        model: the model to be explained.
        adapter: its adapter.
        inputs: token ids (B, T) of an integer dtype, or input word embeddings (B, T, D)
            of a float dtype; or a 1-tuple holding one of them.
        additional_forward_args: attention_mask (B, T), or (attention_mask,), or the model
            inputs by name ``{"attention_mask": ..., "token_type_ids": ..., "position_ids": ...}``
            (:func:`split_forward_args`; ``(attention_mask, token_type_ids)`` positionally only
            where it cannot be misread); None means no padding.

    Returns:
        :class:`PreparedInputs` on the model's device; ``two_way`` where a vision-language model's
        ``token_type_ids`` make its decoder attend two-way over part of the sequence
        (:attr:`~captum_normattr.arch.families.vlm.VisionLanguage.two_way`, docs/vlm.md).

    Raises:
        ValueError / TypeError with a message saying what to change.
    """
    if adapter.modality == "image":  # Vision Transformers: pixel values (B, C, H, W)
        from captum_normattr.attr.images import prepare_pixel_values

        return prepare_pixel_values(model, adapter, inputs, additional_forward_args)
    inputs, is_tuple = single_input(inputs, "token ids", "(B, T)")
    device = input_device(model, inputs)  # a model dispatched by accelerate: the inputs' device
    config = language_config(model)  # a vision-language model's decoder config
    if inputs.is_floating_point():
        if inputs.dim() != 3:
            raise TypeError(
                f"token ids must be an integer tensor (B, T); got {inputs.dtype} of shape {tuple(inputs.shape)}. "
                "Pass word embeddings as a float tensor (B, T, D) instead if you need a float input (e.g. NoiseTunnel)."
            )
        hidden = getattr(config, "embedding_size", None) or config.hidden_size
        if inputs.shape[-1] != hidden:
            raise ValueError(f"input embeddings must have {hidden} features, got {inputs.shape[-1]}")
        ids, embeds = None, inputs.to(device=device, dtype=next(model.parameters()).dtype)
    elif is_integer(inputs):
        if inputs.dim() == 1:
            raise ValueError(f"token ids must be a batch (B, T); got shape {tuple(inputs.shape)} — use ids.unsqueeze(0)")
        if inputs.dim() != 2:
            raise ValueError(f"token ids must have shape (B, T); got {tuple(inputs.shape)}")
        ids, embeds = inputs.to(device=device, dtype=torch.long), None
    else:
        raise TypeError(f"token ids must be an integer tensor (B, T); got dtype {inputs.dtype}")

    b, t = int(inputs.shape[0]), int(inputs.shape[1])
    if b == 0 or t == 0:
        raise ValueError(f"inputs are empty (shape {tuple(inputs.shape)}): give at least one token per example")
    if ids is not None:
        lo, hi = int(ids.min()), int(ids.max())
        vocab = int(config.vocab_size)
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab - 1}] (the model's vocabulary); got values in [{lo}, {hi}]")
    limit = max_positions(model, adapter)
    if limit is not None and t > limit:
        raise ValueError(f"input has {t} tokens but the model accepts at most {limit}; truncate it (tokenizer truncation=True)")

    given = split_forward_args(additional_forward_args, model, adapter, ids)
    mask, token_types, position_ids = given["attention_mask"], given["token_type_ids"], given["position_ids"]
    if mask is None:
        if ids is not None:
            warn_if_padded(ids, config)
        mask = torch.ones(b, t, dtype=torch.long, device=device)
    else:
        if tuple(mask.shape) != (b, t):
            raise ValueError(f"attention_mask must have the shape of the token ids {(b, t)}; got {tuple(mask.shape)}")
        if not (mask.is_floating_point() or mask.dtype == torch.bool or is_integer(mask)):
            raise TypeError(f"attention_mask must be an integer, bool or float tensor of 0s and 1s; got dtype {mask.dtype}")
        if not mask.is_floating_point():
            mask = mask.to(torch.long)  # any integer dtype or bool: compare in one dtype
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")
        mask = mask.to(device=device, dtype=torch.long)
        empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"example(s) {empty} have no tokens (attention_mask all 0)")
    if token_types is not None:
        token_types = _check_token_types(token_types, model, adapter, (b, t), mask).to(device=device)
    if position_ids is not None:
        position_ids = _check_position_ids(position_ids, model, adapter, (b, t)).to(device=device)
    if adapter.causal and has_gaps(mask):
        raise ValueError("attention_mask of a decoder must be one contiguous block of 1s (left or right padding)")
    finite = torch.ones(b, dtype=torch.bool, device=device)
    if embeds is not None:
        finite = (torch.isfinite(embeds) | ~mask.bool()[..., None]).flatten(1).all(1)
    further = {k: v.to(device=device) for k, v in given.items() if k not in FORWARD_KEYWORDS and v is not None}
    description = vision_language(model)
    two_way = description is not None and description.two_way is not None and (
        token_types if description.two_way_input == "token_type_ids" else further.get(description.two_way_input)
    ) is not None
    if two_way and description.two_way_config is not None:  # the types open the attention only under this config
        two_way = getattr(config, description.two_way_config[0], None) == description.two_way_config[1]
    if description is not None and ids is not None:
        require_images(model, ids, mask.bool(), further)
    return PreparedInputs(ids, embeds, mask, token_types, is_tuple, adapter.causal, _takes_use_cache(model), finite,
                          position_ids, further, description is not None and description.positions == "model", two_way)


def require_images(model: nn.Module, ids: Tensor, valid: Tensor, further: Dict[str, Any]) -> None:
    r"""Refuse token ids holding a vision-language model's image (or video) tokens without their ``pixel_values``
    (``pixel_values_videos``).

    The model would run its decoder on the placeholder tokens' own embeddings, and every method would explain that
    forward pass, not the one with the image: a silent wrong answer to the question the caller asked.

    Args:
        model: the vision-language model.
        ids: (B, T) the token ids.
        valid: (B, T) the real tokens (pads are not checked).
        further: the model's further inputs by name, as given.

    Raises:
        ValueError: image (video) tokens and no ``pixel_values`` (``pixel_values_videos``).
    """
    description = vision_language(model)
    config = model.config
    for names, pixels, what in ((description.image_token, "pixel_values", "image"),
                                (description.video_token, "pixel_values_videos", "video")):
        if further.get(pixels) is not None:
            continue
        token = next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
        if token is not None and bool((ids[valid] == int(token)).any()):
            raise ValueError(f"the token ids hold {description.family}'s {what} tokens (id {int(token)}) but no {pixels} "
                             f"were given: pass the processor's outputs by name, additional_forward_args="
                             f"{{'attention_mask': ..., '{pixels}': ..., ...}} (docs/vlm.md), or the explanation would be "
                             f"of the model without the {what}")


def is_integer(t: Tensor) -> bool:
    r"""True for a tensor of any integer dtype (signed or unsigned; not bool, float or complex)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def warn_if_padded(ids: Tensor, config) -> None:
    r"""Warn, as transformers does, when ids without an attention mask start or end with the pad token.

    The package builds an all-ones mask when none is given, which hides transformers' own
    warning; the pads are then attended to as tokens.
    """
    pad = getattr(config, "pad_token_id", None)
    if pad is None or ids.numel() == 0:
        return
    if bool((ids[:, [0, -1]] == int(pad)).any()):
        warnings.warn(
            f"the token ids contain the pad token ({int(pad)}) at an end but no attention_mask was given: every "
            "position is treated as a real token. Pass the tokenizer's attention_mask (additional_forward_args=(mask,)); "
            "ignore this if the pad token is also a real token of your input (e.g. it equals BOS/EOS/SEP).",
            UserWarning,
            stacklevel=3,
        )


def _takes_use_cache(model: nn.Module) -> bool:
    r"""True when the base model's forward names ``use_cache`` and the top model's passes it on.

    (The top model names it too or takes ``**kwargs``, as ``BertForSequenceClassification``.)
    """
    try:
        base = inspect.signature(base_model(model).forward).parameters
        top = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    passes_on = "use_cache" in top or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in top.values())
    return "use_cache" in base and passes_on


def _check_token_types(token_types: Tensor, model: nn.Module, adapter: ArchitectureSpec, shape, mask: Tensor) -> Tensor:
    r"""Token types as long, after checking shape, dtype and range against the model's token-type embedding."""
    if tuple(token_types.shape) != tuple(shape):
        raise ValueError(f"token_type_ids must have shape {tuple(shape)}; got {tuple(token_types.shape)}")
    if token_types.is_floating_point() or token_types.is_complex() or token_types.dtype == torch.bool:
        raise TypeError(f"token_type_ids must be an integer tensor; got dtype {token_types.dtype}")
    config = model.config
    n_types = getattr(config, "type_vocab_size", None)
    if adapter.inputs.token_types == "word_embeddings":  # GPT-2 embeds token types with its word embeddings
        n_types = int(config.vocab_size)
    lo, hi = int(token_types.min()), int(token_types.max())
    if n_types is not None and (lo < 0 or hi >= int(n_types)):
        raise ValueError(
            f"token_type_ids must lie in [0, {int(n_types) - 1}] ({adapter.family}: {int(n_types)} token type(s)); "
            f"got values in [{lo}, {hi}]"
        )
    return token_types.to(dtype=torch.long)


def has_gaps(mask: Tensor) -> bool:
    r"""True where some row's 1s are not one contiguous block (a decoder's mask must be one block)."""
    rises = ((mask[:, 1:] == 1) & (mask[:, :-1] == 0)).sum(-1) + (mask[:, 0] == 1).long()
    return bool((rises > 1).any())


def _token_shapes(inputs: Any) -> set:
    r"""The (B, T) of every token-id (B, T) or embedding (B, T, D) tensor in ``inputs`` (a tensor or a tuple)."""
    shapes = set()
    for x in inputs if isinstance(inputs, (tuple, list)) else (inputs,):
        if isinstance(x, Tensor) and (x.dim() == 2 or (x.dim() == 3 and x.is_floating_point())):
            shapes.add(tuple(x.shape[:2]))
    return shapes


def check_target_is_not_forward_args(target: Any, inputs: Any, method: str = "this method") -> None:
    r"""Raise a ValueError for a ``target`` that is an attention mask, or a tuple holding one.

    ``decompose(inputs, target=None, additional_forward_args=None, ...)`` follows Captum's order,
    so ``decompose(ids, (mask,))`` passes the mask as ``target``. A tensor of two or more
    dimensions whose leading (B, T) is that of a token-id or embedding input, alone or inside
    a tuple or list, is such a mask: no method takes a target of that shape.

    Args:
        target: what the caller passed as ``target``.
        inputs: what the caller passed as ``inputs`` (a tensor, or a tuple of them).
        method: the method's name, for the message.

    Raises:
        ValueError: saying to pass the mask as ``additional_forward_args=``.

    Examples:
        >>> ids, mask = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5)
        >>> check_target_is_not_forward_args(3, ids)
        >>> check_target_is_not_forward_args((mask,), ids)
        Traceback (most recent call last):
        ...
        ValueError: this method: target=(tensor of shape (2, 5),) has the shape of the inputs' (B, T) ...
    """
    if target is None or isinstance(target, (int, str)):
        return
    items = tuple(target) if isinstance(target, (tuple, list)) else (target,)
    shapes = _token_shapes(inputs)

    def mask_like(x: Any) -> bool:
        return (isinstance(x, Tensor) or type(x).__module__ == "numpy") and getattr(x, "ndim", 0) >= 2 and (
            tuple(x.shape[:2]) in shapes)

    if not any(mask_like(x) for x in items):
        return
    described = ", ".join(f"tensor of shape {tuple(x.shape)}" if hasattr(x, "shape") else repr(x) for x in items)
    if isinstance(target, list):
        described = f"[{described}]"
    elif isinstance(target, tuple):
        described = f"({described}{',' if len(items) == 1 else ''})"
    raise ValueError(
        f"{method}: target={described} has the shape of the inputs' (B, T): it looks like an attention mask passed "
        "in the place of target. The arguments are Captum's: decompose(inputs, target=None, "
        "additional_forward_args=None, ...) and attribute(inputs, target=None, additional_forward_args=None, ...); "
        "pass the mask by keyword, e.g. decompose(ids, additional_forward_args=(mask,))"
    )


def explained_positions(explained_position: Union[int, str, Tensor], valid: Tensor) -> Tensor:
    r"""Resolve the explained row of every example.

    An example is explained at the same token whatever the padding: a non-negative int k
    is position first + k, counted from the example's first real token (so that a
    left-padded row explains the token it would explain alone), a negative int -k is
    position last + 1 - k, counted from its last real token (-1: the last real token);
    ``"last"`` is the last real token. A (B,) tensor gives positions in the
    padded tensor itself (what :attr:`AttributionResult.explained_position` returns), one
    per example; it must have an integer dtype.

    Args:
        explained_position: an int, ``"last"`` or a (B,) integer tensor (see above).
        valid: (B, T) bool.

    Returns:
        (B,) long positions in the padded tensor, each on a real token.

    Raises:
        ValueError / TypeError: for a position outside an example's real tokens, float or
        bool positions, or a tensor of the wrong shape.

    Examples:
        >>> valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
        >>> explained_positions(0, valid).tolist(), explained_positions(-1, valid).tolist()
        ([2, 0], [4, 4])
    """
    explained_position = check_explained_position(explained_position)
    b, t = valid.shape
    last = t - 1 - torch.flip(valid.long(), dims=[-1]).argmax(-1)
    first = valid.long().argmax(-1)
    if isinstance(explained_position, str):
        pos = last
    elif isinstance(explained_position, Tensor):
        if tuple(explained_position.shape) != (b,):
            raise ValueError(f"explained_position tensor must have shape ({b},); got {tuple(explained_position.shape)}")
        pos = explained_position.to(valid.device, torch.long)
    elif explained_position is None:
        raise TypeError("explained_position must be an int, 'last' or a (B,) integer tensor; got None")
    else:
        k = explained_position
        pos = last + 1 + k if k < 0 else first + k
        n_real = valid.sum(-1)
        outside = ((pos < first) | (pos > last)).nonzero().flatten().tolist()
        if outside:
            counted = "from the last real token" if k < 0 else "from the first real token"
            raise ValueError(
                f"explained_position {k} (counted {counted}) lies outside example(s) {outside}, which have "
                f"{[int(n_real[i]) for i in outside]} real token(s)"
            )
    if bool(((pos < 0) | (pos >= t)).any()) or not bool(valid.gather(1, pos.clamp(0, t - 1).unsqueeze(1)).all()):
        raise ValueError(f"explained position(s) {pos.tolist()} do not all fall on real (non-pad) tokens")
    return pos
