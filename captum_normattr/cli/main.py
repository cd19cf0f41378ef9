r"""The ``captum-normattr`` command line: explain texts with decomposition methods.

Examples (shell)::

    captum-normattr "the film was a delight"                       # packaged MiniLM, GlobEnc
    captum-normattr "the film was a delight" -m globenc alti --map N_RES
    captum-normattr -m globenc,alti "the film was a delight"           # methods and texts in any order
    captum-normattr explain -m alti -m ff "the film was a delight"     # 'explain' is the default subcommand
    captum-normattr --file texts.txt -m alti --format json -o out.json
    captum-normattr --file texts.txt --format html -o report.html --html-maps
    captum-normattr --file texts.jsonl --column text -m alti --format jsonl -o out.jsonl   # resumable
    accelerate launch --num_processes 4 -m captum_normattr --file texts.txt -m alti -o out.jsonl
    captum-normattr "the film was a delight" -m ff --scope RES2 --plots pics/
    captum-normattr "An unbelievably good film. Dull ending." --aggregate sentence
    captum-normattr --model DIR "The keys to the cabinet" -m alti-logit --exclude-sink   # rank without the sink
    captum-normattr --list-methods
    captum-normattr --model DIR -m alti-plus --source "source text" --target-text "reference"  # encoder-decoders
    captum-normattr --model DIR --file pairs.tsv -m alti-plus --format jsonl -o out.jsonl        # source<TAB>target

Encoder-decoders (``-m alti-plus``, implied by ``--source``) take their own inputs and outputs
(:mod:`captum_normattr.cli.seq2seq`; docs/cli.md): teacher-forced
targets or greedy generation, a table per target token, JSON / JSON Lines records with the
T x S source and T x T target contributions, and the contribution-matrix and source-share plots.

What the command-line modules share (errors, input files, model loading, limits, one batch)
is in :mod:`captum_normattr.cli.common`; what a text run writes (the report, ``--plots``,
``--html-maps``, the ``-o`` check) is in :mod:`captum_normattr.cli.output`. ``--exclude-sink``
leaves the first token out of the table's scale, the HTML colours and the pictures, never
out of the scores (docs/cli.md).

Methods come from the registry, :data:`captum_normattr.attr.methods.METHODS` (re-exported
here as :data:`METHODS`): its keys are the ``-m`` choices, and every option a method
accepts (``--map``, ``--scope`` ...) is declared there with its flag, default and choices.
A new method adds itself with :func:`register_method`::

    from captum_normattr.cli.main import register_method
    register_method("my-alti", lambda model, opts: MyAttribution(model), "my ALTI variant")

Subcommands: :data:`captum_normattr.cli.entry.SUBCOMMANDS` (``explain``: :func:`explain_main`, the
default; ``generate``; ``evaluate``). The parser imports nothing heavy (the methods come from
:func:`captum_normattr.cli.registry_view.methods`): ``--help`` and usage errors do not import torch.

Methods (``-m``/``--method``) are given as names, comma lists or both, and ``-m`` may be
repeated. After ``-m``, the values that are not method names are texts (so
``-m globenc alti "a text"`` explains "a text" with two methods), except that a word
close to a method name is refused as a misspelt method. ``explain`` as the first
argument is the subcommand and is dropped (``captum-normattr explain explain`` explains
the word "explain"); elsewhere it is a text, with a note on stderr. Texts longer than the model's limit are truncated with a
warning on stderr naming the text and the number of tokens cut.

Model folders with their own code (``auto_map``) are refused unless ``--trust-remote-code``
is given: every ``from_pretrained`` gets ``trust_remote_code`` explicitly, so transformers never
prompts. ``-o`` may not be an input, a directory or unwritable; input lines end at ``\n`` /
``\r\n`` only (:func:`~captum_normattr.cli.common.split_lines`).

Exit codes: 0 success, 2 usage errors (unknown model, method or file, bad option, bad ``-o``,
a model with its own code, a folder without tokenizer), 1 for an error raised while explaining,
130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

from captum_normattr.cli.common import (
    ALTI_PLUS,
    PROG,
    CLIError,
    build_attributions,
    explain_batch,
    is_decoder,
    load_model,
    looks_like_path,
    read_stdin_lines,
    read_text_lines,
    resolve_device,
    resolve_max_length,
)
from captum_normattr.cli.entry import SUBCOMMANDS, subcommand_lines
from captum_normattr.cli.entry import main as entry_main
from captum_normattr.cli.output import check_output_path, use_agg_backend, write_results
from captum_normattr.cli.registry_view import methods
from captum_normattr.progress import progress_bar
from captum_normattr.tokens import terminal_lines

if TYPE_CHECKING:  # the registry imports torch: for the annotations only
    from captum_normattr.attr.methods import MethodSpec

__all__ = ["CLIError", "METHODS", "MethodSpec", "SUBCOMMANDS", "build_parser", "explain", "explain_main", "main",
           "method_options", "register_method"]

#: what this module re-exports from the registry, imported when first asked for (the registry imports torch)
_REGISTRY_NAMES = ("METHODS", "MethodSpec", "OptionSpec", "get_method", "register_method")


def __getattr__(name: str) -> Any:
    r"""``METHODS``, ``MethodSpec``, ``register_method`` ...: the registry's own objects
    (:mod:`captum_normattr.attr.methods`), imported on first use so that parsing stays light."""
    if name in _REGISTRY_NAMES:
        import captum_normattr.attr.methods as registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- parsing


def method_options(specs: Optional[Sequence[Any]] = None) -> Dict[str, Tuple[Any, List[str]]]:
    r"""The options of the registry's methods, once each: ``dest -> (option, method keys using it)``.

    Args:
        specs: registry entries (default: every method, from the light view
            :func:`~captum_normattr.cli.registry_view.methods`, which imports nothing heavy).

    Raises:
        ValueError: when two methods declare different options under one ``dest``.
    """
    out: Dict[str, Tuple[Any, List[str]]] = {}
    for spec in (methods().values() if specs is None else specs):
        for opt in spec.options:
            if opt.dest in out:
                if out[opt.dest][0] != opt:
                    raise ValueError(f"methods {out[opt.dest][1]} and {spec.key!r} declare different --{opt.dest} options")
                out[opt.dest][1].append(spec.key)
            else:
                out[opt.dest] = (opt, [spec.key])
    return out


def _positive_int(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


#: this module's subcommand, the default one (:data:`~captum_normattr.cli.entry.SUBCOMMANDS`)
SUBCOMMAND = "explain"


def _is_method_list(value: str) -> bool:
    r"""True when ``value`` is a method name or a comma list of method names (case-insensitive)."""
    names = [m.strip().lower() for m in value.split(",") if m.strip()]
    known = methods()
    return bool(names) and all(n in known for n in names)


def _near_method(value: str) -> Optional[str]:
    r"""A registered method ``value`` looks like a misspelling of (one word, close to a name), or None."""
    import difflib

    word = value.strip().lower()
    if not word or any(c.isspace() for c in word):
        return None
    known = methods()
    for part in word.split(","):
        close = difflib.get_close_matches(part, list(known), n=1, cutoff=0.75)
        if part not in known and close:
            return close[0]
    return None


class _MethodsAction(argparse.Action):
    r"""``-m``: method names (or comma lists), repeatable; trailing values that are not methods are texts.

    The first value must be a method (else: an unknown-method error). Later values are
    methods while they name methods; the first one that does not starts the texts, which
    are kept in ``namespace.trailing_texts``. A one-word value close to a method name is
    refused as a misspelling rather than explained as a text.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        chosen = list(getattr(namespace, self.dest, None) or [])
        texts = list(getattr(namespace, "trailing_texts", None) or [])
        for i, value in enumerate(values):
            if i == 0 or (not texts and _is_method_list(value)):
                chosen.append(value)
                continue
            near = _near_method(value) if not texts else None
            if near is not None:
                parser.error(
                    f"argument {option_string}: unknown method {value!r} (did you mean {near!r}?); "
                    f"available: {', '.join(methods())}"
                )
            texts.append(value)
        setattr(namespace, self.dest, chosen)
        namespace.trailing_texts = texts


