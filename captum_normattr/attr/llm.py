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
per-layer maps (:mod:`captum_normattr.decompose.primitives.multi_position`). See docs/llm.md.
"""
from __future__ import annotations

import string
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from captum.attr import Attribution, LLMAttributionResult, TextTemplateInput, TextTokenInput
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.arch.registry import supported_causal_families
from captum_normattr.attr.alti_logit import ALTILogitAttribution
from captum_normattr.attr.base import LayerDecompositionAttribution, compute_dtype, configured_name, streamed_forward
from captum_normattr.attr.decompx import DecompXAttribution
from captum_normattr.attr.explained_output import VOCAB_BLOCK, NextTokenLogit
from captum_normattr.attr.inputs import prepare_inputs
from captum_normattr.decompose.methods.decompx.adjoint import AdjointPass, FrozenLayer
from captum_normattr.decompose.methods.decompx.parts import ff_coefficients
from captum_normattr.decompose.methods.decompx.propagation import PartsPropagation
from captum_normattr.decompose.methods.decompx.readout import logit_scores
from captum_normattr.decompose.primitives.multi_position import (
    alti_logit_rows,
    attention_logit_updates,
    multi_logit_outputs,
    rollout_rows_at_scaled,
    unscaled_logit_directions,
)
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.decompose.primitives.rollout import LayerMapStore
from captum_normattr.models.adapters import base_model, get_path, layer_modules, value_projection
from captum_normattr.models.capture.recorder import norm_params
from captum_normattr.models.weights import tensors_to

#: The explained quantities of the signed methods (ALTI-Logit, DecompX).
QUANTITIES: Tuple[str, ...] = ("logit", "logit_minus_foil", "logit_minus_mean")

#: Captum's default generation arguments (``captum.attr._core.llm_attr.DEFAULT_GEN_ARGS`` in 0.9).
DEFAULT_GEN_ARGS: Dict[str, Any] = {"max_new_tokens": 25, "do_sample": False, "temperature": None, "top_p": None}

LOG_PROB_NOT_ADDITIVE = (
    "log_prob = logit(target) - logsumexp(all logits) is not additive over the residual stream (logsumexp is "
    "not linear), so no decomposition splits it exactly into token scores. Explain quantity='logit' (the default), "
    "'logit_minus_mean' (the target logit minus the mean logit, the linear part of the log-probability's "
    "dependence on the logits) or 'logit_minus_foil'; the log-probabilities are reported alongside "
    "(GenerationExplanation.log_probs, LLMAttributionResult.output_probs)."
)


# ----------------------------------------------------------------------------------------
# The engines: n explained positions of one teacher-forced sequence
# ----------------------------------------------------------------------------------------
@dataclass
class PositionExplanation:
    r"""What one multi-position call computed, for one sequence of T tokens.

    Attributes:
        method: the method's readable name.
        scores: (n, T) row k: the score of every token of the sequence for explained
            position ``positions[k]`` (tokens after it exactly 0).
        positions: (n,) long explained positions.
        signed: the scores are signed logit contributions (ALTI-Logit, DecompX); False for
            the rollout rows of ALTI / GlobEnc (class-agnostic, no target).
        target: (n,) long target ids (or None); foil: (n,) long foil ids (or None).
        quantity: one of :data:`QUANTITIES` (signed methods) or ``"rollout"``.
        explained: (n,) the model's real explained quantity (signed methods), else None.
        no_token: (n,) the terms that belong to no token (embedding at i, FF updates,
            biases; DecompX: its bias score), else None.
        delta: (n,) ``explained - (scores.sum(-1) + no_token)``, the completeness error.
        log_probs: (n,) log p(target) at each position, when the model has an LM head.
        extras: per-method tensors, e.g. ALTI-Logit's ``layer_token_contributions`` (n, L, T).
    """

    method: str
    scores: Tensor
    positions: Tensor
    signed: bool
    target: Optional[Tensor] = None
    foil: Optional[Tensor] = None
    quantity: str = "logit"
    explained: Optional[Tensor] = None
    no_token: Optional[Tensor] = None
    delta: Optional[Tensor] = None
    log_probs: Optional[Tensor] = None
    extras: Dict[str, Tensor] = field(default_factory=dict)


def _check_ids(ids: Tensor, name: str) -> Tensor:
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids")
    return ids.reshape(-1).long()


def _final_norm(model: nn.Module, adapter, dtype: torch.dtype, device: torch.device):
    return norm_params(get_path(base_model(model), adapter.final_norm), adapter.head.final_norm, dtype, device)


def _mean_unembedding(output: NextTokenLogit, dtype: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor]:
    r"""(mean row of W_U (D,), mean LM-head bias ()), cast :data:`VOCAB_BLOCK` rows at a time."""
    weight, bias = output.weight, output.weight_bias
    total = torch.zeros(weight.shape[1], dtype=dtype, device=device)
    for start in range(0, weight.shape[0], VOCAB_BLOCK):
        total += weight[start:start + VOCAB_BLOCK].detach().to(device=device, dtype=dtype).sum(0)
    mean_b = torch.zeros((), dtype=dtype, device=device)
    if bias is not None:
        mean_b = bias.detach().to(device=device, dtype=dtype).mean()
    return total / weight.shape[0], mean_b


def explained_directions(
    output: NextTokenLogit, target: Tensor, quantity: str, foil: Optional[Tensor], dtype: torch.dtype, device
) -> Tuple[Tensor, Tensor]:
    r"""The unembedding direction u (n, D) and bias (n,) of every explained position.

    Args:
        output: the model's :class:`~captum_normattr.attr.explained_output.NextTokenLogit`.
        target: (n,) target ids; foil: (n,) foil ids for ``"logit_minus_foil"``.
        quantity: one of :data:`QUANTITIES`.

    Returns:
        (u, bias): ``"logit"`` W_U[t], b[t]; ``"logit_minus_foil"`` W_U[t] - W_U[f],
        b[t] - b[f]; ``"logit_minus_mean"`` W_U[t] - mean_v W_U[v], b[t] - mean_v b[v].
    """
    n = target.shape[0]
    probe = torch.zeros(n, 1, dtype=dtype, device=device)
    if quantity == "logit_minus_foil":
        if foil is None:
            raise ValueError("quantity='logit_minus_foil' needs foil= (a token id, a string of one token, or n ids)")
        got = output.resolve(target.to(device), probe, foil=foil.to(device))
        return got.direction, got.bias
    got = output.resolve(target.to(device), probe)
    if quantity == "logit_minus_mean":
        mean_u, mean_b = _mean_unembedding(output, dtype, device)
        return got.direction - mean_u, got.bias - mean_b
    return got.direction, got.bias


def _log_probs(output: Optional[NextTokenLogit], final_out: Tensor, target: Optional[Tensor]) -> Optional[Tensor]:
    if output is None or target is None:
        return None
    logits = output.logits(final_out)  # (n, V)
    return torch.log_softmax(logits, -1).gather(1, target.to(logits.device).view(-1, 1)).squeeze(1)


def _lm_output(model: nn.Module, adapter) -> Optional[NextTokenLogit]:
    try:
        return NextTokenLogit(model, adapter)
    except ValueError:
        return None


def _warn_non_finite(prepared) -> bool:
    if prepared.finite is not None and not bool(prepared.finite.all()):
        warnings.warn("the forward pass holds NaN or infinite values; the scores are NaN", RuntimeWarning, stacklevel=3)
        return True
    return False


def _explain_alti_logit(
    attr: ALTILogitAttribution, ids: Tensor, positions: Tensor, target: Tensor, quantity: str, foil: Optional[Tensor]
) -> PositionExplanation:
    model, adapter = attr.model, attr.adapter
    prepared = prepare_inputs(model, adapter, ids.unsqueeze(0), None)
    valid = prepared.valid
    dtype, dev = compute_dtype(model), valid.device
    u, ub = explained_directions(attr.output, target, quantity, foil, dtype, dev)
    fparams0 = _final_norm(model, adapter, dtype, dev)
    w_unscaled = unscaled_logit_directions(fparams0, u).unsqueeze(0)  # (1, n, D)
    n_layers = len(layer_modules(model, adapter))
    store = LayerMapStore(n_layers, adapter.causal, dense=True)
    kept: Dict[str, Any] = {"updates": [None] * n_layers, "ff": [None] * n_layers, "biases": [None] * n_layers}

    def on_layer(layer: LayerTensors) -> None:
        layer = tensors_to(layer, dev)
        l = layer.index
        if l == 0:
            kept["embedding"] = layer.hidden_in[:, positions]
        store.put(l, attr.kind.alti_map(layer, valid, attr.memory_budget_mb))
        layer = attr.kind.logit_form(layer)  # the same parts as a pre-LN record (the layer kind's frozen maps folded in)
        kept["updates"][l] = attention_logit_updates(layer, positions, w_unscaled.to(layer.hidden_in.dtype))
        kept["ff"][l] = layer.ff_out[:, positions]
        zero = layer.hidden_in.new_zeros(layer.hidden_in.shape[-1])
        kept["biases"][l] = layer.out_bias if layer.out_bias is not None else zero

    with streamed_forward(model, adapter, prepared, on_layer) as (rec, _):
        fparams, f_in, f_out = tensors_to(rec.final_norm_tensors(), dev)
    with torch.no_grad():
        f_in_p, f_out_p = f_in[:, positions], f_out[:, positions]
        terms = alti_logit_rows(
            torch.stack(kept["updates"], 1), store, kept["embedding"], torch.stack(kept["ff"], 1),
            torch.stack(kept["biases"]), fparams, f_in_p, f_out_p, u.unsqueeze(0), ub.unsqueeze(0), valid,
        )
        no_token = (terms["embedding"] + terms["ff"].sum(-1) + terms["attention_bias"].sum(-1) + terms["final_bias"]
                    + terms["unattributed"].sum(-1))
        log_probs = _log_probs(attr.output, f_out_p[0], target)
    scores = terms["scores"][0]
    if _warn_non_finite(prepared):
        scores = torch.full_like(scores, float("nan"))
    return PositionExplanation(
        method=attr.get_name(), scores=scores, positions=positions, signed=True, target=target, foil=foil,
        quantity=quantity, explained=terms["logit"][0], no_token=no_token[0], delta=terms["delta"][0],
        log_probs=log_probs,
        extras={k: terms[k][0] for k in ("layer_token_contributions", "layer_logit_updates", "embedding", "ff",
                                         "attention_bias", "final_bias", "unattributed")},
    )


def _ordinary(t: Tensor) -> Tensor:
    return t.clone() if t.is_inference() else t


def _explain_decompx(
    attr: DecompXAttribution, ids: Tensor, positions: Tensor, target: Tensor, quantity: str, foil: Optional[Tensor]
) -> PositionExplanation:
    if not attr.decoder:
        raise ValueError("DecompositionLLMAttribution explains causal LMs; this DecompXAttribution wraps a classifier")
    model, adapter = attr.model, attr.adapter
    # the adjoint differentiates the frozen layers, which autograd refuses on inference tensors
    with torch.inference_mode(False):
        prepared = prepare_inputs(model, adapter, _ordinary(ids).unsqueeze(0), None)
        valid = prepared.valid
        dtype, dev = compute_dtype(model), valid.device
        vf = valid.to(dtype)
        u, ub = explained_directions(attr.output, target, quantity, foil, dtype, dev)
        u, ub = u.unsqueeze(0), ub.unsqueeze(0)
        modules = layer_modules(model, adapter)
        n_layers = len(modules)
        rows = torch.unique(positions)
        forward = attr.algorithm == "forward" or attr.bias_mode != "separate"
        prop = PartsPropagation(n_layers, valid, attr.bias_mode, rows, attr.memory_budget_mb) if forward else None
        adj = None if forward else AdjointPass(n_layers, rows)
        quad: Dict[int, Tensor] = {}

        def frozen(layer: LayerTensors) -> FrozenLayer:
            coefs = ff_coefficients(layer, attr.nodes)
            q = coefs.get("quadrature_error")
            quad[layer.index] = ((q if q is not None else torch.zeros_like(layer.hidden_in[..., 0])) * vf).amax(-1)
            w, b = value_projection(modules[layer.index], adapter)
            d, t = layer.hidden_in.device, layer.hidden_in.dtype
            return FrozenLayer(layer, w.detach().to(d, t), None if b is None else b.detach().to(d, t), coefs, vf > 0)

        def on_layer(layer: LayerTensors) -> None:
            layer = tensors_to(layer, dev)
            if prop is not None:
                step = frozen(layer)
                prop.step(layer, step.value_weight, step.value_bias, step.coefs)
            else:
                adj.forward(layer.hidden_in)

        with streamed_forward(model, adapter, prepared, on_layer, keep_calls=adj is not None) as (rec, _):
            fparams, f_in, f_out = tensors_to(rec.final_norm_tensors(), dev)
            logit = (f_out[:, positions] * u).sum(-1) + ub  # (1, n)
            if adj is not None:
                outputs = multi_logit_outputs(positions, adj.last_rows, fparams, f_in, u, ub)
                grads = adj.backward(lambda l, x: frozen(tensors_to(rec.rerun_layer(l, x), x.device)), outputs)
                e = adj.embeddings
                scores = torch.stack([(g * e).sum(-1).detach() for g in grads], 1)  # (1, n, T)
                bias = torch.stack(adj.constants, 1)  # (1, n)
                del grads
        with torch.no_grad():
            if prop is not None:
                res = prop.result()
                idx = torch.searchsorted(res.rows, positions)
                got = [
                    logit_scores(res.parts[:, int(idx[k])], res.bias[:, int(idx[k])], fparams,
                                 f_in[:, int(positions[k])],
                                 u[:, k], ub[:, k], attr.bias_mode, fallback=positions[k:k + 1])
                    for k in range(positions.shape[0])
                ]
                scores = torch.stack([s for s, _ in got], 1)
                bias = torch.stack([b for _, b in got], 1)
            scores = scores * vf.unsqueeze(1)
            delta = logit - (scores.sum(-1) + bias)
            log_probs = _log_probs(attr.output, f_out[0, positions], target)
    scores = scores[0]
    if _warn_non_finite(prepared):
        scores = torch.full_like(scores, float("nan"))
    return PositionExplanation(
        method=attr.get_name(), scores=scores, positions=positions, signed=True, target=target, foil=foil,
        quantity=quantity, explained=logit[0], no_token=bias[0], delta=delta[0], log_probs=log_probs,
        extras={"quadrature_error": torch.stack([quad[l] for l in range(n_layers)], 1)[0]},
    )


def _explain_rollout(
    attr: LayerDecompositionAttribution, ids: Tensor, positions: Tensor, target: Optional[Tensor]
) -> PositionExplanation:
    model, adapter = attr.model, attr.adapter
    prepared = prepare_inputs(model, adapter, ids.unsqueeze(0), None)
    valid = prepared.valid
    n_layers = len(layer_modules(model, adapter))
    store = LayerMapStore(n_layers, adapter.causal, dense=True)

    def on_layer(layer: LayerTensors) -> None:
        d = layer.hidden_in.device
        c = attr.layer_contribution(layer, valid.to(d), False)
        store.put(layer.index, c.map.to(valid.device))

    output = _lm_output(model, adapter) if target is not None else None
    with streamed_forward(model, adapter, prepared, on_layer) as (rec, _):
        f_out = rec.final_norm_tensors()[2] if (output is not None and adapter.final_norm is not None) else None
    with torch.no_grad():
        scores, scale = rollout_rows_at_scaled(store, positions, attr.rollout_convention)
        scores, scale = scores[0] * valid[0].to(store.dense().dtype), scale[0]
        f_rows = None if f_out is None else f_out[0, positions.to(f_out.device)].to(valid.device)
        log_probs = None if f_rows is None else _log_probs(output, f_rows, target)
    if _warn_non_finite(prepared):
        scores = torch.full_like(scores, float("nan"))
    extras = {}
    if bool((scale != 0).any()):  # a raw rollout beyond the dtype: returned divided by 2**scale (docs/reliability.md)
        extras["rollout_log2_scale"] = scale
        warnings.warn(
            f"{attr.get_name()}: the raw rollout of explained position(s) {positions[scale != 0].tolist()} exceeds "
            f"{scores.dtype}'s range (the layer maps' rows are not normalised and their product over the layers grows "
            "past the dtype); those rows are divided by 2**extras['rollout_log2_scale'] (exact ratios and ranks); "
            "rollout='row_normalized' stays bounded.", RuntimeWarning, stacklevel=3)
    return PositionExplanation(method=attr.get_name(), scores=scores, positions=positions, signed=False, target=target,
                               quantity="rollout", log_probs=log_probs, extras=extras)


def explain_positions(
    attribution: Attribution,
    input_ids: Tensor,
    positions: Tensor,
    target: Optional[Tensor] = None,
    quantity: str = "logit",
    foil: Optional[Tensor] = None,
) -> PositionExplanation:
    r"""Explain n positions of one token sequence in one forward pass.

    Args:
        attribution: an :class:`~captum_normattr.ALTILogitAttribution`, a decoder
            :class:`~captum_normattr.DecompXAttribution`, or a rollout method
            (:class:`~captum_normattr.ALTIAttribution`, :class:`~captum_normattr.GlobEncAttribution`,
            :class:`~captum_normattr.FFIntegratedDecomposition`) of a causal LM. Its own
            ``explained_position`` is not used.
        input_ids: (T,) or (1, T) token ids (one sequence, no padding).
        positions: (n,) the explained positions (position i predicts token i + 1).
        target: (n,) the explained token at each position (needed by the signed methods;
            optional for the rollouts, where it only yields ``log_probs``).
        quantity: one of :data:`QUANTITIES` (signed methods).
        foil: (n,) or a single foil id, for ``quantity="logit_minus_foil"``.

    Returns:
        :class:`PositionExplanation`; row k equals the single-position call of the same
        class at ``positions[k]`` (up to rounding).

    Examples::

        >>> al = ALTILogitAttribution(model)
        >>> ids = tok("The capital of France is Paris", return_tensors="pt")["input_ids"][0]
        >>> ex = explain_positions(al, ids, torch.arange(ids.shape[0] - 1), ids[1:])
        >>> ex.scores.shape, ex.delta.abs().max()
    """
    ids = _check_ids(input_ids, "input_ids")
    pos = _check_ids(positions, "positions")
    t = ids.shape[0]
    if pos.numel() == 0:
        raise ValueError("give at least one explained position")
    if bool(((pos < 0) | (pos >= t)).any()):
        raise ValueError(f"explained positions must lie in [0, {t - 1}]; got {pos.tolist()}")
    if quantity == "log_prob":
        raise ValueError(LOG_PROB_NOT_ADDITIVE)
    if quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {QUANTITIES}; got {quantity!r}")
    tgt = None if target is None else _check_ids(target, "target")
    if tgt is not None and tgt.shape[0] != pos.shape[0]:
        raise ValueError(f"target must have one token per explained position ({pos.shape[0]}); got {tgt.shape[0]}")
    fl = None
    if foil is not None:
        fl = _check_ids(torch.as_tensor(foil), "foil")
        fl = fl.expand(pos.shape[0]).clone() if fl.numel() == 1 else fl
        if fl.shape[0] != pos.shape[0]:
            raise ValueError(f"foil must be one id or one per explained position ({pos.shape[0]}); got {fl.shape[0]}")
        if quantity == "logit":
            quantity = "logit_minus_foil"
    device = next(attribution.model.parameters()).device
    ids, pos = ids.to(device), pos.to(device)
    tgt = None if tgt is None else tgt.to(device)
    if isinstance(attribution, ALTILogitAttribution):
        if tgt is None:
            raise ValueError("ALTI-Logit explains a target token at every position: give target")
        return _explain_alti_logit(attribution, ids, pos, tgt, quantity, fl)
    if isinstance(attribution, DecompXAttribution):
        if tgt is None:
            raise ValueError("DecompX explains a target token at every position: give target")
        return _explain_decompx(attribution, ids, pos, tgt, quantity, fl)
    if isinstance(attribution, LayerDecompositionAttribution):
        if not attribution.adapter.causal:
            raise ValueError("explain_positions explains causal LMs; this attribution wraps an encoder")
        if quantity != "logit" or fl is not None:
            warnings.warn(f"{attribution.get_name()} rows are class-agnostic: quantity and foil are ignored",
                          UserWarning, stacklevel=2)
        return _explain_rollout(attribution, ids, pos, tgt)
    raise TypeError(
        f"{type(attribution).__name__} is not supported: use ALTILogitAttribution, DecompXAttribution, "
        "ALTIAttribution or GlobEncAttribution of a causal LM"
    )


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
        tokens: the T tokens as strings; output_tokens: the n target tokens (Captum's pretty form).
        feature_of_token: (P,) long interpretable feature index of every prompt token (-1: none:
            a skipped token or template text).
        input_features: the feature names (``inp.values``).
        sink_index: the attention-sink position (the first token: BOS where the tokenizer adds one).
        details: the :class:`PositionExplanation` (explained quantity, no-token terms, deltas,
            log-probabilities, per-method extras).
        inp: the Captum input.
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
        r"""(n,) the sink's share of every row: |score of the sink| / sum of |scores| over the row."""
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
        sum of the explained quantities), ``input_tokens`` = the features, ``output_tokens``,
        ``output_probs`` = p(target) where known.

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
        inp = self.inp
        drop = self.sink_feature() if exclude_sink else None
        if drop is not None and full.shape[1] == len(names):
            keep = [j for j in range(full.shape[1]) if j != drop]
            full, names, inp = full[:, keep], [names[j] for j in keep], None
        probs = None if self.log_probs is None else self.log_probs.exp()
        return LLMAttributionResult(
            seq_attr=full[0], token_attr=full[1:], input_tokens=names, output_tokens=list(self.output_tokens),
            output_probs=probs, inp=inp,
        )


