r"""Several CPU processes under ``accelerate launch --cpu --num_processes N``.

accelerate (1.16) starts CPU processes through ``mpirun`` only (``--mpirun_hostfile``).
Without it, ``accelerate launch --cpu --num_processes N -m captum_normattr ...`` runs its
"simple" launcher: **one** process, with ``ACCELERATE_USE_CPU=True`` and
``MASTER_ADDR``/``MASTER_PORT`` set but no rank or world size, so every
``PartialState`` sees a single process. The same happens with ``--num_processes N`` and no
``--cpu`` on a machine without GPUs.

:func:`requested_cpu_processes` recognises that situation (this process was started by
``accelerate launch`` with ``N > 1`` processes on one machine, no distributed environment
exists and the run is on CPU) by reading the launcher's own command line with accelerate's
own parser, and :func:`spawn_cpu_processes` then starts the N processes that were asked for,
on this machine, joined over gloo like ``torchrun --nproc_per_node N`` would (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on a free port), and
returns the first failing exit status. The dataset runs of the command line
(:func:`captum_normattr.cli.dataset.run.run_cli`) use it; see ``docs/scale.md``.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

__all__ = ["close_process_group", "launch_arguments", "requested_cpu_processes", "spawn_cpu_processes"]

DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                   "MV2_COMM_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "y", "on")


def _parent_argv() -> List[str]:
    r"""The command line of this process's parent ([] where it cannot be read)."""
    try:
        import psutil  # an accelerate dependency

        return list(psutil.Process(os.getppid()).cmdline())
    except Exception:  # noqa: BLE001 - no psutil, no permission, parent gone: not under accelerate launch
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
                return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            return []


def launch_arguments(argv: Sequence[str]) -> Optional[List[str]]:
    r"""The arguments after ``accelerate launch`` in a command line, or None if it is not one.

    Recognises ``accelerate launch ...``, ``accelerate-launch ...`` and
    ``python -m accelerate.commands.launch ...`` (also ``accelerate.commands.accelerate_cli launch``).

    Args:
        argv: a process's command line (``argv[0]`` included).

    Returns:
        The list of launcher arguments (options, then the script or module and its arguments),
        or None.

    Examples::

        >>> launch_arguments(["/venv/bin/python", "/venv/bin/accelerate", "launch", "--cpu", "-m", "x"])
        ['--cpu', '-m', 'x']
        >>> launch_arguments(["python", "-m", "pytest"]) is None
        True
    """
    argv = list(argv)
    for i, arg in enumerate(argv):
        name = os.path.basename(arg)
        if name == "accelerate-launch":
            return argv[i + 1:]
        if name == "accelerate" and i + 1 < len(argv) and argv[i + 1] == "launch":
            return argv[i + 2:]
        if arg == "-m" and i + 1 < len(argv):
            if argv[i + 1] == "accelerate.commands.launch":
                return argv[i + 2:]
            if argv[i + 1] in ("accelerate", "accelerate.commands.accelerate_cli") and argv[i + 2:i + 3] == ["launch"]:
                return argv[i + 3:]
    return None


def requested_cpu_processes(argv: Optional[Sequence[str]] = None) -> int:
    r"""How many CPU processes ``accelerate launch`` asked for where it started only this one.

    Args:
        argv: the launcher's command line (default: this process's parent's).

    Returns:
        N > 1 when this process was started by ``accelerate launch`` with ``--num_processes N``
        (or N in its config file) on one machine, without ``--mpirun_hostfile``, no
        distributed environment exists (no ``RANK``/``WORLD_SIZE``/MPI variables), and the
        run is on CPU (``--cpu``, or no GPU); else 1.
    """
    env = os.environ
    if any(k in env for k in DISTRIBUTED_ENV) or "MASTER_ADDR" not in env:
        return 1  # already distributed, or not started by accelerate's simple launcher
    rest = launch_arguments(_parent_argv() if argv is None else argv)
    if rest is None:
        return 1
    try:
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(rest)
    except (ImportError, SystemExit):
        return 1
    n, machines = args.num_processes, args.num_machines
    if n is None or machines is None:
        try:
            from accelerate.commands.config import default_config_file, load_config_from_file

            if args.config_file is not None or (os.path.isfile(default_config_file) and not args.cpu):
                config = load_config_from_file(args.config_file)
                n = getattr(config, "num_processes", None) if n is None else n
                machines = getattr(config, "num_machines", None) if machines is None else machines
        except Exception:  # noqa: BLE001 - an unreadable config: accelerate itself would have said so
            pass
    if args.mpirun_hostfile is not None or (machines or 1) > 1 or not n or n <= 1:
        return 1
    if not _truthy(env.get("ACCELERATE_USE_CPU")):
        import torch

        accel = getattr(torch, "accelerator", None)
        if accel.is_available() if accel is not None else torch.cuda.is_available():
            return 1  # N processes sharing one accelerator: accelerate's choice, left alone
    return int(n)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_cpu_processes(n: int, argv: Sequence[str], *, poll_s: float = 0.05) -> int:
    r"""Run ``python *argv`` as ``n`` CPU processes of one gloo group on this machine; wait for all.

    Each process gets ``RANK`` = ``LOCAL_RANK`` = its index, ``WORLD_SIZE`` =
    ``LOCAL_WORLD_SIZE`` = ``n``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` = a free port and
    ``ACCELERATE_USE_CPU=true`` (what accelerate's ``PartialState(cpu=True)`` reads). When
    one process fails, the others are stopped (they would otherwise wait for it).

    Args:
        n: number of processes.
        argv: the arguments after the interpreter, e.g. ``["-m", "captum_normattr", ...]``.
        poll_s: how often the processes are checked.

    Returns:
        0 when every process succeeded, else the exit status of the first one that failed
        (130 after Ctrl-C).
    """
    port = _free_port()
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_USE_CPU="true")
        procs.append(subprocess.Popen([sys.executable, *argv], env=env))
    failed: Optional[int] = None
    try:
        while any(p.poll() is None for p in procs):
            if failed is None:
                for p in procs:
                    if p.returncode not in (None, 0):
                        failed = p.returncode
                        for q in procs:
                            if q.poll() is None:
                                q.terminate()
                        break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        for q in procs:
            if q.poll() is None:
                q.terminate()
        for q in procs:
            q.wait()
        return 130
    if failed is None:
        failed = next((p.returncode for p in procs if p.returncode != 0), 0)
    return failed


def close_process_group() -> None:
    r"""Tear down this process's ``torch.distributed`` group, if one was started, before it exits.

    A gloo group left to the interpreter's shutdown can abort the process after its work is
    done ("terminate called without an active exception", exit status 250), which the
    launcher then reports as a failure. Called by ``python -m captum_normattr`` on exit.

    Examples::

        >>> close_process_group()  # no group: nothing to do
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # no process tears down while another still talks to it
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit: the records are written already
        pass