class _Parser(argparse.ArgumentParser):
    r"""argparse's parser; a usage error echoes the user's arguments neutralised (:func:`terminal_lines`)."""

    def error(self, message: str):  # type: ignore[override]
        super().error(terminal_lines(message))


def build_parser() -> argparse.ArgumentParser:
    r"""The argument parser of ``captum-normattr`` (``explain``, the default subcommand).

    Built from light modules only (the methods from :func:`~captum_normattr.cli.registry_view.methods`),
    so ``--help`` and usage errors answer without importing torch; its help ends with every
    subcommand (:data:`~captum_normattr.cli.entry.SUBCOMMANDS`).

    Returns:
        An ``argparse.ArgumentParser``.
    """
    known = methods()
    p = _Parser(
        prog=PROG,
        description="Explain texts with layer-decomposition attributions (GlobEnc, ALTI, ...) "
        "of a Hugging Face Transformer. Without --model the packaged pretrained "
        "all-MiniLM-L6-v2 is used, so it works offline.",
        epilog="examples:\n"
        f"  {PROG} \"the film was a delight\"\n"
        f"  {PROG} -m globenc alti --map N_RES \"the film was a delight\"\n"
        f"  {PROG} explain -m globenc,alti \"the film was a delight\"\n"
        f"  {PROG} --file texts.txt --format html -o report.html\n"
        f"  {PROG} -m ff --scope RES2 --plots pics/ \"the film was a delight\"\n"
        f"  {PROG} --model DIR -m alti-plus --source \"das Haus\" --target-text \"the house\"   # encoder-decoders\n"
        f"  {PROG} --model DIR -m alti-plus --file pairs.tsv --format jsonl -o out.jsonl\n\n"
        + subcommand_lines(PROG),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("texts", nargs="*", metavar="TEXT",
                   help=f"text(s) to explain (a first argument naming a subcommand, {', '.join(SUBCOMMANDS)}, runs it: "
                   f"'{PROG} {SUBCOMMAND} TEXT' explains any text)")
    p.add_argument("--image", nargs="+", metavar="PATH", default=None,
                   help="explain image(s) with a Vision Transformer (--model: a local folder with its image processor)")
    p.add_argument("-f", "--file", metavar="PATH",
                   help="file with one text per line (blank lines skipped); '-' reads stdin")
    p.add_argument("--model", metavar="NAME_OR_PATH",
                   help="Hugging Face Hub name or local model folder (default: packaged all-MiniLM-L6-v2)")
    p.add_argument("-m", "--method", nargs="+", action=_MethodsAction, default=None, metavar="METHOD",
                   help=f"one or more of: {', '.join(known)} (default: globenc), as names or comma lists; "
                   "repeatable; texts may follow the methods; see --list-methods")
    for opt, used_by in method_options().values():
        opt.add_to(p, used_by)
    target_users = [k for k, spec in known.items() if spec.uses_target]
    p.add_argument("-t", "--target", type=int, default=None,
                   help=f"target class/token passed to the methods that use it [methods: {', '.join(target_users)}]")
    p.add_argument("-b", "--batch-size", type=_positive_int, default=8, help="texts per batch (default: 8)")
    p.add_argument("--max-length", type=_positive_int, default=None,
                   help="truncate texts to this many tokens (default: the model's limit)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model folder (or Hub model) to run its own Python code (auto_map in its "
                   "config.json); off by default: such a model is refused, and nothing ever prompts")
    p.add_argument("--format", choices=("table", "json", "html", "jsonl"), default=None,
                   help="output format (default: from the --output suffix, else table); jsonl: one record per "
                   "text, resumable, runs under accelerate launch (docs/scale.md)")
    p.add_argument("-o", "--output", metavar="PATH", help="write the output to PATH instead of stdout")
    p.add_argument("--html-maps", action="store_true",
                   help="HTML: embed the layer-map grid and rollout heat map of every text and method")
    p.add_argument("--plots", metavar="DIR",
                   help="save pictures per text and method (layer grid, rollout map, attribution bars) to DIR")
    p.add_argument("--plot-format", choices=("png", "svg", "pdf"), default="png",
                   help="file format of --plots (default: png)")
    p.add_argument("--aggregate", choices=("word", "sentence"), default=None,
                   help="show words or sentences instead of tokens: the sum of their token scores "
                   "(special tokens dropped; needs a fast tokenizer), in the table, JSON, HTML and --plots")
    p.add_argument("--exclude-sink", action="store_true",
                   help="leave the first token (where attention sinks sit: [CLS], BOS, the first word of a decoder "
                   "prompt) out of the table's bar scale and shares, the HTML colours and --plots; the scores are "
                   "unchanged, and every text reports the first token's share (sink_share)")
    p.add_argument("--raw", action="store_true",
                   help="table: raw scores for every method (default: unsigned methods, whose raw rollout rows "
                   "can sum to e.g. 1e5, as shares of their row)")
    p.add_argument("--ascii", action="store_true", help="table: ASCII bars instead of Unicode blocks")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--list-methods", action="store_true", help="list the available methods and exit")
    from captum_normattr.cli.dataset.run import add_arguments

    add_arguments(p)  # --column, --id-column, --split, --overwrite
    g = p.add_argument_group("encoder-decoders (-m alti-plus; see docs/seq2seq.md)")
    g.add_argument("--source", action="append", default=None, metavar="TEXT",
                   help="a source sentence of an encoder-decoder (repeatable; implies -m alti-plus); TEXT arguments "
                   "given with -m alti-plus are sources too; --file: one 'source<TAB>target' pair or one source per line")
    g.add_argument("--target-text", action="append", default=None, metavar="TEXT",
                   help="the reference target of each --source, teacher-forced (repeatable, in order); "
                   "without it the model generates (greedy) and the generated tokens are explained")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64, metavar="N",
                   help="generation: at most this many new tokens (default: 64)")
    g.add_argument("--conventions", choices=("default", "official"), default="default",
                   help="ALTI+: 'default' (exact norm scale, plain L1) or 'official' (the official code's "
                   "unbiased std, +1e-6 in the L1 distance, row re-normalisation)")
    g.add_argument("--top", type=_positive_int, default=3, metavar="K",
                   help="table: the top source tokens shown per target token (default: 3)")
    return p


