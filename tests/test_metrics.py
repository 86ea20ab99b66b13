"""Metrics sinks in process: the wall-clock field, TensorBoard event files read back by TensorBoard itself (its
event reader and its real server), and the --metric-logger-type list."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diloco import procs
from diloco.cli.app import build_app, run_app
from diloco.config import Config
from diloco.metrics import JsonlSink, Metrics, TensorBoardSink

TENSORBOARD = Path(sys.executable).parent / "tensorboard"

ROWS = [
    {"step": 1, "loss": 6.5, "lr": 0.0, "tokens_per_s": 1200.0, "peak_memory_mb": 310.5},
    {"step": 2, "loss": 5.25, "lr": 5e-3, "tokens_per_s": 1300.0, "peak_memory_mb": 311.0},
    {"step": 2, "eval_loss": 5.0, "eval_perplexity": 148.4},
    {"step": 2, "outer_step": 1, "outer_digest": "ab12", "num_peers": 2, "averaging_s": 0.75, "bytes_sent": 4096,
     "transport": "tcp", "loaded_state_from": None, "params_sha256": "cd34", "skipped": True},
]  # fmt: skip
TAGS = {
    "train/loss", "train/lr", "train/tokens_per_s", "train/peak_memory_mb", "eval/loss", "eval/perplexity",
    "outer/outer_step", "outer/num_peers", "outer/averaging_s", "outer/bytes_sent",
}  # fmt: skip


def log_rows(log_dir: Path) -> tuple[float, float]:
    """Log ROWS through a TensorBoardSink; the wall-clock span they were logged in."""
    metrics = Metrics([TensorBoardSink(log_dir)])
    before = time.time()
    for row in ROWS:
        metrics.log(row)
    after = time.time()
    metrics.close()
    return before, after


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_tensorboard_serves_the_logged_scalars(tmp_path: Path) -> None:
    log_rows(tmp_path / "worker-0" / "tensorboard")
    port = free_port()
    server = subprocess.Popen(
        [str(TENSORBOARD), "--logdir", str(tmp_path), "--host", "127.0.0.1", "--port", str(port),
         "--load_fast", "false", "--reload_interval", "1"],
        env=procs.child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    base, run = f"http://127.0.0.1:{port}/data/plugin/scalars", "worker-0/tensorboard"
    try:
        deadline, tags = time.monotonic() + 60, {}
        while "train/loss" not in tags.get(run, {}):
            assert server.poll() is None, server.stderr.read().decode()[-2000:] if server.stderr else ""
            assert time.monotonic() < deadline, f"tensorboard never listed {run}: {tags}"
            time.sleep(0.3)
            try:
                tags = get_json(f"{base}/tags")
            except (urllib.error.URLError, ConnectionError):
                continue  # not listening yet
        assert set(tags[run]) == TAGS
        query = urllib.parse.urlencode({"run": run, "tag": "train/loss"})
        assert [(step, value) for _, step, value in get_json(f"{base}/scalars?{query}")] == [(1, 6.5), (2, 5.25)]
    finally:
        procs.stop_tree(server, grace_s=5, sig=signal.SIGTERM)
    assert not procs.family(server.pid)


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
