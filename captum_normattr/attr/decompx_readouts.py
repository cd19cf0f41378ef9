r"""DecompX's readouts: what each explained output adds to the one forward/adjoint skeleton.

:class:`~captum_normattr.DecompXAttribution` runs one skeleton for every model
(``DecompXAttribution._run``): a recorded forward pass that either propagates the parts layer by
layer (``"forward"``) or keeps each layer's input for the adjoint's walk down (``"adjoint"``).
What is read at the top is a strategy, one :class:`DecompXReadout` per explained output:

- :class:`ClassifierReadout`: the class logits of a sequence classifier through its head
  (:class:`~captum_normattr.attr.explained_output.ClassLogit`);
- :class:`ImageClassifierReadout`: the class logits of a Vision Transformer classifier, a linear
  head on final-norm rows (:class:`~captum_normattr.attr.explained_output.ImageClassLogit`);
- :class:`NextTokenReadout`: one next-token logit per example of a causal LM
  (:class:`~captum_normattr.attr.explained_output.NextTokenLogit`);
- :class:`PositionsReadout`: n next-token logits of one sequence (the LLM API's
  ``explain_positions``).

Each readout names the head rows the parts must reach, the inputs of the recorded pass,
what it reads from the pass (the model's logits, the final norm, the guard against the
model's own output), and turns the adjoint's or the parts' result into the result's fields.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from captum_normattr.attr.images import image_extras
from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.attr.inputs import explained_positions
from captum_normattr.models.prepared import PreparedInputs
from captum_normattr.decompose.methods.decompx.adjoint import AdjointPass, FrozenLayer
from captum_normattr.decompose.methods.decompx.propagation import PropagatedParts
from captum_normattr.decompose.methods.decompx.readout import adjoint_head_scores, adjoint_next_token_cotangent, head_scores, head_slope, logit_scores, mean_pool_weights, pool_frozen_rows, pool_head_parts
from captum_normattr.decompose.methods.decompx.vision_head import adjoint_linear_head_scores, linear_head_scores
from captum_normattr.decompose.primitives.multi_position import multi_logit_outputs
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.capture.recorder import Recorder
from captum_normattr.models.weights import tensors_to

__all__ = [
    "ClassifierReadout",
    "DecompXReadout",
    "ImageClassifierReadout",
    "InputCotangents",
    "NextTokenReadout",
    "PositionsReadout",
    "stack_layers",
]

#: ``(layer index, checkpoint) -> FrozenLayer``: a layer recomputed for the adjoint's walk
FrozenAt = Callable[[int, Tensor], FrozenLayer]


def stack_layers(per_layer: Dict[int, Tensor], num_layers: int) -> Tensor:
    r"""(B,) per layer index (filled in any order) -> (B, L).

    Args:
        per_layer: layer index -> (B,) tensor.
        num_layers: L.

    Returns:
        (B, L).
    """
    return torch.stack([per_layer[l] for l in range(num_layers)], 1)


def _layer_outputs(res: Optional[PropagatedParts]) -> Dict[str, Optional[Tensor]]:
    r"""The per-layer fields of a DecompX result from the forward propagation (None after the adjoint)."""
    return {
        "layer_part_norms": None if res is None else res.layer_part_norms,
        "layer_bias_norms": None if res is None else res.layer_bias_norms,
        "layer_errors": None if res is None else res.layer_errors,
    }


@dataclass
class InputCotangents:
    r"""A decoder's explained logit as an affine function of its input embeddings.

    What :meth:`~captum_normattr.DecompXAttribution.input_cotangents` returns.

    ``logit = sum_k cotangent_k . embeddings_k + result.bias_scores[:, 0]`` per example (up to the
    Gauss-Legendre quadrature of a gated FF, ``result.delta``).

    Attributes:
        cotangent: (B, T, D) g_k, the gradient of the frozen network's explained logit with respect
            to the decoder's input embedding e_k (0 at pads and after the explained position).
        embeddings: (B, T, D) e_k, the decoder's real input embeddings (the first layer's input).
        result: the :class:`~captum_normattr.attr.decompx.DecompXResult` of the same call (``scores`` =
            g_k . e_k on the real tokens, ``bias_scores``, ``logits``, ``target``, ``explained_position``, ``delta``).
    """

    cotangent: Tensor
    embeddings: Tensor
    result: Any


class DecompXReadout:
    r"""One explained output of DecompX: the strategy the skeleton calls at the top of the model.

    Args:
        attr: the :class:`~captum_normattr.DecompXAttribution` (its ``output``, ``strict``,
            ``bias_mode`` and name are read).
        prepared: the validated inputs.
        target: the explained class or token(s) (None: the predicted one).
        dtype: the compute dtype.

    Attributes:
        rows: (R,) the rows of the last layer the explained output reads (the forward
            propagation keeps only them, the adjoint starts from them).
        quadrature_tokens: (B, T) float mask of the tokens over which a gated FF's quadrature
            error is taken, or None (every token).
        top_model: run the whole model (its head too) for the model's own logits.
    """

    quadrature_tokens: Optional[Tensor] = None
    top_model: bool = True

    def __init__(self, attr: Any, prepared: PreparedInputs, target: Any, dtype: torch.dtype) -> None:
        self.attr, self.output = attr, attr.output
        self.prepared, self.valid = prepared, prepared.valid
        self.target, self.dtype = target, dtype
        self.rows: Tensor = torch.zeros(0, dtype=torch.long)

    def forward_inputs(self) -> PreparedInputs:
        r"""The inputs of the recorded forward pass (by default the prepared inputs themselves)."""
        return self.prepared

    def keep(self, layer: LayerTensors, last: bool) -> None:
        r"""Keep what the readout needs of a layer (``last``: the top layer)."""

    def read(self, rec: Recorder, model_out: Any) -> None:
        r"""Inside the recorded pass: the model's logits, the explained direction, the guard."""
        raise NotImplementedError

    def adjoint(self, adj: AdjointPass, frozen_at: FrozenAt) -> None:
        r"""The scores by the adjoint's walk down (inside the recorded pass, layers rerun by ``frozen_at``)."""
        raise NotImplementedError

    def forward(self, res: PropagatedParts) -> None:
        r"""The scores from the propagated parts of the last layer's rows."""
        raise NotImplementedError

    def result(self, res: Optional[PropagatedParts], quad: Dict[int, Tensor], num_layers: int) -> Dict[str, Any]:
        r"""The fields of the result (``res``: the forward propagation's, None after the adjoint)."""
        raise NotImplementedError


