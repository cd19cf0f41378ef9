r"""The two base classes of the decomposition attributions: Captum's interface, and the rolled-out layer maps.

:class:`DecompositionAttribution` gives every class Captum's ``attribute`` (with the convergence
delta) from its ``decompose``; :class:`LayerDecompositionAttribution` turns each layer into its
map the moment the forward pass has produced it (the streaming engine,
:func:`~captum_normattr.models.engine.streamed_forward`), rolls the maps out, and explains n
positions of a causal LM from one forward pass (:meth:`LayerDecompositionAttribution.explain_positions`).
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from captum.attr import Attribution
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.attr.images import image_extras, pixel_attributions
from captum_normattr.attr.inputs import check_target_is_not_forward_args, explained_positions, prepare_inputs
from captum_normattr.attr.positions import (
    PositionExplanation,
    next_token_output,
    position_log_probs,
    position_request,
    warn_non_finite,
)
from captum_normattr.models.prepared import PreparedInputs
from captum_normattr.decompose.kinds.registry import LayerKind, layer_kind
from captum_normattr.decompose.primitives.multi_position import rollout_rows_at_scaled
from captum_normattr.decompose.primitives.rollout import check_convention, rollout_scaled
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.adapters import get_adapter, layer_modules
from captum_normattr.models.engine import LayerContribution, MapCollector, mark_non_finite, streamed_forward
from captum_normattr.models.guard import ConsistencyGuard
from captum_normattr.models.weights import tensors_to
from captum_normattr.options import check_explained_position
from captum_normattr.result import AttributionResult, DecompositionResult

__all__ = [
    "DecompositionAttribution",
    "LayerDecompositionAttribution",
    "configured_name",
    "format_output",
    "rollout_scale_extras",
]


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

    @configured_name
    def get_name(self) -> str:
        r"""The method's readable name (:attr:`method_name`; a subclass may name its options too)."""
        return self.method_name

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
        r"""True: every decomposition reports its completeness error as the convergence delta."""
        return True

    @property
    def explains_next_tokens(self) -> bool:
        r"""Whether this instance explains positions of a causal LM (its class's ``explain_positions``
        applies to its model; the LLM API, :class:`~captum_normattr.attr.llm.DecompositionLLMAttribution`,
        takes it). False here; the classes with an ``explain_positions`` hook say when it applies."""
        return False


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
        strict: raise :class:`~captum_normattr.models.guard.ConsistencyError` when the model's real tensors disagree
            with what the decomposition assumes (a hook that changes hidden states, a norm
            the architecture description does not match, ...), instead of one
            :class:`~captum_normattr.models.guard.ConsistencyWarning` per call (``docs/reliability.md``, "Consistency guards").
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
        self.check_model()
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
    def check_model(self) -> None:
        r"""Raise for a model this method does not decompose: by default, one whose layer kind does not
        decompose :attr:`kind_method` (:class:`~captum_normattr.UnsupportedModelError`)."""
        self.kind.require(self.kind_method, self.adapter.family)

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
    def stream_maps(
        self, prepared: PreparedInputs, keep_maps: bool, extra_maps: bool, final_norm: bool = False
    ) -> Tuple[MapCollector, Optional[Tensor]]:
        r"""One recorded forward pass: every layer's contribution as the pass produces it, judged by the guard.

        :meth:`decompose` and :meth:`explain_positions` both run it.

        Args:
            prepared: the validated inputs.
            keep_maps: keep every layer's dense map (the full rollout, the layer maps, or
                rows at several positions); False: only the explained rows' rollout.
            extra_maps: keep each layer's further maps (:attr:`LayerContribution.maps`).
            final_norm: also return the final norm's real output (B, T, D).

        Returns:
            (:class:`~captum_normattr.models.engine.MapCollector`, the final norm's output or None).
        """
        valid = prepared.valid
        causal = self.adapter.causal and not prepared.two_way  # two-way spans: full maps (docs/vlm.md)
        collector = MapCollector(len(layer_modules(self.model, self.adapter)), causal, keep_maps)
        guard = ConsistencyGuard(self.get_name(), self.strict)

        def on_layer(layer: LayerTensors) -> None:
            dev = layer.hidden_in.device  # the layer's device (a device_map may spread the layers)
            c = self.layer_contribution(layer, valid.to(dev), extra_maps)
            if self.guards_completeness and "completeness_error" in c.errors:
                guard.check(replace(layer, checks={}), c.errors["completeness_error"], self.kind.attention_block_output(layer))
            collector.add(layer.index, c if dev == valid.device else tensors_to(c, valid.device))

        with streamed_forward(self.model, self.adapter, prepared, on_layer, guard=guard) as (rec, _):
            f_out = rec.final_norm_tensors()[2] if final_norm else None
        return collector, f_out

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
            additional_forward_args: attention_mask (B, T), or the model inputs by name,
                ``{"attention_mask": ..., "token_type_ids": ..., "position_ids": ...}``
                (``(attention_mask, token_type_ids)`` positionally for BERT-like encoders only;
                docs/reliability.md, "Position ids and every other model input by name").
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
        collector, _ = self.stream_maps(prepared, return_layer_maps or return_rollout, return_layer_maps)
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

    @property
    def explains_next_tokens(self) -> bool:
        r"""True for a causal LM: :meth:`explain_positions` rolls its maps out at any positions."""
        return bool(self.adapter.causal)

    def explain_positions(
        self,
        input_ids: Tensor,
        positions: Tensor,
        target: Optional[Tensor] = None,
        quantity: str = "logit",
        foil: Any = None,
        additional_forward_args: Any = None,
    ) -> PositionExplanation:
        r"""The rollout rows of n positions of one sequence of a causal LM, from one forward pass.

        All positions share the per-layer maps of that pass; row k equals the single-position
        call (``explained_position``) at ``positions[k]``, up to rounding. The rows are
        class-agnostic: ``quantity`` and ``foil`` are ignored (with a warning).

        Args:
            input_ids: (T,) or (1, T) token ids (one sequence, no padding).
            positions: (n,) the explained positions.
            target: (n,) the next token at each position, or None; it only yields ``log_probs``.
            quantity, foil: see :func:`~captum_normattr.attr.positions.position_request` (ignored).
            additional_forward_args: the model's further inputs by keyword (an attention mask of ones,
                a vision-language model's ``pixel_values``, ...), as in :meth:`decompose`.

        Returns:
            :class:`~captum_normattr.attr.positions.PositionExplanation` (``quantity="rollout"``,
            unsigned; ``extras["rollout_log2_scale"]`` where a raw rollout exceeds the dtype).
        """
        ids, positions, target, quantity, foil = position_request(self.model, input_ids, positions, target, quantity,
                                                                  foil)
        if not self.adapter.causal:
            raise ValueError("explain_positions explains causal LMs; this attribution wraps an encoder")
        if quantity != "logit" or foil is not None:
            warnings.warn(f"{self.get_name()} rows are class-agnostic: quantity and foil are ignored",
                          UserWarning, stacklevel=2)
        prepared = prepare_inputs(self.model, self.adapter, ids.unsqueeze(0), additional_forward_args)
        valid = prepared.valid
        output = next_token_output(self.model, self.adapter) if target is not None else None
        collector, f_out = self.stream_maps(prepared, True, False,
                                            final_norm=output is not None and self.adapter.final_norm is not None)
        store = collector.store
        with torch.no_grad():
            scores, scale = rollout_rows_at_scaled(store, positions, self.rollout_convention)
            scores, scale = scores[0] * valid[0].to(store.dense().dtype), scale[0]
            f_rows = None if f_out is None else f_out[0, positions.to(f_out.device)].to(valid.device)
            log_probs = None if f_rows is None else position_log_probs(output, f_rows, target)
        if warn_non_finite(prepared):
            scores = torch.full_like(scores, float("nan"))
        extras = {}
        if bool((scale != 0).any()):  # a raw rollout beyond the dtype: returned divided by 2**scale (docs/reliability.md)
            extras["rollout_log2_scale"] = scale
            warnings.warn(
                f"{self.get_name()}: the raw rollout of explained position(s) {positions[scale != 0].tolist()} exceeds "
                f"{scores.dtype}'s range (the layer maps' rows are not normalised and their product over the layers "
                "grows past the dtype); those rows are divided by 2**extras['rollout_log2_scale'] (exact ratios and "
                "ranks); rollout='row_normalized' stays bounded.", RuntimeWarning, stacklevel=2)
        return PositionExplanation(method=self.get_name(), scores=scores, positions=positions, signed=False,
                                   target=target, quantity="rollout", log_probs=log_probs, extras=extras)
