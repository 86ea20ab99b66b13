"""Calls that might hang, run in a thread so that a test fails instead of waiting for good."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def within(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a thread: its result, or what it raised, or a failure if it has not returned after
    ``seconds`` (the thread, a daemon, is left to its wait)."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still waits after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
