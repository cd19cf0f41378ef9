r"""Decoder faithfulness harness: any attributor, items with a target, a foil and evidence, one protocol.

An *attributor* is a callable ``f(input_ids: LongTensor (T,), target: int, foil: Optional[int])
-> Tensor (T,)`` returning one score per prompt token explaining d = logit(target) - logit(foil)
at the last position (d = logit(target) when ``foil`` is None); higher = more important for d.
It may carry ``name`` (str), ``signed`` (bool: scores can be negative and their sign means
something) and ``needs_grad`` (bool: False lets the harness call it under ``torch.no_grad()``).
:func:`as_attributor` turns this package's Captum classes (ALTI-Logit, DecompX, ALTI, GlobEnc,
value zeroing, ...), Captum's own ``Saliency`` / ``InputXGradient`` / ``IntegratedGradients`` /
``FeatureAblation`` (run on the input embeddings, on d) or a plain callable into one;
:func:`make_attributor` builds one from a short spec (``"alti-logit"``, ``"ig:16"``, ...).

:func:`evaluate_item` scores every attributor on one :class:`~captum_normattr.evaluation.decoder_tasks.TaskItem`
(the metrics of ``docs/evaluation.md``, "Compare methods on your model"): evidence top-1 and
MRR, deletion and insertion AOPC, ABPC, the sink share and the cost in forwards, each
with the first position (the attention sink) ranked and with it left out; :func:`run_round_robin`
evaluates several tasks one item of each per round. ``benchmarks/faithfulness/decoder_faithfulness.py``
is built on these functions.

Metrics of one item, for the curve steps ``ks`` (default 1, 2, 3) and d the model's
target-minus-foil logit difference on the full prompt (only tokens other than the explained
last one are ranked or removed; with ``exclude_sink`` position 0 neither, scores unchanged):

- deletion AOPC = mean over k of (d - d_MoRF(k)) / |d|, d_MoRF(k): the prompt without its k
  most relevant tokens (most-relevant-first, MoRF);
- insertion AOPC = mean over k of d_only(k) / |d|, the prompt reduced to its k most relevant
  tokens (and the explained token; and position 0 with ``exclude_sink``);
- ABPC (the area between the perturbation curves of AttnLRP, Achtibat et al. 2024) = mean
  over k of (d_LeRF(k) - d_MoRF(k)) / |d|, d_LeRF(k): the prompt without its k least relevant
  tokens (lowest scores first: the most negative ones of a signed method). The same steps and
  normalisation as the AOPCs; a random ranking has expected ABPC 0, larger is better.

Examples:
    >>> from captum_normattr import ALTILogitAttribution  # doctest: +SKIP
    >>> from captum_normattr.evaluation.decoder_tasks import make_task  # doctest: +SKIP
    >>> items = keep_correct(model, make_task("sva", tokenizer, 40), "sva")  # doctest: +SKIP
    >>> attributors = {"ALTI-Logit": as_attributor(ALTILogitAttribution(model)),
    ...                "IG-16": make_attributor("ig:16", model)}  # doctest: +SKIP
    >>> evaluate_item(model, attributors, items[0])["ALTI-Logit"]["abpc_no_sink"]  # doctest: +SKIP
    2.41
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from captum_normattr.decompose.primitives.rollout import rollout

from .decoder_tasks import TaskItem, evidence_ranks, fact_answer_tokens, removal_sequences, sink_share
from .statistics import ItemValues

__all__ = [
    "Attributor",
    "AttributorFn",
    "CallableAttributor",
    "CaptumEmbeddingAttributor",
    "DecompositionAttributor",
    "AttentionAttributor",
    "RandomAttributor",
    "as_attributor",
    "make_attributor",
    "make_attributors",
    "METHOD_SPECS",
    "PER_ITEM",
    "DEFAULT_KS",
    "TaskState",
    "last_logits",
    "last_logit_diff",
    "keep_correct",
    "forward_time",
    "evaluate_item",
    "run_round_robin",
]

#: f(input_ids (T,), target, foil) -> (T,) scores.
AttributorFn = Callable[[Tensor, int, Optional[int]], Tensor]

#: The curve steps: numbers of tokens removed (deletion, ABPC) or kept (insertion).
DEFAULT_KS = (1, 2, 3)

#: The metrics kept per item in the JSON (paired differences are computed from them).
PER_ITEM = ["top1_no_sink", "deletion_aopc_no_sink", "deletion_aopc_with_sink", "insertion_aopc_no_sink", "cost_forwards",
            "abpc_no_sink", "abpc_with_sink"]


class Attributor:
    r"""Base class of the attributors built here (any callable with the same signature works too).

    Attributes:
        name: the method's name in results.
        signed: the scores are signed (their sign means something).
        needs_grad: the method needs autograd (False: the harness calls it under ``torch.no_grad()``).
    """

    name: str = "attributor"
    signed: bool = False
    needs_grad: bool = True

    def __call__(self, input_ids: Tensor, target: int, foil: Optional[int] = None) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, signed={self.signed})"


class CallableAttributor(Attributor):
    r"""A plain callable ``f(input_ids (T,), target, foil) -> (T,)`` with a name.

    Args:
        fn: the callable.
        name: its name (default: ``fn.name``, else ``fn.__name__``).
        signed: whether its scores are signed (default: ``fn.signed`` or False).
        needs_grad: whether it needs autograd (default: ``fn.needs_grad`` or True).
    """

    def __init__(self, fn: AttributorFn, name: Optional[str] = None, signed: Optional[bool] = None,
                 needs_grad: Optional[bool] = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "name", None) or getattr(fn, "__name__", "attributor")
        self.signed = bool(getattr(fn, "signed", False) if signed is None else signed)
        self.needs_grad = bool(getattr(fn, "needs_grad", True) if needs_grad is None else needs_grad)

    def __call__(self, input_ids: Tensor, target: int, foil: Optional[int] = None) -> Tensor:
        return self.fn(input_ids, target, foil)


def _device(model: Any) -> torch.device:
    r"""The device of a module's first parameter (CPU for anything else)."""
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def _logit_fn(model: torch.nn.Module, target: int, foil: Optional[int]) -> Callable[[Tensor], Tensor]:
    def f(embeds: Tensor) -> Tensor:
        lg = model(inputs_embeds=embeds).logits[:, -1]
        return lg[:, target] - lg[:, foil] if foil is not None else lg[:, target]
    return f


