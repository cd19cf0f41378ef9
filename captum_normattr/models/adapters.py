r"""Reading a model through its architecture description: lookup, paths, weights.

The descriptions themselves live in :mod:`captum_normattr.arch` (one
:class:`~captum_normattr.arch.spec.ArchitectureSpec` per family, in a registry). Paths are dotted
attribute paths: ``layers`` from the base model (``model.base_model``), the others from
one layer module.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.arch import registry as arch_registry
from captum_normattr.arch.registry import ARCHITECTURES, ENCODER_DECODERS, VISION_LANGUAGE, lookup
from captum_normattr.arch.families.vlm import VisionLanguage, text_config, vision_language_spec
from captum_normattr.arch.spec import ArchitectureSpec, UnsupportedModelError
from captum_normattr.decompose.kinds.registry import LAYER_KINDS
from captum_normattr.decompose.kinds.single_branch import absent_value_projection
from captum_normattr.models.quantization import check_quantization
from captum_normattr.models.unregistered import unregistered_hint
from captum_normattr.models.weights import module_tensor, weight_and_bias

__all__ = [
    "TABLE_METHODS",
    "UnsupportedModelError",
    "architecture_table_markdown",
    "base_model",
    "delta_value_columns",
    "encoder_decoder_table_markdown",
    "family_methods",
    "get_adapter",
    "require_loaded_model",
    "get_path",
    "layer_adapters",
    "language_config",
    "layer_modules",
    "layer_scale",
    "linear_params",
    "max_positions",
    "supported_families",
    "unwrap_model",
    "value_projection",
    "value_states",
    "vision_language",
]


def layer_scale(layer: nn.Module, path: Optional[str]) -> Optional[Tensor]:
    r"""The per-channel scale (D,) of a layer-scale module (DINOv2's ``lambda1``), or None without one.

    Read through :func:`~captum_normattr.models.weights.module_tensor` like every other
    weight, so a layer offloaded by accelerate (its parameters on ``meta``) gives the
    values its hook holds.

    Raises:
        WeightsNotReachableError: the scale is on ``meta`` and no accelerate hook holds it.
        ValueError: the module has no scale parameter.
    """
    if path is None:
        return None
    module = get_path(layer, path)
    for name in ("lambda1", "gamma", "scale", "weight"):
        value = module_tensor(module, name, path)
        if value is not None:
            return value
    raise ValueError(f"cannot find the scale parameter of layer-scale module {type(module).__name__} ({path})")


#: The methods the docs' table lists per family (the layer kind's, as tested on every family's tiny model).
TABLE_METHODS: Tuple[Tuple[str, str], ...] = (
    ("maps", "GlobEnc"), ("alti", "ALTI"), ("ff", "FF"), ("decompx", "DecompX"), ("alti_logit", "ALTI-Logit"))


def family_methods(spec: ArchitectureSpec) -> Tuple[str, ...]:
    r"""The methods that decompose a family, as the docs' table names them.

    The descriptions (:mod:`captum_normattr.arch`) state a family's topology; its layer kind
    (:data:`captum_normattr.decompose.kinds.registry.LAYER_KINDS`) says which methods decompose it.

    Args:
        spec: a family's description.

    Returns:
        Its layer kind's methods in :data:`TABLE_METHODS` order (ALTI-Logit for causal models
        only); ``("ALTI+",)`` for an encoder-decoder; empty for a topology without a kind.
    """
    if spec.is_encoder_decoder:
        return ("ALTI+",)
    kind = LAYER_KINDS.get(spec.topology)
    methods = set() if kind is None else set(kind.methods)
    if not spec.causal:
        methods.discard("alti_logit")
    return tuple(name for key, name in TABLE_METHODS if key in methods)


def architecture_table_markdown(specs: Optional[Dict[str, ArchitectureSpec]] = None) -> str:
    r"""The docs' supported-architectures table (Markdown), rendered from the registry and the layer kinds.

    Args:
        specs: the descriptions to list (default:
            :data:`~captum_normattr.arch.registry.ARCHITECTURES`, the one-stack families).

    Returns:
        Columns: family, ``config.model_type`` values, topology kind, token mixers
        (:meth:`~captum_normattr.arch.spec.ArchitectureSpec.mixer_summary`), methods
        (:func:`family_methods`), features, notes.
    """
    rows = ["| family | model types | topology | mixers | methods | features | notes |", "|---|---|---|---|---|---|---|"]
    for spec in (ARCHITECTURES if specs is None else specs).values():
        rows.append(
            f"| {spec.family} | {', '.join(f'`{t}`' for t in spec.model_types)} | `{spec.topology}` | "
            f"{spec.mixer_summary()} | {', '.join(family_methods(spec))} | {', '.join(spec.features())} | "
            f"{spec.notes or '—'} |"
        )
    return "\n".join(rows)


def encoder_decoder_table_markdown() -> str:
    r"""The docs' encoder-decoder table (Markdown).

    Returns:
        :func:`architecture_table_markdown` of :data:`~captum_normattr.arch.registry.ENCODER_DECODERS`.
    """
    return architecture_table_markdown(ENCODER_DECODERS)


def supported_families() -> str:
    r"""Readable list of the supported families and their model types (from the registry)."""
    return arch_registry.supported_families()


def unwrap_model(model: nn.Module) -> nn.Module:
    r"""The ``transformers`` model inside the wrappers that do not change what it computes.

    - ``torch.compile(model)`` (an ``OptimizedModule``): its ``_orig_mod``. The package's
      hooks run on the eager module; the numbers are those of the eager model.
    - a peft ``PeftModel`` with LoRA-type adapters (``get_peft_model``,
      ``PeftModel.from_pretrained``): ``get_base_model()``, the transformers model whose
      projections peft replaced by tuner layers; their effective weights are read by
      :func:`~captum_normattr.models.weights.module_tensor`.

    Args:
        model: any model.

    Returns:
        The innermost model (``model`` itself when it is not wrapped).

    Raises:
        UnsupportedModelError: a peft model with prompt-learning adapters (prefix / prompt /
            p-tuning), whose virtual tokens live outside the transformers model.

    Examples::

        >>> unwrap_model(torch.compile(get_peft_model(model, LoraConfig(...)))) is model
        True
    """
    for _ in range(8):  # wrappers of wrappers, bounded
        inner = model
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module):
            inner = orig
        elif type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
            config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", None))
            if config is not None and getattr(config, "is_prompt_learning", False):
                raise UnsupportedModelError(
                    f"the peft adapter {model.active_adapter!r} is {type(config).__name__} (prompt learning: virtual "
                    "tokens added outside the transformers model), which captum_normattr cannot attribute; LoRA-type "
                    "adapters are supported"
                )
            inner = model.get_base_model()
        elif type(model).__module__.startswith("peft.tuners") and isinstance(getattr(model, "model", None), nn.Module):
            inner = model.model  # a tuner model (LoraModel, PeftModel.base_model): the transformers model it wraps
        if inner is model:
            return model
        model = inner
    return model


#: the transformers Auto class that loads a checkpoint, by the end of the class name in its config.json
_AUTO_BY_ARCHITECTURE = (
    (("ForCausalLM", "LMHeadModel"), "AutoModelForCausalLM"),
    (("ForSequenceClassification",), "AutoModelForSequenceClassification"),
    (("ForImageClassification",), "AutoModelForImageClassification"),
    (("ForMaskedLM",), "AutoModelForMaskedLM"),
    (("ForTokenClassification",), "AutoModelForTokenClassification"),
    (("ForConditionalGeneration",), "AutoModelForSeq2SeqLM"),
)
#: the other Auto classes named when the checkpoint's config cannot be read
OTHER_LOADERS = ("AutoModelForSequenceClassification or AutoModel for an encoder, AutoModelForSeq2SeqLM for an "
                 "encoder-decoder, AutoModelForImageClassification for a Vision Transformer")


def _is_path(name: str) -> bool:
    try:
        return Path(name).expanduser().exists()
    except (OSError, ValueError):  # an invalid path (a null byte, a name too long): a plain string
        return False


def _saved_config(name: str) -> Optional[Dict[str, Any]]:
    r"""The config.json of a local folder, or of a Hub name already in the local cache (never downloads)."""
    try:
        path: Optional[Path] = Path(name).expanduser() / "config.json"
        if not path.is_file():
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
            path = Path(cached) if isinstance(cached, str) else None
        return json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except Exception:  # noqa: BLE001 - no hub library, not a repo id, unreadable: no config, a generic hint
        return None


def _auto_class(name: str) -> Optional[str]:
    r"""The Auto class that loads checkpoint ``name`` (from its config.json when it can be read), or None."""
    config = _saved_config(name)
    if not config:
        return None
    for arch in config.get("architectures") or []:
        for endings, auto in _AUTO_BY_ARCHITECTURE:
            if str(arch).endswith(endings):
                if auto == "AutoModelForSeq2SeqLM" and not config.get("is_encoder_decoder", False):
                    continue  # e.g. a vision-language *ForConditionalGeneration
                return auto
    if config.get("is_encoder_decoder"):
        return "AutoModelForSeq2SeqLM"
    return "AutoModel" if any(str(a).endswith("Model") for a in config.get("architectures") or []) else None


def require_loaded_model(model: Any, loader: Optional[str] = None) -> None:
    r"""Raise a TypeError, saying how to load one, unless ``model`` is a loaded model (a ``torch.nn.Module``).

    Every attribution class reaches it (:func:`get_adapter`, and the encoder-decoder adapter of
    ALTI+), so a model name, a path, a tokenizer or None passed where the model belongs is told
    what to do, e.g. ``expected a loaded model (torch.nn.Module), got the string 'gpt2'; load it
    first: AutoModelForCausalLM.from_pretrained('gpt2')``. The Auto class is read from the
    checkpoint's ``config.json`` where it can be found without downloading (a local folder, or the
    Hugging Face cache), else ``loader`` (or a list of the usual ones) is named.

    Args:
        model: what was passed as the model.
        loader: the Auto class to suggest when the checkpoint's config cannot be read (e.g.
            ``"AutoModelForCausalLM"`` for the LLM API); default: the usual ones, by kind of model.

    Raises:
        TypeError: for anything that is not a ``torch.nn.Module``.

    Examples:
        >>> require_loaded_model("no-such-folder/model")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        TypeError: expected a loaded model (torch.nn.Module), got the string 'no-such-folder/model'; load it first: ...
    """
    if isinstance(model, nn.Module):
        return
    head = "expected a loaded model (torch.nn.Module), got"

    def how(name: str, shown: str) -> str:
        auto = _auto_class(name) if name else None
        call = f"{auto or loader or 'AutoModelForCausalLM'}.from_pretrained({shown})"
        return call if auto or loader else f"{call} (transformers; for a decoder, or {OTHER_LOADERS})"

    cls = type(model).__name__
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        what = "path" if isinstance(model, os.PathLike) or _is_path(name) else "string"
        raise TypeError(f"{head} the {what} {name!r}; load it first: {how(name, repr(name))}")
    if model is None:
        raise TypeError(f"{head} None; load a model first: {how('', 'NAME')}")
    if callable(getattr(model, "convert_ids_to_tokens", None)) or "Tokenizer" in cls or "Processor" in cls:
        name = str(getattr(model, "name_or_path", "") or "")
        kind = "processor" if "Processor" in cls else "tokenizer"
        raise TypeError(f"{head} a {kind} ({cls}); pass the model itself, loaded with "
                        f"{how(name, repr(name) if name else 'NAME')}")
    raise TypeError(f"{head} {cls}; load a model first: {how('', 'NAME')}")


def get_adapter(model: nn.Module) -> ArchitectureSpec:
    r"""The adapter for a Hugging Face model, from its ``config.model_type``.

    Args:
        model: a ``transformers`` model (base model or a model with a head), also inside a
            ``PeftModel`` or ``torch.compile`` wrapper (:func:`unwrap_model`).

    Returns:
        The matching :class:`ArchitectureSpec`.

    Raises:
        TypeError: ``model`` is not a loaded model (a name, a path, a tokenizer, None:
            :func:`require_loaded_model` says how to load it).
        UnsupportedModelError: naming the supported families.
    """
    require_loaded_model(model)
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    spec = lookup(model_type, config)
    if spec is None and model_type in VISION_LANGUAGE:
        spec = _vision_language_adapter(model, VISION_LANGUAGE[model_type])
    if spec is not None:
        reason = spec.refusal(config)
        if reason is not None:
            raise UnsupportedModelError(f"captum_normattr cannot attribute {type(model).__name__}: {reason}.")
        check_quantization(model, type(model).__name__)  # activation-quantizing layers: refused, with why
        return spec
    vision = ""
    if getattr(config, "patch_size", None) is not None or getattr(config, "image_size", None) is not None:
        vision = (
            f" Supported vision families: {arch_registry.supported_families('image', model_types=False)} (pre-LN, absolute positions; Swin, BEiT and "
            "other models with relative position biases or windowed attention are not supported)."
        )
    reason = arch_registry.refusal(model_type, config)
    if reason is not None:
        raise UnsupportedModelError(
            f"captum_normattr cannot attribute {type(model).__name__}: {reason} Supported families: "
            f"{supported_families()}.{vision} See docs/architectures.md."
        )
    raise UnsupportedModelError(
        f"captum_normattr does not support model type {model_type!r} ({type(model).__name__}): it is not "
        f"registered. {unregistered_hint(unwrap_model(model), model_type)} Supported families: {supported_families()}.{vision} "
        "A family with other parts can be described and added with captum_normattr.arch.register_architecture "
        "(docs/architectures.md)."
    )


def vision_language(model: nn.Module) -> Optional[VisionLanguage]:
    r"""The vision-language description of a model (:mod:`captum_normattr.arch.families.vlm`), or None for a text model.

    Read from ``config.model_type``; a model type the one-stack registry serves itself is not one.
    """
    config = getattr(unwrap_model(model), "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in VISION_LANGUAGE or lookup(model_type, config) is not None:
        return None
    return VISION_LANGUAGE[model_type]


def language_config(model: nn.Module) -> Any:
    r"""The config of the Transformer the package decomposes: a vision-language model's decoder config
    (``config.text_config``, :func:`vision_language`), else ``model.config``.

    Args:
        model: the model (wrappers allowed, :func:`unwrap_model`).

    Returns:
        The config whose ``hidden_size``, ``vocab_size``, ``max_position_embeddings``, soft-caps
        and logit scales describe the decomposed layers and head.
    """
    model = unwrap_model(model)
    description = vision_language(model)
    return model.config if description is None else text_config(model.config, description)


def _vision_language_adapter(model: nn.Module, description: VisionLanguage) -> ArchitectureSpec:
    r"""The description of a vision-language model: its decoder's family, re-rooted (:func:`vision_language_spec`)."""
    inner = text_config(model.config, description)
    inner_type = getattr(inner, "model_type", None)
    text_spec = lookup(dict(description.text_types).get(inner_type, inner_type), inner)
    if text_spec is None or not text_spec.causal:
        why = (f"{text_spec.family} is not a decoder" if text_spec is not None else
               arch_registry.refusal(inner_type, inner) or "no registered decoder family serves it")
        raise UnsupportedModelError(
            f"captum_normattr cannot attribute {type(model).__name__}: its language model is {inner_type!r} ({why}). "
            f"Supported decoders: {arch_registry.supported_causal_families()}. See docs/vlm.md."
        )
    reason = text_spec.refusal(inner)
    if reason is not None:
        raise UnsupportedModelError(f"captum_normattr cannot attribute {type(model).__name__}: {reason}.")
    return vision_language_spec(description, text_spec)


