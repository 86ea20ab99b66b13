"""`diloco bench churn`: a swarm of real trainers on loopback that loses and regains worker groups on a seeded
schedule for 30 minutes, against the same swarm without churn.

Four worker groups of mixed shapes (three of one rank, one of two ranks, FULL_SHARD under torchrun; `--quick`:
three groups of one rank for about a minute) train the 1.1M-parameter byte llama on tinyshakespeare, bootstrapping
from one `diloco dht`. Each group runs in a cgroup of its own holding it to CORES of a core (`diloco.bench.throttle`;
everything the group runs, its DHT and averager included), so a group's speed does not depend on how many others
are alive on this 2-core machine; a (re)started group starts up unthrottled and gets its quota once it has joined
(its metrics.jsonl exists). Groups 0 and 1 live throughout; the others are churned.

Two phases, one run id each:
- baseline: every group trains BASELINE rounds, nothing happens to any;
- soak: `--max-steps` set, from the baseline's pace, for the schedule plus a tail. Every 10–30 s (seeded) a
  churned group is picked; alive, it is killed (`kill -9` of the trainer and its ranks: its helpers must follow)
  or stopped (SIGTERM); dead, it is restarted from its newest checkpoint (`--ckpt.resume latest`) or joins fresh
  (a new run folder: it downloads the swarm's state). Events stop when the long-lived groups are a tail away from
  the end; dead groups then start once more and every group must finish on one model.

What is counted is in `diloco.bench.churn_report`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from diloco import procs
from diloco.bench import BenchError, machine_line
from diloco.bench.churn_report import analyse, markdown, plot, rows_of
from diloco.bench.churn_setup import ChurnSetup, Life, Slot, churn_setup, schedule
from diloco.bench.models import write_model
from diloco.bench.throttle import CpuLimit
from diloco.bench.wire import dht_peers, last_line, started
from diloco.corpus import TINYSHAKESPEARE

__all__ = ["markdown", "measure", "plot"]

log = logging.getLogger("diloco")

MODEL = "llama-1m-bytes"
POLL_S = 0.5
RSS_EVERY_S = 10.0
ORPHAN_WAIT_S = 15.0  # a killed trainer's DHT, averager and p2pd must be gone by then (they watch their parent)
STOP_WAIT_S = 90.0  # a SIGTERMed group that has not exited by then is a hang (then killed)


class Swarm:
    """The groups of one phase: starting, ending and watching their trainers."""

    def __init__(self, setup: ChurnSetup, stack: ExitStack, work_dir: Path, phase: str, model: Path,
                 peers: list[str], max_steps: int) -> None:  # fmt: skip
        self.setup, self.stack, self.work_dir, self.phase = setup, stack, work_dir / phase, phase
        self.model, self.peers, self.max_steps = model, peers, max_steps
        self.work_dir.mkdir(parents=True)
        self.slots = [
            Slot(g, ranks, stack.enter_context(CpuLimit(f"churn-{phase}-g{g}", setup.cores[g], engaged=False)),
                 self.work_dir / f"g{g}")
            for g, ranks in enumerate(setup.ranks)
        ]  # fmt: skip
        self.hangs: list[dict[str, Any]] = []
        self.orphans: list[dict[str, Any]] = []
        self.rss: dict[int, list[tuple[float, float]]] = {g: [] for g in range(setup.long_lived)}
        self._orphan_checks: list[tuple[float, Life, list[psutil.Process]]] = []
        self._rss_at = 0.0
        self.t0 = time.time()  # unix time the phase's clock starts (the soak resets it once its groups train)

    def command(self, slot: Slot, run_dir: Path, resume: bool) -> list[str]:
        s = self.setup
        per_rank = s.batch // slot.ranks
        entry = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={slot.ranks}"]
                 if slot.ranks > 1 else [sys.executable])  # fmt: skip
        return [
            *entry, "-m", "diloco.train", "--path-model", str(self.model), "--dataset", str(TINYSHAKESPEARE),
            "--seq-length", str(s.seq_length), "--per-device-train-batch-size", str(per_rank),
            "--total-batch-size", str(s.batch), "--lr", "3e-3", "--warmup-steps", "10",
            "--max-steps", str(self.max_steps), "--eval-steps", "2", "--log-interval", "1", "--precision", "32-true",
            "--no-torch-compile", "--metric-logger-type", "dummy",
            "--hv.galaxy-size", str(len(s.ranks)), "--hv.world-rank", str(slot.group),
            "--hv.local-steps", str(s.local_steps), "--hv.run-id", f"churn-{self.phase}",
            *s.timing_flags(),
            "--hv.host-maddrs", "/ip4/127.0.0.1/tcp/0", "--hv.initial-peers", *self.peers,
            "--ckpt.interval", str(s.local_steps), "--ckpt.path", str(slot.checkpoints),
            *(["--ckpt.resume", "latest"] if resume else []), "--run-dir", str(run_dir),
        ]  # fmt: skip

    def start(self, slot: Slot, how: str) -> Life:
        index = len(slot.lives)
        run_dir = slot.folder / f"life{index}"
        log_path = slot.folder / f"life{index}.log"
        slot.folder.mkdir(parents=True, exist_ok=True)
        slot.limit.disengage()  # start-up (imports, joining) at full speed; the quota comes once it has joined
        proc = started(self.stack, self.command(slot, run_dir, how == "restart"), log_path, procs.child_env())
        slot.limit.add(proc.pid)
        life = Life(slot.group, index, how, run_dir, log_path, proc, time.time())
        slot.lives.append(life)
        return life

    def kill(self, life: Life) -> None:
        """`kill -9` of the trainer (and torchrun's ranks), as when the machine dies; its helpers must follow."""
        family = procs.family(life.proc.pid)
        launcher = psutil.Process(life.proc.pid)
        for proc in [launcher, *launcher.children()]:  # torchrun and its ranks, not the ranks' own helpers
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        life.proc.wait()
        self._ended(life, "kill-9")
        self._orphan_checks.append((time.monotonic() + ORPHAN_WAIT_S, life, family[1:]))

    def terminate(self, life: Life) -> None:
        """SIGTERM: the group finishes its step, writes what it must and leaves (watched by `poll`)."""
        with contextlib.suppress(ProcessLookupError):
            life.proc.send_signal(signal.SIGTERM)
        life.stop_sent_at = time.monotonic()

    def _ended(self, life: Life, end: str) -> None:
        life.ended_at, life.end, life.code = time.time(), end, life.proc.returncode

    def poll(self, now_s: float, sample: bool = True) -> None:
        """Note exits; set quotas of trainers that have joined; count hangs; sample the long-lived groups' RSS;
        count a killed trainer's helpers that outlived it."""
        for slot in self.slots:
            life = slot.life
            if life is None:
                continue
            if life.proc.poll() is not None:
                self._ended(life, "sigterm" if life.stop_sent_at is not None else "exit")
                continue
            metrics = life.run_dir / "metrics.jsonl"
            if not life.engaged and metrics.exists():
                slot.limit.engage()
                life.engaged = True
            self._watch(slot, life, metrics)
        self._check_orphans()
        if sample and time.monotonic() >= self._rss_at:
            self._rss_at = time.monotonic() + RSS_EVERY_S
            for g, samples in self.rss.items():
                if (life := self.slots[g].life) is not None:
                    samples.append((round(now_s, 1), round(procs.tree_rss_mb(life.proc.pid), 1)))

    def _watch(self, slot: Slot, life: Life, metrics: Path) -> None:
        now = time.monotonic()
        if life.stop_sent_at is not None and now - life.stop_sent_at > STOP_WAIT_S:
            self._hang(life, f"still running {STOP_WAIT_S:.0f} s after SIGTERM")
            self.kill(life)
            return
        if life.hung:
            return
        if not life.engaged:
            if time.time() - life.started_at > self.setup.start_timeout_s:
                self._hang(life, f"not joined {self.setup.start_timeout_s:.0f} s after its start")
            return
        quiet = time.time() - metrics.stat().st_mtime
        if quiet > self.setup.hang_s:
            self._hang(life, f"no metrics row for {quiet:.0f} s")

    def _hang(self, life: Life, what: str) -> None:
        life.hung = True
        self.hangs.append({"group": life.group, "life": life.index, "what": what, "at": time.time(),
                           "log_tail": stacks_and_tail(life)})  # fmt: skip
        log.warning("churn: group %d (life %d) hangs: %s", life.group, life.index, what)

    def _check_orphans(self) -> None:
        now = time.monotonic()
        for check in [c for c in self._orphan_checks if c[0] <= now]:
            self._orphan_checks.remove(check)
            _, life, family = check
            alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if alive:
                self.orphans.append({"group": life.group, "life": life.index,
                                     "processes": sorted({p.name() for p in alive})})  # fmt: skip
                procs.kill_all(alive)

    def wait_all(self, timeout_s: float) -> None:
        """Poll until every trainer has exited (a hang is counted and the trainer killed once `timeout_s` pass
        without an outer step in any group: under the token pace the swarm's last rounds take as long as the
        tokens its groups still owe, which churn stretched)."""
        deadline, newest = time.monotonic() + timeout_s, self.newest_outer_step()
        while any(slot.life for slot in self.slots):
            if (now := self.newest_outer_step()) > newest:
                deadline, newest = time.monotonic() + timeout_s, now
            if time.monotonic() > deadline:
                for slot in self.slots:
                    if (life := slot.life) is not None:
                        self._hang(life, f"no outer step in any group for {timeout_s:.0f} s")
                        self.kill(life)
                break
            self.poll(time.time() - self.t0)
            time.sleep(POLL_S)
        while self._orphan_checks:
            self._check_orphans()
            time.sleep(POLL_S)

    def newest_outer_step(self) -> int:
        return max(self.outer_step(g) for g in range(len(self.slots)))

    def outer_step(self, group: int) -> int:
        """The newest outer step group `group`'s current life has logged (0 before its first)."""
        life = self.slots[group].lives[-1] if self.slots[group].lives else None
        if life is None:
            return 0
        steps = [row["outer_step"] for row in rows_of(life.run_dir) if "outer_step" in row]
        return max(steps, default=0)

    def record(self) -> dict[str, Any]:
        return {
            "lives": [life.to_dict() for slot in self.slots for life in slot.lives],
            "hangs": self.hangs,
            "orphans": self.orphans,
            "rss_mb": {str(g): samples for g, samples in self.rss.items()},
            "t0": self.t0,
        }


# ---------------------------------------------------------------- the phases


def stacks_and_tail(life: Life, lines: int = 60) -> list[str]:
    """The end of a hung trainer's log, after asking its ranks for their threads' stacks (SIGUSR1, which the
    trainer answers on stderr and goes on): where it is stuck, for the report."""
    for proc in procs.family(life.proc.pid):
        with contextlib.suppress(psutil.Error):
            command = proc.cmdline()  # a rank, not torchrun (whose command names diloco.train too; USR1 ends it)
            if "diloco.train" in command and "torch.distributed.run" not in command:
                proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    with contextlib.suppress(OSError):
        return life.log_path.read_text(errors="replace").splitlines()[-lines:]
    return []


def run_baseline(setup: ChurnSetup, stack: ExitStack, work_dir: Path, model: Path, peers: list[str]) -> Swarm:
    swarm = Swarm(setup, stack, work_dir, "baseline", model, peers, setup.baseline_rounds * setup.local_steps)
    for slot in swarm.slots:
        swarm.start(slot, "start")
    swarm.wait_all(setup.start_timeout_s + 120 * setup.baseline_rounds)
    return swarm


def round_seconds(swarm: Swarm) -> float:
    """Seconds per round of the baseline's first long-lived group, from its first inner step to its last round."""
    rows = rows_of(swarm.slots[0].lives[0].run_dir)
    steps = [r["time"] for r in rows if "loss" in r]
    outers = [r["time"] for r in rows if "num_peers" in r]
    if not steps or not outers:
        raise BenchError("the baseline's group 0 logged no inner step or no round")
    return (outers[-1] - steps[0]) / len(outers)


def run_soak(setup: ChurnSetup, stack: ExitStack, work_dir: Path, model: Path, peers: list[str],
             round_s: float) -> tuple[Swarm, list[dict[str, Any]], int]:  # fmt: skip
    """The churned phase. Returns the swarm, the events that took place, and the rounds it was set to train."""
    plan = schedule(setup)
    # the soak may round faster than the baseline (its slowest group is often down: 6% faster in the first full
    # run, which then reached its tail 6 events before the schedule's end); the margin lets every event happen
    rounds = math.ceil((plan[-1][0] + setup.tail_s) / round_s * setup.pace_margin) + 2  # start-up: about two rounds
    tail_rounds = math.ceil(setup.tail_s / round_s)
    swarm = Swarm(setup, stack, work_dir, "soak", model, peers, rounds * setup.local_steps)
    for slot in swarm.slots:
        swarm.start(slot, "start")
    # the clock starts once the long-lived groups train: start-up is not churn
    while not all((s.lives[0].run_dir / "metrics.jsonl").exists() for s in swarm.slots[: setup.long_lived]):
        swarm.poll(0.0, sample=False)
        if any(s.lives[0].ended_at is not None for s in swarm.slots[: setup.long_lived]):
            gone = next(s for s in swarm.slots[: setup.long_lived] if s.lives[0].ended_at is not None)
            raise BenchError(f"group {gone.group} exited during start-up: {last_line(gone.lives[0].log_path)}")
        time.sleep(POLL_S)
    swarm.t0 = time.time()
    churned = swarm.slots[setup.long_lived :]
    events: list[dict[str, Any]] = []
    for at, pick, act in plan:
        while (now_s := time.time() - swarm.t0) < at:
            swarm.poll(now_s)
            time.sleep(POLL_S)
        if min(swarm.outer_step(g) for g in range(setup.long_lived)) >= rounds - tail_rounds:
            log.info("churn: the long-lived groups are a tail from the end: %d of %d events", len(events), len(plan))
            break
        events.append(act_on(swarm, churned[int(pick * len(churned))], act, now_s))
    for slot in churned:  # every group finishes with the others
        if slot.life is None:
            swarm.start(slot, "restart" if slot.has_checkpoint() else "fresh")
    swarm.wait_all(setup.tail_s * 4 + setup.start_timeout_s + 10 * round_s)
    return swarm, events, rounds


def act_on(swarm: Swarm, slot: Slot, draw: float, now_s: float) -> dict[str, Any]:
    """One event: an alive group is killed (draw < 0.5) or stopped; a dead one restarts from its checkpoint
    (draw < 0.5, when it has one) or joins fresh. A group still stopping is left alone (counted as skipped)."""
    life = slot.life
    if life is not None and life.stop_sent_at is not None:
        action = "skipped (stopping)"
    elif life is not None:
        action = "kill-9" if draw < 0.5 else "sigterm"
        swarm.kill(life) if action == "kill-9" else swarm.terminate(life)
    else:
        action = "restart" if draw < 0.5 and slot.has_checkpoint() else "fresh"
        swarm.start(slot, action)
    log.info("churn: %6.1f s: group %d: %s", now_s, slot.group, action)
    return {"at_s": round(now_s, 1), "group": slot.group, "action": action}


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    setup = churn_setup(quick)
    log.info("%s", machine_line(info))
    model = write_model(MODEL, work_dir)
    with ExitStack() as stack:
        dht_log = work_dir / "dht.log"
        dht = started(stack, [sys.executable, "-m", "diloco", "dht", "--identity", str(work_dir / "dht.pem"),
                              "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], dht_log, procs.child_env())  # fmt: skip
        peers = dht_peers(dht, dht_log)
        log.info("churn: baseline, %d groups of %s ranks, %d rounds", len(setup.ranks), setup.ranks,
                 setup.baseline_rounds)  # fmt: skip
        baseline = run_baseline(setup, stack, work_dir, model, peers)
        round_s = round_seconds(baseline)
        log.info("churn: a baseline round took %.1f s; the soak starts", round_s)
        soak, events, rounds = run_soak(setup, stack, work_dir, model, peers, round_s)
    return analyse(setup, baseline, soak, events, rounds, round_s)
