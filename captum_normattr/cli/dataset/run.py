r"""Dataset runs: explain every text of a corpus, one JSON Lines record per text, resumable and multi-process.

``captum-normattr --file texts.txt -m alti --format jsonl -o out.jsonl`` (or
``python -m captum_normattr ...``, the same program) writes one record per input text::

    {"id": 3, "text": "...", "tokens": ["[CLS]", ...],
     "methods": {"alti": {"method": "ALTI", "scores": [...], "completeness_error": 1e-7,
                          "sink_share": 0.31, "explained_position": 0}}}

  ``sink_share``: the first token's share ``|s_0| / sum_t |s_t|`` of the method's scores (where
  attention sinks sit; ``null`` when every score is 0); the scores themselves are unchanged.

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
  (:mod:`captum_normattr.cli.dataset.launch`).
- **Resume.** A rerun with the same output skips the ids already in ``out.jsonl`` and in
  any shard left by a crashed run, and merges everything at the end; ``--overwrite``
  starts afresh. It resumes only the same job from the same texts: ``out.jsonl.job.json``
  holds :func:`job_fingerprint` (model, tokenizer, methods and options, position, target,
  token limit), and every record its text; a mismatch is refused naming what differs
  (:class:`OutputError`). A shard's torn last line is cut off before appending.
- **One writer.** The main process holds an exclusive ``flock`` on ``out.jsonl.lock`` from
  the first read to the merge (removed at the end, also after an error); a second run on the
  same output is refused.
- **Truncation.** Texts longer than the limit are cut with a warning; their records say
  ``"truncated": true`` and ``"tokens_cut": N``.
- A progress bar runs on the main process only (``-q`` turns it off).
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
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from captum_normattr.cli.dataset.launch import requested_cpu_processes, spawn_cpu_processes
from captum_normattr.progress import progress_bar

__all__ = ["InputError", "InputItem", "OutputError", "add_arguments", "explain_dataset", "job_fingerprint",
           "read_inputs", "run_cli", "same_file"]

MISSING_DATASETS_MESSAGE = (
    "reading a saved Hugging Face dataset needs the `datasets` package: pip install datasets "
    "(or export the texts to JSON Lines / CSV and pass that file)"
)


class InputError(ValueError):
    r"""A broken or unreadable input; the message names the file and line."""


class OutputError(RuntimeError):
    r"""The output cannot be written or resumed: another run writes it, or it holds another job's records."""


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


# --------------------------------------------------------------------------- output files