class ClassifierReadout(DecompXReadout):
    r"""The class logits of a sequence classifier through its head (a [CLS]-type row, or the mean of the rows).

    Args:
        attr, prepared, target, dtype: see :class:`DecompXReadout`.
        target_only: the adjoint computes the target class only (one vector-Jacobian product
            per layer); the result then carries no class scores.
    """

    def __init__(self, attr: Any, prepared: PreparedInputs, target: Any, dtype: torch.dtype, target_only: bool) -> None:
        super().__init__(attr, prepared, target, dtype)
        self.target_only = target_only
        self.pos = self.output.position
        self.mean = self.output.head.pooling == "mean"  # ModernBERT's classifier_pooling="mean": the head reads every row
        device = self.valid.device
        self.rows = torch.arange(self.valid.shape[1], device=device) if self.mean else torch.tensor([self.pos], device=device)
        self.pool: Optional[Callable[[Tensor], Tensor]] = None
        self.target_scores: Optional[Tuple[Tensor, Tensor]] = None

    def keep(self, layer: LayerTensors, last: bool) -> None:
        if last:
            self.pooled = layer.layer_out if self.mean else layer.layer_out[:, self.pos]  # the head's real input (rows)

    def read(self, rec: Recorder, model_out: Any) -> None:
        model_logits = (model_out.logits if hasattr(model_out, "logits") else model_out[0]).detach()
        self.logits = model_logits.to(self.valid.device, self.dtype)
        self.tgt = self.output.resolve(self.target, self.logits)
        hp = self.output.params(self.dtype, self.pooled.device)
        if self.mean:  # the head's input: the weighted mean of the final-norm rows; the head itself then has no pre-norm
            rows_real, weights, final = self.pooled, mean_pool_weights(self.valid, self.dtype), hp.pre_norm
            self.pooled = pool_frozen_rows(rows_real, rows_real, weights, final, with_bias=True)
            hp = replace(hp, pre_norm=None)
            self.pool = lambda y: pool_frozen_rows(y, rows_real, weights, final, with_bias=True)
            self.mean_rows = (rows_real, weights, final)
        self.hp = hp
        self.output.check_against_model(self.pooled, hp, model_logits, self.attr.strict)

    def adjoint(self, adj: AdjointPass, frozen_at: FrozenAt) -> None:
        slope = head_slope(self.pooled, self.hp)
        if self.target_only:  # one vector-Jacobian product per layer in all
            self.target_scores = adjoint_head_scores(adj, frozen_at, self.hp, slope, self.tgt, self.pooled, self.pool)
            return
        self.cls_scores, self.bias_scores = adjoint_head_scores(adj, frozen_at, self.hp, slope,
                                                                real_input=self.pooled, pool=self.pool)

    def forward(self, res: PropagatedParts) -> None:
        if self.mean:
            idx = torch.searchsorted(res.rows, self.rows)
            head_parts, head_bias, _ = pool_head_parts(res.parts[:, idx], res.bias[:, idx], *self.mean_rows,
                                                       self.attr.bias_mode)
        else:
            row = int((res.rows == self.pos).nonzero()[0, 0])
            head_parts, head_bias = res.parts[:, row], res.bias[:, row]
        hp = self.hp
        self.cls_scores, self.bias_scores = head_scores(
            head_parts, head_bias, self.pooled, hp.w_dense, hp.b_dense, hp.act, hp.w_cls, hp.b_cls,
            self.attr.bias_mode, fallback=self.pos, pre_norm=hp.pre_norm, norm=hp.norm,
        )

    def result(self, res: Optional[PropagatedParts], quad: Dict[int, Tensor], num_layers: int) -> Dict[str, Any]:
        logits, tgt, vf = self.logits, self.tgt, self.valid.to(self.dtype)
        ar = torch.arange(logits.shape[0], device=logits.device)
        if self.target_scores is not None:
            scores, bias_t = self.target_scores
            scores = scores * vf
            return {"scores": scores, "delta": (scores.sum(-1) + bias_t - logits[ar, tgt]).abs(), "target": tgt,
                    "logits": logits}
        cls_scores = self.cls_scores * vf.unsqueeze(-1)
        scores = cls_scores[ar, :, tgt]
        return {
            "scores": scores, "delta": (scores.sum(-1) + self.bias_scores[ar, tgt] - logits[ar, tgt]).abs(),
            "extras": {"all_class_delta": (cls_scores.sum(1) + self.bias_scores - logits).abs().amax(-1)},
            "target": tgt, "logits": logits, "class_scores": cls_scores, "bias_scores": self.bias_scores,
            **_layer_outputs(res),
        }


