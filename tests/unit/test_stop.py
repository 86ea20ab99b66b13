"""The trainer's stop request: after the first step a signal asks for a stop at the next step boundary; during
start-up (nothing trained, nothing to save) it leaves at once."""

from __future__ import annotations

import signal

import pytest

from diloco.train.stop import StopRequest


def test_a_signal_during_start_up_leaves_at_once() -> None:
    stop = StopRequest()
    with pytest.raises(KeyboardInterrupt), stop.starting_up():
        stop._handle(signal.SIGTERM, None)
        pytest.fail("start-up went on after the signal")
    assert stop.requested and stop.during_startup and not stop.starting


def test_a_signal_before_start_up_is_heeded_when_it_begins() -> None:
    stop = StopRequest()
    stop._handle(signal.SIGINT, None)  # (between installing the handler and the start-up block)
    with pytest.raises(KeyboardInterrupt), stop.starting_up():
        pytest.fail("start-up began although a stop was asked for")
    assert stop.during_startup


def test_a_signal_after_start_up_only_asks_and_a_second_one_leaves() -> None:
    stop = StopRequest(echo_s=0.0)
    with stop.starting_up():
        pass
    stop._handle(signal.SIGTERM, None)
    assert stop.requested and not stop.during_startup  # the loop stops at its next step boundary
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGTERM, None)
