r"""DecompX (Modarressi et al., ACL 2023): signed, class-specific token scores by exact propagation."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from captum.attr import Attribution
from captum.log import log_usage
from torch import Tensor, nn

from captum_normattr.attr.base import compute_dtype, format_output
from captum_normattr.attr.inputs import explained_positions, prepare_inputs
from captum_normattr.decompose.decompx import (
    BIAS_MODES,
    adjoint_class_scores,
    adjoint_logit_scores,
    check_bias_mode,
    ff_coefficients,
    head_scores,
    logit_scores,
    propagate_parts,
)
from captum_normattr.decompose.gated_feed_forward import DEFAULT_NODES
from captum_normattr.models.adapters import get_adapter, layer_modules, value_projection
from captum_normattr.models.capture import recording
from captum_normattr.models.heads import get_head_adapter, head_params

ALGORITHMS: Tuple[str, ...] = ("auto", "adjoint", "forward")


@dataclass
class DecompXResult:
    r"""Everything one DecompX call computed, for one batch.

    For a decoder (GPT-2, Llama family) the explained quantity is one logit per example,
    the next-token logit of ``target`` at ``explained_position`` (or its difference to
    ``foil``'s), so C = 1: ``class_scores`` is (B, T, 1), ``bias_scores`` and ``logits`` (B, 1).

    Attributes:
        method: readable name, e.g. ``"DecompX"`` or ``"DecompX (spread bias)"``.
        scores: (B, T) signed score of every input token for the explained class
            (``target``); pads exactly 0 (decoders: tokens after the explained position too).
        target: (B,) long, the explained class (decoders: token id) of every example.
        class_scores: (B, T, C) signed score of every input token for every class.
        bias_scores: (B, C) the bias part of every logit (0 in ``"spread"`` mode).
            (Both are None only in the internal target-only path of ``attribute``.)
        logits: (B, C) the model's real logits.
        delta: (B,) |sum_t scores + bias score - logit| of the target class.
        layer_part_norms: (B, L, T, T): entry [b, l, i, k] = norm of input token k's part
            of layer l's output at token i (pads 0; in the last layer only the head's
            token row is filled unless ``full_last_layer=True``). None when the
            ``"adjoint"`` algorithm ran (it never forms per-layer parts).
        layer_bias_norms: (B, L, T) norms of the bias parts of the layer outputs, or None.
        layer_errors: (B, L) largest |parts + bias - real layer output| over real tokens, or None.
        attention_mask: (B, T).
        bias_mode: ``"separate"`` or ``"spread"``.
        algorithm: ``"forward"`` or ``"adjoint"``, the one that ran.
        extras: e.g. ``"all_class_delta"`` (B,); decoders: ``"quadrature_error"`` (B, L), the
            largest |b (a I1 + I2) - b g(a)| of each gated FF (the completeness error the
            Gauss-Legendre rule leaves; 0 for an elementwise FF).
        explained_position: (B,) decoders: the position whose next-token logit is explained.
        foil: (B,) decoders: the foil token ids, or None.
    """

    method: str
    scores: Tensor
    target: Tensor
    class_scores: Optional[Tensor]
    bias_scores: Optional[Tensor]
    logits: Tensor
    delta: Tensor
    layer_part_norms: Optional[Tensor]
    layer_bias_norms: Optional[Tensor]
    layer_errors: Optional[Tensor]
    attention_mask: Tensor
    bias_mode: str
    algorithm: str = "forward"
    extras: Dict[str, Tensor] = field(default_factory=dict)
    explained_position: Optional[Tensor] = None
    foil: Optional[Tensor] = None

    @property
    def num_layers(self) -> Optional[int]:
        return None if self.layer_part_norms is None else self.layer_part_norms.shape[1]

    def to(self, device) -> "DecompXResult":
        r"""A copy with every tensor moved to ``device``."""
        mv = lambda t: t.to(device) if isinstance(t, Tensor) else t
        return replace(self, **{k: mv(getattr(self, k)) for k in (
            "scores", "target", "class_scores", "bias_scores", "logits", "delta", "layer_part_norms",
            "layer_bias_norms", "layer_errors", "attention_mask", "explained_position", "foil")}, extras={k: mv(v) for k, v in self.extras.items()})

    def example(self, index: int) -> Dict[str, Any]:
        r"""One example's tensors with the pad positions removed.

        Returns:
            dict with ``scores`` (n,), ``class_scores`` (n, C), ``bias_scores`` (C,),
            ``logits`` (C,), ``target`` (int), ``delta`` (float), ``layer_part_norms`` (L, n, n).
        """
        idx = self.attention_mask[index].bool().nonzero().squeeze(-1)
        return {
            "scores": self.scores[index][idx],
            "class_scores": self.class_scores[index][idx],
            "bias_scores": self.bias_scores[index],
            "logits": self.logits[index],
            "target": int(self.target[index]),
            "delta": float(self.delta[index]),
            "layer_part_norms": None if self.layer_part_norms is None else self.layer_part_norms[index][:, idx][:, :, idx],
        }


def _targets(target: Any, logits: Tensor) -> Tensor:
    b, c = logits.shape
    if target is None:
        return logits.argmax(-1)
    if isinstance(target, int) and not isinstance(target, bool):
        t = torch.full((b,), target, dtype=torch.long, device=logits.device)
    elif isinstance(target, Tensor):
        if target.is_floating_point() or target.dtype == torch.bool:
            raise TypeError(f"target must be an integer class index; got a {target.dtype} tensor")
        if target.dim() == 0 or tuple(target.shape) == (1,):
            t = target.reshape(1).expand(b).to(logits.device, torch.long)
        elif tuple(target.shape) == (b,):
            t = target.to(logits.device, torch.long)
        else:
            raise ValueError(f"target tensor must have shape ({b},) (one class per example); got {tuple(target.shape)}")
    elif isinstance(target, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in target):
        if len(target) != b:
            raise ValueError(f"target list must have one class per example ({b}); got {len(target)}")
        t = torch.tensor(list(target), dtype=torch.long, device=logits.device)
    else:
        raise TypeError(
            "target must be None (predicted class), an int, a list of ints or a (B,) long tensor of class indices; "
            f"got {type(target).__name__}"
        )
    if bool(((t < 0) | (t >= c)).any()):
        raise ValueError(f"target class(es) {t.tolist()} out of range: the model has {c} classes (0..{c - 1})")
    return t


class DecompXAttribution(Attribution):
    r"""DecompX: signed, class-specific token attributions by exact propagation of parts.

    The embedding output of every input token is carried as its own part through every
    layer (attention with the real probabilities, residuals, LayerNorms with the real
    per-token scale, the feed-forward block by the exact closed form at the real
    pre-activation, which is DecompX's "zero-origin slope") and through the
    classification head, so that every class logit is exactly the sum of one signed
    score per input token plus a bias score (Modarressi et al., ACL 2023).

    Two algorithms give the same numbers in ``"separate"`` mode. ``"forward"`` carries all
    T parts through every layer (cost about T forward passes; it yields the per-layer
    parts). ``"adjoint"`` uses that, with the nonlinear quantities frozen, the network is
    linear in the embedding output: token k's score is <dF_c/dx_k, e_k>, one
    vector-Jacobian product per class (cost a few forward passes). ``"auto"`` (default)
    takes ``"adjoint"`` for ``"separate"`` and ``"forward"`` for ``"spread"`` (whose
    weights depend on the forward parts).

    Supported models: sequence classifiers with the heads of
    :func:`captum_normattr.models.heads.supported_heads` — ``BertForSequenceClassification``,
    ``RobertaForSequenceClassification`` (and XLM-R/CamemBERT), ``ElectraForSequenceClassification``,
    ``DistilBertForSequenceClassification``. A bare encoder (``BertModel`` ...) has no classes
    to explain and raises :class:`~captum_normattr.UnsupportedModelError`; its per-layer parts are
    available from :func:`captum_normattr.decompose.decompx.propagate_parts`.

    Decoders (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``Qwen2ForCausalLM``; or a bare ``*Model`` with ``unembedding``): the parts go through the
    pre-LN layers (LN1 and LN2 at the real per-token scale, values of grouped-query heads
    repeated per query head, the causal attention probabilities, the residuals without a
    norm; an elementwise FF by the closed form, a gated SwiGLU FF by per-neuron integrated
    gradients along t (a, b) evaluated with ``nodes`` Gauss-Legendre nodes), then the final
    norm and the LM-head row of ``target``: the next-token logit at ``explained_position``
    is the sum of one signed score per input token plus a bias score. ``target``: a token
    id, (B,) ids, or (target, foil) (explains the logit difference), as in
    :class:`~captum_normattr.ALTILogitAttribution`; default: the predicted next token. Tokens
    after the explained position get exactly 0.

    Args:
        model: the sequence classifier.
        bias_mode: ``"separate"`` (default; every bias in its own part, exact and
            bias-free token scores) or ``"spread"`` (each bias distributed over tokens in
            proportion to |<part, bias>| where it enters, as in the paper; also complete).
        memory_budget_mb: bound on the temporary tensors of one layer step (the parts themselves
            take about 4 B T^2 D floats more).
        full_last_layer: produce every row of the last layer (for inspection); by
            default only the row the head reads.
        algorithm: ``"auto"`` (default), ``"adjoint"`` (``"separate"`` mode only) or
            ``"forward"``.
        explained_position: decoders only: ``"last"`` (default; the last real token), an
            int (negative counts from the last real token) or a (B,) tensor.
        unembedding: decoders only: a (V, D) unembedding matrix used instead of the LM head
            (needed for a bare ``GPT2Model`` / ``LlamaModel`` ...).
        nodes: decoders with a gated FF: Gauss-Legendre nodes of the gate integrals.

    Examples::

        >>> from transformers import BertForSequenceClassification
        >>> from captum_normattr import default_model_path, load_default_model
        >>> _, tok = load_default_model()
        >>> model = BertForSequenceClassification.from_pretrained(default_model_path(), num_labels=2).eval()
        >>> batch = tok(["a gripping, funny film"], return_tensors="pt")
        >>> ids, mask = batch["input_ids"], batch["attention_mask"]
        >>> dx = DecompXAttribution(model)
        >>> scores, delta = dx.attribute(ids, additional_forward_args=(mask,), return_convergence_delta=True)
        >>> res = dx.decompose(ids, additional_forward_args=(mask,))
        >>> res.class_scores.shape  # (B, T, C)
        >>> # a decoder: the next-token logit of " Paris" at the last token
        >>> lm = AutoModelForCausalLM.from_pretrained("gpt2")
        >>> scores, delta = DecompXAttribution(lm).attribute(ids, target=paris_id, return_convergence_delta=True)
    """

    def __init__(
        self,
        model: nn.Module,
        bias_mode: str = "separate",
        memory_budget_mb: float = 256.0,
        full_last_layer: bool = False,
        algorithm: str = "auto",
        explained_position: Union[int, str, Tensor, None] = None,
        unembedding: Optional[Tensor] = None,
        nodes: int = DEFAULT_NODES,
    ) -> None:
        check_bias_mode(bias_mode)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if algorithm == "adjoint" and bias_mode != "separate":
            raise ValueError("the 'adjoint' algorithm computes bias_mode='separate' only; use algorithm='forward' for 'spread'")
        self.adapter = get_adapter(model)
        self.decoder = bool(self.adapter.pre_ln)
        self._logit = None
        if self.decoder:
            if self.adapter.final_norm is None:
                raise ValueError(f"the {self.adapter.family} adapter names no final norm; DecompX needs it for decoders")
            if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
                raise ValueError(f"nodes (Gauss-Legendre nodes) must be a positive int, got {nodes!r}")
            from captum_normattr.attr.alti_logit import ALTILogitAttribution

            # the LM-head lookup and the (target, foil) parsing are ALTI-Logit's
            self._logit = ALTILogitAttribution(
                model, unembedding=unembedding, explained_position="last" if explained_position is None else explained_position
            )
            self.head = None
        else:
            if explained_position is not None or unembedding is not None:
                raise ValueError(
                    "explained_position and unembedding apply to decoders only; an encoder classifier's head fixes the "
                    "position it reads"
                )
            self.head = get_head_adapter(model)
        self.explained_position = "last" if explained_position is None else explained_position
        self.nodes = nodes
        if self.adapter.attn_value is None:
            raise ValueError(f"the {self.adapter.family} adapter does not name the value projection (attn_value)")
        if memory_budget_mb <= 0:
            raise ValueError(f"memory_budget_mb must be positive, got {memory_budget_mb}")
        Attribution.__init__(self, model)
        self.model = model
        self.bias_mode = bias_mode
        self.memory_budget_mb = float(memory_budget_mb)
        self.full_last_layer = full_last_layer
        self.algorithm = algorithm

    def _value_params(self, dtype: torch.dtype) -> List[Tuple[Tensor, Optional[Tensor]]]:
        out = []
        for layer in layer_modules(self.model, self.adapter):
            w, b = value_projection(layer, self.adapter)
            out.append((w.detach().to(dtype), None if b is None else b.detach().to(dtype)))
        return out

    def decompose(
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        target: Any = None,
        additional_forward_args: Any = None,
        layer_parts: bool = False,
    ) -> DecompXResult:
        r"""Decompose every layer and the head; all classes at once.

        Args:
            inputs: token ids (B, T) (or word embeddings (B, T, D)), or a 1-tuple.
            target: the explained class: None (predicted), an int, a list of ints or a
                (B,) long tensor. Only ``scores`` and ``delta`` depend on it. Decoders: the
                token id(s) whose next-token logit is explained (None: the predicted next
                token), or (target, foil) for the logit difference (a (B, 2) tensor: per example).
            additional_forward_args: attention_mask (B, T) or (attention_mask, token_type_ids).
            layer_parts: run the ``"forward"`` algorithm whatever ``algorithm`` says, so that
                the per-layer part norms and completeness errors are filled in.

        Returns:
            :class:`DecompXResult`.
        """
        return self._compute(inputs, target, additional_forward_args, layer_parts, target_only=False)

    def _compute(self, inputs, target, additional_forward_args, layer_parts: bool, target_only: bool):
        if self.decoder:
            return self._compute_decoder(inputs, target, additional_forward_args, layer_parts)
        prepared = prepare_inputs(self.model, self.adapter, inputs, additional_forward_args)
        valid = prepared.valid
        dtype = compute_dtype(self.model)
        with torch.no_grad():
            with recording(self.model, self.adapter) as rec:
                out = self.model(**prepared.forward_kwargs())
            logits_real = (out.logits if hasattr(out, "logits") else out[0]).detach()
            layers = rec.layer_tensors(dtype)
            pos = self.head.position
            hp = head_params(self.model, self.head, dtype)
            algorithm = "forward" if (layer_parts or self.algorithm == "forward" or self.bias_mode != "separate") else "adjoint"
            prop = None
            logits = logits_real.to(dtype)
            tgt = _targets(target, logits)
            ar = torch.arange(logits.shape[0], device=logits.device)
            if algorithm == "adjoint" and target_only:  # one vector-Jacobian product in all
                scores, bias_t = adjoint_class_scores(layers, self._value_params(dtype), hp, tgt)
                scores = scores * valid.to(dtype)
                delta = (scores.sum(-1) + bias_t - logits[ar, tgt]).abs()
                return DecompXResult(
                    method=self.get_name(), scores=scores, target=tgt, class_scores=None, bias_scores=None,
                    logits=logits, delta=delta, layer_part_norms=None, layer_bias_norms=None, layer_errors=None,
                    attention_mask=prepared.attention_mask, bias_mode=self.bias_mode, algorithm=algorithm,
                )
            if algorithm == "adjoint":
                cls_scores, bias_scores = adjoint_class_scores(layers, self._value_params(dtype), hp)
            else:
                last_rows = None if self.full_last_layer else torch.tensor([pos], device=valid.device)
                prop = propagate_parts(layers, self._value_params(dtype), valid, self.bias_mode, last_rows, self.memory_budget_mb)
                row = int((prop.rows == pos).nonzero()[0, 0])
                cls_scores, bias_scores = head_scores(
                    prop.parts[:, row], prop.bias[:, row], layers[-1].layer_out[:, pos],
                    hp.w_dense, hp.b_dense, hp.act, hp.w_cls, hp.b_cls, self.bias_mode, fallback=pos,
                )
            cls_scores = cls_scores * valid.to(dtype).unsqueeze(-1)
            scores = cls_scores[ar, :, tgt]
            delta = (scores.sum(-1) + bias_scores[ar, tgt] - logits[ar, tgt]).abs()
        name = self.get_name()
        return DecompXResult(
            method=name, scores=scores, target=tgt, class_scores=cls_scores, bias_scores=bias_scores,
            logits=logits, delta=delta,
            layer_part_norms=None if prop is None else prop.layer_part_norms,
            layer_bias_norms=None if prop is None else prop.layer_bias_norms,
            layer_errors=None if prop is None else prop.layer_errors,
            attention_mask=prepared.attention_mask, bias_mode=self.bias_mode, algorithm=algorithm,
            extras={"all_class_delta": (cls_scores.sum(1) + bias_scores - logits).abs().amax(-1)},
        )

    def _compute_decoder(self, inputs, target, additional_forward_args, layer_parts: bool) -> DecompXResult:
        prepared = prepare_inputs(self.model, self.adapter, inputs, additional_forward_args)
        valid = prepared.valid
        pos = explained_positions(self.explained_position, valid)
        with torch.no_grad():
            layers, (fparams, f_in, f_out) = self._logit.capture_full(prepared)
            b = valid.shape[0]
            ar = torch.arange(b, device=valid.device)
            dtype = f_in.dtype
            if target is None:  # the predicted next token at the explained position
                w_u = self._logit._unembed.detach().to(device=f_in.device, dtype=dtype)
                nxt = f_out[ar, pos] @ w_u.T
                if self._logit._unembed_bias is not None:
                    nxt = nxt + self._logit._unembed_bias.detach().to(device=f_in.device, dtype=dtype)
                target = nxt.argmax(-1)
            u, ub, t_ids, f_ids = self._logit._direction(target, b, f_in.device, dtype)
            logit = (f_out[ar, pos] * u).sum(-1) + ub  # the model's real logit (difference)
            value_params = self._value_params(dtype)
            coefs = [ff_coefficients(layer, self.nodes) for layer in layers]
            algorithm = "forward" if (layer_parts or self.algorithm == "forward" or self.bias_mode != "separate") else "adjoint"
            prop = None
            if algorithm == "adjoint":
                scores, bias_score = adjoint_logit_scores(layers, value_params, coefs, fparams, f_in, u, ub, pos)
            else:
                last_rows = None if self.full_last_layer else torch.unique(pos)
                prop = propagate_parts(layers, value_params, valid, self.bias_mode, last_rows, self.memory_budget_mb, coefs)
                idx = torch.searchsorted(prop.rows, pos)
                scores, bias_score = logit_scores(
                    prop.parts[ar, idx], prop.bias[ar, idx], fparams, f_in[ar, pos], u, ub, self.bias_mode, fallback=pos
                )
            scores = scores * valid.to(dtype)
            delta = (scores.sum(-1) + bias_score - logit).abs()
            quad = torch.stack(
                [c["quadrature_error"] if "quadrature_error" in c else torch.zeros_like(f_in[..., 0]) for c in coefs], 1
            )  # (B, L, T)
            quad = (quad * valid.to(dtype).unsqueeze(1)).amax(-1)
        return DecompXResult(
            method=self.get_name(), scores=scores, target=t_ids, class_scores=scores.unsqueeze(-1),
            bias_scores=bias_score.unsqueeze(-1), logits=logit.unsqueeze(-1), delta=delta,
            layer_part_norms=None if prop is None else prop.layer_part_norms,
            layer_bias_norms=None if prop is None else prop.layer_bias_norms,
            layer_errors=None if prop is None else prop.layer_errors,
            attention_mask=prepared.attention_mask, bias_mode=self.bias_mode, algorithm=algorithm,
            extras={"quadrature_error": quad}, explained_position=pos, foil=f_ids,
        )

    @log_usage()
    def attribute(
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        target: Any = None,
        additional_forward_args: Any = None,
        return_convergence_delta: bool = False,
    ) -> Union[Tensor, Tuple[Tensor], Tuple[Union[Tensor, Tuple[Tensor]], Tensor]]:
        r"""Signed token scores for the target class.

        Args:
            inputs: token ids (B, T) (or word embeddings (B, T, D)), or a 1-tuple of them.
            target: the explained class: None (the predicted class), an int, a list of ints
                or a (B,) long tensor. Decoders: token id(s), or (target, foil); None: the
                predicted next token (see :meth:`decompose`).
            additional_forward_args: attention_mask (B, T) or (attention_mask, token_type_ids).
            return_convergence_delta: also return delta (B,) = |sum of the token scores +
                bias score - real logit of the target class|.

        Returns:
            (B, T) scores (a 1-tuple for tuple inputs); pads exactly 0; with
            ``return_convergence_delta``, (scores, delta).
        """
        res = self._compute(inputs, target, additional_forward_args, layer_parts=False, target_only=True)
        return format_output(inputs, res.scores, res.delta, return_convergence_delta)

    def has_convergence_delta(self) -> bool:
        return True

    def get_name(self) -> str:
        return "DecompX" if self.bias_mode == "separate" else "DecompX (spread bias)"