def same_file(a: Union[str, Path], b: Union[str, Path]) -> bool:
    r"""True when ``a`` and ``b`` name one file (also through symbolic and hard links; ``a`` may not exist yet)."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _shards(output: Path) -> List[Path]:
    return sorted(output.parent.glob(output.name + ".part-*"))


def _parsed_records(path: Path) -> Iterable[Tuple[Dict[str, Any], str]]:
    r"""(record, raw line) of every complete record of a JSON Lines output (a torn last line is skipped)."""
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
                yield rec, line


def _read_records(path: Path) -> Iterable[Tuple[Any, str]]:
    r"""(id, raw line) of every complete record of a JSON Lines output (a torn last line is skipped)."""
    for rec, line in _parsed_records(path):
        yield rec["id"], line


def _recorded_texts(output: Path) -> Dict[Any, Optional[str]]:
    r"""``key(id) -> text`` of every complete record of ``output`` and its shards (the first one of an id)."""
    texts: Dict[Any, Optional[str]] = {}
    for path in [output] + _shards(output):
        for rec, _ in _parsed_records(path):
            texts.setdefault(_key(rec["id"]), rec.get("text"))
    return texts


def _drop_torn_tail(path: Path) -> bool:
    r"""Cut ``path`` back to its last complete line (a process killed mid-write, a full disk); True if it did.

    Appending after a fragment would glue the next record onto it and lose both.
    """
    if not path.exists():
        return False
    with path.open("rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return False
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return False
        keep, end = 0, size
        while end > 0:
            start = max(0, end - (1 << 16))
            fh.seek(start)
            k = fh.read(end - start).rfind(b"\n")
            if k >= 0:
                keep = start + k + 1
                break
            end = start
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    return True


def lock_path(output: Path) -> Path:
    r"""The lock file of a run writing ``output``: ``<output>.lock`` (removed when the run ends)."""
    return output.with_name(output.name + ".lock")


def job_path(output: Path) -> Path:
    r"""The job description of ``output`` (:func:`job_fingerprint`): ``<output>.job.json``, kept for resuming."""
    return output.with_name(output.name + ".job.json")


class _OutputLock:
    r"""An exclusive, non-blocking ``flock`` on :func:`lock_path` (POSIX; elsewhere no lock is taken)."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = lock_path(output)
        self.fd: Optional[int] = None

    def acquire(self) -> Optional[str]:
        r"""Take the lock: None, or why not (another process holds it)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no flock
            return None
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                try:
                    holder = os.read(fd, 64).decode(errors="replace").strip()
                finally:
                    os.close(fd)
                who = f" (process {holder})" if holder.isdigit() else ""
                return (f"{self.output} is being written by another run{who}, which holds {self.path.name}; "
                        "wait for it to finish, or give another -o (two runs on one output would lose records)")
            try:  # the holder before us may have removed the file after we opened it: lock the current file
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except OSError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, str(os.getpid()).encode())
                self.fd = fd
                return None
            os.close(fd)
        return f"cannot lock {self.path}: it keeps being replaced"

    def release(self) -> None:
        if self.fd is None:
            return
        import fcntl

        try:
            self.path.unlink()  # while still held: a process that opened it before cannot lock a removed file
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def _sha(value: Any) -> str:
    import hashlib

    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True, default=str).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


#: configuration entries that say how a model runs, not what it computes (not part of its identity)
_RUNTIME_CONFIG_KEYS = ("transformers_version", "torch_dtype", "dtype", "attn_implementation", "output_attentions",
                        "output_hidden_states", "return_dict", "use_cache", "torchscript")


def _model_identity(model: Any) -> Dict[str, Any]:
    r"""The model's class, a hash of its configuration, a hash of a sample of every weight tensor, its dtype."""
    import torch

    config = getattr(model, "config", None)
    cfg = config.to_dict() if hasattr(config, "to_dict") else {}
    cfg = {k: v for k, v in cfg.items()
           if not k.startswith("_") and k not in _RUNTIME_CONFIG_KEYS}
    h = []
    dtype = None
    for name, param in model.named_parameters():
        dtype = dtype or str(param.dtype).replace("torch.", "")
        if param.device.type == "meta":  # offloaded by accelerate: the name only
            h.append(name)
            continue
        flat = param.detach().reshape(-1)
        sample = flat if flat.numel() <= 32 else torch.cat([flat[:16], flat[-16:]])
        h.append(name + ":" + _sha(sample.to("cpu", torch.float64).numpy().tobytes()))
    return {"name": str(getattr(config, "_name_or_path", "") or type(model).__name__), "class": type(model).__name__,
            "config": _sha(cfg), "weights": _sha(h), "dtype": dtype}


def job_fingerprint(model: Any, tokenizer: Any, specs: Sequence[Any], options: Any, max_length: Optional[int],
                    target: Optional[int]) -> Dict[str, Any]:
    r"""What a dataset run's records depend on, stored next to its output (:func:`job_path`) for resuming.

    ``model``: class, configuration hash, a hash of the first and last 16 values of every weight
    tensor (catches another checkpoint with the same configuration) and dtype (its name is shown,
    not compared); ``tokenizer``: class, vocabulary hash and truncation side; ``methods``: every
    method with each of its options; ``explained_position``, ``target`` and ``max_length`` (the limit
    the texts are cut to). Not compared: ``--batch-size``, ``--device``, the number of processes
    (they change the last bits only). Each record holds its text, which a resume compares too.

    Returns:
        A JSON-ready dict.
    """
    try:
        vocab = _sha(sorted(tokenizer.get_vocab().items()))
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab
        vocab = None
    methods = {spec.key: {opt.dest: getattr(options, opt.dest, opt.default) for opt in spec.options}
               for spec in sorted(specs, key=lambda sp: sp.key)}
    return _jsonable({
        "model": _model_identity(model),
        "tokenizer": {"class": type(tokenizer).__name__, "vocab": vocab,
                      "truncation_side": getattr(tokenizer, "truncation_side", None)},
        "methods": methods,
        "explained_position": getattr(options, "position", None),
        "target": target,
        "max_length": max_length,
    })


