r"""The command line for encoder-decoders: ``captum-normattr -m alti-plus --source ...``.

Split from :mod:`captum_normattr.cli.main`, which hands over to :func:`run_seq2seq` when a run
asks for ``alti-plus``, ``--source`` or ``--target-text``. Teacher-forced targets or greedy
generation, a table per target token, JSON / JSON Lines records with the T x S source and
T x T target contributions, and the contribution-matrix and source-share plots
(docs/cli.md, docs/seq2seq.md).

Examples (shell)::

    captum-normattr --model DIR -m alti-plus --source "source text" --target-text "reference"
    captum-normattr --model DIR --file pairs.tsv -m alti-plus --format jsonl -o out.jsonl
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from captum_normattr.attr.methods import MethodSpec
from captum_normattr.cli.common import (
    ALTI_PLUS,
    PROG,
    CLIError,
    build_alti_plus,
    can_print_blocks,
    load_model,
    read_stdin_lines,
    read_text_lines,
    require_encoder_decoder,
    resolve_device,
    resolve_max_length,
    write_output,
)
from captum_normattr.cli.output import use_agg_backend
from captum_normattr.progress import progress_bar
from captum_normattr.tokens import display_token, json_for_terminal, readable_tokens, visible_text

__all__ = ["SourcePair", "explain_pairs", "read_pairs", "render_seq2seq_table", "run_seq2seq"]


@dataclass(frozen=True)
class SourcePair:
    r"""One encoder-decoder input: a source text and its reference target (None: generate one).

    Attributes:
        id: the record id (the line number of a ``--file``, else 1, 2, ... over the command line).
        source: the source text.
        target: the teacher-forced target text, or None to explain the model's own (greedy) output.
        where: where it came from, for messages.
    """

    id: Any
    source: str
    target: Optional[str]
    where: str


def read_pairs(sources: Sequence[str], targets: Optional[Sequence[str]], file: Optional[str]) -> List[SourcePair]:
    r"""The (source, target) pairs of the command line and of ``--file``.

    Args:
        sources: source texts given with ``--source`` (and TEXT arguments).
        targets: their ``--target-text`` values (same number, same order), or None.
        file: a UTF-8 file, ``"-"`` for stdin, or None: per line ``source<TAB>target`` (teacher-forced)
            or ``source`` alone (generated); blank lines are skipped.

    Returns:
        The pairs in order (command line first); ids are 1, 2, ... on the command line and
        line numbers in the file.

    Raises:
        CLIError: for unequal numbers of sources and targets, an unreadable file, a line with
            more than two tab-separated columns or an empty column (naming the line), or no pair at all.
    """
    sources = [s for s in sources if s.strip()]
    if targets is not None and len(targets) != len(sources):
        raise CLIError(f"--target-text was given {len(targets)} time(s) for {len(sources)} source(s) on the command "
                       "line; give one reference target per --source, in order (or none, to generate)")
    out = [SourcePair(i, s.strip(), None if targets is None else targets[i - 1].strip(), f"source {i}")
           for i, s in enumerate(sources, start=1)]
    for p in out:
        if p.target == "":
            raise CLIError(f"{p.where}: the --target-text is empty")
    if file is not None:
        name = "<stdin>" if file == "-" else file
        if file == "-":
            lines = read_stdin_lines()
        else:
            path = Path(file).expanduser()
            if not path.is_file():
                raise CLIError(f"file not found: {file}" if not path.exists() else f"not a file: {file}")
            if path.suffix.lower() in (".json", ".jsonl", ".ndjson"):
                raise CLIError(f"{file}: a pairs file is plain text, one 'source<TAB>target' pair (or one source) "
                               "per line; JSON is not read here")
            lines = read_text_lines(path, file)
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            cols = line.split("\t")
            where = f"{name} line {n}"
            if len(cols) > 2:
                raise CLIError(f"{where}: {len(cols)} tab-separated columns; expected 'source<TAB>target' or a "
                               "source alone (a tab inside a text is not allowed)")
            if not cols[0].strip():
                raise CLIError(f"{where}: the source (first column) is empty")
            if len(cols) == 2 and not cols[1].strip():
                raise CLIError(f"{where}: the target (second column) is empty; leave out the tab to generate a target")
            out.append(SourcePair(n, cols[0].strip(), cols[1].strip() if len(cols) == 2 else None, where))
    if not out:
        raise CLIError("no source to explain: give --source TEXT (with -m alti-plus, TEXT arguments) or --file PATH")
    if file is not None and sources:  # ids: command line 1..k, file lines; keep them unique
        out = [SourcePair(f"arg{p.id}", p.source, p.target, p.where) if p.where.startswith("source ") else p
               for p in out]
    return out


def _decoder_start(model: Any) -> int:
    gen = getattr(model, "generation_config", None)
    for cfg in (gen, model.config):
        start = getattr(cfg, "decoder_start_token_id", None)
        if start is not None:
            return int(start)
    raise CLIError(f"{type(model).__name__} has no decoder_start_token_id in its config; cannot build the decoder inputs")


def _eos_ids(model: Any) -> List[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])


def _token_ids(tokenizer: Any, texts: Sequence[str], pairs: Sequence[SourcePair], max_len: Optional[int],
               side: str) -> List[List[int]]:
    r"""Token ids of the sources (``side="source"``) or of the targets (``"target"``, the tokenizer's
    ``text_target=``), cut to ``max_len`` with a warning naming the pair."""
    key = "text" if side == "source" else "text_target"
    full = tokenizer(**{key: list(texts)}, truncation=False, verbose=False)["input_ids"]
    if max_len is None or all(len(x) <= max_len for x in full):
        return [list(x) for x in full]
    cut = tokenizer(**{key: list(texts)}, truncation=True, max_length=max_len)["input_ids"]
    for p, a, b in zip(pairs, full, cut):
        if len(a) > len(b):
            print(f"{PROG}: warning: {visible_text(p.where)}: the {side} has {len(a)} tokens but the limit is {max_len}: "
                  f"{len(a) - len(b)} token(s) were cut (see --max-length)", file=sys.stderr)
    return [list(x) for x in cut]


def _pad_rows(rows: Sequence[Sequence[int]], pad: int) -> Tuple[Any, Any]:
    r"""Right-padded (B, N) ids and their mask."""
    import torch

    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def _generate(model: Any, src_ids: Any, src_mask: Any, max_new_tokens: int, pad: int) -> List[Tuple[List[int], List[int]]]:
    r"""Greedy ``generate()``: per row (decoder inputs, generated tokens), cut after the first end-of-sequence
    token (kept), as :func:`~captum_normattr.attr.alti_plus.explain_generation` reads them."""
    import torch

    if not (callable(getattr(model, "generate", None)) and getattr(model, "can_generate", lambda: False)()):
        raise CLIError(f"{type(model).__name__} cannot generate (it has no language-model head); give the "
                       "target with --target-text, or a 'source<TAB>target' file, or use the "
                       "*ForConditionalGeneration model")
    with torch.no_grad():
        gen = model.generate(input_ids=src_ids, attention_mask=src_mask, max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=pad)
    eos = set(_eos_ids(model))
    out = []
    for row in gen.cpu().tolist():
        n = len(row) - 1
        for k in range(1, len(row)):
            if row[k] in eos:
                n = k
                break
        out.append((row[:n], row[1:n + 1]))  # decoder input k predicts token k + 1
    return out


def _seq2seq_batch(alti: Any, model: Any, tokenizer: Any, pairs: Sequence[SourcePair], options: argparse.Namespace,
                   max_len: Optional[int], device: Any) -> List[Dict[str, Any]]:
    r"""Explain one batch of pairs (all teacher-forced or all generated): one record per pair.

    The decoder inputs are the decoder start token followed by the target tokens but the last
    (the labels shifted right, as the model builds them); row k of the matrices is the
    decoder state that predicts target token k.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    src_rows = _token_ids(tokenizer, [p.source for p in pairs], pairs, max_len, "source")
    src_ids, src_mask = _pad_rows(src_rows, pad)
    src_ids, src_mask = src_ids.to(device), src_mask.to(device)
    if pairs[0].target is not None:
        start = _decoder_start(model)
        labels = _token_ids(tokenizer, [p.target for p in pairs], pairs, max_len, "target")
        steps = [([start] + lab[:-1], lab) for lab in labels]
    else:
        steps = _generate(model, src_ids, src_mask, options.max_new_tokens, pad)
    dec_ids, dec_mask = _pad_rows([d for d, _ in steps], pad)
    try:
        res = alti.decompose((src_ids, dec_ids.to(device)), additional_forward_args=(src_mask, dec_mask.to(device)))
    except (ValueError, TypeError) as err:
        raise CLIError(f"{ALTI_PLUS}: {err}") from None
    records = []
    for i, (p, (dec, tgt)) in enumerate(zip(pairs, steps)):
        n = len(tgt)
        s = len(src_rows[i])
        src_c = res.source_contributions[i, :n, :s].detach().cpu().double()
        tgt_c = res.target_contributions[i, :n, :n].detach().cpu().double()
        share = res.source_share[i, :n].detach().cpu().double()
        records.append({
            "id": p.id,
            "source": p.source,
            "target": p.target if p.target is not None else tokenizer.decode(tgt, skip_special_tokens=True),
            "mode": "teacher-forced" if p.target is not None else "generated",
            "method": res.method,
            "conventions": res.conventions,
            "source_tokens": tokenizer.convert_ids_to_tokens(src_rows[i]),
            "target_tokens": tokenizer.convert_ids_to_tokens(list(tgt)),
            "decoder_input_tokens": tokenizer.convert_ids_to_tokens(list(dec)),
            "source_token_text": list(readable_tokens(tokenizer, src_rows[i])),
            "target_token_text": list(readable_tokens(tokenizer, list(tgt))),
            "decoder_input_token_text": list(readable_tokens(tokenizer, list(dec))),
            "source_contributions": src_c.tolist(),
            "target_contributions": tgt_c.tolist(),
            "source_share": share.tolist(),
            "completeness_error": float(res.delta[i]),
        })
    return records


