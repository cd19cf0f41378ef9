r"""DecompX (Modarressi et al., ACL 2023): signed, class-specific token scores by exact propagation.

One skeleton for every model (:meth:`DecompXAttribution._run`: the layers streamed, the parts
forward or the adjoint down); what is explained at the top is a readout
(:mod:`captum_normattr.attr.decompx_readouts`: a classifier's classes, a Vision Transformer's
classes, a causal LM's next-token logit, or n positions of one sequence for the LLM API).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Iterator, Optional, Tuple, Union

import torch
from captum.attr import Attribution
from torch import Tensor, nn

from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.attr.base import DecompositionAttribution, format_output
from captum_normattr.attr.decompx_readouts import (ClassifierReadout, DecompXReadout, ImageClassifierReadout,
                                                   InputCotangents, NextTokenReadout, PositionsReadout)
from captum_normattr.attr.explained_output import ClassLogit, ImageClassLogit, NextTokenLogit, explains_next_token
from captum_normattr.attr.images import pixel_attributions
from captum_normattr.attr.inputs import prepare_inputs
from captum_normattr.attr.positions import (PositionExplanation, explained_directions, position_log_probs,
                                            position_request, warn_non_finite)
from captum_normattr.models.prepared import PreparedInputs
from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.methods.decompx.adjoint import AdjointPass, FrozenLayer
from captum_normattr.decompose.methods.decompx.parts import check_bias_mode, ff_coefficients
from captum_normattr.decompose.methods.decompx.propagation import PartsPropagation
from captum_normattr.decompose.primitives.gated_feed_forward import DEFAULT_NODES
from captum_normattr.decompose.records import LayerTensors
from captum_normattr.models.adapters import get_adapter, get_path, layer_modules, unwrap_model, value_projection
from captum_normattr.models.capture.recorder import Recorder
from captum_normattr.models.engine import compute_dtype, mark_non_finite, streamed_forward
from captum_normattr.models.guard import ConsistencyGuard
from captum_normattr.models.weights import tensors_to
from captum_normattr.options import check_explained_position, check_memory_budget, check_positive_int
from captum_normattr.result import LogitDecompositionResult

__all__ = ["ALGORITHMS", "DECOMPX_COST_MODEL", "DecompXAttribution", "DecompXResult", "InputCotangents",
           "choose_decompx_algorithm", "decompx_cost"]

ALGORITHMS: Tuple[str, ...] = ("auto", "adjoint", "forward")

#: DecompX's measured cost for n explained next-token logits of one T-token sequence, in forward passes of
#: the model on the same tokens: per measured T, (T, a_adjoint, b_adjoint, a_forward, b_forward) with
#: cost = a + b n (``benchmarks/speed/decompx_cost_model.py``, results in
#: ``benchmarks/results/decompx_cost_model.json``; docs/llm.md, "Cost"). Between the measured T the
#: coefficients are interpolated linearly; beyond the largest T the forward propagation's a grows
#: with T (it carries T parts per token: its cost per forward pass grows like T) and the others stay.
DECOMPX_COST_MODEL: Tuple[Tuple[int, float, float, float, float], ...] = (
    (16, 8.05, 0.077, 8.68, 0.0),
    (32, 7.99, 0.397, 17.39, 0.135),
    (128, 3.54, 0.329, 50.02, 0.158),
    (512, 6.28, 0.685, 425.94, 0.0),
)


def decompx_cost(algorithm: str, n_targets: int, seq_len: int) -> float:
    r"""DecompX's cost model: forward passes for ``n_targets`` explained logits at prompt length ``seq_len``.

    Args:
        algorithm: ``"adjoint"`` or ``"forward"``.
        n_targets: n, the explained logits (positions) of one sequence.
        seq_len: T, its tokens.

    Returns:
        a + b n in forward passes of the model on the T tokens (:data:`DECOMPX_COST_MODEL`).

    Examples:
        >>> round(decompx_cost("adjoint", 1, 128), 1), round(decompx_cost("forward", 1, 128), 1)
        (3.9, 50.2)
    """
    if algorithm not in ("adjoint", "forward"):
        raise ValueError(f"algorithm must be 'adjoint' or 'forward', got {algorithm!r}")
    n, t = int(n_targets), int(seq_len)
    table = DECOMPX_COST_MODEL
    if t <= table[0][0]:
        row = table[0][1:]
    elif t >= table[-1][0]:
        last = table[-1]
        row = (last[1], last[2], last[3] * t / last[0], last[4])
    else:
        i = next(k for k in range(1, len(table)) if t <= table[k][0])
        lo, hi = table[i - 1], table[i]
        w = (t - lo[0]) / (hi[0] - lo[0])
        row = tuple((1 - w) * x + w * y for x, y in zip(lo[1:], hi[1:]))
    a, b = row[:2] if algorithm == "adjoint" else row[2:]
    return a + b * n


def choose_decompx_algorithm(n_targets: int, seq_len: int) -> str:
    r"""The cheaper DecompX algorithm for ``n_targets`` explained logits of one ``seq_len``-token sequence.

    The adjoint costs a few forward passes plus about one vector-Jacobian product per explained
    logit; the forward propagation carries T parts per token, so its cost grows with T but
    hardly with n (:func:`decompx_cost`). Both give the same scores (to rounding). The LLM API
    (:class:`~captum_normattr.attr.llm.DecompositionLLMAttribution`, ``captum-normattr generate``)
    calls this when the method was built with ``algorithm="auto"`` (the default).

    Args:
        n_targets: n >= 1.
        seq_len: T >= 1.

    Returns:
        ``"adjoint"`` or ``"forward"``.

    Examples:
        >>> choose_decompx_algorithm(32, 512), choose_decompx_algorithm(64, 32)
        ('adjoint', 'forward')
    """
    if int(n_targets) < 1 or int(seq_len) < 1:
        raise ValueError(f"n_targets and seq_len must be >= 1, got {n_targets} and {seq_len}")
    adjoint, forward = decompx_cost("adjoint", n_targets, seq_len), decompx_cost("forward", n_targets, seq_len)
    return "forward" if forward < adjoint else "adjoint"


def _ordinary_tensors(obj: Any) -> Any:
    r"""``obj`` with every inference tensor (made under ``torch.inference_mode()``) cloned into an ordinary one."""
    if isinstance(obj, Tensor):
        return obj.clone() if obj.is_inference() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_ordinary_tensors(o) for o in obj)
    return obj


def _checked_preactivations(layer: LayerTensors, got: Dict[str, Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
    r"""(a, b) from the gate and up projections' outputs of a rerun, if they are the layer's real pre-activations.

    They must have the shape (B, T, F) and the compute dtype (a half-precision model is
    decomposed in float32: its own products are not used), and agree on the first token
    with the FF input times the weights (so that a projection whose input is not the
    recorded FF input is never taken). Otherwise None: the coefficients recompute them.
    """
    f = layer.ff
    if "gate" not in got or "up" not in got or f.w_gate is None:
        return None
    u = layer.ff_input
    shape = u.shape[:-1] + (f.w_out.shape[0],)
    pair = []
    for key, w, b in (("gate", f.w_gate, f.b_gate), ("up", f.w_in, f.b_in)):
        t = got[key]
        if t.shape != shape or t.dtype != u.dtype:
            return None
        t = t.to(u.device)
        check = u[:, :1] @ w + (b if b is not None else 0.0)
        tol = 1e-9 if u.dtype == torch.float64 else 1e-3
        if not torch.allclose(t[:, :1], check, rtol=tol, atol=tol * float(check.abs().max().clamp(min=1.0))):
            return None
        pair.append(t)
    return pair[0], pair[1]


@dataclass
class DecompXResult(LogitDecompositionResult):
    r"""Everything one DecompX call computed, for one batch.

    For a decoder (GPT-2, Llama family) the explained quantity is one logit per example,
    the next-token logit of ``target`` at ``explained_position`` (or its difference to
    ``foil``'s), so C = 1: ``class_scores`` is (B, T, 1), ``bias_scores`` and ``logits`` (B, 1).

    Attributes:
        method: readable name: ``"DecompX"``, ``"DecompX (spread bias)"`` or
            ``"DecompX (spread bias per key)"``.
        scores: (B, T) signed score of every input token for the explained class
            (``target``); pads exactly 0 (decoders: tokens after the explained position too).
        target: (B,) long, the explained class (decoders: token id) of every example.
        class_scores: (B, T, C) signed score of every input token for every class.
        bias_scores: (B, C) the bias part of every logit (0 in the spread modes, up to
            rounding).
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
        bias_mode: ``"separate"``, ``"spread"`` or ``"spread_per_key"``.
        algorithm: ``"forward"`` or ``"adjoint"``, the one that ran.
        extras: e.g. ``"all_class_delta"`` (B,); decoders: ``"quadrature_error"`` (B, L), the
            largest |b (a I1 + I2) - b g(a)| of each gated FF (the completeness error the
            Gauss-Legendre rule leaves; 0 for an elementwise FF).
        explained_position: (B,) decoders: the position whose next-token logit is explained
            (None for a classifier, whose head fixes the token it reads).
        foil: (B,) decoders: the foil token ids, or None.

    :meth:`~captum_normattr.result.AttributionResult.example` drops the pads along the token
    axes of ``scores``, ``class_scores``, ``layer_part_norms`` and ``layer_bias_norms``.
    """

    TOKEN_AXES: ClassVar[Dict[str, Tuple[int, ...]]] = {
        "scores": (1,), "class_scores": (1,), "layer_part_norms": (2, 3), "layer_bias_norms": (2,),
    }

    class_scores: Optional[Tensor] = None
    bias_scores: Optional[Tensor] = None
    layer_part_norms: Optional[Tensor] = None
    layer_bias_norms: Optional[Tensor] = None
    layer_errors: Optional[Tensor] = None
    bias_mode: str = "separate"
    algorithm: str = "forward"

    @property
    def num_layers(self) -> Optional[int]:
        return None if self.layer_part_norms is None else self.layer_part_norms.shape[1]


class DecompXAttribution(DecompositionAttribution):
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
    takes ``"adjoint"`` for ``"separate"`` and ``"forward"`` for the spread modes (whose
    weights depend on the forward parts); for n next-token logits of one sequence
    (:meth:`explain_positions`, the LLM API) it takes the cheaper of the two for n and T
    (:func:`choose_decompx_algorithm`; docs/llm.md, "Cost").

    Both stream: the layers are decomposed as the forward pass reaches them, so that no
    more than one layer's attention probabilities exist at a time. ``"forward"`` carries
    the (B, T, T, D) parts from layer to layer and keeps per layer only their norms;
    ``"adjoint"`` keeps each layer's input (B, T, D) and then walks the layers top-down,
    rerunning each layer on its input for one local vector-Jacobian product
    (:class:`~captum_normattr.decompose.methods.decompx.adjoint.AdjointPass`).

    Supported models: sequence classifiers with the heads of
    :func:`captum_normattr.models.heads.supported_heads` — ``BertForSequenceClassification``,
    ``RobertaForSequenceClassification`` (and XLM-R/CamemBERT), ``ElectraForSequenceClassification``,
    ``DistilBertForSequenceClassification``, and the heads that the architecture registry
    describes (``Head.classifier``: DeBERTa-v2's pooler, ModernBERT's head, whose final norm and
    head LayerNorm are frozen at their real scales). A bare encoder (``BertModel`` ...) has no classes
    to explain and raises :class:`~captum_normattr.UnsupportedModelError`; its per-layer parts are
    available from :func:`captum_normattr.decompose.methods.decompx.propagation.propagate_parts`.

    Decoders (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``Qwen2ForCausalLM``; or a bare ``*Model`` with ``unembedding``): the parts go through the
    pre-LN layers (LN1 and LN2 at the real per-token scale, values of grouped-query heads
    repeated per query head, the causal attention probabilities, the residuals without a
    norm; an elementwise FF by the closed form, a gated SwiGLU FF by per-neuron integrated
    gradients along t (a, b) evaluated with ``nodes`` Gauss-Legendre nodes), then the final
    norm and the LM-head row of ``target``: the next-token logit at ``explained_position``
    is the sum of one signed score per input token plus a bias score. ``target``: a token
    id or (B,) ids, default the predicted next token; ``foil=``: token id(s) whose logit is
    subtracted (explains the logit difference), as in :class:`~captum_normattr.ALTILogitAttribution`. Tokens
    after the explained position get exactly 0.

    Guard: the logit the scores explain (rebuilt from the recorded head input and the head's
    weights) is compared with the model's own output logits on every call; a mismatch beyond
    rounding warns, far beyond raises
    (:func:`~captum_normattr.attr.explained_output.check_explained_logit`, docs/reliability.md).

    Args:
        model: the sequence classifier (or decoder), also inside a peft ``PeftModel`` (LoRA
            layers are read as their effective weights) or a ``torch.compile`` wrapper (run
            eagerly); see :func:`captum_normattr.models.adapters.unwrap_model`.
        bias_mode: ``"separate"`` (default; every bias in its own part, exact and
            bias-free token scores), ``"spread"`` (each bias distributed over tokens in
            proportion to |<part, bias>|, exactly as the official DecompX code does it:
            attention biases W_O b_V + b_O after the residual, b_V inside each token's value
            in layer 0; also complete) or ``"spread_per_key"`` (the same, except that b_V is
            spread over the parts of each key token before the attention mixes them, and
            b_O over the attention parts before the residual; this package's rule before
            version 2). See docs/design.md, section 8 (DecompX) and docs/fidelity.md.
        memory_budget_mb: bound on the temporary tensors of one layer step (the parts themselves
            take about 4 B T^2 D floats more).
        full_last_layer: produce every row of the last layer (for inspection); by
            default only the row the head reads.
        algorithm: ``"auto"`` (default), ``"adjoint"`` (``"separate"`` mode only) or
            ``"forward"``.
        explained_position: decoders only: ``"last"`` (default; the last real token), an
            int (k >= 0 counts from the first real token, negative from the last) or a (B,)
            integer tensor of padded positions.
        unembedding: decoders only: a (V, D) unembedding matrix used instead of the LM head
            (needed for a bare ``GPT2Model`` / ``LlamaModel`` ...).
        nodes: decoders with a gated FF: Gauss-Legendre nodes of the gate integrals.
        strict: raise :class:`~captum_normattr.models.guard.ConsistencyError` (and
            :class:`~captum_normattr.attr.explained_output.ExplainedOutputMismatchError`)
            instead of warning when the model's real tensors or logits disagree with the
            decomposition (docs/reliability.md).

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

    method_name = "DecompX"

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
        strict: bool = False,
    ) -> None:
        check_bias_mode(bias_mode)
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        self.strict = strict
        nodes = check_positive_int("nodes", nodes)
        memory_budget_mb = check_memory_budget(memory_budget_mb)
        explained_position = check_explained_position(explained_position)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if algorithm == "adjoint" and bias_mode != "separate":
            raise ValueError("the 'adjoint' algorithm computes bias_mode='separate' only; use algorithm='forward' for 'spread'")
        model = unwrap_model(model)  # a PeftModel / torch.compile wrapper: the transformers model inside, run eagerly
        self.adapter = get_adapter(model)
        self.kind = layer_kind(self.adapter.topology, self.adapter.family)
        self.kind.require("decompx", self.adapter.family)
        if algorithm == "adjoint" and not self.kind.adjoint:
            raise UnsupportedModelError(f"{self.adapter.family} has {self.kind.name} layers, which DecompX's adjoint "
                                        "does not transpose (a layer reusing an earlier layer's values depends on that "
                                        "layer's input): use algorithm='forward' (what 'auto' chooses for them)")
        self.vision = self.adapter.modality == "image"  # Vision Transformer classifier (see attr/images.py)
        # the explained output follows the model's head: an LM head gives next-token logits, a classification
        # head class logits (whatever the layer kind: a pre-LN *ForSequenceClassification is a classifier)
        self.decoder = not self.vision and explains_next_token(model, self.adapter)
        self.output: Union[ClassLogit, NextTokenLogit]
        if self.decoder:
            self.output = NextTokenLogit(model, self.adapter, unembedding)
        else:
            if explained_position is not None or unembedding is not None:
                raise ValueError(
                    "explained_position and unembedding apply to decoders only; an encoder classifier's head fixes the "
                    "position it reads"
                )
            self.output = ImageClassLogit(model) if self.vision else ClassLogit(model)
        self.head = None if self.decoder else self.output.head
        self.explained_position = "last" if explained_position is None else explained_position
        self.nodes = nodes
        if self.adapter.attn_value is None:
            raise ValueError(f"the {self.adapter.family} adapter does not name the value projection (attn_value)")
        self.memory_budget_mb = check_memory_budget(memory_budget_mb)
        Attribution.__init__(self, model)
        self.model = model
        self.bias_mode = bias_mode
        self.full_last_layer = full_last_layer
        self.algorithm = algorithm
        self._modules_list = layer_modules(model, self.adapter)

    def _value_param(self, layer: LayerTensors) -> Tuple[Tensor, Optional[Tensor]]:
        r"""(W_V, b_V) of ``layer`` in its dtype, on its device (read from an accelerate hook if offloaded).

        A kind whose step reads its values itself (``reads_value_projection`` False) gets an empty W_V.
        """
        if not self.kind.reads_value_projection:
            return layer.hidden_in.new_zeros(0), None
        w, b = value_projection(self._modules_list[layer.index], self.adapter)
        dev, dtype = layer.hidden_in.device, layer.hidden_in.dtype
        return w.detach().to(dev, dtype), None if b is None else b.detach().to(dev, dtype)

    def _coefficients(
        self, layer: LayerTensors, preactivations: Optional[Tuple[Tensor, Tensor]] = None
    ) -> Dict[str, Tensor]:
        return ff_coefficients(layer, self.nodes, preactivations)

    def _frozen(
        self,
        layer: LayerTensors,
        quad: Optional[Dict[int, Tensor]] = None,
        vf: Optional[Tensor] = None,
        preactivations: Optional[Tuple[Tensor, Tensor]] = None,
    ) -> FrozenLayer:
        r"""The layer's :class:`FrozenLayer`; with ``quad``, its largest quadrature error (B,) (over
        the real tokens ``vf``, if given) goes to ``quad[layer.index]``."""
        coefs = self._coefficients(layer, preactivations)
        if quad is not None:
            q = coefs.get("quadrature_error")
            q = q if q is not None else torch.zeros_like(layer.hidden_in[..., 0])
            quad[layer.index] = (q if vf is None else q * vf).amax(-1)
        return FrozenLayer(layer, *self._value_param(layer), coefs, None if vf is None else vf > 0)

    def _rerun(
        self, rec: Recorder, quad: Optional[Dict[int, Tensor]] = None, vf: Optional[Tensor] = None,
        adj: Optional[AdjointPass] = None, guard: Optional[ConsistencyGuard] = None,
    ) -> Callable[[int, Tensor], FrozenLayer]:
        r"""``(l, checkpoint) -> FrozenLayer``: layer l recomputed from its input, for the adjoint's walk.

        A gated FF's pre-activations computed by the rerun are kept (:meth:`_tap_preactivations`)
        and reused for its coefficients instead of being computed a second time. With ``adj`` and
        ``guard``, every rerun is checked against the layer's output in the recorded pass
        (:meth:`~captum_normattr.models.guard.ConsistencyGuard.check_rerun`).
        """

        def frozen_at(l: int, x: Tensor) -> FrozenLayer:
            with self._tap_preactivations(l) as got:
                layer = tensors_to(rec.rerun_layer(l, x), x.device)  # x: on the inputs' device
            real = adj.real_output(l) if adj is not None else None
            if guard is not None and real is not None:
                guard.check_rerun(layer, real)
            return self._frozen(layer, quad, vf, _checked_preactivations(layer, got))

        return frozen_at

    @contextmanager
    def _tap_preactivations(self, l: int) -> Iterator[Dict[str, Tensor]]:
        r"""In the block: the outputs of layer l's gate and up projections computed by this thread (gated FF only)."""
        got: Dict[str, Tensor] = {}
        if self.adapter.ff_gate is None:
            yield got
            return
        me = threading.get_ident()

        def keep(name: str):
            def hook(module, args, output):
                if threading.get_ident() == me and torch.is_tensor(output):
                    got[name] = output.detach()

            return hook

        layer = self._modules_list[l]
        handles = [
            get_path(layer, self.adapter.ff_gate).register_forward_hook(keep("gate")),
            get_path(layer, self.adapter.ff_in).register_forward_hook(keep("up")),
        ]
        try:
            yield got
        finally:
            for h in handles:
                h.remove()

    def _algorithm(self, layer_parts: bool) -> str:
        forward = layer_parts or self.algorithm == "forward" or self.bias_mode != "separate" or not self.kind.adjoint
        return "forward" if forward else "adjoint"

    def decompose(
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        target: Any = None,
        additional_forward_args: Any = None,
        layer_parts: bool = False,
        foil: Any = None,
    ) -> DecompXResult:
        r"""Decompose every layer and the head; all classes at once.

        Args:
            inputs: token ids (B, T) (or word embeddings (B, T, D)), or a 1-tuple.
            target: the explained class: None (predicted), an int (or numpy integer, 0-d
                tensor), a list of ints or a (B,) integer tensor (one class per example). Only
                ``scores`` and ``delta`` depend on it. Decoders: the token id(s) whose
                next-token logit is explained (None: the predicted next token). A tuple is
                Captum's output index: ``(c,)`` for a classifier; the old ``(target, foil)``
                form raises a ValueError pointing to ``foil``, an attention mask passed here one
                pointing to ``additional_forward_args=``.
            additional_forward_args: attention_mask (B, T), or the model inputs by name,
                ``{"attention_mask": ..., "token_type_ids": ..., "position_ids": ...}``
                (``(attention_mask, token_type_ids)`` positionally for BERT-like encoders only;
                docs/reliability.md, "Position ids and every other model input by name").
            layer_parts: run the ``"forward"`` algorithm whatever ``algorithm`` says, so that
                the per-layer part norms and completeness errors are filled in.
            foil: decoders: token id(s) (one, or one per example) whose logit is subtracted:
                the explained quantity is logit(target) - logit(foil). For a classifier's
                contrast of two classes use ``class_scores[..., a] - class_scores[..., b]``.

        Returns:
            :class:`DecompXResult`.
        """
        return self._compute(inputs, target, additional_forward_args, layer_parts, target_only=False, foil=foil)

    def _compute(self, inputs, target, additional_forward_args, layer_parts: bool, target_only: bool,
                 foil: Any = None) -> DecompXResult:
        return self._computed(inputs, target, additional_forward_args, self._algorithm(layer_parts), target_only,
                              foil)[0]

    def _computed(self, inputs, target, additional_forward_args, algorithm: str, target_only: bool,
                  foil: Any = None) -> Tuple[DecompXResult, DecompXReadout]:
        r"""(the result, the readout that made it) of one call by ``algorithm``."""
        self.check_target(target, inputs)
        if foil is not None and not self.decoder:
            raise ValueError(
                "foil= applies to the next-token logit of a decoder. A classifier explains every class at once: "
                "decompose(...).class_scores[..., a] - class_scores[..., b] (and bias_scores) is the contrast of two classes"
            )
        # The adjoint and the gate integrals differentiate the frozen layers, which autograd refuses
        # on inference tensors: leave inference mode for the call (its results are ordinary tensors).
        with torch.inference_mode(False):
            inputs, additional_forward_args = _ordinary_tensors((inputs, additional_forward_args))
            prepared = prepare_inputs(self.model, self.adapter, inputs, additional_forward_args)
            dtype = compute_dtype(self.model)
            readout: DecompXReadout
            if self.vision:
                readout = ImageClassifierReadout(self, prepared, target, dtype, target_only)
            elif self.decoder:
                readout = NextTokenReadout(self, prepared, target, dtype, foil)
            else:
                readout = ClassifierReadout(self, prepared, target, dtype, target_only)
            fields = self._run(prepared, readout, algorithm)
            result = DecompXResult(method=self.get_name(), attention_mask=prepared.attention_mask,
                                   bias_mode=self.bias_mode, algorithm=algorithm, **fields)
            return mark_non_finite(result, prepared.finite), readout

    def input_cotangents(
        self,
        inputs: Union[Tensor, Tuple[Tensor]],
        target: Any = None,
        additional_forward_args: Any = None,
        foil: Any = None,
    ) -> InputCotangents:
        r"""A decoder's explained next-token logit as an affine function of its input embeddings: the cotangents.

        With DecompX's nonlinear quantities frozen at their real values the explained logit is affine in
        the decoder's input embeddings e_k, ``F(e) = sum_k g_k . e_k + c``; the adjoint computes every
        g_k = dF/de_k in one walk down the layers (always the ``"adjoint"`` algorithm). Token k's score is
        g_k . e_k and c the bias score, so whatever is written into e_k as a sum of parts gets its exact
        share g_k . part (a vision-language model's image tokens split over image patches:
        :mod:`captum_normattr.attr.vlm_end_to_end`).

        Args:
            inputs, target, additional_forward_args, foil: as in :meth:`decompose`.

        Returns:
            :class:`~captum_normattr.attr.decompx_readouts.InputCotangents`.

        Raises:
            UnsupportedModelError: not a decoder, a spread bias mode, or layers the adjoint does not transpose.

        Examples::

            >>> cot = DecompXAttribution(lm).input_cotangents(ids, target=paris_id)
            >>> (cot.cotangent * cot.embeddings).sum(-1)   # == cot.result.scores on the real tokens
        """
        if not self.decoder:
            raise UnsupportedModelError(
                "input_cotangents explains a decoder's next-token logit; this DecompXAttribution wraps a classifier "
                "(decompose() gives its class scores)")
        if self.bias_mode != "separate" or not self.kind.adjoint:
            raise UnsupportedModelError(
                f"input_cotangents runs DecompX's adjoint, which needs bias_mode='separate' and layers it transposes "
                f"(got bias_mode={self.bias_mode!r}, {self.kind.name} layers)")
        result, readout = self._computed(inputs, target, additional_forward_args, "adjoint", False, foil)
        return readout.input_cotangents(result)

    # --- the skeleton: one recorded pass, the parts forward or the adjoint down, the readout at the top ---------
    def _run(self, prepared: PreparedInputs, readout: DecompXReadout, algorithm: str) -> Dict[str, Any]:
        r"""DecompX of every model: the layers streamed, then ``readout``'s explained output.

        ``"forward"`` propagates the parts layer by layer as the pass reaches them (keeping the
        last layer's ``readout.rows`` only, unless ``full_last_layer``); ``"adjoint"`` keeps each
        layer's input and, once the readout has read the model's output, walks the layers down,
        rerunning each one for its vector-Jacobian product. Returns the readout's result fields.
        """
        valid = prepared.valid
        n = len(self._modules_list)
        quad: Dict[int, Tensor] = {}  # layer -> (B,) its largest quadrature error (over readout.quadrature_tokens)
        vf = readout.quadrature_tokens
        prop: Optional[PartsPropagation] = None
        adj: Optional[AdjointPass] = None
        if algorithm == "forward":
            last_rows = None if self.full_last_layer else readout.rows
            prop = PartsPropagation(n, valid, self.bias_mode, last_rows, self.memory_budget_mb)
        else:
            adj = AdjointPass(n, readout.rows)

        def on_layer(layer: LayerTensors) -> None:
            layer = tensors_to(layer, valid.device)  # a device_map may spread the layers: work on the inputs' device
            if prop is not None:
                step = self._frozen(layer, quad, vf)
                prop.step(layer, step.value_weight, step.value_bias, step.coefs)
            else:
                # the checkpoint (the layer is rerun later); the last layer's output, for checking its rerun
                adj.forward(layer.hidden_in, layer_output=layer.layer_out if layer.index == n - 1 else None)
            readout.keep(layer, layer.index == n - 1)

        run = readout.forward_inputs()
        # the adjoint keeps only each layer's input (its checkpoint) from this pass and reruns the layers on the way
        # down: no probabilities here, the model's own (sdpa) attention runs (docs/performance.md, "Long prompts")
        guard = ConsistencyGuard(self.get_name(), self.strict)
        with streamed_forward(self.model, self.adapter, run, on_layer, top_model=readout.top_model,
                              keep_calls=adj is not None, guard=guard, probabilities=adj is None) as (rec, model_out):
            prepared.finite = run.finite
            readout.read(rec, model_out)
            if adj is not None:  # every rerun checked against the recorded pass (docs/reliability.md, "Checked reruns")
                readout.adjoint(adj, self._rerun(rec, quad, vf, adj, guard))
        with torch.no_grad():
            res = None
            if prop is not None:
                res = prop.result()
                readout.forward(res)
            return readout.result(res, quad, n)

    def attribution_and_delta(self, inputs, target, additional_forward_args, foil: Any = None):
        r"""(signed token scores for the target class, delta (B,)): ``attribute``'s output.

        ``attribute(inputs, target=None, additional_forward_args=None,
        return_convergence_delta=False, foil=None)``: the scores of :meth:`decompose` for
        ``target`` ((B, T), a 1-tuple for tuple inputs, pads exactly 0; pixels for an image
        classifier) computed for that target only (one vector-Jacobian product per layer with the
        adjoint algorithm); delta (B,) = ``|sum of the token scores + bias score - real logit|``.
        """
        res = self._compute(inputs, target, additional_forward_args, layer_parts=False, target_only=True, foil=foil)
        return format_output(inputs, pixel_attributions(inputs, res)), res.delta

    @property
    def explains_next_tokens(self) -> bool:
        r"""True for a causal LM (its next-token logits; :meth:`explain_positions`), False for a classifier."""
        return self.decoder

    def explain_positions(
        self,
        input_ids: Tensor,
        positions: Tensor,
        target: Optional[Tensor] = None,
        quantity: str = "logit",
        foil: Any = None,
        additional_forward_args: Any = None,
    ) -> PositionExplanation:
        r"""Signed token scores of n next-token logits of one sequence of a causal LM, from one forward pass.

        The parts are propagated (``"forward"``) or the adjoint walks the layers (``"adjoint"``)
        once for every position together; row k equals the single-position call
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
            :class:`~captum_normattr.attr.positions.PositionExplanation` (signed; ``no_token`` is
            the bias score; ``extras["quadrature_error"]`` (n_layers,)).
        """
        ids, positions, target, quantity, foil = position_request(self.model, input_ids, positions, target, quantity,
                                                                  foil)
        if target is None:
            raise ValueError("DecompX explains a target token at every position: give target")
        if not self.decoder:
            raise ValueError("DecompositionLLMAttribution explains causal LMs; this DecompXAttribution wraps a classifier")
        # the adjoint differentiates the frozen layers, which autograd refuses on inference tensors
        with torch.inference_mode(False):
            prepared = prepare_inputs(self.model, self.adapter, _ordinary_tensors(ids).unsqueeze(0),
                                      additional_forward_args)
            dtype = compute_dtype(self.model)
            u, ub = explained_directions(self.output, target, quantity, foil, dtype, prepared.valid.device)
            readout = PositionsReadout(self, prepared, dtype, positions, u.unsqueeze(0), ub.unsqueeze(0))
            algorithm = self._algorithm(False)
            if self.algorithm == "auto" and algorithm == "adjoint":  # the cheaper one for n logits at T (docs/llm.md)
                algorithm = choose_decompx_algorithm(int(positions.numel()), int(prepared.shape[1]))
            got = self._run(prepared, readout, algorithm)
            log_probs = position_log_probs(self.output, got.pop("final_out"), target)
        scores = got.pop("scores")
        if warn_non_finite(prepared):
            scores = torch.full_like(scores, float("nan"))
        return PositionExplanation(
            method=self.get_name(), scores=scores, positions=positions, signed=True, target=target, foil=foil,
            quantity=quantity, explained=got["explained"], no_token=got["no_token"], delta=got["delta"],
            log_probs=log_probs, extras={"quadrature_error": got["quadrature_error"]},
        )

    def get_name(self) -> str:
        return {"separate": "DecompX", "spread": "DecompX (spread bias)"}.get(self.bias_mode, "DecompX (spread bias per key)")
