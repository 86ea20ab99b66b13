"""`diloco bench hetero`'s CPU counters: a thread that reads each group's cgroups, its trainer's main thread, the
bootstrap DHT's cgroup, the bench's own process and the machine every SAMPLE_S seconds while a phase runs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from diloco.bench.throttle import CpuLimit, ThrottleError

SAMPLE_S = 0.1  # how often the sampler reads the CPU counters (the CFS period is 0.1 s)
CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")  # the unit of /proc's utime and stime


def thread_cpu_s(pid: int) -> float | None:
    """CPU seconds of process `pid`'s main thread (its training loop), or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S  # utime, stime


class Sampler:
    """Reads every SAMPLE_S seconds, in a thread, until `stop`: per group its quota's CPU seconds and throttling, its
    helpers' CPU seconds and its trainer's main thread; the bootstrap DHT's cgroup, this process, and the machine's
    busy and stolen CPU seconds. It also moves any process but the trainer out of the quota into the helpers'
    cgroup (a child forked after the quota was set). A counter that cannot be read keeps its last value."""

    GROUP = ("train", "main", "helpers", "throttled_s", "throttled", "periods")

    def __init__(self, pids: list[int], limits: list[CpuLimit], helpers: list[CpuLimit], dht: CpuLimit | None):
        self.pids, self.limits, self.helpers, self.dht = pids, limits, helpers, dht
        self.series: dict[str, Any] = {"t": [], "busy": [], "steal": [], "bench": [], "dht": []}
        self.series |= {name: [[] for _ in pids] for name in self.GROUP}
        self._me = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hetero-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after one last reading (idempotent)."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(SAMPLE_S):
                self.sample()
                return

    def sample(self) -> None:
        s = self.series
        machine, me = psutil.cpu_times(), self._me.cpu_times()
        s["t"].append(time.time())
        s["busy"].append(machine.user + machine.nice + machine.system + machine.irq + machine.softirq)
        s["steal"].append(getattr(machine, "steal", 0.0))
        s["bench"].append(me.user + me.system)
        s["dht"].append(self._cpu(self.dht, s["dht"]))
        for i, (pid, limit, helper) in enumerate(zip(self.pids, self.limits, self.helpers)):
            self._sweep(pid, limit, helper)
            try:
                usage = limit.usage()
                values = (usage.cpu_s, thread_cpu_s(pid), self._cpu(helper, s["helpers"][i]), usage.throttled_s,
                          usage.throttled_periods, usage.periods)  # fmt: skip
            except (OSError, ThrottleError, ValueError):
                values = (None,) * len(self.GROUP)
            for name, value in zip(self.GROUP, values):
                column = s[name][i]
                column.append(value if value is not None else (column[-1] if column else 0.0))

    @staticmethod
    def _cpu(limit: CpuLimit | None, column: list[float]) -> float:
        try:
            value = limit.usage().cpu_s if limit is not None else 0.0
        except (OSError, ThrottleError, ValueError):
            value = None
        return value if value is not None else (column[-1] if column else 0.0)

    @staticmethod
    def _sweep(pid: int, limit: CpuLimit, helper: CpuLimit) -> None:
        try:
            for other in limit.pids():
                if other != pid:
                    helper.add(other)
        except (OSError, ThrottleError, ValueError):
            pass  # the group is being removed: the phase is over