class ImageClassifierReadout(DecompXReadout):
    r"""The class logits of a Vision Transformer classifier: the final norm, then a linear head on its rows.

    Args:
        attr, prepared, target, dtype: see :class:`DecompXReadout`.
        target_only: the adjoint computes the target class only.
    """

    def __init__(self, attr: Any, prepared: PreparedInputs, target: Any, dtype: torch.dtype, target_only: bool) -> None:
        super().__init__(attr, prepared, target, dtype)
        self.target_only = target_only
        self.head = self.output.linear_head(self.valid.shape[1], prepared.num_prefix, dtype, self.valid.device)
        self.rows = self.head.rows
        self.target_scores = False

    def read(self, rec: Recorder, model_out: Any) -> None:
        self.logits = model_out.logits.detach().to(self.dtype)
        self.tgt = self.output.resolve(self.target, self.logits)
        self.fparams, f_in, f_out = rec.final_norm_tensors()
        self.f_rows = f_in[:, self.rows]
        self.output.check_against_model(f_out[:, self.rows], self.head, model_out.logits, self.attr.strict)

    def adjoint(self, adj: AdjointPass, frozen_at: FrozenAt) -> None:
        head = self.head
        self.cls_scores, self.bias_scores = adjoint_linear_head_scores(
            adj, frozen_at, self.fparams, self.f_rows, head.weight, head.bias, self.tgt if self.target_only else None
        )
        self.target_scores = self.target_only

    def forward(self, res: PropagatedParts) -> None:
        idx = torch.searchsorted(res.rows, self.rows)
        self.cls_scores, self.bias_scores = linear_head_scores(
            res.parts[:, idx], res.bias[:, idx], self.fparams, self.f_rows, self.rows, self.head.weight, self.head.bias,
            self.attr.bias_mode,
        )

    def result(self, res: Optional[PropagatedParts], quad: Dict[int, Tensor], num_layers: int) -> Dict[str, Any]:
        logits, tgt, cls_scores, bias_scores = self.logits, self.tgt, self.cls_scores, self.bias_scores
        ar = torch.arange(logits.shape[0], device=logits.device)
        if self.target_scores:  # the adjoint of the target class only: (B, T) scores, (B,) bias
            delta = (cls_scores.sum(-1) + bias_scores - logits[ar, tgt]).abs()
            return {"scores": cls_scores, "delta": delta, "extras": image_extras(self.prepared, cls_scores),
                    "target": tgt, "logits": logits}
        scores = cls_scores[ar, :, tgt]
        extras = {"all_class_delta": (cls_scores.sum(1) + bias_scores - logits).abs().amax(-1),
                  "quadrature_error": stack_layers(quad, num_layers)}
        extras.update(image_extras(self.prepared, scores))
        return {
            "scores": scores, "delta": (scores.sum(-1) + bias_scores[ar, tgt] - logits[ar, tgt]).abs(), "extras": extras,
            "target": tgt, "logits": logits, "class_scores": cls_scores, "bias_scores": bias_scores,
            **_layer_outputs(res),
        }


