r"""Captum's LLM API for the decompositions: every generated token explained from one forward pass.

:class:`DecompositionLLMAttribution` takes Captum's ``TextTokenInput`` / ``TextTemplateInput``
and a target text (teacher forcing), target token ids or ``gen_args`` (generate first), and
returns Captum's own ``LLMAttributionResult``: ``token_attr`` has one row per generated token
and one column per input feature, ``seq_attr`` is the sum of the rows (the attribution of
the sum of the explained quantities: the decompositions are additive), and
``plot_token_attr`` / ``plot_seq_attr`` work unchanged.

Unlike ``LLMAttribution(FeatureAblation)`` (one forward pass per feature) or
``LLMGradientAttribution`` (one backward pass per generated token), the prompt and all
target tokens go through the model once; every target position is explained from the same
per-layer maps (:mod:`captum_normattr.decompose.primitives.multi_position`). See docs/llm.md; an
``ImageMaskInput`` goes to :mod:`captum_normattr.attr.llm_images` (docs/vlm.md).

The methods explain themselves: this module only asks the attribution's class
(``attribution.explain_positions``, answered with a
:class:`~captum_normattr.attr.positions.PositionExplanation`) and adapts the answer to Captum.
"""
from __future__ import annotations

import os
import string
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from captum.attr import Attribution, LLMAttributionResult, TextTemplateInput, TextTokenInput
from captum.attr._utils.interpretable_input import ImageMaskInput
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.arch.registry import supported_causal_families
from captum_normattr.attr.base import configured_name
from captum_normattr.models.adapters import require_loaded_model
from captum_normattr.attr.positions import (
    LOG_PROB_NOT_ADDITIVE,
    QUANTITIES,
    PositionExplanation,
    check_ids,
)
from captum_normattr.tokens import ReadableTokens, display_token, readable_tokens

#: Captum's default generation arguments (``captum.attr._core.llm_attr.DEFAULT_GEN_ARGS`` in 0.9).
DEFAULT_GEN_ARGS: Dict[str, Any] = {"max_new_tokens": 25, "do_sample": False, "temperature": None, "top_p": None}

#: what an unsupported attribution is told
UNSUPPORTED = (
    "{name} is not supported: use ALTILogitAttribution, DecompXAttribution, ALTIAttribution or GlobEncAttribution "
    "of a causal LM (a class with an explain_positions method)"
)


def check_explains_positions(attribution: Any) -> None:
    r"""Raise a TypeError unless ``attribution`` explains positions (its class has ``explain_positions``).

    Args:
        attribution: the attribution given to the LLM API.
    """
    if isinstance(attribution, nn.Module):  # the model itself, where its attribution belongs
        raise TypeError(f"expected an attribution of the model, got the model {type(attribution).__name__}; wrap it "
                        "in a method: DecompositionLLMAttribution(ALTILogitAttribution(model), tokenizer), or "
                        "DecompositionLLMAttribution('alti-logit', tokenizer, model=model)")
    if not isinstance(attribution, Attribution) or not callable(getattr(attribution, "explain_positions", None)):
        raise TypeError(UNSUPPORTED.format(name=type(attribution).__name__))


