r"""The output of a dataset run: one writer, resumable, merged in input order.

- **One writer.** The main process holds an exclusive ``flock`` on ``out.jsonl.lock``
  (:func:`lock_path`, :class:`OutputLock`) from the first read to the merge (removed at the
  end, also after an error); a second run on the same output is refused.
- **Resume.** A rerun with the same output skips the ids already in ``out.jsonl`` and in any
  shard (``out.jsonl.part-<rank>``) left by a crashed run (:func:`recorded_texts`); a shard's
  torn last line is cut off before appending. It resumes only the same job from the same
  texts: ``out.jsonl.job.json`` (:func:`job_path`) holds :func:`job_fingerprint` (model,
  tokenizer, methods and options, position, target, token limit), and every record its text;
  a mismatch is refused naming what differs (:class:`OutputError`, :func:`prepare_output`).
- **Records.** :func:`read_records` reads the complete records of an output;
  :func:`merge_output` writes the output and its shards into the output in input order
  (a temporary file, then renamed) and removes the shards. Ids are compared as written
  (:func:`record_key`: 3 and ``"3"`` differ).

Used by :mod:`captum_normattr.cli.dataset.run`; see ``docs/scale.md``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from captum_normattr.cli.dataset.inputs import InputItem

__all__ = ["OutputError", "OutputLock", "agree", "job_fingerprint", "job_path", "lock_path", "merge_output",
           "prepare_output", "read_records", "record_key", "recorded_texts", "same_file", "tensor_digest"]


class OutputError(RuntimeError):
    r"""The output cannot be written or resumed: another run writes it, or it holds another job's records."""


# --------------------------------------------------------------------------- output files


def same_file(a: Union[str, Path], b: Union[str, Path]) -> bool:
    r"""True when ``a`` and ``b`` name one file (also through symbolic and hard links; ``a`` may not exist yet).

    Args:
        a, b: the paths.

    Returns:
        Whether they are one file (``os.path.samefile`` where both exist, else their resolved paths agree).
    """
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


def read_records(path: Path) -> Iterable[Tuple[Any, str]]:
    r"""The complete records of a JSON Lines output (a torn last line is skipped).

    Args:
        path: the output or one of its shards (a missing file has no records).

    Returns:
        (id, raw line) of every record with an ``id``, in file order.
    """
    for rec, line in _parsed_records(path):
        yield rec["id"], line


def recorded_texts(output: Path) -> Dict[Any, Optional[str]]:
    r"""The texts already explained into ``output`` and its shards (the first record of an id).

    Args:
        output: the run's output file.

    Returns:
        ``record_key(id) -> text`` (None for a record without its text).
    """
    texts: Dict[Any, Optional[str]] = {}
    for path in [output] + _shards(output):
        for rec, _ in _parsed_records(path):
            texts.setdefault(record_key(rec["id"]), rec.get("text"))
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
    r"""The lock file of a run writing ``output`` (removed when the run ends).

    Args:
        output: the run's output file.

    Returns:
        ``<output>.lock``.
    """
    return output.with_name(output.name + ".lock")


def job_path(output: Path) -> Path:
    r"""The job description of ``output`` (:func:`job_fingerprint`), kept for resuming.

    Args:
        output: the run's output file.

    Returns:
        ``<output>.job.json``.
    """
    return output.with_name(output.name + ".job.json")


class OutputLock:
    r"""An exclusive, non-blocking ``flock`` on :func:`lock_path` (POSIX; elsewhere no lock is taken).

    Args:
        output: the run's output file.
    """

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
        r"""Remove the lock file and release the lock (nothing to do when it was not taken)."""
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


