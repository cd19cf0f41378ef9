r"""The method registry: one table of our attribution methods, read by the CLI, the
evaluation baselines and the docs.

Every entry is a :class:`MethodSpec`: the command-line key, the Captum class, what it
explains, the constructor options it accepts (with their command-line flag, default,
choices and help), whether its scores depend on ``target``, whether they are signed, and
the groups of models it applies to (encoders, decoders, encoder-decoders). :data:`METHODS` maps the key to its spec.

Examples:
    >>> sorted(METHODS)
    ['alti', 'alti-logit', 'alti-plus', 'decompx', 'ff', 'globenc', 'value-zeroing']
    >>> spec = get_method("globenc")
    >>> spec.cls.__name__, spec.uses_target, spec.signed
    ('GlobEncAttribution', False, False)
    >>> [o.flags[-1] for o in spec.options]
    ['--map', '--rollout', '--position']
    >>> attr = spec.build(model, map_name="N_RES")  # doctest: +SKIP
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from captum_normattr.arguments import add_option, parse_position
from captum_normattr.attr.alti import ALTIAttribution
from captum_normattr.attr.alti_logit import ALTILogitAttribution
from captum_normattr.attr.alti_plus import ALTIPlusAttribution
from captum_normattr.attr.decompx import DecompXAttribution
from captum_normattr.attr.ff_decomposition import FFIntegratedDecomposition
from captum_normattr.attr.globenc import GlobEncAttribution
from captum_normattr.attr.value_zeroing import ValueZeroingAttribution
from captum_normattr.decompose.methods.decompx.parts import BIAS_MODES
from captum_normattr.decompose.kinds.post_ln import GLOBENC_MAPS
from captum_normattr.decompose.primitives.feed_forward import CONTRIBUTIONS, SCOPES
from captum_normattr.decompose.primitives.rollout import ROLLOUT_CONVENTIONS

__all__ = [
    "MODEL_GROUPS",
    "METHODS",
    "MethodSpec",
    "OptionSpec",
    "get_method",
    "method_table_markdown",
    "parse_position",
    "register_method",
    "spec_for",
]

#: the groups of models a method can apply to (not architecture families: see captum_normattr.arch)
MODEL_GROUPS: Tuple[str, ...] = ("encoders", "decoders", "encoder-decoders")
#: the model groups a method applies to unless its entry says otherwise
DEFAULT_MODEL_GROUPS: Tuple[str, ...] = ("encoders", "decoders")


@dataclass(frozen=True)
class OptionSpec:
    r"""One constructor option of a method, and how the command line spells it.

    Attributes:
        dest: the option's name on the command line's namespace (``args.map``).
        param: the constructor keyword it fills (``map_name``).
        flags: the command-line flags (``("--map",)``).
        default: the command-line default; None leaves the constructor's own default
            (which may depend on the model family).
        choices: the allowed values, or None.
        help: one line for ``--help``.
        type: converts the command-line string (e.g. ``str.upper``), or None.
        metavar: shown in ``--help``, or None.
        meta_key: the key of the JSON report's ``meta`` that records the value (default ``dest``).
    """

    dest: str
    param: str
    flags: Tuple[str, ...]
    default: Any = None
    choices: Optional[Tuple[Any, ...]] = None
    help: str = ""
    type: Optional[Callable[[str], Any]] = None
    metavar: Optional[str] = None
    meta_key: Optional[str] = None

    def add_to(self, parser: argparse.ArgumentParser, used_by: Optional[List[str]] = None) -> None:
        r"""Add this option to an argparse parser (``used_by``: method keys named in the help)."""
        add_option(parser, self.flags, self.dest, self.default, self.choices, self.help, self.type, self.metavar,
                   used_by)


MAP_OPTION = OptionSpec(
    "map", "map_name", ("--map",), None, GLOBENC_MAPS,
    "GlobEnc layer map: " + ", ".join(GLOBENC_MAPS) + " (default: N_ENC for encoders, N_RESLN for decoders)",
    type=str.upper, metavar="MAP", meta_key="globenc_map",
)
SCOPE_OPTION = OptionSpec(
    "scope", "scope", ("--scope",), None, SCOPES,
    "FF decomposition scope: " + ", ".join(SCOPES) + " (default: the whole layer, LN2 for encoders and RES2 for decoders)",
    type=str.upper, metavar="SCOPE", meta_key="ff_scope",
)
CONTRIBUTION_OPTION = OptionSpec(
    "contribution", "contribution", ("--contribution",), "norm", CONTRIBUTIONS,
    "norms of the parts (GlobEnc+FF, default) or ALTI's L1 contributions (ALTI+FF)",
)
BIAS_MODE_OPTION = OptionSpec(
    "bias_mode", "bias_mode", ("--bias-mode",), "separate", BIAS_MODES,
    "keep biases as their own part (default, exact) or spread them over tokens",
)
ROLLOUT_OPTION = OptionSpec(
    "rollout", "rollout", ("--rollout",), "raw", ROLLOUT_CONVENTIONS,
    "rollout convention (default: raw, as the GlobEnc code and figures)",
)
POSITION_OPTION = OptionSpec(
    "position", "explained_position", ("-p", "--position"), None, None,
    "explained position: an integer (k >= 0 counts from the first real token, negative from the last) or 'last' "
    "(default: 0, the [CLS] token, for encoders; 'last' for decoders)",
    type=parse_position, metavar="POS", meta_key="explained_position",
)


@dataclass(frozen=True)
class MethodSpec:
    r"""One method of the registry.

    Attributes:
        key: the command-line name (``-m KEY``), lower case.
        cls: the Captum ``Attribution`` class, or None for an entry built by ``factory``.
        description: one line (``--list-methods``).
        explains: what the scores explain (the docs' method table).
        options: the constructor options it accepts.
        uses_target: the scores depend on ``target`` (it is passed to ``decompose`` /
            ``attribute``); False for the class-agnostic maps.
        signed: the scores carry a sign.
        model_groups: the groups of models it applies to, a subset of :data:`MODEL_GROUPS`.
        maps: ``decompose`` returns a :class:`~captum_normattr.result.DecompositionResult`
            and takes ``return_layer_maps`` / ``return_rollout``.
        fixed: constructor keywords always passed.
        factory: ``factory(model, options) -> attribution`` for entries without ``cls``
            (``options``: the command line's namespace); its attribution has
            ``decompose(inputs, additional_forward_args=...)`` returning an
            :class:`~captum_normattr.result.AttributionResult`, or ``attribute(...)``
            returning (B, T) scores.
    """

    key: str
    cls: Optional[type]
    description: str
    explains: str = ""
    options: Tuple[OptionSpec, ...] = ()
    uses_target: bool = False
    signed: bool = False
    model_groups: Tuple[str, ...] = DEFAULT_MODEL_GROUPS
    maps: bool = False
    fixed: Mapping[str, Any] = field(default_factory=dict)
    factory: Optional[Callable[[Any, Any], Any]] = None

    def __post_init__(self) -> None:
        if (self.cls is None) == (self.factory is None):
            raise ValueError(f"method {self.key!r}: give exactly one of cls and factory")
        bad = [f for f in self.model_groups if f not in MODEL_GROUPS]
        if bad:
            raise ValueError(f"method {self.key!r}: unknown model groups {bad}; choose from {MODEL_GROUPS}")

    @property
    def name(self) -> str:
        r"""The command-line name (alias of ``key``)."""
        return self.key

    @property
    def help(self) -> str:
        r"""The one-line description (alias of ``description``)."""
        return self.description

    @property
    def llm(self) -> bool:
        r"""The method explains positions of a causal LM (:meth:`explain_positions`; the LLM API and ``generate``)."""
        return self.cls is not None and callable(getattr(self.cls, "explain_positions", None))

    @property
    def class_name(self) -> str:
        r"""The name of :attr:`cls` (or of ``factory``)."""
        return self.cls.__name__ if self.cls is not None else getattr(self.factory, "__name__", "factory")

    def constructor_kwargs(self, options: Any = None) -> Dict[str, Any]:
        r"""Constructor keywords from command-line options.

        Args:
            options: an ``argparse.Namespace`` or a mapping keyed by option ``dest``;
                missing options take their default; None values are left out so that
                the constructor's (family-dependent) default applies.

        Returns:
            dict ``param -> value`` (plus ``fixed``).
        """
        out = dict(self.fixed)
        for opt in self.options:
            if options is None:
                value = opt.default
            elif isinstance(options, Mapping):
                value = options.get(opt.dest, opt.default)
            else:
                value = getattr(options, opt.dest, opt.default)
            if value is not None:
                out[opt.param] = value
        return out

    def build(self, model: Any, options: Any = None, **kwargs: Any) -> Any:
        r"""The attribution for ``model``.

        Args:
            model: the Hugging Face model.
            options: command-line options (see :meth:`constructor_kwargs`).
            **kwargs: constructor keywords that override the options.

        Returns:
            An instance of ``cls`` (or what ``factory`` returns).
        """
        if self.factory is not None:
            return self.factory(model, options)
        return self.cls(model, **{**self.constructor_kwargs(options), **kwargs})

    def applies_to(self, family: str) -> bool:
        r"""Whether the method applies to ``"encoders"`` or ``"decoders"``."""
        return family in self.model_groups


METHODS: Dict[str, MethodSpec] = {}


def register_method(
    name: Union[str, MethodSpec],
    build: Optional[Callable[[Any, Any], Any]] = None,
    help: str = "",
    *,
    cls: Optional[type] = None,
    explains: str = "",
    options: Tuple[OptionSpec, ...] = (),
    uses_target: bool = False,
    signed: bool = False,
    model_groups: Tuple[str, ...] = DEFAULT_MODEL_GROUPS,
    maps: bool = False,
    fixed: Optional[Mapping[str, Any]] = None,
    replace: bool = False,
) -> MethodSpec:
    r"""Add a method to the registry (and so to the command line).

    Args:
        name: the key, lower case (e.g. ``"my-alti"``), or a ready :class:`MethodSpec`.
        build: ``build(model, options) -> attribution`` (``options``: the command line's
            namespace), for a method without a class entry.
        help: one-line description.
        cls, explains, options, uses_target, signed, model_groups, maps, fixed: see
            :class:`MethodSpec`.
        replace: allow overwriting an existing entry.

    Returns:
        The registered :class:`MethodSpec`.

    Raises:
        ValueError: if the key is taken and ``replace`` is False.

    Examples:
        >>> spec = register_method("my-alti", lambda m, o: None, "demo", replace=True)
        >>> "my-alti" in METHODS
        True
        >>> del METHODS["my-alti"]
    """
    if isinstance(name, MethodSpec):
        spec = name
    else:
        spec = MethodSpec(
            key=name.lower(), cls=cls, description=help, explains=explains, options=tuple(options),
            uses_target=uses_target, signed=signed, model_groups=tuple(model_groups), maps=maps,
            fixed=dict(fixed or {}), factory=build,
        )
    if spec.key in METHODS and not replace:
        raise ValueError(f"method {spec.key!r} is already registered")
    METHODS[spec.key] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    r"""The spec of method ``name`` (case-insensitive).

    Raises:
        ValueError: for an unknown name; the message lists the registered ones.
    """
    key = str(name).lower()
    if key not in METHODS:
        raise ValueError(f"unknown method {key!r}; available: {', '.join(METHODS)}")
    return METHODS[key]


def spec_for(attribution: Any) -> Optional[MethodSpec]:
    r"""The registry entry of an attribution instance's class (the first one), or None."""
    for spec in METHODS.values():
        if spec.cls is not None and type(attribution) is spec.cls:
            return spec
    return None


register_method(MethodSpec(
    "globenc", GlobEncAttribution,
    "GlobEnc and the norm-based maps of Kobayashi et al. (choose the map with --map)",
    explains="the explained row of the rolled-out norm-based layer maps (class-agnostic)",
    options=(MAP_OPTION, ROLLOUT_OPTION, POSITION_OPTION), maps=True,
))
register_method(MethodSpec(
    "alti", ALTIAttribution,
    "ALTI, L1-distance contributions (Ferrando et al. 2022)",
    explains="the explained row of the rolled-out ALTI layer maps (class-agnostic)",
    options=(ROLLOUT_OPTION, POSITION_OPTION), maps=True,
))
register_method(MethodSpec(
    "ff", FFIntegratedDecomposition,
    "whole-layer maps with the feed-forward block (Kobayashi et al. 2023): GlobEnc+FF, or ALTI+FF with "
    "--contribution alti; choose the scope with --scope",
    explains="the explained row of the rolled-out whole-layer maps, FF block included (class-agnostic)",
    options=(SCOPE_OPTION, CONTRIBUTION_OPTION, ROLLOUT_OPTION, POSITION_OPTION), maps=True,
))
register_method(MethodSpec(
    "decompx", DecompXAttribution,
    "DecompX (Modarressi et al. 2023): signed scores of the target class (-t; default: predicted) "
    "of a sequence classifier; --bias-mode separate|spread",
    explains="a class logit of a sequence classifier, or a next-token logit of a causal LM",
    options=(BIAS_MODE_OPTION,), uses_target=True, signed=True,
))
register_method(MethodSpec(
    "alti-logit", ALTILogitAttribution,
    "ALTI-Logit (Ferrando et al. 2023): signed contributions to the next-token logit of a causal LM "
    "(-t token id; default: the predicted token)",
    explains="a next-token logit of a causal LM (or target minus foil)",
    options=(POSITION_OPTION,), uses_target=True, signed=True, model_groups=("decoders",),
))
register_method(MethodSpec(
    "value-zeroing", ValueZeroingAttribution,
    "Value Zeroing (Mohebbi et al. 2023): cosine distance of each layer's output when one token's value is zeroed "
    "(O(T) layer reruns)",
    explains="the explained row of the rolled-out, row-normalised Value Zeroing maps (class-agnostic)",
    options=(POSITION_OPTION,), maps=True,
))

register_method(MethodSpec(
    "alti-plus", ALTIPlusAttribution,
    "ALTI+ (Ferrando et al. 2022): source and target-prefix contributions of an encoder-decoder "
    "(BART, Marian, mBART, M2M100/NLLB, Pegasus, T5/mT5)",
    explains="every decoder position's contributions from the source tokens and the target prefix (rows sum to 1)",
    model_groups=("encoder-decoders",),
))


def method_table_markdown(methods: Optional[Mapping[str, MethodSpec]] = None) -> str:
    r"""The docs' method table (Markdown), rendered from the registry.

    Columns: CLI name, class, what it explains, ``target``?, signed?, model groups, options
    (command-line flag, with the constructor keyword where it differs).

    Examples:
        >>> print(method_table_markdown().splitlines()[0])
        | name | class | explains | target? | signed? | model groups | options |
    """
    rows = [
        "| name | class | explains | target? | signed? | model groups | options |",
        "|---|---|---|:-:|:-:|---|---|",
    ]
    for spec in (METHODS if methods is None else methods).values():
        opts = ", ".join(
            f"`{o.flags[-1]}`" + ("" if o.flags[-1].lstrip("-").replace("-", "_") == o.param else f" (`{o.param}`)")
            for o in spec.options
        ) or "—"
        rows.append(
            f"| `{spec.key}` | `{spec.class_name}` | {spec.explains or spec.description} | "
            f"{'yes' if spec.uses_target else 'no'} | {'yes' if spec.signed else 'no'} | "
            f"{', '.join(spec.model_groups)} | {opts} |"
        )
    return "\n".join(rows)
