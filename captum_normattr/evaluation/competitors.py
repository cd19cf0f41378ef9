r"""Competing token attributions for decoders, behind one small protocol: AttnLRP, Value Zeroing, Captum's LLM wrappers.

An *attributor* is a callable ``f(input_ids, target, foil) -> scores``:

- ``input_ids``: (T,) int64, one prompt (no batch dimension, no padding);
- ``target``, ``foil``: token ids; the scores explain d = logit(target) - logit(foil) of the
  next-token prediction at the last position (logit(target) when ``foil`` is None, unless the
  attributor says otherwise in its ``details``);
- returns (T,) scores, one per prompt token, on the model's parameter device,

with the attributes ``name`` (str), ``signed`` (True when a score's sign says whether the
token raises or lowers d; False for non-negative mixing shares), ``needs_grad`` (True when it
runs a backward pass: the caller must not wrap it in ``torch.no_grad()``) and ``details``
(dict: what exactly was computed, with versions, so a table can be rerun).

The factories:

- :func:`attnlrp` — AttnLRP (Achtibat et al., ICML 2024) in the efficient mode of the ``lxt``
  package: the model's modeling module is monkey-patched by lxt so that input x gradient is
  AttnLRP, then input x (modified) gradient of d on the input embeddings, summed over the
  embedding dimension. lxt is optional and benchmark-only (its licence restricts LRP to
  non-commercial use): it is imported when the attributor is built, never by the package,
  and is not a dependency. The patch is global to the transformers modeling module (and to
  ``torch.nn.Dropout``, ``torch.nn.LayerNorm`` for GPT-2, and transformers' shared attention
  registry): :func:`lxt_patched` applies it for one call and restores everything afterwards,
  also after an error;
- :func:`attnlrp_classifier` — AttnLRP for BERT sequence classifiers (harness methods of
  :mod:`~captum_normattr.evaluation.baselines`), each token's relevance for the target class logit;
  :func:`bert_attnlrp_map` puts lxt's rules on transformers 5 BERT (lxt's own BERT module does not run);
- :func:`value_zeroing` — :class:`~captum_normattr.attr.value_zeroing.ValueZeroingAttribution`,
  the row of the last position of its rollout (unsigned, target-agnostic);
- :func:`captum_feature_ablation` and :func:`captum_layer_integrated_gradients` — Captum's
  ``LLMAttribution(FeatureAblation)`` and ``LLMGradientAttribution(LayerIntegratedGradients)``
  with a ``TextTokenInput``. Captum's LLM API explains log p(target) (log-softmax of the
  logits) and cannot explain a difference of logits. Both methods are linear in the explained
  function (an ablation difference; an integral of gradients on a fixed path), and
  log p(target) - log p(foil) = logit(target) - logit(foil), so the contrastive scores are
  computed exactly as the difference of two Captum calls (one for the target, one for the
  foil; the cost counts both). Without a foil they explain log p(target), as Captum does
  (said in ``details``).

``docs/which_method.md`` reports these methods next to ours on the decoder tasks.

Examples::

    >>> from captum_normattr.evaluation.competitors import attnlrp, value_zeroing
    >>> f = attnlrp(model)                          # doctest: +SKIP
    >>> scores = f(ids, target=are_id, foil=is_id)  # (T,), explains logit(are) - logit(is)
    >>> f.details["lxt_commit"]                     # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor, nn

from captum_normattr.attr.value_zeroing import ValueZeroingAttribution

__all__ = [
    "LXT_BENCHMARKED_COMMIT",
    "LXT_INSTALL",
    "Attributor",
    "check_prompt",
    "contrastive_logit",
    "lxt_available",
    "lxt_patched",
    "attnlrp",
    "attnlrp_classifier",
    "bert_attnlrp_map",
    "value_zeroing",
    "captum_feature_ablation",
    "captum_layer_integrated_gradients",
]

#: The commit of rachtibat/LRP-eXplains-Transformers the package's benchmarks ran (main, "update to
#: transformers==5.9.0", 2026-08-11); lxt 2.1 from PyPI does not import under transformers 5.
LXT_BENCHMARKED_COMMIT = "f04344177551bfcc3665e88afe96501f43fe560b"

#: How to install lxt for these comparisons (benchmark-only, non-commercial licence).
LXT_INSTALL = (
    "pip install --no-deps 'lxt @ git+https://github.com/rachtibat/LRP-eXplains-Transformers@"
    + LXT_BENCHMARKED_COMMIT + "' (lxt 2.1 from PyPI fails to import under transformers 5; its LRP licence is "
    "non-commercial, so it is never a dependency of captum_normattr)")

_PATCH_LOCK = threading.RLock()


class Attributor:
    r"""A named attribution callable of the competitor protocol (see the module docstring).

    Args:
        fn: ``fn(input_ids (T,), target, foil) -> (T,)``.
        name: the method's name in tables.
        signed: the scores are signed (explain d with their sign).
        needs_grad: ``fn`` runs a backward pass.
        details: what is computed, versions, conventions.

    Examples::

        >>> f = Attributor(lambda ids, t, f: ids.double() * 0, "zeros", signed=True, needs_grad=False)
        >>> f(torch.tensor([1, 2, 3]), 4, None)
        tensor([0., 0., 0.], dtype=torch.float64)
    """

    def __init__(self, fn: Callable[[Tensor, int, Optional[int]], Tensor], name: str, signed: bool, needs_grad: bool,
                 details: Optional[Dict[str, Any]] = None) -> None:
        self.fn = fn
        self.name = name
        self.signed = signed
        self.needs_grad = needs_grad
        self.details: Dict[str, Any] = dict(details or {})

    def __call__(self, input_ids: Tensor, target: int, foil: Optional[int] = None) -> Tensor:
        ids = check_prompt(input_ids)
        scores = self.fn(ids, int(target), None if foil is None else int(foil))
        if scores.shape != ids.shape:
            raise RuntimeError(f"{self.name}: the scores have shape {tuple(scores.shape)}, not {tuple(ids.shape)}")
        return scores.detach()

    def __repr__(self) -> str:
        return f"Attributor({self.name!r}, signed={self.signed}, needs_grad={self.needs_grad})"


def check_prompt(input_ids: Tensor) -> Tensor:
    r"""The prompt as a (T,) int64 tensor, refused when it is not one.

    Args:
        input_ids: (T,) or (1, T) token ids.

    Returns:
        (T,) int64.

    Raises:
        ValueError: not one non-empty sequence of integer token ids.

    Examples::

        >>> check_prompt(torch.tensor([[5, 6]]))
        tensor([5, 6])
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be one prompt of integer token ids, shape (T,), got {tuple(ids.shape)} "
                         f"{ids.dtype}")
    return ids.long()