class CaptumEmbeddingAttributor(Attributor):
    r"""A Captum attribution (``Saliency``, ``InputXGradient``, ``IntegratedGradients``, ``FeatureAblation``,
    any ``GradientAttribution`` / ``PerturbationAttribution`` taking inputs) on the input embeddings, explaining d.

    The attribution's ``forward_func`` is replaced, for the duration of each call, by
    ``embeds -> d`` on ``model`` (and put back after, also after an error); the (1, T, D)
    feature scores become (T,) token scores by ``reduce``.

    Args:
        attribution: the Captum attribution instance (its own forward function is not used).
        model: a Hugging Face causal LM (default: the attribution's ``forward_func``).
        name: the name in results (default: ``Saliency``, ``InputXGradient``, ``IG-<n_steps>``,
            ``FeatureAblation``, else the class name).
        reduce: ``"sum"`` (signed scores), ``"l2"`` (the gradient norm) or ``"first"`` (the value of
            the first feature: ablation gives every feature of a token the same value).
            Default: ``"l2"`` for Saliency, ``"first"`` for FeatureAblation, else ``"sum"``.
        **attribute_kwargs: passed to ``attribute`` (defaults: ``abs=True`` for Saliency; a zero
            baseline, ``n_steps=16`` and ``internal_batch_size=n_steps`` for IntegratedGradients;
            a zero baseline, one feature per token and every token in one batch for FeatureAblation).
    """

    def __init__(self, attribution: Any, model: Optional[torch.nn.Module] = None, name: Optional[str] = None,
                 reduce: Optional[str] = None, **attribute_kwargs: Any) -> None:
        self.attribution = attribution
        self.model = model if model is not None else attribution.forward_func
        if not callable(getattr(self.model, "get_input_embeddings", None)):
            raise ValueError(f"{type(attribution).__name__}: pass model= (a Hugging Face causal LM); the attribution's "
                             "forward function has no get_input_embeddings()")
        kind = type(attribution).__name__
        self.kind = kind
        kw = dict(attribute_kwargs)
        if kind == "Saliency":
            kw.setdefault("abs", True)
        elif kind == "IntegratedGradients":
            kw.setdefault("n_steps", 16)
            kw.setdefault("internal_batch_size", kw["n_steps"])
        self.attribute_kwargs = kw
        default_reduce = {"Saliency": "l2", "FeatureAblation": "first"}.get(kind, "sum")
        self.reduce = reduce or default_reduce
        if self.reduce not in ("sum", "l2", "first"):
            raise ValueError(f"reduce must be 'sum', 'l2' or 'first', got {self.reduce!r}")
        self.name = name or {"IntegratedGradients": f"IG-{kw.get('n_steps')}"}.get(kind, kind)
        self.signed = self.reduce != "l2" and not kw.get("abs", False)
        self.needs_grad = kind != "FeatureAblation"

    def __call__(self, input_ids: Tensor, target: int, foil: Optional[int] = None) -> Tensor:
        with torch.no_grad():
            x = self.model.get_input_embeddings()(input_ids.reshape(1, -1).to(_device(self.model)))
        kw = dict(self.attribute_kwargs)
        if self.kind in ("IntegratedGradients", "FeatureAblation"):
            kw.setdefault("baselines", torch.zeros_like(x) if self.kind == "IntegratedGradients" else 0.0)
        if self.kind == "FeatureAblation":
            kw.setdefault("feature_mask", torch.arange(x.shape[1], device=x.device)[None, :, None].expand_as(x))
            kw.setdefault("perturbations_per_eval", x.shape[1])
        old = self.attribution.forward_func
        self.attribution.forward_func = _logit_fn(self.model, target, foil)
        try:
            a = self.attribution.attribute(x, **kw)
        finally:
            self.attribution.forward_func = old
        a = a[0]
        if self.reduce == "l2":
            return a.norm(dim=-1)
        return a[:, 0] if self.reduce == "first" else a.sum(-1)


