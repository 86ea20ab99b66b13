"""`diloco plot`: the loss curves of worker groups, read from their metrics.jsonl, drawn into one PNG.

A worker group is any folder holding a ``metrics.jsonl`` (``runs/<name>/worker-0``, ``worker-1``, ...), found
under the folders given. Reading is plain Python, so bad input fails before matplotlib is imported; drawing
uses a bare ``matplotlib.figure.Figure`` (rendered by Agg), never pyplot's global state.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.errors import UsageError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

log = logging.getLogger("diloco")


@dataclass(frozen=True)
class Point:
    """One row's value at its inner step and wall-clock second (since the group's first row; None when the row
    has no ``time``, as in metrics.jsonl files written before it existed)."""

    step: int
    seconds: float | None
    value: float


@dataclass(frozen=True)
class Group:
    """One worker group's curves. ``outer``: one point per outer-step row (its value unused)."""

    name: str
    train: list[Point]
    eval: list[Point]
    outer: list[Point]


def plot_runs(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Train and eval loss of every worker group under ``run_dirs`` against inner step and wall-clock, outer
    steps marked, into one PNG (default: ``<first run dir>/loss.png``). Returns the path written."""
    groups = load_groups(run_dirs)
    out = run_dirs[0] / "loss.png" if out is None else out
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(groups).savefig(out, dpi=100)
    log.info("plotted %d worker group(s) into %s", len(groups), out)
    return out


def load_groups(run_dirs: list[Path]) -> list[Group]:
    """Every worker group under the given folders, in path order; a folder that is missing or holds no
    metrics.jsonl at any depth is a UsageError naming it."""
    groups: list[Group] = []
    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise UsageError(f"{run_dir}: no such folder")
        files = sorted(run_dir.rglob("metrics.jsonl"))
        if not files:
            raise UsageError(f"{run_dir}: no metrics.jsonl in it or in any folder below it")
        root = run_dir.resolve().parent
        groups += [load_group(f.parent.resolve().relative_to(root).as_posix(), read_rows(f)) for f in files]
    return groups


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a line that is not a JSON object (the half-written last line of a running
    group) is skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def load_group(name: str, rows: list[dict[str, Any]]) -> Group:
    """Sort a group's rows into train loss, eval loss and outer steps; seconds count from its first timed row."""
    start = next((row["time"] for row in rows if _number(row.get("time"))), None)

    def points(field: str) -> list[Point]:
        return [
            Point(row["step"], row["time"] - start if _number(row.get("time")) else None, float(row[field]))
            for row in rows
            if _number(row.get(field))
        ]

    return Group(name, train=points("loss"), eval=points("eval_loss"), outer=points("outer_step"))


def draw(groups: list[Group]) -> Figure:
    """Four panels, train and eval loss against inner step (top) and wall-clock seconds (bottom); one colour
    per group; outer steps as hollow circles on the group's train-loss curve."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 8), layout="constrained")
    (train_step, eval_step), (train_time, eval_time) = fig.subplots(2, 2)
    for i, group in enumerate(groups):
        colour = f"C{i % 10}"
        _curve(train_step, group.train, colour, group.name, wall_clock=False)
        _curve(eval_step, group.eval, colour, group.name, wall_clock=False, marker="o")
        _curve(train_time, group.train, colour, group.name, wall_clock=True)
        _curve(eval_time, group.eval, colour, group.name, wall_clock=True, marker="o")
        _outer_marks(train_step, group, colour, wall_clock=False)
        _outer_marks(train_time, group, colour, wall_clock=True)
    seconds = "seconds since the group's first row"
    for ax, title, xlabel in [
        (train_step, "train loss by inner step", "inner step"),
        (eval_step, "eval loss by inner step", "inner step"),
        (train_time, "train loss by wall-clock", seconds),
        (eval_time, "eval loss by wall-clock", seconds),
    ]:
        ax.set(title=title, xlabel=xlabel, ylabel="loss")
        if xlabel == "inner step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if not ax.get_lines():
            why = "no rows with a time field" if ax in (train_time, eval_time) else "no rows"
            ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", color="grey")
    handles = [Line2D([], [], color=f"C{i % 10}", label=group.name) for i, group in enumerate(groups)]
    if any(group.outer for group in groups):
        handles.append(Line2D([], [], color="black", marker="o", markerfacecolor="none", linestyle="none",
                              label="outer step"))  # fmt: skip
    fig.legend(handles=handles, loc="outside right upper")
    return fig


def _curve(ax: Axes, points: list[Point], colour: str, name: str, wall_clock: bool, marker: str = "") -> None:
    shown = [p for p in points if p.seconds is not None] if wall_clock else points
    if shown:
        xs = [p.seconds if wall_clock else p.step for p in shown]
        ax.plot(xs, [p.value for p in shown], color=colour, marker=marker, markersize=3, linewidth=1.2, label=name)


def _outer_marks(ax: Axes, group: Group, colour: str, wall_clock: bool) -> None:
    """Each outer step at the train loss interpolated to its inner step (the train row of that step is missing
    when --log-interval skips it). By wall-clock it sits where the round ended: the gap before it is averaging."""
    import numpy as np

    marks = [p for p in group.outer if p.seconds is not None] if wall_clock else group.outer
    if not marks or not group.train:
        return
    train = sorted(group.train, key=lambda p: p.step)  # a resumed run appends steps it had logged already
    losses = np.interp([p.step for p in marks], [p.step for p in train], [p.value for p in train])
    xs = [p.seconds if wall_clock else p.step for p in marks]
    label = f"_{group.name} outer"  # "_": not in the legend, which has one entry for every group's outer steps
    ax.plot(xs, losses, color=colour, marker="o", markerfacecolor="none", linestyle="none", label=label)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