# --------------------------------------------------------------------------- inputs


def read_texts(texts: Sequence[str], file: Optional[str]) -> List[str]:
    r"""Collect the texts from the positional arguments and ``--file``.

    Args:
        texts: texts given on the command line.
        file: path of a UTF-8 file with one text per line, ``"-"`` for stdin, or None.

    Returns:
        The texts, in order, blank lines dropped.

    Raises:
        CLIError: when the file cannot be read, or there is no text at all.
    """
    out = [t for t in texts if t.strip()]
    if file is not None:
        if file == "-":
            lines = read_stdin_lines()
        else:
            path = Path(file).expanduser()
            if not path.exists():
                raise CLIError(f"file not found: {file}")
            if not path.is_file():
                raise CLIError(f"not a file: {file}")
            lines = read_text_lines(path, file)
        out.extend(line.strip() for line in lines if line.strip())
    if not out:
        raise CLIError("no text to explain: give TEXT arguments or --file PATH")
    return out


# --------------------------------------------------------------------------- explaining


def _batches(items: Sequence[str], size: int) -> Iterator[Tuple[int, Sequence[str]]]:
    for start in range(0, len(items), size):
        yield start, items[start:start + size]


def _predictions(model: Any, tok: Any, enc: Dict[str, Any], positions: Any) -> Optional[List[str]]:
    r"""Readable predictions of a classifier or causal LM; None for a base model."""
    import torch

    cfg = model.config
    cls_name = type(model).__name__
    is_cls = cls_name.endswith("ForSequenceClassification")
    is_lm = cls_name.endswith(("ForCausalLM", "LMHeadModel"))
    if not (is_cls or is_lm):
        return None
    with torch.no_grad():
        out = model(**enc)
    logits = getattr(out, "logits", None)
    if logits is None:
        return None
    if is_cls and logits.dim() == 2:
        probs = logits.float().softmax(-1)
        p, k = probs.max(-1)
        labels = getattr(cfg, "id2label", None) or {}
        return [f"{labels.get(int(ki), labels.get(str(int(ki)), int(ki)))} ({float(pi):.3f})"
                for pi, ki in zip(p, k)]
    if is_lm and logits.dim() == 3:
        rows = logits[torch.arange(logits.shape[0]), positions.to(logits.device)].float().softmax(-1)
        p, k = rows.max(-1)
        return [f"next token {tok.decode([int(ki)])!r} ({float(pi):.3f})" for pi, ki in zip(p, k)]
    return None


