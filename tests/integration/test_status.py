"""`diloco status`, the command, against real DHT and trainer processes on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from diloco import procs
from diloco.cli.monitor import NO_GROUPS_EXIT, UNREACHABLE_EXIT
from tests.support.paths import DILOCO, ROOT
from tests.support.procs import FAST, child_env, metrics, read_until


def spawn(cmd: list[str], nice: int = 0, log: Path | None = None) -> subprocess.Popen[str]:
    """A session of its own; its output in pipes, or in `log` (a trainer writes a line per step: a pipe nobody reads
    would fill and stop it) at priority `nice` (the status commands under test get the CPU first)."""
    kw: dict[str, Any] = {"cwd": ROOT, "env": child_env(), "text": True, "start_new_session": True}
    if log is None:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    with log.open("w") as out:  # the child keeps its own copy
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(nice), **kw)


@contextlib.contextmanager
def socket_nobody_listens_on() -> Iterator[int]:
    """A loopback port held (bound, never listening) so that a connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


class Watched:
    """A status command run to its end: when it answered (its first line on stdout), its output, and every process
    it started, seen while it ran."""

    def __init__(self, args: list[str], timeout: float = 30) -> None:
        started = time.monotonic()
        proc = spawn([str(DILOCO), "status", *args])
        self.answered_s: float | None = None  # None: nothing on stdout
        self.children: dict[int, psutil.Process] = {}
        self.names: set[str] = set()
        out: list[str] = []

        def read() -> None:
            out.append(proc.stdout.readline())
            self.answered_s = time.monotonic() - started if out[0] else None
            out.append(proc.stdout.read())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while proc.poll() is None and time.monotonic() - started < timeout:
                seen = procs.family(proc.pid)[1:]
                self.children |= {c.pid: c for c in seen}
                self.names |= {_name(c) for c in seen}
                time.sleep(0.1)
            proc.wait(timeout=5)
            reader.join(timeout=5)
            self.stdout, self.stderr = "".join(out), proc.stderr.read()
        finally:
            procs.stop_tree(proc, grace_s=0, sig=None)
        self.returncode = proc.returncode

    def left_running(self) -> list[psutil.Process]:
        _, alive = psutil.wait_procs(list(self.children.values()), timeout=3)
        return [c for c in alive if c.status() != psutil.STATUS_ZOMBIE]

    @property
    def started_p2pd(self) -> bool:
        return "p2pd" in self.names


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return ""


def test_an_unreachable_dht_exits_1_with_one_line() -> None:
    with socket_nobody_listens_on() as port:
        maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmXfBXa5vNXe1U66aJcRQMjRzgz5JtgTnY1xZ6yjHrAmcA"
        look = Watched(["--hv.initial-peers", maddr])
    assert look.returncode == UNREACHABLE_EXIT == 1
    assert look.stdout == "" and look.stderr.startswith(f"error: --hv.initial-peers: no DHT peer answered at {maddr}")
    assert len(look.stderr.splitlines()) == 1, look.stderr
    assert not look.left_running()


def test_bad_flags_exit_2_before_any_process_starts() -> None:
    for args in (["--hv.initial-peers", "/ip4/127.0.0.1/tcp/1"], ["--hv.initial-peers", "nonsense"], [],
                 ["--hv.initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmXfBXa5vNXe1U66aJcRQMjRzgz5JtgTnY1xZ6yjHrAmcA",
                  "--watch", "-1"]):  # fmt: skip
        look = Watched(args)
        assert look.returncode == 2 and look.stderr.startswith("error: --"), (args, look.stderr)
        assert len(look.stderr.splitlines()) == 1 and not look.children, (args, look.stderr)