def explain_pairs(pairs: Sequence[SourcePair], model: Any, tokenizer: Any, options: argparse.Namespace, *,
                  progress: bool = True) -> List[Dict[str, Any]]:
    r"""Explain encoder-decoder pairs with ALTI+: one JSON-ready record per pair, in input order.

    Pairs with a target are teacher-forced; the others are generated first (greedy, at most
    ``options.max_new_tokens`` new tokens) and the generated tokens are explained. Both kinds
    are batched separately by ``options.batch_size``.

    Args:
        pairs: the inputs (:func:`read_pairs`).
        model: an encoder-decoder (with its LM head to generate).
        tokenizer: its tokenizer.
        options: parsed options (``batch_size``, ``max_length``, ``max_new_tokens``, ``conventions``).
        progress: a progress bar on stderr when there is more than one batch.

    Returns:
        Records with ``id``, ``source``, ``target``, ``mode``, ``source_tokens`` (S),
        ``target_tokens`` (T: the token each row predicts), ``decoder_input_tokens`` (T: the
        columns of ``target_contributions``), ``source_contributions`` (T x S),
        ``target_contributions`` (T x T, lower triangular), ``source_share`` (T) and
        ``completeness_error``; every row of [source | target] sums to 1.
    """
    alti = build_alti_plus(model, options.conventions)
    device = next(model.parameters()).device
    max_len = resolve_max_length(model, tokenizer, options.max_length)
    groups = [[p for p in pairs if p.target is not None], [p for p in pairs if p.target is None]]
    chunks = [g[k:k + options.batch_size] for g in groups for k in range(0, len(g), options.batch_size)]
    bar = progress_bar(len(chunks), enabled=progress)
    done: Dict[int, Dict[str, Any]] = {}
    try:
        for chunk in chunks:
            for p, rec in zip(chunk, _seq2seq_batch(alti, model, tokenizer, chunk, options, max_len, device)):
                done[id(p)] = rec
            bar.update(1)
    finally:
        bar.close()
    return [done[id(p)] for p in pairs]