def _job_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> List[str]:
    r"""The parts of two :func:`job_fingerprint` dicts that differ, readably."""
    out = []
    for part in new:
        a, b = old.get(part), new[part]
        if part == "model" and isinstance(a, dict):
            keys = [k for k in ("class", "config", "weights", "dtype") if a.get(k) != b.get(k)]
            if keys:
                out.append(f"model ({', '.join(keys)} differ): {a.get('name')!r} there, {b.get('name')!r} now")
        elif part == "methods" and isinstance(a, dict):
            if list(a) != list(b):
                out.append(f"methods: {', '.join(a)} there, {', '.join(b)} now")
            else:
                for key in b:
                    for dest, value in b[key].items():
                        if a[key].get(dest) != value:
                            out.append(f"{key} option {dest}: {a[key].get(dest)!r} there, {value!r} now")
        elif a != b:
            out.append(f"{part}: {a!r} there, {b!r} now")
    return out


def _resume_problem(output: Path, job: Mapping[str, Any], items: Sequence["InputItem"]) -> Optional[str]:
    r"""Why the records of ``output`` (and its shards) cannot be resumed by this job, or None."""
    recorded = _recorded_texts(output)
    if not recorded:
        return None
    redo = "--overwrite (overwrite=True) starts afresh, or give another -o"
    side = job_path(output)
    try:
        old = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return (f"{output} holds {len(recorded)} record(s) but no readable job description {side.name} (written by "
                f"an older version or another program): cannot tell whether they match this run; {redo}")
    diffs = _job_differences(old, job)
    if diffs:
        return f"{output} holds the records of another job: {'; '.join(diffs)}. {redo}"
    changed = [it for it in items if _key(it.id) in recorded and recorded[_key(it.id)] != it.text]
    if changed:
        it = changed[0]
        return (f"{len(changed)} record(s) of {output} were explained from other texts than the input holds now "
                f"(was a line inserted or edited?), e.g. id {it.id!r}: {recorded[_key(it.id)]!r:.80} there, "
                f"{it.text!r:.80} now at {it.where}. {redo}")
    return None


def _write_job(output: Path, job: Mapping[str, Any]) -> None:
    side = job_path(output)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps(job, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, side)


def _agree(state: Any, value: Any) -> Any:
    r"""The main process's ``value`` on every process (so that all of them stop together)."""
    if state.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


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


def _sink_share(scores: Sequence[float]) -> Optional[float]:
    r"""The first real token's share of the absolute scores (:func:`captum_normattr.present.report.first_token_share`);
    None (JSON ``null``) where it is undefined (all scores 0)."""
    from captum_normattr.present.report import first_token_share

    share = first_token_share(scores)
    return share if share == share else None


def _completeness(res: Any, i: int) -> Optional[float]:
    r"""The example's completeness error: its delta, else the largest per-layer error of its batch."""
    if getattr(res, "delta", None) is not None:
        return float(res.delta[i].abs())
    err = getattr(res, "extras", {}).get("completeness_error")
    return None if err is None else float(err.abs().max())


def _records(
    chunk: Sequence[InputItem], tokenizer: Any, ids: Any, mask: Any, results: Mapping[str, Any],
    cut: Sequence[int] = (),
) -> List[Dict[str, Any]]:
    from torch import Tensor

    from captum_normattr.present.tokens import readable_tokens

    out = []
    for i, item in enumerate(chunk):
        keep = mask[i].bool().cpu()
        first = int(keep.long().argmax())  # left padding moves positions; positions are given over real tokens
        real_ids = ids[i].cpu()[keep].tolist()
        methods: Dict[str, Any] = {}
        for key, res in results.items():
            if isinstance(res, Tensor):
                scores = _to_list(res[i].cpu()[keep])
                methods[key] = {"method": key, "scores": scores, "completeness_error": None,
                                "sink_share": _sink_share(scores)}
                continue
            scores = _to_list(res.scores[i].cpu()[keep])
            entry: Dict[str, Any] = {
                "method": res.method,
                "scores": scores,
                "completeness_error": _completeness(res, i),
                "sink_share": _sink_share(scores),
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
        out[-1]["truncated"] = bool(cut and cut[i])
        if cut and cut[i]:
            out[-1]["tokens_cut"] = int(cut[i])
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


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=4)


def _truncation_warnings(share: Sequence[InputItem], cut: Sequence[int], limit: Optional[int], side: str,
                         warn: Callable[[str], None], shown: int = 5) -> None:
    r"""One warning per truncated text (the first ``shown``), then one for the rest."""
    where = "first" if side == "left" else "last"
    hit = [k for k, c in enumerate(cut) if c]
    for k in hit[:shown]:
        warn(f"{share[k].where} (id {share[k].id!r}) has {limit + cut[k]} tokens but the limit is {limit}: its "
             f"{where} {cut[k]} token(s) were cut; its record says \"truncated\": true (see --max-length)")
    if len(hit) > shown:
        warn(f"{len(hit) - shown} more text(s) were cut to {limit} tokens; their records say \"truncated\": true")


