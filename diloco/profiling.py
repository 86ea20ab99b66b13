"""--profile-steps N: torch.profiler over N inner steps after --profile-start, on the group's first rank. It writes
what keeps the accelerator idle or busy, in a form that reads without a trace viewer: ``profile.json`` (the window's
wall time, the accelerator's busy time and share, the top kernels and host ops) and ``profile.txt`` (torch's own
table), both in the run folder. Off (``NoProfiler``) it costs nothing.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger("diloco")
TOP = 15  # kernels and host ops listed


class NoProfiler:
    def step(self, step: int) -> None:
        """After inner step `step`."""

    def close(self) -> None:
        """At the end of the run (a window cut short by the end is written as it stands)."""


class StepProfiler(NoProfiler):
    """Profiles inner steps start+1 .. start+steps (the window opens after step `start` ends)."""

    def __init__(self, start: int, steps: int, run_dir: Path, device: torch.device) -> None:
        self.start, self.end = start, start + steps
        self.run_dir, self.device = run_dir, device
        self.accelerated = device.type != "cpu"
        self.prof: profile | None = None
        self.opened_at = 0.0

    def step(self, step: int) -> None:
        if step == self.start and self.prof is None:
            self._sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()
            self.opened_at, self.first = time.perf_counter(), step + 1
        elif step == self.end:
            self.close(step)

    def close(self, step: int | None = None) -> None:
        if self.prof is None:
            return
        self._sync()  # the window ends when the accelerator finished its last step, not when the host queued it
        wall = time.perf_counter() - self.opened_at
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        report = summarize(prof, wall, self.first, step)
        write_report(self.run_dir, report, prof)
        busy = report["device_busy_fraction"]
        log.info("profiled inner steps %d-%s: %s", self.first, step or "end",
                 "host only" if busy is None else f"accelerator busy {busy:.1%} of {wall:.2f} s")  # fmt: skip

    def _sync(self) -> None:
        if self.accelerated:
            torch.accelerator.synchronize()


def build_profiler(start: int, steps: int, run_dir: Path, device: torch.device, is_main: bool) -> NoProfiler:
    return StepProfiler(start, steps, run_dir, device) if steps and is_main else NoProfiler()


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end) intervals given in microseconds: concurrent kernels on several
    streams count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1e6


def summarize(prof: profile, wall: float, first: int, last: int | None) -> dict[str, Any]:
    """The window's figures: wall time, the accelerator's busy time (the union of its kernels and copies), the top
    kernels by device time and the top host ops by their own time."""
    kernels = [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU]
    busy = busy_seconds([(e.time_range.start, e.time_range.end) for e in kernels]) if kernels else None
    averages = prof.key_averages()
    device_top = sorted((a for a in averages if _device_us(a) > 0), key=_device_us, reverse=True)[:TOP]
    host_top = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:TOP]
    return {
        "steps": [first, last],
        "wall_s": wall,
        "device_busy_s": busy,
        "device_busy_fraction": None if busy is None else min(1.0, busy / wall),
        "top_device": [{"name": a.key, "calls": a.count, "s": _device_us(a) / 1e6} for a in device_top],
        "top_host_self": [{"name": a.key, "calls": a.count, "s": a.self_cpu_time_total / 1e6} for a in host_top],
    }


def _device_us(average: Any) -> float:
    """An op's own time on the accelerator (torch names the field per backend across versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(average, name):
            return float(getattr(average, name))
    return 0.0


def write_report(run_dir: Path, report: dict[str, Any], prof: profile) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "profile.json").write_text(json.dumps(report, indent=1) + "\n")
    sort_by = "self_device_time_total" if report["device_busy_s"] is not None else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort_by, row_limit=40)
    except (AttributeError, KeyError, ValueError):  # an older torch names the device column after CUDA
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
    (run_dir / "profile.txt").write_text(table + "\n")
