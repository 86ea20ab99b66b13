"""Start a DHT and G worker groups (each a torchrun job) on this machine; prefix and collect their logs;
stop every process it started on SIGINT/SIGTERM or when the workers end."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from diloco.config import Config
from diloco.errors import FieldError
from diloco.procs import child_env, stop_tree

log = logging.getLogger("diloco")

STOP_GRACE_S = 15.0  # how long workers get to checkpoint and write their summary after a stop signal


def group_flags(config: Config, world_rank: int, workers: int) -> list[str]:
    """What a launcher adds to the user's train flags for one group (a repeated flag's last value wins): its place
    in the galaxy, and its own `worker-<world rank>` run and checkpoint folders under the ones given."""
    args = ["--hv.galaxy-size", str(workers), "--hv.world-rank", str(world_rank)]
    if config.run_dir is not None:
        args += ["--run-dir", str(config.run_dir / f"worker-{world_rank}")]
    if config.ckpt.path is not None:  # each group checkpoints its own ranks' state
        args += ["--ckpt.path", str(config.ckpt.path / f"worker-{world_rank}")]
    return args


def worker_args(
    config: Config, train_args: Sequence[str], world_rank: int, workers: int, peers: list[str]
) -> list[str]:
    """The user's train flags plus this group's place in the galaxy and the DHT started here."""
    return [*train_args, *group_flags(config, world_rank, workers), "--hv.initial-peers", *peers]


def worker_command(nproc: int, args: list[str]) -> list[str]:
    torchrun = Path(sys.executable).parent / "torchrun"
    return [str(torchrun), "--standalone", f"--nproc_per_node={nproc}", "-m", "diloco.train", *args]


class Workers:
    """The worker-group processes, each in its own process group so that stopping one stops its ranks."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.threads: list[threading.Thread] = []

    def start(self, name: str, command: list[str]) -> None:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(threads=None),
            start_new_session=True,
        )  # fmt: skip
        thread = threading.Thread(target=_relay, args=(proc.stdout, f"[{name}] ", sys.stdout), daemon=True)
        thread.start()
        self.procs.append(proc)
        self.threads.append(thread)

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def stop(self, grace_s: float) -> None:
        """SIGTERM to each torchrun (it forwards it to its ranks once), then SIGKILL to whatever is left of each
        (ranks, their DHT and averager processes, p2pd) after `grace_s` seconds."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in self.procs:
            stop_tree(proc, grace_s=0, sig=None)
        for thread in self.threads:
            thread.join(timeout=5)

    def exit_code(self) -> int:
        codes = [p.returncode for p in self.procs]
        return next((c for c in codes if c), 0)


def _relay(stream: TextIO, prefix: str, out: TextIO) -> None:
    for line in stream:
        out.write(prefix + line)
        out.flush()


def launch(config: Config, train_args: Sequence[str], workers: int, nproc_per_worker: int) -> int:
    """Run `workers` groups of `nproc_per_worker` ranks against a DHT started here. Returns the exit code."""
    from diloco.swarm.records.dht import start_dht, visible_maddrs

    try:
        dht = start_dht(initial_peers=config.hv.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[])
    except FieldError as e:
        raise e.within("hv") from None  # the workers' flags, as given after `--`
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: _second_signal_kills(stop)) for sig in signals}
    group = Workers()
    try:
        peers = visible_maddrs(dht)
        log.info("DHT up: --hv.initial-peers %s", " ".join(peers))
        if config.run_dir is None and config.run_name is None:
            config = config.model_copy(update={"run_name": time.strftime("%Y%m%d-%H%M%S")})
            train_args = [*train_args, "--run-name", config.run_name]
        for rank in range(workers):
            args = worker_args(config, train_args, rank, workers, peers)
            group.start(f"worker-{rank}", worker_command(nproc_per_worker, args))
        while group.running() and not stop.is_set():
            time.sleep(0.2)
        if stop.is_set():
            log.info("stopping %d worker groups", workers)
        group.stop(STOP_GRACE_S)
        log.info("worker groups ended with exit codes %s", [p.returncode for p in group.procs])
        report(run_root(config), workers)
        return 130 if stop.is_set() else group.exit_code()
    finally:
        group.stop(0)
        dht.shutdown()
        log.info("DHT stopped")
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_root(config: Config) -> Path:
    """The folder holding every group's run folder (`worker-<world rank>`), as `worker_args` and the trainer
    name them."""
    return config.run_dir if config.run_dir is not None else Path("runs") / str(config.run_name)


def report(root: Path, workers: int) -> None:
    """The verdict table over the groups' run folders, and a loss plot beside them (a plot that fails is a warning:
    the runs themselves are done and written)."""
    from diloco.console import read_group, verdict

    folders = [root / f"worker-{rank}" for rank in range(workers)]
    print(verdict([read_group(folder) for folder in folders]), flush=True)
    if not any((folder / "metrics.jsonl").is_file() for folder in folders):
        return
    try:
        from diloco.plot import plot_runs

        log.info("loss plot: %s", plot_runs([root], root / "loss.png"))
    except Exception as e:  # noqa: BLE001 - matplotlib or a half-written file must not turn a good run into a failure
        log.warning("could not draw the loss plot: %s", e)


def _second_signal_kills(stop: threading.Event) -> None:
    if stop.is_set():
        raise KeyboardInterrupt  # second Ctrl+C: the finally block kills everything at once
    stop.set()
