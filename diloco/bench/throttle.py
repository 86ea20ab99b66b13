"""A kernel CPU limit for a process tree: a cgroup of the v1 `cpu` controller with a CFS quota.

`diloco bench hetero` makes worker groups that really differ in speed on one machine by giving each its own
share of a core (`cpu.cfs_quota_us` ÷ `cpu.cfs_period_us`): the kernel runs the group's processes for at most
that much CPU time per period and then parks them until the next one. Nothing in the trainer sleeps or knows.
Children forked after a process joined the cgroup are in it too (hivemind's DHT and averager processes, p2pd).

Needs root and a cgroup v1 `cpu` hierarchy mounted at /sys/fs/cgroup/cpu (`available()` says why not). Where
`cpuacct` is mounted apart (as on this machine), a twin group there counts the CPU time the processes used.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

from diloco.bench import BenchError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
ACCT_ROOT = Path("/sys/fs/cgroup/cpuacct")
PERIOD_US = 100_000  # the kernel's default CFS period: a quota of 25_000 is a quarter of a core
MIN_QUOTA_US = 1_000  # the kernel refuses smaller quotas
REMOVE_S = 5.0  # how long close() retries rmdir while exiting processes leave the group
_serial = itertools.count()


class ThrottleError(BenchError):
    """No cgroup could be made or removed (no `cpu` controller, not root): one line, the bench stops."""


def available(root: Path = CPU_ROOT) -> str | None:
    """None when CPU limits can be set here, else why not (one line)."""
    if not (root / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {root} (cpu.cfs_quota_us missing)"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (needs root)"
    return None


@dataclass(frozen=True)
class CpuUsage:
    """What the kernel counted for one limit's group since it was made.

    cpu_s: CPU seconds its processes used (cpuacct; None where that controller is not mounted);
    periods / throttled_periods: CFS periods in which it ran / in which it hit the quota and was parked;
    throttled_s: the time its processes were parked, summed over its CPUs (so up to cores × wall)."""

    cpu_s: float | None
    periods: int
    throttled_periods: int
    throttled_s: float


class CpuLimit:
    """A context manager: `cores` CPUs' worth of time for every process `add`ed and their later children.

    On exit the processes still in the group are moved back to the hierarchy's root (they then run unlimited;
    stop them first) and the group is removed; `usage` then returns the last reading taken before removal.

    :param name: a label for the cgroup's folder (`diloco-<name>-<pid>-<n>`); letters, digits, `._-`.
    :param cores: the share, e.g. 0.25 for a quarter of one core, 2.0 for two cores.
    :param engaged: False: the group starts without a quota (its processes run at full speed) until `engage()`;
        for start-up work (imports) that no measurement counts and a quota would only stretch.
    """

    def __init__(
        self, name: str, cores: float, engaged: bool = True, root: Path = CPU_ROOT, acct_root: Path = ACCT_ROOT
    ) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"cgroup name {name!r}: letters, digits, '.', '_' and '-' only")
        if not cores * PERIOD_US >= MIN_QUOTA_US:
            raise ValueError(f"cores {cores}: at least {MIN_QUOTA_US / PERIOD_US} of a core")
        self.name, self.cores, self.engaged, self.root = name, cores, engaged, root
        self.folder = root / f"diloco-{name}-{os.getpid()}-{next(_serial)}"
        # cpuacct beside cpu (mounted apart) needs a twin group; co-mounted, the cpu group counts usage itself
        self.acct_root = acct_root if acct_root.is_dir() and acct_root.resolve() != root.resolve() else None
        self.acct_folder = self.acct_root / self.folder.name if self.acct_root else None
        self._last: CpuUsage | None = None

    @property
    def quota_us(self) -> int:
        return round(self.cores * PERIOD_US)

    def __enter__(self) -> CpuLimit:
        if why := available(self.root):
            raise ThrottleError(f"cannot limit CPU for {self.name}: {why}")
        try:
            self.folder.mkdir()
            (self.folder / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.folder / "cpu.cfs_quota_us").write_text(str(self.quota_us if self.engaged else -1))
            if self.acct_folder is not None:
                self.acct_folder.mkdir()
        except OSError as e:
            self._remove()
            raise ThrottleError(f"cannot make cgroup {self.folder}: {e.strerror or e}") from None
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close(raise_errors=kind is None)  # never hide the error that ended the block

    def engage(self) -> None:
        """Set the quota now (for a limit made with `engaged=False`; harmless when already set)."""
        (self.folder / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        self.engaged = True

    def disengage(self) -> None:
        """Lift the quota (until the next `engage`): a process restarted in the group starts up at full speed."""
        (self.folder / "cpu.cfs_quota_us").write_text("-1")
        self.engaged = False

    def add(self, pid: int) -> None:
        """Put process `pid` and the descendants it already has into the group (the kernel puts later children
        there itself). A process that has exited meanwhile is skipped.

        The tree is listed again until a listing finds nobody outside the group that was not moved already: a
        child forked after one listing but before its parent moved was born in the parent's old group, and only a
        later listing sees it (children born inside do not keep the loop going)."""
        moved: set[int] = set()
        while True:
            done = moved.union(self.pids())
            new = [p for p in self._tree(pid) if p not in done]
            if not new:
                return
            for pid_now in new:
                for folder in self._folders():
                    with contextlib.suppress(ProcessLookupError):  # ESRCH: it exited between listing and writing
                        (folder / "cgroup.procs").write_text(str(pid_now))
            moved.update(new)

    def release(self, pid: int) -> None:
        """Move the processes that descend from `pid` (not `pid` itself) back to their hierarchy's root: they run
        unlimited again, while `pid` stays held (e.g. a trainer's network helpers, but not its compute)."""
        for child in self._tree(pid)[1:]:
            for folder, root in zip(self._folders(), [self.root, self.acct_root]):
                if folder.exists():
                    with contextlib.suppress(ProcessLookupError):
                        (root / "cgroup.procs").write_text(str(child))

    def pids(self) -> list[int]:
        """The processes in the group now."""
        text = (self.folder / "cgroup.procs").read_text() if self.folder.exists() else ""
        return [int(line) for line in text.split()]

    def usage(self) -> CpuUsage:
        """The kernel's counters for the group now (after exit: as read just before it was removed)."""
        if not self.folder.exists():
            if self._last is None:
                raise ThrottleError(f"cgroup {self.folder} does not exist (not entered)")
            return self._last
        stat = dict(line.split() for line in (self.folder / "cpu.stat").read_text().splitlines() if line.strip())
        cpu_ns = self._read_int(self.acct_folder or self.folder, "cpuacct.usage")
        return CpuUsage(
            cpu_s=None if cpu_ns is None else cpu_ns / 1e9,
            periods=int(stat.get("nr_periods", 0)),
            throttled_periods=int(stat.get("nr_throttled", 0)),
            throttled_s=int(stat.get("throttled_time", 0)) / 1e9,
        )

    def close(self, raise_errors: bool = True) -> None:
        """Move every process still in the group back to the root, then remove the group (and its cpuacct twin).
        Exiting processes can keep a group busy for a moment: rmdir is retried for up to REMOVE_S seconds."""
        if self.folder.exists():
            self._last = self.usage()
        deadline = time.monotonic() + REMOVE_S
        while not self._remove():
            if time.monotonic() > deadline:
                if raise_errors:
                    raise ThrottleError(f"cgroup {self.folder} still holds processes {self.pids()}; not removed")
                return
            time.sleep(0.05)

    # ---------------------------------------------------------------- internals

    def _folders(self) -> list[Path]:
        return [self.folder, *([self.acct_folder] if self.acct_folder is not None else [])]

    def _remove(self) -> bool:
        """One attempt: move the group's processes to their hierarchy's root and rmdir it. True once gone."""
        gone = True
        for folder, root in zip(self._folders(), [self.root, self.acct_root]):
            if not folder.exists():
                continue
            for pid in (folder / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    (root / "cgroup.procs").write_text(pid)
            try:
                folder.rmdir()
            except OSError as e:
                if e.errno != errno.EBUSY:  # EBUSY: a process is still on its way out; anything else is real
                    raise ThrottleError(f"cannot remove cgroup {folder}: {e.strerror or e}") from None
                gone = False
        return gone

    @staticmethod
    def _tree(pid: int) -> list[int]:
        try:
            root = psutil.Process(pid)
            return [pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    @staticmethod
    def _read_int(folder: Path, name: str) -> int | None:
        path = folder / name
        return int(path.read_text()) if path.exists() else None