def _bar(value: float, width: int, ascii_only: bool) -> str:
    full = max(0, min(width, int(round(value * width))))
    return ("#" * full + "." * (width - full)) if ascii_only else ("\u2588" * full + "\u2591" * (width - full))


def render_seq2seq_table(records: Sequence[Dict[str, Any]], top: int = 3, ascii_only: bool = False) -> str:
    r"""A readable table per pair: every target token, its source share and its top source tokens.

    Args:
        records: from :func:`explain_pairs`.
        top: the number of source tokens shown per target token (largest contributions first).
        ascii_only: ASCII bars instead of Unicode blocks.

    Returns:
        The text.
    """
    vis = visible_text  # control characters and bidi overrides are shown, never sent to the terminal
    out: List[str] = []
    for rec in records:
        out.append(vis(f"[{rec['id']}] source: {rec['source']}"))
        out.append(vis(f"    target ({rec['mode']}): {rec['target']}"))
        out.append(vis(f"    {rec['method']} ({rec['conventions']}); completeness error {rec['completeness_error']:.1e}; "
                       "each row: the source share and the top source tokens of the prediction of that token "
                       "(the rest of the row is the target prefix)"))
        toks = [display_token(t, ascii_only) for t in rec.get("target_token_text", rec["target_tokens"])]
        src = [display_token(t, ascii_only) for t in rec.get("source_token_text", rec["source_tokens"])]
        w = min(16, max([len(t) for t in toks] + [6]))
        out.append(f"    {'#':>3}  {'token'.ljust(w)}  {'source share':<19}  top source tokens")
        for k, (tok, share, row) in enumerate(zip(toks, rec["source_share"], rec["source_contributions"])):
            order = sorted(range(len(row)), key=lambda j: -row[j])[:top]
            best = "  ".join(f"{src[j]} {row[j]:.2f}" for j in order)
            out.append(f"    {k:>3}  {tok[:w].ljust(w)}  {share:5.2f} {_bar(share, 12, ascii_only)}  {best}")
        shares = rec["source_share"]
        if shares:
            out.append(f"    mean source share: {sum(shares) / len(shares):.3f}")
        out.append("")
    return "\n".join(out).rstrip("\n")


