r"""Regression against saved outputs of an earlier version (``tests/fixtures/saved_outputs/reference.pt``).

The file was written by ``tests/fixtures/saved_outputs/make_saved_outputs.py`` (commit in
``created_with``). For each of the 8 tiny float64 models (4 encoders, 4 decoders) it holds the
config and the state dict, so the model is rebuilt here without relying on transformers'
random initialisation, and the padded batch. Every recorded public call (constructor
options, ``decompose(...)`` and ``attribute(...)`` kwargs) is rerun and every saved tensor
must agree to a tolerance scaled to its own magnitude (:func:`tolerance`; integer tensors:
exactly). BLAS rounding differs between processors, so an absolute bound does not travel.

The saved entries are named by the PUBLIC RESULT FIELDS of the version that wrote the file:
``"decompose.<field>"`` (e.g. ``decompose.layer_maps``, ``decompose.layer_part_norms``),
``"decompose.extras.<key>"`` and ``"attribute.scores"`` / ``"attribute.delta"`` (the
``attribute`` return values). If a field is renamed or moved, update :data:`RENAMED` (the one
place that maps saved names to current ones); a saved name that can no longer be found
fails loudly, it is never skipped.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache

import pytest
import torch
import transformers

import captum_normattr

REFERENCE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "saved_outputs", "reference.pt")
EPS = torch.finfo(torch.float64).eps  # 2.2e-16
# Per tensor: |new - saved| <= RTOL * max|saved| (+ a floor for residuals, below). Why these factors:
# every value is a chain of ~2 layers x ~10 dependent ops, each a sum of up to ~40 terms (D = 24,
# F = 40, T = 7) of the tensor's magnitude, so a change of summation order (another CPU's BLAS
# blocking / FMA, or a later version's tiling) moves it by some eps x depth x magnitude.
# Measured: saved vs rerun <= 32 eps x max|saved|; rerun on a model whose weights were scaled by
# (1 + eps N(0,1)) (the same order of change as a rounding difference) <= 60 eps. 512 eps
# (1.1e-13) leaves a factor ~8 over the worst case, and catches any change of meaning.
RTOL = 512 * EPS
# FF decomposition with contribution="alti" is ill-conditioned: ALTI's max(0, |y|_1 - |y - p|_1)
# cancels when the FF output y is much larger than one token's part p, which multiplies the
# rounding above by |y|_1 / contribution (~1e3 on these random models). Measured: saved vs rerun
# 2.0e4 eps (1.6e-12 on an AMD EPYC), 1-ulp weight perturbation 5.4e4 eps; 2**18 eps (5.8e-11)
# leaves a factor ~5.
RTOL_ILL_CONDITIONED = 2 ** 18 * EPS
# Residuals (convergence deltas, completeness errors, and bias scores that are zero in exact
# arithmetic for bias-free decoders) are rounding noise of sums of the call's values, so their
# scale is the largest saved value of the call (measured <= 32 eps of it), not their own.
RESIDUAL_FLOOR = 512 * EPS
RESIDUAL_NAMES = ("delta", "error", "bias_scores")
FAMILIES = ["bert", "roberta", "electra", "distilbert", "gpt2", "llama", "mistral", "qwen2"]

# saved name -> current name, e.g. {"decompose.layer_maps": "decompose.maps",
# "decompose.extras.completeness_error": "decompose.extras.attention_completeness_error"}.
RENAMED: dict = {}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    r"""The tensors are tiny: intra-op threads only add overhead (and spin under CPU contention)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@lru_cache(maxsize=1)
def reference() -> dict:
    return torch.load(REFERENCE, weights_only=True)


def rebuild(rec: dict) -> torch.nn.Module:
    r"""The saved model: architecture from the config, exact RMSNorm swaps, then the saved state dict."""
    cfg = getattr(transformers, rec["config_class"]).from_dict(json.loads(rec["config"]))
    cfg._attn_implementation = rec["attn_implementation"]
    model = getattr(transformers, rec["model_class"])(cfg).double().eval()
    for path, dim, eps in rec["rmsnorm_swaps"]:  # tests/fixtures/decoder_models.py exact_norms=True
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path), child, torch.nn.RMSNorm(dim, eps=eps, dtype=torch.float64))
    model.load_state_dict(rec["state_dict"], strict=True)
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    assert types == rec["module_types"], "the rebuilt model's modules differ from the saved model's"
    return model.eval()