def contrastive_logit(logits: Tensor, target: int, foil: Optional[int]) -> Tensor:
    r"""d = logits[..., target] - logits[..., foil] (logits[..., target] when ``foil`` is None).

    Args:
        logits: (..., V).
        target: token id.
        foil: token id or None.

    Returns:
        (...) the explained quantity.

    Examples::

        >>> contrastive_logit(torch.tensor([1.0, 3.0, 0.5]), 1, 2)
        tensor(2.5000)
    """
    d = logits[..., target]
    return d if foil is None else d - logits[..., foil]


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# ----------------------------------------------------------------------------- AttnLRP (lxt)
def lxt_available() -> bool:
    r"""Whether lxt's efficient mode imports here (the optional AttnLRP package).

    Returns:
        True when ``lxt.efficient`` imports.

    Examples::

        >>> isinstance(lxt_available(), bool)
        True
    """
    try:
        with _quiet_zennit():
            importlib.import_module("lxt.efficient")
    except Exception:  # lxt 2.1 from PyPI raises ImportError inside transformers 5, not ModuleNotFoundError
        return False
    return True


def _import_lxt() -> Tuple[Any, Any]:
    try:
        with _quiet_zennit():
            core = importlib.import_module("lxt.efficient.core")
            models = importlib.import_module("lxt.efficient.models")
    except Exception as exc:
        raise ImportError(f"AttnLRP needs lxt's efficient mode, which does not import here ({exc!r}). Install: "
                          + LXT_INSTALL) from exc
    return core, models