def check_tokenizer(tokenizer: Any) -> None:
    r"""Raise a TypeError, saying how to load one, unless ``tokenizer`` looks like a loaded tokenizer.

    Args:
        tokenizer: the tokenizer given to the LLM API (it needs ``encode`` and ``convert_ids_to_tokens``).
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        name = os.fspath(tokenizer)
        raise TypeError(f"expected a loaded tokenizer, got the string {name!r}; load it first: "
                        f"AutoTokenizer.from_pretrained({name!r})")
    if isinstance(tokenizer, nn.Module):
        raise TypeError(f"expected a tokenizer, got the model {type(tokenizer).__name__}: "
                        "DecompositionLLMAttribution(ALTILogitAttribution(model), tokenizer)")
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "convert_ids_to_tokens", None))):
        got = "None" if tokenizer is None else type(tokenizer).__name__
        raise TypeError(f"expected a loaded tokenizer (with encode and convert_ids_to_tokens), got {got}; load the "
                        "model's: AutoTokenizer.from_pretrained(NAME)")


def explain_positions(
    attribution: Attribution,
    input_ids: Tensor,
    positions: Tensor,
    target: Optional[Tensor] = None,
    quantity: str = "logit",
    foil: Optional[Tensor] = None,
    additional_forward_args: Any = None,
) -> PositionExplanation:
    r"""Explain n positions of one token sequence in one forward pass: ``attribution.explain_positions(...)``.

    Args:
        attribution: an :class:`~captum_normattr.ALTILogitAttribution`, a decoder
            :class:`~captum_normattr.DecompXAttribution`, or a rollout method
            (:class:`~captum_normattr.ALTIAttribution`, :class:`~captum_normattr.GlobEncAttribution`,
            :class:`~captum_normattr.FFIntegratedDecomposition`) of a causal LM: any class with an
            ``explain_positions`` hook. Its own ``explained_position`` is not used.
        input_ids: (T,) or (1, T) token ids (one sequence, no padding).
        positions: (n,) the explained positions (position i predicts token i + 1).
        target: (n,) the explained token at each position (needed by the signed methods;
            optional for the rollouts, where it only yields ``log_probs``).
        quantity: one of :data:`~captum_normattr.attr.positions.QUANTITIES` (signed methods).
        foil: (n,) or a single foil id, for ``quantity="logit_minus_foil"``.
        additional_forward_args: the model's further inputs by keyword (a vision-language
            model's ``pixel_values``, ...; per-token inputs cover the whole sequence); None: none.

    Returns:
        :class:`~captum_normattr.attr.positions.PositionExplanation`; row k equals the
        single-position call of the same class at ``positions[k]`` (up to rounding).

    Examples::

        >>> al = ALTILogitAttribution(model)
        >>> ids = tok("The capital of France is Paris", return_tensors="pt")["input_ids"][0]
        >>> ex = explain_positions(al, ids, torch.arange(ids.shape[0] - 1), ids[1:])
        >>> ex.scores.shape, ex.delta.abs().max()
    """
    check_explains_positions(attribution)
    if additional_forward_args is None:
        return attribution.explain_positions(input_ids, positions, target, quantity, foil)
    return attribution.explain_positions(input_ids, positions, target, quantity, foil,
                                         additional_forward_args=additional_forward_args)


# ----------------------------------------------------------------------------------------
# Captum's inputs: token features and template features
# ----------------------------------------------------------------------------------------
def template_value_spans(inp: TextTemplateInput, text: str) -> List[Tuple[int, int]]:
    r"""Character span of every value of a ``TextTemplateInput`` in its rendered text."""
    values = list(inp.values)
    if isinstance(inp.template, str):
        spans: List[Tuple[int, int]] = [(-1, -1)] * len(values)
        out, auto = [], 0
        for literal, name, spec, conv in string.Formatter().parse(inp.template):
            out.append(literal)
            if name is None:
                continue
            if name == "":
                idx, auto = auto, auto + 1
            elif name.isdigit():
                idx = int(name)
            elif name in inp.dict_keys:
                idx = inp.dict_keys.index(name)
            else:
                raise ValueError(f"template field {{{name}}} names no value of the TextTemplateInput")
            v = values[idx]
            v = {"r": repr, "a": ascii, "s": str}.get(conv, str)(v) if conv else v
            v = format(v, spec or "")
            start = sum(len(s) for s in out)
            spans[idx] = (start, start + len(v))
            out.append(v)
        if "".join(out) == text and all(s >= 0 for s, _ in spans):
            return spans
    spans, cursor = [], 0  # a callable template: find the values in order
    for v in values:
        at = text.find(v, cursor) if v else cursor
        if at < 0:
            raise ValueError(
                f"cannot locate the value {v!r} in the rendered template text; use a str template "
                "(e.g. '{} feels {}') so that every value's characters are known"
            )
        spans.append((at, at + len(v)))
        cursor = at + len(v)
    return spans


def template_token_features(inp: TextTemplateInput, tokenizer: Any, text: str, n_tokens: int) -> List[int]:
    r"""For every token of the encoded template text, its interpretable feature index (or -1)."""
    spans = template_value_spans(inp, text)
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
        offsets = list(enc["offset_mapping"])
    except (NotImplementedError, TypeError, KeyError, ValueError):
        raise ValueError(
            "TextTemplateInput features need a fast tokenizer (with return_offsets_mapping); load it with use_fast=True"
        ) from None
    if len(offsets) != n_tokens:
        raise ValueError("the tokenizer's offsets do not match its encoding of the template text")
    feats = []
    straddle = False
    for s, e in offsets:
        piece = text[s:e]
        if piece.strip():  # a byte-level BPE token carries the space before a word: whitespace does not decide
            s, e = s + len(piece) - len(piece.lstrip()), e - (len(piece) - len(piece.rstrip()))
        best, best_len = -1, 0
        for i, (vs, ve) in enumerate(spans):
            ov = min(e, ve) - max(s, vs)
            if ov > best_len:
                best, best_len = i, ov
            if 0 < ov < e - s:
                straddle = True
        if best >= 0 and inp.mask is not None:
            best = inp.formatted_mask[best]
        feats.append(best)
    if straddle:
        warnings.warn(
            "a token spans a value of the TextTemplateInput and the text around it; it is counted in the value it "
            "overlaps most", UserWarning, stacklevel=4,
        )
    return feats


@dataclass
class GenerationExplanation:
    r"""Everything :meth:`DecompositionLLMAttribution.decompose` computed for one prompt and its target tokens.

    Attributes:
        method: the method's readable name.
        input_ids: (T,) the teacher-forced sequence: prompt (P tokens) then the n target tokens.
        prompt_length: P.
        target_ids: (n,) the explained (generated or given) tokens.
        positions: (n,) the explained positions, P - 1 + k for target k.
        scores: (n, T) row k: every token's score for target k (prompt and earlier target
            tokens; the tokens from position P + k on are exactly 0). The full, untouched scores.
        tokens: the T tokens as the tokenizer spells them (``Ġcapital``, ``▁Paris``).
        output_tokens: the n target tokens as readable text
            (:func:`~captum_normattr.tokens.readable_tokens`: ``Paris``, no ``Ġ`` / ``▁``), a
            :class:`~captum_normattr.tokens.ReadableTokens` whose ``.raw`` holds the tokenizer's spelling.
        feature_of_token: (P,) long interpretable feature index of every prompt token (-1: none:
            a skipped token or template text).
        input_features: the feature names as Captum's input holds them (``inp.values``: the
            tokenizer's spelling of a ``TextTokenInput``'s tokens, a ``TextTemplateInput``'s values).
        sink_index: the attention-sink position (the first token: BOS where the tokenizer adds one).
        details: the :class:`PositionExplanation` (explained quantity, no-token terms, deltas,
            log-probabilities, per-method extras).
        inp: the Captum input.
        feature_text: the readable text of every feature (a token's text, no ``Ġ`` / ``▁``; a
            template value as given); None: :attr:`input_features`.
    """

    method: str
    input_ids: Tensor
    prompt_length: int
    target_ids: Tensor
    positions: Tensor
    scores: Tensor
    tokens: List[str]
    output_tokens: List[str]
    feature_of_token: Tensor
    input_features: List[str]
    sink_index: int
    details: PositionExplanation
    inp: Any = None
    feature_text: Optional[List[str]] = None

    @property
    def signed(self) -> bool:
        return self.details.signed

    @property
    def quantity(self) -> str:
        return self.details.quantity

    @property
    def explained(self) -> Optional[Tensor]:
        r"""(n,) the model's real explained quantity of every target (signed methods)."""
        return self.details.explained

    @property
    def delta(self) -> Optional[Tensor]:
        return self.details.delta

    @property
    def log_probs(self) -> Optional[Tensor]:
        r"""(n,) log p(target) of every target, from the same forward pass (reported, not explained)."""
        return self.details.log_probs

    @property
    def sink_share(self) -> Tensor:
        r"""(n,) the sink's share of every row: ``|score of the sink| / sum of |scores|`` over the row."""
        a = self.scores.abs()
        total = a.sum(-1)
        return torch.where(total > 0, a[:, self.sink_index] / total.clamp_min(torch.finfo(a.dtype).tiny),
                           torch.zeros_like(total))

    def feature_attr(self, exclude_sink: bool = False) -> Tensor:
        r"""(n, number of interpretable features): the sum of every feature's token scores.

        Args:
            exclude_sink: leave the sink token out of the sums (its score is not changed,
                it is just not shown; a feature made of the sink alone gets 0).
        """
        p = self.prompt_length
        feat = self.feature_of_token.to(self.scores.device).clone()
        if exclude_sink and self.sink_index < p:
            feat[self.sink_index] = -1
        n_feat = self.n_features
        keep = feat >= 0
        out = self.scores.new_zeros(self.scores.shape[0], n_feat)
        out.index_add_(1, feat[keep], self.scores[:, :p][:, keep])
        return out

    @property
    def n_features(self) -> int:
        inp = self.inp
        return int(inp.n_itp_features) if inp is not None else int(self.feature_of_token.max()) + 1

    def sink_feature(self) -> Optional[int]:
        r"""The interpretable feature that is the sink token alone (a ``TextTokenInput`` feature), or None."""
        if self.sink_index >= self.prompt_length:
            return None
        f = int(self.feature_of_token[self.sink_index])
        if f < 0 or int((self.feature_of_token == f).sum()) != 1:
            return None
        return f

    def to_captum(self, exclude_sink: bool = False) -> LLMAttributionResult:
        r"""Captum's ``LLMAttributionResult`` (its own class), as ``LLMAttribution.attribute`` builds it.

        ``token_attr`` (n, features), ``seq_attr`` = its column sums (the attribution of the
        sum of the explained quantities), ``output_probs`` = p(target) where known, and the
        labels as readable text, so that ``plot_token_attr`` / ``plot_seq_attr`` show clean
        words: ``input_tokens`` = the features' text (:attr:`feature_text`), ``output_tokens``
        = the targets' text (each label as :func:`~captum_normattr.tokens.display_token` shows it:
        a newline as ``\n``, a space-only token as ``␣``). The tokenizer's own spellings
        (``Ġcapital``) are kept on the result as two more attributes, ``raw_input_tokens``
        (:attr:`input_features`, what ``inp.values`` holds) and ``raw_output_tokens``, in the same order.

        Args:
            exclude_sink: leave the sink out of the plots and their colour scale: a sink
                feature of its own (e.g. BOS of a ``TextTokenInput``) is dropped as a column,
                and the sink's score is left out of any feature sum. The scores themselves
                (:attr:`scores`) are unchanged.
        """
        attr = self.feature_attr(exclude_sink)
        full = torch.cat([attr.sum(0, keepdim=True), attr], 0)
        fmt = getattr(self.inp, "format_attr", None)
        full = fmt(full) if fmt is not None else full
        names = list(self.input_features)
        labels = [display_token(t) for t in (self.feature_text if self.feature_text is not None else names)]
        inp = self.inp
        drop = self.sink_feature() if exclude_sink else None
        if drop is not None and full.shape[1] == len(names):
            keep = [j for j in range(full.shape[1]) if j != drop]
            full, names, labels, inp = full[:, keep], [names[j] for j in keep], [labels[j] for j in keep], None
        probs = None if self.log_probs is None else self.log_probs.exp()
        res = LLMAttributionResult(
            seq_attr=full[0], token_attr=full[1:], input_tokens=labels,
            output_tokens=[display_token(t) for t in self.output_tokens],
            output_probs=probs, inp=inp,
        )
        res.raw_input_tokens = names  # the tokenizer's spelling (inp.values), next to the readable labels
        res.raw_output_tokens = list(getattr(self.output_tokens, "raw", self.output_tokens))
        return res


