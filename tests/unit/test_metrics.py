"""Metrics sinks in process: the wall-clock field, TensorBoard event files read back by TensorBoard's event reader,
and the --metric-logger-type list."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diloco.cli.app import build_app, run_app
from diloco.config import Config
from diloco.metrics import JsonlSink, Metrics
from tests.support.tensorboard import TAGS, log_rows


def test_every_row_gets_its_wall_clock_time_and_the_callers_row_is_left_alone(tmp_path: Path) -> None:
    metrics = Metrics([JsonlSink(tmp_path / "metrics.jsonl")])
    row = {"step": 3, "loss": 2.0}
    before = time.time()
    metrics.log(row)
    metrics.close()
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written["step"] == 3 and written["loss"] == 2.0 and before <= written["time"] <= time.time()
    assert row == {"step": 3, "loss": 2.0}


def test_tensorboard_sink_writes_every_numeric_field_as_a_scalar_at_the_rows_step(tmp_path: Path) -> None:
    before, after = log_rows(tmp_path)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == TAGS  # no strings, None or booleans; no step or time scalar
    loss = events.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 6.5), (2, 5.25)]
    assert all(before <= e.wall_time <= after for e in loss)  # the rows' `time`
    assert [(e.step, e.value) for e in events.Scalars("train/lr")] == [(1, 0.0), (2, pytest.approx(5e-3))]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 5.0)]
    assert [(e.step, e.value) for e in events.Scalars("outer/num_peers")] == [(2, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("outer/bytes_sent")] == [(2, 4096.0)]


def test_metric_logger_type_combines_sinks_and_names_the_allowed_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert Config(path_model="m", fake_data=True, metric_logger_type="tensorboard,wandb").metric_sinks == [
        "tensorboard",
        "wandb",
    ]
    assert Config(path_model="m", fake_data=True).metric_sinks == []  # dummy: metrics.jsonl and the console only
    app = build_app(train_only=True, train_fn=lambda config: 0)
    with pytest.raises(SystemExit) as exit_info:
        run_app(app, ["--path-model", "m", "--fake-data", "--metric-logger-type", "tensorboard,wandbb"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--metric-logger-type" in err and "'wandbb'" in err
    assert "dummy, tensorboard, wandb" in err
