r"""The consistency guard: the model's real tensors against what a decomposition assumes.

Every recorded layer carries checks (relative differences between the model's real tensors
and the tensors the decomposition rebuilds, filled by the capture); the map methods add their
attention block's completeness error. :class:`ConsistencyGuard` judges them for one call with
the tolerance of the dtype the model computed in, and warns once (:class:`ConsistencyWarning`)
or raises at the first failing layer (:class:`ConsistencyError`, ``strict=True``). A *gross*
disagreement (a relative difference above :data:`GROSS_RELATIVE`, far above every rounding floor
measured: at most ~1e-4 in bfloat16, ~1e-6 in float32) raises by default too: a wrong
architecture description or a hook that changes the computation cannot return numbers with only
a warning.
``docs/reliability.md``, "Consistency guards".
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch
from torch import Tensor

from captum_normattr.decompose.kinds.registry import layer_kind
from captum_normattr.decompose.primitives.guards import guard_tolerance, relative_difference
from captum_normattr.decompose.records import LayerTensors

__all__ = ["ConsistencyError", "ConsistencyGuard", "ConsistencyWarning", "GROSS_RELATIVE", "RERUN_CHECK"]

#: Relative differences above this raise :class:`ConsistencyError` even when not ``strict``.
GROSS_RELATIVE = 1e-2


#: The name of the check of a rerun layer (:meth:`ConsistencyGuard.check_rerun`) in the guard's messages.
RERUN_CHECK = "rerun layer output vs the recorded forward pass's output"


class ConsistencyWarning(RuntimeWarning):
    r"""The model's real tensors disagree with what the decomposition assumes (see :class:`ConsistencyGuard`)."""


class ConsistencyError(RuntimeError):
    r"""Raised instead of :class:`ConsistencyWarning` by ``strict=True`` attributions."""


class ConsistencyGuard:
    r"""Judges the consistency checks of every layer of one call: warns once, or raises when strict.

    Each layer's :attr:`~captum_normattr.decompose.records.LayerTensors.checks` (relative
    differences between the model's real tensors and the assumed ones, filled by the capture)
    and, for the methods without a delta (GlobEnc, ALTI), the attention block's completeness
    error relative to the scale of the tensor it is measured on, are compared with
    :func:`~captum_normattr.decompose.primitives.guards.guard_tolerance` of the dtype the model computed
    in. ``docs/reliability.md``, "Consistency guards".

    Args:
        method: the method's name, for the message.
        strict: raise :class:`ConsistencyError` at the first layer that fails a check,
            instead of one :class:`ConsistencyWarning` per call after the forward pass. Without
            it, a difference above :data:`GROSS_RELATIVE` still raises.
    """

    def __init__(self, method: str, strict: bool = False):
        self.method = method
        self.strict = bool(strict)
        self.failures: List[str] = []
        self.tolerance = 0.0

    def check(self, layer: LayerTensors, completeness: Optional[Tensor] = None, real: Optional[Tensor] = None) -> None:
        r"""Judge one layer's checks; ``completeness``: its absolute completeness error (0-dim), or None;
        ``real``: the real tensor it is measured on (the layer kind's ``attention_block_output``)."""
        names, values = list(layer.checks), list(layer.checks.values())
        if completeness is not None:
            # the attention block's real output; its scale over every token (pads are computed like real
            # tokens, so this is at least the scale at the real ones: never a stricter tolerance)
            if real is None:
                real = layer_kind(layer.topology).attention_block_output(layer)
            lo, hi = torch.aminmax(real)
            scale = torch.maximum(hi, -lo).clamp_min(torch.finfo(real.dtype).tiny)
            names.append("completeness of the attention block")
            values.append(completeness.to(scale.dtype) / scale)
        if not values:
            return
        rel = torch.stack([v.detach().to(device=values[0].device, dtype=torch.float64) for v in values]).tolist()
        tol = guard_tolerance(layer.source_dtype or layer.hidden_in.dtype)
        self.tolerance = max(self.tolerance, tol)
        bad = [f"{n}: {r:.3g}" for n, r in zip(names, rel) if not r <= tol and r == r]  # NaN: the non-finite rule
        if not bad:
            return
        msg = f"layer {layer.index} ({'; '.join(bad)})"
        if self.strict:
            raise ConsistencyError(self._message([msg], tol))
        if any(r > GROSS_RELATIVE for r in rel if r == r):
            raise ConsistencyError(self._message([msg], tol) + (
                f" Differences above {GROSS_RELATIVE:g} are refused even without strict=True: no rounding explains "
                "them, so the scores would not decompose this model (docs/reliability.md, 'Consistency guards')."))
        self.failures.append(msg)

    def check_rerun(self, layer: LayerTensors, real_output: Tensor) -> None:
        r"""Judge a layer recomputed from its checkpointed input (the DecompX adjoint's and the routes' walk down).

        The rerun's own checks are judged as in the forward pass, and its output is compared
        with the output the layer gave in the recorded forward pass (:data:`RERUN_CHECK`,
        relative to the real output's largest magnitude), under the same tolerances: a rerun
        that computes something else (another attention function or mask than the recorded
        pass, a hook that acts on one pass only, a nondeterministic layer) warns below
        :data:`GROSS_RELATIVE` and raises above it, and ``strict=True`` raises on any
        difference above the dtype's tolerance. ``docs/reliability.md``, "Checked reruns".

        Args:
            layer: the rerun layer's tensors (its ``layer_out`` is compared).
            real_output: (B, T, D) the layer's output in the recorded pass (the next layer's
                checkpointed input, or the last layer's kept output).
        """
        rel = relative_difference(real_output.detach().to(layer.layer_out.dtype), layer.layer_out)
        layer.checks = {**layer.checks, RERUN_CHECK: rel}
        self.check(layer)

    def _message(self, failures: List[str], tol: float) -> str:
        return (
            f"{self.method}: the model's real tensors disagree with what the decomposition assumes, relative "
            f"differences above {tol:g} at {', '.join(failures)}. A hook or patched module that changes hidden states, "
            "attention inputs or outputs, or a norm or layer that the architecture description does not match, makes "
            "the scores a decomposition of another computation. Remove the hook (or describe the architecture "
            "correctly); see docs/reliability.md, 'Consistency guards'."
        ) + (" A layer rerun from its saved input gave another output than in the recorded pass: a hook that acts on "
             "one pass only, a nondeterministic layer, or an attention implementation that computes differently from "
             "the recording's eager attention (load the model with attn_implementation='sdpa' or 'eager'); "
             "docs/reliability.md, 'Checked reruns'." if any(RERUN_CHECK in f for f in failures) else "")

    def finish(self, stacklevel: int = 4) -> None:
        r"""Warn once for the call if any layer failed (strict guards raised already)."""
        if self.failures:
            failures, self.failures = self.failures, []
            warnings.warn(self._message(failures, self.tolerance), ConsistencyWarning, stacklevel=stacklevel)

