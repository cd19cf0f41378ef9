r"""Recording the tensors of one forward pass through public hooks (DESIGN section 8).

For the duration of one call the model's attention implementation is switched to a
function registered in transformers' ``AttentionInterface`` that computes the usual
eager attention and records its probabilities and value states; forward hooks record
the inputs and outputs of the norms, the feed-forward block and each layer. Everything
(hooks, attention implementation, training mode) is restored when the call ends, also
when it raises. No modeling file is copied or edited.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch
from torch import Tensor, nn

from captum_normattr.decompose.records import LayerTensors, NormParams
from captum_normattr.models.adapters import ArchitectureAdapter, base_model, get_path, layer_modules, linear_params

ATTENTION_NAME = "captum_normattr_capture"
_ACTIVE: List["Recorder"] = []
_REGISTERED = False


def _recording_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    **kwargs,
):
    r"""Eager attention that records probabilities and values of the modules being watched."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention soft-capping and attention sinks are not supported by captum_normattr")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: one key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask[..., : key.shape[-2]], torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask[..., : key.shape[-2]]
    probs32 = torch.softmax(scores, dim=-1, dtype=torch.float32 if scores.dtype != torch.float64 else torch.float64)
    probs = probs32.to(query.dtype)
    if module.training and dropout > 0:
        probs = nn.functional.dropout(probs, p=dropout, training=True)
    for recorder in _ACTIVE:
        recorder._record_attention(module, probs32 if probs32.dtype != probs.dtype else probs, value)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, _recording_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
    _REGISTERED = True


def _configs(model: nn.Module):
    from transformers import PretrainedConfig

    seen = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            seen[id(cfg)] = cfg
    return list(seen.values())


def _norm_params(module: nn.Module, kind: str) -> NormParams:
    eps = getattr(module, "eps", None)
    if eps is None:
        eps = getattr(module, "variance_epsilon", None)
    if eps is None and isinstance(module, getattr(nn, "RMSNorm", ())):
        eps = torch.finfo(module.weight.dtype if module.weight is not None else torch.float32).eps  # torch's default
    if eps is None:
        raise ValueError(f"cannot find the epsilon of norm module {type(module).__name__}")
    return NormParams(
        weight=getattr(module, "weight", None),
        bias=getattr(module, "bias", None) if kind == "layernorm" else None,
        eps=float(eps),
        kind=kind,
    )