def _method_label(res: Any, spec: MethodSpec, taken: Dict[str, Any]) -> str:
    from captum_normattr.result import AttributionResult

    label = (res.method if isinstance(res, AttributionResult) else "") or spec.key
    if label in taken:
        label = f"{label} [{spec.key}]"
    return label


def explain(
    texts: Sequence[str],
    model: Any,
    tokenizer: Any,
    specs: Sequence[MethodSpec],
    options: argparse.Namespace,
    *,
    progress: bool = True,
    keep_maps: bool = False,
) -> Tuple[List[Any], List[Dict[str, Any]]]:
    r"""Explain ``texts`` with every method in ``specs``, batch by batch.

    Args:
        texts: the texts.
        model: the model (on its device).
        tokenizer: its tokenizer.
        specs: the methods.
        options: parsed options (``position``, ``target``, ``batch_size``,
            ``max_length`` ... are used).
        progress: show a progress bar on stderr when there is more than one batch.
        keep_maps: also return per text and method the unpadded layer maps, rollout
            and scores (for pictures).

    Returns:
        (explanations, maps): a list of :class:`~captum_normattr.present.report.TextExplanation`
        and, per text, a dict method label -> ``example_from_result`` dict (empty
        dicts unless ``keep_maps``).
    """
    from captum_normattr.attr.inputs import explained_positions
    from captum_normattr.present.report import delta_caption, explanations_from_results
    from captum_normattr.result import AttributionResult, DecompositionResult
    from captum_normattr.tokens import readable_tokens
    from captum_normattr.present.visualization import example_from_result

    device = next(model.parameters()).device
    attrs = build_attributions(specs, model, options)
    max_len = resolve_max_length(model, tokenizer, options.max_length)
    side = getattr(tokenizer, "truncation_side", "right")
    all_exps: List[Any] = []
    all_maps: List[Dict[str, Any]] = []
    n_batches = (len(texts) + options.batch_size - 1) // options.batch_size
    bar = progress_bar(n_batches, enabled=progress)
    try:
        for start, chunk in _batches(texts, options.batch_size):
            if max_len is not None:
                _warn_truncation(tokenizer, chunk, start, max_len, side)
            enc = tokenizer(list(chunk), return_tensors="pt", padding=True,
                            truncation=max_len is not None, max_length=max_len)
            ids = enc["input_ids"].to(device)
            mask = enc["attention_mask"].to(device)
            results: Dict[str, Any] = {}
            for spec, attr in attrs:
                try:
                    res = explain_batch(spec, attr, ids, mask, options.target, keep_maps)
                except (ValueError, TypeError, NotImplementedError) as err:
                    raise CLIError(f"{spec.key}: {err}") from None
                results[_method_label(res, spec, results)] = res
            known = [r.explained_position for r in results.values()
                     if isinstance(r, AttributionResult) and r.explained_position is not None]
            pos = known[0] if known else explained_positions(options.position, mask.bool())
            fwd = {"input_ids": ids, "attention_mask": mask}
            preds = _predictions(model, tokenizer, fwd, pos)
            tokens = [readable_tokens(tokenizer, row) for row in enc["input_ids"].tolist()]
            exps = explanations_from_results(
                chunk, tokens, results,
                attention_mask=mask.cpu(), explained_position=pos.cpu(), predictions=preds,
            )
            level = getattr(options, "aggregate", None)
            spans = _aggregation_spans(enc, mask, chunk, level) if level else None
            for i, ex in enumerate(exps):
                maps: Dict[str, Any] = {}
                for label, res in results.items():
                    if not isinstance(res, AttributionResult):
                        continue  # plain scores: nothing more to show
                    err = res.extras.get("completeness_error")
                    if res.delta is not None:  # the explained logit's own error (ALTI-Logit's includes its layers')
                        ex.extras[delta_caption(label, bool(res.signed))] = float(res.delta[i].abs())
                    elif err is not None:
                        ex.extras[f"{label}: max completeness error"] = float(err.max())
                    if keep_maps and isinstance(res, DecompositionResult) and res.layer_maps is not None \
                            and res.rollout is not None:
                        m = example_from_result(res, i, tokens[i])
                        m["components"] = _component_maps(res, i)
                        maps[label] = m if spans is None else _aggregate_maps(m, spans[i])
                all_maps.append(maps)
            if spans is not None:
                exps = [ex.aggregated(sp, unit=level) for ex, sp in zip(exps, spans)]
            all_exps.extend(exps)
            bar.update(1)
    finally:
        bar.close()
    return all_exps, all_maps


