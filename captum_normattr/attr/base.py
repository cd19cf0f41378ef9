r"""Shared machinery of the decomposition attributions: validate, stream the layers, roll out.

Every class here turns each layer into its contribution (a (B, T, T) map, a mixing ratio,
completeness errors) the moment the forward pass has produced that layer
(:func:`~captum_normattr.models.capture.recorder.recording`), so that the memory of a call does not
grow with depth: only the per-layer maps and a few per-layer numbers are kept.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar, Union

import torch
from captum.attr import Attribution
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.attr.images import image_extras, pixel_attributions
from captum_normattr.attr.inputs import (
    PreparedInputs,
    check_target_is_not_forward_args,
    explained_positions,
    prepare_inputs,
)
from captum_normattr.decompose.primitives.guards import guard_tolerance
from captum_normattr.decompose.kinds.registry import LayerKind, layer_kind
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.decompose.primitives.rollout import LayerMapStore, check_convention, rollout_scaled
from captum_normattr.models.adapters import base_model, get_adapter, layer_modules
from captum_normattr.models.capture.recorder import Recorder, RecordedTensorModifiedError, recording
from captum_normattr.models.weights import tensors_to
from captum_normattr.options import check_explained_position, check_memory_budget  # noqa: F401  (re-exported)
from captum_normattr.result import AttributionResult, DecompositionResult

R = TypeVar("R", bound=AttributionResult)


def format_output(inputs: Any, scores: Tensor, delta: Optional[Tensor] = None, return_convergence_delta: bool = False):
    r"""Captum's output convention: tuple in, tuple out; ``(scores, delta)`` when the delta is asked for.

    Args:
        inputs: what the caller passed as ``inputs`` (a tensor or a 1-tuple).
        scores: (B, T) token scores.
        delta: (B,) completeness error, needed when ``return_convergence_delta``.
        return_convergence_delta: append ``delta``.

    Returns:
        ``scores``, ``(scores,)``, or either of them paired with ``delta``.
    """
    out = (scores,) if isinstance(inputs, tuple) else scores
    return (out, delta) if return_convergence_delta else out


def compute_dtype(model: nn.Module) -> torch.dtype:
    r"""float64 for float64 models, float32 otherwise (half-precision models are decomposed in float32)."""
    return torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32


def layer_finite(layer: LayerTensors, valid: Tensor, input_checked: bool = False) -> Tensor:
    r"""(B,) bool: True where the layer's input and output are finite at the real tokens.

    That covers every recorded tensor of the layer: a NaN or an infinity in the value
    states of a real key, in the attention rows of a real query or in the feed-forward
    output reaches the layer output of the real queries (a product with a NaN or an
    infinity is never finite again, not even times an exactly zero probability; a norm of
    a non-finite vector is NaN), so checking them as well only re-reads memory.
    ``input_checked``: the input is a tensor already checked (the previous layer's output).
    """
    v = valid.to(layer.hidden_in.device)
    ok = torch.ones(v.shape[0], dtype=torch.bool, device=v.device)
    for x in (layer.layer_out,) if input_checked else (layer.hidden_in, layer.layer_out):
        ok &= (torch.isfinite(x).all(-1) | ~v).all(-1)
    return ok


#: result fields that are the model's own values or indices, never overwritten with NaN
_KEEP_FIELDS = ("attention_mask", "explained_position", "target", "foil", "logits")


def mark_non_finite(result: R, finite: Optional[Tensor]) -> R:
    r"""NaN for every per-example number of the examples whose forward pass was not finite.

    An example is non-finite when its inputs or any recorded layer tensor held a NaN or an
    infinity at a real token (``finite`` False, see :func:`layer_finite`), or when any of its
    scores at a real token is not finite. Its scores (pads included), delta and every other
    per-example float tensor of the result (layer maps, rollout, class scores, ...) become
    NaN, so that no finite number is ever reported for it; the other examples are untouched.
    The model's own logits are kept as they are. A warning names the examples.

    Args:
        result: an :class:`~captum_normattr.result.AttributionResult`.
        finite: (B,) bool from :class:`~captum_normattr.attr.inputs.PreparedInputs`, or None.

    Returns:
        ``result``, or a copy with those examples set to NaN.
    """
    scores = result.scores
    real = result.attention_mask.to(scores.device).bool()
    overflow = ~(torch.isfinite(scores) | ~real).all(-1)
    forward = torch.zeros_like(overflow) if finite is None else ~finite.to(overflow.device)
    bad = overflow | forward
    if not bool(bad.any()):
        return result
    b = bad.shape[0]
    overflow = overflow & ~forward
    messages = []
    if bool(forward.any()):
        messages.append(f"example(s) {forward.nonzero().flatten().tolist()} hold NaN or infinite values in their "
                        "inputs or forward pass")
    if bool(overflow.any()):
        messages.append(
            f"the scores of example(s) {overflow.nonzero().flatten().tolist()} overflowed although their inputs and "
            "forward pass were finite: the method's own arithmetic left the dtype's range inside a layer (rollouts "
            "are carried with a power of two and do not overflow); run the model in float64")
    warnings.warn("; ".join(messages) + "; their scores are NaN", RuntimeWarning, stacklevel=3)
    updates = {}
    for f in fields(result):
        value = getattr(result, f.name)
        if f.name in _KEEP_FIELDS or not isinstance(value, Tensor) or not value.is_floating_point():
            continue
        if value.dim() == 0 or value.shape[0] != b:
            continue
        rows = bad.to(value.device).view(b, *([1] * (value.dim() - 1)))
        updates[f.name] = value.masked_fill(rows, float("nan"))
    return replace(result, **updates)


def rollout_scale_extras(
    name: str, scores: Tensor, score_scale: Tensor, joint_scale: Optional[Tensor], stacklevel: int = 3
) -> Dict[str, Tensor]:
    r"""The powers of two of a rollout beyond the dtype's range, and a warning that says so.

    A ``"raw"`` rollout of maps whose rows are not normalised grows like the product of
    their row sums; when the explained row (or the full rollout) does not fit the dtype it
    is returned divided by an exact power of two (``decompose.primitives.rollout.rollout_scaled``):
    ratios and ranks are exact, nothing is NaN.

    Args:
        name: the method's name, for the warning.
        scores: (B, T) the scaled explained rows.
        score_scale: (B,) int64: the rollout rows = scores * 2**score_scale.
        joint_scale: (B,) int64 of the full rollout, or None.
        stacklevel: of the warning.

    Returns:
        ``{"rollout_log2_scale": score_scale}`` (and ``"full_rollout_log2_scale"``) when a
        scale is not 0, else ``{}``.
    """
    extras: Dict[str, Tensor] = {}
    if bool((score_scale != 0).any()):
        extras["rollout_log2_scale"] = score_scale
    if joint_scale is not None and bool((joint_scale != 0).any()):
        extras["full_rollout_log2_scale"] = joint_scale
    if extras:
        which = (score_scale != 0) | (joint_scale != 0 if joint_scale is not None else False)
        finite = torch.where(torch.isfinite(scores), scores.abs(), torch.zeros_like(scores)).amax(1).clamp(min=1e-300)
        decades = (torch.log10(finite.double()) + score_scale.double() * 0.30102999566398120).amax()
        warnings.warn(
            f"{name}: the raw rollout of example(s) {which.nonzero().flatten().tolist()} exceeds {scores.dtype}'s "
            f"range (the explained row reaches about 1e{float(decades):.0f}): the layer maps' rows are not normalised "
            "and their product over the layers grows past the dtype. The scores are that row divided by "
            "2**extras['rollout_log2_scale'] (exact ratios and ranks; the full rollout by "
            "2**extras['full_rollout_log2_scale']); rollout='row_normalized' divides each map by its row sums "
            "first and stays bounded.",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    return extras


class ConsistencyWarning(RuntimeWarning):
    r"""The model's real tensors disagree with what the decomposition assumes (see :class:`ConsistencyGuard`)."""


class ConsistencyError(RuntimeError):
    r"""Raised instead of :class:`ConsistencyWarning` by ``strict=True`` attributions."""


class ConsistencyGuard:
    r"""Judges the consistency checks of every layer of one call: warns once, or raises when strict.

    Each layer's :attr:`~captum_normattr.decompose.records.LayerTensors.checks` (relative
    differences between the model's real tensors and the assumed ones, filled by the capture)
    and, for the methods without a delta (GlobEnc, ALTI), the attention block's completeness
    error relative to the scale of the tensor it is measured on, are compared with
    :func:`~captum_normattr.decompose.primitives.guards.guard_tolerance` of the dtype the model computed
    in. ``docs/reliability.md``, "Consistency guards".

    Args:
        method: the method's name, for the message.
        strict: raise :class:`ConsistencyError` at the first layer that fails a check,
            instead of one :class:`ConsistencyWarning` per call after the forward pass.
    """

    def __init__(self, method: str, strict: bool = False):
        self.method = method
        self.strict = bool(strict)
        self.failures: List[str] = []
        self.tolerance = 0.0

    def check(self, layer: LayerTensors, completeness: Optional[Tensor] = None, real: Optional[Tensor] = None) -> None:
        r"""Judge one layer's checks; ``completeness``: its absolute completeness error (0-dim), or None;
        ``real``: the real tensor it is measured on (the layer kind's ``attention_block_output``)."""
        names, values = list(layer.checks), list(layer.checks.values())
        if completeness is not None:
            # the attention block's real output; its scale over every token (pads are computed like real
            # tokens, so this is at least the scale at the real ones: never a stricter tolerance)
            if real is None:
                real = layer_kind(layer.topology).attention_block_output(layer)
            lo, hi = torch.aminmax(real)
            scale = torch.maximum(hi, -lo).clamp_min(torch.finfo(real.dtype).tiny)
            names.append("completeness of the attention block")
            values.append(completeness.to(scale.dtype) / scale)
        if not values:
            return
        rel = torch.stack([v.detach().to(device=values[0].device, dtype=torch.float64) for v in values]).tolist()
        tol = guard_tolerance(layer.source_dtype or layer.hidden_in.dtype)
        self.tolerance = max(self.tolerance, tol)
        bad = [f"{n}: {r:.3g}" for n, r in zip(names, rel) if not r <= tol and r == r]  # NaN: the non-finite rule
        if not bad:
            return
        msg = f"layer {layer.index} ({'; '.join(bad)})"
        if self.strict:
            raise ConsistencyError(self._message([msg], tol))
        self.failures.append(msg)

    def _message(self, failures: List[str], tol: float) -> str:
        return (
            f"{self.method}: the model's real tensors disagree with what the decomposition assumes, relative "
            f"differences above {tol:g} at {', '.join(failures)}. A hook or patched module that changes hidden states, "
            "attention inputs or outputs, or a norm or layer that the architecture description does not match, makes "
            "the scores a decomposition of another computation. Remove the hook (or describe the architecture "
            "correctly); see docs/reliability.md, 'Consistency guards'."
        )

    def finish(self, stacklevel: int = 4) -> None:
        r"""Warn once for the call if any layer failed (strict guards raised already)."""
        if self.failures:
            failures, self.failures = self.failures, []
            warnings.warn(self._message(failures, self.tolerance), ConsistencyWarning, stacklevel=stacklevel)


@contextlib.contextmanager
def streamed_forward(
    model: nn.Module,
    adapter,
    prepared: PreparedInputs,
    on_layer: Callable[[LayerTensors], None],
    top_model: bool = False,
    keep_calls: bool = False,
    guard: Optional[ConsistencyGuard] = None,
    probabilities: bool = True,
) -> Iterator[Tuple[Recorder, Any]]:
    r"""Run one recorded forward pass, handing every layer to ``on_layer`` as it is produced.

    Args:
        model: the user's model.
        adapter: its adapter.
        prepared: validated inputs.
        on_layer: callback receiving each layer's :class:`LayerTensors`. Before it runs,
            ``prepared.finite`` is updated with the layer's finiteness (:func:`layer_finite`).
        top_model: run the whole model (heads included) instead of the bare Transformer.
        keep_calls: allow :meth:`Recorder.rerun_layer` inside the block.
        guard: judges every layer's consistency checks before ``on_layer`` runs, and warns
            (once) when the block ends; None: a non-strict :class:`ConsistencyGuard`.
        probabilities: False: the layers' attention runs the model's own implementation
            (sdpa, ...) and the handed-over layers carry no probabilities (``probs=None``);
            reruns (``keep_calls``) still record them (:func:`~captum_normattr.models.capture.recorder.recording`).

    A forward pass that changes a recorded tensor in place before any layer was handed over
    (:class:`~captum_normattr.models.capture.recorder.RecordedTensorModifiedError`) is run once more,
    with those tensors recorded as copies.

    Yields:
        (recorder, model output). The hooks stay in place until the block ends, so that
        layers can be recomputed there.
    """
    # the last layer output checked, kept alive: while it lives, no other tensor can have its
    # memory, so the same address, shape, strides and dtype mean the same elements
    checked: List[Optional[Tensor]] = [None]
    guard = ConsistencyGuard(adapter.family) if guard is None else guard

    def checked_on_layer(layer: LayerTensors) -> None:
        guard.check(layer)
        if prepared.finite is not None:
            last, x = checked[0], layer.hidden_in
            same_input = last is not None and (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device) == (
                last.data_ptr(), last.shape, last.stride(), last.dtype, last.device)
            prepared.finite = prepared.finite & layer_finite(layer, prepared.valid, input_checked=same_input)
            checked[0] = layer.layer_out
        on_layer(layer)

    for attempt in range(2):
        with torch.no_grad(), recording(model, adapter, checked_on_layer, compute_dtype(model), keep_calls,
                                        probabilities) as rec:
            try:
                out = (model if top_model else base_model(model))(**prepared.forward_kwargs())
            except RecordedTensorModifiedError as e:
                if attempt or not e.retry:
                    raise
                continue  # the changed tensors are recorded as copies in the next pass
            rec.check_complete()
            yield rec, out
            guard.finish()
            return


@dataclass
class LayerContribution:
    r"""What one layer contributes to a decomposition.

    Attributes:
        map: (B, T, T) the layer map.
        mixing_ratio: (B, T) or None.
        errors: per-layer numbers (scalars or (B,) tensors), stacked over layers at the end.
        maps: further (B, T, T) maps kept with the layer maps (e.g. every FF scope).
    """

    map: Tensor
    mixing_ratio: Optional[Tensor] = None
    errors: Dict[str, Tensor] = field(default_factory=dict)
    maps: Dict[str, Tensor] = field(default_factory=dict)


class _MapCollector:
    r"""Keeps what the layers contribute: the maps (a :class:`LayerMapStore`) and small per-layer numbers."""

    def __init__(self, num_layers: int, causal: bool, keep_maps: bool):
        self.keep_maps = keep_maps
        self.store = LayerMapStore(num_layers, causal, dense=keep_maps)
        self.extra_maps: Dict[str, Tensor] = {}
        self.ratios: List[Optional[Tensor]] = []
        self.errors: Dict[str, List[Tensor]] = {}

    def add(self, index: int, c: LayerContribution) -> None:
        self.store.put(index, c.map)
        if self.keep_maps:
            for name, m in c.maps.items():
                if name not in self.extra_maps:
                    b, t, _ = m.shape
                    self.extra_maps[name] = m.new_zeros(b, self.store.num_layers, t, t)
                self.extra_maps[name][:, index] = m
        self.ratios.append(c.mixing_ratio)
        for name, e in c.errors.items():
            self.errors.setdefault(name, []).append(e)

    def stacked_errors(self) -> Dict[str, Tensor]:
        return {k: torch.stack(v, dim=min(1, v[0].dim())) for k, v in self.errors.items()}

    def mixing(self) -> Optional[Tensor]:
        if not self.ratios or any(r is None for r in self.ratios):
            return None
        return torch.stack(self.ratios, 1)


class configured_name:
    r"""``get_name`` in Captum's classmethod form, refined on an instance by its options.

    Captum's :meth:`~captum.attr.Attribution.get_name` is a classmethod: ``Cls.get_name()``
    names the method. Every ``get_name(self)`` of a :class:`DecompositionAttribution` subclass is
    wrapped in it (by the class itself), which keeps that form
    (``GlobEncAttribution.get_name()`` is the class's :attr:`method_name`) while an instance
    names its configuration (``GlobEncAttribution(model, "N").get_name()`` is
    ``"GlobEnc (N)"``), the name its results carry.

    Examples::

        >>> class Demo(DecompositionAttribution):
        ...     method_name = "Demo"
        ...     def get_name(self):
        ...         return f"Demo ({self.option})"
        >>> Demo.get_name()
        'Demo'
    """

    def __init__(self, instance_name: Callable[[Any], str]) -> None:
        self.instance_name = instance_name
        functools.update_wrapper(self, instance_name)

    def __get__(self, obj: Any, cls: Optional[type] = None) -> Callable[[], str]:
        if obj is None:
            owner = cls

            def class_name() -> str:
                return owner.method_name

            return class_name
        return functools.partial(self.instance_name, obj)


class DecompositionAttribution(Attribution):
    r"""Captum's interface, once for every decomposition class.

    ``decompose(inputs, target=None, additional_forward_args=None, ...)`` returns the typed
    result (every term of the decomposition); ``attribute(inputs, target=None,
    additional_forward_args=None, return_convergence_delta=False, ...)`` returns Captum's
    output: the scores (a tuple for tuple inputs), paired with the (B,) convergence delta when
    ``return_convergence_delta`` is True. A subclass implements :meth:`decompose` and, where
    its scores are not ``decompose(...).scores`` in Captum's form, :meth:`attribution_and_delta`.

    ``target`` is checked once here: an attention mask passed in its place (the positional
    ``decompose(ids, (mask,))`` of an older order) raises a ValueError; a method whose scores do
    not depend on the target (:attr:`uses_target` False: the norm-based and ALTI maps) raises
    one for any target other than None, instead of ignoring it.
    """

    #: the method's name (``Cls.get_name()``; an instance may name its options too)
    method_name = "decomposition"
    #: the scores depend on ``target`` (False: the class-agnostic maps refuse a target)
    uses_target = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("get_name")
        if callable(name) and not isinstance(name, (configured_name, classmethod, staticmethod)):
            cls.get_name = configured_name(name)  # Captum's classmethod form kept (see configured_name)

    def check_target(self, target: Any, inputs: Any) -> None:
        r"""Raise a ValueError for a mask passed as ``target``, or any target of a class-agnostic method."""
        check_target_is_not_forward_args(target, inputs, self.get_name())
        if target is not None and not self.uses_target:
            raise ValueError(
                f"{self.get_name()}: the scores do not depend on the target (the maps are class-agnostic), so "
                f"target={target!r} would be ignored. Pass target=None: the same scores explain every class; for "
                "signed scores of one class use DecompXAttribution (or ALTILogitAttribution for a next-token logit)"
            )

    def decompose(self, inputs: Any, target: Any = None, additional_forward_args: Any = None, **options: Any) -> AttributionResult:
        r"""Every term of the decomposition (a typed :class:`~captum_normattr.result.AttributionResult`)."""
        raise NotImplementedError

    def attribution_and_delta(
        self, inputs: Any, target: Any, additional_forward_args: Any, **options: Any
    ) -> Tuple[Any, Optional[Tensor]]:
        r"""(Captum-shaped scores, (B,) delta); by default from :meth:`decompose`."""
        res = self.decompose(inputs, target, additional_forward_args, **options)
        return format_output(inputs, pixel_attributions(inputs, res)), res.delta

    @log_usage()
    def attribute(
        self,
        inputs: Any,
        target: Any = None,
        additional_forward_args: Any = None,
        return_convergence_delta: bool = False,
        **options: Any,
    ) -> Any:
        r"""Captum's ``attribute``: token (or patch, pixel) scores, and optionally the convergence delta.

        Args:
            inputs: what :meth:`decompose` takes (token ids (B, T), embeddings (B, T, D),
                pixel values, or a tuple of them).
            target: what :meth:`decompose` takes (None for the class-agnostic maps).
            additional_forward_args: attention mask(s), as for :meth:`decompose`.
            return_convergence_delta: also return the (B,) convergence delta, the
                completeness error of the decomposition (see the class; never negative).
            **options: the method's own keywords (``foil=`` for the logit methods).

        Returns:
            The scores ((B, T); a tuple for tuple inputs); with ``return_convergence_delta``,
            ``(scores, delta)``.
        """
        if not isinstance(return_convergence_delta, bool):
            raise TypeError(f"return_convergence_delta must be True or False, got {return_convergence_delta!r}")
        out, delta = self.attribution_and_delta(inputs, target, additional_forward_args, **options)
        if not return_convergence_delta:
            return out
        if delta is None:  # pragma: no cover - every class here has a delta
            raise ValueError(f"{self.get_name()} has no convergence delta")
        return out, delta

    def has_convergence_delta(self) -> bool:
        return True


class LayerDecompositionAttribution(DecompositionAttribution):
    r"""Base class: per-layer token-to-token maps rolled out into token attributions.

    Subclasses implement :meth:`layer_contribution` (one layer's map, from its tensors). The
    maps do not depend on a target (:attr:`uses_target` False: ``decompose`` and ``attribute``
    take ``target=None`` only). The convergence delta of GlobEnc and ALTI is, per example, the
    largest completeness error of the attention-block parts their maps are built from (over
    layers and real tokens: ``|sum of the parts + bias part - the model's real tensor|``).

    Args:
        model: a supported Hugging Face model (``*Model``, ``*ForSequenceClassification`` or
            ``*ForCausalLM``).
        explained_position: the explained row of the rollout: an int (k >= 0: the k-th
            token counted from each example's first real token, so left padding does not
            move it; k < 0: counted from the last real token), ``"last"`` (the last real
            token) or a (B,) integer tensor of positions in the padded tensor. None
            (default): 0 ([CLS]) for encoders, ``"last"`` for decoders. Checked by
            :func:`captum_normattr.options.check_explained_position`.
        rollout: ``"raw"`` (default; the convention of the published figures) or
            ``"row_normalized"``.
        strict: raise :class:`ConsistencyError` when the model's real tensors disagree
            with what the decomposition assumes (a hook that changes hidden states, a norm
            the architecture description does not match, ...), instead of one
            :class:`ConsistencyWarning` per call (``docs/reliability.md``, "Consistency guards").
    """

    method_name = "decomposition"
    uses_target = False
    #: what this method asks of the layer kind (one of ``layer_kinds.KIND_METHODS``)
    kind_method = "maps"
    #: judge the attention block's completeness error (methods without a delta: GlobEnc, ALTI)
    guards_completeness = True

    def __init__(
        self,
        model: nn.Module,
        explained_position: Union[int, str, Tensor, None] = None,
        rollout: str = "raw",
        strict: bool = False,
    ) -> None:
        self.adapter = get_adapter(model)
        self.kind: LayerKind = layer_kind(self.adapter.topology, self.adapter.family)
        self.kind.require(self.kind_method, self.adapter.family)
        explained_position = check_explained_position(explained_position)
        if explained_position is None:
            explained_position = "last" if self.adapter.causal else 0
        if rollout not in ("raw", "row_normalized"):
            raise ValueError(f"rollout must be one of ('raw', 'row_normalized'), got {rollout!r}")
        check_convention(rollout)
        Attribution.__init__(self, model)
        self.model = model
        self.explained_position = explained_position
        self.rollout_convention = rollout
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        self.strict = strict

    # --- to implement -------------------------------------------------------------
    def layer_contribution(self, layer: LayerTensors, valid: Tensor, keep_maps: bool) -> LayerContribution:
        r"""One layer's contribution; ``keep_maps``: the caller keeps further per-layer maps."""
        raise NotImplementedError

    def finish_extras(self, errors: Dict[str, Tensor]) -> Dict[str, Tensor]:
        r"""The result's extras from the stacked per-layer errors (override to derive more).

        ``example_completeness_error`` (B, L) becomes its largest value over the layers (B,):
        the result's delta.
        """
        if "example_completeness_error" in errors:
            errors["example_completeness_error"] = errors["example_completeness_error"].amax(1)
        return errors

    def attention_block_errors(self, layer: LayerTensors, valid: Tensor) -> Dict[str, Tensor]:
        r"""The attention block's completeness error of one layer: largest over the batch (0-dim,
        ``completeness_error``) and per example ((B,), ``example_completeness_error``)."""
        example = self.kind.example_completeness_error(layer, valid)
        return {"completeness_error": example.max(), "example_completeness_error": example}

    # --- shared -------------------------------------------------------------------
    def decompose(  # type: ignore[override]
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        target: None = None,
        additional_forward_args: Any = None,
        return_layer_maps: bool = True,
        return_rollout: bool = True,
    ) -> DecompositionResult:
        r"""Decompose every layer as the forward pass reaches it, and roll the maps out.

        Args:
            inputs: token ids (B, T) (or word embeddings (B, T, D)), or a 1-tuple.
            target: None: the maps are class-agnostic (any other value raises a ValueError,
                an attention mask passed here too: give it as ``additional_forward_args=``).
            additional_forward_args: attention_mask (B, T) or (attention_mask, token_type_ids).
            return_layer_maps: keep the (B, L, T, T) layer maps (and, for the FF
                decomposition, every scope's maps) in the result.
            return_rollout: also form the full (B, T, T) rollout, O(L T^3); without it only
                the explained rows are rolled out (O(L T^2)). Switch both off for long inputs.

        Returns:
            :class:`~captum_normattr.DecompositionResult`.
        """
        self.check_target(target, inputs)
        prepared = prepare_inputs(self.model, self.adapter, inputs, additional_forward_args)
        valid = prepared.valid
        pos = explained_positions(self.explained_position, valid)
        collector = _MapCollector(len(layer_modules(self.model, self.adapter)), self.adapter.causal, return_layer_maps or return_rollout)
        guard = ConsistencyGuard(self.get_name(), self.strict)

        def on_layer(layer: LayerTensors) -> None:
            dev = layer.hidden_in.device  # the layer's device (a device_map may spread the layers)
            c = self.layer_contribution(layer, valid.to(dev), return_layer_maps)
            if self.guards_completeness and "completeness_error" in c.errors:
                guard.check(replace(layer, checks={}), c.errors["completeness_error"], self.kind.attention_block_output(layer))
            collector.add(layer.index, c if dev == valid.device else tensors_to(c, valid.device))

        with streamed_forward(self.model, self.adapter, prepared, on_layer, guard=guard):
            pass
        with torch.no_grad():
            maps = collector.store.dense()
            scores, score_scale = collector.store.rollout_rows_scaled(pos, self.rollout_convention)
            scores = scores * valid.to(scores.dtype)
            joint, joint_scale = rollout_scaled(maps, self.rollout_convention) if return_rollout else (None, None)
            extras = self.finish_extras(collector.stacked_errors())
            extras.update(rollout_scale_extras(self.get_name(), scores, score_scale, joint_scale, stacklevel=4))
            extras.update(image_extras(prepared, scores))
            for name, m in collector.extra_maps.items():
                extras[name] = m
        result = DecompositionResult(
            method=self.get_name(),
            scores=scores,
            attention_mask=prepared.attention_mask,
            explained_position=pos,
            delta=extras.get("example_completeness_error"),
            extras=extras,
            layer_maps=maps if return_layer_maps else None,
            rollout=joint,
            rollout_convention=self.rollout_convention,
            mixing_ratio=collector.mixing(),
        )
        return mark_non_finite(result, prepared.finite)

    def attribution_and_delta(self, inputs, target, additional_forward_args, **options):
        res = self.decompose(inputs, target, additional_forward_args, return_layer_maps=False, return_rollout=False,
                             **options)
        return format_output(inputs, pixel_attributions(inputs, res)), res.delta

    def get_name(self) -> str:
        return self.method_name