@contextlib.contextmanager
def _quiet_zennit() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():  # lxt warns that zennit (vision transformers only) is absent
        warnings.filterwarnings("ignore", message=".*zennit.*")
        yield


def _modeling_module(model: nn.Module) -> types.ModuleType:
    r"""The transformers modeling module that defines the model's classes (``modeling_llama``, ...)."""
    name = type(model).__module__
    module = sys.modules.get(name)
    if module is None:
        raise ValueError(f"cannot find the module {name!r} of {type(model).__name__}")
    return module


def _snapshot(obj: Any) -> Dict[str, Any]:
    return {k: v for k, v in vars(obj).items() if not (k.startswith("__") and k.endswith("__"))}


def _restore(obj: Any, saved: Dict[str, Any]) -> None:
    now = _snapshot(obj)
    for key in now:
        if key not in saved:
            delattr(obj, key)
    for key, value in saved.items():
        if now.get(key, _MISSING) is not value:
            setattr(obj, key, value)


_MISSING = object()


def _registry_items(registry: Any) -> Dict[str, Any]:
    return {k: registry[k] for k in list(registry)}


def _restore_registry(registry: Any, saved: Dict[str, Any]) -> None:
    r"""Undo ``registry[k] = v`` on transformers' attention registry (a local override of a global mapping)."""
    for key in list(registry):
        if key in saved and registry[key] is saved[key]:
            continue
        try:
            del registry[key]  # drops the local override: the global function shows again
        except KeyError:
            pass
        if key in saved and (key not in list(registry) or registry[key] is not saved[key]):
            registry[key] = saved[key]


def _bert_module() -> types.ModuleType:
    return importlib.import_module("transformers.models.bert.modeling_bert")


def _default_map(model: nn.Module) -> dict:
    r"""The AttnLRP patch map of the model's modeling module: :func:`bert_attnlrp_map` for BERT, else lxt's."""
    _, models = _import_lxt()
    module = _modeling_module(model)
    if module is _bert_module():
        return bert_attnlrp_map()
    try:
        return models.get_default_map(module)
    except ValueError as exc:
        raise ValueError(f"AttnLRP (lxt) has no patch for {type(model).__name__} ({module.__name__}): {exc}") from exc


