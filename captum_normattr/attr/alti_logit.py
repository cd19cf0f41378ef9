r"""ALTI-Logit (Ferrando et al. 2023): signed token contributions to a next-token logit.

:class:`ALTILogitAttribution` explains one position per example (``decompose`` / ``attribute``)
or n positions of one sequence from one forward pass (:meth:`ALTILogitAttribution.explain_positions`,
what the LLM API asks), both through one forward pass, :meth:`ALTILogitAttribution._explain`.
Every ALTI map of that pass is checked against its first rows recomputed with the torch path
(:func:`~captum_normattr.decompose.methods.alti_logit.alti_map_check`): the rows of a wrong map
still sum to 1, so the completeness delta cannot show it; the consistency guard does
(docs/reliability.md, "Consistency guards").
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from captum_normattr.attr.alti import ALTI_MEMORY_BUDGET_MB
from captum_normattr.attr.base import LayerDecompositionAttribution, format_output
from captum_normattr.attr.explained_output import NextTokenLogit, check_additive_next_token_logit
from captum_normattr.attr.inputs import explained_positions, prepare_inputs
from captum_normattr.attr.positions import (
    PositionExplanation,
    explained_directions,
    position_log_probs,
    position_request,
    warn_non_finite,
)
from captum_normattr.decompose.methods.alti_logit import (
    ALTI_MAP_CHECK,
    alti_logit_terms,
    alti_map_check,
    attention_update_at,
    logit_direction,
)
from captum_normattr.decompose.primitives.multi_position import (
    alti_logit_rows,
    attention_logit_updates,
    unscaled_logit_directions,
)
from captum_normattr.decompose.primitives.rollout import LayerMapStore
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.adapters import base_model, get_path, layer_modules, unwrap_model
from captum_normattr.models.capture.record import norm_params
from captum_normattr.models.engine import compute_dtype, mark_non_finite, streamed_forward
from captum_normattr.models.guard import ConsistencyGuard
from captum_normattr.models.weights import tensors_to
from captum_normattr.options import check_memory_budget
from captum_normattr.result import LogitDecompositionResult

__all__ = ["ALTILogitAttribution", "ALTILogitResult"]

@dataclass
class ALTILogitResult(LogitDecompositionResult):
    r"""Everything ALTI-Logit computed for one batch.

    Attributes:
        method: ``"ALTI-Logit"``.
        scores: (B, T) signed contribution of every input token to the logit; pads exactly 0.
        layer_token_contributions: (B, L, T) the same per layer (sums over L to ``scores``).
        layer_logit_updates: (B, L, T) logit of the attention update of layer l at the
            explained position coming from source position j, before the rollout.
        embedding: (B,) logit of the embedding x_{0,i} at the explained position (no token).
        ff: (B, L) logit of every feed-forward update at i (no token).
        attention_bias: (B, L) logit of every attention output bias b_O (no token).
        final_bias: (B,) final-norm beta and LM-head bias along the unembedding (no token).
        unattributed: (B, L) logit of layer l's attention update that the ALTI rollout of the
            layers below carries to no token, because a real row of an ALTI map below is all
            zero (every part farther from the block output than the zero vector; large
            attention biases cause it). 0 when every real row sums to 1 (no token).
        logit: (B,) the model's real logit (target, or target minus foil); also ``logits``.
        delta: (B,) the completeness error, >= 0: |``logit`` - (token scores + no-token terms)|
            plus, for every layer, the attention-block completeness error of the example (the
            largest |sum_j h_{i<-j} + b_O - h_i| over its real tokens i, the parts the ALTI maps
            are built from against the model's real h_i) times ||w||_1, w the logit direction at
            the explained position: the logit an error vector of that size could carry. A wrong
            attention decomposition anywhere (not only at the explained row) shows in it.
        target: (B,) token ids; foil: (B,) or None.
        attention_mask: (B, T); explained_position: (B,).
        extras: ``"completeness_error"`` (L,) of the attention-block parts (largest over the
            batch), ``"example_completeness_error"`` (B, L) and ``"alti_map_check"`` (L,): the
            largest difference of each layer's ALTI map from its first rows recomputed with
            the torch path (0 where not checked: the top layer, whose map is never read, and
            sequences no longer than the recomputed rows), judged by the consistency guard.
    """

    TOKEN_AXES: ClassVar[Dict[str, Tuple[int, ...]]] = {
        "scores": (1,), "layer_token_contributions": (2,), "layer_logit_updates": (2,),
    }

    layer_token_contributions: Optional[Tensor] = None
    layer_logit_updates: Optional[Tensor] = None
    embedding: Optional[Tensor] = None
    ff: Optional[Tensor] = None
    attention_bias: Optional[Tensor] = None
    final_bias: Optional[Tensor] = None
    unattributed: Optional[Tensor] = None

    @property
    def logit(self) -> Tensor:
        r"""(B,) the model's real explained logit."""
        return self.logits

    @property
    def no_token_total(self) -> Tensor:
        r"""(B,) the sum of all terms that belong to no token."""
        total = self.embedding + self.ff.sum(-1) + self.attention_bias.sum(-1) + self.final_bias
        return total if self.unattributed is None else total + self.unattributed.sum(-1)


class ALTILogitAttribution(LayerDecompositionAttribution):
    r"""Signed contributions of every input token to the logit of a target token (Ferrando et al. 2023).

    At the explained position i (default: the last real token) the logit is
    u . FinalNorm(x_{L,i}) + bias, u = W_U[target] (or W_U[target] - W_U[foil]). The final norm
    is linearised at the real scale of x_{L,i}, so each additive piece of the residual stream
    has its own logit. The attention update of layer l splits exactly over the source
    positions j; its logit is carried to the input tokens by the ALTI rollout of the layers
    below l (rows summing to 1). The pieces that belong to no token (embedding at i, every
    feed-forward update, attention output biases, final-norm beta and LM-head bias, and the
    logit that the rollout routes through an all-zero ALTI row, ``unattributed``) are kept
    apart, so that token scores plus these terms equal the model's logit; the remaining
    difference is the convergence delta (docs/design.md, section 7, ALTI-Logit).

    Args:
        model: a GPT-2 / Llama / Mistral / Qwen2 model with its LM head
            (``GPT2LMHeadModel``, ``*ForCausalLM``), or a bare ``*Model`` together with
            ``unembedding``; also inside a peft ``PeftModel`` or a ``torch.compile`` wrapper.
            The explained logit is compared with the model's own output logit on every call
            (a mismatch beyond rounding warns, far beyond raises; docs/reliability.md).
        unembedding: optional (V, D) unembedding matrix (rows = tokens), used instead of the
            model's LM head (needed for a bare ``*Model``).
        explained_position: the position whose next-token logit is explained: ``"last"``
            (default), an int (k >= 0 counts from the first real token, negative from the
            last) or a (B,) integer tensor of padded positions.
        memory_budget_mb: memory for the explicit parts of the ALTI maps, per chunk of rows.
        strict: raise :class:`~captum_normattr.models.guard.ConsistencyError` (and
            :class:`~captum_normattr.attr.explained_output.ExplainedOutputMismatchError`)
            instead of warning when the model's real tensors or logits disagree with the
            decomposition (docs/reliability.md).

    Examples::

        >>> model = AutoModelForCausalLM.from_pretrained("gpt2")
        >>> ids = tok(["The capital of France is"], return_tensors="pt")["input_ids"]
        >>> al = ALTILogitAttribution(model)
        >>> scores, delta = al.attribute(ids, target=tok(" Paris")["input_ids"][0],
        ...                              return_convergence_delta=True)
        >>> res = al.decompose(ids, target=paris_id, foil=london_id)   # target minus foil
    """

    method_name = "ALTI-Logit"
    kind_method = "alti_logit"
    uses_target = True

    def __init__(
        self,
        model: nn.Module,
        unembedding: Optional[Tensor] = None,
        explained_position: Union[int, str, Tensor, None] = "last",
        memory_budget_mb: float = ALTI_MEMORY_BUDGET_MB,
        strict: bool = False,
    ) -> None:
        model = unwrap_model(model)  # a PeftModel / torch.compile wrapper: the transformers model inside
        super().__init__(model, explained_position, "raw", strict=strict)  # the adapter, judged by check_model
        self.memory_budget_mb = check_memory_budget(memory_budget_mb)
        self.output = NextTokenLogit(model, self.adapter, unembedding)

    def check_model(self) -> None:
        r"""Raise unless the model gives an additive next-token logit
        (:func:`~captum_normattr.attr.explained_output.check_additive_next_token_logit`)."""
        check_additive_next_token_logit(self.adapter, "ALTILogitAttribution")

    def decompose(  # type: ignore[override]
        self, inputs: Union[Tensor, Tuple[Tensor]], target: Any = None, additional_forward_args: Any = None,
        foil: Any = None,
    ) -> ALTILogitResult:
        r"""All terms of the ALTI-Logit decomposition, layer by layer as the forward pass runs.

        The same pass as :meth:`explain_positions` (:meth:`_explain`), one explained position
        per example.

        Args:
            inputs: token ids (B, T) (or input embeddings (B, T, D)), or a 1-tuple.
            target: token id (int, numpy integer, 0-d tensor) or per-example ids (list or (B,)
                tensor); None (default): the token the model predicts at the explained position
                (argmax of its real logits). A tuple raises a ValueError pointing to ``foil``
                (it meant (target, foil) before); an attention mask passed here raises one
                pointing to ``additional_forward_args=``.
            additional_forward_args: attention_mask (B, T) (left or right padding).
            foil: None, or token id(s) of the same forms: explains logit(target) - logit(foil).

        Returns:
            :class:`ALTILogitResult`.
        """
        self.check_target(target, inputs)
        prepared = prepare_inputs(self.model, self.adapter, inputs, additional_forward_args)
        pos = explained_positions(self.explained_position, prepared.valid)
        got = self._explain(prepared, pos.unsqueeze(1), target=target, foil=foil)
        terms, out, block = got["terms"], got["output"], got["example_completeness_error"]
        return mark_non_finite(ALTILogitResult(
            method=self.get_name(),
            scores=terms["scores"],
            attention_mask=prepared.attention_mask,
            explained_position=pos,
            delta=got["delta"],
            extras={"completeness_error": block.amax(0), "example_completeness_error": block,
                    "alti_map_check": got["alti_map_check"], **got["cap_extras"]},
            target=out.target,
            foil=out.foil,
            logits=terms["logit"],
            layer_token_contributions=terms["layer_token_contributions"],
            layer_logit_updates=terms["layer_logit_updates"],
            embedding=terms["embedding"],
            ff=terms["ff"],
            attention_bias=terms["attention_bias"],
            final_bias=terms["final_bias"],
            unattributed=terms["unattributed"],
        ), prepared.finite)

    def attribution_and_delta(self, inputs, target, additional_forward_args, foil: Any = None):
        r"""(signed token contributions to the target logit, delta (B,)): ``attribute``'s output.

        ``attribute(inputs, target=None, additional_forward_args=None,
        return_convergence_delta=False, foil=None)``: the scores of :meth:`decompose` ((B, T),
        a 1-tuple for tuple inputs, pads exactly 0); the delta is ``|the real logit - token
        scores - the no-token terms|`` plus the attention-block completeness (see
        :class:`ALTILogitResult`).
        """
        res = self.decompose(inputs, target, additional_forward_args, foil=foil)
        return format_output(inputs, res.scores), res.delta

    def explain_positions(
        self,
        input_ids: Tensor,
        positions: Tensor,
        target: Optional[Tensor] = None,
        quantity: str = "logit",
        foil: Any = None,
        additional_forward_args: Any = None,
    ) -> PositionExplanation:
        r"""The signed contributions to n next-token logits of one sequence, from one forward pass.

        Every position shares the per-layer ALTI maps of the pass (:meth:`_explain`, the pass
        :meth:`decompose` runs); row k equals the single-position call
        (``explained_position=positions[k]``, ``target=target[k]``) up to rounding.

        Args:
            input_ids: (T,) or (1, T) token ids (one sequence, no padding).
            positions: (n,) the explained positions (position i predicts token i + 1).
            target: (n,) the explained token at each position (required).
            quantity: ``"logit"``, ``"logit_minus_foil"`` or ``"logit_minus_mean"``
                (:data:`~captum_normattr.attr.positions.QUANTITIES`).
            foil: one id or (n,) ids, for ``"logit_minus_foil"``.
            additional_forward_args: the model's further inputs by keyword (an attention mask of ones,
                a vision-language model's ``pixel_values``, ...), as in :meth:`decompose`.

        Returns:
            :class:`~captum_normattr.attr.positions.PositionExplanation` (signed; ``extras``:
            ``layer_token_contributions`` (n, L, T), ``layer_logit_updates``, every no-token
            term, ``completeness_error`` (L,) of the attention blocks and ``alti_map_check``).
        """
        ids, positions, target, quantity, foil = position_request(self.model, input_ids, positions, target, quantity,
                                                                  foil)
        if target is None:
            raise ValueError("ALTI-Logit explains a target token at every position: give target")
        prepared = prepare_inputs(self.model, self.adapter, ids.unsqueeze(0), additional_forward_args)
        dtype, dev = compute_dtype(self.model), prepared.valid.device
        u, ub = explained_directions(self.output, target, quantity, foil, dtype, dev)
        got = self._explain(prepared, positions.to(dev).unsqueeze(0), directions=(u.unsqueeze(0), ub.unsqueeze(0)))
        terms = got["terms"]
        with torch.no_grad():
            no_token = (terms["embedding"] + terms["ff"].sum(-1) + terms["attention_bias"].sum(-1)
                        + terms["final_bias"] + terms["unattributed"].sum(-1))
            log_probs = position_log_probs(self.output, got["final_out"][0], target)
        scores = terms["scores"][0]
        if warn_non_finite(prepared):
            scores = torch.full_like(scores, float("nan"))
        extras = {k: terms[k][0] for k in ("layer_token_contributions", "layer_logit_updates", "embedding", "ff",
                                           "attention_bias", "final_bias", "unattributed")}
        extras.update(completeness_error=got["example_completeness_error"][0], alti_map_check=got["alti_map_check"])
        return PositionExplanation(
            method=self.get_name(), scores=scores, positions=positions, signed=True, target=target, foil=foil,
            quantity=quantity, explained=terms["logit"][0], no_token=no_token[0], delta=terms["delta"][0],
            log_probs=log_probs, extras=extras,
        )

    def _explain(self, prepared: Any, positions: Tensor, target: Any = None, foil: Any = None,
                 directions: Optional[Tuple[Tensor, Tensor]] = None) -> Dict[str, Any]:
        r"""The one forward pass of ALTI-Logit: every layer's ALTI map, attention update, FF update and bias.

        Each layer, as the forward pass hands it over, gives its ALTI map (checked against its
        first rows recomputed with the torch path, :func:`~captum_normattr.decompose.methods.alti_logit.alti_map_check`,
        judged by the consistency guard), its attention-block completeness error per example,
        and in its pre-LN form (``LayerKind.logit_form``) the pieces of the final residual
        stream at the explained positions. The logit directions are

        * resolved after the pass (``directions=None``, :meth:`decompose`: one position per
          example, ``target`` None is the model's own prediction there, ``foil``): the attention
          updates are kept as vectors (B, L, T, D) and the explained logit is compared with the
          model's output logit;
        * given (``directions``, :meth:`explain_positions`: n positions of one sequence): the
          updates are kept as their logits (B, L, n, T), no (n, T, D) tensor is formed.

        Args:
            prepared: the validated inputs (:func:`~captum_normattr.attr.inputs.prepare_inputs`).
            positions: (B, n) long explained positions (n = 1 without ``directions``).
            target, foil: as in :meth:`decompose` (``directions=None`` only).
            directions: None, or (u (B, n, D), bias (B, n)): the unembedding direction of every position.

        Returns:
            dict: ``terms`` (:func:`~captum_normattr.decompose.methods.alti_logit.alti_logit_terms`
            or, with ``directions``, :func:`~captum_normattr.decompose.primitives.multi_position.alti_logit_rows`),
            ``example_completeness_error`` (B, L), ``alti_map_check`` (L,) (0 where not checked),
            ``final_out`` the final norm's real output at the positions; without ``directions``
            also ``output`` (the resolved :class:`LogitDirection`), ``delta`` (B,) (see
            :class:`ALTILogitResult`) and ``cap_extras``.
        """
        model, adapter, kind = self.model, self.adapter, self.kind
        valid = prepared.valid
        dev = valid.device
        rows = torch.arange(valid.shape[0], device=dev).unsqueeze(1)  # (B, 1): the examples of ``positions``
        late = directions is None
        n_layers = len(layer_modules(model, adapter))
        if late:
            # the rollout of layer l's update uses the maps below l: the top layer's map is never read
            n_maps, w_unscaled = n_layers - 1, None
        else:  # the many-position rollout reads one map per layer
            dtype = compute_dtype(model)
            final = norm_params(get_path(base_model(model), adapter.final_norm), adapter.head.final_norm, dtype, dev)
            n_maps, w_unscaled = n_layers, unscaled_logit_directions(final, directions[0])  # (B, n, D)
        store = LayerMapStore(max(1, n_maps), adapter.causal and not prepared.two_way, dense=not late)
        guard = ConsistencyGuard(self.get_name(), self.strict)
        kept: Dict[str, Any] = {k: [None] * n_layers for k in ("updates", "ff", "biases", "errors")}
        map_checks = [0.0] * n_layers

        def on_layer(layer: LayerTensors) -> None:
            layer = tensors_to(layer, dev)  # a device_map may spread the layers: work on the inputs' device
            l = layer.index
            if late and not isinstance(kept["updates"], Tensor):  # filled in place: no second copy when stacked
                b, t, d = layer.hidden_in.shape
                kept["updates"], kept["ff"] = layer.hidden_in.new_zeros(b, n_layers, t, d), layer.hidden_in.new_zeros(
                    b, n_layers, 1, d)
            if l < n_maps:  # (one position per example: not the top layer's map, 1/L of the ALTI work and memory)
                amap = kind.alti_map(layer, valid, self.memory_budget_mb)
                wrong = alti_map_check(kind, layer, valid, amap, self.memory_budget_mb)
                if wrong is not None:  # the guard judges it with the layer's tolerance (gross: refused)
                    map_checks[l] = float(wrong)
                    judged = copy.copy(layer)
                    judged.checks = {ALTI_MAP_CHECK: wrong}
                    guard.check(judged)
                store.put(l, amap)
            # (B,) largest |parts + b_O - the block's real output| over the real tokens (the layer kind's)
            kept["errors"][l] = kind.example_completeness_error(layer, valid)
            own = layer.own_after  # vectors the model adds after the layer, each its position's token's own (DeepStack)
            layer = kind.logit_form(layer)  # the same parts as a pre-LN record (the layer kind's frozen maps folded in)
            if l == 0:  # the embedding as the logit form carries it (a kind scaling the stream scales it too)
                kept["embedding"] = layer.hidden_in[rows, positions]  # (B, n, D)
            if own is not None:  # the explained position's own additions join its embedding (docs/vlm.md, DeepStack)
                kept["embedding"] = kept["embedding"] + own[rows, positions]
            if late:
                kept["updates"][:, l] = attention_update_at(layer, positions[:, 0])  # (B, T, D)
            else:
                kept["updates"][l] = attention_logit_updates(layer, positions[0], w_unscaled.to(layer.hidden_in.dtype))
            if late:
                kept["ff"][:, l] = layer.ff_out[rows, positions]  # (B, 1, D)
            else:
                kept["ff"][l] = layer.ff_out[rows, positions]  # (B, n, D)
            kept["biases"][l] = (layer.out_bias if layer.out_bias is not None
                                 else layer.hidden_in.new_zeros(layer.hidden_in.shape[-1]))

        if late:
            run, top_model, logits_kept = self.output.guarded_forward(model, prepared, positions[:, 0])
        else:
            run, top_model, logits_kept = prepared, False, None
        with streamed_forward(model, adapter, run, on_layer, top_model=top_model, guard=guard) as (rec, model_out):
            prepared.finite = run.finite
            fparams, f_in, f_out = tensors_to(rec.final_norm_tensors(), dev)
        with torch.no_grad():
            f_in, f_out = f_in[rows, positions], f_out[rows, positions]  # (B, n, D)
            block = torch.stack(kept["errors"], 1)  # (B, L)
            got: Dict[str, Any] = {"example_completeness_error": block, "final_out": f_out,
                                   "alti_map_check": torch.as_tensor(map_checks, dtype=torch.float64)}
            biases = torch.stack(kept["biases"])
            updates, ff = ((kept["updates"], kept["ff"]) if late
                           else (torch.stack(kept["updates"], 1), torch.stack(kept["ff"], 1)))
            if not late:
                got["terms"] = alti_logit_rows(updates, store, kept["embedding"], ff, biases, fparams, f_in, f_out,
                                               directions[0], directions[1], valid)
                return got
            f_in, f_out = f_in[:, 0], f_out[:, 0]
            out = self.output.resolve(target, f_out, foil)
            terms = alti_logit_terms(updates, store, kept["embedding"][:, 0], ff[:, :, 0], biases, fparams, f_in, f_out,
                                     out.direction, out.bias, valid, positions[:, 0])
            # guard 1: the explained logit is the model's own output logit (after any scaling, cap or hook)
            self.output.check_against_model(model_out if top_model else None, logits_kept, positions[:, 0], out, f_out,
                                            terms["logit"], self.strict)
            # guard 2: the delta also carries every layer's attention-block completeness error, as the logit an
            # error vector of that size would have at the explained position (|e| . |w|, w the logit direction)
            w1 = logit_direction(fparams, f_in, out.direction).abs().sum(-1)  # (B,)
            got.update(terms=terms, output=out, delta=terms["delta"].abs() + w1 * block.sum(-1),
                       cap_extras=self.output.cap_extras(terms["logit"], f_out, out))
        return got