def tensor_digest(t: Any) -> str:
    r"""BLAKE2b digest (16 hex digits) of every byte of a tensor, with its dtype and shape.

    The bytes are read in place (a contiguous CPU tensor is not copied; others are copied
    once to the CPU), so any edit of any value changes the digest: a head or neuron ablation
    that zeroes a few rows, a rescaled column. Measured cost: docs/reliability.md, "Resuming".
    """
    import hashlib

    import torch

    x = t.detach()
    if x.device.type != "cpu":
        x = x.to("cpu")
    x = x.contiguous()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{x.dtype}:{tuple(x.shape)}".encode())
    if x.numel():
        h.update(memoryview(x.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _model_identity(model: Any) -> Dict[str, Any]:
    r"""The model's class, a hash of its configuration, a hash of every byte of every weight tensor, its dtype."""
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
        h.append(name + ":" + tensor_digest(param))
    return {"name": str(getattr(config, "_name_or_path", "") or type(model).__name__), "class": type(model).__name__,
            "config": _sha(cfg), "weights": _sha(h), "dtype": dtype}


def job_fingerprint(model: Any, tokenizer: Any, specs: Sequence[Any], options: Any, max_length: Optional[int],
                    target: Optional[int]) -> Dict[str, Any]:
    r"""What a dataset run's records depend on, stored next to its output (:func:`job_path`) for resuming.

    ``model``: class, configuration hash, a hash of every byte of every weight tensor
    (:func:`tensor_digest`: another checkpoint with the same configuration, or any in-place edit
    such as a head or neuron ablation) and dtype (its name is shown,
    not compared); ``tokenizer``: class, vocabulary hash and truncation side; ``methods``: every
    method with each of its options; ``explained_position``, ``target`` and ``max_length`` (the limit
    the texts are cut to). Not compared: ``--batch-size``, ``--device``, the number of processes
    (they change the last bits only). Each record holds its text, which a resume compares too.

    Args:
        model, tokenizer: the run's model and tokenizer.
        specs: the methods (:class:`~captum_normattr.attr.methods.MethodSpec`).
        options: their options (a namespace keyed by option ``dest``; ``position`` too).
        max_length: the token limit the texts are cut to.
        target: the explained target (None: predicted).

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


def _resume_problem(output: Path, job: Mapping[str, Any], items: Sequence[InputItem]) -> Optional[str]:
    r"""Why the records of ``output`` (and its shards) cannot be resumed by this job, or None."""
    recorded = recorded_texts(output)
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
    changed = [it for it in items if record_key(it.id) in recorded and recorded[record_key(it.id)] != it.text]
    if changed:
        it = changed[0]
        return (f"{len(changed)} record(s) of {output} were explained from other texts than the input holds now "
                f"(was a line inserted or edited?), e.g. id {it.id!r}: {recorded[record_key(it.id)]!r:.80} there, "
                f"{it.text!r:.80} now at {it.where}. {redo}")
    return None


def _write_job(output: Path, job: Mapping[str, Any]) -> None:
    side = job_path(output)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps(job, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, side)


def agree(state: Any, value: Any) -> Any:
    r"""The main process's ``value`` on every process (so that all of them stop together).

    Args:
        state: accelerate's ``PartialState``.
        value: a picklable value (only the main process's counts).

    Returns:
        The main process's ``value``.
    """
    if state.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


def record_key(value: Any) -> str:
    r"""The key a record's id is compared by: as written, so 3 and ``"3"`` differ, as they do in the file.

    Args:
        value: a record id.

    Returns:
        Its JSON text.
    """
    return json.dumps(value)


def merge_output(output: Path, items: Sequence[InputItem]) -> int:
    r"""Write the records of ``output`` and its shards into ``output`` in input order; remove the shards.

    Records of ids no longer in the input are kept, after the others.

    Args:
        output: the run's output file.
        items: the inputs, in order.

    Returns:
        The number of records written.
    """
    lines: Dict[Any, str] = {}
    shards = _shards(output)
    for path in [output] + shards:
        for i, line in read_records(path):
            lines.setdefault(record_key(i), line)
    order = [record_key(it.id) for it in items]
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


def prepare_output(state: Any, output: Path, items: Sequence[InputItem], job: Optional[Mapping[str, Any]],
                   overwrite: bool, warn: Callable[[str], None]) -> None:
    r"""Main process (with the lock held): start afresh or check that the job and texts match; repair torn shards.

    Args:
        state: accelerate's ``PartialState`` (every process calls this).
        output: the run's output file.
        items: the inputs, in order.
        job: this run's :func:`job_fingerprint` (None on the other processes).
        overwrite: remove the output, its job description and its shards first.
        warn: called with a message for every shard whose torn last line was cut off.

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
    problem = agree(state, problem)
    if problem is not None:
        raise OutputError(problem)
