r"""Attribution methods as harness callables: Captum's gradient baselines and ours.

A *method* is a named callable ``(input_ids (B,T) long, attention_mask (B,T),
target (B,) long) -> (B,T) token scores``. :class:`Method` carries the name and whether
the scores depend on ``target``; the factories build methods from

- Captum's ``Saliency``, ``InputXGradient`` (on the word embeddings, fed through
  ``inputs_embeds``), ``LayerGradientXActivation`` (on the embedding-block output, after
  its LayerNorm: GlobEnc's gradient x input) and ``LayerIntegratedGradients`` (on either
  layer), reduced to token scores by the L2 norm or the sum over features;
- our Captum classes, from the method registry (:data:`captum_normattr.attr.methods.METHODS`:
  the class, its options and whether it uses ``target``): :func:`ours` builds one by its
  registry key, :func:`our_methods` every one that applies to the model, and
  :func:`normattr_method` wraps any object whose
  ``attribute(input_ids, additional_forward_args=(attention_mask,))`` returns (B, T).

Captum pitfalls handled here (docs/design.md, section 14): the attention mask always travels in
``additional_forward_args`` (so that IG's step expansion repeats it), gradients are
re-enabled when a metric calls under ``torch.no_grad()``, IG keeps [CLS]/[SEP] in its
baseline and pads only the other tokens, and the model stays in eval mode.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import Tensor

from .classifier import SequenceClassifier

MethodFn = Callable[[Tensor, Tensor, Tensor], Tensor]

__all__ = [
    "Method",
    "MethodFn",
    "reduce_features",
    "saliency",
    "input_x_gradient",
    "gradient_x_input_embedding_output",
    "integrated_gradients",
    "normattr_method",
    "ours",
    "our_methods",
    "globenc",
    "alti",
    "ff",
    "decompx",
    "default_baselines",
]

_REDUCTIONS = ("l2", "sum", "l1")
_LABEL = {"l2": "L2", "sum": "sum", "l1": "L1"}


def reduce_features(attr: Tensor, reduction: str) -> Tensor:
    r"""Token scores (B, T) from feature attributions (B, T, D).

    Args:
        attr: (B, T, D).
        reduction: ``"l2"`` (norm over features, >= 0), ``"sum"`` (signed sum) or
            ``"l1"`` (sum of absolute values).

    Returns:
        (B, T).

    Examples:
        >>> reduce_features(torch.tensor([[[3., -4.]]]), "l2")
        tensor([[5.]])
    """
    if attr.dim() != 3:
        raise ValueError(f"expected feature attributions (B, T, D), got shape {tuple(attr.shape)}")
    if reduction == "l2":
        return attr.norm(dim=-1)
    if reduction == "sum":
        return attr.sum(-1)
    if reduction == "l1":
        return attr.abs().sum(-1)
    raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


@dataclass
class Method:
    r"""A named token-attribution method for the harness.

    Args:
        name: readable name used in tables ("GlobEnc (N_ENC)", "IG (sum, 50 steps)").
        fn: ``(input_ids, attention_mask, target) -> (B, T)`` scores.
        uses_target: False when the scores do not depend on ``target`` (norm-based
            decompositions explain the [CLS] representation, not a class); the harness
            then calls it once per batch whatever the protocol's target.
        description: free text for reports.

    Calling the method validates the output: shape (B, T), float, finite at real tokens;
    pads are set to exactly 0 and the result is detached.

    Examples:
        >>> m = Method("first token", lambda ids, mask, t: (torch.arange(ids.shape[1]) == 0).float().expand(ids.shape))
        >>> m(torch.tensor([[101, 5, 102]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([0]))
        tensor([[1., 0., 0.]])
    """

    name: str
    fn: MethodFn
    uses_target: bool = True
    description: str = ""
    info: dict = field(default_factory=dict)

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, target: Tensor) -> Tensor:
        out = self.fn(input_ids, attention_mask, target)
        if isinstance(out, tuple):
            if len(out) != 1:
                raise ValueError(f"method {self.name!r} returned a tuple of {len(out)} tensors, expected one")
            out = out[0]
        if not isinstance(out, Tensor) or out.shape != input_ids.shape:
            raise ValueError(
                f"method {self.name!r} must return token scores of shape {tuple(input_ids.shape)}, "
                f"got {getattr(out, 'shape', type(out))}"
            )
        if not out.dtype.is_floating_point:
            raise TypeError(f"method {self.name!r} returned {out.dtype} scores, expected a float dtype")
        out = out.detach().masked_fill(~attention_mask.bool(), 0.0)
        if not torch.isfinite(out).all():
            raise ValueError(f"method {self.name!r} returned NaN or inf scores")
        return out


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def saliency(clf: SequenceClassifier, reduction: str = "l2") -> Method:
    r"""Captum ``Saliency`` (absolute gradient of the target logit) w.r.t. the word embeddings.

    Args:
        clf: the wrapped classifier.
        reduction: ``"l2"`` (gradient norm, the usual) or ``"sum"``/``"l1"`` of |grad|.

    Returns:
        a :class:`Method` named ``"Saliency (L2)"`` etc.
    """
    from captum.attr import Saliency

    _check_reduction(reduction)
    sal = Saliency(clf.logits_from_embeds)

    def fn(ids: Tensor, mask: Tensor, target: Tensor) -> Tensor:
        with torch.enable_grad():
            emb = clf.embed(ids).detach().requires_grad_()
            a = sal.attribute(emb, target=target, additional_forward_args=(mask,), abs=True)
        return reduce_features(a, reduction)

    return Method(f"Saliency ({_LABEL[reduction]})", fn, True, "Captum Saliency on the word embeddings")


def input_x_gradient(clf: SequenceClassifier, reduction: str = "l2") -> Method:
    r"""Captum ``InputXGradient`` on the word embeddings (before position embeddings and LayerNorm).

    Args:
        clf: the wrapped classifier.
        reduction: ``"l2"`` or ``"sum"`` (signed) or ``"l1"``.

    Returns:
        a :class:`Method` named ``"InputXGradient (L2)"`` etc.
    """
    from captum.attr import InputXGradient

    _check_reduction(reduction)
    ixg = InputXGradient(clf.logits_from_embeds)

    def fn(ids: Tensor, mask: Tensor, target: Tensor) -> Tensor:
        with torch.enable_grad():
            emb = clf.embed(ids).detach().requires_grad_()
            a = ixg.attribute(emb, target=target, additional_forward_args=(mask,))
        return reduce_features(a, reduction)

    return Method(f"InputXGradient ({_LABEL[reduction]})", fn, True, "Captum InputXGradient on the word embeddings")


def gradient_x_input_embedding_output(clf: SequenceClassifier, reduction: str = "l2") -> Method:
    r"""GlobEnc's gradient x input: on the embedding-block output (after the embedding LayerNorm).

    Captum ``LayerGradientXActivation`` on ``clf.embedding_layer``; with the default L2
    reduction this is the reference of the GlobEnc Spearman protocol (docs/design.md, section 15).

    Args:
        clf: the wrapped classifier.
        reduction: ``"l2"`` (default) or ``"sum"`` or ``"l1"``.

    Returns:
        a :class:`Method` named ``"GradXInput emb-out (L2)"`` etc.
    """
    from captum.attr import LayerGradientXActivation

    _check_reduction(reduction)
    lgxa = LayerGradientXActivation(clf.logits, clf.embedding_layer)

    def fn(ids: Tensor, mask: Tensor, target: Tensor) -> Tensor:
        with torch.enable_grad():
            a = lgxa.attribute(ids, target=target, additional_forward_args=(mask,))
        if isinstance(a, (tuple, list)):
            a = a[0]
        return reduce_features(a, reduction)

    return Method(
        f"GradXInput emb-out ({_LABEL[reduction]})", fn, True,
        "Captum LayerGradientXActivation on the embedding output (after LayerNorm)",
    )


class _SharedAttribution:
    r"""Computes feature attributions once for several reductions of the same call.

    The last ``size`` calls are remembered; a method asking for the same
    (input_ids, attention_mask, target) as a recent call reuses its result. ``seconds`` is
    the time of the real computation of the last call, reported for every method that
    shares it.
    """

    def __init__(self, compute: Callable[[Tensor, Tensor, Tensor], Tensor], size: int = 8) -> None:
        self.compute = compute
        self.size = size
        self._cache: list = []  # [(ids, mask, target, value, seconds)], most recent last
        self.seconds = 0.0

    def __call__(self, ids: Tensor, mask: Tensor, target: Tensor) -> Tensor:
        for i, (k_ids, k_mask, k_t, value, secs) in enumerate(self._cache):
            if (k_ids.shape == ids.shape and k_t.shape == target.shape and torch.equal(k_ids, ids)
                    and torch.equal(k_mask, mask) and torch.equal(k_t, target)):
                self._cache.append(self._cache.pop(i))
                self.seconds = secs
                return value
        import time

        t0 = time.perf_counter()
        value = self.compute(ids, mask, target)
        self.seconds = time.perf_counter() - t0
        self._cache.append((ids.clone(), mask.clone(), target.clone(), value, self.seconds))
        del self._cache[: -self.size]
        return value


def integrated_gradients(
    clf: SequenceClassifier,
    n_steps: int = 50,
    reduction: Union[str, Sequence[str]] = "sum",
    layer: str = "word_embeddings",
    baseline: str = "pad",
    internal_batch_size: Optional[int] = None,
    method: str = "gausslegendre",
) -> Union[Method, List[Method]]:
    r"""Captum ``LayerIntegratedGradients`` from a reference sequence, reduced to token scores.

    The reference keeps the special tokens and replaces every other token by ``baseline``
    (the Captum BERT tutorial's choice), so IG integrates along the word-embedding path
    from the reference to the input; ``layer="embeddings"`` attributes on the embedding
    block's output instead (same path, measured after position embeddings and LayerNorm).

    Args:
        clf: the wrapped classifier.
        n_steps: integration steps (each costs one forward and backward per example).
        reduction: ``"sum"`` (signed; completeness holds for it) or ``"l2"`` or ``"l1"``;
            or a sequence of them: then one method per reduction is returned, sharing
            one IG computation per call (each reports the time of that computation).
        layer: ``"word_embeddings"`` or ``"embeddings"``.
        baseline: ``"pad"``, ``"mask"`` or ``"zero"`` (zero word embeddings; only with
            ``layer="word_embeddings"``).
        internal_batch_size: Captum's chunking of the B * n_steps expanded batch.
        method: Captum's approximation method.

    Returns:
        a :class:`Method` named ``"IG word emb. (sum, 50 steps)"`` etc., or a list of them.

    Examples:
        >>> ig_sum, ig_l2 = integrated_gradients(clf, 50, ("sum", "l2"))  # doctest: +SKIP
    """
    from captum.attr import IntegratedGradients, LayerIntegratedGradients

    reductions = [reduction] if isinstance(reduction, str) else list(reduction)
    if not reductions:
        raise ValueError("give at least one reduction")
    for r in reductions:
        _check_reduction(r)
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    if layer not in ("word_embeddings", "embeddings"):
        raise ValueError(f"layer must be 'word_embeddings' or 'embeddings', got {layer!r}")
    if baseline not in ("pad", "mask", "zero"):
        raise ValueError(f"baseline must be 'pad', 'mask' or 'zero', got {baseline!r}")
    if baseline == "zero" and layer != "word_embeddings":
        raise ValueError("baseline='zero' is defined for layer='word_embeddings' only")

    if baseline == "zero":
        ig = IntegratedGradients(clf.logits_from_embeds)

        def feature_attr(ids: Tensor, mask: Tensor, target: Tensor) -> Tensor:
            with torch.enable_grad():
                emb = clf.embed(ids).detach().requires_grad_()
                return ig.attribute(
                    emb, baselines=torch.zeros_like(emb), target=target, additional_forward_args=(mask,),
                    n_steps=n_steps, method=method, internal_batch_size=internal_batch_size,
                ).detach()
    else:
        module = clf.word_embeddings if layer == "word_embeddings" else clf.embedding_layer
        lig = LayerIntegratedGradients(clf.logits, module)
        ref_id = clf.pad_token_id if baseline == "pad" else clf.require_mask_token()

        def feature_attr(ids: Tensor, mask: Tensor, target: Tensor) -> Tensor:
            special = clf.special_mask(ids, mask)
            ref = torch.where(special, ids, torch.full_like(ids, ref_id))
            with torch.enable_grad():
                return lig.attribute(
                    ids, baselines=ref, target=target, additional_forward_args=(mask,),
                    n_steps=n_steps, method=method, internal_batch_size=internal_batch_size,
                ).detach()

    shared = _SharedAttribution(feature_attr) if len(reductions) > 1 else None
    where = "word emb." if layer == "word_embeddings" else "emb-out"
    methods = []
    for red in reductions:
        info = {"n_steps": n_steps, "baseline": baseline, "layer": layer}
        if shared is not None:
            info["_cost"] = shared

        def fn(ids: Tensor, mask: Tensor, target: Tensor, _red: str = red) -> Tensor:
            a = shared(ids, mask, target) if shared is not None else feature_attr(ids, mask, target)
            return reduce_features(a, _red)

        methods.append(Method(
            f"IG {where} ({_LABEL[red]}, {n_steps} steps{'' if baseline == 'pad' else ', ' + baseline + ' ref.'})",
            fn, True,
            f"Captum {'Layer' if baseline != 'zero' else ''}IntegratedGradients on {layer}, {baseline} baseline",
            info,
        ))
    return methods[0] if isinstance(reduction, str) else methods


def _accepts_target(f) -> bool:
    try:
        return "target" in inspect.signature(f).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def normattr_method(attribution, name: Optional[str] = None, uses_target: Optional[bool] = None) -> Method:
    r"""Wrap one of our Captum classes (or anything with the same ``attribute``) as a method.

    Args:
        attribution: e.g. ``GlobEncAttribution(model, map_name="N_ENC")``; its
            ``attribute(input_ids, additional_forward_args=(attention_mask,))`` must give (B, T).
        name: table name; default ``attribution.get_name()``.
        uses_target: whether the scores depend on the target class. None (default): what
            the method registry says of the attribution's class (False for the norm-based
            decompositions, which explain the [CLS] representation; True for DecompX), and
            False for a class it does not list. When True the target is passed as ``target=``.

    Returns:
        a :class:`Method`.

    Examples:
        >>> from captum_normattr import GlobEncAttribution  # doctest: +SKIP
        >>> m = normattr_method(GlobEncAttribution(model, map_name="N_ENC"))  # doctest: +SKIP
    """
    from captum_normattr.attr.methods import spec_for

    if not hasattr(attribution, "attribute"):
        raise TypeError(f"{type(attribution).__name__} has no attribute() method")
    if uses_target is None:
        spec = spec_for(attribution)
        uses_target = bool(spec is not None and spec.uses_target)
    if name is None:
        name = attribution.get_name() if hasattr(attribution, "get_name") else type(attribution).__name__
    pass_target = uses_target and _accepts_target(attribution.attribute)

    def fn(ids: Tensor, mask: Tensor, target: Tensor) -> Tensor:
        if pass_target:
            return attribution.attribute(ids, additional_forward_args=(mask,), target=target)
        return attribution.attribute(ids, additional_forward_args=(mask,))

    return Method(name, fn, uses_target, f"captum_normattr {type(attribution).__name__}")


def ours(model, key: str, name: Optional[str] = None, **kwargs) -> Method:
    r"""The registry's method ``key`` (``"globenc"``, ``"alti"``, ``"ff"``, ``"decompx"`` ...) as a harness method.

    Args:
        model: the Hugging Face model.
        key: a key of :data:`captum_normattr.attr.methods.METHODS`.
        name: table name (default: the attribution's ``get_name()``).
        **kwargs: constructor keywords of the method's class (``map_name``, ``bias_mode`` ...).

    Returns:
        a :class:`Method` whose ``uses_target`` is the registry's.

    Examples:
        >>> m = ours(model, "ff", contribution="alti")  # ALTI+FF  # doctest: +SKIP
    """
    from captum_normattr.attr.methods import get_method

    spec = get_method(key)
    return normattr_method(spec.build(model, **kwargs), name=name, uses_target=spec.uses_target)


def our_methods(model, keys: Optional[Sequence[str]] = None) -> List[Method]:
    r"""Every registry method (or those in ``keys``) that applies to ``model``, with its defaults.

    Args:
        model: the Hugging Face model; a decoder (``config.is_decoder`` or a causal-LM
            architecture) takes the methods for decoders, anything else those for encoders.
        keys: registry keys to build (default: all that apply).

    Returns:
        a list of :class:`Method`, in registry order.
    """
    from captum_normattr.attr.methods import METHODS, get_method

    cfg = getattr(model, "config", None)
    decoder = bool(getattr(cfg, "is_decoder", False)) or any(
        a.endswith(("ForCausalLM", "LMHeadModel")) for a in (getattr(cfg, "architectures", None) or [])
    ) or type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    family = "decoders" if decoder else "encoders"
    specs = [get_method(k) for k in keys] if keys is not None else list(METHODS.values())
    return [ours(model, s.key) for s in specs if s.cls is not None and s.applies_to(family)]


def globenc(model, map_name: str = "N_ENC", rollout: str = "raw", name: Optional[str] = None, **kwargs) -> Method:
    r"""The registry's ``globenc`` (``GlobEncAttribution(model, map_name=..., rollout=...)``) as a method.

    Args:
        model: the Hugging Face model (the classifier; the encoder is found by the adapters).
        map_name: one of ``captum_normattr.GLOBENC_MAPS``.
        rollout: ``"raw"`` (the published convention) or ``"row_normalized"``.
        name: table name, default ``"GlobEnc-family {map_name}"`` with the convention if not raw.
        **kwargs: passed on to ``GlobEncAttribution``.
    """
    if name is None:
        name = map_name + ("" if rollout == "raw" else f" ({rollout})")
    return ours(model, "globenc", name=name, map_name=map_name, rollout=rollout, **kwargs)


def alti(model, rollout: str = "raw", name: Optional[str] = None, **kwargs) -> Method:
    r"""The registry's ``alti`` (``ALTIAttribution(model)``) as a method (target-independent)."""
    return ours(model, "alti", name=name or ("ALTI" if rollout == "raw" else f"ALTI ({rollout})"), rollout=rollout,
                **kwargs)


def ff(model, contribution: str = "norm", name: Optional[str] = None, **kwargs) -> Method:
    r"""The registry's ``ff``: GlobEnc+FF (``contribution="norm"``) or ALTI+FF (``"alti"``) as a method.

    Args:
        model: the Hugging Face model.
        contribution: ``"norm"`` or ``"alti"``.
        name: table name (default: ``"GlobEnc+FF"`` / ``"ALTI+FF"`` or the scope's name).
        **kwargs: passed on to ``FFIntegratedDecomposition`` (``scope`` ...).
    """
    return ours(model, "ff", name=name, contribution=contribution, **kwargs)


def decompx(model, bias_mode: str = "separate", name: Optional[str] = None, **kwargs) -> Method:
    r"""The registry's ``decompx`` (``DecompXAttribution(model, bias_mode=...)``); it explains the protocol's target class.

    Args:
        model: a supported sequence classifier (``BertForSequenceClassification`` ...).
        bias_mode: ``"separate"`` (default) or ``"spread"``.
        name: table name, default ``"DecompX"`` / ``"DecompX (spread bias)"``.
        **kwargs: passed on to ``DecompXAttribution`` (``memory_budget_mb`` ...).

    Returns:
        a :class:`Method` with ``uses_target=True`` (signed scores of the target class).
    """
    return ours(model, "decompx", name=name, bias_mode=bias_mode, **kwargs)


def default_baselines(clf: SequenceClassifier, ig_steps: int = 50, internal_batch_size: Optional[int] = None) -> list:
    r"""The Captum baselines of the faithfulness tables.

    GradXInput on the embedding output (L2: GlobEnc's reference), InputXGradient and
    Saliency on the word embeddings (L2 and sum), and LayerIntegratedGradients on the
    word embeddings (sum and L2 of one shared computation), ``ig_steps`` steps, [PAD] reference.

    Returns:
        a list of :class:`Method`.
    """
    return [
        gradient_x_input_embedding_output(clf, "l2"),
        input_x_gradient(clf, "l2"),
        input_x_gradient(clf, "sum"),
        saliency(clf, "l2"),
        *integrated_gradients(clf, ig_steps, ("sum", "l2"), internal_batch_size=internal_batch_size),
    ]
