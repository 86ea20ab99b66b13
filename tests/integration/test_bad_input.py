"""Bad input: one line naming the flag or file, exit code 2, no traceback, nothing written, no process left."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from diloco.model import load_model
from tests.support.paths import DILOCO, TINY_MODEL, TORCHRUN
from tests.support.procs import FAST, Result, child_env, python_train, run_cmd, torchrun

FAKE = [*FAST, "--fake-data", "--total-batch-size", "4", "--max-steps", "2"]
SWARM = ["--hv.galaxy-size", "2"]  # a DHT starts (before the run folder is made)
PEER_ID = "12D3KooWSShrJm4CSvrqkmVgos7VPu8p47kbbw2i8PgUB4EuDHv6"  # a valid peer id that no peer here has


def corrupt_checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt" / "step-3"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    (folder / ".metadata").write_bytes(b"truncated")
    (folder / "rank-0.pt").write_bytes(b"")
    return folder


def empty_dataset(tmp_path: Path) -> Path:
    (tmp_path / "empty.txt").write_text("")
    return tmp_path / "empty.txt"


def occupied_run_dir(tmp_path: Path) -> Path:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1}\n')
    return tmp_path / "old"


def bad_owner_key(tmp_path: Path) -> Path:
    """A run folder (of a group that was stopped before its first step) whose record key file is not a key."""
    folder = tmp_path / "stopped"
    folder.mkdir()
    (folder / "owner.key").write_bytes(b"not a key")
    return folder


def closed_port() -> int:
    """A loopback port that nobody listens on (we just let it go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the whole test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def open_key(tmp: Path) -> Path:
    """A swarm key file anyone may read."""
    path = tmp / "swarm.key"
    path.write_text("ab" * 32 + "\n")
    path.chmod(0o644)
    return path


def left_in(work: Path, grace_s: float = 5.0) -> list[str]:
    """Processes still running with ``work`` as their folder after ``grace_s`` seconds: every process a command
    starts (its DHT process, p2pd) inherits it. They are killed, and their command lines returned."""
    procs = []
    for proc in psutil.process_iter(["cwd", "status"]):
        if proc.info["cwd"] == str(work.resolve()) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            procs.append(proc)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    left = []
    for proc in alive:
        try:
            left.append(" ".join(proc.cmdline()))
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return left


def assert_one_line_exit_2(result: Result, expected: str, work: Path) -> None:
    assert result.returncode == 2, result.output[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert list(work.iterdir()) == []  # nothing written
    assert left_in(work) == []


CASES = {
    "indivisible batch": (lambda t: ["--total-batch-size", "5"], "--total-batch-size 5"),
    "missing model folder": (lambda t: ["--path-model", str(t / "nope")], "--path-model"),
    "uncached hub id": (lambda t: ["--path-model", "meta-llama/Llama-3-8B"], "not in the Hugging Face cache"),
    "folder without config": (lambda t: ["--path-model", str(t)], "no config.json"),
    "missing dataset": (lambda t: ["--no-fake-data", "--dataset", str(t / "none.txt")], "--dataset"),
    "empty dataset": (lambda t: ["--no-fake-data", "--dataset", str(empty_dataset(t))], "the dataset is empty"),
    "no data source": (lambda t: ["--no-fake-data"], "--dataset"),
    "unknown precision": (lambda t: ["--precision", "fp8"], "--precision"),
    "unknown strategy": (lambda t: ["--sharding-strategy", "ZERO4"], "--sharding-strategy"),
    "negative steps": (lambda t: ["--max-steps", "-1"], "--max-steps"),
    "not a number": (lambda t: ["--lr", "fast"], "--lr"),
    "outer lr neither a number nor auto": (lambda t: ["--hv.outer-lr", "fast"],
                                           "--hv.outer-lr: Input should be a valid number"),  # fmt: skip
    "corrupt checkpoint": (lambda t: ["--ckpt.resume", str(corrupt_checkpoint(t))], "corrupt checkpoint"),
    "missing checkpoint": (lambda t: ["--ckpt.resume", str(t / "step-9")], "--ckpt.resume"),
    "no latest checkpoint": (lambda t: ["--ckpt.path", str(t), "--ckpt.resume", "latest"], "no step-N checkpoint"),
    "unknown flag": (lambda t: ["--learning-rate", "1"], "--learning-rate"),
    "bad multiaddr": (lambda t: ["--hv.initial-peers", "/ip4/300.1.1.1/tcp/1"], "--hv.initial-peers"),
    "world rank >= galaxy": (lambda t: ["--hv.galaxy-size", "2", "--hv.world-rank", "2"], "--hv.world-rank"),
    "galaxy moment under ZERO1": (lambda t: [*SWARM, "--hv.inner-moment", "galaxy", "--sharding-strategy", "ZERO1"],
                                  "--hv.inner-moment galaxy needs each rank's whole AdamW state"),  # fmt: skip
    "galaxy moment without halves": (lambda t: [*SWARM, "--hv.inner-moment", "galaxy", "--total-batch-size", "1",
                                                "--per-device-train-batch-size", "1"],
                                     "--hv.inner-moment galaxy needs two halves of each inner step"),  # fmt: skip
    "announced port 0": (lambda t: [*SWARM, "--hv.announce-maddrs", "/ip4/1.2.3.4/tcp/0"], "--hv.announce-maddrs"),
    "fragments not dividing H": (lambda t: [*SWARM, "--hv.local-steps", "10", "--hv.fragments", "3"],
                                 "--hv.local-steps 10 must be a multiple of --hv.fragments 3"),  # fmt: skip
    "overlap as long as a fragment's period": (lambda t: [*SWARM, "--hv.local-steps", "4", "--hv.fragments", "2",
                                                          "--hv.overlap-steps", "2"], "--hv.overlap-steps 2"),
    "LoRA on a module the model lacks": (lambda t: ["--lora-r", "4", "--lora-target-modules", "c_attn"],
                                         "--lora-target-modules c_attn: "),  # fmt: skip
    "more fragments than layers": (lambda t: [*SWARM, "--hv.local-steps", "8", "--hv.fragments", "8"],
                                   "--hv.fragments 8: the model has 2 decoder layers"),  # fmt: skip
    "overlap as long as a token budget's round": (
        lambda t: [*SWARM, "--hv.target-tokens", "256", "--hv.fragments", "2", "--hv.overlap-steps", "100"],
        "--hv.overlap-steps 100 must be smaller than the inner steps between two rounds: --hv.target-tokens 256",
    ),
    "record key that is not a key": (lambda t: [*SWARM, "--run-dir", str(bad_owner_key(t))],
                                     "owner.key: not this group's record key"),  # fmt: skip
    "robust aggregation for two groups": (lambda t: [*SWARM, "--hv.aggregation", "trimmed-mean"],
                                          "--hv.aggregation trimmed-mean needs --hv.galaxy-size 3 or more"),
    "unknown aggregation": (lambda t: ["--hv.aggregation", "median"], "--hv.aggregation"),
    "missing swarm key": (lambda t: [*SWARM, "--hv.swarm-key", str(t / "none.key")], "--hv.swarm-key"),
    "swarm key readable by others": (lambda t: [*SWARM, "--hv.swarm-key", str(open_key(t))],
                                     "let others read the key; chmod 600"),  # fmt: skip
    "missing config file": (lambda t: ["--config", str(t / "run.toml")], "--config"),
    "run dir in use": (lambda t: ["--run-dir", str(occupied_run_dir(t))], "already holds a run"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case: str, tmp_path: Path) -> None:
    make_args, expected = CASES[case]
    work = tmp_path / "cwd"
    work.mkdir()
    result = python_train([*FAKE, *make_args(tmp_path)], cwd=work)  # the default run folder would go here
    assert_one_line_exit_2(result, expected, work)


def test_bad_flags_fail_before_torch_is_imported(tmp_path: Path) -> None:
    """The flags and files are checked first: a bad run costs a fraction of a second, not torch's import."""
    result = run_cmd([sys.executable, "-X", "importtime", "-m", "diloco.train", *FAKE, "--total-batch-size", "5"],
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2 and "error: --total-batch-size 5" in result.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert "diloco" in imported and not imported & {"torch", "transformers", "hivemind"}, sorted(imported)


def test_existing_run_dir_is_left_untouched(tmp_path: Path) -> None:
    old = occupied_run_dir(tmp_path)
    before = (old / "metrics.jsonl").read_bytes()
    assert python_train([*FAKE, "--run-dir", str(old)]).returncode == 2
    assert (old / "metrics.jsonl").read_bytes() == before and sorted(p.name for p in old.iterdir()) == ["metrics.jsonl"]


QUIET_RANK = """
import os, signal, sys, time
os.environ["RANK"] = "1"
from diloco.cli import app as cli
from diloco.errors import UsageError
cli.QUIET_RANK_WAIT_S = float(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: None)  # as a run that installed its stop handler
print("reported", flush=True)
cli._usage_exit(UsageError("--total-batch-size 5"))
"""


@pytest.mark.parametrize("ended_by", ["the wait", "SIGTERM"])
def test_a_rank_that_leaves_the_report_to_rank_zero_waits_for_it(ended_by: str) -> None:
    """A rank other than 0 that meets the same bad input says nothing and does not leave at once: torchrun ends
    the other ranks as soon as one fails, which could end rank 0 before its line. Its wait ends after
    QUIET_RANK_WAIT_S, or at once with torchrun's SIGTERM once rank 0 left (whatever handler the run installed)."""
    wait = 1.0 if ended_by == "the wait" else 60.0
    proc = subprocess.Popen([sys.executable, "-c", QUIET_RANK, str(wait)], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline() == "reported\n"
        started = time.monotonic()
        if ended_by == "SIGTERM":
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - started
    finally:
        proc.kill()
    if ended_by == "the wait":
        assert code == 2 and elapsed >= wait, (code, elapsed)
    else:
        assert code == -signal.SIGTERM and elapsed < 10, (code, elapsed)
    assert proc.stderr.read() == ""


def test_under_torchrun_only_rank_zero_reports(tmp_path: Path) -> None:
    """torchrun reports a failed child itself (exit 1, its own summary), but our line appears once."""
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    result = torchrun([*FAKE, "--path-model", str(model), "--total-batch-size", "6"])
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    # (the output on failure: once, under the suite's load, no rank's line came at all)
    expected = "error: --total-batch-size 6 is not a multiple of --per-device-train-batch-size 2 × 2 ranks = 4"
    assert ours == [expected], (result.returncode, result.output[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["corrupt", "a layer short"])
def test_under_torchrun_weights_that_cannot_load_are_one_line_from_every_rank(tmp_path: Path, damage: str) -> None:
    """In an FSDP group each rank reads its own shards of the weights: a file that is not safetensors, or a
    config.json asking for a layer the files lack, is the same error on every rank, so the line appears once and no
    rank waits on the others."""
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    if damage == "corrupt":
        (model / "model.safetensors").write_bytes(b"not a safetensors file")
        said = "could not load the weights"
    else:
        load_model(TINY_MODEL, seed=0).save_pretrained(model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(config | {"num_hidden_layers": config["num_hidden_layers"] + 1}))
        said = "the weights do not fit its config.json"
    result = torchrun([*FAKE, "--path-model", str(model), "--total-batch-size", "4"])
    assert result.returncode != 0  # (torchrun's own code: 1 when a rank exits with 2)
    ours = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith(f"error: --path-model {model}: {said}"), (
        result.returncode, result.output[-3000:])  # fmt: skip


# --------------------------------------------------------------------------------------- joining a swarm, `diloco dht`

# (args given the test's tmp_path and a port in use, expected part of the line, where {port} is that port)
SWARM_CASES = {
    "unreachable initial peer": (
        lambda t, port: [*SWARM, "--hv.initial-peers", f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{PEER_ID}"],
        "--hv.initial-peers: no DHT peer answered at /ip4/127.0.0.1/tcp/",
    ),
    "initial peer without peer id": (
        lambda t, port: [*SWARM, "--hv.initial-peers", f"/ip4/127.0.0.1/tcp/{closed_port()}"],
        "needs its /p2p/<peer id> part",
    ),
    "host port in use": (
        lambda t, port: [*SWARM, "--hv.host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],
        "--hv.host-maddrs: cannot listen on 127.0.0.1 port {port}: address already in use",
    ),
    "averaging port in use": (
        lambda t, port: [*SWARM, "--hv.host-maddrs", "/ip4/127.0.0.1/tcp/0", "--hv.averaging-port", str(port)],
        "--hv.averaging-port: cannot listen on 127.0.0.1 port {port}: address already in use",
    ),
}


@pytest.mark.parametrize("case", list(SWARM_CASES))
def test_swarm_bad_input_is_one_line_and_exit_2(case: str, tmp_path: Path, busy_port: int) -> None:
    """p2pd refuses to start (at once for a closed port, after about 5 s when nothing answers): never a lone peer."""
    make_args, expected = SWARM_CASES[case]
    work = tmp_path / "cwd"
    work.mkdir()
    result = python_train([*FAKE, *make_args(tmp_path, busy_port)], timeout=90, cwd=work)
    assert_one_line_exit_2(result, expected.format(port=busy_port), work)


def a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("not a folder")
    return tmp_path / "file"


def garbage_key(tmp_path: Path) -> Path:
    (tmp_path / "bad.pem").write_bytes(b"not a key")
    (tmp_path / "bad.pem").chmod(0o600)
    return tmp_path / "bad.pem"


DHT_CASES = {
    "identity under a file": (
        lambda t, port: ["--identity", str(a_file(t) / "keys" / "id.pem")],
        "--identity: cannot create identity file {tmp}/file/keys/id.pem: {tmp}/file is a file, not a folder",
    ),
    "identity is a folder": (lambda t, port: ["--identity", str(t)], "--identity: cannot read identity file {tmp}"),
    "garbage identity": (
        lambda t, port: ["--identity", str(garbage_key(t))],
        "--identity: identity file {tmp}/bad.pem is not a valid libp2p RSA private key",
    ),
    "bad host multiaddr": (lambda t, port: ["--host-maddrs", "/ip4/127.0.0.1/tcp/x"], "--host-maddrs"),
    "host port in use": (
        lambda t, port: ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],
        "--host-maddrs: cannot listen on 127.0.0.1 port {port}: address already in use",
    ),
    "announced port 0": (lambda t, port: ["--announce-maddrs", "/ip4/1.2.3.4/tcp/0"], "--announce-maddrs"),
}


@pytest.mark.parametrize("case", list(DHT_CASES))
def test_dht_bad_input_is_one_line_and_exit_2(case: str, tmp_path: Path, busy_port: int) -> None:
    make_args, expected = DHT_CASES[case]
    work = tmp_path / "cwd"
    work.mkdir()
    identity = ["--identity", str(tmp_path / "keys" / "id.pem")]  # not in work: a case may override it
    result = run_cmd([str(DILOCO), "dht", *identity, *make_args(tmp_path, busy_port)], timeout=60, cwd=work)
    assert_one_line_exit_2(result, expected.format(port=busy_port, tmp=tmp_path), work)


@pytest.mark.parametrize("command", ["train", "dht"])
def test_a_temp_folder_too_long_for_torchs_socket_is_one_line_and_exit_2(command: str, tmp_path: Path) -> None:
    """hivemind shares memory through a torch manager whose unix socket lives in TMPDIR: a long TMPDIR (a test's
    tmp_path under pytest-xdist is one) fails in torch's C++ side; the swarm's commands say so instead, before
    anything is written."""
    long = tmp_path / ("t" * 80)
    long.mkdir()
    work = tmp_path / "cwd"
    work.mkdir()
    env = {"TMPDIR": str(long)}
    if command == "train":
        result = python_train([*FAKE, *SWARM], timeout=90, cwd=work, env=env)
    else:
        result = run_cmd([str(DILOCO), "dht"], timeout=60, cwd=work, env=env)
    assert_one_line_exit_2(result, f"TMPDIR {long}: {len(str(long))} characters", work)
    assert list(long.iterdir()) == []


def test_dht_with_a_readable_identity_warns_in_one_line_and_starts(tmp_path: Path) -> None:
    from diloco.swarm.records.identity import ensure_identity

    identity = ensure_identity(tmp_path / "id.pem")
    identity.chmod(0o644)
    work = tmp_path / "cwd"
    work.mkdir()
    proc = subprocess.Popen([str(DILOCO), "dht", "--identity", str(identity), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                            cwd=work, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    guard = threading.Timer(60, lambda: os.killpg(proc.pid, signal.SIGKILL))  # a hang fails, not blocks, the test
    guard.start()
    try:
        assert proc.stdout.readline().startswith("--hv.initial-peers /ip4/127.0.0.1/tcp/")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        guard.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and " WARN" in lines[0] and f"chmod 600 {identity}" in lines[0], err
    assert left_in(work) == []


def free_port_below_a_busy_one() -> tuple[int, socket.socket]:
    """A free port P whose neighbour P + 1 is held by the returned listening socket."""
    for _ in range(50):
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1] - 1
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
        except OSError:
            busy.close()
            continue
        busy.listen()
        return port, busy
    raise AssertionError("no free port below a busy one")


@pytest.mark.slow
def test_under_torchrun_the_rank_whose_port_is_taken_reports_it(tmp_path: Path) -> None:
    """Local rank r listens on the given port + r: only rank 1 meets the taken port, and it says so itself."""
    port, busy = free_port_below_a_busy_one()
    work = tmp_path / "cwd"
    work.mkdir()
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "diloco.train", *FAKE, *SWARM,
           "--hv.host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--hv.averaging-timeout", "30"]  # fmt: skip
    with busy:
        result = run_cmd(cmd, timeout=180, cwd=work)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert ours == [
        f"error: rank 1: --hv.host-maddrs: cannot listen on 127.0.0.1 port {port + 1}: address already in use"
    ], result.output[-3000:]
    assert not (work / "runs").exists()
    assert left_in(work) == []


def test_start_dht_gives_up_on_a_silent_peer_and_leaves_no_process() -> None:
    """A peer that takes no connections (its backlog is full, so SYNs are dropped, like behind a firewall): p2pd
    keeps dialing; ``start_dht`` gives up after ``startup_timeout`` and stops its DHT process and p2pd."""
    from diloco.cli.app import as_flags
    from diloco.errors import FieldError
    from diloco.swarm.records.dht import start_dht

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        port = silent.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        started = time.monotonic()
        try:
            with pytest.raises(FieldError) as failed:
                start_dht(initial_peers=[f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER_ID}"],
                          host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], startup_timeout=2)  # fmt: skip
        finally:
            for filler in fillers:
                filler.close()
    # as training reports it (the DHT's options are Config.hv's)
    reported = str(as_flags(failed.value.within("hv")))
    assert re.match(f"--hv.initial-peers: no DHT peer answered at .*/tcp/{port}/", reported), reported
    assert time.monotonic() - started < 10
    dialers = [p for p in psutil.process_iter(["cmdline"]) if f"/tcp/{port}/p2p/" in " ".join(p.info["cmdline"] or [])]
    started_here = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    started_here = [p for p in started_here if p.name() != "torch_shm_manager"]  # torch's, lives on with pytest
    _, alive = psutil.wait_procs(dialers + started_here, timeout=5)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
