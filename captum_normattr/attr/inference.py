r"""Verified inference of an architecture description for a model the registry does not know.

:func:`infer_architecture` answers "does my model work, and as what?": it proposes every
registered description whose parts the model has (the layer list, each branch's modules, the
norms, the final norm), and *verifies* each proposal on a probe input: the model runs once with
the description's capture, the consistency guard compares the model's real tensors with what the
decomposition assumes (residual joins, norms rebuilt from their inputs, the feed-forward rebuilt
from its weights, the attention output rebuilt from the values), and, for a causal LM, ALTI-Logit's
token scores plus its no-token terms are compared with the model's own logit. A proposal is
*verified* when every check is within the guard's rounding tolerance for the model's dtype.

Nothing is registered: the result says which description verified and gives the one line that
registers it (``register_architecture(replace(ARCHITECTURES[key], model_types=(...)))``); a
verified proposal is never applied silently. For the others it says which part differs. The
:class:`~captum_normattr.UnsupportedModelError` of an unregistered model type names the
descriptions whose parts the model has (a module-path match, no run: about 1.4 ms) and this
function, which verifies them (a forward pass and a decomposition per description: 2.6 s for
the 17 proposals of a 10k-parameter Llama clone, so the error does not run it); once this
function has verified a description for a model type, that error names it with its line.

docs/architectures.md, "Does my model work?".
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch
from torch import nn

from captum_normattr.arch import ARCHITECTURES, ENCODER_DECODERS, ArchitectureSpec, register_architecture
from captum_normattr.arch.spec import UnsupportedModelError
from captum_normattr.decompose.primitives.guards import guard_tolerance
from captum_normattr.models.adapters import unwrap_model
from captum_normattr.models.unregistered import VERIFIED_PROPOSALS, register_line, structural_candidates

__all__ = ["ArchitectureInference", "ArchitectureProposal", "infer_architecture", "structural_candidates"]


@dataclass
class ArchitectureProposal:
    r"""One registered description tried on the model.

    Attributes:
        key: the description's registry key.
        family: its readable family name.
        verified: every check within the rounding tolerance of the model's dtype.
        max_relative_error: the largest relative difference found (consistency checks, the
            attention block's completeness, and for a causal LM the logit check), or ``inf``
            where the proposal could not run.
        differs: what differs (readable, one entry per failing check), empty when verified.
        register_line: the Python line that registers the description for this model type.
    """

    key: str
    family: str
    verified: bool
    max_relative_error: float
    differs: List[str] = field(default_factory=list)
    register_line: str = ""


@dataclass
class ArchitectureInference:
    r"""What :func:`infer_architecture` found for one model.

    Attributes:
        model_type: the model's ``config.model_type``.
        registered: the key the registry already serves it with, or None.
        tolerance: the relative tolerance the checks were judged with (the guard's, for the
            model's dtype).
        proposals: the descriptions tried, verified ones first, then by error.
    """

    model_type: Optional[str]
    registered: Optional[str]
    tolerance: float
    proposals: List[ArchitectureProposal]

    @property
    def verified(self) -> Optional[ArchitectureProposal]:
        r"""The best verified proposal, or None."""
        return next((p for p in self.proposals if p.verified), None)

    def __str__(self) -> str:
        lines = [f"model_type {self.model_type!r}: "
                 + (f"registered as {self.registered!r}" if self.registered else "not registered")]
        if not self.proposals:
            lines.append("no registered description has this model's parts (layer list, attention and feed-forward "
                         "modules, norms); see docs/architectures.md to describe it")
        for p in self.proposals:
            if p.verified:
                lines.append(f"  {p.key} ({p.family}): VERIFIED (max relative difference {p.max_relative_error:.2g}, "
                             f"tolerance {self.tolerance:.2g}); register it with:\n      {p.register_line}")
            else:
                lines.append(f"  {p.key} ({p.family}): differs: " + "; ".join(p.differs[:4]))
        return "\n".join(lines)


def _get(root: nn.Module, path: str) -> Optional[Any]:
    for part in path.split("."):
        if not hasattr(root, part):
            return None
        root = getattr(root, part)
    return root


def _probe(model: nn.Module, length: int) -> torch.Tensor:
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 100)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (2, length), generator=g)
    return ids


def _verify(model: nn.Module, key: str, spec: ArchitectureSpec, model_type: str, length: int) -> ArchitectureProposal:
    from captum_normattr.attr.alti import ALTIAttribution
    from captum_normattr.attr.alti_logit import ALTILogitAttribution
    from captum_normattr.models.guard import ConsistencyError, ConsistencyWarning

    line = register_line(key, model_type)
    proposal = ArchitectureProposal(key, spec.family, False, float("inf"), [], line)
    candidate = dataclasses.replace(spec, model_types=(model_type,))
    saved, saved_ed = dict(ARCHITECTURES), dict(ENCODER_DECODERS)
    ids = _probe(model, length).to(next(model.parameters()).device)
    mask = torch.ones_like(ids)
    mask[1, length // 2 + 1:] = 0  # a padded row too
    try:
        register_architecture(candidate, key=model_type, replace=True)
        errors: List[str] = []
        delta_rel = 0.0
        errs: List[float] = []
        lm = candidate.causal and candidate.head.lm_head is not None and _get(model, candidate.head.lm_head) is not None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                res = ALTIAttribution(model).decompose(ids, additional_forward_args=(mask,))
                errs = [float(e) for e in res.extras.get("completeness_error", torch.zeros(1)).flatten()]
            except ConsistencyError as err:  # a gross difference: the guard refuses it
                errors.append(str(err))
            if lm and not errors:
                target = int(ids[0, 0])
                scores, delta = ALTILogitAttribution(model).attribute(
                    ids, additional_forward_args=(mask,), target=target, return_convergence_delta=True)
                with torch.no_grad():
                    logits = model(input_ids=ids, attention_mask=mask).logits
                last = mask.sum(1) - 1
                real = logits[torch.arange(ids.shape[0]), last, target].double()
                scale = real.abs().clamp_min(1.0) + scores.double().abs().sum(-1)
                delta_rel = float((delta.double().abs() / scale).max())
        failures = errors + [str(w.message) for w in caught if issubclass(w.category, ConsistencyWarning)]
        tol = guard_tolerance(next(model.parameters()).dtype)
        found = [float(x) for f in failures for x in re.findall(r": (-?[0-9.]+(?:e[-+]?[0-9]+)?)[;)]", f)]
        for f in failures:  # "... relative differences above 1e-05 at layer 0 (...), layer 1 (...). A hook ..."
            where = f.split("relative differences above", 1)[-1].split(". A hook")[0].strip()
            where = where.split(" at ", 1)[-1].split(" Differences above")[0]
            if where not in proposal.differs:  # ALTI and ALTI-Logit see the same layers
                proposal.differs.append(where)
        if lm and not delta_rel <= tol:
            proposal.differs.append(f"ALTI-Logit's scores plus no-token terms miss the model's logit by {delta_rel:.3g} "
                                    "(relative)")
        if not all(e == e for e in errs):
            proposal.differs.append("non-finite completeness errors")
        proposal.verified = not proposal.differs
        proposal.max_relative_error = max(found + [delta_rel]) if (found or not proposal.differs) else float("inf")
    except Exception as err:  # noqa: BLE001 - any failure of a proposal is reported, not raised
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        proposal.differs.append(f"{type(err).__name__}: {first[:300]}")
    finally:
        ARCHITECTURES.clear()
        ARCHITECTURES.update(saved)
        ENCODER_DECODERS.clear()
        ENCODER_DECODERS.update(saved_ed)
    return proposal


def infer_architecture(model: nn.Module, candidates: Optional[Sequence[str]] = None,
                       probe_length: int = 8) -> ArchitectureInference:
    r"""Propose and verify registered descriptions for ``model`` (see the module docstring).

    Args:
        model: a ``transformers`` text model (bare, ``*ForCausalLM``, ``*ForSequenceClassification``).
        candidates: registry keys to try (default: every description whose parts the model
            has, :func:`structural_candidates`).
        probe_length: tokens of the probe input (two rows, one padded).

    Returns:
        :class:`ArchitectureInference`; ``.verified`` is the best verified proposal or None,
        ``str()`` of it is a readable report. Nothing is registered.

    Examples::

        >>> from captum_normattr import infer_architecture
        >>> found = infer_architecture(model)
        >>> print(found)                      # which description verified, and the line to register it
        >>> found.verified.register_line      # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"infer_architecture takes a loaded model (an nn.Module), not {type(model).__name__}")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    registered = next((k for k, s in ARCHITECTURES.items() if model_type in s.model_types), None)
    keys = list(candidates) if candidates is not None else structural_candidates(unwrap_model(model))
    unknown = [k for k in keys if k not in ARCHITECTURES]
    if unknown:
        raise UnsupportedModelError(f"unknown registry keys {unknown}; registered: {', '.join(ARCHITECTURES)}")
    was_training = model.training
    model.eval()
    try:
        proposals = [_verify(model, k, ARCHITECTURES[k], model_type or "unknown", probe_length) for k in keys]
    finally:
        model.train(was_training)
    proposals.sort(key=lambda p: (not p.verified, p.max_relative_error))
    tol = guard_tolerance(next(model.parameters()).dtype)
    found = ArchitectureInference(model_type, registered, tol, proposals)
    if found.verified is not None and registered is None and model_type is not None:
        # remembered for the UnsupportedModelError of this model type, which names the line; never applied
        VERIFIED_PROPOSALS[model_type] = (found.verified.key, found.verified.register_line)
    return found
