r"""The kind registry is one literal line per topology; each kind declares its methods, DecompX steps and capture recipe."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from captum_normattr.arch.spec import TOPOLOGIES, UnsupportedModelError
from captum_normattr.decompose.kinds import registry
from captum_normattr.decompose.kinds.base import COMMON_RECORD_KEYS, KIND_METHODS, LayerKind
from captum_normattr.decompose.kinds.registry import LAYER_KINDS, layer_kind, register_layer_kind

PACKAGE = Path(__file__).resolve().parents[3] / "captum_normattr"


def test_every_topology_has_its_kind_listed_literally():
    assert list(LAYER_KINDS) == ["post_ln", "pre_ln", "parallel", "sandwich", "single_branch", "sandwich_per_layer_input"]
    assert set(LAYER_KINDS) == set(TOPOLOGIES)
    for name, kind in LAYER_KINDS.items():
        assert kind.name == name and type(kind).__module__ == f"captum_normattr.decompose.kinds.{name}"
    # no registration by import side effect: the registry module calls register_layer_kind nowhere
    tree = ast.parse((PACKAGE / "decompose" / "kinds" / "registry.py").read_text(encoding="utf-8"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "register_layer_kind"]
    assert calls == []


def test_methods_of_each_kind():
    assert {"alti_logit", "routes"}.isdisjoint(LAYER_KINDS["post_ln"].methods)
    assert LAYER_KINDS["pre_ln"].methods == frozenset(KIND_METHODS)
    assert LAYER_KINDS["single_branch"].methods == frozenset(KIND_METHODS)  # the pre-LN kind on one-branch records
    for name in ("parallel", "sandwich"):  # the routes too (tests/attr/test_routes_kinds.py)
        assert LAYER_KINDS[name].methods == frozenset(KIND_METHODS)
        LAYER_KINDS[name].require("routes", name)
    # only a parallel layer's FF block reads the layer input (its route edge comes from x_{l,i})
    assert [n for n, kind in LAYER_KINDS.items() if kind.route_ff_reads_input] == ["parallel"]
    with pytest.raises(UnsupportedModelError, match="post_ln layers, and the 'routes' decomposition"):
        LAYER_KINDS["post_ln"].require("routes", "BERT")
    gemma4 = LAYER_KINDS["sandwich_per_layer_input"]  # Gemma 4: every method, its step reads its own values
    assert gemma4.methods == frozenset(KIND_METHODS)
    assert gemma4.adjoint and not gemma4.reads_value_projection
    assert all(kind.adjoint and kind.reads_value_projection for kind in LAYER_KINDS.values() if kind is not gemma4)
    gemma4.require("ff", "Gemma 4")  # the FF scopes are implemented
    gemma4.require("routes", "Gemma 4")  # the routes too (tests/attr/test_routes_gemma4.py)


def test_capture_recipes():
    rec = {name: kind.capture for name, kind in LAYER_KINDS.items()}
    assert rec["post_ln"].attention_input == "hidden_in" and rec["post_ln"].ff_input == "ln1_out"
    assert rec["post_ln"].stream_norms and not any(rec[k].stream_norms for k in ("pre_ln", "parallel", "sandwich"))
    assert rec["single_branch"] == rec["pre_ln"]  # the absent branch is completed, the record is a pre-LN one
    for name in ("pre_ln", "parallel", "sandwich"):
        assert rec[name].attention_input == "ln1_out" and rec[name].ff_input == "ln2_out"
    assert rec["parallel"].extra_keys == ("attn_branch_out",) and rec["parallel"].branch_output == "attn_branch_out"
    assert rec["sandwich"].extra_keys == ("attn_post_in", "attn_post_out", "ff_post_in", "ff_post_out")
    assert rec["sandwich"].post_norms == ("attn_post", "ff_post")
    assert rec["sandwich_per_layer_input"].extra_keys == rec["sandwich"].extra_keys
    assert rec["sandwich_per_layer_input"].post_norms == ("attn_post", "ff_post")
    assert [r.attention_join for r in rec.values()] == ["ln1_in", "ln2_in", None, None, "ln2_in", None]
    for r in rec.values():
        assert r.record_keys[: len(COMMON_RECORD_KEYS)] == COMMON_RECORD_KEYS
        keys = set(r.record_keys)
        assert all(real in keys and assumed in keys for _, real, assumed in r.identity_checks)


def test_nothing_outside_the_kinds_branches_on_the_topology():
    for rel in ("models/capture/recorder.py", "models/capture/record.py", "models/capture/attention.py",
                "models/capture/session.py", "models/seq2seq.py", "decompose/methods/decompx/propagation.py",
                "decompose/methods/decompx/adjoint.py"):
        text = (PACKAGE / rel).read_text(encoding="utf-8")
        assert not re.search(r"\.pre_ln\b(?![._])", text) and "topology ==" not in text and '"sandwich"' not in text, rel
        assert '"parallel"' not in text, rel


def test_a_users_kind_replaces_the_listed_one():
    class MyPreLN(type(LAYER_KINDS["pre_ln"])):
        pass

    old = LAYER_KINDS["pre_ln"]
    try:
        mine = register_layer_kind(MyPreLN())
        assert layer_kind("pre_ln") is mine and layer_kind(True) is mine
    finally:
        registry.LAYER_KINDS["pre_ln"] = old
    with pytest.raises(ValueError, match="unknown topology"):
        register_layer_kind(type("Odd", (LayerKind,), {"name": "odd"})())
