"""Training by epochs (`--epochs N`): passes over the group's share of the data instead of a step count, in
real runs."""

from __future__ import annotations

from pathlib import Path

from tests.support.procs import FAST, assert_ok, metrics, python_train, summary


def test_epochs_set_the_steps_log_the_epoch_and_evaluate_at_every_epoch_end(tmp_path: Path) -> None:
    # 703 bytes + EOS = 704 byte tokens = 22 blocks of 32: 2 held out, 20 to train on; 2 per batch, one rank and
    # one micro-batch per step: 10 inner steps an epoch
    text = tmp_path / "text.txt"
    text.write_text(("To be, or not to be, that is the question. " * 20)[:703])
    run_dir = tmp_path / "run"
    result = python_train([*FAST, "--dataset", str(text), "--total-batch-size", "2", "--epochs", "3",
                           "--run-dir", str(run_dir)])  # fmt: skip
    assert_ok(result)
    rows = metrics(run_dir)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 31))  # 3 epochs × 10 steps
    assert [r["epoch"] for r in train_rows][9::10] == [1.0, 2.0, 3.0] and train_rows[4]["epoch"] == 0.5
    assert [r["step"] for r in rows if "eval_loss" in r] == [10, 20, 30]  # one per epoch end, the last at the end
    assert summary(run_dir)["steps"] == 30
    assert "30 inner steps from step 0 (3 epochs of 10)" in result.output  # the banner says how it counted


def test_an_epoch_shorter_than_one_step_is_one_line(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("x" * 703)  # 20 training blocks: fewer than one step of 32 sequences
    result = python_train([*FAST, "--dataset", str(text), "--per-device-train-batch-size", "2",
                           "--total-batch-size", "32", "--epochs", "1", "--run-dir", str(tmp_path / "run")])  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.output
    assert result.stderr.startswith("error: --epochs: one pass over this group's share of --dataset"), result.stderr
    assert not (tmp_path / "run").exists()  # nothing written
