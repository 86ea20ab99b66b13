"""A swarm's commands as processes of the test: started in a session of their own, their process trees, stopping them,
and `diloco dht` as the bootstrap peer of the groups a test starts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil

from tests.support.paths import DILOCO, ROOT
from tests.support.procs import child_env, read_until


def spawn(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env() | (env or {}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def left_running(children: list[psutil.Process], grace_s: float = 5.0) -> list[psutil.Process]:
    """Children still alive after `grace_s` (torch's shm manager, for one, takes a moment to notice)."""
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    return [c for c in alive if c.status() != psutil.STATUS_ZOMBIE]


def kill_group(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def diloco_dht(identity: Path) -> Iterator[list[str]]:
    """`diloco dht` on loopback with `identity`; yields its --hv.initial-peers multiaddrs; stops it with SIGINT."""
    with dht_process(identity) as (_, peers):
        yield peers


@contextlib.contextmanager
def dht_process(identity: Path) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`diloco_dht`, yielding its process too (a test that pauses it)."""
    proc = spawn([str(DILOCO), "dht", "--identity", str(identity), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"])
    try:
        yield proc, read_until(proc, r"--hv\.initial-peers (.+)").group(1).split()
    finally:  # a clean stop is test_dht_identity_is_stable_and_stop_is_clean's; here, only cleanup (under load a
        # stop once took over 10 s, which failed the test whose fixture this is)
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        kill_group(proc)