def _warn_truncation(tokenizer: Any, chunk: Sequence[str], start: int, max_len: int, side: str) -> List[int]:
    r"""Warn on stderr for every text of ``chunk`` longer than ``max_len`` tokens.

    Returns:
        the number of tokens cut from each text of ``chunk`` (0 where none).
    """
    lengths = [len(ids) for ids in tokenizer(list(chunk), truncation=False, verbose=False)["input_ids"]]
    cut = [max(0, n - max_len) for n in lengths]
    for i, (n, c) in enumerate(zip(lengths, cut)):
        if c:
            where = "first" if side == "left" else "last"
            print(
                f"{PROG}: warning: text {start + i + 1} has {n} tokens but the limit is {max_len}: "
                f"its {where} {c} token(s) were cut (see --max-length)",
                file=sys.stderr,
            )
    return cut


def _aggregation_spans(enc: Any, mask: Any, texts: Sequence[str], level: str) -> List[List[Any]]:
    r"""Per text, the word or sentence spans of ``--aggregate``, indexing the unpadded tokens."""
    from captum_normattr.aggregation import Span, spans_for

    if not getattr(enc, "encodings", None):
        raise CLIError("--aggregate needs a fast tokenizer (word ids and character offsets); this model's is not")
    out = []
    for i in range(mask.shape[0]):
        keep = mask[i].bool().nonzero().squeeze(-1).tolist()
        where = {p: k for k, p in enumerate(keep)}
        spans = spans_for(level, enc, i, texts=list(texts))
        out.append([Span(sp.label, tuple(where[p] for p in sp.tokens)) for sp in spans])
    return out