def _save_seq2seq_plots(records: Sequence[Dict[str, Any]], folder: Path, fmt: str) -> List[Path]:
    r"""Per pair: the [source | target prefix] contribution matrix and the source share by target token."""
    import matplotlib.pyplot as plt
    import torch

    from captum_normattr.present import visualization_seq2seq as VS

    def text(rec: Dict[str, Any], key: str) -> List[str]:  # the readable labels (" le", not "▁le")
        return list(rec.get(f"{key}_token_text") or rec[f"{key}_tokens"])

    written = []
    for n, rec in enumerate(records, start=1):
        src = torch.tensor(rec["source_contributions"], dtype=torch.float64).reshape(len(rec["target_tokens"]), -1)
        tgt = torch.tensor(rec["target_contributions"], dtype=torch.float64).reshape(len(rec["target_tokens"]), -1)
        title = f"{rec['source'][:60]} ({rec['mode']})"
        path = folder / f"pair{n:03d}_alti_plus_matrix.{fmt}"
        fig = VS.plot_contribution_matrix((src, tgt), source_tokens=text(rec, "source"),
                                          target_tokens=text(rec, "decoder_input"), row_labels=text(rec, "target"),
                                          title=f"ALTI+ — {title}", path=path)
        plt.close(fig)
        written.append(path)
        path = folder / f"pair{n:03d}_alti_plus_source_share.{fmt}"
        fig = VS.plot_source_share(torch.tensor(rec["source_share"], dtype=torch.float64),
                                   target_tokens=text(rec, "target"), title=f"Source share — {title}", path=path)
        plt.close(fig)
        written.append(path)
    return written