class NextTokenReadout(DecompXReadout):
    r"""One next-token logit per example of a causal LM (``target``, or its difference to ``foil``).

    Args:
        attr, prepared, target, dtype: see :class:`DecompXReadout`.
        foil: token id(s) whose logit is subtracted, or None.
    """

    def __init__(self, attr: Any, prepared: PreparedInputs, target: Any, dtype: torch.dtype, foil: Any = None) -> None:
        super().__init__(attr, prepared, target, dtype)
        self.foil = foil
        #: after the adjoint: (B, T, D) the cotangent g of the explained logit at the decoder's input, and e there
        self.cotangent: Optional[Tensor] = None
        self.embeddings: Optional[Tensor] = None
        self.pos = explained_positions(attr.explained_position, self.valid)
        self.rows = torch.unique(self.pos)
        self.quadrature_tokens = self.valid.to(dtype)
        self.ar = torch.arange(self.valid.shape[0], device=self.valid.device)
        self.run, self.top_model, self.kept = self.output.guarded_forward(attr.model, prepared, self.pos)

    def forward_inputs(self) -> PreparedInputs:
        return self.run

    def read(self, rec: Recorder, model_out: Any) -> None:
        ar, pos = self.ar, self.pos
        self.fparams, self.f_in, f_out = tensors_to(rec.final_norm_tensors(), self.valid.device)
        self.f_at = f_out[ar, pos]
        self.out = self.output.resolve(self.target, self.f_at, self.foil)
        self.logit = (self.f_at * self.out.direction).sum(-1) + self.out.bias  # from the real final-norm output
        self.output.check_against_model(  # ... and the model's own output logit: the same number
            model_out if self.top_model else None, self.kept, pos, self.out, self.f_at, self.logit, self.attr.strict)

    def adjoint(self, adj: AdjointPass, frozen_at: FrozenAt) -> None:
        e = adj.embeddings
        g, self.bias_score = adjoint_next_token_cotangent(adj, frozen_at, self.fparams, self.f_in, self.out.direction,
                                                          self.out.bias, self.pos)
        self.scores = adj.token_scores([g])[0].detach()
        self.cotangent, self.embeddings = g, e.detach()  # what DecompXAttribution.input_cotangents returns
        self.own_inputs = adj.own_scores is not None  # token-own inputs beyond e: g . e is not the whole score

    def input_cotangents(self, result: Any) -> InputCotangents:
        r"""The :class:`InputCotangents` of the adjoint's walk (:meth:`adjoint`) and the call's ``result``.

        Raises:
            UnsupportedModelError: the model adds token-own vectors beyond the input embeddings (Gemma 4's
                per-layer inputs, Qwen3-VL's DeepStack features): the logit is not g . e + c.
        """
        if self.own_inputs:
            raise UnsupportedModelError(
                "input_cotangents writes the explained logit as sum_k g_k . e_k + c; this model also adds token-own "
                "vectors to the stream after the embeddings (per-layer inputs, DeepStack features), whose shares are "
                "in decompose()'s scores but not in g . e (docs/decompx.md)")
        return InputCotangents(cotangent=self.cotangent, embeddings=self.embeddings, result=result)

    def forward(self, res: PropagatedParts) -> None:
        ar, pos = self.ar, self.pos
        idx = torch.searchsorted(res.rows, pos)
        self.scores, self.bias_score = logit_scores(
            res.parts[ar, idx], res.bias[ar, idx], self.fparams, self.f_in[ar, pos], self.out.direction, self.out.bias,
            self.attr.bias_mode, fallback=pos,
        )

    def result(self, res: Optional[PropagatedParts], quad: Dict[int, Tensor], num_layers: int) -> Dict[str, Any]:
        scores = self.scores * self.quadrature_tokens
        out = self.out
        return {
            "scores": scores, "explained_position": self.pos,
            "delta": (scores.sum(-1) + self.bias_score - self.logit).abs(),
            "extras": {"quadrature_error": stack_layers(quad, num_layers),
                       **self.output.cap_extras(self.logit, self.f_at, out)},
            "target": out.target, "foil": out.foil, "logits": self.logit.unsqueeze(-1),
            "class_scores": scores.unsqueeze(-1), "bias_scores": self.bias_score.unsqueeze(-1),
            **_layer_outputs(res),
        }