def _aggregate_maps(m: Dict[str, Any], spans: Sequence[Any]) -> Dict[str, Any]:
    r"""An ``example_from_result`` dict over words/sentences: maps sum source columns and average
    target rows (:func:`captum_normattr.aggregation.aggregate_map`), scores are summed."""
    from captum_normattr.aggregation import aggregate_map, aggregate_scores

    out = dict(m)
    out["tokens"] = [sp.label for sp in spans]
    for key in ("layer_maps", "rollout"):
        if m.get(key) is not None:
            out[key] = aggregate_map(m[key], spans)
    out["scores"] = aggregate_scores(m["scores"], spans)
    out["components"] = {k: aggregate_map(v, spans) for k, v in (m.get("components") or {}).items()}
    pos = m.get("explained_position")
    out["explained_position"] = None if pos is None else next(
        (k for k, sp in enumerate(spans) if pos in sp.tokens), None)
    return out


def _component_maps(res: Any, b: int) -> Dict[str, Any]:
    r"""Last-layer component-scope maps (``extras["scope_<NAME>"]``, (B, L, T, T)) of one example, pads removed."""
    keep = res.real_tokens(b).cpu()
    out: Dict[str, Any] = {}
    for key, val in res.extras.items():
        if key.startswith("scope_") and val.dim() == 4:
            last = val[b, -1].detach().cpu().double()
            out[key[len("scope_"):]] = last[keep][:, keep]
    return out