def bert_attnlrp_map() -> dict:
    r"""lxt's AttnLRP patch map for the BERT classes of transformers 5 (``modeling_bert``).

    lxt's ``efficient.models.bert`` replaces the attributes of ``modeling_bert`` by its own copy
    of the transformers 4 BERT code; under transformers 5 that copy fails (its classes read
    ``config.position_embedding_type`` and call ``get_head_mask``, both gone), and replacing a
    module's classes does not change a model already built from them. This map applies lxt's
    own rule functions, at the places lxt's BERT module applies them, to the transformers 5
    classes and functions that a built model calls:

    - ``torch.nn.LayerNorm``: lxt's ``layer_norm_forward`` (identity rule: the standard
      deviation is detached), also the embedding LayerNorm;
    - ``torch.nn.Dropout``: lxt's ``dropout_forward`` (identity);
    - the attention functions of ``modeling_bert`` (``eager_attention_forward`` and every entry
      of transformers' attention registry, sdpa included): lxt's ``patch_attention``, which
      divides the gradients of the queries and keys by 4 and of the values by 2 (the uniform
      rule on the two matrix products; lxt's BERT module divides the gradients of the
      scores and of the context by 2, the same rule);
    - ``BertIntermediate``, ``BertPooler``, ``BertPredictionHeadTransform``: the transformers 5
      forward with lxt's ``identity_rule_implicit`` on the element-wise activation (GELU,
      the pooler's tanh).

    Every entry is undone by :func:`lxt_patched` after the call. The patched forward pass
    computes the same values (only the gradients change; tested).

    Returns:
        dict: class or module -> patch function, for ``lxt.efficient.monkey_patch``.

    Raises:
        ImportError: lxt is not installed (with the install command).

    Examples::

        >>> with lxt_patched(bert_classifier, bert_attnlrp_map()):        # doctest: +SKIP
        ...     logits = bert_classifier(inputs_embeds=x.requires_grad_()).logits
    """
    from functools import partial

    _import_lxt()
    patches = importlib.import_module("lxt.efficient.patches")
    rules = importlib.import_module("lxt.efficient.rules")
    bert = _bert_module()
    identity = rules.identity_rule_implicit

    def intermediate_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        return identity(self.intermediate_act_fn, self.dense(hidden_states))

    def pooler_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        return identity(self.activation, self.dense(hidden_states[:, 0]))

    def head_transform_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        return self.LayerNorm(identity(self.transform_act_fn, self.dense(hidden_states)))

    return {
        torch.nn.LayerNorm: partial(patches.patch_method, patches.layer_norm_forward),
        torch.nn.Dropout: partial(patches.patch_method, patches.dropout_forward),
        bert: patches.patch_attention,
        bert.BertIntermediate: partial(patches.patch_method, intermediate_forward),
        bert.BertPooler: partial(patches.patch_method, pooler_forward),
        bert.BertPredictionHeadTransform: partial(patches.patch_method, head_transform_forward),
    }


@contextlib.contextmanager
def lxt_patched(model: nn.Module, patch_map: Optional[dict] = None) -> Iterator[dict]:
    r"""lxt's AttnLRP patch of the model's modeling module, for the duration of a ``with`` block.

    lxt's ``monkey_patch`` replaces methods on classes (the family's MLP and norm classes,
    ``torch.nn.Dropout``; ``torch.nn.LayerNorm`` for GPT-2), the modeling module's
    ``eager_attention_forward`` and every entry of transformers' shared attention registry
    ``ALL_ATTENTION_FUNCTIONS`` (used by every model in the process). Every one of them is
    saved before and restored on exit, also after an error, so other models and methods in the
    process run unpatched. Not reentrant across threads: a lock serialises the patched blocks.

    Args:
        model: a model of a family lxt supports (Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma 3, GPT-2;
            BERT through :func:`bert_attnlrp_map`).
        patch_map: lxt's patch map (default: its AttnLRP map for the model's modeling module,
            :func:`bert_attnlrp_map` for BERT).

    Yields:
        The patch map applied (class or module -> patch function).

    Raises:
        ImportError: lxt is not installed (with the install command).
        ValueError: lxt has no patch for the model's family.

    Examples::

        >>> with lxt_patched(model):                           # doctest: +SKIP
        ...     logits = model(inputs_embeds=x.requires_grad_()).logits
    """
    core, _ = _import_lxt()
    module = _modeling_module(model)
    if patch_map is None:
        patch_map = _default_map(model)
    registry = getattr(module, "ALL_ATTENTION_FUNCTIONS", None)
    with _PATCH_LOCK:
        saved = [(target, _snapshot(target)) for target in patch_map]
        saved_registry = _registry_items(registry) if registry is not None else None
        try:
            with _quiet_zennit():
                core.monkey_patch(module, patch_map=patch_map)
            yield patch_map
        finally:
            for target, snap in saved:
                _restore(target, snap)
            if registry is not None:
                _restore_registry(registry, saved_registry)