class DecompositionAttributor(Attributor):
    r"""One of this package's Captum classes (:class:`~captum_normattr.attr.base.DecompositionAttribution`).

    A class whose scores depend on the target (ALTI-Logit, DecompX) gets ``target=`` and
    ``foil=``; a class-agnostic map (ALTI, GlobEnc, value zeroing) explains the last token's
    row, whatever the target.

    Args:
        attribution: the instance.
        name: the name in results (default: the registry's display name, else ``get_name()``).
    """

    DISPLAY = {"ALTILogitAttribution": "ALTI-Logit", "DecompXAttribution": "DecompX", "ALTIAttribution": "ALTI",
               "GlobEncAttribution": "GlobEnc", "ValueZeroingAttribution": "Value zeroing"}

    def __init__(self, attribution: Any, name: Optional[str] = None) -> None:
        from captum_normattr.attr.methods import spec_for

        self.attribution = attribution
        spec = spec_for(attribution)
        self.uses_target = bool(getattr(attribution, "uses_target", True))
        self.signed = bool(spec.signed) if spec is not None else self.uses_target
        self.name = name or self.DISPLAY.get(type(attribution).__name__) or str(attribution.get_name())

    def __call__(self, input_ids: Tensor, target: int, foil: Optional[int] = None) -> Tensor:
        ids = input_ids.reshape(1, -1).to(_device(getattr(self.attribution, "model", None)))
        if self.uses_target:
            return self.attribution.attribute(ids, target=target, foil=foil)[0]
        return self.attribution.attribute(ids)[0]


