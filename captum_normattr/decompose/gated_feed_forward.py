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
falls quickly with n for smooth g (SiLU, GELU). Part of token j: IG_j W_down; bias part:
IG_bias W_down + b_down.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

#: Default number of Gauss-Legendre nodes: |a I1 + I2 - g(a)| < 1e-12 for SiLU gate values |a| <= 60 in float64.
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
    r"""I1 = int_0^1 g'(t a) t dt and I2 = int_0^1 g(t a) dt per element, by Gauss-Legendre.

    Args:
        a: (...) gate pre-activations (the real totals, bias included).
        act: the elementwise activation g (differentiable almost everywhere).
        nodes: quadrature nodes.

    Returns:
        (I1, I2), each shaped like ``a``.
    """
    ts, ws = gauss_legendre_unit(nodes, a.dtype, a.device)
    i1 = torch.zeros_like(a)
    i2 = torch.zeros_like(a)
    ones = None
    # Nodes and weights as Python numbers (the values of ``a``'s dtype), sums accumulated in
    # place with a scalar factor: 3 passes over ``a`` per node fewer than tensor-scalar
    # products and fresh sums (docs/performance.md, "Round 2: FF throughput and DecompX profile").
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
        act: the gate activation g (SiLU for Llama, Mistral, Qwen2).
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
