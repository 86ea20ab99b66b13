"""`diloco bench wan`: DDP, blocking DiLoCo and overlapped fragments on real text, two workers in network namespaces
behind tbf links; the figures come from the workers' own rows, and the namespaces are gone afterwards. Needs root."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from diloco import procs
from diloco.bench import wan
from tests.support.bench import STOP_GRACE_S, bench
from tests.support.netns import assert_none_left, namespaces
from tests.support.paths import CORPUS, DILOCO
from tests.support.procs import child_env


@pytest.mark.slow
def test_wan_quick(tmp_path) -> None:
    """The quick bench with --train-cores: each worker's training held to 0.9 of its core once it trains (the
    default, pinned workers alone, differs only in skipping that)."""
    before = namespaces()
    data, doc = bench("wan", tmp_path, "--data", str(CORPUS), "--train-cores", "0.9", timeout=480,
                      stem="wan-cores0.9")  # 80 s alone  # fmt: skip
    assert data["setup"]["train_cores"] == 0.9 and "--train-cores 0.9" in data["command"]
    assert data["setup"]["eval_steps"] == 50 and "the held-out split's first 50 batches" in doc
    for arm in data["links"][0]["arms"]:  # each worker's training ran under its quota (parked or not: that
        # depends on what else the machine runs)
        assert [(h["cores"], h["periods"] > 0, h["cpu_s"] > 0) for h in arm["held"]] == [(0.9, True, True)] * 2, arm
        # a DiLoCo worker's DHT, p2pd and averager left the quota; DDP's rank has no helpers
        assert [h["helpers"] >= 3 for h in arm["held"]] == [arm["flags"] is not None] * 2, (arm["name"], arm["held"])
    (link,) = data["links"]
    used = {m.group(1) for arm in link["arms"] if (m := re.match(r"ip netns exec (\S+) ", arm["command"]))}
    assert used
    assert_none_left(before, used)
    arms = {arm["name"]: arm for arm in link["arms"]}
    assert list(arms) == ["ddp", "blocking", "streaming", "streaming-int4"]
    steps = data["setup"]["steps"]
    for arm in arms.values():
        assert 0 < arm["inner_s"] <= arm["train_s"] and 0 < arm["utilisation"] <= 1.0, arm
        assert arm["evals"] and arm["evals"][-1][1] == pytest.approx(arm["final_eval_loss"]), arm
        assert arm["peak_link_bytes_per_s"] > 0
    assert arms["ddp"]["time_to_ddp_loss_ratio"] == 1.0  # DDP reaches its own final loss at its end
    assert arms["blocking"]["rounds"] == steps // data["setup"]["local_steps"]
    # a fragment round every H/F steps, landed T steps later, and at the last step the other fragments' rounds
    fragments = data["setup"]["fragments"]
    assert arms["streaming"]["rounds"] == steps // (data["setup"]["local_steps"] // fragments) + fragments - 1
    assert arms["streaming"]["median_step_s_on_wire"] is not None
    assert arms["streaming-int4"]["peak_link_bytes_per_s"] < arms["streaming"]["peak_link_bytes_per_s"]
    assert "## wan (quick): " in doc and "| streaming-int4 | " in doc and "Targets at 1000 Mbit/s" in doc
    assert "held to 0.9 of its core" in doc
    assert (tmp_path / "wan-cores0.9-quick.png").stat().st_size > 0


@pytest.mark.slow
def test_wan_slow_link_quick(tmp_path) -> None:
    """The 10 Mbit/s study: blocking int8 rounds against blocking sparse rounds, no DDP; the sparse arm's link
    carries a small share of int8's bytes, both arms end on one model per arm, and the target is judged."""
    before = namespaces()
    data, doc = bench("wan", tmp_path, "--data", str(CORPUS), "--slow-link", timeout=480, stem="wan-10mbit")
    (link,) = data["links"]
    assert link["rate_mbit"] == 10.0 and data["setup"]["slow_link"] is True
    arms = {arm["name"]: arm for arm in link["arms"]}
    assert list(arms) == ["blocking-int8", "blocking-sparse"]
    for arm in arms.values():
        assert 0 < arm["utilisation"] <= 1.0 and arm["rounds"] == data["setup"]["steps"] // data["setup"][
            "local_steps"], arm  # fmt: skip
        assert arm["time_to_ddp_loss_s"] is None
    assert arms["blocking-sparse"]["peak_link_bytes_per_s"] < arms["blocking-int8"]["peak_link_bytes_per_s"]
    assert arms["blocking-int8"]["eval_vs_blocking"] == 0
    assert set(data["targets"]) == {"link_mbit", "sparse_utilisation_at_least_0.95", "int8_utilisation"}
    assert "**10 Mbit/s**" in doc and "| blocking-sparse | " in doc and "Targets at 10 Mbit/s" in doc
    used = {m.group(1) for arm in link["arms"] if (m := re.match(r"ip netns exec (\S+) ", arm["command"]))}
    assert_none_left(before, used)
    assert (tmp_path / "wan-10mbit-quick.png").stat().st_size > 0