class AttentionAttributor(Attributor):
    r"""Raw attention of the last layer (mean over heads), or attention rollout (0.5 A + 0.5 I, mean over heads).

    Args:
        model: a model that returns attentions (``attn_implementation="eager"``).
        rollout: attention rollout instead of the last layer's weights.
    """

    needs_grad = False

    def __init__(self, model: torch.nn.Module, rollout: bool = False) -> None:
        self.model, self.rollout = model, rollout
        self.name = "Attention rollout" if rollout else "Attention (last layer)"

    def __call__(self, input_ids: Tensor, target: int, foil: Optional[int] = None) -> Tensor:
        ids = input_ids.reshape(1, -1).to(_device(self.model))
        att = self.model(input_ids=ids, output_attentions=True).attentions
        if att is None or att[0] is None:
            raise ValueError(f"{self.name}: the model returned no attentions; load it with attn_implementation='eager'")
        if not self.rollout:
            return att[-1][0].mean(0)[-1].double()
        eye = torch.eye(ids.shape[1], dtype=att[0].dtype, device=att[0].device)
        maps = [0.5 * a[0].mean(0) + 0.5 * eye for a in att]
        return rollout([m[None] for m in maps])[0, -1].double()


class RandomAttributor(Attributor):
    r"""Uniform random scores from the global torch generator (the reference: expected ABPC 0).

    :func:`evaluate_item` seeds the generator with the item's seed before every attributor
    (and restores it after), so the scores are reproducible.
    """

    name = "Random"
    needs_grad = False

    def __call__(self, input_ids: Tensor, target: int, foil: Optional[int] = None) -> Tensor:
        return torch.rand(input_ids.numel(), dtype=torch.float64)


def as_attributor(obj: Any, name: Optional[str] = None, model: Optional[torch.nn.Module] = None,
                  **attribute_kwargs: Any) -> Attributor:
    r"""Turn a Captum attribution or a callable into an attributor.

    Args:
        obj: one of this package's Captum classes (``ALTILogitAttribution``, ``DecompXAttribution``,
            ``ALTIAttribution``, ``GlobEncAttribution``, ``ValueZeroingAttribution``, ...); a Captum
            attribution taking the input embeddings (``Saliency``, ``InputXGradient``,
            ``IntegratedGradients``, ``FeatureAblation``, ...; built on the model or on anything:
            its forward function is replaced by d during each call); an :class:`Attributor`
            (returned, renamed if ``name`` is given); or a callable ``f(input_ids (T,), target, foil) -> (T,)``.
        name: the name in results.
        model: the causal LM, for a Captum attribution whose ``forward_func`` is not the model.
        **attribute_kwargs: a Captum attribution's ``attribute`` keywords (``n_steps=8``, ...).

    Returns:
        An :class:`Attributor`.

    Raises:
        TypeError: for an object that is none of these.
    """
    from captum.attr import Attribution

    from captum_normattr.attr.base import DecompositionAttribution

    if isinstance(obj, Attributor):
        if name:
            obj.name = name
        return obj
    if isinstance(obj, DecompositionAttribution):
        return DecompositionAttributor(obj, name)
    if isinstance(obj, Attribution):
        return CaptumEmbeddingAttributor(obj, model, name, **attribute_kwargs)
    if callable(obj):
        return CallableAttributor(obj, name)
    raise TypeError(f"as_attributor: expected a Captum Attribution or a callable f(input_ids, target, foil), got "
                    f"{type(obj).__name__}")


#: The method specs :func:`make_attributor` knows (``ig:<steps>`` for IntegratedGradients).
METHOD_SPECS = {
    "alti-logit": "ALTI-Logit (this package; signed, contrastive)",
    "decompx": "DecompX (this package; signed, contrastive)",
    "alti": "ALTI (this package; the last token's rollout row, unsigned)",
    "globenc": "GlobEnc (this package; the last token's rollout row, unsigned)",
    "value-zeroing": "value zeroing (this package; the last token's rollout row, unsigned)",
    "saliency": "Captum Saliency: L2 norm of the gradient of d w.r.t. each token's embedding",
    "ixg": "Captum InputXGradient: sum over the embedding of embedding x gradient of d (signed)",
    "ig:N": "Captum IntegratedGradients with N steps, zero-embedding baseline, summed (signed)",
    "ablation": "Captum FeatureAblation: d minus d with the token's embedding set to 0 (signed)",
    "attention": "raw attention of the last layer, mean over heads (needs an eager model)",
    "rollout": "attention rollout, 0.5 A + 0.5 I, mean over heads (needs an eager model)",
    "random": "uniform random scores (the reference)",
    "attnlrp": "AttnLRP (lxt efficient mode; optional, non-commercial licence: evaluation.competitors)",
    "llm-ablation": "Captum's LLMAttribution(FeatureAblation) on a TextTokenInput (needs the tokenizer)",
    "llm-lig:N": "Captum's LLMGradientAttribution(LayerIntegratedGradients), N steps (needs the tokenizer)",
}


