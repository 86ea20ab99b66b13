"""What a person watching a terminal reads: the start-up banner, one compact line per metrics row, the verdict
table `diloco launch` prints when its worker groups end, and the log's format.

Files keep every field (`metrics.jsonl`, `summary.json`); the console keeps what a person acts on: where the run
writes, how fast it goes, when it ends, whether the last round worked. Digests stay in the files. Plain Python.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO


def banner(facts: dict[str, Any]) -> str:
    """The start-up banner: one aligned `name: value` line per fact, in the given order."""
    width = max(len(name) for name in facts)
    return "\n".join(f"  {name.ljust(width)} : {value}" for name, value in facts.items())


def count(n: float) -> str:
    """1234567 -> '1.23M': parameter, token and block counts at a glance."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= limit:
            return f"{n / limit:.3g}{suffix}"
    return f"{n:g}"


def duration(seconds: float) -> str:
    """75 -> '1m15s', 3725 -> '1h02m'."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class ProgressLine:
    """A metrics sink printing one short line per row: `step 40/300 | loss 2.61 | lr 3.0e-03 | 9.1k tok/s |
    ETA 1m12s` for inner steps, `outer step 3 | peers 2 | 0.41 s | 1.2 MB | tcp` for rounds, `step 50/300 | eval
    loss 2.58 | ppl 13.2` for evaluations. The ETA comes from the wall-clock pace since the first step this run
    logged, outer steps and evaluations included."""

    def __init__(self, max_steps: int, out: TextIO | None = None) -> None:
        self.max_steps, self.out = max_steps, out
        self.first: tuple[float, int] | None = None  # (monotonic time, step) of the first train row
        self.gone = False  # the output's reader went away: nothing more is printed

    def write(self, row: dict[str, Any]) -> None:
        line = self.format(row, time.monotonic())
        if not line or self.gone:
            return
        try:
            print(line, file=self.out or sys.stdout, flush=True)
        except BrokenPipeError:  # its reader left (`| head`): training goes on, the rows still reach metrics.jsonl
            self.gone = True

    def close(self) -> None:
        pass

    def format(self, row: dict[str, Any], now: float) -> str:
        if "outer_step" in row:
            return outer_line(row)
        step = row.get("swarm_step", row.get("step"))  # under a token budget the run ends at the swarm's step
        if "eval_loss" in row:
            return f"step {step}/{self.max_steps} | eval loss {row['eval_loss']:.4f} | ppl {row['eval_perplexity']:.4g}"
        if "loss" not in row:
            return " | ".join(f"{key} {value}" for key, value in row.items() if key != "time")
        parts = [f"step {step}/{self.max_steps}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.2e}"]
        if "tokens_per_s" in row:
            parts.append(f"{count(row['tokens_per_s'])} tok/s")
        if self.first is None:
            self.first = (now, step)
        elif step > self.first[1] and step < self.max_steps:
            per_step = (now - self.first[0]) / (step - self.first[1])
            parts.append(f"ETA {duration(per_step * (self.max_steps - step))}")
        return " | ".join(parts)


def outer_line(row: dict[str, Any]) -> str:
    """One outer step: its number, then what the round did (or where the state came from)."""
    peers = row.get("num_peers")
    # a round that applied nothing left the group's outer step where it was: the line names the step it was for, as
    # the log's "outer step N: averaging" did
    applied_nothing = peers == 0 or bool(row.get("sat_out"))
    parts = [f"outer step {row['outer_step'] + int(applied_nothing)}"]
    if peers is not None:
        what = "sat out (the swarm was past it): nothing applied" if row.get("sat_out") else None
        parts.append(what or {0: "round failed: nothing applied", 1: "alone"}.get(peers, f"peers {peers}"))
        if peers:
            megabytes = (row.get("bytes_sent", 0) + row.get("bytes_received", 0)) / 1e6
            parts += [f"{row['averaging_s']:.2f} s", f"{megabytes:.3g} MB"]
        if row.get("swarm_tokens") is not None:  # a token budget: what this group brought to the round
            parts.append(f"{count(row['tokens'])} of {count(row['swarm_tokens'])} tokens")
        if row.get("wait_s", 0.0) >= 0.05:
            parts.append(f"waited {row['wait_s']:.2f} s")
        if row.get("rejected"):
            parts.append(f"rejected {row['rejected']}")
        if row.get("transport"):
            parts.append(row["transport"])
    if row.get("loaded_state_from") is not None:
        parts.append(f"loaded the state of group {row['loaded_state_from']}")
    if row.get("discarded_steps"):
        parts.append(f"lost {row['discarded_steps']} step{'s' if row['discarded_steps'] != 1 else ''}")
    return " | ".join(parts)


LOST_WARN_PERCENT = 10  # a group that discarded more than this share of its inner steps is marked and named


def lost_steps(discarded: int | None, steps: int | None) -> str:
    """A group's discarded inner steps as a table cell: ``0``, ``12 (8%)`` (of `steps`, when any), with a trailing
    ``!`` over ``LOST_WARN_PERCENT`` of its steps; ``-`` when unknown (an earlier trainer's files)."""
    if discarded is None:
        return "-"
    if not discarded:
        return "0"
    share = f" ({discarded / steps:.0%})" if steps else ""
    return f"{discarded}{share}{'!' if lost_too_many(discarded, steps) else ''}"


def lost_too_many(discarded: int | None, steps: int | None) -> bool:
    """Whether `discarded` is over ``LOST_WARN_PERCENT`` of `steps` (any discarded step of a group with none
    counts)."""
    return bool(discarded) and discarded * 100 > LOST_WARN_PERCENT * (steps or 0)


# ---------------------------------------------------------------- the end of `diloco launch`


@dataclass(frozen=True)
class GroupResult:
    """What one worker group's folder says about how it ended."""

    name: str
    status: str
    steps: int | None
    outer_steps: int | None
    rounds: dict[str, int]  # ok / alone / failed
    final_eval_loss: float | None
    sha: str | None
    discarded_steps: int | None = None  # None: the summary has no count (an earlier trainer)


def read_group(run_dir: Path) -> GroupResult:
    """The summary and round counts of one worker group's run folder (missing files: status 'no summary')."""
    summary: dict[str, Any] = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    rounds = {"ok": 0, "alone": 0, "failed": 0}
    if (run_dir / "metrics.jsonl").is_file():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "num_peers" in row:
                rounds["failed" if row["num_peers"] == 0 else "alone" if row["num_peers"] == 1 else "ok"] += 1
    return GroupResult(
        name=run_dir.name,
        status=summary.get("status", "no summary"),
        steps=summary.get("steps"),
        outer_steps=summary.get("outer_steps"),
        rounds=rounds,
        final_eval_loss=summary.get("final_eval_loss"),
        sha=summary.get("params_sha256"),
        discarded_steps=summary.get("discarded_steps"),
    )


def verdict(groups: list[GroupResult]) -> str:
    """The table `diloco launch` ends with, a line for each group that discarded over ``LOST_WARN_PERCENT`` of its
    inner steps, and one line: did every group end with the same model?"""
    header = ["group", "status", "inner steps", "lost steps", "outer steps", "rounds ok/alone/failed",
              "final eval loss", "model"]  # fmt: skip
    rows = [
        [
            g.name,
            g.status,
            _or_dash(g.steps),
            lost_steps(g.discarded_steps, g.steps),
            _or_dash(g.outer_steps),
            f"{g.rounds['ok']}/{g.rounds['alone']}/{g.rounds['failed']}",
            "-" if g.final_eval_loss is None or not math.isfinite(g.final_eval_loss) else f"{g.final_eval_loss:.4f}",
            (g.sha or "-")[:12],
        ]
        for g in groups
    ]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [" | ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join([*lines, *lost_lines(groups), same_model_line(groups)])


def lost_lines(groups: list[GroupResult]) -> list[str]:
    """One line per group that discarded over ``LOST_WARN_PERCENT`` of its inner steps."""
    return [
        f"! {g.name} discarded {g.discarded_steps} of {_or_dash(g.steps)} inner steps"
        + (f" ({g.discarded_steps / g.steps:.0%})" if g.steps else "")
        + ": it loaded another group's state over its own work, or a round applied nothing (see docs/reliability.md)"
        for g in groups
        if lost_too_many(g.discarded_steps, g.steps)
    ]


def same_model_line(groups: list[GroupResult]) -> str:
    models: dict[str, list[str]] = {}
    for g in groups:
        models.setdefault(g.sha or "none", []).append(g.name)
    if len(models) == 1 and None not in (g.sha for g in groups):
        return f"✓ all {len(groups)} worker groups ended with the same model (params_sha256 {groups[0].sha[:12]}…)"
    split = "; ".join(f"{', '.join(names)}: {sha[:12]}" for sha, names in models.items())
    return f"✗ the worker groups did not end with the same model ({split})"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def log_warning(message: Warning | str, category: type[Warning], *_location: Any, **_kwargs: Any) -> None:
    """``warnings.showwarning`` as one log line (no file name and source line: the message says what to do)."""
    logging.getLogger("diloco").warning("%s", message)


def setup_logging(rank: int) -> None:
    """Log lines with time and rank; INFO on rank 0, WARNING on the others (every rank sees the same events), but
    for the token store's lines (``diloco.data``), which only the rank that builds or waits for it has."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # whichever rank builds a token store (the first to take its lock) says how far it got
    logging.getLogger("diloco.data").setLevel(logging.INFO)
    for chatty in ("httpx", "httpx2", "httpcore"):  # huggingface_hub's HTTP clients log every request at INFO
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # bitsandbytes, imported by peft, warns on a CPU with AVX512-BF16 that it cannot fetch an optional kernel from
    # the hub (the `kernels` package, not ours to need): a warning in every LoRA run that names nothing to fix
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: "from kernels-community" not in record.getMessage()
    )
