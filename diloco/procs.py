"""Child processes: the environment they start with, their memory, stopping them, and dying with the parent.

`diloco launch`, the benches, the swarm's background processes and the tests all start processes; these are
the four things each of them needs, written once, and the temp folder their shared memory needs. psutil, signals
and the standard library only: no torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable

import psutil

from diloco.errors import UsageError

# What torchrun tells one rank about its group: a child started from a rank is a launch of its own
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(threads: int | None = 1, **extra: str) -> dict[str, str]:
    """This process's environment for a child: unbuffered output (its log lines arrive as they are written),
    none of torchrun's per-rank variables, and `threads` OpenMP/MKL threads per process.

    :param threads: torch threads per process; 1 where processes share few cores (tests, benches: more threads
        only contend), None to leave the user's setting alone (`diloco launch`).
    :param extra: variables to set as well.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in LAUNCHER_VARIABLES:
        env.pop(name, None)
    if threads is not None:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return env | extra


def family(pid: int) -> list[psutil.Process]:
    """The process and all its descendants that still run ([] once it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_pss_mb(pids: int | Iterable[int]) -> float:
    """Summed proportional set size of processes and all their descendants, in MiB (0 once they are gone): a page
    shared by n processes counts 1/n in each, so the sum is the memory they hold together."""
    total = 0
    for pid in [pids] if isinstance(pids, int) else pids:
        for proc in family(pid):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += proc.memory_full_info().pss
    return total / 2**20


def tree_rss_mb(pids: int | Iterable[int]) -> float:
    """Summed resident set size of processes and all their descendants, in MiB (0 once they are gone). Shared
    memory counts in every process that maps it."""
    total = 0
    for pid in [pids] if isinstance(pids, int) else pids:
        for proc in family(pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += proc.memory_info().rss
    return total / 2**20


def stop_tree(proc: subprocess.Popen, grace_s: float, sig: int | None = signal.SIGINT) -> None:
    """Send `sig` to `proc` (None: none), give it `grace_s` seconds to exit, then SIGKILL whatever is left of it
    and of its descendants, and reap it.

    The descendants are collected before the signal, and killed by pid as well as by process group: hivemind's
    DHT and averager processes move to process groups of their own, so a killpg alone would miss them.
    """
    # once it is reaped its pid may be another process's: only its process group is still its own
    procs = family(proc.pid) if proc.poll() is None else []
    if sig is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # a session of its own (start_new_session): its group id is its pid
    kill_all(procs)
    proc.wait()


def kill_all(procs: Iterable[psutil.Process], grace_s: float = 0.0) -> None:
    """SIGKILL those of `procs` still running after `grace_s` seconds, and wait (briefly) until they are gone."""
    _, alive = psutil.wait_procs(list(procs), timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


def exit_with_parent(parent_pid: int | None = None, poll_s: float = 0.5) -> None:
    """Exit this process (`os._exit(1)`) as soon as its parent is gone, whatever it is doing.

    For background processes whose parent may die by SIGKILL: nothing else would tell them (hivemind's DHT and
    averager processes hold both ends of their control pipes), and they would live on with their children.

    :param parent_pid: the parent to watch [default: the current parent].
    """
    parent = os.getppid() if parent_pid is None else parent_pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# hivemind shares memory through torch's "file_system" strategy, whose manager listens on a unix socket inside the
# temp folder; a socket path holds at most 107 bytes, so a longer TMPDIR fails deep inside torch (measured limit
# with torch 2.13: 73 characters)
TEMPDIR_MAX_CHARS = 73


def check_tempdir() -> None:
    """The temp folder's path is short enough for the socket of torch's shared-memory manager (the swarm needs
    it); a clear line naming TMPDIR instead of a traceback from torch's C++ side."""
    folder = tempfile.gettempdir()
    if len(folder) > TEMPDIR_MAX_CHARS:
        raise UsageError(
            f"TMPDIR {folder}: {len(folder)} characters; the swarm needs a temp folder path of at most "
            f"{TEMPDIR_MAX_CHARS} (torch's shared-memory socket lives there): set TMPDIR to a shorter folder"
        )