def make_attributor(spec: str, model: torch.nn.Module, eager_model: Optional[torch.nn.Module] = None,
                    tokenizer: Any = None) -> Attributor:
    r"""An attributor from a short spec (:data:`METHOD_SPECS`; case-insensitive).

    Args:
        spec: ``"alti-logit"``, ``"decompx"``, ``"alti"``, ``"globenc"``, ``"value-zeroing"``,
            ``"saliency"``, ``"ixg"``, ``"ig:16"`` (any number of steps; ``"ig"``: 16),
            ``"ablation"``, ``"attention"``, ``"rollout"``, ``"random"``, and the competitors of
            :mod:`~captum_normattr.evaluation.competitors`: ``"attnlrp"`` (needs lxt),
            ``"llm-ablation"`` and ``"llm-lig:16"`` (Captum's LLM wrappers; need ``tokenizer``).
        model: the causal LM.
        eager_model: the same model loaded with ``attn_implementation="eager"``, for
            ``attention`` and ``rollout`` (default: ``model``).
        tokenizer: the model's tokenizer, for Captum's LLM wrappers.

    Returns:
        The :class:`Attributor`.

    Raises:
        ValueError: for an unknown spec (the message lists the known ones).
    """
    from captum.attr import FeatureAblation, InputXGradient, IntegratedGradients, Saliency

    key = spec.strip().lower()
    aliases = {"inputxgradient": "ixg", "input-x-gradient": "ixg", "feature-ablation": "ablation",
               "featureablation": "ablation", "alti_logit": "alti-logit", "value_zeroing": "value-zeroing",
               "vz": "value-zeroing"}
    key = aliases.get(key, key)
    if key in ("alti-logit", "decompx", "alti", "globenc", "value-zeroing"):
        from captum_normattr.attr.methods import get_method

        return DecompositionAttributor(get_method(key).build(model))
    if key == "saliency":
        return CaptumEmbeddingAttributor(Saliency(model), model)
    if key == "ixg":
        return CaptumEmbeddingAttributor(InputXGradient(model), model)
    if key == "ig" or key.startswith("ig:") or key.startswith("ig-"):
        steps = int(key[3:]) if len(key) > 3 else 16
        if steps < 1:
            raise ValueError(f"ig:N needs N >= 1 steps, got {spec!r}")
        return CaptumEmbeddingAttributor(IntegratedGradients(model), model, n_steps=steps)
    if key == "ablation":
        return CaptumEmbeddingAttributor(FeatureAblation(model), model)
    if key in ("attention", "rollout"):
        return AttentionAttributor(eager_model if eager_model is not None else model, rollout=key == "rollout")
    if key == "random":
        return RandomAttributor()
    if key == "attnlrp":
        from captum_normattr.evaluation.competitors import attnlrp

        return attnlrp(model)
    if key in ("llm-ablation", "llm-lig") or key.startswith("llm-lig:"):
        from captum_normattr.evaluation.competitors import captum_feature_ablation, captum_layer_integrated_gradients

        if tokenizer is None:
            raise ValueError(f"{spec!r} (Captum's LLM wrappers) needs the model's tokenizer: make_attributor(..., tokenizer=tok)")
        if key == "llm-ablation":
            return captum_feature_ablation(model, tokenizer)
        steps = int(key[len("llm-lig:"):]) if key.startswith("llm-lig:") else 16
        if steps < 1:
            raise ValueError(f"llm-lig:N needs N >= 1 steps, got {spec!r}")
        return captum_layer_integrated_gradients(model, tokenizer, n_steps=steps)
    raise ValueError(f"unknown method {spec!r}; known: {', '.join(METHOD_SPECS)}")


