r"""Write ``tests/saved_outputs/reference.pt``: saved outputs of every public method on tiny float64 models.

The file freezes what this version of ``captum_normattr`` computes, so that a later rewrite
can be checked against it to 1e-12 by ``tests/test_saved_outputs.py``. It holds:

* ``models``: for each of the 8 families (4 post-LN encoders with a classification head,
  4 pre-LN decoders with an LM head) the transformers config (JSON), the model and config
  class names, the module types, the ``torch.nn.RMSNorm`` swaps (``exact_norms``) and the
  **state dict**, plus the padded batch (encoders right-padded, decoders left-padded,
  lengths [7, 4]). The test rebuilds the architecture from the config and loads the state
  dict, so it does not depend on transformers' random initialisation.
* ``entries``: key ``"family/method/options"`` -> ``{"family", "spec", "tensors", "labels",
  "none_fields"}``. ``spec`` is the recorded public call (class name, constructor kwargs,
  kwargs of ``decompose`` and of ``attribute``); ``tensors`` holds every tensor of the
  result, named ``"decompose.<field>"``, ``"decompose.extras.<key>"``, ``"attribute.scores"``
  and ``"attribute.delta"`` (the names are the public result fields of this version).
* ``skipped``: keys of combinations that raise ``ValueError`` by design -> ``{"family",
  "spec", "reason"}`` (the test checks that they still raise).

Run from the repository root (with the package to freeze first on the path)::

    PYTHONPATH=. python tests/saved_outputs/make_saved_outputs.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path.insert(0, TESTS)

import captum  # noqa: E402
import transformers  # noqa: E402

import captum_normattr  # noqa: E402
from captum_normattr import FF_SCOPES, GLOBENC_MAPS  # noqa: E402
from conftest import FAMILIES as ENCODERS  # noqa: E402
from conftest import make_model, random_batch  # noqa: E402
from decoder_models import DECODER_FAMILIES as DECODERS  # noqa: E402
from decoder_models import decoder_batch, make_decoder  # noqa: E402

OUT = os.path.join(HERE, "reference.pt")
LENGTHS = [7, 4]
FORMAT = 1


# --------------------------------------------------------------------------- models
def model_record(family: str, model: torch.nn.Module) -> dict:
    cfg = model.config
    swaps = [
        (name, int(m.weight.shape[0]), float(m.eps))
        for name, m in model.named_modules()
        if type(m) is torch.nn.RMSNorm
    ]
    return {
        "model_class": type(model).__name__,
        "config_class": type(cfg).__name__,
        "config": json.dumps(cfg.to_dict(), default=str, sort_keys=True),
        "attn_implementation": cfg._attn_implementation,
        "rmsnorm_swaps": swaps,
        "module_types": {name: type(m).__name__ for name, m in model.named_modules()},
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def rebuild(rec: dict) -> torch.nn.Module:
    r"""The same rebuild as the test does (kept identical on purpose)."""
    cfg = getattr(transformers, rec["config_class"]).from_dict(json.loads(rec["config"]))
    cfg._attn_implementation = rec["attn_implementation"]
    model = getattr(transformers, rec["model_class"])(cfg).double().eval()
    for path, dim, eps in rec["rmsnorm_swaps"]:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, child, torch.nn.RMSNorm(dim, eps=eps, dtype=torch.float64))
    model.load_state_dict(rec["state_dict"], strict=True)
    return model.eval()


# --------------------------------------------------------------------------- specs
def spec(cls, init=None, decompose=None, attribute=None, aux="mask", tuple_inputs=False):
    return {"cls": cls, "init": dict(init or {}), "decompose": decompose, "attribute": attribute,
            "aux": aux, "tuple_inputs": tuple_inputs}


def fmt(v) -> str:
    if isinstance(v, torch.Tensor) and v.dim() > 1:
        return "tensor" + "x".join(str(n) for n in v.shape)
    if isinstance(v, torch.Tensor):
        return "[" + ",".join(str(x) for x in v.tolist()) + "]"
    if isinstance(v, tuple):
        return "(" + ",".join(fmt(x) for x in v) + ")"
    return str(v)


SHORT = {"GlobEncAttribution": "globenc", "ALTIAttribution": "alti", "FFIntegratedDecomposition": "ff",
         "ALTILogitAttribution": "alti_logit", "DecompXAttribution": "decompx"}


def key_of(family: str, s: dict, label: str = "") -> str:
    opts = [f"{k}={fmt(v)}" for k, v in s["init"].items()]
    call = s["decompose"] if s["decompose"] is not None else s["attribute"]
    opts += [f"{k}={fmt(v)}" for k, v in (call or {}).items() if k != "return_convergence_delta"]
    if s["aux"] != "mask":
        opts.append(s["aux"])
    if s["tuple_inputs"]:
        opts.append("tuple_inputs")
    if label:
        opts.append(label)
    return f"{family}/{SHORT[s['cls']]}/{','.join(opts) or 'default'}"


def specs_for(family: str, decoder: bool, unembedding: torch.Tensor):
    out = []
    # GlobEnc: every map valid for the family (invalid ones are recorded as skipped)
    for m in GLOBENC_MAPS:
        out.append(spec("GlobEncAttribution", {"map_name": m, "rollout": "raw"}, {}, {}))
    out.append(spec("GlobEncAttribution", {"rollout": "row_normalized"}, {}, {}))
    out.append(spec("GlobEncAttribution", {}, {}, {}, tuple_inputs=True))
    if decoder:
        out.append(spec("GlobEncAttribution", {"map_name": "N", "explained_position": -2}, {}, {}))
    else:
        out.append(spec("GlobEncAttribution", {"map_name": "N_ENC", "explained_position": "last"}, {}, {}))
    if family == "bert":
        out.append(spec("GlobEncAttribution", {}, {}, {}, aux="mask+token_type_ids"))
    # ALTI
    out.append(spec("ALTIAttribution", {}, {}, {}))
    out.append(spec("ALTIAttribution", {"rollout": "row_normalized", "memory_budget_mb": 0.01}, {}, {}))
    # FF decomposition: every scope x contribution (pre-LN + 'alti' raises by design)
    for scope in FF_SCOPES:
        for contribution in ("norm", "alti"):
            out.append(spec("FFIntegratedDecomposition", {"scope": scope, "contribution": contribution}, {},
                            {"return_convergence_delta": True}))
    out.append(spec("FFIntegratedDecomposition", {}, {}, {"return_convergence_delta": True}))
    out.append(spec("FFIntegratedDecomposition", {"method": "riemann", "steps": 20}, {},
                    {"return_convergence_delta": True}))
    out.append(spec("FFIntegratedDecomposition", {"chunk_rows": 2, "rollout": "row_normalized"}, {},
                    {"return_convergence_delta": True}))
    for scope in ("LN2", "ATB"):  # post-LN only (pre-LN raises by design)
        out.append(spec("FFIntegratedDecomposition", {"scope": scope, "ignore_low_gamma": 0.25}, {},
                        {"return_convergence_delta": True}))
    if decoder:
        out.append(spec("FFIntegratedDecomposition", {"nodes": 8}, {}, {"return_convergence_delta": True}))
    # ALTI-Logit (pre-LN decoders with an LM head; raises on encoders by design)
    tgt = torch.tensor([5, 9]) if decoder else torch.tensor([1, 0])
    if not decoder:  # raises by design: recorded once as skipped
        out.append(spec("ALTILogitAttribution", {}, {}, {"return_convergence_delta": True}))
    for t in ((None, 7, (7, 11), tgt) if decoder else ()):
        kw = {} if t is None else {"target": t}
        out.append(spec("ALTILogitAttribution", {}, dict(kw), dict(kw, return_convergence_delta=True)))
    if decoder:
        out.append(spec("ALTILogitAttribution", {"explained_position": -2}, {"target": 7},
                        {"target": 7, "return_convergence_delta": True}))
        out.append(spec("ALTILogitAttribution", {"unembedding": unembedding, "memory_budget_mb": 0.01},
                        {"target": 3}, {"target": 3, "return_convergence_delta": True}))
    # DecompX: every bias mode x every algorithm (adjoint + spread raises by design), explicit targets
    for bias_mode in ("separate", "spread", "spread_per_key"):
        for algorithm in ("auto", "adjoint", "forward"):
            out.append(spec("DecompXAttribution", {"bias_mode": bias_mode, "algorithm": algorithm},
                            {"target": tgt}, {"target": tgt, "return_convergence_delta": True}))
    out.append(spec("DecompXAttribution", {}, {}, {"return_convergence_delta": True}))  # predicted target
    out.append(spec("DecompXAttribution", {"algorithm": "adjoint"}, {"target": tgt, "layer_parts": True},
                    {"target": tgt, "return_convergence_delta": True}))
    out.append(spec("DecompXAttribution", {"algorithm": "forward", "full_last_layer": True, "memory_budget_mb": 0.01},
                    {"target": tgt}, {"target": tgt, "return_convergence_delta": True}))
    if decoder:
        for algorithm in ("adjoint", "forward"):
            out.append(spec("DecompXAttribution", {"algorithm": algorithm}, {"target": (7, 11)},
                            {"target": (7, 11), "return_convergence_delta": True}))
        for bias_mode in ("spread", "spread_per_key"):
            out.append(spec("DecompXAttribution", {"bias_mode": bias_mode, "explained_position": -2, "nodes": 8},
                            {"target": 7}, {"target": 7, "return_convergence_delta": True}))
        out.append(spec("DecompXAttribution", {"unembedding": unembedding}, {"target": 3},
                        {"target": 3, "return_convergence_delta": True}))
    else:
        for bias_mode in ("spread", "spread_per_key"):
            out.append(spec("DecompXAttribution", {"bias_mode": bias_mode}, {"target": 1},
                            {"target": 1, "return_convergence_delta": True}, tuple_inputs=True))
    return out


# --------------------------------------------------------------------------- running
def run(model, batch: dict, s: dict):
    r"""Run one spec through the public API; returns {"decompose": result, "attribute": (scores, delta)}."""
    cls = getattr(captum_normattr, s["cls"])
    obj = cls(model, **s["init"])
    ids = batch["input_ids"]
    inputs = (ids,) if s["tuple_inputs"] else ids
    afa = (batch["attention_mask"],)
    if s["aux"] == "mask+token_type_ids":
        afa = (batch["attention_mask"], batch["token_type_ids"])
    out = {}
    if s["decompose"] is not None:
        out["decompose"] = obj.decompose(inputs, additional_forward_args=afa, **s["decompose"])
    if s["attribute"] is not None:
        a = obj.attribute(inputs, additional_forward_args=afa, **s["attribute"])
        scores, delta = a if s["attribute"].get("return_convergence_delta") else (a, None)
        if s["tuple_inputs"]:
            assert isinstance(scores, tuple) and len(scores) == 1
            scores = scores[0]
        out["attribute"] = {"scores": scores, "delta": delta}
    return out


def flatten(out: dict):
    r"""Every tensor of the outputs by its (current) public name; strings and Nones apart."""
    tensors, labels, nones = {}, {}, []
    res = out.get("decompose")
    if res is not None:
        for f in dataclasses.fields(res):
            v = getattr(res, f.name)
            name = f"decompose.{f.name}"
            if isinstance(v, torch.Tensor):
                tensors[name] = v.detach().clone()
            elif isinstance(v, dict):
                for k, t in v.items():
                    tensors[f"{name}.{k}"] = t.detach().clone()
            elif isinstance(v, str):
                labels[name] = v
            elif v is None:
                nones.append(name)
            else:
                raise TypeError(f"unexpected field {name}: {type(v).__name__}")
    for k, v in out.get("attribute", {}).items():
        if v is None:
            nones.append(f"attribute.{k}")
        else:
            tensors[f"attribute.{k}"] = v.detach().clone()
    for name, t in tensors.items():
        assert t.dtype in (torch.float64, torch.long), (name, t.dtype)
    return tensors, labels, nones


def pack(payload: dict) -> dict:
    r"""Make every tensor a view into one flat buffer per dtype (file size: one storage, not thousands).

    ``torch.save`` keeps the views, so the loaded file still holds plain tensors by name.
    """
    found = []

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(payload)
    buffers, offsets = {}, {}
    for dtype in {t.dtype for t in found}:
        ts = [t for t in found if t.dtype == dtype]
        buffers[dtype] = torch.cat([t.detach().reshape(-1) for t in ts])
        off = 0
        for t in ts:
            offsets.setdefault(id(t), off)
            off += t.numel()

    def rebuild_(obj):
        if isinstance(obj, torch.Tensor):
            o = offsets[id(obj)]
            view = buffers[obj.dtype][o:o + obj.numel()].view(obj.shape)
            assert torch.equal(view, obj)
            return view
        if isinstance(obj, dict):
            return {k: rebuild_(v) for k, v in obj.items()}
        if isinstance(obj, tuple):
            return tuple(rebuild_(v) for v in obj)
        if isinstance(obj, list):
            return [rebuild_(v) for v in obj]
        return obj

    return rebuild_(payload)


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True).strip()
    except Exception:  # pragma: no cover
        return "unknown"


def main() -> None:
    torch.set_num_threads(1)  # tiny tensors: threads only cost time (results agree far below 1e-12 anyway)
    models, entries, skipped = {}, {}, {}
    for family in ENCODERS + DECODERS:
        decoder = family in DECODERS
        if decoder:
            original = make_decoder(family, lm_head=True)
            ids, mask = decoder_batch(LENGTHS, seed=1, left=True)
        else:
            original = make_model(family)
            ids, mask = random_batch(LENGTHS, seed=1)
        rec = model_record(family, original)
        batch = {"input_ids": ids, "attention_mask": mask}
        if family == "bert":
            tt = torch.zeros_like(ids)
            tt[0, 4:7] = 1
            tt[1, 2:4] = 1
            batch["token_type_ids"] = tt
        rec["batch"] = batch
        models[family] = rec
        model = rebuild(rec)
        assert {n: type(m).__name__ for n, m in model.named_modules()} == rec["module_types"], family
        with torch.no_grad():  # the rebuilt model is the original one, bit for bit
            a = original(input_ids=ids, attention_mask=mask).logits
            b = model(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(a, b), family
        g = torch.Generator().manual_seed(7)
        unembedding = 0.2 * torch.randn(original.config.vocab_size, original.config.hidden_size, generator=g,
                                        dtype=torch.float64)
        for s in specs_for(family, decoder, unembedding):
            key = key_of(family, s)
            assert key not in entries and key not in skipped, key
            try:
                out = run(model, batch, s)
            except ValueError as e:
                skipped[key] = {"family": family, "spec": s, "reason": f"ValueError: {e}"}
                continue
            tensors, labels, nones = flatten(out)
            entries[key] = {"family": family, "spec": s, "tensors": tensors, "labels": labels, "none_fields": nones}
    payload = {
        "format": FORMAT,
        "created_with": {"captum_normattr_commit": git_commit(), "torch": str(torch.__version__),
                         "transformers": transformers.__version__, "captum": captum.__version__},
        "models": models,
        "entries": entries,
        "skipped": skipped,
    }
    torch.save(pack(payload), OUT)
    loaded = torch.load(OUT, weights_only=True)  # the test loads it this way
    assert loaded["entries"].keys() == entries.keys()
    n = sum(len(e["tensors"]) for e in entries.values())
    print(f"wrote {OUT}: {len(entries)} entries, {n} tensors, {len(skipped)} skipped, "
          f"{os.path.getsize(OUT) / 2**20:.2f} MiB")
    for k, why in skipped.items():
        print(f"  skipped {k}: {why['reason'][:110]}")


if __name__ == "__main__":
    main()
