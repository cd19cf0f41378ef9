r"""Dataset runs: explain every text of a corpus, one JSON Lines record per text, resumable and multi-process.

``captum-normattr --file texts.txt -m alti --format jsonl -o out.jsonl`` (or
``python -m captum_normattr ...``, the same program) writes one record per input text::

    {"id": 3, "text": "...", "tokens": ["[CLS]", ...],
     "methods": {"alti": {"method": "ALTI", "scores": [...], "completeness_error": 1e-7,
                          "sink_share": 0.31, "explained_position": 0}}}

  ``sink_share``: the first token's share ``|s_0| / sum_t |s_t|`` of the method's scores (where
  attention sinks sit; ``null`` when every score is 0); the scores themselves are unchanged.

- **Inputs** (:func:`~captum_normattr.cli.dataset.inputs.read_inputs`): a text file (one
  text per line, blank lines skipped; the id is the line number), JSON Lines or CSV/TSV
  (the text in ``--column``, default ``text``; the id in ``--id-column``, default the line /
  row number), or a folder saved with Hugging Face ``datasets`` ``save_to_disk`` (needs
  ``datasets``; ``--split`` picks a split of a ``DatasetDict``; the id is the row index). Every input is checked before
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
- **Resume** (:mod:`captum_normattr.cli.dataset.resume`). A rerun with the same output skips
  the ids already in ``out.jsonl`` and in any shard left by a crashed run, and merges
  everything at the end; ``--overwrite`` starts afresh. It resumes only the same job from
  the same texts: ``out.jsonl.job.json`` holds
  :func:`~captum_normattr.cli.dataset.resume.job_fingerprint` (model, tokenizer, methods and
  options, position, target, token limit), and every record its text; a mismatch is refused
  naming what differs (:class:`~captum_normattr.cli.dataset.resume.OutputError`). A shard's
  torn last line is cut off before appending.
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

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from captum_normattr.cli.dataset.inputs import InputError, InputItem, read_inputs
from captum_normattr.cli.dataset.launch import requested_cpu_processes, spawn_cpu_processes
from captum_normattr.cli.dataset.resume import (
    OutputError,
    OutputLock,
    agree,
    job_fingerprint,
    merge_output,
    prepare_output,
    read_records,
    record_key,
    recorded_texts,
    same_file,
)
from captum_normattr.progress import progress_bar

__all__ = ["add_arguments", "explain_dataset", "run_cli"]


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

    from captum_normattr.tokens import readable_tokens

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

    With an ``output``, the main process holds an exclusive lock on it
    (:func:`~captum_normattr.cli.dataset.resume.lock_path`) from the first read to the merge,
    released also after an error; a second run on the same output is refused
    (:class:`~captum_normattr.cli.dataset.resume.OutputError`) on every process.
    """
    from captum_normattr.cli import common as cli_common  # explain_batch looked up at run time (tests replace it)

    state = _state()
    attrs = cli_common.build_attributions(specs, model, options)
    limit = cli_common.resolve_max_length(model, tokenizer, max_length)
    lock = OutputLock(output) if output is not None and state.is_main_process else None
    try:
        if output is not None:
            busy = agree(state, lock.acquire() if lock is not None else None)
            if busy is not None:
                raise OutputError(busy)
            job = job_fingerprint(model, tokenizer, specs, options, limit, target) if state.is_main_process else None
            prepare_output(state, output, items, job, overwrite, warn)
            state.wait_for_everyone()
            done = set(recorded_texts(output))
            state.wait_for_everyone()  # every process has read the done ids before any shard grows
            todo = [it for it in items if record_key(it.id) not in done]
        else:
            todo = list(items)
        new = _explain_share(state, todo, tokenizer, attrs, output, limit, batch_size, target, progress, device,
                             warn, cli_common.CLIError, cli_common.explain_batch)
        if output is not None:
            state.wait_for_everyone()
            if state.is_main_process:
                merge_output(output, items)
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
        source: texts, a file or a saved dataset (see :func:`~captum_normattr.cli.dataset.inputs.read_inputs`).
        model, tokenizer: the model (on its device, or dispatched by accelerate) and its
            tokenizer; both None: the packaged MiniLM.
        methods: registry keys (:data:`captum_normattr.attr.methods.METHODS`).
        output: a ``.jsonl`` path to write (and resume: ids already there are skipped, after checking
            that they were explained by the same job from the same texts), or None. While the run
            writes it, ``<output>.lock`` is held (a second run on it is refused); ``<output>.job.json``
            keeps the job's description (:func:`~captum_normattr.cli.dataset.resume.job_fingerprint`) for resuming.
        column, id_column, split: see :func:`~captum_normattr.cli.dataset.inputs.read_inputs`.
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
    from captum_normattr.cli.common import inputs_device, is_decoder

    if output is not None and isinstance(source, (str, Path)) and same_file(Path(output).expanduser(),
                                                                          Path(source).expanduser()):
        raise OutputError(f"output {output} is the input {source}: writing there would replace the input; "
                          "give another output path")
    items = read_inputs(source, column, id_column, split)
    if model is None:
        from captum_normattr.models.loading import load_default_model

        model, tokenizer = load_default_model()
    if tokenizer is None:
        raise ValueError("pass the model's tokenizer")
    _pad_token(tokenizer)
    specs = [get_method(m) for m in dict.fromkeys(methods)]
    ns = argparse.Namespace(**dict(options or {}))
    if getattr(ns, "position", None) is None:
        ns.position = "last" if is_decoder(model) else 0
    device = inputs_device(model)
    path = None if output is None else Path(output).expanduser()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    new = _run(items, model, tokenizer, specs, ns, path, batch_size=batch_size, max_length=max_length,
               target=target, progress=progress, overwrite=overwrite, device=device)
    if path is not None:
        return [json.loads(line) for _, line in read_records(path)]
    rank = {record_key(it.id): n for n, it in enumerate(items)}
    return sorted(new, key=lambda r: rank[record_key(r["id"])])


# --------------------------------------------------------------------------- command line


def add_arguments(parser: Any) -> None:
    r"""The dataset-run options of the command line (used with ``--format jsonl``)."""
    g = parser.add_argument_group("dataset runs (--format jsonl; see docs/scale.md)")
    g.add_argument("--column", default="text", help="JSON Lines / CSV / dataset: the text column (default: text)")
    g.add_argument("--id-column", default=None,
                   help="the column holding each record's id (default: line number, CSV row number or dataset index)")
    g.add_argument("--split", default=None, help="saved DatasetDict: the split to read")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output file: a jsonl dataset run starts it afresh (default: resume, "
                        "skipping the ids already written); table, json and html outputs refuse an existing file "
                        "without it")


def run_cli(args: Any, specs: Sequence[Any]) -> int:
    r"""``--format jsonl``: explain ``--file`` (and TEXT arguments) into ``--output``, resumable, multi-process."""
    from captum_normattr.cli.common import PROG, CLIError, is_decoder, load_model, resolve_device
    from captum_normattr.tokens import terminal_lines, visible_text

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
        n = sum(1 for _ in read_records(output))
        per = f": {' + '.join(map(str, counts))} explained now" if state.num_processes > 1 else ""
        print(f"{PROG}: wrote {visible_text(args.output)} ({n} records, {state.num_processes} process"
              f"{'es' if state.num_processes > 1 else ''}{per})", file=sys.stderr)
    return 0