def _list_methods() -> str:
    r"""``--list-methods``: every registered method, its description, options and properties."""
    from captum_normattr.attr.methods import METHODS

    width = max(len(k) for k in METHODS)
    lines = []
    for key, spec in METHODS.items():
        lines.append(f"{key.ljust(width)}  {spec.description}")
        facts = [", ".join(spec.model_groups)]
        if spec.options:
            facts.append("options " + " ".join(o.flags[-1] for o in spec.options))
        if spec.uses_target:
            facts.append("uses --target")
        if spec.signed:
            facts.append("signed scores")
        lines.append(f"{''.ljust(width)}  ({'; '.join(facts)})")
    return "\n".join(lines)


def _check_paths(args: argparse.Namespace, refuse_existing: bool = False) -> None:
    r"""Usage errors of the paths, before anything is loaded: ``--image`` without ``--model``, a missing
    model folder, and an ``-o`` that is an input, a directory or unwritable (:func:`check_output_path`)."""
    if args.image and not args.model:
        raise CLIError("--image needs --model DIR: a local folder with an image classifier and its image processor")
    if args.model and looks_like_path(args.model) and not Path(args.model).expanduser().exists():
        raise CLIError(f"model folder not found: {args.model}")
    inputs = [("input file", args.file)] if args.file not in (None, "-") else []
    inputs += [("input image", image) for image in (args.image or [])]
    check_output_path(args.output, inputs, args.model, refuse_existing=refuse_existing)


def _specs(names: Sequence[str]) -> List["MethodSpec"]:
    r"""The registry entries of ``names`` (importing the registry, hence torch: only to run)."""
    from captum_normattr.attr.methods import get_method

    try:
        return [get_method(m) for m in names]
    except ValueError as err:
        raise CLIError(str(err)) from None