def feature_labels(inp: Any, tokenizer: Any) -> ReadableTokens:
    r"""The readable text of every interpretable feature of a Captum text input, with the raw spelling.

    Args:
        inp: a ``TextTokenInput`` (its features are tokens: each token's text, from
            :func:`~captum_normattr.tokens.readable_tokens`, ``Ġcapital`` -> ``capital``) or a
            ``TextTemplateInput`` (its values, kept as given).
        tokenizer: the model's tokenizer.

    Returns:
        :class:`~captum_normattr.tokens.ReadableTokens`: the labels, with ``inp.values`` in ``.raw``.
    """
    values = [str(v) for v in inp.values]
    itp = getattr(inp, "itp_tensor", None)
    if isinstance(inp, TextTokenInput) and itp is not None and itp.numel() == len(values):
        ids = itp.reshape(-1).tolist()
        if tokenizer.convert_ids_to_tokens(ids) == values:  # the values are these tokens' spellings
            return ReadableTokens(readable_tokens(tokenizer, ids), raw=values)
    return ReadableTokens(values, raw=values)


def chat_prompt(
    tokenizer: Any, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
) -> str:
    r"""A chat conversation rendered with the tokenizer's chat template, as text.

    Args:
        tokenizer: a tokenizer with a chat template.
        messages: ``[{"role": "user", "content": "..."}, ...]``.
        add_generation_prompt: end with the assistant's turn header (what generation continues).
        **kwargs: passed to ``tokenizer.apply_chat_template``.

    Returns:
        The rendered prompt; give it to :func:`chat_token_input` (or ``TextTokenInput``).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; pass the prompt text itself")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def chat_token_input(
    tokenizer: Any,
    messages: Union[str, Sequence[Dict[str, str]]],
    skip_tokens: Union[List[int], List[str], None] = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> TextTokenInput:
    r"""A Captum ``TextTokenInput`` of a chat conversation (or of a prompt already rendered by ``apply_chat_template``).

    ``TextTokenInput`` encodes its text with the tokenizer's special tokens; a rendered chat
    template usually starts with the BOS text already, so the BOS would appear twice. The
    duplicate is removed here.

    Args:
        tokenizer: the model's tokenizer.
        messages: the messages (rendered with :func:`chat_prompt`) or the rendered text.
        skip_tokens: as in ``TextTokenInput``.
        add_generation_prompt, ``**kwargs``: see :func:`chat_prompt`.

    Returns:
        ``TextTokenInput``.
    """
    text = messages if isinstance(messages, str) else chat_prompt(tokenizer, messages, add_generation_prompt, **kwargs)
    inp = TextTokenInput(text, tokenizer, skip_tokens=skip_tokens)
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = inp.inp_tensor
    if bos is not None and ids.shape[1] >= 2 and int(ids[0, 0]) == bos and int(ids[0, 1]) == bos:
        inp.inp_tensor = ids[:, 1:]
        if inp.itp_mask is None:
            inp.itp_tensor = inp.inp_tensor
        else:
            inp.itp_mask = inp.itp_mask[:, 1:]
            inp.itp_tensor = inp.inp_tensor[inp.itp_mask].unsqueeze(0)
        inp.values = tokenizer.convert_ids_to_tokens(inp.itp_tensor[0].tolist())
        inp.n_itp_features = len(inp.values)
    return inp


def _method_from_name(name: str, model: Optional[nn.Module], **kwargs: Any) -> Attribution:
    from captum_normattr.attr.methods import METHODS, get_method

    if name.lower() not in METHODS:  # a model's name or folder where the attribution belongs?
        raise TypeError(
            f"expected an attribution or a method name ({', '.join(k for k, s in METHODS.items() if s.llm)}), got the "
            f"string {name!r}; for a model, load it first: model = AutoModelForCausalLM.from_pretrained({name!r}), "
            "then DecompositionLLMAttribution(ALTILogitAttribution(model), tokenizer)")
    if model is None:
        raise ValueError(f"method {name!r} given by name: pass model= as well")
    require_loaded_model(model, "AutoModelForCausalLM")
    return get_method(name).build(model, None, **kwargs)


class DecompositionLLMAttribution(Attribution):
    r"""Captum's ``LLMAttribution`` interface for ALTI-Logit, DecompX, ALTI and GlobEnc of a causal LM.

    ``attribute(inp, target)`` explains every target token of a teacher-forced sequence
    (prompt + target) from ONE forward pass: all target positions share the per-layer maps
    (ALTI-Logit, DecompX: one explained logit per target position; ALTI, GlobEnc: one rollout
    row per position). The result is Captum's own ``LLMAttributionResult``.

    What is explained (signed methods), by ``quantity``:

    - ``"logit"`` (default): the target token's logit at its position;
    - ``"logit_minus_foil"``: the target logit minus a foil token's (``foil=``);
    - ``"logit_minus_mean"``: the target logit minus the mean logit over the vocabulary.

    Captum's ``LLMAttribution`` explains the log-probability by default. A log-probability
    is not additive (logsumexp is not linear in the residual stream), so it is refused with
    an explanation; the log-probabilities of the targets are reported alongside
    (:attr:`GenerationExplanation.log_probs`, ``LLMAttributionResult.output_probs``).
    ALTI and GlobEnc rows are class-agnostic (they do not depend on the target).

    Features: a ``TextTokenInput``'s tokens (``skip_tokens`` left out); a ``TextTemplateInput``'s
    values, each the sum of its tokens' scores (exact: the scores are additive); template
    text around the values is no feature. Baselines mean nothing for a decomposition
    (nothing is removed or replaced) and are ignored.

    The attention sink (the first token, BOS where the tokenizer adds one) usually takes a
    large share: :attr:`GenerationExplanation.sink_share` reports it, and ``exclude_sink=True``
    leaves it out of the returned result (plots and their colour scale) without changing
    any score.

    Args:
        attr_method: an attribution of a causal LM (``ALTILogitAttribution``,
            ``DecompXAttribution``, ``ALTIAttribution``, ``GlobEncAttribution``), or a method
            name of the registry (``"alti-logit"``, ``"decompx"``, ``"alti"``, ``"globenc"``)
            together with ``model``.
        tokenizer: the model's tokenizer.
        model: the model, when ``attr_method`` is a name.
        **method_kwargs: constructor keywords of a method given by name.

    Examples::

        >>> from captum.attr import TextTokenInput
        >>> llm = DecompositionLLMAttribution(ALTILogitAttribution(model), tok)
        >>> inp = TextTokenInput("The capital of France is", tok)
        >>> res = llm.attribute(inp, target=" Paris, a city")  # teacher forcing
        >>> res.token_attr.shape  # (output tokens, input tokens)
        >>> fig, ax = res.plot_token_attr()
        >>> res = llm.attribute(inp, gen_args={"max_new_tokens": 8})  # generate first
    """

    method_name = "LLM attribution"

    SUPPORTED_INPUTS = (TextTemplateInput, TextTokenInput, ImageMaskInput)

    def __init__(
        self,
        attr_method: Union[Attribution, str],
        tokenizer: Any,
        model: Optional[nn.Module] = None,
        **method_kwargs: Any,
    ) -> None:
        check_tokenizer(tokenizer)
        if isinstance(attr_method, str):
            attr_method = _method_from_name(attr_method, model, **method_kwargs)
        elif method_kwargs:
            raise TypeError("method keywords apply to a method given by name only")
        check_explains_positions(attr_method)
        if not attr_method.explains_next_tokens:
            raise ValueError(f"DecompositionLLMAttribution explains causal LMs ({supported_causal_families()}); "
                             f"{attr_method.adapter.family} is not one")
        super().__init__(attr_method.model)
        self.attr_method = attr_method
        self.model: nn.Module = attr_method.model
        self.tokenizer = tokenizer
        self.device = next(self.model.parameters()).device

    # --- inputs and targets ----------------------------------------------------------
    def _prompt_ids(self, inp: Any) -> Tensor:
        model_input = inp.to_model_input()
        if isinstance(model_input, str):  # TextTemplateInput: encoded as Captum encodes it
            return self.tokenizer.encode(model_input, return_tensors="pt")[0]
        return model_input.reshape(-1)

    def _target_ids(self, inp: Any, prompt: Tensor, target: Any, gen_args: Optional[Dict[str, Any]]) -> Tensor:
        if target is None:
            if not callable(getattr(self.model, "generate", None)):
                raise ValueError("the model has no generate(): give target (a string or token ids)")
            args = dict(gen_args) if gen_args else dict(DEFAULT_GEN_ARGS)
            ids = prompt.unsqueeze(0).to(self.device)
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **args)
            return out[0, ids.shape[1]:].detach().cpu()
        if gen_args is not None:
            raise ValueError("gen_args applies when target is None (generate first); give one of them")
        if isinstance(target, str):
            return torch.tensor(self.tokenizer.encode(target, add_special_tokens=False), dtype=torch.long)
        if isinstance(target, (list, tuple)):
            target = torch.tensor(list(target), dtype=torch.long)
        if isinstance(target, Tensor):
            return check_ids(target, "target").cpu()
        raise TypeError(f"target must be a string, token ids or None; got {type(target).__name__}")

    def _foil_ids(self, foil: Any, n: int) -> Optional[Tensor]:
        if foil is None:
            return None
        if isinstance(foil, str):
            ids = self.tokenizer.encode(foil, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"foil {foil!r} is {len(ids)} tokens; give one token (or its id)")
            return torch.full((n,), ids[0], dtype=torch.long)
        f = torch.as_tensor(foil, dtype=torch.long).reshape(-1)
        return f.expand(n).clone() if f.numel() == 1 else f

    def _features(self, inp: Any, prompt: Tensor) -> Tensor:
        p = prompt.shape[0]
        if isinstance(inp, TextTokenInput):
            if inp.itp_mask is None:
                return torch.arange(p)
            mask = inp.itp_mask.reshape(-1).bool()
            feat = torch.full((p,), -1, dtype=torch.long)
            feat[mask] = torch.arange(int(mask.sum()))
            return feat
        return torch.tensor(template_token_features(inp, self.tokenizer, inp.to_model_input(), p), dtype=torch.long)

    # --- the API ---------------------------------------------------------------------
    def decompose(
        self,
        inp: Union[TextTokenInput, TextTemplateInput, ImageMaskInput],
        target: Union[str, Tensor, Sequence[int], None] = None,
        gen_args: Optional[Dict[str, Any]] = None,
        quantity: str = "logit",
        foil: Union[str, int, Tensor, None] = None,
    ) -> GenerationExplanation:
        r"""Every target token explained from one teacher-forced forward pass, with all the details.

        Args:
            inp: Captum's ``TextTokenInput`` or ``TextTemplateInput`` (baselines ignored), or an
                ``ImageMaskInput`` of a vision-language model (its segments scored by pixel overlap
                from the same one pass: :func:`~captum_normattr.attr.llm_images.decompose_image_input`,
                which returns an :class:`~captum_normattr.attr.llm_images.ImageGenerationExplanation`).
            target: the target text (encoded without special tokens, as Captum does), (n,)
                token ids, or None: generate with ``gen_args`` first.
            gen_args: ``model.generate`` arguments when ``target`` is None (default: Captum's,
                greedy, 25 new tokens).
            quantity: ``"logit"``, ``"logit_minus_foil"``, ``"logit_minus_mean"``
                (:data:`QUANTITIES`); ``"log_prob"`` raises (not additive; see the class docs).
            foil: the foil token (a one-token string, an id, or n ids) for ``"logit_minus_foil"``.

        Returns:
            :class:`GenerationExplanation`.
        """
        if isinstance(inp, ImageMaskInput):  # a vision-language model's image segments: docs/vlm.md
            from captum_normattr.attr.llm_images import decompose_image_input

            if target is None and not gen_args:
                gen_args = DEFAULT_GEN_ARGS
            return decompose_image_input(self, inp, target, gen_args, quantity, foil)  # type: ignore[return-value]
        if not isinstance(inp, self.SUPPORTED_INPUTS):
            raise TypeError(f"inp must be a TextTokenInput, TextTemplateInput or ImageMaskInput; got "
                            f"{type(inp).__name__}")
        if quantity == "log_prob":
            raise ValueError(LOG_PROB_NOT_ADDITIVE)
        if quantity not in QUANTITIES:
            raise ValueError(f"quantity must be one of {QUANTITIES}; got {quantity!r}")
        if quantity == "logit_minus_foil" and foil is None:
            raise ValueError("quantity='logit_minus_foil' needs foil=")
        prompt = self._prompt_ids(inp).cpu()
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and prompt.shape[0] >= 2 and int(prompt[0]) == bos == int(prompt[1]):
            warnings.warn("the prompt starts with two BOS tokens (a chat template rendered with BOS, encoded with "
                          "special tokens); build the input with chat_token_input()", UserWarning, stacklevel=2)
        target_ids = self._target_ids(inp, prompt, target, gen_args)
        n = int(target_ids.shape[0])
        if n == 0:
            raise ValueError("no target tokens: the target text is empty or generation produced nothing")
        p = int(prompt.shape[0])
        ids = torch.cat([prompt, target_ids])
        positions = torch.arange(p - 1, p - 1 + n)
        fl = self._foil_ids(foil, n)
        details = explain_positions(self.attr_method, ids, positions, target_ids, quantity if fl is None or
                                    quantity != "logit" else "logit_minus_foil", fl)
        return GenerationExplanation(
            method=details.method, input_ids=ids, prompt_length=p, target_ids=target_ids, positions=positions,
            scores=details.scores, tokens=self.tokenizer.convert_ids_to_tokens(ids.tolist()),
            output_tokens=readable_tokens(self.tokenizer, target_ids), feature_of_token=self._features(inp, prompt),
            input_features=list(inp.values), sink_index=0, details=details, inp=inp,
            feature_text=list(feature_labels(inp, self.tokenizer)),
        )

    @log_usage()
    def attribute(  # type: ignore[override]
        self,
        inp: Union[TextTokenInput, TextTemplateInput, ImageMaskInput],
        target: Union[str, Tensor, Sequence[int], None] = None,
        gen_args: Optional[Dict[str, Any]] = None,
        quantity: str = "logit",
        foil: Union[str, int, Tensor, None] = None,
        exclude_sink: bool = False,
        **kwargs: Any,
    ) -> LLMAttributionResult:
        r"""Captum's ``LLMAttributionResult`` for every target token, from one forward pass.

        Args:
            inp, target, gen_args, quantity, foil: see :meth:`decompose`.
            exclude_sink: leave the sink token out of the result (see
                :meth:`GenerationExplanation.to_captum`); the scores are unchanged.
            **kwargs: Captum's keywords that do not apply to a decomposition
                (``num_trials``, ``use_cached_outputs``, ``forward_in_tokens``) are accepted and
                ignored with a warning. With an ``ImageMaskInput``: ``layout`` (where the patch grid
                lies over the image, :data:`~captum_normattr.attr.llm_images.LAYOUTS`).

        Returns:
            ``captum.attr.LLMAttributionResult``: ``token_attr`` (n, features), ``seq_attr``
            (features,), ``output_probs`` (n,) the target probabilities; ``input_tokens`` /
            ``output_tokens`` readable text (no ``Ġ`` / ``▁``), the tokenizer's spellings in
            ``raw_input_tokens`` / ``raw_output_tokens`` (:meth:`GenerationExplanation.to_captum`).
            For an ``ImageMaskInput`` the features are its segments, and the result also holds
            ``patch_attr`` (n, rows, cols) and ``explanation``
            (:meth:`~captum_normattr.attr.llm_images.ImageGenerationExplanation.to_captum`).
        """
        if isinstance(inp, ImageMaskInput):  # image segments from one pass (captum_normattr.attr.llm_images)
            from captum_normattr.attr.llm_images import attribute_image_input

            if target is None and not gen_args:
                gen_args = DEFAULT_GEN_ARGS
            return attribute_image_input(self, inp, target, gen_args, quantity, foil, **kwargs)
        if kwargs:
            warnings.warn(f"ignored (they mean nothing for a decomposition): {sorted(kwargs)}", UserWarning,
                          stacklevel=2)
        return self.decompose(inp, target, gen_args, quantity, foil).to_captum(exclude_sink)

    def has_convergence_delta(self) -> bool:
        r"""True for the signed methods (their scores depend on the target and carry a completeness error)."""
        return bool(self.attr_method.uses_target)

    @configured_name
    def get_name(self) -> str:
        return f"{self.attr_method.get_name()} (LLM)"


__all__ = [
    "DEFAULT_GEN_ARGS",
    "DecompositionLLMAttribution",
    "GenerationExplanation",
    "UNSUPPORTED",
    "chat_prompt",
    "chat_token_input",
    "check_explains_positions",
    "check_tokenizer",
    "explain_positions",
    "feature_labels",
    "template_token_features",
    "template_value_spans",
]
