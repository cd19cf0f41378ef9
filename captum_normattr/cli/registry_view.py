r"""A light view of the method registry, for the command line's parsers: names and options without torch.

``captum-normattr --help``, ``generate --help`` and usage errors must answer at once, so their
parsers cannot import :mod:`captum_normattr.attr.methods` (it imports every attribution class,
hence torch, transformers and Captum). They read :func:`methods` instead:

- once the registry is loaded (a program that imported it, or registered a method with
  :func:`~captum_normattr.attr.methods.register_method`), :func:`methods` is the registry
  itself, :data:`captum_normattr.attr.methods.METHODS`;
- before, it is :data:`SNAPSHOT`, a copy of what the parsers need from the built-in entries:
  each method's key, whether it uses ``--target``, whether it is an LLM method (``generate``),
  and its options with their flags, defaults, choices, help, converters and metavars.

``tests/cli/test_entry.py`` checks that :data:`SNAPSHOT` equals :func:`snapshot_from_registry`
of the live registry, so the two cannot drift: a new method or option is added to the
registry and its line copied here (the failing test prints the new value).

Examples:
    >>> list(methods())[:2]
    ['globenc', 'alti']
    >>> [o.flags[-1] for o in methods()["globenc"].options]
    ['--map', '--rollout', '--position']
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from captum_normattr.arguments import add_option, parse_position

__all__ = ["REGISTRY_MODULE", "SNAPSHOT", "MethodView", "OptionView", "llm_method_names", "methods", "parse_position",
           "snapshot_from_registry"]

#: the module holding the real registry; used when it is already imported
REGISTRY_MODULE = "captum_normattr.attr.methods"


@dataclass(frozen=True)
class OptionView:
    r"""What a parser needs of one method option (the fields of
    :class:`~captum_normattr.attr.methods.OptionSpec` that ``add_to`` reads)."""

    dest: str
    flags: Tuple[str, ...]
    default: Any = None
    choices: Optional[Tuple[Any, ...]] = None
    help: str = ""
    type: Optional[Callable[[str], Any]] = None
    metavar: Optional[str] = None

    def add_to(self, parser: argparse.ArgumentParser, used_by: Optional[List[str]] = None) -> None:
        r"""Add this option to an argparse parser (``used_by``: method keys named in the help), as
        :meth:`OptionSpec.add_to <captum_normattr.attr.methods.OptionSpec.add_to>` does."""
        add_option(parser, self.flags, self.dest, self.default, self.choices, self.help, self.type, self.metavar,
                   used_by)


@dataclass(frozen=True)
class MethodView:
    r"""What a parser needs of one registry entry: its key, options, ``uses_target`` and ``llm``."""

    key: str
    options: Tuple[OptionView, ...] = ()
    uses_target: bool = False
    llm: bool = False


_MAP = OptionView(
    "map", ("--map",), None, ("W", "W_FIXEDRES", "W_RES", "N", "N_FIXEDRES", "N_RES", "N_RESLN", "N_ENC"),
    "GlobEnc layer map: W, W_FIXEDRES, W_RES, N, N_FIXEDRES, N_RES, N_RESLN, N_ENC (default: N_ENC for encoders, "
    "N_RESLN for decoders)", str.upper, "MAP")
_ROLLOUT = OptionView("rollout", ("--rollout",), "raw", ("raw", "row_normalized"),
                      "rollout convention (default: raw, as the GlobEnc code and figures)")
_POSITION = OptionView(
    "position", ("-p", "--position"), None, None,
    "explained position: an integer (k >= 0 counts from the first real token, negative from the last) or 'last' "
    "(default: 0, the [CLS] token, for encoders; 'last' for decoders)", parse_position, "POS")
_SCOPE = OptionView(
    "scope", ("--scope",), None, ("ATB", "FF", "RES2", "LN2"),
    "FF decomposition scope: ATB, FF, RES2, LN2 (default: the whole layer, LN2 for encoders and RES2 for decoders)",
    str.upper, "SCOPE")
_CONTRIBUTION = OptionView("contribution", ("--contribution",), "norm", ("norm", "alti"),
                           "norms of the parts (GlobEnc+FF, default) or ALTI's L1 contributions (ALTI+FF)")
_BIAS_MODE = OptionView("bias_mode", ("--bias-mode",), "separate", ("separate", "spread", "spread_per_key"),
                        "keep biases as their own part (default, exact) or spread them over tokens")

#: the built-in registry entries as the parsers see them (checked against the registry by the tests)
SNAPSHOT: Dict[str, MethodView] = {
    "globenc": MethodView("globenc", (_MAP, _ROLLOUT, _POSITION), uses_target=False, llm=True),
    "alti": MethodView("alti", (_ROLLOUT, _POSITION), uses_target=False, llm=True),
    "ff": MethodView("ff", (_SCOPE, _CONTRIBUTION, _ROLLOUT, _POSITION), uses_target=False, llm=True),
    "decompx": MethodView("decompx", (_BIAS_MODE,), uses_target=True, llm=True),
    "alti-logit": MethodView("alti-logit", (_POSITION,), uses_target=True, llm=True),
    "value-zeroing": MethodView("value-zeroing", (_POSITION,), uses_target=False, llm=False),
    "alti-plus": MethodView("alti-plus", (), uses_target=False, llm=False),
}


def methods() -> Mapping[str, Any]:
    r"""The registry's entries for a parser: the live :data:`~captum_normattr.attr.methods.METHODS` when
    it is imported, else :data:`SNAPSHOT` (nothing heavy is imported either way).

    Returns:
        A mapping key -> entry with ``key``, ``options`` (each with ``dest``, ``flags``, ``add_to``),
        ``uses_target`` and ``llm``.
    """
    live = sys.modules.get(REGISTRY_MODULE)
    registry = getattr(live, "METHODS", None) if live is not None else None
    return registry if registry else SNAPSHOT


def llm_method_names() -> Tuple[str, ...]:
    r"""The keys of the methods that explain positions of a causal LM (``generate``'s ``-m`` choices)."""
    return tuple(key for key, spec in methods().items() if spec.llm)


def _type_of(fn: Optional[Callable[[str], Any]]) -> Optional[Callable[[str], Any]]:
    r"""A converter as the snapshot spells it: the registry's ``parse_position`` is this module's."""
    return parse_position if getattr(fn, "__name__", None) == "parse_position" else fn


def snapshot_from_registry(registry: Mapping[str, Any]) -> Dict[str, MethodView]:
    r"""The :data:`SNAPSHOT` that a registry (``{key: MethodSpec}``) gives.

    Args:
        registry: :data:`captum_normattr.attr.methods.METHODS` (or a mapping of the same entries).

    Returns:
        dict key -> :class:`MethodView`, comparable with ``==`` to :data:`SNAPSHOT`.
    """
    return {
        key: MethodView(
            key,
            tuple(OptionView(o.dest, tuple(o.flags), o.default, o.choices, o.help, _type_of(o.type), o.metavar)
                  for o in spec.options),
            uses_target=bool(spec.uses_target), llm=bool(spec.llm),
        )
        for key, spec in registry.items()
    }
