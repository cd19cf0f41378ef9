r"""The ``captum-normattr`` program: one table of subcommands, each module imported only when it runs.

This is the console script's entry point (``setup.cfg``: ``captum-normattr =
captum_normattr.cli.entry:main``); ``python -m captum_normattr``, ``python -m captum_normattr.cli``
and :func:`captum_normattr.cli.main.main` run the same :func:`main`. It imports nothing but the
standard library, so ``captum-normattr --help``, ``generate --help`` and usage errors answer
without importing torch, transformers or Captum (docs/cli.md, "Start-up time").

:data:`SUBCOMMANDS` maps each subcommand to the module and function that run it, with the
one line the top-level help shows:

- ``explain`` (the default: ``captum-normattr TEXT ...`` is ``captum-normattr explain TEXT ...``):
  :func:`captum_normattr.cli.main.explain_main`;
- ``generate``: :func:`captum_normattr.cli.generate.generate_main`;
- ``evaluate``: :func:`captum_normattr.cli.evaluate.evaluate_main`.

Each function takes the arguments after the subcommand's name and returns the exit code.

Examples (shell)::

    captum-normattr --help                     # the explain options, and every subcommand
    captum-normattr generate --help
    captum-normattr "the film was a delight"   # explain (the default subcommand)
"""
from __future__ import annotations

import importlib
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

__all__ = ["DEFAULT_SUBCOMMAND", "SUBCOMMANDS", "Subcommand", "main", "run_subcommand", "subcommand_lines"]


class Subcommand(NamedTuple):
    r"""Where a subcommand lives: ``module.function(argv) -> exit code``, and its one-line description."""

    module: str
    function: str
    summary: str


#: every subcommand of ``captum-normattr``: name -> (module, function, one line for --help)
SUBCOMMANDS: Dict[str, Subcommand] = {
    "explain": Subcommand("captum_normattr.cli.main", "explain_main",
                          "explain texts (or images, or encoder-decoder pairs) with decomposition methods; "
                          "the default"),
    "generate": Subcommand("captum_normattr.cli.generate", "generate_main",
                           "explain every token a causal LM generates (or a given continuation), from one forward pass"),
    "evaluate": Subcommand("captum_normattr.cli.evaluate", "evaluate_main",
                           "compare the faithfulness of methods on a model and a task"),
}
#: what runs when the first argument names no subcommand
DEFAULT_SUBCOMMAND = "explain"


def subcommand_lines(prog: str = "captum-normattr") -> str:
    r"""The top-level help's list of subcommands, one line each (from :data:`SUBCOMMANDS`).

    Examples:
        >>> print(subcommand_lines().splitlines()[0])
        subcommands (captum-normattr SUBCOMMAND --help for each):
    """
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"subcommands ({prog} SUBCOMMAND --help for each):"]
    lines += [f"  {name.ljust(width)}  {sub.summary}" for name, sub in SUBCOMMANDS.items()]
    return "\n".join(lines)


def run_subcommand(name: str, argv: Sequence[str]) -> int:
    r"""Import the module of subcommand ``name`` and run its function on ``argv``.

    Args:
        name: a key of :data:`SUBCOMMANDS`.
        argv: the arguments after the subcommand's name.

    Returns:
        The subcommand's exit code; 2 (with a message) when its module is not installed.
    """
    sub = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(sub.module)
    except ModuleNotFoundError as err:
        if err.name != sub.module:  # a dependency of the module is missing: its own error
            raise
        print(f"captum-normattr: error: the {name!r} subcommand ({sub.module}) is not part of this installation",
              file=sys.stderr)
        return 2
    run: Callable[[List[str]], int] = getattr(module, sub.function)
    return int(run(list(argv)) or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    r"""Entry point of ``captum-normattr``: dispatch to the subcommand named by the first argument.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 success, 2 usage error, 1 error while running, 130 on Ctrl-C
        (each subcommand's own codes).

    Examples:
        >>> main(["--help"])  # doctest: +SKIP
        usage: captum-normattr [-h] ...
        0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    name = args[0] if args and args[0] in SUBCOMMANDS else None
    return run_subcommand(name or DEFAULT_SUBCOMMAND, args[1:] if name else args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