def _pretty_tokens(ids: Tensor, tokenizer: Any) -> List[str]:
    r"""Captum's readable output tokens (its ``_convert_ids_to_pretty_tokens``), or a plain per-token decode."""
    try:
        from captum.attr._core.llm_attr import _convert_ids_to_pretty_tokens as pretty  # captum's own labels
    except ImportError:  # pragma: no cover - another captum version
        pretty = None
    if pretty is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                got = pretty(ids.cpu(), tokenizer)
                if len(got) == ids.shape[0]:
                    return got
            except Exception:  # noqa: BLE001 - fall back to plain decoding
                pass
    return [tokenizer.decode([int(i)]) for i in ids.tolist()]


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
        add_generation_prompt, **kwargs: see :func:`chat_prompt`.

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
    from captum_normattr.attr.methods import get_method

    if model is None:
        raise ValueError(f"method {name!r} given by name: pass model= as well")
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

    SUPPORTED_INPUTS = (TextTemplateInput, TextTokenInput)

    def __init__(
        self,
        attr_method: Union[Attribution, str],
        tokenizer: Any,
        model: Optional[nn.Module] = None,
        **method_kwargs: Any,
    ) -> None:
        if isinstance(attr_method, str):
            attr_method = _method_from_name(attr_method, model, **method_kwargs)
        elif method_kwargs:
            raise TypeError("method keywords apply to a method given by name only")
        if not isinstance(attr_method, (ALTILogitAttribution, DecompXAttribution, LayerDecompositionAttribution)):
            raise TypeError(
                f"{type(attr_method).__name__} is not supported: use ALTILogitAttribution, DecompXAttribution, "
                "ALTIAttribution or GlobEncAttribution of a causal LM"
            )
        adapter = attr_method.adapter
        if not adapter.causal or isinstance(attr_method, DecompXAttribution) and not attr_method.decoder:
            raise ValueError(f"DecompositionLLMAttribution explains causal LMs ({supported_causal_families()}); "
                             f"{adapter.family} is not one")
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
            return _check_ids(target, "target").cpu()
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
        inp: Union[TextTokenInput, TextTemplateInput],
        target: Union[str, Tensor, Sequence[int], None] = None,
        gen_args: Optional[Dict[str, Any]] = None,
        quantity: str = "logit",
        foil: Union[str, int, Tensor, None] = None,
    ) -> GenerationExplanation:
        r"""Every target token explained from one teacher-forced forward pass, with all the details.

        Args:
            inp: Captum's ``TextTokenInput`` or ``TextTemplateInput`` (baselines ignored).
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
        if not isinstance(inp, self.SUPPORTED_INPUTS):
            raise TypeError(f"inp must be a TextTokenInput or TextTemplateInput; got {type(inp).__name__}")
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
            output_tokens=_pretty_tokens(target_ids, self.tokenizer), feature_of_token=self._features(inp, prompt),
            input_features=list(inp.values), sink_index=0, details=details, inp=inp,
        )

    @log_usage()
    def attribute(  # type: ignore[override]
        self,
        inp: Union[TextTokenInput, TextTemplateInput],
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
                ignored with a warning.

        Returns:
            ``captum.attr.LLMAttributionResult``: ``token_attr`` (n, features), ``seq_attr``
            (features,), ``output_probs`` (n,) the target probabilities.
        """
        if kwargs:
            warnings.warn(f"ignored (they mean nothing for a decomposition): {sorted(kwargs)}", UserWarning,
                          stacklevel=2)
        return self.decompose(inp, target, gen_args, quantity, foil).to_captum(exclude_sink)

    def has_convergence_delta(self) -> bool:
        return isinstance(self.attr_method, (ALTILogitAttribution, DecompXAttribution))

    @configured_name
    def get_name(self) -> str:
        return f"{self.attr_method.get_name()} (LLM)"


__all__ = [
    "DEFAULT_GEN_ARGS",
    "DecompositionLLMAttribution",
    "GenerationExplanation",
    "LOG_PROB_NOT_ADDITIVE",
    "PositionExplanation",
    "QUANTITIES",
    "chat_prompt",
    "chat_token_input",
    "explain_positions",
    "explained_directions",
    "template_token_features",
    "template_value_spans",
]