def _lxt_version() -> str:
    try:
        from importlib.metadata import version

        return version("lxt")
    except Exception:
        return "unknown"


def attnlrp(model: nn.Module, lxt_commit: str = LXT_BENCHMARKED_COMMIT) -> Attributor:
    r"""AttnLRP (lxt efficient mode): input x AttnLRP-modified gradient of d on the input embeddings.

    Per call: the model's modeling module is patched with lxt's AttnLRP map
    (:func:`lxt_patched`: the identity rule on norms and element-wise activations, the uniform
    rule on the gated product and on the attention matrix products, by dividing gradients),
    the prompt's input embeddings x are fed with ``requires_grad``, d = logit(target) -
    logit(foil) at the last position is back-propagated once, and the scores are
    sum_k x[t, k] * grad[t, k]; then the patch is undone. Signed. Cost: one forward and one
    backward. AttnLRP is not conservative on these models: the scores do not sum to d (bias
    terms and the rules' leaks; ``docs/which_method.md``).

    Args:
        model: a ``*ForCausalLM`` of a family lxt patches (Llama, Qwen2, Qwen3, Qwen3-MoE,
            Gemma 3, GPT-2), in eval mode. Its norm and MLP modules must be the family's own
            classes (a module swapped for ``torch.nn.RMSNorm`` is not patched).
        lxt_commit: the commit of the lxt snapshot installed, written in ``details``.

    Returns:
        :class:`Attributor` ``"AttnLRP"`` (signed, needs_grad); ``details``: lxt version and
        commit, the patched classes and modules, the convention.

    Raises:
        ImportError: lxt is not installed (with the install command).
        ValueError: lxt has no patch for the model's family.

    Examples::

        >>> f = attnlrp(model)                          # doctest: +SKIP
        >>> f(ids, target=are_id, foil=is_id).shape     # doctest: +SKIP
        torch.Size([T])
    """
    module = _modeling_module(model)
    patch_map = _default_map(model)
    emb = model.get_input_embeddings()
    details = {
        "method": "AttnLRP, lxt efficient mode (input x modified gradient on the input embeddings, summed over the "
                  "embedding dimension)",
        "lxt_version": _lxt_version(),
        "lxt_commit": lxt_commit,
        "lxt_source": "https://github.com/rachtibat/LRP-eXplains-Transformers",
        "patch": f"lxt.efficient.monkey_patch({module.__name__}) with its default AttnLRP map, undone after each call",
        "patched": sorted(getattr(t, "__qualname__", getattr(t, "__name__", str(t))) for t in patch_map),
        "explains": "logit(target) - logit(foil) at the last position (logit(target) without a foil)",
    }

    def fn(ids: Tensor, target: int, foil: Optional[int]) -> Tensor:
        ids = ids.to(_device(model))
        with lxt_patched(model, patch_map), torch.enable_grad():
            x = emb(ids[None]).detach().requires_grad_(True)
            logits = model(inputs_embeds=x, use_cache=False).logits[0, -1]
            d = contrastive_logit(logits, target, foil)
            (grad,) = torch.autograd.grad(d, x)
        return (x.detach() * grad).sum(-1)[0].to(torch.float64)

    return Attributor(fn, "AttnLRP", signed=True, needs_grad=True, details=details)