def _prepare_output(state: Any, output: Path, items: Sequence[InputItem], job: Optional[Mapping[str, Any]],
                    overwrite: bool, warn: Callable[[str], None]) -> None:
    r"""Main process (with the lock held): start afresh or check that the job and texts match; repair torn shards.

    Raises:
        OutputError: on every process, when the records there belong to another job or texts.
    """
    problem = None
    if state.is_main_process:
        if overwrite:
            for path in [output, job_path(output)] + _shards(output):
                path.unlink(missing_ok=True)
        for path in _shards(output):
            if _drop_torn_tail(path):
                warn(f"{path.name}: dropped its incomplete last line (a run stopped while writing it); "
                     "that text is explained again")
        problem = _resume_problem(output, job, items) if job is not None else None
        if problem is None and job is not None:
            _write_job(output, job)
    problem = _agree(state, problem)
    if problem is not None:
        raise OutputError(problem)


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
    warn: Callable[[str], None] = _warn,
) -> List[Dict[str, Any]]:
    r"""The shared core of :func:`explain_dataset` and the command line; returns this process's new records.

    With an ``output``, the main process holds an exclusive lock on it (:func:`lock_path`) from the
    first read to the merge, released also after an error; a second run on the same output is
    refused (:class:`OutputError`) on every process.
    """
    from captum_normattr.cli import common as cli_common  # explain_batch looked up at run time (tests replace it)

    state = _state()
    attrs = cli_common.build_attributions(specs, model, options)
    limit = cli_common.resolve_max_length(model, tokenizer, max_length)
    lock = _OutputLock(output) if output is not None and state.is_main_process else None
    try:
        if output is not None:
            busy = _agree(state, lock.acquire() if lock is not None else None)
            if busy is not None:
                raise OutputError(busy)
            job = job_fingerprint(model, tokenizer, specs, options, limit, target) if state.is_main_process else None
            _prepare_output(state, output, items, job, overwrite, warn)
            state.wait_for_everyone()
            done = set(_recorded_texts(output))
            state.wait_for_everyone()  # every process has read the done ids before any shard grows
            todo = [it for it in items if _key(it.id) not in done]
        else:
            todo = list(items)
        new = _explain_share(state, todo, tokenizer, attrs, output, limit, batch_size, target, progress, device,
                             warn, cli_common.CLIError, cli_common.explain_batch)
        if output is not None:
            state.wait_for_everyone()
            if state.is_main_process:
                _merge(output, items)
            state.wait_for_everyone()
    finally:
        if lock is not None:
            lock.release()
    return new


