r"""DecompX's adjoint algorithm, streamed over the layers (``"separate"`` bias mode; docs/design.md, section 8).

With every nonlinear quantity frozen at its real value the network is affine in the
embedding output, F(X) = sum_k L_k e_k + c, and token k's DecompX score of class c is the
contribution L_k e_k = <dF_c/dx_k, e_k>. One vector-Jacobian product per explained output
gives every token's score; the bias score is the constant F(0) = c (= F(e) - sum_k scores).
Cost a few forward passes; it agrees with the forward algorithm (:mod:`.propagation`) to
rounding.

Streamed (:class:`AdjointPass`): the forward phase keeps each layer's input (B, T, D) as a
checkpoint, nothing else; the backward phase walks the layers top-down, recomputes each
layer's tensors from its checkpoint, pushes the cotangents through that one frozen layer
(:class:`FrozenLayer`, its kind's frozen layer) by its written-out transpose (its kind's
``frozen_layer_vjp``, built from :mod:`.frozen`) and adds <cotangent, c_l> of the layer's
constant c_l to c. The frozen layer is affine, so its transpose does not depend on any
point; no layer's attention probabilities outlive its own step. The outputs it explains
(a classifier's logits, a next-token logit) are in :mod:`.readout`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.primitives.gated_feed_forward import local_autograd
from captum_normattr.decompose.records import LayerTensors

__all__ = ["STACK_BYTES", "AdjointPass", "FrozenLayer", "FrozenStep", "frozen_layer"]


def frozen_layer(
    x: Tensor,
    layer: LayerTensors,
    value_weight: Tensor,
    value_bias: Optional[Tensor],
    with_bias: bool,
    coefs: Dict[str, Tensor],
    rows: Optional[Tensor] = None,
) -> Tensor:
    r"""One frozen layer, by its kind (``LayerKind.frozen_layer``: the post-LN, pre-LN, parallel or sandwich one).

    Args:
        x: (B, T, D) the layer input.
        layer: the layer's real tensors.
        value_weight, value_bias: W_V (D, H_kv Dh) and b_V.
        with_bias: add every bias (without: the linear part).
        coefs: the layer's :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients`
            (a post-LN layer uses its ``"slope"``).
        rows: (R,) output rows to produce (default all).

    Returns:
        (B, R, D).
    """
    return layer_kind(layer.topology).frozen_layer(x, layer, value_weight, value_bias, with_bias, coefs, rows)


def _is_zero(t: Optional[Tensor]) -> bool:
    return t is None or not bool(torch.any(t != 0))


class FrozenLayer:
    r"""One layer with its nonlinear quantities frozen at the real values: an affine map J x + c.

    Calling it applies the map with its biases (:func:`frozen_layer`, a :data:`FrozenStep`);
    :meth:`vjp` applies J^T (its kind's ``frozen_layer_vjp``, e.g.
    :func:`~captum_normattr.decompose.kinds.pre_ln.frozen_pre_ln_layer_vjp`)
    and :meth:`constant` gives c (None when the layer adds no bias at all, e.g. Llama).
    It holds the layer's tensors while it lives.

    Args:
        layer: the layer's real tensors.
        value_weight, value_bias: its W_V and b_V.
        coefs: its :func:`~captum_normattr.decompose.methods.decompx.parts.ff_coefficients`.
        valid: (B, T) bool, the real tokens (lets :meth:`vjp` skip a causal layer's zero triangle), or None.
    """

    def __init__(
        self,
        layer: LayerTensors,
        value_weight: Tensor,
        value_bias: Optional[Tensor],
        coefs: Dict[str, Tensor],
        valid: Optional[Tensor] = None,
    ) -> None:
        self.layer, self.value_weight, self.value_bias, self.coefs = layer, value_weight, value_bias, coefs
        self.valid = valid
        self.kind = layer_kind(layer.topology)

    def __call__(self, x: Tensor, rows: Optional[Tensor] = None) -> Tensor:
        return frozen_layer(x, self.layer, self.value_weight, self.value_bias, True, self.coefs, rows)

    def vjp(self, g: Tensor, rows: Optional[Tensor] = None) -> Tensor:
        r"""J^T g: (..., B, R, D) cotangent(s) at ``rows`` -> (..., B, T, D), a stack in one call."""
        return self.kind.frozen_layer_vjp(g, self.layer, self.value_weight, self.coefs, rows, self.valid)

    def own(self, rows: Optional[Tensor] = None) -> Optional[Tensor]:
        r"""(B, R, D) token-own vectors in the layer's output (its kind's ``frozen_layer_own``: a DeepStack
        addition, Gemma 4's per-layer-input branch), or None: row t's goes to token t's score."""
        return self.kind.frozen_layer_own(self.layer, rows)

    def value_source(self) -> Optional[int]:
        r"""The earlier layer whose input this layer's values read (shared keys and values), or None."""
        return self.kind.frozen_value_source(self.layer)

    def vjp_with_source(self, g: Tensor, source_input: Tensor, rows: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        r"""(J^T g, V^T g): the cotangents of the layer input and of the input x_s of :meth:`value_source`
        (its real value ``source_input``), (..., B, T, D) each."""
        return self.kind.frozen_layer_source_vjp(g, self.layer, self.coefs, source_input, rows)

    def has_constant(self) -> bool:
        r"""Whether c can be nonzero: some bias, beta or (elementwise FF) g(0) W_out is present."""
        layer, f = self.layer, self.layer.ff
        tensors = [self.value_bias, layer.out_bias, layer.ln1.bias, layer.ln2.bias, f.b_in, f.b_out, f.b_gate]
        if not all(_is_zero(t) for t in tensors):
            return True
        if f.w_gate is None:  # the frozen elementwise FF maps 0 to g(0) W_out
            return not _is_zero(f.act(torch.zeros((), dtype=self.value_weight.dtype, device=self.value_weight.device)))
        return False

    def constant(self, rows: Optional[Tensor] = None) -> Optional[Tensor]:
        r"""c = the frozen layer applied to 0, (B, R, D); None when :meth:`has_constant` is False."""
        if not self.has_constant():
            return None
        return self(torch.zeros_like(self.layer.hidden_in), rows)


#: Bytes of the widest stacked intermediate, n x (B, T, max(D, F)) with F the feed-forward width, that
#: :meth:`AdjointPass.backward` lets one call of a layer's transpose hold; more outputs go in chunks.
STACK_BYTES = 256 * 2**20


def _stack_chunks(stacks: List[Tensor], step: FrozenLayer) -> List[Tensor]:
    r"""Stacked cotangents (k, B, R, D) regrouped (as views where they fit) into chunks small enough
    for ``step`` (:data:`STACK_BYTES`, the layer's widest intermediate (B, T, max(D, F)) per output)."""
    if not stacks:
        return stacks
    b, t = step.layer.hidden_in.shape[:2]
    width = max(int(step.layer.hidden_in.shape[2]), int(step.layer.ff.w_out.shape[0]))
    size = max(1, STACK_BYTES // max(1, b * t * width * stacks[0].element_size()))
    if all(st.shape[0] <= size for st in stacks):
        return stacks
    return list((torch.cat(stacks) if len(stacks) > 1 else stacks[0]).split(size))


#: A frozen layer with its biases, as a function of its input: (x (B, T, D), rows or None) -> (B, R, D).
FrozenStep = Callable[[Tensor, Optional[Tensor]], Tensor]


class AdjointPass:
    r"""The adjoint algorithm streamed over the layers (``"separate"`` bias mode).

    Forward phase: :meth:`forward` once per layer, in order, as the forward pass produces
    it: it keeps the layer input (B, T, D) as the layer's checkpoint. Nothing else is
    computed there (the layer itself is not kept, except the frozen last layer if it is
    handed over: it is the first one the backward phase needs).

    Backward phase: :meth:`backward` walks l = L-1, ..., 0. ``frozen_at(l, checkpoint_l)``
    recomputes layer l's :class:`FrozenLayer` (the attribution reruns the real layer on its
    checkpoint: :meth:`~captum_normattr.models.capture.recorder.Recorder.rerun_layer`), and the
    cotangents are pushed through it by its written-out transpose (:meth:`FrozenLayer.vjp`);
    the layer's tensors (its attention probabilities) are released before the next layer is
    recomputed. The frozen network is affine, F(x) = J x + c, and its constant
    <u, c> = sum_l <g_(l+1), c_l> + (the output's own constant) is accumulated on the way
    (c_l the constant of layer l, g_(l+1) the cotangent of its output), so that F(e) is
    never formed: the bias score is that constant, and F(e) = scores + bias score.
    Each rerun can be checked against the layer's output in the recorded pass
    (:meth:`real_output`: the next checkpoint, or the kept last output), which is released
    only after the layer below has been walked.
    Two further terms (docs/decompx.md, "The adjoint with shared values and token-own additions"):
    a layer whose values are computed from an earlier layer s's input (keys and values shared across
    layers, :meth:`FrozenLayer.value_source`) gives a second cotangent, of x_s, kept until the walk
    reaches layer s and added to the cotangent of x_s there; token-own vectors in a layer's output
    (:meth:`FrozenLayer.own`: a DeepStack addition, Gemma 4's per-layer-input branch) add
    <g_(l+1),t, own_t> to token t's score (:attr:`own_scores`, :meth:`token_scores`), not to the constant.
    Memory: L + 1 checkpoints (B, T, D) plus one layer's tensors (and one (B, T, D) cotangent per output
    for each layer whose values are still to be reached).

    Args:
        num_layers: L.
        last_rows: (R,) long rows of the last layer that the explained output reads.
    """

    def __init__(self, num_layers: int, last_rows: Tensor) -> None:
        self.num_layers = num_layers
        self.last_rows = last_rows
        self.checkpoints: List[Optional[Tensor]] = []
        self.last_step: Optional[FrozenLayer] = None
        #: (B, T, D) the last layer's output in the recorded pass (what its rerun is checked against), or None
        self.last_output: Optional[Tensor] = None
        #: After :meth:`backward`: per explained output, its constant (B,) (the bias score).
        self.constants: List[Tensor] = []
        #: After :meth:`backward`: per explained output, the token-own terms of the scores (B, T)
        #: (sum over the layers of <g_(l+1),t, own_l,t>, :meth:`FrozenLayer.own`), or None where no layer has any.
        self.own_scores: Optional[List[Tensor]] = None

    def token_scores(self, cots: Sequence[Tensor]) -> List[Tensor]:
        r"""Every token's score per explained output, (B, T) each: <g_t, e_t> plus its token-own terms.

        Args:
            cots: :meth:`backward`'s gradients, (B, T, D) each.
        """
        e = self.embeddings
        scores = [(g * e).sum(-1) for g in cots]
        if self.own_scores is not None:
            scores = [s + o for s, o in zip(scores, self.own_scores)]
        return scores

    def _add_own(self, stacks: List[Tensor], own: Tensor, rows: Optional[Tensor]) -> None:
        r"""Add <g_t, own_t> of the cotangents ``stacks`` (k, B, R, D) to :attr:`own_scores` at ``rows``."""
        gs = [g for st in stacks for g in st.unbind(0)]
        b, t = self.checkpoints[0].shape[:2]
        if self.own_scores is None:
            self.own_scores = [own.new_zeros(b, t) for _ in gs]
        for acc, g in zip(self.own_scores, gs):
            got = (g * own).sum(-1)
            if rows is None:
                acc.add_(got)
            else:
                acc.index_add_(1, rows.to(acc.device), got)

    @property
    def embeddings(self) -> Tensor:
        r"""(B, T, D) e, the input of the first layer."""
        return self.checkpoints[0]

    def forward(self, layer_input: Tensor, last_step: Optional[FrozenLayer] = None,
                layer_output: Optional[Tensor] = None) -> None:
        r"""Checkpoint the next layer's input.

        Args:
            layer_input: (B, T, D) its real input.
            last_step: the last layer only: its :class:`FrozenLayer`, kept for the backward
                phase instead of being recomputed (ignored for the other layers).
            layer_output: the last layer only: its real output (B, T, D), kept so that its
                rerun can be checked (:meth:`real_output`; ignored for the other layers, whose
                output is the next checkpoint).
        """
        l = len(self.checkpoints)
        if l >= self.num_layers:
            raise RuntimeError(f"all {self.num_layers} layers have been seen already")
        self.checkpoints.append(layer_input.detach())
        if l == self.num_layers - 1:
            self.last_step = last_step
            self.last_output = None if layer_output is None else layer_output.detach()

    def real_output(self, l: int) -> Optional[Tensor]:
        r"""Layer l's output in the recorded pass, (B, T, D): the next layer's checkpoint (the last
        layer's kept output), while the backward phase is at layer l or above; None if not kept."""
        if l == self.num_layers - 1:
            return self.last_output
        return self.checkpoints[l + 1] if 0 <= l + 1 < len(self.checkpoints) else None

    def backward(
        self, frozen_at: Callable[[int, Tensor], FrozenLayer], outputs: Callable[[Tensor], Sequence[Tensor]]
    ) -> List[Tensor]:
        r"""The gradients of the explained outputs with respect to e, one layer at a time.

        Args:
            frozen_at: ``(l, checkpoint_l) -> FrozenLayer`` of layer l.
            outputs: maps the frozen last-layer output at ``last_rows`` (B, R, D) to the
                explained outputs, (B,) each (e.g. one class logit per example); affine in its input.

        Returns:
            One (B, T, D) gradient per output; :attr:`constants` holds each output's constant (B,).
        """
        n = self.num_layers
        if len(self.checkpoints) != n:
            raise RuntimeError(f"the forward phase saw {len(self.checkpoints)} of {n} layers")
        x_last = self.checkpoints[-1]
        with local_autograd():  # the explained outputs are affine: gradient and value at 0
            y = x_last.new_zeros(x_last.shape[0], self.last_rows.shape[0], x_last.shape[2]).requires_grad_(True)
            roots = list(outputs(y))
            last = len(roots) - 1
            cots = [torch.autograd.grad(r.sum(), y, retain_graph=j < last)[0].detach() for j, r in enumerate(roots)]
            consts = [r.detach().clone() for r in roots]
            del roots, y
        # all the cotangents go through each layer in one call (J^T is linear in them), stacked
        # (k, B, R, D) in chunks (STACK_BYTES)
        stacks = [torch.stack(cots)] if cots else []
        del cots
        self.own_scores = None
        pending: Dict[int, Tensor] = {}  # layer s -> cotangents (k, B, T, D) of its input from layers reusing its values
        for l in range(n - 1, -1, -1):
            rows = self.last_rows if l == n - 1 else None
            step = self.last_step if (l == n - 1 and self.last_step is not None) else frozen_at(l, self.checkpoints[l])
            self.last_step = None
            c = step.constant(rows)
            if c is not None:
                gs = [g for st in stacks for g in st.unbind(0)]
                consts = [k + (g * c).sum((1, 2)) for k, g in zip(consts, gs)]
                del gs
            del c
            own = step.own(rows)
            if own is not None and stacks:
                self._add_own(stacks, own, rows)
            del own
            source = step.value_source()
            if source is None:
                stacks = [step.vjp(st, rows) for st in _stack_chunks(stacks, step)]
            else:  # the layer also reads layer source's input (its values): that cotangent waits for layer source
                pairs = [step.vjp_with_source(st, self.checkpoints[source], rows) for st in _stack_chunks(stacks, step)]
                stacks = [p[0] for p in pairs]
                g_s = torch.cat([p[1] for p in pairs]) if pairs else None
                del pairs
                if g_s is not None:
                    pending[source] = g_s if source not in pending else pending[source] + g_s
            del step  # the layer's tensors go here
            if l in pending and stacks:  # the cotangent of x_l from the later layers that reuse its values
                stacks = [torch.cat(stacks) + pending.pop(l)]
            if l + 1 < n:  # layer l + 1's input: the output layer l's rerun was checked against (real_output)
                self.checkpoints[l + 1] = None
            else:
                self.last_output = None
        cots = [g for st in stacks for g in st.unbind(0)]
        self.constants = consts
        return cots

