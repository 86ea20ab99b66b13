"""`diloco plot`: hand-written metrics.jsonl files of two worker groups, drawn through the command line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from matplotlib.image import imread

from diloco.cli.app import build_app, run_app
from diloco.plot import draw, load_groups

START = 1_700_000_000.0


def group_rows(offset: float, timed: bool = True) -> list[dict]:
    """Train rows for steps 1-4, an outer step and an eval after steps 2 and 4; a row every 2 s from START."""
    rows: list[dict] = []
    for step in range(1, 5):
        rows.append({"step": step, "loss": 8.0 - step + offset, "lr": 1e-3, "tokens_per_s": 900.0})
        if step % 2 == 0:
            rows.append({"step": step, "outer_step": step // 2, "num_peers": 2, "outer_digest": "ab"})
            rows.append({"step": step, "eval_loss": 7.5 - step + offset, "eval_perplexity": 9.0})
    for i, row in enumerate(rows):
        if timed:
            row["time"] = START + 2 * i
    return rows


def write_group(folder: Path, rows: list[dict]) -> None:
    folder.mkdir(parents=True)
    lines = [json.dumps(row) for row in rows]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')  # a running group's half line


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run = tmp_path / "exp"
    write_group(run / "worker-0", group_rows(0.0))
    write_group(run / "worker-1", group_rows(0.5))
    return run


def test_plot_draws_every_group_into_one_png(run: Path) -> None:
    assert run_app(build_app(), ["plot", str(run)]) == 0
    png = run / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(png).shape[:2] == (800, 1300)  # the figure's 13 × 8 inches at 100 dpi

    out = run.parent / "plots" / "both.png"
    assert run_app(build_app(), ["plot", str(run / "worker-0"), str(run / "worker-1"), "-o", str(out)]) == 0
    assert out.is_file()


def test_the_series_are_each_groups_train_eval_and_outer_rows(run: Path) -> None:
    first, second = load_groups([run])
    assert (first.name, second.name) == ("exp/worker-0", "exp/worker-1")
    assert [(p.step, p.value) for p in second.train] == [(1, 7.5), (2, 6.5), (3, 5.5), (4, 4.5)]
    assert [(p.step, p.value) for p in second.eval] == [(2, 6.0), (4, 4.0)]
    assert [p.step for p in first.outer] == [2, 4]
    assert [p.seconds for p in first.train] == [0.0, 2.0, 8.0, 10.0]  # since the group's first row
    assert [p.seconds for p in first.outer] == [4.0, 12.0]


def test_the_figure_has_a_line_per_group_and_panel_and_marks_outer_steps(run: Path) -> None:
    train_step, eval_step, train_time, eval_time = draw(load_groups([run])).axes
    lines = {line.get_label(): line for line in train_step.get_lines()}
    assert sorted(lines) == ["_exp/worker-0 outer", "_exp/worker-1 outer", "exp/worker-0", "exp/worker-1"]
    assert list(lines["exp/worker-1"].get_ydata()) == [7.5, 6.5, 5.5, 4.5]
    outer = lines["_exp/worker-1 outer"]
    assert list(outer.get_xdata()) == [2, 4] and list(outer.get_ydata()) == [6.5, 4.5]  # on the train curve
    assert [list(line.get_xdata()) for line in eval_step.get_lines()] == [[2, 4], [2, 4]]
    assert list(train_time.get_lines()[0].get_xdata()) == [0.0, 2.0, 8.0, 10.0]
    assert len(eval_time.get_lines()) == 2


def test_rows_without_time_leave_that_group_out_of_the_wall_clock_panels(tmp_path: Path) -> None:
    write_group(tmp_path / "old" / "worker-0", group_rows(0.0, timed=False))
    write_group(tmp_path / "new" / "worker-0", group_rows(0.0))
    groups = load_groups([tmp_path / "old", tmp_path / "new"])
    train_step, _, train_time, _ = draw(groups).axes
    assert [line.get_label() for line in train_step.get_lines()] == [
        "old/worker-0", "_old/worker-0 outer", "new/worker-0", "_new/worker-0 outer",
    ]  # fmt: skip
    assert [line.get_label() for line in train_time.get_lines()] == ["new/worker-0", "_new/worker-0 outer"]
    assert run_app(build_app(), ["plot", str(tmp_path / "old")]) == 0  # and the command still draws it


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "missing: no such folder"),
        (lambda tmp: (tmp / "empty" / "worker-0").mkdir(parents=True) or tmp / "empty", "empty: no metrics.jsonl"),
    ],
    ids=["missing folder", "no metrics.jsonl"],
)
def test_bad_folder_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Callable[[Path], Path], message: str
) -> None:
    folder = make(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_app(build_app(), ["plot", str(folder)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and f"{tmp_path}/{message}" in err
    assert not (tmp_path / "missing").exists() and not (tmp_path / "empty" / "loss.png").exists()
