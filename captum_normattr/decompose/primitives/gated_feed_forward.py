r"""Gated feed-forward decomposition (SwiGLU, Llama family) by Gauss-Legendre quadrature (docs/design.md, section 6).

FF(u) = (g(u W_gate + b_gate) * (u W_up + b_up)) W_down + b_down. Given input parts
u = sum_j u_j + u_bias, the pre-activations split into parts a = sum_j a_j + a_bias
(a_j = u_j W_gate, a_bias = u_bias W_gate + b_gate) and b = sum_j b_j + b_bias alike.
Integrated gradients of phi(a, b) = g(a) * b (per neuron) along the straight path
t * (a, b), t in [0, 1], from the zero baseline (phi(0, 0) = 0) gives

    IG_j = a_j * b * I1(a) + b_j * I2(a),   I1(a) = int_0^1 g'(t a) t dt,   I2(a) = int_0^1 g(t a) dt,

one-dimensional integrals per neuron. Their sum over j (bias part included) is
b * (a I1 + I2) = b * int_0^1 d/dt [t g(t a)] dt = b g(a): completeness holds exactly for the
exact integrals. Both integrals are evaluated by an n-node Gauss-Legendre rule on [0, 1]
(g' by autograd); the completeness error that remains is the quadrature error, which
falls quickly with n for smooth g (SiLU, GELU). For the SiLU gate with n >= 48 (the
default) the integrals are taken in closed form instead (:func:`silu_gate_integrals`, exact
to rounding; the 48-node rule agrees with it to 1e-14 for |a| <= 60 in float64), several
times faster. Part of token j: IG_j W_down; bias part: IG_bias W_down + b_down.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from fractions import Fraction
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ClampedSwiGLUGate",
    "DEFAULT_NODES",
    "ReLUGate",
    "SILU_CHUNK",
    "gate_integrals",
    "gated_ff_parts",
    "gated_ff_parts_from_preactivations",
    "gauss_legendre_unit",
    "is_silu",
    "local_autograd",
    "quadrature_error",
    "quadrature_gate_integrals",
    "silu_gate_integrals",
    "clamped_swiglu_gate_integrals",
    "relu_gate_integrals",
]

#: Default number of Gauss-Legendre nodes: |a I1 + I2 - g(a)| < 1e-12 for SiLU gate values |a| <= 60 in float64.
#: From this many nodes on, a SiLU gate's integrals are taken in closed form (:func:`silu_gate_integrals`).
DEFAULT_NODES = 48


@contextmanager
def local_autograd() -> Iterator[None]:
    r"""Gradients on, also under ``torch.inference_mode()``, for the package's local autograd steps.

    Inside the block, tensors made from inference tensors are ordinary tensors, so a leaf
    built there (``(t * a).detach().requires_grad_(True)``) can be differentiated; the
    gradients that come out are ordinary tensors too.
    """
    with torch.inference_mode(False), torch.enable_grad():
        yield


def gauss_legendre_unit(nodes: int, dtype: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor]:
    r"""Gauss-Legendre nodes and weights on [0, 1] (weights sum to 1).

    Args:
        nodes: number of nodes n >= 1 (exact for polynomials of degree 2n - 1).
        dtype, device: of the result.

    Returns:
        (t (n,), w (n,)).
    """
    if int(nodes) < 1:
        raise ValueError(f"the number of quadrature nodes must be >= 1, got {nodes}")
    x, w = np.polynomial.legendre.leggauss(int(nodes))
    t = torch.as_tensor((x + 1.0) / 2.0, dtype=dtype, device=device)
    return t, torch.as_tensor(w / 2.0, dtype=dtype, device=device)


def gate_integrals(a: Tensor, act: Callable, nodes: int = DEFAULT_NODES) -> Tuple[Tensor, Tensor]:
    r"""I1 = int_0^1 g'(t a) t dt and I2 = int_0^1 g(t a) dt per element.

    By the n-node Gauss-Legendre rule, except for a SiLU gate with ``nodes >= DEFAULT_NODES``,
    whose integrals are exact in closed form (:func:`silu_gate_integrals`): the 48-node rule
    and the closed form agree to 1e-14 for |a| <= 60 and to 2e-12 for |a| <= 95 in float64
    (further out the rule's own error grows; more nodes only bring it closer to the closed form).

    Args:
        a: (...) gate pre-activations (the real totals, bias included).
        act: the elementwise activation g (differentiable almost everywhere).
        nodes: quadrature nodes.

    Returns:
        (I1, I2), each shaped like ``a``.
    """
    if int(nodes) >= DEFAULT_NODES and is_silu(act):
        return silu_gate_integrals(a)
    if int(nodes) >= DEFAULT_NODES and isinstance(act, ClampedSwiGLUGate):
        return clamped_swiglu_gate_integrals(a, act.limit, act.alpha)
    if isinstance(act, ReLUGate):  # exact for any number of nodes (the rule is exact on its polynomials too)
        return relu_gate_integrals(a)
    return quadrature_gate_integrals(a, act, nodes)


class ClampedSwiGLUGate(torch.nn.Module):
    r"""GPT-OSS's expert gate g(a) = c sigmoid(alpha c), c = min(a, L) (the clamped, scaled SiLU).

    With the up half's own clamp and offset handled outside the gate (``models.experts``), an
    expert neuron is g(a) * b in the form every gated-FF decomposition takes. Its integrals along
    the straight path have a closed form (:func:`clamped_swiglu_gate_integrals`): the kink at L
    costs no quadrature error.

    Args:
        limit: L (``swiglu_limit``).
        alpha: the sigmoid's slope (``swiglu_alpha``).

    Examples::

        >>> g = ClampedSwiGLUGate(7.0, 1.702)
        >>> float(g(torch.tensor(9.0, dtype=torch.float64))) == float(g(torch.tensor(7.0, dtype=torch.float64)))
        True
    """

    def __init__(self, limit: float, alpha: float) -> None:
        super().__init__()
        self.limit, self.alpha = float(limit), float(alpha)

    def forward(self, a: Tensor) -> Tensor:
        c = a.clamp(max=self.limit)
        return c * torch.sigmoid(c * self.alpha)

    def extra_repr(self) -> str:
        return f"limit={self.limit}, alpha={self.alpha}"


class ReLUGate(torch.nn.Module):
    r"""The ReLU as the gate of a ReLU² neuron written gated: relu(a)^2 = relu(a) * a.

    A non-gated ReLU² expert (Nemotron-H's) is the gated form g(a) * b with W_gate = W_up (a = b) and
    g = ReLU: integrated gradients along t (a, b) = t (a, a) is the straight path of the elementwise
    ReLU², so the parts are the elementwise closed form's, a_j relu(a) (:func:`relu_gate_integrals`).
    """

    def forward(self, a: Tensor) -> Tensor:
        return torch.relu(a)


def relu_gate_integrals(a: Tensor) -> Tuple[Tensor, Tensor]:
    r"""The exact gate integrals of :class:`ReLUGate`: I1 = [a > 0] / 2, I2 = relu(a) / 2 (a I1 + I2 = relu(a))."""
    return (a > 0).to(a.dtype) * 0.5, torch.relu(a) * 0.5


def clamped_swiglu_gate_integrals(a: Tensor, limit: float, alpha: float) -> Tuple[Tensor, Tensor]:
    r"""The exact gate integrals I1, I2 (:func:`gate_integrals`) of :class:`ClampedSwiGLUGate`.

    Below the limit g(x) = silu(alpha x) / alpha, so I1(a) = I1_silu(alpha a) and
    I2(a) = I2_silu(alpha a) / alpha. Above it (a > L) the path t a crosses the kink at
    t0 = L / a, after which g is the constant g(L) and g' = 0:
    I1 = t0^2 I1_silu(alpha L), I2 = t0 I2_silu(alpha L) / alpha + (1 - t0) g(L).
    Either way a I1 + I2 = g(a) (completeness), the SiLU's closed form to rounding.

    Args:
        a: (...) gate pre-activations.
        limit, alpha: the gate's L and alpha.

    Returns:
        (I1, I2), each shaped like ``a``.
    """
    above = a > limit
    c = a.clamp(max=limit)
    i1, i2 = silu_gate_integrals(c * alpha)
    i2 = i2 / alpha
    if bool(above.any()):
        t0 = torch.where(above, limit / a.clamp(min=limit), torch.ones_like(a))
        g_limit = limit * torch.sigmoid(torch.tensor(limit * alpha, dtype=a.dtype, device=a.device))
        i1 = torch.where(above, t0 * t0 * i1, i1)
        i2 = torch.where(above, t0 * i2 + (1 - t0) * g_limit, i2)
    return i1, i2


def quadrature_gate_integrals(a: Tensor, act: Callable, nodes: int = DEFAULT_NODES) -> Tuple[Tensor, Tensor]:
    r"""I1 and I2 (see :func:`gate_integrals`) by the ``nodes``-node Gauss-Legendre rule, g' by autograd."""
    ts, ws = gauss_legendre_unit(nodes, a.dtype, a.device)
    i1 = torch.zeros_like(a)
    i2 = torch.zeros_like(a)
    ones = None
    # Nodes and weights as Python numbers (the values of ``a``'s dtype), sums accumulated in
    # place with a scalar factor: 3 passes over ``a`` per node fewer than tensor-scalar
    # products and fresh sums (docs/performance.md, "FF throughput and DecompX profile").
    for t, w in zip(ts.tolist(), ws.tolist()):
        with local_autograd():
            x = (a * t).detach().requires_grad_(True)
            y = act(x)
            if ones is None:
                ones = torch.ones_like(y)
            (grad,) = torch.autograd.grad(y, x, grad_outputs=ones)
        i1.add_(grad, alpha=w * t)
        i2.add_(y.detach(), alpha=w)
    return i1, i2


def is_silu(act: Callable) -> bool:
    r"""Whether ``act`` is the SiLU (``torch.nn.functional.silu``, ``nn.SiLU``, transformers' ``SiLUActivation``).

    Recognised by type, then confirmed on a few probe values (a module whose forward was
    replaced by something else is not taken for a SiLU).
    """
    known = act is torch.nn.functional.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    if not known:
        return False
    probe = torch.linspace(-8.0, 8.0, 17, dtype=torch.float64)
    try:
        out = act(probe)
    except Exception:  # e.g. a kernel that only takes another dtype or device
        return False
    return torch.is_tensor(out) and out.shape == probe.shape and bool(
        torch.allclose(out.to(torch.float64), torch.nn.functional.silu(probe), rtol=1e-12, atol=0)
    )


def _bernoulli(n: int) -> List[Fraction]:
    r"""Bernoulli numbers B_0..B_n (B_1 = -1/2), exactly."""
    b = [Fraction(1)]
    for m in range(1, n + 1):
        b.append(-sum(math.comb(m + 1, k) * b[k] for k in range(m)) / Fraction(m + 1))
    return b


_B = _bernoulli(40)
#: H(x) = int_0^x u tanh(u) du = sum_n c_n x^(2n+1), c_n = 4^n (4^n - 1) B_2n / ((2n)! (2n + 1)), n >= 1.
_TANH_MOMENT = [
    float(Fraction(4**n * (4**n - 1)) * _B[2 * n] / (math.factorial(2 * n) * (2 * n + 1))) for n in range(1, 20)
]
#: Li2(z) = w - w^2/4 + sum_k B_2k w^(2k+1) / (2k+1)!, w = -log(1 - z), k >= 1.
_LI2 = [float(_B[2 * k] / math.factorial(2 * k + 1)) for k in range(1, 12)]
#: Elements per piece of :func:`silu_gate_integrals`: bounds its dozen temporaries (not faster in smaller pieces).
SILU_CHUNK = 2**19
#: Terms used per dtype: (Taylor terms for |a| < 1, Li2 terms for |a| >= 1); both truncation errors < eps / 10.
_TERMS: Dict[torch.dtype, Tuple[int, int]] = {torch.float64: (18, 7), torch.float32: (9, 4)}


def _horner(x: Tensor, coefs: List[float]) -> Tensor:
    r"""sum_k coefs[k] x^k (a new tensor)."""
    p = x * coefs[-1]
    p.add_(coefs[-2])
    for c in reversed(coefs[:-2]):
        p.mul_(x).add_(c)
    return p


def silu_gate_integrals(a: Tensor) -> Tuple[Tensor, Tensor]:
    r"""The exact gate integrals of the SiLU g(s) = s sigmoid(s), in closed form.

    With S(a) = int_0^a g(s) ds, I2 = S(a) / a and, by parts, I1 = (g(a) - I2) / a
    = sigmoid(a) - S(a) / a^2 (docs/design.md, section 6). Two evaluations of S, each
    without cancellation in its range:

    - |a| >= 1: S = relu(a) a / 2 - K sign(a), K = pi^2/12 - |a| log(1 + q) + Li2(-q),
      q = exp(-|a|) <= 1/e (int_0^x u tanh(u) du in terms of the dilogarithm), so
      I2 = relu(a) / 2 - K / |a| and I1 = sigmoid(a) - [a > 0] / 2 + sign(a) K / a^2; Li2 by
      its Bernoulli series in w = -log(1 + q) (|w| <= 0.32: each term 400 times smaller than
      the one before);
    - |a| < 1: s sigmoid(s) = s/2 + (s/2) tanh(s/2) gives S = a^2/4 + a y P(y), y = a^2/4,
      P(y) = sum_n c_n y^(n-1) from the Taylor series of int_0^x u tanh(u) du (each term at
      most a tenth of the one before), so I2 = a/4 + y P(y) and I1 = sigmoid(a) - 1/4 - (a/4) P(y).

    Both give a I1 + I2 = g(a) up to rounding (completeness holds exactly), and agree with a
    40-digit reference to about 2e-16 in float64 (``tests/test_decompx_speed.py``).

    Args:
        a: (...) gate pre-activations, float32 or float64 (other dtypes are computed in
            float32 and cast back).

    Returns:
        (I1, I2), each shaped like ``a``.

    Examples::

        >>> a = torch.tensor([-3.0, 0.0, 2.0], dtype=torch.float64)
        >>> i1, i2 = silu_gate_integrals(a)
        >>> torch.allclose(a * i1 + i2, torch.nn.functional.silu(a), rtol=0, atol=1e-15)
        True
    """
    if a.dtype not in _TERMS:
        i1, i2 = silu_gate_integrals(a.float())
        return i1.to(a.dtype), i2.to(a.dtype)
    if a.numel() > SILU_CHUNK:  # about 40 elementwise passes: in pieces whose temporaries stay in cache
        flat = a.reshape(-1)
        i1, i2 = torch.empty_like(flat), torch.empty_like(flat)
        for start in range(0, flat.numel(), SILU_CHUNK):
            piece = slice(start, start + SILU_CHUNK)
            i1[piece], i2[piece] = _silu_gate_integrals(flat[piece])
        return i1.view(a.shape), i2.view(a.shape)
    return _silu_gate_integrals(a)


def _silu_gate_integrals(a: Tensor) -> Tuple[Tensor, Tensor]:
    r""":func:`silu_gate_integrals` of one piece (float32 or float64)."""
    n_taylor, n_li2 = _TERMS[a.dtype]
    m = a.abs()
    small = m < 1.0
    sig = torch.sigmoid(a)
    # |a| < 1 (y clamped so that the other elements stay finite)
    y = (a * a).mul_(0.25).clamp_(max=0.25)
    p = _horner(y, _TANH_MOMENT[:n_taylor])
    i2_small = torch.addcmul(a * 0.25, y, p)
    i1_small = torch.addcmul(sig - 0.25, a, p, value=-0.25)
    del y, p
    # |a| >= 1 (|a| clamped so that the other elements stay finite)
    mc = m.clamp_(min=1.0)
    lq = torch.neg(mc).exp_().log1p_()  # log(1 + q) = -w
    w2 = lq * lq
    li2 = _horner(w2, _LI2[:n_li2]).mul_(lq).add_(0.25).mul_(lq).add_(1.0).mul_(lq).neg_()  # Li2(-q)
    k = li2.addcmul_(mc, lq, value=-1.0).add_(math.pi**2 / 12)  # K
    del lq, w2
    k_over = k.div_(mc)  # K / |a|
    i2_big = torch.relu(a).mul_(0.5).sub_(k_over)
    i1_big = torch.addcmul(sig, torch.sign(a), k_over.div_(mc)).sub_((a > 0).to(a.dtype), alpha=0.5)
    return torch.where(small, i1_small, i1_big), torch.where(small, i2_small, i2_big)


def gated_ff_parts(
    input_parts: Tensor,
    input_bias: Tensor,
    w_gate: Tensor,
    b_gate: Optional[Tensor],
    w_up: Tensor,
    b_up: Optional[Tensor],
    act: Callable,
    w_down: Tensor,
    b_down: Optional[Tensor],
    nodes: int = DEFAULT_NODES,
) -> Tuple[Tensor, Tensor]:
    r"""Parts of a gated FF output from parts of its input.

    Args:
        input_parts: (B, R, P, D) parts u_j.
        input_bias: (B, R, D) bias part u_bias.
        w_gate, b_gate: (D, F), (F,) or None.
        w_up, b_up: (D, F), (F,) or None.
        act: the gate activation g (SiLU for the Llama-like families, tanh-GELU for Gemma).
        w_down, b_down: (F, D), (D,) or None.
        nodes: Gauss-Legendre nodes.

    Returns:
        (parts (B, R, P, D), bias part (B, R, D)); they sum to FF(u) up to the quadrature error.

    Examples::

        >>> parts, bias = gated_ff_parts(u_parts, u_bias, wg, None, wu, None, torch.nn.functional.silu, wd, None)
    """
    a_parts = input_parts @ w_gate
    b_parts = input_parts @ w_up
    a_bias = input_bias @ w_gate
    b_bias = input_bias @ w_up
    if b_gate is not None:
        a_bias = a_bias + b_gate
    if b_up is not None:
        b_bias = b_bias + b_up
    return gated_ff_parts_from_preactivations(a_parts, a_bias, b_parts, b_bias, act, w_down, b_down, nodes)


def gated_ff_parts_from_preactivations(
    a_parts: Tensor,
    a_bias: Tensor,
    b_parts: Tensor,
    b_bias: Tensor,
    act: Callable,
    w_down: Tensor,
    b_down: Optional[Tensor],
    nodes: int = DEFAULT_NODES,
) -> Tuple[Tensor, Tensor]:
    r"""Gated FF parts from the parts of the gate and up pre-activations.

    Args:
        a_parts, b_parts: (B, R, P, F) gate and up pre-activation parts (overwritten: pass
            tensors you do not need afterwards).
        a_bias, b_bias: (B, R, F) their bias parts (b_gate, b_up included).
        act, w_down, b_down, nodes: as in :func:`gated_ff_parts`.

    Returns:
        (parts (B, R, P, D), bias part (B, R, D)).
    """
    a = a_parts.sum(-2) + a_bias
    b = b_parts.sum(-2) + b_bias
    i1, i2 = gate_integrals(a, act, nodes)
    ig = a_parts.mul_((b * i1).unsqueeze(-2)).add_(b_parts.mul_(i2.unsqueeze(-2)))
    del b_parts
    parts = ig @ w_down
    bias = (a_bias * b * i1 + b_bias * i2) @ w_down
    if b_down is not None:
        bias = bias + b_down
    return parts, bias


def quadrature_error(a: Tensor, b: Tensor, act: Callable, nodes: int = DEFAULT_NODES) -> Tensor:
    r"""Largest |b (a I1 + I2) - b g(a)|: the completeness error of the quadrature alone, in neuron space."""
    i1, i2 = gate_integrals(a, act, nodes)
    return (b * (a * i1 + i2) - b * act(a)).abs().max()