def run_seq2seq(args: argparse.Namespace, specs: Sequence[MethodSpec], fmt: str) -> int:
    r"""``-m alti-plus`` / ``--source``: explain encoder-decoder pairs (table, json, jsonl, --plots).

    Raises:
        CLIError: for other methods in the same run, options that do not apply, a model that
            is not an encoder-decoder, or broken inputs.
    """
    import json

    others = [s.key for s in specs if s.key != ALTI_PLUS]
    if others:
        if len(others) < len(specs):
            raise CLIError(f"{ALTI_PLUS!r} explains encoder-decoders and runs alone; the other methods "
                           f"({', '.join(others)}) explain encoder-only and decoder-only models: run them separately")
        raise CLIError(f"--source and --target-text are the inputs of encoder-decoders, explained by -m {ALTI_PLUS}; "
                       f"method(s) {', '.join(others)} explain encoder-only and decoder-only models: give their texts "
                       "as TEXT arguments")
    for flag, bad in (("--image", args.image), ("--html-maps", args.html_maps), ("--aggregate", args.aggregate),
                      ("--exclude-sink", getattr(args, "exclude_sink", False)), ("--format html", fmt == "html")):
        if bad:
            raise CLIError(f"{flag} does not apply to {ALTI_PLUS}: use --format table, json or jsonl, and --plots DIR")
    if args.plots:
        use_agg_backend()
    sources = list(args.source or []) + list(args.texts) + list(getattr(args, "trailing_texts", None) or [])
    pairs = read_pairs(sources, args.target_text, args.file)
    device = resolve_device(args.device)
    model, tok, model_name = load_model(args.model, device, getattr(args, "trust_remote_code", False))
    need = "--source needs" if args.source and not args.method else f"-m {ALTI_PLUS} needs"
    require_encoder_decoder(model, model_name, need)
    if tok.pad_token_id is None and getattr(tok, "eos_token", None) is not None:
        tok.pad_token = tok.eos_token
    records = explain_pairs(pairs, model, tok, args, progress=not args.quiet)
    if args.plots:
        written = _save_seq2seq_plots(records, Path(args.plots).expanduser(), args.plot_format)
        if not args.quiet:
            print(f"{PROG}: wrote {len(written)} pictures to {visible_text(args.plots)}", file=sys.stderr)
    if fmt == "jsonl":
        text = "\n".join(json.dumps(r, ensure_ascii=False, allow_nan=False) for r in records)
    elif fmt == "json":
        meta = {"model": model_name, "method": ALTI_PLUS, "conventions": args.conventions, "device": str(device),
                "pairs": len(records),
                "rows": "row k of source_contributions (T x S) and target_contributions (T x T) is the decoder "
                        "state that predicts target_tokens[k]; its columns are source_tokens and "
                        "decoder_input_tokens; each row sums to 1; source_share: the sum of its source part"}
        if any(p.target is None for p in pairs):
            meta["max_new_tokens"] = args.max_new_tokens
        text = json.dumps({"meta": meta, "pairs": records}, indent=2, ensure_ascii=False, allow_nan=False)
    else:
        text = render_seq2seq_table(records, top=args.top, ascii_only=args.ascii or not can_print_blocks())
    if fmt in ("json", "jsonl") and args.output is None:  # the same JSON, bidi overrides as \u escapes
        text = json_for_terminal(text)
    write_output(text, args.output)
    if args.output and not args.quiet:
        print(f"{PROG}: wrote {visible_text(args.output)} ({len(records)} pair{'s' if len(records) != 1 else ''})", file=sys.stderr)
    return 0

