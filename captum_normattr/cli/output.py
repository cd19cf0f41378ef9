r"""What a text run of the command line writes: the report (table, JSON, HTML), its pictures, the ``-o`` check.

:func:`check_output_path` refuses an ``-o`` that would destroy an input or cannot be
written, before anything runs; :func:`write_results` writes a run's explanations as the
table, JSON or HTML report (:mod:`captum_normattr.present.report`) to ``-o`` or stdout, the
``--plots`` pictures (:func:`save_plots`) and the ``--html-maps`` figures
(:func:`embed_maps`); :func:`use_agg_backend` checks for matplotlib before a run that draws.
Used by :mod:`captum_normattr.cli.main` (texts; the ``-o`` check of every run) and
:mod:`captum_normattr.cli.seq2seq` (encoder-decoders: :func:`use_agg_backend`).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from captum_normattr.cli.common import PROG, CLIError, can_print_blocks, write_output
from captum_normattr.cli.dataset.resume import same_file
from captum_normattr.tokens import json_for_terminal, visible_text

__all__ = ["check_output_path", "embed_maps", "save_plots", "use_agg_backend", "write_results"]


def use_agg_backend() -> None:
    r"""Select matplotlib's file-only ``Agg`` backend before a run that draws (``--plots``, ``--html-maps``).

    Raises:
        CLIError: when matplotlib is not installed (the message says how to install it).
    """
    try:
        import matplotlib
    except ImportError:
        from captum_normattr.present.figures import MISSING_MATPLOTLIB_MESSAGE

        raise CLIError(MISSING_MATPLOTLIB_MESSAGE) from None
    matplotlib.use("Agg")


def check_output_path(output: Optional[str], inputs: Sequence[Tuple[str, str]], model: Optional[str] = None,
                      refuse_existing: bool = False) -> None:
    r"""Refuse an ``-o`` path that would destroy an input or cannot be written, before anything runs.

    Args:
        output: the ``-o`` path (None: stdout, nothing to check).
        inputs: (what, path) of every input file (``--file``, ``--image``).
        model: the ``--model`` value; an existing file inside a local model folder is refused too.
        refuse_existing: refuse an existing file (table, json and html outputs without
            ``--overwrite``, as jsonl dataset runs refuse to replace a file they would not resume).

    Raises:
        CLIError: when ``output`` is an input (also through symbolic or hard links), an existing
            file of the model folder, a directory, or cannot be created or written.
    """
    if output is None:
        return
    out = Path(output).expanduser()
    for what, name in inputs:
        if same_file(out, Path(name).expanduser()):
            raise CLIError(f"-o {output} is the {what} {name}: writing there would replace the input; "
                           "give another output path")
    if model is not None and out.exists():
        folder = Path(model).expanduser()
        if folder.is_dir() and Path(os.path.realpath(out)).is_relative_to(os.path.realpath(folder)):
            raise CLIError(f"-o {output} is a file of the model folder {model}; give another output path")
    if out.is_dir():
        raise CLIError(f"-o {output} is a directory; give a file path (e.g. {out / 'out.jsonl'})")
    if refuse_existing and out.exists():
        raise CLIError(f"-o {output} exists; pass --overwrite to replace it, or give another path")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CLIError(f"cannot write -o {output}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise CLIError(f"cannot write -o {output}: permission denied")


def save_plots(exps: Sequence[Any], maps: Sequence[Dict[str, Any]], folder: Path, fmt: str,
               exclude_sink: bool = False) -> List[Path]:
    r"""``--plots``: per text and method the layer grid, rollout map, score bars and component maps, and a
    comparison of the methods.

    Args:
        exps: the explanations (:class:`~captum_normattr.present.report.TextExplanation`), one per text.
        maps: per text, method label -> its maps (:func:`captum_normattr.cli.main.explain` with ``keep_maps``).
        folder: where the pictures go.
        fmt: their file format (``png``, ``svg``, ``pdf``).
        exclude_sink: leave the first token out of every picture.

    Returns:
        The paths written.
    """
    from captum_normattr.present import visualization as V

    sink = {"exclude_sink": exclude_sink}
    written = []
    for n, (ex, per_method) in enumerate(zip(exps, maps), start=1):
        for label, m in per_method.items():
            stem = _slug(label)
            toks = m["tokens"]
            written.append(V.save_figure(V.plot_layer_grid(m["layer_maps"], toks, title=f"{label} — layer maps", **sink),
                                         folder / f"text{n:03d}_{stem}_layers.{fmt}"))
            written.append(V.save_figure(V.plot_token_map(m["rollout"], toks, title=f"{label} — rollout", **sink),
                                         folder / f"text{n:03d}_{stem}_rollout.{fmt}"))
            written.append(V.save_figure(V.plot_rollout_row(m["scores"], toks, title=label,
                                                            explained_position=m["explained_position"], **sink),
                                         folder / f"text{n:03d}_{stem}_scores.{fmt}"))
            if m.get("components"):
                fig = V.plot_component_maps(m["components"], toks, title=f"{label} — last layer, component scopes",
                                            **sink)
                written.append(V.save_figure(fig, folder / f"text{n:03d}_{stem}_components.{fmt}"))
        if len(ex.scores) > 1:
            written.append(V.save_figure(V.plot_method_comparison(ex.scores, ex.tokens, title=ex.text[:80], **sink),
                                         folder / f"text{n:03d}_comparison.{fmt}"))
    return written


def embed_maps(exps: Sequence[Any], maps: Sequence[Dict[str, Any]], exclude_sink: bool = False) -> None:
    r"""``--html-maps``: the layer grid and rollout map of every text and method, as PNG data in the report.

    Args:
        exps: the explanations; each one's ``figures`` receives its pictures.
        maps: per text, method label -> its maps (as for :func:`save_plots`).
        exclude_sink: leave the first token out of every picture.
    """
    from captum_normattr.present import visualization as V
    from captum_normattr.present.report import figure_to_data_uri

    for ex, per_method in zip(exps, maps):
        for label, m in per_method.items():
            fig = V.plot_layer_grid(m["layer_maps"], m["tokens"], title=f"{label} — layer maps", exclude_sink=exclude_sink)
            ex.figures[label] = figure_to_data_uri(fig, "png")
            ex.figures[f"{label} — rollout"] = figure_to_data_uri(
                V.plot_token_map(m["rollout"], m["tokens"], title=f"{label} — rollout", exclude_sink=exclude_sink), "png")


def _slug(s: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in s).strip("_").lower()
    while "__" in out:
        out = out.replace("__", "_")
    return out or "method"


def write_results(exps: Sequence[Any], maps: Sequence[Dict[str, Any]], meta: Mapping[str, Any],
                  args: argparse.Namespace, fmt: str, model_name: str) -> None:
    r"""Write a text run's results: the ``--plots`` pictures, then the report in ``fmt`` to ``-o`` or stdout.

    Args:
        exps: the explanations, one per text.
        maps: per text, method label -> its maps (empty unless pictures were asked for).
        meta: the run's description (model, methods, options ...), in the JSON and HTML reports.
        args: the parsed command line (``output``, ``plots``, ``plot_format``, ``html_maps``,
            ``exclude_sink``, ``ascii``, ``raw``, ``quiet`` are read).
        fmt: ``table``, ``json`` or ``html``.
        model_name: the model's name or folder (the HTML title and meta show its
            :func:`~captum_normattr.present.labels.model_display_name`, never an absolute path).

    Raises:
        CLIError: when the output cannot be written.
    """
    from captum_normattr.present import report

    if args.plots:
        written = save_plots(exps, maps, Path(args.plots).expanduser(), args.plot_format, args.exclude_sink)
        if not args.quiet:
            print(f"{PROG}: wrote {len(written)} pictures to {visible_text(args.plots)}", file=sys.stderr)
    if fmt == "json":
        text = report.render_json(exps, dict(meta))
        if args.output is None:  # the same JSON, with bidi overrides and C1 controls as \u escapes
            text = json_for_terminal(text)
    elif fmt == "html":
        if args.html_maps:
            embed_maps(exps, maps, args.exclude_sink)
        from captum_normattr.present.labels import model_display_name

        shown = model_display_name(name_or_path=model_name)  # a folder by its name, never its absolute path
        page_meta = dict(meta, model=shown) if "model" in meta else dict(meta)
        text = report.render_html(exps, page_meta, title=f"{PROG}: {shown}", exclude_sink=args.exclude_sink)
    else:
        text = report.render_table(exps, ascii_only=args.ascii or not can_print_blocks(), shares=not args.raw,
                                   exclude_sink=args.exclude_sink)
    write_output(text, args.output)
    if args.output and not args.quiet:
        print(f"{PROG}: wrote {visible_text(args.output)}", file=sys.stderr)
