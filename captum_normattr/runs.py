r"""Dataset runs: explain every text of a corpus, one JSON Lines record per text, resumable and multi-process.

``captum-normattr --file texts.txt -m alti --format jsonl -o out.jsonl`` (or
``python -m captum_normattr ...``, the same program) writes one record per input text::

    {"id": 3, "text": "...", "tokens": ["[CLS]", ...],
     "methods": {"alti": {"method": "ALTI", "scores": [...], "completeness_error": 1e-7,
                          "explained_position": 0}}}

- **Inputs** (:func:`read_inputs`): a text file (one text per line, blank lines skipped; the
  id is the line number), JSON Lines or CSV/TSV (the text in ``--column``, default
  ``text``; the id in ``--id-column``, default the line / row number), or a folder saved
  with Hugging Face ``datasets`` ``save_to_disk`` (needs ``datasets``; ``--split`` picks
  a split of a ``DatasetDict``; the id is the row index). Every input is checked before
  anything runs: a broken line stops the run with its file and line number.
- **Processes.** Under ``accelerate launch`` (multi-process CPU, several GPUs, several
  nodes) each process takes its share of the texts not yet done
  (``PartialState().split_between_processes``), sorts it by token length and runs it in
  batches of ``--batch-size``, on its own device. Each process appends its finished
  records to its own shard file (``out.jsonl.part-<rank>``, flushed after every batch);
  at the end the main process merges the existing output and the shards in input order
  into ``out.jsonl`` (written to a temporary file, then renamed) and removes the shards.
  ``accelerate launch --cpu --num_processes N`` starts one process (accelerate's multi-CPU
  launcher is ``mpirun``); the command line then starts the N CPU processes itself
  (:mod:`captum_normattr.cpu_launch`).
- **Resume.** A rerun with the same output skips the ids already in ``out.jsonl`` and in
  any shard left by a crashed run, and merges everything at the end; ``--overwrite``
  starts afresh. A progress bar runs on the main process only (``-q`` turns it off).
- **Notebooks:** :func:`explain_dataset` does the same from Python and returns the records.

See ``docs/scale.md``.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from captum_normattr.cpu_launch import requested_cpu_processes, spawn_cpu_processes

__all__ = ["InputError", "InputItem", "add_arguments", "explain_dataset", "read_inputs", "run_cli"]

MISSING_DATASETS_MESSAGE = (
    "reading a saved Hugging Face dataset needs the `datasets` package: pip install datasets "
    "(or export the texts to JSON Lines / CSV and pass that file)"
)


class InputError(ValueError):
    r"""A broken or unreadable input; the message names the file and line."""


@dataclass(frozen=True)
class InputItem:
    r"""One input text: its id (the record's key), the text, and where it came from (for messages)."""

    id: Any
    text: str
    where: str


# --------------------------------------------------------------------------- inputs


def _text_file(path: Path) -> List[InputItem]:
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise InputError(f"{path} is not a UTF-8 text file ({err})") from None
    for n, line in enumerate(lines, start=1):
        if line.strip():
            out.append(InputItem(n, line.strip(), f"{path} line {n}"))
    return out


def _check_text(value: Any, column: str, where: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{where}: column {column!r} must be a text, got {type(value).__name__} {value!r:.60}")
    if not value.strip():
        raise InputError(f"{where}: column {column!r} is empty")
    return value.strip()


def _check_id(value: Any, id_column: str, where: str) -> Any:
    if value is None or isinstance(value, (bool, float, dict, list)) or value == "":
        raise InputError(f"{where}: id column {id_column!r} must be a non-empty string or an integer, got {value!r}")
    return value


def _jsonl_file(path: Path, column: str, id_column: Optional[str]) -> List[InputItem]:
    out = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise InputError(f"{where}: expected a JSON object with a {column!r} field, got {type(row).__name__}")
            if column not in row:
                raise InputError(f"{where}: no {column!r} field (fields: {', '.join(map(str, row)) or 'none'}); "
                                 "name the text field with --column")
            if id_column is not None and id_column not in row:
                raise InputError(f"{where}: no id field {id_column!r}")
            key = n if id_column is None else _check_id(row[id_column], id_column, where)
            out.append(InputItem(key, _check_text(row[column], column, where), where))
    return out


def _csv_file(path: Path, column: str, id_column: Optional[str]) -> List[InputItem]:
    delimiter = "\t" if path.suffix.lower() in (".tsv", ".tab") else ","
    out = []
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh, delimiter=delimiter)
        fields = reader.fieldnames or []
        for name in [column] + ([id_column] if id_column else []):
            if name not in fields:
                raise InputError(f"{path} line 1: no column {name!r} in the header ({', '.join(fields) or 'empty'}); "
                                 "name the text column with --column")
        try:
            for row_number, row in enumerate(reader, start=1):
                where = f"{path} line {reader.line_num}"
                if None in row:
                    raise InputError(f"{where}: more fields than the header has")
                if row.get(column) is None:
                    raise InputError(f"{where}: fewer fields than the header has")
                key = row_number if id_column is None else _check_id(row[id_column], id_column, where)
                out.append(InputItem(key, _check_text(row[column], column, where), where))
        except csv.Error as err:
            raise InputError(f"{path} line {reader.line_num}: {err}") from None
    return out


def _dataset_rows(ds: Any, column: str, id_column: Optional[str], where: str, split: Optional[str]) -> List[InputItem]:
    if isinstance(ds, dict) or isinstance(getattr(ds, "column_names", None), dict):  # a DatasetDict
        splits = list(ds.keys())
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            raise InputError(f"{where} holds the splits {splits}; choose one with --split")
        ds, where = ds[split], f"{where} [{split}]"
    names = list(getattr(ds, "column_names", []) or [])
    for name in [column] + ([id_column] if id_column else []):
        if name not in names:
            raise InputError(f"{where}: no column {name!r} (columns: {', '.join(names)}); name it with --column")
    texts = ds[column]
    ids = ds[id_column] if id_column else range(len(texts))
    out = []
    for i, (key, text) in enumerate(zip(ids, texts)):
        row_where = f"{where} row {i}"
        if id_column:
            key = _check_id(key, id_column, row_where)
        out.append(InputItem(key, _check_text(text, column, row_where), row_where))
    return out


def read_inputs(
    source: Union[str, Path, Sequence[str], Any],
    column: str = "text",
    id_column: Optional[str] = None,
    split: Optional[str] = None,
) -> List[InputItem]:
    r"""Read and check every input text, with its id.

    Args:
        source: a path (text file; ``.jsonl`` / ``.ndjson``; ``.csv`` / ``.tsv``; or a folder
            saved by ``datasets``' ``save_to_disk``), a list of texts (ids 1, 2, ...), or a
            ``datasets.Dataset`` / ``DatasetDict`` object.
        column: the text column of JSON Lines, CSV/TSV and datasets.
        id_column: the column holding each record's id (default: the line number of text
            and JSON Lines files, the data row number of CSV, the row index of a dataset).
        split: the split of a ``DatasetDict`` (needed when it has several).

    Returns:
        The :class:`InputItem` list in input order.

    Raises:
        InputError: naming the file and line of the first broken input, a missing column,
            a repeated id, or a missing ``datasets`` package.
    """
    if isinstance(source, (list, tuple)):
        items = [InputItem(i, _check_text(t, "text", f"text {i}"), f"text {i}") for i, t in enumerate(source, start=1)]
    elif isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if not path.exists():
            raise InputError(f"input not found: {source}")
        if path.is_dir():
            try:
                import datasets
            except ImportError:
                raise InputError(MISSING_DATASETS_MESSAGE) from None
            try:
                ds = datasets.load_from_disk(str(path))
            except Exception as err:  # noqa: BLE001 - any failure: not a saved dataset
                raise InputError(f"{source} is a folder but not a dataset saved with save_to_disk ({err})") from None
            items = _dataset_rows(ds, column, id_column, str(path), split)
        else:
            suffix = path.suffix.lower()
            if suffix in (".jsonl", ".ndjson"):
                items = _jsonl_file(path, column, id_column)
            elif suffix in (".csv", ".tsv", ".tab"):
                items = _csv_file(path, column, id_column)
            else:
                items = _text_file(path)
    else:
        items = _dataset_rows(source, column, id_column, type(source).__name__, split)
    seen: Dict[Any, str] = {}
    for it in items:
        if it.id in seen:
            raise InputError(f"{it.where}: id {it.id!r} already used at {seen[it.id]}; ids must be unique")
        seen[it.id] = it.where
    if not items:
        raise InputError(f"no text to explain in {source if isinstance(source, (str, Path)) else 'the input'}")
    return items


# --------------------------------------------------------------------------- output files


def _shards(output: Path) -> List[Path]:
    return sorted(output.parent.glob(output.name + ".part-*"))


def _read_records(path: Path) -> Iterable[Tuple[Any, str]]:
    r"""(id, raw line) of every complete record of a JSON Lines output (a torn last line is skipped)."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.endswith("\n"):
                continue  # written while the process died
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                yield rec["id"], line


def _done_ids(output: Path) -> set:
    done = set()
    for path in [output] + _shards(output):
        done.update(_key(i) for i, _ in _read_records(path))
    return done


def _key(value: Any) -> Any:
    return json.dumps(value)  # ids compared as written: 3 and "3" differ, as they do in the file


def _merge(output: Path, items: Sequence[InputItem]) -> int:
    r"""Write the records of ``output`` and its shards into ``output`` in input order; returns how many."""
    lines: Dict[Any, str] = {}
    shards = _shards(output)
    for path in [output] + shards:
        for i, line in _read_records(path):
            lines.setdefault(_key(i), line)
    order = [_key(it.id) for it in items]
    known = set(order)
    tmp = output.with_name(output.name + ".merging")
    with tmp.open("w", encoding="utf-8") as fh:
        for k in order:
            if k in lines:
                fh.write(lines[k])
        for k, line in lines.items():  # records of ids no longer in the input are kept, after the others
            if k not in known:
                fh.write(line)
    os.replace(tmp, output)
    for path in shards:
        path.unlink()
    return len(lines)


# --------------------------------------------------------------------------- records


def _to_list(t: Any) -> List[float]:
    return [float(x) for x in t.detach().cpu().double().tolist()]


def _completeness(res: Any, i: int) -> Optional[float]:
    r"""The example's completeness error: its delta, else the largest per-layer error of its batch."""
    if getattr(res, "delta", None) is not None:
        return float(res.delta[i].abs())
    err = getattr(res, "extras", {}).get("completeness_error")
    return None if err is None else float(err.abs().max())


def _records(
    chunk: Sequence[InputItem], tokenizer: Any, ids: Any, mask: Any, results: Mapping[str, Any]
) -> List[Dict[str, Any]]:
    from torch import Tensor

    from captum_normattr.tokens import readable_tokens

    out = []
    for i, item in enumerate(chunk):
        keep = mask[i].bool().cpu()
        first = int(keep.long().argmax())  # left padding moves positions; positions are given over real tokens
        real_ids = ids[i].cpu()[keep].tolist()
        methods: Dict[str, Any] = {}
        for key, res in results.items():
            if isinstance(res, Tensor):
                methods[key] = {"method": key, "scores": _to_list(res[i].cpu()[keep]), "completeness_error": None}
                continue
            entry: Dict[str, Any] = {
                "method": res.method,
                "scores": _to_list(res.scores[i].cpu()[keep]),
                "completeness_error": _completeness(res, i),
            }
            if getattr(res, "explained_position", None) is not None:
                entry["explained_position"] = int(res.explained_position[i]) - first
            target = getattr(res, "target", None)
            if isinstance(target, Tensor):
                entry["target"] = int(target[i])
            methods[key] = entry
        out.append({
            "id": item.id, "text": item.text, "tokens": tokenizer.convert_ids_to_tokens(real_ids),
            "token_text": list(readable_tokens(tokenizer, real_ids)), "methods": methods,
        })
    return out


def _state():
    r"""accelerate's process state; CPU processes where ``--cpu`` was asked for or no accelerator exists.

    (``accelerate launch --multi_gpu --num_processes N`` on a machine without GPUs, or
    ``torchrun --nproc_per_node N``, then gives N CPU processes joined by gloo.)
    """
    import torch
    from accelerate import PartialState

    accel = getattr(torch, "accelerator", None)
    has_accelerator = accel.is_available() if accel is not None else torch.cuda.is_available()
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not has_accelerator
    state = PartialState(cpu=cpu)
    if state.num_processes == 1:
        n = requested_cpu_processes()
        if n > 1:  # explain_dataset in a script under `accelerate launch --cpu --num_processes N`
            warnings.warn(f"accelerate launch asked for {n} CPU processes but started one (its multi-CPU launcher is "
                          f"mpirun): this process explains every text. For {n} processes use `accelerate launch "
                          f"--multi_gpu --num_processes {n}` with CUDA_VISIBLE_DEVICES=\"\" or `torchrun "
                          f"--nproc_per_node {n}` (the command line `-m captum_normattr` starts them itself)",
                          stacklevel=3)
    return state


def _run(
    items: Sequence[InputItem],
    model: Any,
    tokenizer: Any,
    specs: Sequence[Any],
    options: Any,
    output: Optional[Path],
    *,
    batch_size: int = 8,
    max_length: Optional[int] = None,
    target: Optional[int] = None,
    progress: bool = True,
    overwrite: bool = False,
    device: Any = None,
) -> List[Dict[str, Any]]:
    r"""The shared core of :func:`explain_dataset` and the command line; returns this process's new records."""
    from captum_normattr.cli import CLIError, _build_attributions, _explain_batch, _max_length

    state = _state()
    if output is not None:
        if overwrite and state.is_main_process:
            for path in [output] + _shards(output):
                path.unlink(missing_ok=True)
        state.wait_for_everyone()
        done = _done_ids(output)
        state.wait_for_everyone()  # every process has read the done ids before any shard grows
        todo = [it for it in items if _key(it.id) not in done]
    else:
        todo = list(items)
    attrs = _build_attributions(specs, model, options)
    limit = _max_length(model, tokenizer, max_length)
    with state.split_between_processes(todo) as share:
        share = list(share)
    lengths = [len(tokenizer(it.text, truncation=limit is not None, max_length=limit)["input_ids"]) for it in share]
    order = sorted(range(len(share)), key=lambda k: (lengths[k], k))
    shard = None if output is None else output.with_name(f"{output.name}.part-{state.process_index}")
    bar = None
    if progress and state.is_main_process and share:
        from tqdm.auto import tqdm

        desc = "captum-normattr" + (f" (process 0 of {state.num_processes})" if state.num_processes > 1 else "")
        bar = tqdm(total=len(share), unit="text", desc=desc, file=sys.stderr, leave=False)
    new: List[Dict[str, Any]] = []
    try:
        for start in range(0, len(order), batch_size):
            chunk = [share[k] for k in order[start:start + batch_size]]
            enc = tokenizer([it.text for it in chunk], return_tensors="pt", padding=True,
                            truncation=limit is not None, max_length=limit)
            ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
            results: Dict[str, Any] = {}
            for spec, attr in attrs:
                try:
                    results[spec.key] = _explain_batch(spec, attr, ids, mask, target, False)
                except (ValueError, TypeError, NotImplementedError) as err:
                    raise CLIError(f"{spec.key} on {chunk[0].where}...: {err}") from None
            recs = _records(chunk, tokenizer, ids, mask, results)
            if shard is not None:
                with shard.open("a", encoding="utf-8") as fh:
                    fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
                    fh.flush()
                    os.fsync(fh.fileno())
            new.extend(recs)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    if output is not None:
        state.wait_for_everyone()
        if state.is_main_process:
            _merge(output, items)
        state.wait_for_everyone()
    return new


def _pad_token(tokenizer: Any) -> None:
    if tokenizer.pad_token is None:
        if getattr(tokenizer, "eos_token", None) is None:
            raise InputError("the tokenizer has no pad token and no end-of-sequence token to pad with")
        tokenizer.pad_token = tokenizer.eos_token


def explain_dataset(
    source: Union[str, Path, Sequence[str], Any],
    model: Any = None,
    tokenizer: Any = None,
    methods: Sequence[str] = ("globenc",),
    output: Union[str, Path, None] = None,
    *,
    column: str = "text",
    id_column: Optional[str] = None,
    split: Optional[str] = None,
    batch_size: int = 8,
    max_length: Optional[int] = None,
    target: Optional[int] = None,
    options: Optional[Mapping[str, Any]] = None,
    overwrite: bool = False,
    progress: bool = True,
) -> List[Dict[str, Any]]:
    r"""Explain every text of a corpus; the Python form of ``captum-normattr --format jsonl``.

    Args:
        source: texts, a file or a saved dataset (see :func:`read_inputs`).
        model, tokenizer: the model (on its device, or dispatched by accelerate) and its
            tokenizer; both None: the packaged MiniLM.
        methods: registry keys (:data:`captum_normattr.registry.METHODS`).
        output: a ``.jsonl`` path to write (and resume: ids already there are skipped), or None.
        column, id_column, split: see :func:`read_inputs`.
        batch_size: texts per batch (texts are sorted by length first).
        max_length: truncate to this many tokens (default: the model's limit).
        target: the target class / token of the methods that use one (None: predicted).
        options: method options by their command-line ``dest`` (e.g. ``{"map": "N_RES"}``).
        overwrite: start ``output`` afresh instead of resuming.
        progress: a progress bar (main process only).

    Returns:
        With ``output``: every record of the output file, in input order (also those of
        earlier runs). Without: the records of the texts this process explained, in input
        order.

    Raises:
        InputError: for broken inputs (file and line named).

    Examples::

        >>> recs = explain_dataset(["a gripping film", "dull"], methods=["alti", "globenc"])
        >>> recs[0]["tokens"], recs[0]["methods"]["alti"]["scores"]
        >>> explain_dataset("reviews.csv", model, tok, ["decompx"], "out.jsonl", column="review", id_column="id")
    """
    import argparse

    from captum_normattr.registry import get_method

    items = read_inputs(source, column, id_column, split)
    if model is None:
        from captum_normattr import load_default_model

        model, tokenizer = load_default_model()
    if tokenizer is None:
        raise ValueError("pass the model's tokenizer")
    _pad_token(tokenizer)
    specs = [get_method(m) for m in dict.fromkeys(methods)]
    ns = argparse.Namespace(**dict(options or {}))
    if getattr(ns, "position", None) is None:
        from captum_normattr.cli import _is_decoder

        ns.position = "last" if _is_decoder(model) else 0
    from captum_normattr.models.weights import is_dispatched

    device = None if is_dispatched(model) else next(model.parameters()).device
    path = None if output is None else Path(output).expanduser()
    new = _run(items, model, tokenizer, specs, ns, path, batch_size=batch_size, max_length=max_length,
               target=target, progress=progress, overwrite=overwrite, device=device)
    if path is not None:
        return [json.loads(line) for _, line in _read_records(path)]
    rank = {_key(it.id): n for n, it in enumerate(items)}
    return sorted(new, key=lambda r: rank[_key(r["id"])])


# --------------------------------------------------------------------------- command line


def add_arguments(parser: Any) -> None:
    r"""The dataset-run options of the command line (used with ``--format jsonl``)."""
    g = parser.add_argument_group("dataset runs (--format jsonl; see docs/scale.md)")
    g.add_argument("--column", default="text", help="JSON Lines / CSV / dataset: the text column (default: text)")
    g.add_argument("--id-column", default=None,
                   help="the column holding each record's id (default: line number, CSV row number or dataset index)")
    g.add_argument("--split", default=None, help="saved DatasetDict: the split to read")
    g.add_argument("--overwrite", action="store_true",
                   help="start the --output file afresh (default: resume, skipping the ids already written)")


def run_cli(args: Any, specs: Sequence[Any]) -> int:
    r"""``--format jsonl``: explain ``--file`` (and TEXT arguments) into ``--output``, resumable, multi-process."""
    from captum_normattr.cli import PROG, CLIError, _is_decoder, _resolve_device, load_model

    if args.output is None:
        raise CLIError("--format jsonl needs --output PATH (records are appended and resumed there)")
    if args.html_maps or args.plots:
        raise CLIError("--html-maps and --plots do not apply to --format jsonl")
    if args.file is not None and args.texts:
        raise CLIError("give either TEXT arguments or --file with --format jsonl, not both")
    if args.file == "-":
        raise CLIError("--format jsonl needs a file (ids are line numbers, for resuming), not stdin")
    try:
        items = read_inputs(args.file if args.file is not None else list(args.texts), args.column, args.id_column,
                            args.split)
    except InputError as err:
        raise CLIError(str(err)) from None
    n = requested_cpu_processes()
    if n > 1:  # `accelerate launch --cpu --num_processes N` started only this process: start the N
        if not args.quiet:
            print(f"{PROG}: accelerate launch started 1 process for --num_processes {n} on CPU (its multi-CPU "
                  f"launcher is mpirun); starting {n} CPU processes joined over gloo", file=sys.stderr)
        return spawn_cpu_processes(n, ["-m", "captum_normattr", *getattr(args, "_argv", sys.argv[1:])])
    state = _state()
    device = _resolve_device(args.device)
    if state.num_processes > 1 and state.device.type != "cpu":
        device = state.device  # accelerate launch on several GPUs: one device per process
    model, tok, _ = load_model(args.model, device)
    try:
        _pad_token(tok)
    except InputError as err:
        raise CLIError(str(err)) from None
    if args.position is None:
        args.position = "last" if _is_decoder(model) else 0
    output = Path(args.output).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    new = _run(items, model, tok, specs, args, output, batch_size=args.batch_size, max_length=args.max_length,
               target=args.target, progress=not args.quiet, overwrite=args.overwrite, device=device)
    counts = [len(new)]
    if state.num_processes > 1:
        from accelerate.utils import gather_object

        counts = gather_object(counts)  # texts explained now by each process, in process order
    if state.is_main_process and not args.quiet:
        n = sum(1 for _ in _read_records(output))
        per = f": {' + '.join(map(str, counts))} explained now" if state.num_processes > 1 else ""
        print(f"{PROG}: wrote {args.output} ({n} records, {state.num_processes} process"
              f"{'es' if state.num_processes > 1 else ''}{per})", file=sys.stderr)
    return 0