def make_attributors(specs: Union[str, Sequence[str]], model: torch.nn.Module,
                     eager_model: Optional[torch.nn.Module] = None, tokenizer: Any = None) -> Dict[str, Attributor]:
    r"""``{name: attributor}`` from a comma-separated string or a list of specs (:func:`make_attributor`)."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    out: Dict[str, Attributor] = {}
    for s in specs:
        a = make_attributor(s, model, eager_model, tokenizer=tokenizer)
        out[a.name] = a
    return out


# ----------------------------------------------------------------------------- model calls
def last_logits(model: torch.nn.Module, ids_list: Sequence[Sequence[int]], chunk: int = 24) -> Tensor:
    r"""(N, V) next-token logits at the last real token of each prompt (right padding, batches by length).

    The LM head runs on the last real position only (the same numbers, less work) when the model
    has output embeddings and no final logit soft-capping; else the whole model runs.

    Args:
        model: a Hugging Face causal LM.
        ids_list: N prompts (token id lists).
        chunk: prompts per batch.

    Returns:
        (N, V) logits.
    """
    out = None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    direct = head is not None and getattr(model.config, "final_logit_softcapping", None) is None
    device = next(model.parameters()).device
    order = sorted(range(len(ids_list)), key=lambda b: len(ids_list[b]))
    for c in range(0, len(order), chunk):  # by length: little padding
        part = order[c: c + chunk]
        n = max(len(ids_list[b]) for b in part)
        ids = torch.zeros(len(part), n, dtype=torch.long)
        mask = torch.zeros(len(part), n, dtype=torch.long)
        for r, b in enumerate(part):
            ids[r, : len(ids_list[b])] = torch.tensor(list(ids_list[b]))
            mask[r, : len(ids_list[b])] = 1
        ids, mask = ids.to(device), mask.to(device)
        last = mask.sum(1) - 1
        rows = torch.arange(len(part), device=device)
        with torch.no_grad():
            if direct:
                hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
                lg = head(hidden[rows, last])
            else:
                lg = model(input_ids=ids, attention_mask=mask).logits[rows, last]
        if out is None:
            out = lg.new_empty(len(ids_list), lg.shape[-1])
        out[part] = lg
    return out


def last_logit_diff(model: torch.nn.Module, ids_list: Sequence[Sequence[int]], target: int, foil: Optional[int],
                    chunk: int = 24) -> Tensor:
    r"""(N,) float64 d = logit(target) - logit(foil) (logit(target) when ``foil`` is None) at the last real token."""
    lg = last_logits(model, ids_list, chunk)
    return (lg[:, target] - lg[:, foil]).double() if foil is not None else lg[:, target].double()


def keep_correct(model: torch.nn.Module, items: List[TaskItem], task: str, tokenizer: Any = None) -> List[TaskItem]:
    r"""The items the model gets right: logit(target) > logit(foil) (target = argmax when the foil is None).

    For ``task == "facts"`` (``tokenizer`` needed) the foil first becomes the model's strongest
    other answer of the same kind (``meta["group"]``: a city, a language, a country) among all
    the generator's answers (:func:`~captum_normattr.evaluation.decoder_tasks.fact_answer_tokens`).

    Args:
        model: the causal LM.
        items: candidate items (``facts`` items get their foil set in place).
        task: the task name.
        tokenizer: the model's tokenizer (``facts`` only).

    Returns:
        The kept items, in order.
    """
    kept = []
    groups = fact_answer_tokens(tokenizer) if task == "facts" else {}
    all_logits = last_logits(model, [it.input_ids for it in items])
    for it, lg in zip(items, all_logits):
        if task == "facts":
            others = [c for c in groups[it.meta.get("group", "city")] if c != it.target]
            it.foil = others[int(torch.argmax(lg[others]))]
        if (it.foil is None and int(torch.argmax(lg)) == it.target) or (it.foil is not None and lg[it.target] > lg[it.foil]):
            kept.append(it)
    return kept


def forward_time(model: torch.nn.Module, item: TaskItem, repeats: int = 3) -> float:
    r"""Median wall time (s) of ``repeats`` forwards of the item's prompt."""
    ids = torch.tensor([item.input_ids], device=next(model.parameters()).device)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=ids)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _run(attributor: AttributorFn, it: TaskItem, seed: int) -> Tensor:
    ids = torch.tensor(it.input_ids)
    with torch.random.fork_rng(devices=[]):  # the CPU generator only: restored after
        torch.default_generator.manual_seed(seed)
        if getattr(attributor, "needs_grad", True):
            with torch.enable_grad():
                scores = attributor(ids, it.target, it.foil)
        else:
            with torch.no_grad():
                scores = attributor(ids, it.target, it.foil)
    scores = torch.as_tensor(scores).detach().reshape(-1).double().cpu()
    if scores.numel() != len(it.input_ids):
        raise ValueError(f"{getattr(attributor, 'name', attributor)} returned {scores.numel()} scores for a "
                         f"{len(it.input_ids)}-token prompt; an attributor returns one score per token, shape (T,)")
    return scores