def current_call(kwargs: dict) -> dict:
    r"""A saved call's kwargs in today's API: the contrast ``target=(t, f)`` of the logit classes is now ``target=t, foil=f``."""
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("target"), tuple) and len(kwargs["target"]) == 2:
        kwargs["target"], kwargs["foil"] = kwargs["target"]
    return kwargs


def run(model: torch.nn.Module, batch: dict, spec: dict) -> dict:
    r"""Rerun one recorded call through the public API: {"decompose": result, "attribute": {...}}."""
    obj = getattr(captum_normattr, spec["cls"])(model, **spec["init"])
    ids = batch["input_ids"]
    inputs = (ids,) if spec["tuple_inputs"] else ids
    afa = (batch["attention_mask"],)
    if spec["aux"] == "mask+token_type_ids":
        afa = (batch["attention_mask"], batch["token_type_ids"])
    out = {}
    if spec["decompose"] is not None:
        out["decompose"] = obj.decompose(inputs, additional_forward_args=afa, **current_call(spec["decompose"]))
    if spec["attribute"] is not None:
        a = obj.attribute(inputs, additional_forward_args=afa, **current_call(spec["attribute"]))
        scores, delta = a if spec["attribute"].get("return_convergence_delta") else (a, None)
        if spec["tuple_inputs"]:
            assert isinstance(scores, tuple) and len(scores) == 1, "tuple inputs must give a 1-tuple of scores"
            scores = scores[0]
        out["attribute"] = {"scores": scores, "delta": delta}
    return out


def read_field(out: dict, saved_name: str):
    r"""The current value of a saved name (through :data:`RENAMED`); KeyError naming what exists if absent."""
    name = RENAMED.get(saved_name, saved_name)
    obj = out
    for part in name.split("."):
        if isinstance(obj, dict):
            if part not in obj:
                raise KeyError(f"{saved_name!r} (read as {name!r}): no {part!r}; available: {sorted(obj)}")
            obj = obj[part]
        else:
            if not hasattr(obj, part):
                fields = sorted(k for k in vars(obj) if not k.startswith("_"))
                raise KeyError(f"{saved_name!r} (read as {name!r}): {type(obj).__name__} has no {part!r}; "
                               f"fields: {fields}")
            obj = getattr(obj, part)
    return obj


def ill_conditioned(spec: dict) -> bool:
    r"""Calls whose outputs are ALTI L1 contributions of FF-scope parts (see :data:`RTOL_ILL_CONDITIONED`)."""
    return spec["cls"] == "FFIntegratedDecomposition" and spec["init"].get("contribution") == "alti"


def call_scale(tensors: dict) -> float:
    r"""The largest magnitude of the floating tensors saved for one call."""
    return max((float(t.abs().max()) for t in tensors.values() if t.is_floating_point() and t.numel()),
               default=0.0)


def tolerance(saved: torch.Tensor, name: str, spec: dict, scale: float) -> float:
    r"""Allowed max |new - saved| of one floating tensor: RTOL x its magnitude (+ floor for residuals)."""
    rtol = RTOL_ILL_CONDITIONED if ill_conditioned(spec) else RTOL
    tol = rtol * (float(saved.abs().max()) if saved.numel() else 0.0)
    if any(r in name.rsplit(".", 1)[-1] for r in RESIDUAL_NAMES) or ill_conditioned(spec):
        # residuals, and the ill-conditioned calls' small results (BERT's scope=FF scores are 1.8e-4, rollouts of
        # maps whose entries reach 1): their rounding is that of the call's largest values, not their own
        # (measured on this CPU: 1.6e-14 = 72 eps of the call's scale, 4e5 eps of the scores' own 1.8e-4)
        tol += RESIDUAL_FLOOR * scale
    return tol