class PositionsReadout(DecompXReadout):
    r"""n next-token logits of one sequence of a causal LM, one per explained position.

    The explained directions are given (the LLM API's quantity: logit, logit minus a foil's,
    logit minus the mean logit); the recorded pass runs the bare model (no output guard).

    Args:
        attr, prepared, dtype: see :class:`DecompXReadout` (``prepared``: one sequence).
        positions: (n,) the explained positions.
        direction: (1, n, D) the unembedding direction of every position; bias: (1, n).
    """

    top_model = False

    def __init__(self, attr: Any, prepared: PreparedInputs, dtype: torch.dtype, positions: Tensor, direction: Tensor,
                 bias: Tensor) -> None:
        super().__init__(attr, prepared, None, dtype)
        self.positions, self.u, self.ub = positions, direction, bias
        self.rows = torch.unique(positions)
        self.quadrature_tokens = self.valid.to(dtype)

    def read(self, rec: Recorder, model_out: Any) -> None:
        self.fparams, self.f_in, self.f_out = tensors_to(rec.final_norm_tensors(), self.valid.device)
        self.logit = (self.f_out[:, self.positions] * self.u).sum(-1) + self.ub  # (1, n)

    def adjoint(self, adj: AdjointPass, frozen_at: FrozenAt) -> None:
        outputs = multi_logit_outputs(self.positions, adj.last_rows, self.fparams, self.f_in, self.u, self.ub)
        grads = adj.backward(frozen_at, outputs)
        self.scores = torch.stack([s.detach() for s in adj.token_scores(grads)], 1)  # (1, n, T)
        self.bias = torch.stack(adj.constants, 1)  # (1, n)

    def forward(self, res: PropagatedParts) -> None:
        positions = self.positions
        idx = torch.searchsorted(res.rows, positions)
        got = [
            logit_scores(res.parts[:, int(idx[k])], res.bias[:, int(idx[k])], self.fparams, self.f_in[:, int(positions[k])],
                         self.u[:, k], self.ub[:, k], self.attr.bias_mode, fallback=positions[k:k + 1])
            for k in range(positions.shape[0])
        ]
        self.scores = torch.stack([s for s, _ in got], 1)
        self.bias = torch.stack([b for _, b in got], 1)

    def result(self, res: Optional[PropagatedParts], quad: Dict[int, Tensor], num_layers: int) -> Dict[str, Any]:
        scores = self.scores * self.quadrature_tokens.unsqueeze(1)
        return {
            "scores": scores[0], "explained": self.logit[0], "no_token": self.bias[0],
            "delta": (self.logit - (scores.sum(-1) + self.bias))[0],
            "final_out": self.f_out[0, self.positions],
            "quadrature_error": stack_layers(quad, num_layers)[0],
        }