def evaluate_item(model: torch.nn.Module, attributors: Mapping[str, AttributorFn], it: TaskItem,
                  ks: Sequence[int] = DEFAULT_KS, seed: int = 0, time_cost: bool = True, curves: bool = False
                  ) -> Dict[str, Dict[str, float]]:
    r"""Every attributor's metrics on one item: ``{method: {metric: value}}``.

    Every perturbed prompt of every method (deduplicated) and the full prompt go through one
    batched forward pass. Before each attributor the global torch generator is seeded with
    ``seed`` (restored after). Metrics (``tag`` = ``with_sink`` / ``no_sink``): ``top1_<tag>``,
    ``mrr_<tag>`` (and ``alt_top1_<tag>``, ``alt_mrr_<tag>`` with ``alt_evidence``; none without
    evidence), ``deletion_aopc_<tag>``, ``insertion_aopc_<tag>``, ``abpc_<tag>`` (module
    docstring), ``sink_share`` and ``cost_forwards`` (method time / median time of 3 forwards of
    the prompt, when ``time_cost``).

    Args:
        model: the causal LM whose d is measured.
        attributors: ``{name: attributor}``.
        it: the item.
        ks: curve steps (numbers of tokens removed or kept; each clipped to the candidates).
        seed: the item's seed.
        time_cost: measure ``cost_forwards``.
        curves: also return ``morf_<k>_<tag>``, ``lerf_<k>_<tag>`` and ``ins_<k>_<tag>`` (d after
            each step / |d|) and ``logit_sign`` (d / |d|), for plots.

    Returns:
        ``{method: {metric: value}}``.
    """
    t_fwd = forward_time(model, it) if time_cost else None
    rows = {}
    for name, fn in attributors.items():
        t0 = time.perf_counter()
        scores = _run(fn, it, seed)
        rows[name] = (scores, (time.perf_counter() - t0) / t_fwd if time_cost else None)
    prompts: Dict[tuple, int] = {tuple(it.input_ids): 0}
    plan = {}
    for name, (scores, _) in rows.items():
        for ex in (False, True):
            dele, ins = removal_sequences(it.input_ids, scores, ks, exclude_sink=ex)
            plan[(name, ex)] = tuple([prompts.setdefault(tuple(p), len(prompts)) for p in seq] for seq in (dele, ins))
    n_main = len(prompts)
    for name, (scores, _) in rows.items():  # the LeRF prompts in batches of their own: the others' batches unchanged
        for ex in (False, True):
            lerf, _ = removal_sequences(it.input_ids, scores, ks, exclude_sink=ex, least_relevant_first=True)
            plan[(name, ex)] += ([prompts.setdefault(tuple(p), len(prompts)) for p in lerf],)
    keys = list(prompts)
    d = last_logit_diff(model, keys[:n_main], it.target, it.foil).tolist()
    if len(keys) > n_main:
        d += last_logit_diff(model, keys[n_main:], it.target, it.foil).tolist()
    d_full = d[0]
    scale = abs(d_full)
    out: Dict[str, Dict[str, float]] = {}
    for name, (scores, cost) in rows.items():
        rec = out[name] = {}
        if cost is not None:
            rec["cost_forwards"] = cost
        rec["sink_share"] = sink_share(scores)
        if curves:
            rec["logit_sign"] = 1.0 if d_full > 0 else -1.0  # the curves' value at k = 0
        for ex in (False, True):
            tag = "no_sink" if ex else "with_sink"
            if it.evidence:
                r = evidence_ranks(scores, it.evidence, exclude_sink=ex)
                rec[f"top1_{tag}"] = float(r == 1)
                rec[f"mrr_{tag}"] = 1.0 / r if r else 0.0
            if it.alt_evidence:
                ra = evidence_ranks(scores, it.alt_evidence, exclude_sink=ex)
                rec[f"alt_top1_{tag}"] = float(ra == 1)
                rec[f"alt_mrr_{tag}"] = 1.0 / ra if ra else 0.0
            dele, ins, lerf = plan[(name, ex)]
            rec[f"deletion_aopc_{tag}"] = sum((d_full - d[j]) / scale for j in dele) / len(dele)
            rec[f"insertion_aopc_{tag}"] = sum(d[j] / scale for j in ins) / len(ins)
            rec[f"abpc_{tag}"] = sum((d[a] - d[m]) / scale for a, m in zip(lerf, dele)) / len(dele)
            if curves:
                for k, jm, jl, ji in zip(ks, dele, lerf, ins):
                    rec[f"morf_{k}_{tag}"] = d[jm] / scale
                    rec[f"lerf_{k}_{tag}"] = d[jl] / scale
                    rec[f"ins_{k}_{tag}"] = d[ji] / scale
    return out