def get_path(root: nn.Module, path: str):
    r"""Follow a dotted attribute path (integers index module lists)."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def base_model(model: nn.Module) -> nn.Module:
    r"""The bare Transformer inside a model with a head (``model.base_model``), wrappers removed (:func:`unwrap_model`)."""
    model = unwrap_model(model)
    base = getattr(model, "base_model", model)
    body = getattr(model, "model", None)
    if base is model and isinstance(body, nn.Module) and getattr(model, "base_model_prefix", "model") != "model":
        return body  # a head whose base_model_prefix names no attribute (Llama 4's *ForCausalLM: language_model / .model)
    return base


def layer_modules(model: nn.Module, adapter: ArchitectureSpec):
    r"""The list of layer modules."""
    return list(get_path(base_model(model), adapter.layers))


def layer_adapters(model: nn.Module, adapter: ArchitectureSpec, layers: Optional[list] = None) -> list:
    r"""Each layer's description: for a hybrid model (:attr:`~captum_normattr.arch.spec.Layer.mixers`) the layer's
    own mixer as its attention branch, for a single-branch model (:attr:`~captum_normattr.arch.spec.Layer.single_branches`)
    the layer's one branch, chosen by ``config.<mixer_types>[i]``; else ``adapter`` for every layer.

    Args:
        model: the model.
        adapter: its description.
        layers: its layer modules (default: :func:`layer_modules`).

    Returns:
        One :class:`~captum_normattr.arch.spec.ArchitectureSpec` per layer.
    """
    layers = layer_modules(model, adapter) if layers is None else layers
    types_name = adapter.layer.mixer_types
    if not (adapter.layer.mixers or adapter.layer.single_branches) or types_name is None:
        return [adapter] * len(layers)
    types = getattr(getattr(unwrap_model(model), "config", None), types_name, None)
    if types is None or len(types) < len(layers):
        return [adapter.for_layer(layer) for layer in layers]
    return [adapter.for_layer(layer, types[i]) for i, layer in enumerate(layers)]


def linear_params(module: nn.Module, transposed: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    r"""Weight as a right-multiplied (in, out) matrix, and bias.

    Args:
        module: ``nn.Linear`` (weight [out, in]) or GPT-2 ``Conv1D`` (weight [in, out]).
        transposed: True for ``Conv1D``.

    Returns:
        (W (in, out), b (out,) or None) so that module(x) = x @ W + b. The tensors are read
        wherever they live (:func:`~captum_normattr.models.weights.weight_and_bias`: also
        from the hook of a module offloaded by accelerate) and left on that device.

    Raises:
        WeightsNotReachableError: a weight on ``meta`` that no accelerate hook holds.
    """
    w, b = weight_and_bias(module)
    w = w if transposed else w.T
    return w, b


def value_projection(layer: nn.Module, adapter: ArchitectureSpec) -> Tuple[Tensor, Optional[Tensor]]:
    r"""The value projection W_V of one layer as a right-multiplied matrix, and b_V.

    Args:
        layer: one layer module.
        adapter: its description (its attention names a value projection).

    Returns:
        (W_V (D, H_kv * Dh), b_V (H_kv * Dh,) or None); with grouped-query attention the
        columns are the key/value heads (each serves several query heads). A fused
        projection gives its value slice; a per-head interleaved one (GPT-NeoX's
        [q_h | k_h | v_h] blocks) the value block of every head, heads in order; a fused
        one with grouped-query attention (Phi-3's ``qkv_proj``: H * Dh query columns, then
        H_kv * Dh key and H_kv * Dh value columns) its value columns; a grouped one (Falcon's
        new decoder architecture: per key/value head [q_1 .. q_g | k | v]) the value head of
        every group, groups in order.

    Raises:
        ValueError: the description names no value projection, or the projection's width
            does not match the head counts of its attention module.
    """
    adapter = adapter.for_layer(layer)  # a hybrid model: this layer's mixer
    if adapter.layer.branch == "feed_forward":  # a single-branch FF layer: its absent attention's W_V (D, 1) is 0
        norm = module_tensor(get_path(layer, adapter.norm2.path), "weight")
        if norm is None:
            raise ValueError(f"the {adapter.family} feed-forward layer's norm has no weight to read its width from")
        return absent_value_projection(norm.shape[-1], norm.dtype, norm.device), None
    spec = adapter.layer.attention.value
    if spec is None:
        raise ValueError(f"the {adapter.family} description does not name the value projection (attention value)")
    w, b = linear_params(get_path(layer, spec.path), adapter.transposed_weights)
    if spec.layout == "latent":
        return _latent_value_projection(layer, adapter, w, b)
    if spec.layout in ("delta_grouped", "delta_split"):
        cols = delta_value_columns(get_path(layer, adapter.attention), spec.layout, w.shape[1]).to(w.device)
        return w[:, cols], None if b is None else b[cols]
    if adapter.layer.attention.output_gate is not None:  # gated attention: one column per query-head channel
        heads, kv_heads, dh = _head_counts(get_path(layer, adapter.attention))
        if kv_heads * dh != w.shape[1] or heads % kv_heads:
            raise ValueError(f"the value projection {spec.path} of {adapter.family} has {w.shape[1]} outputs, not the "
                             f"{kv_heads} x {dh} its attention module's head counts give")

        def per_query_head(t: Tensor) -> Tensor:
            t = t.reshape(*t.shape[:-1], kv_heads, dh).repeat_interleave(heads // kv_heads, dim=-2)
            return t.reshape(*t.shape[:-2], heads * dh)

        return per_query_head(w), None if b is None else per_query_head(b)
    if spec.layout == "fused":
        size = w.shape[1] // spec.count
        cols = slice(spec.index * size, (spec.index + 1) * size)
        return w[:, cols], None if b is None else b[cols]
    if spec.layout == "mamba2_x":  # a Mamba-2 in_proj [z | x | B | C | dt]: the x channels
        inner = int(get_path(layer, adapter.attention).intermediate_size)
        cols = slice(inner, 2 * inner)
        w_x, b_x = w[:, cols], None if b is None else b[cols]
        conv_bias = getattr(get_path(layer, adapter.layer.attention.conv), "bias", None)
        if conv_bias is None:
            return w_x, b_x
        # the convolution bias's heads (capture.mamba2.mamba2_bias_heads): W_V 0, b_V the bias of the x channels
        conv_bias = conv_bias.detach()[:inner].to(w.dtype)
        return (torch.cat([w_x, w_x.new_zeros(w_x.shape)], 1),
                torch.cat([b_x if b_x is not None else conv_bias.new_zeros(inner), conv_bias]))
    if spec.layout == "interleaved":
        dh = _head_dim(get_path(layer, adapter.attention), w.shape[1] // spec.count)
        heads = w.shape[1] // (spec.count * dh)

        def pick(t: Tensor) -> Tensor:
            blocks = t.reshape(*t.shape[:-1], heads, spec.count, dh)[..., spec.index, :]
            return blocks.reshape(*t.shape[:-1], heads * dh)

        return pick(w), None if b is None else pick(b)
    if spec.layout == "fused_gqa":
        heads, kv_heads, dh = _head_counts(get_path(layer, adapter.attention))
        sizes = (heads * dh, kv_heads * dh, kv_heads * dh)
        if sum(sizes) != w.shape[1]:
            raise ValueError(
                f"the fused projection {spec.path} of {adapter.family} has {w.shape[1]} outputs, not the "
                f"{heads} x {dh} query + 2 x {kv_heads} x {dh} key/value columns its attention module's head counts give"
            )
        start = sum(sizes[: spec.index])
        cols = slice(start, start + sizes[spec.index])
        return w[:, cols], None if b is None else b[cols]
    if spec.layout == "grouped":
        heads, kv_heads, dh = _head_counts(get_path(layer, adapter.attention))
        per = heads // kv_heads + 2  # per key/value head: its query heads, its key, its value
        if heads % kv_heads or kv_heads * per * dh != w.shape[1]:
            raise ValueError(
                f"the grouped projection {spec.path} of {adapter.family} has {w.shape[1]} outputs, not the "
                f"{kv_heads} x ({heads // max(kv_heads, 1)} + 2) x {dh} columns its attention module's head counts give"
            )
        block = {0: slice(0, per - 2), 1: slice(per - 2, per - 1), 2: slice(per - 1, per)}[spec.index]

        def grouped(t: Tensor) -> Tensor:
            blocks = t.reshape(*t.shape[:-1], kv_heads, per, dh)[..., block, :]
            return blocks.reshape(*t.shape[:-1], -1)

        return grouped(w), None if b is None else grouped(b)
    return w, b


def delta_value_columns(mixer: nn.Module, layout: str, width: int) -> Tensor:
    r"""The value columns of a Gated DeltaNet's input projection (``ValueProjection`` layouts ``delta_grouped`` and
    ``delta_split``), value heads in order, as the mixer's forward reads them.

    Args:
        mixer: the Gated DeltaNet module (its ``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim``).
        layout: ``"delta_grouped"`` (per key head [q | k | v | z], Qwen3-Next's ``in_proj_qkvz``) or
            ``"delta_split"`` ([q | k | v], Qwen3.5's ``in_proj_qkv``).
        width: the projection's number of outputs (checked against the sizes).

    Returns:
        (H_v * d_v,) long indices of the value columns.

    Raises:
        ValueError: the module lacks the sizes, or they do not give ``width``.
    """
    sizes = [getattr(mixer, n, None) for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")]
    if any(not isinstance(v, int) for v in sizes):
        raise ValueError(f"{type(mixer).__name__} has no num_k_heads / num_v_heads / head_k_dim / head_v_dim: it is not "
                         "a Gated DeltaNet mixer")
    hk, hv, dk, dv = sizes
    if hv % hk:
        raise ValueError(f"{type(mixer).__name__}: {hv} value heads are not a multiple of {hk} key heads")
    if layout == "delta_grouped":
        block = 2 * dk + 2 * (hv // hk) * dv
        expected = hk * block
        cols = (torch.arange(hk)[:, None] * block + 2 * dk + torch.arange((hv // hk) * dv)[None, :]).reshape(-1)
    else:
        expected = 2 * hk * dk + hv * dv
        cols = 2 * hk * dk + torch.arange(hv * dv)
    if expected != width:
        raise ValueError(f"{type(mixer).__name__}'s {layout} input projection has {width} outputs, not the {expected} its "
                         f"{hk} key heads of {dk} and {hv} value heads of {dv} give")
    return cols


def _latent_value_projection(layer: nn.Module, adapter: ArchitectureSpec, w: Tensor, b: Optional[Tensor]):
    r"""(W_a^c diag(g) W_b^v, b_a^c diag(g) W_b^v): multi-head latent attention's values before the latent's norm scale.

    ``w``, ``b``: the down-projection (D, kv_lora_rank + rotary); its first ``kv_lora_rank``
    columns are the latent c. The up-projection's output is per head [key (qk_nope_head_dim) |
    value (v_head_dim)]; its value columns, heads in order, give (D, H * v_head_dim).
    """
    spec = adapter.layer.attention.value
    attention = get_path(layer, adapter.attention)
    rank, nope, dv = (getattr(attention, n, None) for n in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"))
    if None in (rank, nope, dv):
        raise ValueError(f"the {adapter.family} description reads latent values, but {type(attention).__name__} has no "
                         "kv_lora_rank / qk_nope_head_dim / v_head_dim")
    norm = get_path(layer, spec.latent_norm.path)
    gain = module_tensor(norm, "weight")
    gain = (torch.ones(rank, dtype=w.dtype, device=w.device) if gain is None else gain.detach().to(w.dtype)) + \
        spec.latent_norm.weight_offset
    up, _ = linear_params(get_path(layer, spec.latent_up), adapter.transposed_weights)  # (rank, H (nope + dv))
    heads = up.shape[1] // (nope + dv)
    up_v = up.reshape(rank, heads, nope + dv)[..., nope:].reshape(rank, heads * dv).to(w.dtype)
    w_eff = (w[:, :rank] * gain) @ up_v
    return w_eff, None if b is None else (b[:rank] * gain) @ up_v


def value_states(projection_output: Tensor, layer: nn.Module, adapter: ArchitectureSpec, heads: int) -> Tensor:
    r"""The value states (B, H, T, Dh) in the model's own output of its value projection.

    For an attention module that computes its probabilities itself (``Attention.probabilities
    == "returned"``, BLOOM): the value states are read from the real output of the projection
    the description names, laid out as :func:`value_projection` reads its weights (a fused
    projection's value slice, an interleaved one's per-head value blocks, grouped-query key/value
    heads repeated for the ``heads`` query heads).

    Args:
        projection_output: (B, T, W) the projection's output (b_V inside).
        layer: the layer module.
        adapter: its description.
        heads: H, the query heads (the probabilities' second dimension).

    Returns:
        (B, H, T, Dh).
    """
    spec = adapter.layer.attention.value
    out = projection_output
    b, t, width = out.shape
    if spec.layout == "interleaved":
        dh = width // (spec.count * heads)
        v = out.reshape(b, t, heads, spec.count, dh)[..., spec.index, :]
    else:
        if spec.layout == "fused":
            size = width // spec.count
            out = out[..., spec.index * size:(spec.index + 1) * size]
        elif spec.layout == "fused_gqa":
            h, kv, dh = _head_counts(get_path(layer, adapter.attention))
            out = out[..., h * dh + kv * dh:]
        dh = _head_dim(get_path(layer, adapter.attention), out.shape[-1] // heads)
        v = out.reshape(b, t, out.shape[-1] // dh, dh)
    v = v.transpose(1, 2)
    if v.shape[1] != heads:  # grouped-query attention: one key/value head serves several query heads
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    return v


def _head_counts(attention: nn.Module) -> Tuple[int, int, int]:
    r"""(query heads, key/value heads, head size) of an attention module (its attributes, else its config)."""
    config = getattr(attention, "config", None)
    heads = getattr(attention, "num_heads", None) or getattr(config, "num_attention_heads", None)
    kv_heads = (getattr(attention, "num_key_value_heads", None) or getattr(attention, "num_kv_heads", None)
                or getattr(config, "num_key_value_heads", None) or heads)
    if not heads:
        raise ValueError(f"cannot find the head counts of {type(attention).__name__} (no num_heads or config)")
    dh = getattr(attention, "head_dim", None) or getattr(config, "head_dim", None) or int(config.hidden_size) // int(heads)
    return int(heads), int(kv_heads), int(dh)


def _head_dim(attention: nn.Module, total: int) -> int:
    r"""The head size of an attention module (its ``head_dim`` / ``head_size``, else from its config)."""
    for name in ("head_dim", "head_size"):
        value = getattr(attention, name, None)
        if isinstance(value, int) and value > 0:
            return value
    config = getattr(attention, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if heads:
        return int(config.hidden_size) // int(heads)
    raise ValueError(f"cannot find the head size of {type(attention).__name__} (no head_dim, head_size or config)")


def max_positions(model: nn.Module, adapter: ArchitectureSpec) -> Optional[int]:
    r"""The longest input the model's position embeddings allow, or None if unbounded."""
    config = language_config(model)
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        n = getattr(config, "n_positions", None)
    if n is None or getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
        return n
    if adapter.max_positions_offset:
        pad = getattr(config, "pad_token_id", 1) or 0
        n = n - pad - 1
    return n
