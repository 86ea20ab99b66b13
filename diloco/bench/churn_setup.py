"""What `diloco bench churn` runs (`ChurnSetup`, the seeded `schedule` of events) and what it keeps of each group:
its `Slot` (world rank, cgroup, checkpoints) and the `Life` of each start of its trainer."""

from __future__ import annotations

import dataclasses
import random
import subprocess
from pathlib import Path
from typing import Any

from diloco.bench.throttle import CpuLimit
from diloco.checkpoint import latest
from diloco.errors import FieldError

SEED = 0


@dataclasses.dataclass(frozen=True)
class ChurnSetup:
    """What both phases run. `ranks[g]`: ranks of group g; the first `long_lived` groups are never churned."""

    ranks: tuple[int, ...]
    long_lived: int
    seq_length: int
    batch: int  # sequences per inner step of a group (a 2-rank group: half per rank)
    local_steps: int  # H
    baseline_rounds: int
    soak_s: float  # events are drawn until this time and at least `min_events` of them
    min_events: int
    gap_s: tuple[float, float]  # seconds between two events, uniform
    tail_s: float  # the swarm trains about this long after the last event
    pace: str | None  # --hv.pace; None: the default
    matchmaking_s: float | None  # --hv.matchmaking-time; None: the default (auto)
    averaging_timeout_s: float | None  # --hv.averaging-timeout; None: the default (auto)
    cores: tuple[float, ...]  # each group's share of the machine (a 2-rank group: more, to keep pace)
    start_timeout_s: float  # a start-up longer than this is a hang
    rss_reference_s: float  # the RSS a long-lived group's end is compared with: its sample nearest this time
    # soak rounds planned beyond the baseline's pace: the soak often rounds faster (its churned group is down a
    # share of the time), most of all in the quick run on a loaded machine, whose baseline is two rounds
    pace_margin: float = 1.15

    @property
    def tokens_per_step(self) -> int:
        return self.seq_length * self.batch

    @property
    def hang_s(self) -> float:
        """No metrics row for this long from a trainer that has joined: a hang (two rounds' worst case; under auto a
        round waits at most one of its own rounds + 5 s and its deadline starts at 60 s plus the model's bytes)."""
        matchmaking = AUTO_WAIT_S if self.matchmaking_s is None else self.matchmaking_s
        timeout = AUTO_DEADLINE_S if self.averaging_timeout_s is None else self.averaging_timeout_s
        return 2 * (matchmaking + timeout)

    def timing_flags(self) -> list[str]:
        """The flags of what is not left to the defaults."""
        flags = [] if self.pace is None else ["--hv.pace", self.pace]
        flags += [] if self.matchmaking_s is None else ["--hv.matchmaking-time", f"{self.matchmaking_s:g}"]
        return flags + ([] if self.averaging_timeout_s is None else
                        ["--hv.averaging-timeout", f"{self.averaging_timeout_s:g}"])  # fmt: skip


# a round's worst case under the defaults, for the hang threshold: the longest wait for groups on their way (one
# round of a slow group here, and 5 s) and a first deadline (60 s, and the small model's bytes at 1 MiB/s)
AUTO_WAIT_S, AUTO_DEADLINE_S = 60.0, 120.0


def churn_setup(quick: bool) -> ChurnSetup:
    if quick:
        return ChurnSetup(ranks=(1, 1, 1), long_lived=2, seq_length=64, batch=4, local_steps=5, baseline_rounds=2,
                          soak_s=40.0, min_events=4, gap_s=(8.0, 14.0), tail_s=20.0, pace="fixed", matchmaking_s=3.0,
                          averaging_timeout_s=15.0, cores=(0.5, 0.5, 0.5), start_timeout_s=150.0,
                          rss_reference_s=30.0, pace_margin=1.6)  # fmt: skip
    return ChurnSetup(ranks=(1, 1, 1, 2), long_lived=2, seq_length=64, batch=4, local_steps=20, baseline_rounds=10,
                      soak_s=1800.0, min_events=90, gap_s=(10.0, 30.0), tail_s=150.0, pace=None, matchmaking_s=None,
                      averaging_timeout_s=None, cores=(0.35, 0.35, 0.35, 0.5), start_timeout_s=240.0,
                      rss_reference_s=300.0)  # fmt: skip


def schedule(setup: ChurnSetup, seed: int = SEED) -> list[tuple[float, float, float]]:
    """Seeded events: (seconds into the soak, a draw that picks the group, a draw that picks the action)."""
    rng = random.Random(seed)
    events, t = [], 0.0
    while t < setup.soak_s or len(events) < setup.min_events:
        t += rng.uniform(*setup.gap_s)
        events.append((round(t, 2), rng.random(), rng.random()))
    return events


# ---------------------------------------------------------------- one group's lives


@dataclasses.dataclass
class Life:
    """One start of a group's trainer, until it exits or is ended."""

    group: int
    index: int
    how: str  # start, restart (from its checkpoint), fresh (new run folder, no checkpoint)
    run_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    started_at: float  # unix
    ended_at: float | None = None
    end: str | None = None  # exit, kill-9, sigterm
    code: int | None = None
    engaged: bool = False  # its quota is set (it has joined)
    hung: bool = False
    stop_sent_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "life": self.index, "how": self.how, "run_dir": self.run_dir.name,
                "started_at": self.started_at, "ended_at": self.ended_at, "end": self.end, "code": self.code,
                "hung": self.hung}  # fmt: skip


class Slot:
    """A group: its world rank, its cgroup, its checkpoint folder and its lives, one at a time."""

    def __init__(self, group: int, ranks: int, limit: CpuLimit, folder: Path) -> None:
        self.group, self.ranks, self.limit, self.folder = group, ranks, limit, folder
        self.lives: list[Life] = []

    @property
    def life(self) -> Life | None:
        """The life that runs now (None: dead)."""
        return self.lives[-1] if self.lives and self.lives[-1].ended_at is None else None

    @property
    def checkpoints(self) -> Path:
        return self.folder / "checkpoints"

    def has_checkpoint(self) -> bool:
        try:
            latest(self.checkpoints)
        except FieldError:
            return False
        return True