def compare(saved: torch.Tensor, new, tol: float = 0.0) -> str | None:
    if not isinstance(new, torch.Tensor):
        return f"expected a tensor, got {type(new).__name__}"
    if tuple(new.shape) != tuple(saved.shape):
        return f"shape {tuple(new.shape)} != saved {tuple(saved.shape)}"
    if saved.is_floating_point():
        if new.dtype != torch.float64:
            return f"dtype {new.dtype} != float64"
        diff = (new - saved).abs()
        bad = ~(diff <= tol)  # NaN counts as bad
        if bool(bad.any()):
            return (f"max |diff| {diff.max().item():.3e} > tolerance {tol:.3e} at {int(bad.sum())} of "
                    f"{diff.numel()} entries (max |saved| {saved.abs().max().item():.3e})")
        return None
    if not torch.equal(new.to(saved.dtype), saved):
        return f"{new.tolist()} != saved {saved.tolist()}"
    return None


@lru_cache(maxsize=None)
def family_model(family: str) -> torch.nn.Module:
    return rebuild(reference()["models"][family])


def entries_of(family: str) -> dict:
    return {k: e for k, e in reference()["entries"].items() if e["family"] == family}


def test_reference_file_covers_every_family():
    ref = reference()
    assert ref["format"] == 1
    assert set(ref["models"]) == set(FAMILIES)
    for family in FAMILIES:
        assert len(entries_of(family)) >= 20, family


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_outputs(family):
    ref = reference()
    model = family_model(family)
    batch = ref["models"][family]["batch"]
    failures, checked = [], 0
    for key, entry in entries_of(family).items():
        try:
            out = run(model, batch, entry["spec"])
        except Exception as e:  # a call that used to work must still work
            failures.append(f"{key}: call raised {type(e).__name__}: {e}")
            continue
        scale = call_scale(entry["tensors"])
        for name, saved in entry["tensors"].items():
            try:
                new = read_field(out, name)
            except KeyError as e:
                failures.append(f"{key} :: {name}: saved field not found: {e}")
                continue
            msg = compare(saved, new, tolerance(saved, name, entry["spec"], scale) if saved.is_floating_point() else 0.0)
            checked += 1
            if msg:
                failures.append(f"{key} :: {name}: {msg}")
        for name, label in entry["labels"].items():  # method names, rollout convention, bias mode, algorithm
            try:
                new = read_field(out, name)
            except KeyError as e:
                failures.append(f"{key} :: {name}: saved field not found: {e}")
                continue
            if new != label:
                failures.append(f"{key} :: {name}: {new!r} != saved {label!r}")
    assert not failures, f"{len(failures)} mismatches ({checked} tensors checked):\n" + "\n".join(failures[:60])


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_rejections_still_raise(family):
    r"""Combinations that raised ValueError by design in the saved version still do."""
    ref = reference()
    model = family_model(family)
    batch = ref["models"][family]["batch"]
    for key, entry in ref["skipped"].items():
        if entry["family"] != family:
            continue
        if entry["spec"]["init"].get("contribution") == "alti" and "pre-LN" in entry["reason"]:
            continue  # ALTI+FF on pre-LN models was refused then and is supported now (tests/decompose/kinds/test_pre_ln_alti_ff.py)
        with pytest.raises(ValueError):
            run(model, batch, entry["spec"])


@pytest.mark.parametrize("key,name", [
    ("electra/alti/default", "decompose.layer_maps"),
    ("electra/ff/scope=FF,contribution=alti", "decompose.layer_maps"),
    ("mistral/decompx/default", "decompose.scores"),
    ("mistral/alti_logit/default", "attribute.delta"),
    ("llama/decompx/default", "decompose.bias_scores"),
])
def test_a_perturbed_saved_value_fails(key, name):
    r"""The tolerances still catch a change: one saved entry moved by 2x its tolerance fails, by 0.5x passes."""
    ref = reference()
    entry = ref["entries"][key]
    family = entry["family"]
    out = run(family_model(family), ref["models"][family]["batch"], entry["spec"])
    saved = entry["tensors"][name]
    tol = tolerance(saved, name, entry["spec"], call_scale(entry["tensors"]))
    new = read_field(out, name)
    assert compare(saved, new, tol) is None
    assert tol < 1e-10 * max(1.0, call_scale(entry["tensors"]))  # still a strict comparison
    at = int((new - saved).abs().flatten().argmin())  # the entry that agrees best: moved by 2 tol, it must fail
    for factor, fails in ((2.0, True), (0.5, False)):
        moved = saved.clone()
        moved.view(-1)[at] += factor * tol + (new - saved).view(-1)[at]
        assert (compare(moved, new, tol) is not None) == fails, (factor, compare(moved, new, tol))
