r"""The single-branch layer kind (Nemotron-H): y = x + B(N(x)), ONE branch per layer.

Each layer of such a model is one branch behind its own norm N, the branch chosen by the layer's
type (:attr:`~captum_normattr.arch.spec.Layer.single_branches`): a mixing branch (softmax attention,
a Mamba-2 mixer, any mixer the capture records as attention) or a feed-forward (a plain FF, a
mixture of experts). Such a layer is exactly the pre-LN layer whose other branch is identically 0:

- a mixing layer: h = x + Attn(N(x)), y = h + 0: the pre-LN layer with N1 = N and no feed-forward
  (its second norm the identity on h = y, its FF a zero map: FF ≡ 0);
- a feed-forward layer: h = x + 0, y = h + FF(N(h)): the pre-LN layer with no attention (its
  first norm the identity, one head of size 1 whose probabilities, values and W_O are 0) and N2 = N.

The capture records the layer's one branch and completes the record with the absent one
(:func:`complete_record`; the weights by :func:`absent_attention_out`, :func:`absent_feed_forward`,
:func:`absent_value_projection`, :func:`absent_norm`), so every pre-LN formula
(:mod:`~captum_normattr.decompose.kinds.pre_ln`) holds with the identity residual: the absent
branch's token parts and bias part are exactly 0, and :class:`SingleBranchKind` is the pre-LN kind
under its own name. What the methods then say of each layer:

- GlobEnc and ALTI (attention-block maps): a mixing layer's map is its mixer's with the residual;
  a feed-forward layer's is the identity (h = x), as for every FF these methods leave out;
- the FF decomposition: its whole-layer scope ``RES2`` is the mixer block (mixing layer) or
  x + FF parts (feed-forward layer); its ``FF`` scope is 0 on a mixing layer, which has no FF;
- DecompX, ALTI-Logit, the routes and the LLM API: exact, the absent branch adding nothing.

The residual joins stay checked: a mixing layer's output against x + the mixer output rebuilt
from its weights (the pre-LN attention join, its second-norm input being the layer output), a
feed-forward layer's against x + the FF output (``docs/frontier.md``, "Single-branch layers").
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from captum_normattr.decompose.kinds.pre_ln import PRE_LN_CAPTURE, PreLNKind
from captum_normattr.decompose.records import FFParams, NormParams

__all__ = [
    "SINGLE_BRANCH_CAPTURE",
    "SingleBranchKind",
    "absent_attention_out",
    "absent_feed_forward",
    "absent_norm",
    "absent_value_projection",
    "complete_record",
]


def absent_norm() -> NormParams:
    r"""The norm of the absent branch: the identity (no centering, scale 1, no parameters)."""
    return NormParams(weight=None, bias=None, eps=0.0, kind="identity")


def absent_attention_out(width: int, dtype: torch.dtype, device: Optional[torch.device] = None) -> Tensor:
    r"""W_O (1, D) of the absent attention: zeros (one head of size 1)."""
    return torch.zeros(1, width, dtype=dtype, device=device)


def absent_value_projection(width: int, dtype: torch.dtype, device: Optional[torch.device] = None) -> Tensor:
    r"""W_V (D, 1) of the absent attention: zeros (one head of size 1)."""
    return torch.zeros(width, 1, dtype=dtype, device=device)


def absent_feed_forward(width: int, dtype: torch.dtype, device: Optional[torch.device] = None) -> FFParams:
    r"""The absent feed-forward: FF(u) = relu(u 0) 0 = 0, one hidden neuron, no biases (g(0) = 0: no bias part)."""
    return FFParams(torch.zeros(width, 1, dtype=dtype, device=device), None,
                    torch.zeros(1, width, dtype=dtype, device=device), None, torch.relu)


def complete_record(rec: Dict[str, Tensor], branch: str, with_probabilities: bool = True) -> None:
    r"""Complete a single-branch layer's raw record (in place) with its absent branch, as a pre-LN record.

    Args:
        rec: the recorded tensors of the layer (``hidden_in``, ``layer_out`` and its branch's: the
            mixer's ``probs``, ``values``, ``context``, ``ln1_in``, ``ln1_out``; or the feed-forward's
            ``ln2_in``, ``ln2_out``, ``ff_out``).
        branch: the layer's one branch, ``"self_attention"`` or ``"feed_forward"``.
        with_probabilities: add the absent attention's (zero) probabilities (False where the pass
            records none).

    Filled: for a mixing layer, the second norm's input and output (the identity on h = y: the
    layer output) and the FF output 0; for a feed-forward layer, the first norm's input and output
    (the identity on x) and one attention head of size 1 with zero probabilities, values and context.
    """
    if branch == "self_attention":
        out = rec["layer_out"]
        rec["ln2_in"] = rec["ln2_out"] = out
        rec["ff_out"] = torch.zeros_like(out)
        return
    if branch != "feed_forward":
        raise ValueError(f"a single-branch layer's branch is 'self_attention' or 'feed_forward', got {branch!r}")
    x = rec["hidden_in"]
    b, t = x.shape[:2]
    rec["ln1_in"] = rec["ln1_out"] = x
    if with_probabilities:
        rec["probs"] = x.new_zeros(b, 1, t, t)
    rec["values"] = x.new_zeros(b, 1, t, 1)
    rec["context"] = x.new_zeros(b, t, 1, 1)


#: What the capture records of a single-branch layer: the pre-LN keys (the absent branch's completed by
#: :func:`complete_record`), the attention joined at the second norm's input (a mixing layer's output).
SINGLE_BRANCH_CAPTURE = PRE_LN_CAPTURE


class SingleBranchKind(PreLNKind):
    r"""Single-branch layers (Nemotron-H): the pre-LN kind on records whose absent branch is 0 (see the module)."""

    name = "single_branch"
    capture = SINGLE_BRANCH_CAPTURE