def _first_tensor(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class Recorder:
    r"""Holds what one forward pass recorded, per layer."""

    def __init__(self, model: nn.Module, adapter: ArchitectureAdapter):
        self.model = model
        self.adapter = adapter
        self.layers = layer_modules(model, adapter)
        self.base = base_model(model)
        self._attn_index = {id(get_path(layer, adapter.attention)): i for i, layer in enumerate(self.layers)}
        self.records: List[Dict[str, Tensor]] = [dict() for _ in self.layers]
        self.final: Dict[str, Tensor] = {}

    def _record_attention(self, module: nn.Module, probs: Tensor, values: Tensor) -> None:
        idx = self._attn_index.get(id(module))
        if idx is not None:
            self.records[idx]["probs"] = probs.detach()
            self.records[idx]["values"] = values.detach()

    def _hooks(self) -> list:
        a = self.adapter
        handles = []

        def store(idx: int, key: str, what: str):
            def hook(module, args, output):
                rec = self.records[idx]
                if what in ("in", "both"):
                    rec[key + "_in"] = _first_tensor(args).detach()
                if what in ("out", "both"):
                    rec[key + "_out"] = _first_tensor(output).detach()

            return hook

        for i, layer in enumerate(self.layers):

            def pre_hook(module, args, kwargs, idx=i):
                x = args[0] if args else kwargs.get("hidden_states")
                self.records[idx]["hidden_in"] = x.detach()

            handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(layer.register_forward_hook(store(i, "layer", "out")))
            handles.append(get_path(layer, a.ln1).register_forward_hook(store(i, "ln1", "both")))
            handles.append(get_path(layer, a.ln2).register_forward_hook(store(i, "ln2", "both")))
            handles.append(get_path(layer, a.ff_out).register_forward_hook(store(i, "ff", "out")))
            handles.append(get_path(layer, a.attn_out).register_forward_hook(store(i, "attn", "out")))
        if a.final_norm is not None:

            def final_hook(module, args, output):
                self.final["in"] = _first_tensor(args).detach()
                self.final["out"] = _first_tensor(output).detach()

            handles.append(get_path(self.base, a.final_norm).register_forward_hook(final_hook))
        return handles

    def final_norm_tensors(self, dtype: torch.dtype):
        r"""The final norm of a pre-LN model: (parameters, real input, real output), in ``dtype``.

        Raises:
            RuntimeError: if the adapter has no final norm or the forward pass did not reach it.
        """
        if self.adapter.final_norm is None or "in" not in self.final:
            raise RuntimeError(f"the forward pass recorded no final norm for the {self.adapter.family} adapter")
        p = _norm_params(get_path(self.base, self.adapter.final_norm), self.adapter.norm_kind)
        cast = lambda t: None if t is None else t.detach().to(dtype)
        return NormParams(cast(p.weight), cast(p.bias), p.eps, p.kind), cast(self.final["in"]), cast(self.final["out"])

    def layer_tensors(self, dtype: torch.dtype) -> List[LayerTensors]:
        r"""Build the per-layer records in the compute dtype.

        Args:
            dtype: float32 or float64.

        Returns:
            One :class:`LayerTensors` per layer.
        """
        a = self.adapter
        out = []
        for i, (layer, rec) in enumerate(zip(self.layers, self.records)):
            missing = [k for k in ("hidden_in", "probs", "values", "ln1_in", "ln1_out", "ln2_in", "ln2_out", "ff_out", "layer_out") if k not in rec]
            if missing:
                raise RuntimeError(
                    f"layer {i}: the forward pass recorded no {missing}; the model's structure does not match the "
                    f"{a.family} adapter"
                )
            cast = lambda t: None if t is None else t.detach().to(dtype)
            w_o, b_o = linear_params(get_path(layer, a.attn_out), a.transposed_weights)
            w_in, b_in = linear_params(get_path(layer, a.ff_in), a.transposed_weights)
            w_out, b_out = linear_params(get_path(layer, a.ff_out), a.transposed_weights)
            ff = {"w_in": cast(w_in), "b_in": cast(b_in), "w_out": cast(w_out), "b_out": cast(b_out),
                  "act": get_path(layer, a.ff_act), "w_gate": None, "b_gate": None}
            if a.ff_gate is not None:
                w_g, b_g = linear_params(get_path(layer, a.ff_gate), a.transposed_weights)
                ff["w_gate"], ff["b_gate"] = cast(w_g), cast(b_g)

            def norm(path: str) -> NormParams:
                p = _norm_params(get_path(layer, path), a.norm_kind)
                return NormParams(cast(p.weight), cast(p.bias), p.eps, p.kind)

            out.append(
                LayerTensors(
                    hidden_in=cast(rec["hidden_in"]),
                    probs=cast(rec["probs"]),
                    values=cast(rec["values"]),
                    out_weight=cast(w_o),
                    out_bias=cast(b_o),
                    ln1=norm(a.ln1),
                    ln1_in=cast(rec["ln1_in"]),
                    ln1_out=cast(rec["ln1_out"]),
                    ln2=norm(a.ln2),
                    ln2_in=cast(rec["ln2_in"]),
                    ln2_out=cast(rec["ln2_out"]),
                    ff_out=cast(rec["ff_out"]),
                    layer_out=cast(rec["layer_out"]),
                    pre_ln=a.pre_ln,
                    ff=ff,
                )
            )
        return out


@contextlib.contextmanager
def recording(model: nn.Module, adapter: ArchitectureAdapter) -> Iterator[Recorder]:
    r"""Record one forward pass of ``model``; restore everything on exit, even on error.

    Inside the block the model runs in eval mode with the recording attention function;
    afterwards its hooks, attention implementation and training mode are as before.

    Args:
        model: a supported ``transformers`` model.
        adapter: its :class:`ArchitectureAdapter`.

    Yields:
        A :class:`Recorder`; call ``recorder.layer_tensors(dtype)`` after the forward.

    Examples::

        >>> with recording(model, get_adapter(model)) as rec:
        ...     model(input_ids=ids, attention_mask=mask)
        >>> layers = rec.layer_tensors(torch.float32)
    """
    _register()
    recorder = Recorder(model, adapter)
    configs = _configs(model)
    saved = [(cfg, cfg.__dict__.get("_attn_implementation_internal")) for cfg in configs]
    was_training = model.training
    handles = []
    try:
        for cfg in configs:
            cfg.__dict__["_attn_implementation_internal"] = ATTENTION_NAME
        handles = recorder._hooks()
        model.eval()
        _ACTIVE.append(recorder)
        yield recorder
    finally:
        if recorder in _ACTIVE:
            _ACTIVE.remove(recorder)
        for h in handles:
            h.remove()
        for cfg, impl in saved:
            cfg.__dict__["_attn_implementation_internal"] = impl
        model.train(was_training)
