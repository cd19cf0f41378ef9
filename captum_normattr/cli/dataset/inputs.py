r"""The inputs of a dataset run: every text of a corpus with its id, read and checked before anything runs.

:func:`read_inputs` reads a text file (one text per line, blank lines skipped; the id is the
line number), JSON Lines or CSV/TSV (the text in ``column``, default ``text``; the id in
``id_column``, default the line / row number), a folder saved with Hugging Face ``datasets``
``save_to_disk`` (needs ``datasets``; ``split`` picks a split of a ``DatasetDict``; the id is
the row index), a list of texts, or a ``datasets`` object. A broken line stops the run with
its file and line number (:class:`InputError`); ids must be unique.

Used by :mod:`captum_normattr.cli.dataset.run` (``--file`` of ``--format jsonl`` and
:func:`~captum_normattr.cli.dataset.run.explain_dataset`); see ``docs/scale.md``.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

__all__ = ["MISSING_DATASETS_MESSAGE", "InputError", "InputItem", "read_inputs"]

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


def _lines(path: Path) -> List[str]:
    r"""The lines of a UTF-8 file, split at ``\n`` / ``\r\n`` only, a byte-order mark dropped (so ids are line numbers)."""
    from captum_normattr.cli.common import read_utf8, split_lines

    try:
        return split_lines(read_utf8(path))
    except UnicodeDecodeError as err:
        raise InputError(f"{path} is not a UTF-8 text file ({err})") from None
    except OSError as err:
        raise InputError(f"cannot read {path}: {err.strerror or err}") from None


def _text_file(path: Path) -> List[InputItem]:
    out = []
    for n, line in enumerate(_lines(path), start=1):
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
    for n, line in enumerate(_lines(path), start=1):
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
    with path.open(encoding="utf-8-sig", newline="") as fh:  # utf-8-sig: a byte-order mark is not in the header
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