def attnlrp_classifier(model: nn.Module, lxt_commit: str = LXT_BENCHMARKED_COMMIT) -> Any:
    r"""AttnLRP of a BERT sequence classifier: relevance of each input token for the target class logit.

    Per call (a padded batch): the model is patched with :func:`bert_attnlrp_map` (lxt's
    efficient-mode rules) inside :func:`lxt_patched`, the word embeddings x of the tokens are
    fed with ``requires_grad`` (the model adds the position and token-type embeddings), the
    target class logits of the batch are back-propagated once, and the scores are
    sum_k x[b, t, k] * grad[b, t, k]; the patch is undone afterwards, also after an error.
    Signed. Cost: one forward and one backward pass per batch. Not conservative: the
    scores do not sum to the logit (the biases, the position and token-type embeddings and
    the softmax keep the rest; ``docs/evaluation.md``).

    Args:
        model: a transformers 5 BERT model with a classification head
            (``BertForSequenceClassification``; all-MiniLM-L6-v2 is one), in any mode (run in
            eval mode, the training flags restored).
        lxt_commit: the commit of the lxt snapshot installed, written in ``info``.

    Returns:
        :class:`~captum_normattr.evaluation.baselines.Method` ``"AttnLRP"``: ``(input_ids (B, T),
        attention_mask (B, T), target (B,)) -> (B, T)`` scores (pads 0), ``uses_target=True``;
        ``info``: lxt version and commit, the patches, the convention.

    Raises:
        ImportError: lxt is not installed (with the install command).
        ValueError: the model is not a BERT model of transformers' ``modeling_bert``.

    Examples::

        >>> m = attnlrp_classifier(bert_classifier)                   # doctest: +SKIP
        >>> m(input_ids, attention_mask, target=torch.tensor([1, 0])).shape   # doctest: +SKIP
        torch.Size([2, T])
    """
    from captum_normattr.evaluation.baselines import Method
    from captum_normattr.evaluation.classifier import logits_of
    from captum_normattr.models.capture.session import eval_mode

    _import_lxt()
    module = _modeling_module(model)
    if module is not _bert_module():
        raise ValueError(f"attnlrp_classifier patches transformers' BERT (modeling_bert) only, not "
                         f"{type(model).__name__} ({module.__name__}); for the decoders lxt patches use attnlrp()")
    patch_map = bert_attnlrp_map()
    emb = model.get_input_embeddings()
    info = {
        "method": "AttnLRP, lxt efficient mode: input x modified gradient of the target class logit on the word "
                  "embeddings, summed over the embedding dimension",
        "lxt_version": _lxt_version(),
        "lxt_commit": lxt_commit,
        "lxt_source": "https://github.com/rachtibat/LRP-eXplains-Transformers",
        "patch": "lxt.efficient.monkey_patch with bert_attnlrp_map() (lxt's layer_norm_forward, dropout_forward, "
                 "patch_attention and identity_rule_implicit on the transformers 5 BERT classes), undone after "
                 "each call",
        "patched": sorted(getattr(t, "__qualname__", getattr(t, "__name__", str(t))) for t in patch_map),
    }

    def fn(ids: Tensor, mask: Tensor, target: Tensor) -> Tensor:
        dev = _device(model)
        ids, mask, target = ids.to(dev), mask.to(dev), torch.as_tensor(target).to(dev).reshape(-1)
        if target.numel() != ids.shape[0]:
            raise ValueError(f"target must have one class per example ({ids.shape[0]}), got {target.numel()}")
        with lxt_patched(model, patch_map), eval_mode(model), torch.enable_grad():
            x = emb(ids).detach().requires_grad_(True)
            logits = logits_of(model(inputs_embeds=x, attention_mask=mask))
            chosen = logits.gather(1, target.long()[:, None]).sum()
            (grad,) = torch.autograd.grad(chosen, x)
        return (x.detach() * grad).sum(-1)

    return Method("AttnLRP", fn, True, "AttnLRP (lxt efficient mode) on the word embeddings", info)