def _run(args: argparse.Namespace) -> int:
    if args.list_methods:
        print(terminal_lines(_list_methods()))  # registered descriptions are anyone's text
        return 0
    default = [ALTI_PLUS] if (args.source or args.target_text) else ["globenc"]
    names = list(dict.fromkeys(m.strip().lower() for arg in (args.method or default) for m in arg.split(",")
                               if m.strip()))
    known = methods()  # the light view: an unknown method is a usage error before torch is imported
    for name in names:
        if name not in known:
            near = _near_method(name)
            hint = f" (did you mean {near!r}?)" if near else ""
            raise CLIError(f"unknown method {name!r}{hint}; available: {', '.join(known)}")
    fmt = args.format
    if fmt is None:
        suffix = Path(args.output).suffix.lower() if args.output else ""
        fmt = {".json": "json", ".html": "html", ".htm": "html", ".jsonl": "jsonl"}.get(suffix, "table")
    _check_paths(args, refuse_existing=fmt != "jsonl" and not args.overwrite)
    if args.source or args.target_text or ALTI_PLUS in names:  # encoder-decoders
        from captum_normattr.cli.seq2seq import run_seq2seq

        return run_seq2seq(args, _specs(names), fmt)
    if args.image:  # Vision Transformers: see captum_normattr/present/vision.py
        if args.exclude_sink:
            raise CLIError("--exclude-sink does not apply to --image: the [CLS] and other prefix tokens are shown "
                           "apart from the top patches already")
        from captum_normattr.cli.images import run_image_cli

        return run_image_cli(args, _specs(names))
    if fmt == "jsonl":  # dataset runs: captum_normattr/cli/dataset/run.py
        from captum_normattr.cli.dataset.run import run_cli

        return run_cli(args, _specs(names))
    if args.html_maps and fmt != "html":
        raise CLIError("--html-maps needs --format html (or an --output ending in .html)")
    if args.exclude_sink and args.aggregate:
        raise CLIError(f"--exclude-sink leaves the first token out, --aggregate {args.aggregate} shows "
                       f"{args.aggregate}s without the special tokens: use one of them (the first token's share, "
                       "sink_share, is reported either way)")
    if args.html_maps or args.plots:
        use_agg_backend()
    given = list(args.texts) + list(getattr(args, "trailing_texts", None) or [])
    if SUBCOMMAND in given:
        print(f"{PROG}: note: explaining the word {SUBCOMMAND!r} as a text; the subcommand {SUBCOMMAND!r} is "
              f"recognised only as the first argument ({PROG} {SUBCOMMAND} [options] TEXT ...)", file=sys.stderr)
    texts = read_texts(given, args.file)
    specs = _specs(names)
    device = resolve_device(args.device)
    model, tok, model_name = load_model(args.model, device, args.trust_remote_code)
    if tok.pad_token is None:
        if getattr(tok, "eos_token", None) is not None:
            tok.pad_token = tok.eos_token
        else:
            raise CLIError("the tokenizer has no pad token and no end-of-sequence token to pad with")
    if args.position is None:
        args.position = "last" if is_decoder(model) else 0
    exps, maps = explain(texts, model, tok, specs, args, progress=not args.quiet,
                         keep_maps=bool(args.html_maps or args.plots))
    meta: Dict[str, Any] = {"model": model_name, "methods": [s.key for s in specs]}
    for opt, _ in method_options(specs).values():  # the options of the methods that ran
        meta[opt.meta_key or opt.dest] = getattr(args, opt.dest)
    meta.update(explained_position=args.position, target=args.target, device=str(device), texts=len(texts),
                aggregate=args.aggregate, exclude_sink=args.exclude_sink or None,
                scores="raw attributions as computed (not shares); row_totals: their sum over the tokens of the text")
    meta = {k: v for k, v in meta.items() if v is not None}
    write_results(exps, maps, meta, args, fmt, model_name)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    r"""Entry point of ``captum-normattr``: every subcommand (:func:`captum_normattr.cli.entry.main`).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``); a first argument naming a subcommand runs
            it, anything else is explained (:func:`explain_main`).

    Returns:
        The exit code: 0 success, 2 usage error (no traceback), 1 error while explaining, 130 on Ctrl-C.

    Examples:
        >>> main(["--list-methods"])  # doctest: +SKIP
        globenc  GlobEnc and the norm-based maps ...
        0
    """
    return entry_main(argv)


def explain_main(argv: Sequence[str]) -> int:
    r"""``captum-normattr [explain] ...``: parse the arguments (light: no torch) and explain.

    Args:
        argv: the arguments after ``explain`` (or all of them, ``explain`` being the default).

    Returns:
        The exit code: 0 success, 2 usage error (message on stderr, no traceback),
        1 error while explaining, 130 on Ctrl-C.
    """
    parser = build_parser()
    argv = list(argv)
    try:
        args = parser.parse_intermixed_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    args._argv = [SUBCOMMAND] + argv  # what a dataset run restarts as several CPU processes (cli/dataset/launch.py)
    try:
        return _run(args)
    except CLIError as err:
        print(f"{PROG}: error: {terminal_lines(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as err:
        if "out of memory" in str(err).lower():
            print(f"{PROG}: error: out of memory; try a smaller --batch-size or --max-length", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":  # pragma: no cover
    from captum_normattr.cli.dataset.launch import close_process_group

    code = main()
    if "torch.distributed" in sys.modules:  # a group exists only where a run imported torch.distributed
        close_process_group()
    sys.exit(code)
