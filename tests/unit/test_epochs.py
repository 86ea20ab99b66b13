"""Training by epochs (`--epochs N`): the flags it does not go with, one line each, parsed in process."""

from __future__ import annotations

import pytest

from tests.support.parse import usage_error


@pytest.mark.parametrize(
    "argv, said",
    [
        ("--dataset d.txt --epochs 2 --max-steps 5", "either --epochs or --max-steps"),
        ("--dataset d.txt --epochs 2 --total-steps 5", "either --epochs or --max-steps"),
        ("--fake-data --epochs 2", "--epochs needs --dataset"),
        ("--dataset d.txt --epochs 0", "--epochs"),
    ],
)
def test_epochs_with_a_step_count_or_fake_data_is_a_usage_error(
    argv: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in usage_error(["--path-model", "m", *argv.split()], capsys)