# ----------------------------------------------------------------------------- Value Zeroing
def value_zeroing(model: nn.Module, **options: Any) -> Attributor:
    r"""Value Zeroing (Mohebbi et al. 2023): the last position's row of the rollout of the layer maps.

    Wraps :class:`~captum_normattr.attr.value_zeroing.ValueZeroingAttribution` with
    ``explained_position="last"``. Target-agnostic (the target and foil are ignored) and
    unsigned (shares of context mixing, summing to 1 over the prompt). Cost: one forward plus,
    per layer, T + 1 reruns of the layer (batched).

    Args:
        model: a supported decoder (``*ForCausalLM`` or ``*Model``).
        **options: passed to ``ValueZeroingAttribution`` (``memory_budget_mb``, ``strict``).

    Returns:
        :class:`Attributor` ``"Value Zeroing"`` (unsigned, no gradient).

    Examples::

        >>> f = value_zeroing(model)                          # doctest: +SKIP
        >>> f(ids, target, foil).sum()                        # doctest: +SKIP
        tensor(1.)
    """
    vz = ValueZeroingAttribution(model, explained_position="last", **options)
    details = {"method": "ValueZeroingAttribution (captum_normattr), rollout row of the last position, no identity "
                         "added (the reruns include the residuals)",
               "explains": "context mixing into the last position (target and foil not used)"}

    def fn(ids: Tensor, target: int, foil: Optional[int]) -> Tensor:
        with torch.no_grad():
            return vz.attribute(ids.to(_device(model))[None])[0].to(torch.float64)

    return Attributor(fn, "Value Zeroing", signed=False, needs_grad=False, details=details)


# ----------------------------------------------------------------------------- Captum's LLM wrappers
def _text_input(ids: Tensor, tokenizer: Any, baseline: int) -> Any:
    r"""Captum's ``TextTokenInput`` for exactly these token ids.

    It is built from the decoded text; when the tokenizer does not encode that text back to the
    same ids (a merge across a boundary, an added BOS), its token tensors are set to ``ids``
    so that Captum perturbs the prompt the other methods explain.
    """
    from captum.attr import TextTokenInput

    text = tokenizer.decode(ids.tolist())
    inp = TextTokenInput(text, tokenizer, baselines=baseline)
    if inp.inp_tensor.shape != (1, ids.numel()) or not torch.equal(inp.inp_tensor[0].to(ids.device), ids):
        inp.inp_tensor = ids[None].cpu()
        inp.itp_tensor = inp.inp_tensor
        inp.itp_mask = None
        inp.values = tokenizer.convert_ids_to_tokens(ids.tolist())
        inp.n_itp_features = ids.numel()
    return inp


