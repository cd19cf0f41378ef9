r"""The recorder: hooks that keep each layer's tensors and hand the layer over as soon as it has run.

The recording attention function (:mod:`captum_normattr.models.capture.attention`) records
the probabilities and value states of the modules the calling thread is recording (an
attention module that computes its own probabilities, as BLOOM's with ALiBi, is described
with ``probabilities="returned"``: a forward hook records the probabilities it returns, the
value states from its value projection's output). Forward hooks record the inputs and
outputs of the norms, the feed-forward block and each layer. When a layer's forward hook
fires, its tensors become one :class:`~captum_normattr.decompose.records.LayerTensors`
(:func:`~captum_normattr.models.capture.record.layer_record`) that is passed to the
caller's ``on_layer`` callback and then dropped: the memory of a call does not grow with
depth (see ``docs/design.md``, "Streaming engine"). A recorder is opened by a session
(:func:`~captum_normattr.models.capture.session.recording`).

Guards (``docs/reliability.md``, "Consistency guards"): every point where a user's hook can
change the computation is compared with what the decomposition assumes (the attention
module's real inputs, the feed-forward input, the output projection's input, the residual
joins, each norm rebuilt from its input and parameters, one layer's output against the next
layer's input); each layer module must run exactly once per forward pass, in order; and a
recorded tensor that the model changes in place afterwards is detected at hand-over (its
version counter), after which that tensor is recorded as a copy.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.arch.spec import ArchitectureSpec, Norm
from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.kinds.single_branch import complete_record
from captum_normattr.decompose.primitives.guards import relative_difference
from captum_normattr.decompose.records import LayerTensors, NormParams
from captum_normattr.decompose.primitives.short_conv import short_conv_channel_mixing
from captum_normattr.models.adapters import base_model, get_path, layer_adapters, layer_modules, value_states, vision_language
from captum_normattr.models.capture.attention import LOCK, ProbabilityBuffers, active_recorders
from captum_normattr.models.capture.deepstack import DeepStackCapture
from captum_normattr.models.capture.gated_delta_net import gated_attention_hooks, gated_delta_net_hooks
from captum_normattr.models.capture.kimi_delta import kimi_delta_hooks
from captum_normattr.models.capture.mamba2 import mamba2_hooks
from captum_normattr.models.capture.per_layer_input import per_layer_input_hooks
from captum_normattr.models.capture.record import input_keeper, layer_record, norm_params, record_checks
from captum_normattr.models.experts import register_expert_hooks

__all__ = ["AttentionRecords", "LayerRunError", "RecordedTensorModifiedError", "Recorder"]

_CLONE_KEYS: Dict[type, frozenset] = {}  # layer class -> recorded keys its forward changes in place


class RecordedTensorModifiedError(RuntimeError):
    r"""A recorded tensor was changed in place by the forward pass after it was recorded.

    Attributes:
        layer: the layer index. keys: the recorded tensors that changed.
        retry: True when nothing of the pass had been handed over yet, so that the caller
            can run it again (the keys are then recorded as copies).
    """

    def __init__(self, message: str, layer: int, keys: Tuple[str, ...], retry: bool):
        super().__init__(message)
        self.layer, self.keys, self.retry = layer, keys, retry


class LayerRunError(RuntimeError):
    r"""A layer module ran more or fewer times than once per forward pass, or out of order."""


def _version(t: Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        return None


def _same(a: Tensor, b: Tensor) -> bool:
    r"""True when ``a`` and ``b`` are the same elements (same memory, shape, strides and dtype)."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        and a.device == b.device
    )