class TaskState(ItemValues):
    r"""One task's kept items and the per-item metric values gathered so far (:class:`ItemValues`).

    Args:
        name: the task's name.
        candidates: how many candidates were generated.
        kept: the items to evaluate.

    Attributes:
        correct: how many candidates the model got right (set it when ``kept`` was truncated).
        seconds: evaluation time so far.
    """

    def __init__(self, name: str, candidates: int, kept: List[TaskItem]) -> None:
        super().__init__()
        self.name, self.candidates, self.correct = name, candidates, len(kept)
        self.items = kept
        self.seconds = 0.0


def run_round_robin(model: torch.nn.Module, states: Sequence[TaskState], attributors: Mapping[str, AttributorFn],
                    ks: Sequence[int] = DEFAULT_KS, cost_every: int = 1, total_seconds: float = float("inf"),
                    task_seconds: float = float("inf"), save_every: int = 5,
                    on_save: Optional[Callable[[int], None]] = None, log: Optional[Callable[[str], None]] = None,
                    curves: bool = False) -> int:
    r"""Evaluate the tasks one item of each per round, so a stop leaves balanced counts.

    Item n of a task gets seed n; the cost is timed on items 0, ``cost_every``, 2 ``cost_every``, ...

    Args:
        model: the causal LM.
        states: the tasks (:class:`TaskState`; filled in place).
        attributors: ``{name: attributor}``.
        ks: curve steps.
        cost_every: time the cost on every n-th item of a task.
        total_seconds: stop after this many seconds (whole rounds).
        task_seconds: stop a task once its items took this long.
        save_every: call ``on_save(round)`` every this many rounds.
        on_save: the callback (writing a snapshot, logging).
        log: a logger for the time-budget message.
        curves: keep the curve points (:func:`evaluate_item`).

    Returns:
        The number of rounds run.
    """
    t_eval = time.time()
    n_round = 0
    while any(st.done < len(st.items) and st.seconds <= task_seconds for st in states):
        if time.time() - t_eval > total_seconds:
            if log is not None:
                log(f"total time budget reached after {n_round} rounds")
            break
        for st in states:
            if st.done < len(st.items) and st.seconds <= task_seconds:
                n = st.done
                t0 = time.time()
                st.add(evaluate_item(model, attributors, st.items[n], ks, seed=n, time_cost=n % cost_every == 0,
                                     curves=curves))
                st.seconds += time.time() - t0
        n_round += 1
        if on_save is not None and n_round % save_every == 0:
            on_save(n_round)
    return n_round