def _baseline_token(tokenizer: Any, baseline: Optional[int]) -> int:
    if baseline is not None:
        return int(baseline)
    for name in ("unk_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _contrast(call: Callable[[int], Tensor], target: int, foil: Optional[int]) -> Tensor:
    a = call(target)
    return a if foil is None else a - call(foil)


def captum_feature_ablation(model: nn.Module, tokenizer: Any, baseline: Optional[int] = None) -> Attributor:
    r"""Captum 0.9's ``LLMAttribution(FeatureAblation)`` with a ``TextTokenInput``, made contrastive exactly.

    Each prompt token in turn is replaced by the ``baseline`` token id and the change of
    log p(target) is its score (Captum's LLM API, one forward per token, one prompt per
    forward). With a foil, the same is done for log p(foil) and subtracted: an ablation
    difference is linear in the explained function and log p(target) - log p(foil) =
    logit(target) - logit(foil), so the result is exactly FeatureAblation of d. Signed.
    Cost: 2 (T + 1) forwards with a foil, T + 1 without.

    Args:
        model: a Hugging Face ``*ForCausalLM``.
        tokenizer: its tokenizer.
        baseline: the replacement token id (default: the tokenizer's unk, else pad, else eos
            token, else 0).

    Returns:
        :class:`Attributor` ``"Captum FeatureAblation (LLM)"`` (signed, no gradient).

    Examples::

        >>> f = captum_feature_ablation(model, tokenizer)     # doctest: +SKIP
        >>> f(ids, target, foil)                              # doctest: +SKIP
    """
    from captum.attr import FeatureAblation, LLMAttribution

    base = _baseline_token(tokenizer, baseline)
    llm = LLMAttribution(FeatureAblation(model), tokenizer)
    details = {"method": "captum.attr.LLMAttribution(FeatureAblation(model), tokenizer) on a TextTokenInput, "
                         "attr_target='log_prob', forward_in_tokens (one target token)",
               "baseline_token": base,
               "explains": "logit(target) - logit(foil), exactly, as the difference of two calls (log p(target), "
                           "log p(foil)); log p(target) without a foil (Captum's LLM API cannot explain a logit)",
               "forwards": "2 (T + 1) with a foil"}

    def fn(ids: Tensor, target: int, foil: Optional[int]) -> Tensor:
        inp = _text_input(ids, tokenizer, base)

        def call(token: int) -> Tensor:
            with torch.no_grad():
                res = llm.attribute(inp, target=torch.tensor([token]))
            return res.seq_attr.to(torch.float64)

        return _contrast(call, target, foil).to(ids.device)

    return Attributor(fn, "Captum FeatureAblation (LLM)", signed=True, needs_grad=False, details=details)


def captum_layer_integrated_gradients(model: nn.Module, tokenizer: Any, n_steps: int = 16,
                                      baseline: Optional[int] = None) -> Attributor:
    r"""Captum 0.9's ``LLMGradientAttribution(LayerIntegratedGradients)`` on the input embeddings, made contrastive.

    Integrated gradients of log p(target) on the embedding layer's output, from the
    embeddings of the ``baseline`` token at every position to the prompt's (Captum's default
    Gauss-Legendre rule, ``n_steps`` points), summed over the embedding dimension. With a foil
    the same is done for log p(foil) and subtracted: on the same path and points, integrated
    gradients are linear in the explained function, so the result is exactly IG of d =
    logit(target) - logit(foil). Signed. Cost: 2 n_steps forwards and backwards with a foil.

    Args:
        model: a Hugging Face ``*ForCausalLM``.
        tokenizer: its tokenizer.
        n_steps: integration points.
        baseline: the baseline token id (default: the tokenizer's unk, else pad, else eos
            token, else 0).

    Returns:
        :class:`Attributor` ``"Captum LayerIG-<n_steps> (LLM)"`` (signed, needs_grad).

    Raises:
        ValueError: ``n_steps`` < 1.

    Examples::

        >>> f = captum_layer_integrated_gradients(model, tokenizer, n_steps=16)  # doctest: +SKIP
        >>> f(ids, target, foil)                                                 # doctest: +SKIP
    """
    from captum.attr import LayerIntegratedGradients, LLMGradientAttribution

    if not isinstance(n_steps, int) or isinstance(n_steps, bool) or n_steps < 1:
        raise ValueError(f"n_steps must be a positive integer, got {n_steps!r}")
    base = _baseline_token(tokenizer, baseline)
    llm = LLMGradientAttribution(LayerIntegratedGradients(model, model.get_input_embeddings()), tokenizer)
    details = {"method": "captum.attr.LLMGradientAttribution(LayerIntegratedGradients(model, "
                         "model.get_input_embeddings()), tokenizer) on a TextTokenInput, summed over the embedding "
                         "dimension", "n_steps": n_steps, "baseline_token": base,
               "explains": "logit(target) - logit(foil), exactly, as the difference of two calls (log p(target), "
                           "log p(foil)); log p(target) without a foil (Captum's LLM API cannot explain a logit)",
               "forwards": "2 n_steps forward and backward passes with a foil"}

    def fn(ids: Tensor, target: int, foil: Optional[int]) -> Tensor:
        inp = _text_input(ids, tokenizer, base)

        def call(token: int) -> Tensor:
            with torch.enable_grad():
                res = llm.attribute(inp, target=torch.tensor([token]), n_steps=n_steps, internal_batch_size=n_steps)
            return res.seq_attr.to(torch.float64)

        return _contrast(call, target, foil).to(ids.device)

    return Attributor(fn, f"Captum LayerIG-{n_steps} (LLM)", signed=True, needs_grad=True, details=details)