@pytest.mark.slow
def test_a_stopped_wan_bench_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM to the bench's process group while its first arm trains (a test's timeout, a user's `kill`): it exits
    with 128 + 15 within STOP_GRACE_S, and nothing it started is left: no process (its bootstrap DHTs with their
    p2pd inside namespaces, the workers), none of its namespaces (named from its pid) nor its bridge, no temp
    folder."""
    # the bench's temp folder goes here (TMPDIR), where the test can see it; short (not under tmp_path), as torch's
    # shared-memory socket lives there (see preflight.check_tempdir)
    scratch = Path(tempfile.mkdtemp(prefix="dlwan-"))
    command = [str(DILOCO), "bench", "wan", "--quick", "--data", str(CORPUS), "--out", str(tmp_path / "out"),
               "--doc", str(tmp_path / "benchmarks.md")]  # fmt: skip
    env = child_env() | {"TMPDIR": str(scratch)}
    with (tmp_path / "bench.log").open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    tag = f"dl{proc.pid % 100000}"  # netns.hosts names its namespaces, veths and bridge after the bench's pid
    mine = re.compile(rf"{tag}[nh]\d+$|{tag}br$")
    started: list[psutil.Process] = []
    try:
        started = wait_for_training(proc, timeout_s=240, log_path=tmp_path / "bench.log")
        assert {name for name in namespaces() if mine.match(name)}
        assert list(scratch.glob("diloco-bench-wan-*"))
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_GRACE_S:.0f} s after SIGTERM:\n{(tmp_path / 'bench.log').read_text()}")
        assert not [p.cmdline() for p in started if running(p)]
        assert not {name for name in namespaces() if mine.match(name)}
        assert not [link for link in links() if mine.match(link)]
        assert not list(scratch.glob("diloco-bench-wan-*"))
        assert code == 128 + signal.SIGTERM, (tmp_path / "bench.log").read_text()
        assert "stopped by SIGTERM" in (tmp_path / "bench.log").read_text()
    finally:  # what a failure left behind, so that it fails alone: only what this test's bench started
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        procs.kill_all(started)
        proc.wait()
        remove_namespaces(mine)
        shutil.rmtree(scratch, ignore_errors=True)


def remove_namespaces(mine: re.Pattern[str]) -> None:
    """Kill what runs inside the namespaces `mine` matches, delete them, their veths and bridge (written here, not
    with the bench's own code: the test cleans up after a bench whose cleanup failed)."""
    for name in namespaces():
        if mine.match(name):
            inside = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in inside:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    for link in links():
        if mine.match(link):
            subprocess.run(["ip", "link", "delete", link], capture_output=True)


def wait_for_training(proc: subprocess.Popen[bytes], timeout_s: float, log_path: Path) -> list[psutil.Process]:
    """Wait until the bench runs a DHT (its p2pd) and the first arm's workers; its descendants then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        family = procs.family(proc.pid)[1:]
        lines = []
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                lines.append(" ".join(p.cmdline()))
        if any("p2pd" in line for line in lines) and any("diloco.train" in line for line in lines):
            return family
        time.sleep(0.5)
    tail = log_path.read_text()[-3000:]
    raise AssertionError(f"no DHT and workers within {timeout_s:.0f} s (exit code {proc.poll()}):\n{tail}")


def running(proc: psutil.Process) -> bool:
    """Still there and not a zombie (an orphan's zombie waits for a reaper that may not come in a container)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def links() -> list[str]:
    """Names of the network interfaces of the root namespace."""
    return os.listdir("/sys/class/net")


def test_time_to_a_loss_is_interpolated_between_the_evals_around_its_crossing() -> None:
    evals = [(1.0, 5.0), (2.0, 4.0), (3.0, 3.5), (4.0, 3.6)]
    assert wan.time_to(evals, 4.0) == 2.0 and wan.time_to(evals, 3.5) == 3.0 and wan.time_to(evals, 3.0) is None
    assert wan.time_to(evals, 4.5) == pytest.approx(1.5) and wan.time_to(evals, 3.75) == pytest.approx(2.5)
    assert wan.time_to(evals, 6.0) == 1.0  # below it at the first evaluation: no earlier point to go from


def test_run_figures_leave_evaluations_out_and_split_steps_on_the_wire() -> None:
    """Steps of 1 s each (tokens/s = tokens per step); an eval taking 5 s after step 2; a round started after step
    2 landed at step 4 (steps 3 and 4 on the wire, 2 s each); the final round row at 11 s. Training time: 11 − 0 −
    5 = 6 s, inner time 1 + 1 + 2 + 2 = 6 s."""
    rows = [
        {"step": 1, "tokens_per_s": 100.0, "time": 1.0},
        {"step": 2, "tokens_per_s": 100.0, "time": 2.0},
        {"step": 2, "eval_loss": 4.0, "time": 7.0},
        {"step": 3, "tokens_per_s": 50.0, "time": 9.0},
        {"step": 4, "tokens_per_s": 50.0, "time": 11.0},
        {"step": 4, "outer_step": 1, "num_peers": 2, "round_step": 2, "land_wait_s": 0.25, "land_s": 0.5,
         "side_cpu_s": 0.75, "averaging_s": 0.5, "time": 11.0},
    ]  # fmt: skip
    got = wan.run_figures(rows, tokens_per_step=100)
    assert (got["land_wait_s_total"], got["land_s_total"], got["side_cpu_s_total"]) == (0.25, 0.5, 0.75)
    assert got["train_s"] == pytest.approx(6.0) and got["inner_s"] == pytest.approx(6.0)
    assert got["utilisation"] == pytest.approx(1.0) and got["evals"] == [(2.0, 4.0)]
    assert got["median_step_s_on_wire"] == 2.0 and got["median_step_s_off_wire"] == 1.0 and got["rounds"] == 1
