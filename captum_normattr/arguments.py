r"""Command-line argument pieces shared by the method registry and the command line's light view of it.

Stand-alone (floor 0: imports nothing of the package, nor torch), so that
:mod:`captum_normattr.cli.registry_view` can build parsers without importing the registry, and
:class:`~captum_normattr.attr.methods.OptionSpec` adds its option the same way.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, Optional, Sequence, Union

__all__ = ["parse_position", "add_option"]


def parse_position(value: str) -> Union[int, str]:
    r"""A command-line explained position: an integer or ``"last"``.

    Args:
        value: the command-line string.

    Returns:
        the integer, or ``"last"``.

    Raises:
        argparse.ArgumentTypeError: anything else.

    Examples:
        >>> parse_position("-1"), parse_position("last")
        (-1, 'last')
    """
    if value == "last":
        return "last"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'last', got {value!r}") from None


def add_option(parser: argparse.ArgumentParser, flags: Sequence[str], dest: str, default: Any = None,
               choices: Optional[Sequence[Any]] = None, help: str = "", type: Optional[Callable[[str], Any]] = None,
               metavar: Optional[str] = None, used_by: Optional[Sequence[str]] = None) -> None:
    r"""Add one method option to an argparse parser, its help naming the methods that use it.

    Args:
        parser: the parser (or argument group).
        flags: the option's flags (``("--map",)``).
        dest, default, choices, type, metavar: as :meth:`argparse.ArgumentParser.add_argument`.
        help: the help text.
        used_by: method keys appended to the help as ``[methods: ...]``.

    Examples:
        >>> p = argparse.ArgumentParser(); add_option(p, ("--map",), "map", choices=("N", "N_ENC"))
        >>> p.parse_args(["--map", "N"]).map
        'N'
    """
    kwargs: Dict[str, Any] = {"dest": dest, "default": default}
    if type is not None:
        kwargs["type"] = type
    if choices is not None:
        kwargs["choices"] = choices
    if metavar is not None:
        kwargs["metavar"] = metavar
    text = help + (f" [methods: {', '.join(used_by)}]" if used_by else "")
    parser.add_argument(*flags, help=text, **kwargs)