def _explain_share(state: Any, todo: Sequence[InputItem], tokenizer: Any, attrs: Sequence[Any],
                   output: Optional[Path], limit: Optional[int], batch_size: int, target: Optional[int],
                   progress: bool, device: Any, warn: Callable[[str], None], cli_error: Any,
                   explain_batch: Callable[..., Any]) -> List[Dict[str, Any]]:
    r"""This process's share of ``todo``, sorted by length, in batches; each batch appended to its shard."""
    with state.split_between_processes(list(todo)) as share:
        share = list(share)
    full = [len(tokenizer(it.text, truncation=False, verbose=False)["input_ids"]) for it in share]
    cut = [max(0, n - limit) if limit is not None else 0 for n in full]
    _truncation_warnings(share, cut, limit, getattr(tokenizer, "truncation_side", "right"), warn)
    order = sorted(range(len(share)), key=lambda k: (full[k] - cut[k], k))
    shard = None if output is None else output.with_name(f"{output.name}.part-{state.process_index}")
    desc = "captum-normattr" + (f" (process 0 of {state.num_processes})" if state.num_processes > 1 else "")
    bar = progress_bar(len(share), enabled=progress and state.is_main_process, desc=desc, unit="text", min_total=1)
    new: List[Dict[str, Any]] = []
    try:
        for start in range(0, len(order), batch_size):
            ks = order[start:start + batch_size]
            chunk = [share[k] for k in ks]
            enc = tokenizer([it.text for it in chunk], return_tensors="pt", padding=True,
                            truncation=limit is not None, max_length=limit)
            ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
            results: Dict[str, Any] = {}
            for spec, attr in attrs:
                try:
                    results[spec.key] = explain_batch(spec, attr, ids, mask, target, False)
                except (ValueError, TypeError, NotImplementedError) as err:
                    raise cli_error(f"{spec.key} on {chunk[0].where}...: {err}") from None
            recs = _records(chunk, tokenizer, ids, mask, results, [cut[k] for k in ks])
            if shard is not None:
                with shard.open("a", encoding="utf-8") as fh:
                    fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
                    fh.flush()
                    os.fsync(fh.fileno())
            new.extend(recs)
            bar.update(len(chunk))
    finally:
        bar.close()
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
        methods: registry keys (:data:`captum_normattr.attr.methods.METHODS`).
        output: a ``.jsonl`` path to write (and resume: ids already there are skipped, after checking
            that they were explained by the same job from the same texts), or None. While the run
            writes it, ``<output>.lock`` is held (a second run on it is refused); ``<output>.job.json``
            keeps the job's description (:func:`job_fingerprint`) for resuming.
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
        OutputError: when another run writes ``output``, or its records belong to another job
            (another model, methods, options, ``max_length``, ``target``) or to other texts
            (the message says which part differs); ``overwrite=True`` starts afresh.

    Texts longer than ``max_length`` are cut with a warning and their records say
    ``"truncated": true`` (and ``"tokens_cut"``).

    Examples::

        >>> recs = explain_dataset(["a gripping film", "dull"], methods=["alti", "globenc"])
        >>> recs[0]["tokens"], recs[0]["methods"]["alti"]["scores"]
        >>> explain_dataset("reviews.csv", model, tok, ["decompx"], "out.jsonl", column="review", id_column="id")
    """
    import argparse

    from captum_normattr.attr.methods import get_method

    if output is not None and isinstance(source, (str, Path)) and same_file(Path(output).expanduser(),
                                                                          Path(source).expanduser()):
        raise OutputError(f"output {output} is the input {source}: writing there would replace the input; "
                          "give another output path")
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
        from captum_normattr.cli.common import is_decoder

        ns.position = "last" if is_decoder(model) else 0
    from captum_normattr.models.weights import is_dispatched

    device = None if is_dispatched(model) else next(model.parameters()).device
    path = None if output is None else Path(output).expanduser()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
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
    from captum_normattr.cli.common import PROG, CLIError, is_decoder, load_model, resolve_device
    from captum_normattr.present.tokens import terminal_lines, visible_text

    if args.output is None:
        raise CLIError("--format jsonl needs --output PATH (records are appended and resumed there)")
    if args.html_maps or args.plots:
        raise CLIError("--html-maps and --plots do not apply to --format jsonl")
    if args.aggregate:
        raise CLIError(f"--aggregate {args.aggregate} does not apply to --format jsonl: the records hold token scores "
                       "(with their tokens); sum them into words or sentences afterwards with "
                       "captum_normattr.aggregation, or use --format json")
    if getattr(args, "exclude_sink", False):
        raise CLIError("--exclude-sink does not apply to --format jsonl: the records hold the scores unchanged and "
                       "every method's sink_share (the first token's share); leave the first token out when reading "
                       "them, or use --format table, html or json")
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
    device = resolve_device(args.device)
    if state.num_processes > 1 and state.device.type != "cpu":
        device = state.device  # accelerate launch on several GPUs: one device per process
    model, tok, _ = load_model(args.model, device, getattr(args, "trust_remote_code", False))
    try:
        _pad_token(tok)
    except InputError as err:
        raise CLIError(str(err)) from None
    if args.position is None:
        args.position = "last" if is_decoder(model) else 0
    output = Path(args.output).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        new = _run(items, model, tok, specs, args, output, batch_size=args.batch_size, max_length=args.max_length,
                   target=args.target, progress=not args.quiet, overwrite=args.overwrite, device=device,
                   warn=lambda msg: print(f"{PROG}: warning: {terminal_lines(msg)}", file=sys.stderr))
    except OutputError as err:
        if not state.is_main_process:
            return 2  # every process stops; the main process says why, once
        raise CLIError(str(err)) from None
    counts = [len(new)]
    if state.num_processes > 1:
        from accelerate.utils import gather_object

        counts = gather_object(counts)  # texts explained now by each process, in process order
    if state.is_main_process and not args.quiet:
        n = sum(1 for _ in _read_records(output))
        per = f": {' + '.join(map(str, counts))} explained now" if state.num_processes > 1 else ""
        print(f"{PROG}: wrote {visible_text(args.output)} ({n} records, {state.num_processes} process"
              f"{'es' if state.num_processes > 1 else ''}{per})", file=sys.stderr)
    return 0