def _first_tensor(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class AttentionRecords:
    r"""What a recorder does when the recording attention runs a module: the shared part of
    :class:`Recorder` and the encoder-decoder recorder.

    A subclass sets ``_attn_keys`` (id of each watched attention module -> the key of its
    record in ``records``) and ``keeps_context`` (whether the attention context is kept).
    """

    _attn_keys: Dict[int, Any]
    records: Dict[Any, Dict[str, Tensor]]
    keeps_context: bool = True
    #: the recording attention's reusable buffers (:class:`ProbabilityBuffers`; None: fresh tensors)
    buffers: Optional[ProbabilityBuffers] = None
    #: False: the watched modules run the model's own attention (sdpa, ...) and record no probabilities
    #: (values and context only); a rerun of a layer (:meth:`Recorder.rerun_layer`) records them
    record_probabilities: bool = True
    #: set once the model's own attention was found to give NaN where the recording does not (one warning per call;
    #: :class:`~captum_normattr.models.capture.attention.ModelAttentionWarning`)
    warned_model_attention: bool = False

    def watches(self, module: nn.Module) -> bool:
        return id(module) in self._attn_keys

    def _mine(self) -> bool:
        return self in active_recorders()

    def record_attention(self, module: nn.Module, probs: Optional[Tensor], values: Tensor,
                         context: Optional[Tensor] = None) -> None:
        r"""Keep a watched module's probabilities (None: not recorded, :attr:`record_probabilities`), values and
        (if kept and given) attention context (B, T, H, Dh)."""
        key = self._attn_keys.get(id(module))
        if key is not None:
            rec = self.records.setdefault(key, {})
            if probs is not None:
                rec["probs"] = probs.detach()
            rec["values"] = values.detach()
            if context is not None and self.keeps_context:
                rec["context"] = context.detach()
            self._recorded(key, rec, ("probs", "values", "context"))

    def _recorded(self, key: Any, rec: Dict[str, Tensor], names: Tuple[str, ...]) -> None:
        r"""Called after ``names`` were stored in ``rec`` (a subclass keeps their versions)."""


class Recorder(AttentionRecords):
    r"""Records one forward pass layer by layer and hands each layer to ``on_layer``.

    Args:
        model: a supported ``transformers`` model.
        adapter: its :class:`~captum_normattr.models.adapters.ArchitectureSpec`.
        dtype: the compute dtype of the handed-over tensors (float32 or float64).
        on_layer: called with every layer's :class:`LayerTensors` as soon as the layer has
            run; the recorder keeps nothing of it afterwards.
        keep_calls: keep each layer's call arguments (masks and position embeddings, shared
            between layers) so that :meth:`rerun_layer` can recompute a layer later.
        clone_keys: recorded tensors kept as copies (None: those that the forward pass of
            this layer class was seen to change in place, :class:`RecordedTensorModifiedError`).

    Raises:
        LayerRunError: the model's layer list holds one module more than once (shared layers).
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: ArchitectureSpec,
        dtype: torch.dtype,
        on_layer: Callable[[LayerTensors], None],
        keep_calls: bool = False,
        clone_keys: Optional[frozenset] = None,
    ):
        self.model = model
        self.adapter = adapter
        #: the pass's attention is two-way over part of the sequence: its layers are recorded as not causal
        self.two_way = False
        #: the layer kind: what is recorded of each layer and checked (its ``capture`` recipe)
        self.kind = layer_kind(adapter.topology, adapter.family)
        self.dtype = dtype
        self.on_layer = on_layer
        self.keep_calls = keep_calls
        self.layers = layer_modules(model, adapter)
        if len({id(m) for m in self.layers}) != len(self.layers):
            raise LayerRunError(
                f"the {adapter.family} model's layer list holds the same module more than once (shared layers, as in "
                "ALBERT): a layer that runs several times per forward pass is not supported"
            )
        self.base = base_model(model)
        #: each layer's description: a hybrid model's layer with its own mixer as the attention branch
        self.layer_adapters = layer_adapters(model, adapter, self.layers)
        self._attn_keys = {id(get_path(layer, la.attention)): i
                           for i, (layer, la) in enumerate(zip(self.layers, self.layer_adapters))
                           if la.layer.branch != "feed_forward"}  # a single-branch feed-forward layer mixes nothing
        self.records: Dict[int, Dict[str, Tensor]] = {}
        self.versions: Dict[int, Dict[str, Optional[int]]] = {}
        self.checks: Dict[int, Dict[str, Tensor]] = {}
        self.calls: Dict[int, Tuple[tuple, dict, bool]] = {}
        self.final: Dict[str, Tensor] = {}
        self.final_versions: Dict[str, Optional[int]] = {}
        self.layers_done = 0
        self.handed_over = 0
        self.clone_keys = _CLONE_KEYS.get(type(self.layers[0]), frozenset()) if clone_keys is None else clone_keys
        self._ran = [False] * len(self.layers)
        self._rerunning = False
        self._last_out: Optional[Tuple[int, Tensor]] = None  # (index, raw output) of the last layer that ran
        #: Qwen3-VL's DeepStack additions, folded into each layer's record (None for every other model)
        self.deepstack: Optional[DeepStackCapture] = None

    # --- recording --------------------------------------------------------------
    def _keep(self, idx: int, key: str, t: Tensor) -> None:
        t = t.detach()
        if key in self.clone_keys:
            t = t.clone()
        rec = self.records.setdefault(idx, {})
        rec[key] = t
        self.versions.setdefault(idx, {})[key] = _version(t)

    def _recorded(self, key: Any, rec: Dict[str, Tensor], names: Tuple[str, ...]) -> None:
        versions = self.versions.setdefault(key, {})
        for name in names:
            if name in rec:
                if name in self.clone_keys:
                    rec[name] = rec[name].clone()
                versions[name] = _version(rec[name])

    def _check(self, idx: int, name: str, real: Tensor, expected: Optional[Tensor]) -> None:
        r"""Keep the relative difference of a real tensor from the assumed one (0 when they are the same memory)."""
        if expected is None or _same(real, expected):
            return
        rel = relative_difference(real.detach().to(self.dtype), expected.detach())
        checks = self.checks.setdefault(idx, {})
        checks[name] = torch.maximum(checks[name], rel) if name in checks else rel

    def _start_layer(self, idx: int, x: Tensor) -> None:
        r"""Guard the order of the layers (each once per pass) and the hand-over of the stream."""
        if self._rerunning:
            return
        if idx == 0 and all(self._ran):  # a new forward pass inside the same recording
            self._ran = [False] * len(self._ran)
            self._last_out = None
        if self._ran[idx]:
            raise LayerRunError(
                f"layer {idx} ({type(self.layers[idx]).__name__}) ran twice in one forward pass (a shared layer, as in "
                "ALBERT, or a wrapper calling it again): its tensors would be decomposed once; this is not supported"
            )
        skipped = [j for j in range(idx) if not self._ran[j]]
        if skipped:
            raise LayerRunError(
                f"layer {idx} ran before layer(s) {skipped} in one forward pass: the layers must run once each, in order"
            )
        self._ran[idx] = True
        if self._last_out is not None and self._last_out[0] == idx - 1:
            self._check(idx, "layer input vs the previous layer's output", x, self._last_out[1])
        self._last_out = None

    def check_complete(self) -> None:
        r"""Raise :class:`LayerRunError` if the last forward pass did not run every layer."""
        missing = [i for i, ran in enumerate(self._ran) if not ran]
        if missing:
            raise LayerRunError(
                f"the forward pass ran {len(self._ran) - len(missing)} of {len(self._ran)} layers (not layer(s) "
                f"{missing}); the model's structure does not match the {self.adapter.family} adapter"
            )

    def install_hooks(self) -> list:
        r"""Register the recorder's hooks on the model (under :data:`~captum_normattr.models.capture.attention.LOCK`) and return their handles."""
        a = self.adapter
        handles = []

        def store(idx: int, key: str, what: str):
            def hook(module, args, output):
                if not self._mine():
                    return
                if what in ("in", "both"):
                    self._keep(idx, key + "_in", _first_tensor(args))
                if what in ("out", "both"):
                    self._keep(idx, key + "_out", _first_tensor(output))

            return hook

        def compare_inputs(idx: int, name: str, assumed_key: str, all_tensors: bool, first_only: bool = False):
            # kwargs=None: torch adds a with_kwargs hook in two steps, so another thread's forward pass may call
            # it without kwargs in between; it is not that thread's recording, so the hook does nothing then
            def pre_hook(module, args, kwargs=None):
                if not self._mine():
                    return
                rec = self.records.get(idx, {})
                assumed = rec.get(assumed_key)
                if assumed is None:
                    return
                given = list(args) + (list((kwargs or {}).values()) if all_tensors else [])
                if first_only:  # the module's first input is its input (BLOOM's attention takes the residual too)
                    given = given[:1] if args else [(kwargs or {}).get("hidden_states")]
                for x in given:
                    if isinstance(x, Tensor) and x.shape == assumed.shape:
                        self._check(idx, name, x, assumed)

            return pre_hook

        def context_check(idx: int):
            def pre_hook(module, args):
                if not self._mine() or not args or not isinstance(args[0], Tensor):
                    return
                ctx = self.records.get(idx, {}).get("context")
                if ctx is not None and args[0].numel() == ctx.numel():
                    x = args[0]
                    if not (x.data_ptr() == ctx.data_ptr() and x.is_contiguous() and ctx.is_contiguous()):
                        self._check(idx, "output projection input vs the attention context", x, ctx)

            return pre_hook

        def identity_norm(idx: int, key: str):
            # a branch without a pre-norm (OLMo 2): the "norm" output is the branch module's input
            def pre_hook(module, args, kwargs=None):
                if not self._mine():
                    return
                x = args[0] if args else (kwargs or {}).get("hidden_states")
                self._keep(idx, key + "_in", x)
                self._keep(idx, key + "_out", x)

            return pre_hook

        def norm_hook(module: nn.Module, norm: Norm, idx: int, key: str):
            if norm.kind == "identity":
                return module.register_forward_pre_hook(identity_norm(idx, key), with_kwargs=True)
            return module.register_forward_hook(store(idx, key, "both"))

        returned = a.layer.attention.probabilities == "returned"

        def returned_attention(idx: int, layer: nn.Module):
            # a module computing its own attention (BLOOM): (output, probabilities) returned, values from the projection
            attention = get_path(layer, a.attention)

            def value_hook(module, args, output):
                if self._mine():
                    self.records.setdefault(idx, {})["_projection"] = _first_tensor(output).detach()

            def context_hook(module, args):
                if self._mine() and args and isinstance(args[0], Tensor):
                    self.records.setdefault(idx, {})["_context"] = args[0].detach()

            def attention_hook(module, args, output):
                if not self._mine():
                    return
                rec = self.records.setdefault(idx, {})
                probs = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
                projection = rec.pop("_projection", None)
                if not isinstance(probs, Tensor) or probs.dim() != 4 or projection is None:
                    raise RuntimeError(
                        f"layer {idx}: the {a.family} description says the attention module returns (output, "
                        "probabilities) and reads its value projection, but the forward pass gave "
                        f"{type(probs).__name__} probabilities" + (" and no value projection output" if projection is None
                                                                    else ""))
                values = value_states(projection, layer, a, probs.shape[1])
                ctx = rec.pop("_context", None)
                if ctx is not None and ctx.numel() == values.numel():
                    ctx = ctx.reshape(values.shape[0], values.shape[2], values.shape[1], values.shape[3])
                else:
                    ctx = None
                self.record_attention(module, probs, values, ctx)

            return [get_path(layer, a.layer.attention.value.path).register_forward_hook(value_hook),
                    get_path(layer, a.attn_out).register_forward_pre_hook(context_hook),
                    attention.register_forward_hook(attention_hook)]

        recipe = self.kind.capture

        def keep_output(idx: int, key: str):
            def hook(module, args, output):
                if self._mine():
                    self._keep(idx, key, _first_tensor(output))

            return hook

        description = vision_language(self.model)
        if description is not None and description.stream_additions == "deepstack":
            self.deepstack = DeepStackCapture(self, get_path(self.base, description.language_model))
        with LOCK:
            if self.deepstack is not None:
                handles.extend(self.deepstack.hooks())
            for i, layer in enumerate(self.layers):
                la = self.layer_adapters[i]  # the layer's own mixer (hybrid models) as its attention branch

                def pre_hook(module, args, kwargs=None, idx=i):  # kwargs=None: see compare_inputs
                    if not self._mine() or kwargs is None:
                        return
                    from_args = bool(args)
                    x = args[0] if from_args else kwargs.get("hidden_states")
                    self._start_layer(idx, x)
                    self._keep(idx, "hidden_in", x)
                    if self.keep_calls:
                        rest = args[1:] if from_args else args
                        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                        self.calls[idx] = (rest, kw, from_args)

                def post_hook(module, args, output, idx=i):
                    if not self._mine():
                        return
                    self._keep(idx, "layer_out", _first_tensor(output))
                    if self.deepstack is not None:  # the stream after the layer: its output plus the additions
                        self.deepstack.fold(idx, self.records)
                    if a.final_norm is None and idx == len(self.layers) - 1 and not self._rerunning:
                        # no final norm (post-LN OPT): the LM head reads the last layer's output (an identity "norm")
                        out = self.records[idx]["layer_out"]
                        self.final["in"] = self.final["out"] = out
                        self.final_versions["in"] = self.final_versions["out"] = _version(out)
                    self._finish_layer(idx)

                handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
                # a single-branch layer (Nemotron-H) runs one of its description's branches: only its hooks
                mixes, feeds = la.layer.branch != "feed_forward", la.layer.branch != "self_attention"
                if mixes:
                    handles.append(norm_hook(get_path(layer, la.ln1), la.norm1, i, "ln1"))
                if feeds:
                    handles.append(norm_hook(get_path(layer, la.ln2), la.norm2, i, "ln2"))
                if returned:
                    handles.extend(returned_attention(i, layer))
                for key, norm in (("attn_post", a.layer.attention.post_norm), ("ff_post", a.layer.ff.post_norm)):
                    if norm is not None:  # the norms on the branch outputs that the description has
                        handles.append(get_path(layer, norm.path).register_forward_hook(store(i, key, "both")))
                if recipe.branch_output is not None:  # the attention branch output as it joins the stream (parallel)
                    attn_branch = get_path(layer, la.attn_scale if la.attn_scale is not None else la.attn_out)
                    handles.append(attn_branch.register_forward_hook(keep_output(i, recipe.branch_output)))
                if la.layer.per_layer_input is not None:  # Gemma 4: the per-layer input and the expert block's routing
                    handles.extend(per_layer_input_hooks(self, i, layer))
                if feeds and la.layer.ff.kind == "experts":  # the routing the experts module is called with, the shared gate
                    handles.extend(register_expert_hooks(
                        layer, la.layer.ff, self._mine, lambda key, t, idx=i: self._keep(idx, key, t),
                        lambda name, real, assumed, idx=i: self._check(idx, name, real, assumed),
                        lambda idx=i: self.records.get(idx, {}).get(recipe.ff_input)))
                if feeds:  # FF(u), layer scale inside
                    ff_out_module = get_path(layer, la.ff_scale if la.ff_scale is not None else la.ff_out)
                    handles.append(ff_out_module.register_forward_hook(store(i, "ff", "out")))
                mixer = la.layer.attention.mixer if mixes else None
                if mixer == "short_conv":  # the gates and values from the real forward pass
                    handles.extend(self._short_conv_hooks(i, layer, la))
                elif mixer == "gated_delta_net" or (mixes and la.layer.attention.output_gate is not None):
                    hooks = gated_delta_net_hooks if la.layer.attention.output_gate is None else gated_attention_hooks
                    handles.extend(hooks(self, i, layer, la))  # per-channel heads (Qwen3-Next, Qwen3.5)
                elif mixer == "kimi_delta":  # Kimi Linear's delta attention, its coefficients recorded
                    handles.extend(kimi_delta_hooks(self, i, layer, la))
                elif mixer == "mamba2":  # the scan's coefficients from the real forward pass
                    handles.extend(mamba2_hooks(self, i, layer, la))
                if mixes:
                    handles.append(get_path(layer, la.attention).register_forward_pre_hook(
                        compare_inputs(i, "attention input vs " + recipe.attention_input_name, recipe.attention_input,
                                       True, returned), with_kwargs=True))
                for path in (la.ff_in, la.ff_gate) if feeds else ():
                    if path is not None:
                        handles.append(get_path(layer, path).register_forward_pre_hook(compare_inputs(
                            i, "feed-forward input vs " + recipe.ff_input_name, recipe.ff_input, False)))
                if mixes:
                    handles.append(get_path(layer, la.attn_out).register_forward_pre_hook(context_check(i)))
                if a.layer.attention.probabilities == "module_output":  # DeBERTa: the module computes its attention
                    handles.extend(self._module_output_hooks(layer))
                handles.append(layer.register_forward_hook(post_hook))
            if a.final_norm is not None:

                def final_hook(module, args, output):
                    if not self._mine():
                        return
                    for key, t in (("in", _first_tensor(args)), ("out", _first_tensor(output))):
                        t = t.detach()
                        self.final[key] = t.clone() if "final_" + key in self.clone_keys else t
                        self.final_versions[key] = _version(self.final[key])

                handles.append(get_path(self.base, a.final_norm).register_forward_hook(final_hook))
        return handles

    def _short_conv_hooks(self, idx: int, layer: nn.Module, la: ArchitectureSpec) -> list:
        r"""Hooks that record a gated short-convolution mixer (LFM2) as attention with one head per channel.

        The input projection's real output [B | C | x] gives the gates and the values, the mixer's
        mask argument the tokens it keeps (padding is zeroed at its input); the per-channel mixing
        tensor (:func:`~captum_normattr.decompose.primitives.short_conv.short_conv_channel_mixing`, factored) is recorded
        as the probabilities (B, C, T, T; factored), x as the values (B, C, T, 1) and the output projection's
        input as the context (B, T, C, 1).
        """
        mixer = la.layer.attention
        module = get_path(layer, mixer.module)
        got: Dict[str, Any] = {}

        def keep_mask(mod, args, kwargs):
            if self._mine():
                got["mask"] = (kwargs or {}).get("attention_mask")

        def keep_projection(mod, args, output):
            if self._mine():
                got["bcx"] = _first_tensor(output).detach()

        keep_context = input_keeper(self._mine, got)

        def record(mod, args, output):
            if not self._mine():
                return
            bcx, ctx, mask = got.pop("bcx", None), got.pop("context", None), got.pop("mask", None)
            if bcx is None:
                raise RuntimeError(f"layer {idx}: the {la.family} short-convolution mixer did not run its input "
                                   f"projection {mixer.value.path}; the description does not match the model")
            b_gate, c_gate, x = bcx.chunk(3, dim=-1)
            b, t, c = x.shape
            valid = mask.to(torch.bool) if isinstance(mask, Tensor) and mask.dim() == 2 else None
            probs = None
            if self.record_probabilities:
                kernel = get_path(layer, mixer.conv).weight.detach()
                probs = short_conv_channel_mixing(b_gate, c_gate, kernel.reshape(c, -1), valid)
            context = None if ctx is None else ctx.reshape(b, t, c, 1)
            self.record_attention(mod, probs, x.transpose(1, 2).unsqueeze(-1), context)

        return [module.register_forward_pre_hook(keep_mask, with_kwargs=True),
                get_path(layer, mixer.value.path).register_forward_hook(keep_projection),
                get_path(layer, mixer.out).register_forward_pre_hook(keep_context),
                module.register_forward_hook(record)]

    def _module_output_hooks(self, layer: nn.Module) -> list:
        r"""Hooks that record the probabilities an attention module computes itself (``probabilities="module_output"``).

        The module is called with ``output_attentions=True`` (its own forward then returns
        ``(context, probabilities)``; what its caller receives does not change, DeBERTa's
        attention block drops the probabilities unless it asked for them); its value
        projection's output, reshaped per head, is recorded as the values, and its context
        output (B, T, H * Dh) as the attention context.
        """
        a = self.adapter
        module = get_path(layer, a.attention)
        value_module = get_path(layer, a.attn_value)
        signature = inspect.signature(module.forward)
        if "output_attentions" not in signature.parameters:
            raise ValueError(
                f"the {a.family} description records the probabilities from the output of {type(module).__name__}, "
                "whose forward takes no output_attentions argument"
            )
        got: Dict[str, Tensor] = {}

        def ask(mod, args, kwargs):
            if not self._mine():
                return None
            bound = signature.bind(*args, **kwargs)
            bound.arguments["output_attentions"] = True
            return bound.args, bound.kwargs

        def keep_values(mod, args, output):
            if self._mine():
                got["values"] = _first_tensor(output)

        def record(mod, args, output):
            if not self._mine():
                return
            values = got.pop("values", None)
            if not isinstance(output, (tuple, list)) or len(output) < 2 or output[1] is None or values is None:
                raise RuntimeError(
                    f"{type(mod).__name__} returned no attention probabilities with output_attentions=True (or its value "
                    f"projection did not run); the {a.family} description does not match the model"
                )
            probs, context = output[1], output[0]
            b, h, t, s = probs.shape
            values = values.reshape(b, s, h, -1).transpose(1, 2)
            self.record_attention(mod, probs, values, context.reshape(b, t, h, -1))

        return [
            module.register_forward_pre_hook(ask, with_kwargs=True),
            value_module.register_forward_hook(keep_values),
            module.register_forward_hook(record),
        ]

    def _changed_in_place(self, idx: int, rec: Dict[str, Tensor]) -> None:
        versions = self.versions.pop(idx, {})
        changed = tuple(k for k, v in versions.items() if v is not None and k in rec and _version(rec[k]) != v)
        if not changed:
            return
        layer_type = type(self.layers[idx])
        with LOCK:
            _CLONE_KEYS[layer_type] = _CLONE_KEYS.get(layer_type, frozenset()) | frozenset(changed)
        retry = self.handed_over == 0 and not self._rerunning
        raise RecordedTensorModifiedError(
            f"layer {idx}: the forward pass changed the recorded tensor(s) {list(changed)} in place after they were "
            f"recorded (an in-place operation of the model's code or of a hook, such as `mlp_output += attention_output`); "
            + ("they are recorded as copies from now on: run the call again" if not retry else "retrying with copies"),
            idx, changed, retry,
        )

    def _finish_layer(self, idx: int) -> None:
        rec = self.records.pop(idx, {})
        branch = self.layer_adapters[idx].layer.branch
        if branch is not None and "layer_out" in rec and "hidden_in" in rec:  # one branch: the other completed as 0
            complete_record(rec, branch, self.record_probabilities)
        missing = [k for k in self.kind.capture.record_keys if k not in rec
                   and not (k == "probs" and not self.record_probabilities)]
        if missing:
            raise RuntimeError(
                f"layer {idx}: the forward pass recorded no {missing}; the model's structure does not match the "
                f"{self.adapter.family} adapter"
            )
        self._changed_in_place(idx, rec)
        tensors = self.layer_tensors(idx, rec)
        self._last_out = (idx, rec["layer_out"])
        del rec
        self.layers_done = max(self.layers_done, idx + 1)
        if not self._rerunning:
            self.handed_over += 1
        self.on_layer(tensors)

    def _layer_checks(self, idx: int, rec: Dict[str, Tensor], t: LayerTensors) -> Dict[str, Tensor]:
        r"""The layer's consistency checks: those of its hooks, the norms rebuilt, the residual joins.

        ``rec``: the raw recorded tensors (identical memory needs no arithmetic); ``t``: the
        same in the compute dtype.
        """
        for name, real, assumed in self.kind.capture.identity_checks:
            self._check(idx, name, rec[real], rec[assumed])
        return record_checks(self.kind, t, self.checks.pop(idx, {}))

    # --- what the recorded tensors become ---------------------------------------
    def layer_tensors(self, idx: int, rec: Dict[str, Tensor]) -> LayerTensors:
        r"""One layer's :class:`LayerTensors` in the compute dtype, from its recorded tensors, with its checks.

        The record is :func:`~captum_normattr.models.capture.record.layer_record` (every tensor,
        weights included, on the device the layer's attention ran on); its ``checks`` are the
        hooks' checks and :func:`~captum_normattr.models.capture.record.record_checks`.
        """
        tensors = layer_record(self.layer_adapters[idx], self.kind, self.layers[idx], self.base, idx, rec, self.dtype)
        if self.two_way:  # a decoder attending two-way over part of this pass (docs/vlm.md, "Two-way spans")
            tensors.causal = False
        tensors.checks = self._layer_checks(idx, rec, tensors)
        return tensors

    def final_norm_tensors(self) -> Tuple[NormParams, Tensor, Tensor]:
        r"""The final norm of a pre-LN model: (parameters, real input, real output), in the compute dtype.

        A model whose LM head reads the last layer's output (a post-LN decoder without a final
        norm, OPT with ``do_layer_norm_before=False``) gives the identity norm over that output.

        Raises:
            RuntimeError: if the forward pass did not reach the final norm (or the last layer).
        """
        if "in" not in self.final:
            raise RuntimeError(f"the forward pass recorded no final norm for the {self.adapter.family} adapter")
        changed = [k for k, v in self.final_versions.items() if v is not None and _version(self.final[k]) != v]
        if changed:
            with LOCK:
                layer_type = type(self.layers[0])
                _CLONE_KEYS[layer_type] = _CLONE_KEYS.get(layer_type, frozenset()) | {"final_" + k for k in changed}
            raise RecordedTensorModifiedError(
                f"the forward pass changed the recorded final norm {changed} in place after it was recorded; it is "
                "recorded as a copy from now on: run the call again", len(self.layers), tuple(changed), False)
        device = self.final["out"].device
        if self.adapter.final_norm is None:  # the LM head reads the last layer's output: an identity final norm
            p = norm_params(None, "identity")
        else:
            p = norm_params(get_path(self.base, self.adapter.final_norm), self.adapter.head.final_norm, self.dtype, device)
        return p, self.final["in"].to(device=device, dtype=self.dtype), self.final["out"].to(self.dtype)

    def rerun_layer(self, idx: int, hidden_in: Tensor) -> LayerTensors:
        r"""Run layer ``idx`` again on ``hidden_in`` (its checkpointed input) and return its tensors.

        Needs ``keep_calls=True`` and the forward pass to have reached the layer; used by
        algorithms that walk the layers top-down (the DecompX adjoint) instead of keeping
        every layer's attention probabilities.
        """
        if idx not in self.calls:
            raise RuntimeError(f"layer {idx} cannot be recomputed: its call was not recorded (keep_calls=True)")
        rest, kw, from_args = self.calls[idx]
        got: List[LayerTensors] = []
        saved, saved_probs = self.on_layer, self.record_probabilities
        self.on_layer = got.append
        self._rerunning = True
        self.record_probabilities = True  # the rerun is what needs them
        try:
            x = hidden_in.to(next(self.layers[idx].parameters()).dtype)
            if from_args:
                self.layers[idx](x, *rest, **kw)
            else:
                self.layers[idx](*rest, hidden_states=x, **kw)
        finally:
            self.on_layer, self.record_probabilities = saved, saved_probs
            self._rerunning = False
        return got[0]