# The tests reading the module's swarm run on one xdist worker (`--dist loadgroup`): one swarm, not one per worker.
SHARES_THE_SWARM = pytest.mark.xdist_group("status-swarm")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """`diloco dht` and two worker groups of one rank training together (at low priority: the status commands
    under test get the CPU first); stopped, p2pd included, at the end of the module."""
    tmp = tmp_path_factory.mktemp("status")
    dht = spawn([str(DILOCO), "dht", "--identity", str(tmp / "id.pem"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"])
    started: list[subprocess.Popen[str]] = [dht]
    try:
        peers = read_until(dht, "--hv.initial-peers", timeout=60).string.split()[1:]
        run_dirs, logs = [tmp / f"w{i}" for i in range(2)], [tmp / f"w{i}.log" for i in range(2)]
        for world_rank, run_dir in enumerate(run_dirs):
            args = [*FAST, "--fake-data", "--total-batch-size", "2", "--max-steps", "100000", "--hv.local-steps",
                    "20", "--hv.galaxy-size", "2", "--hv.world-rank", str(world_rank), "--hv.matchmaking-time", "5", "--hv.pace", "fixed",
                    "--hv.initial-peers", *peers, "--run-dir", str(run_dir)]  # fmt: skip
            started.append(spawn([sys.executable, "-m", "diloco.train", *args], nice=10, log=logs[world_rank]))
        wait_for_full_rounds(run_dirs, started[1:], logs, timeout=90)
        yield SimpleNamespace(peers=peers, run_dirs=run_dirs)
    finally:  # every process of every tree at once (the DHT and averager processes and each p2pd included)
        procs.kill_all([member for proc in started for member in procs.family(proc.pid)])
        for proc in started:
            proc.wait()


def wait_for_full_rounds(
    run_dirs: list[Path], workers: list[subprocess.Popen[str]], logs: list[Path], timeout: float
) -> None:
    """Until every group logged a round with both groups in it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(w.poll() is None for w in workers), "\n".join(log.read_text()[-3000:] for log in logs)
        if all(full_round(d) for d in run_dirs):
            return
        time.sleep(0.5)
    tails = "\n".join(log.read_text()[-2000:] for log in logs)
    raise AssertionError(f"no round of both groups within {timeout} s:\n{tails}")


def full_round(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").is_file() and any(r.get("num_peers") == 2 for r in metrics(run_dir))


@SHARES_THE_SWARM
def test_status_lists_both_training_groups_and_leaves_no_p2pd(swarm: SimpleNamespace) -> None:
    for _look in range(3):  # a round under the suite's load can miss the other group; a later look sees a full one
        groups = look_at_the_swarm(swarm)
        if all(group["round"] == "ok" for group in groups):
            break
    assert all(group["round"] == "ok" and group["round_peers"] == 2 for group in groups), groups


def look_at_the_swarm(swarm: SimpleNamespace) -> list[dict]:
    """`diloco status --json` once: both groups, each as its own metrics say (its last round as it logged it)."""
    look = Watched(["--hv.initial-peers", *swarm.peers, "--json"])
    assert look.returncode == 0, look.stderr[-3000:]
    # it answers rather than hangs; how fast (3.5–4 s here, the 5 s target) is a measurement, in the README, not a
    # test: under the suite's load the same look took 11.8 s
    assert look.answered_s is not None, look.stderr[-3000:]
    assert look.started_p2pd and not look.left_running()
    groups = json.loads(look.stdout)["groups"]
    assert [g["world_rank"] for g in groups] == [0, 1], groups
    for group, run_dir in zip(groups, swarm.run_dirs):
        assert group["ranks"] == 1 and group["sharding"] == "FULL_SHARD" and group["max_steps"] == 100000
        assert group["state"] == "training" and group["step"] > 0 and group["tokens_per_s"] > 0
        assert group["outer_step"] >= 1 and group["heard_s"] < 30 and group["round_age_s"] < 60, group
        rounds = [r for r in metrics(run_dir) if r.get("outer_step") == group["outer_step"] and "num_peers" in r]
        assert rounds, group  # the round the record tells of, as the group logged it
        # one of them: a round that failed at this outer step may be in the metrics before its record is in the DHT
        # (the record is stored in the background), as once under the suite's load
        assert group["round_peers"] in {r["num_peers"] for r in rounds} and group["round"] in ("ok", "alone"), group
        assert rounds[-1]["outer_digest"].startswith(group["digest"])
    return groups


@SHARES_THE_SWARM
def test_the_table_prints_one_row_per_group(swarm: SimpleNamespace) -> None:
    look = Watched(["--hv.initial-peers", *swarm.peers])
    assert look.returncode == 0, look.stderr[-3000:]
    title, header, *rows = look.stdout.splitlines()
    assert title.startswith("run diloco: 2 worker group(s)") and header.startswith("group")
    assert [row.split()[:3] for row in rows] == [["0", "1", "FULL_SHARD"], ["1", "1", "FULL_SHARD"]]
    assert all(row.split()[-1] == "training" for row in rows)


@SHARES_THE_SWARM
def test_a_run_id_without_groups_exits_3_with_one_line(swarm: SimpleNamespace) -> None:
    look = Watched(["--hv.initial-peers", *swarm.peers, "--hv.run-id", "nobody-here"])
    assert look.returncode == NO_GROUPS_EXIT == 3
    assert look.stdout == "" and look.stderr.startswith("error: --hv.run-id nobody-here: no worker group")
    assert len(look.stderr.splitlines()) == 1, look.stderr
    assert look.started_p2pd and not look.left_running()


@SHARES_THE_SWARM
def test_watch_redraws_until_ctrl_c_then_exits_0_leaving_no_p2pd(swarm: SimpleNamespace) -> None:
    proc = spawn([str(DILOCO), "status", "--hv.initial-peers", *swarm.peers, "--watch", "0.5"])
    # its stderr is read all along: a pipe nobody reads fills up (64 KiB) and stops a writer, which then never
    # exits (twice under the suite's load, with both pipes left unread after the first frames)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        first = read_until(proc, re.escape("run diloco: 2 worker group(s)"), timeout=30).string
        read_until(proc, re.escape("run diloco: 2 worker group(s)"), timeout=10)
        assert first
        children = procs.family(proc.pid)[1:]
        names = {c.pid: _name(c) for c in children}
        assert "p2pd" in names.values()
        threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()  # the frames until it stops
        proc.send_signal(2)  # SIGINT, as Ctrl+C
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit 30 s after Ctrl+C; stderr:\n{''.join(said)[-3000:]}") from None
        exited = time.monotonic()
        assert code == 0, "".join(said)[-3000:]
        # p2pd and the DHT process are gone when the command exits. torch_shm_manager (torch's shared-memory manager,
        # which hivemind's futures start through torch's file_system sharing strategy) is not: by its own design it
        # exits about 2 s after its last client disconnected, then by itself (3.15 s after Ctrl+C on a quiet machine,
        # some 2 s after the exit), later under load
        shm = [c for c in children if names[c.pid] == "torch_shm_manager"]
        _, alive = psutil.wait_procs([c for c in children if c not in shm], timeout=3)
        assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE]
        _, alive = psutil.wait_procs(shm, timeout=max(exited + 15 - time.monotonic(), 0))
        assert not [c for c in alive if c.status() != psutil.STATUS_ZOMBIE]
    finally:
        procs.stop_tree(proc, grace_s=0, sig=None)
