"""The unit tier starts no process: inside a unit test, starting one (subprocess, fork, spawn, multiprocessing, and so
a DHT, p2pd or torchrun) raises, and a start that the code under test caught and hid still fails the test. Such a
test belongs in tests/integration."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

STARTS_NO_PROCESS = "a unit test starts no process: move it to tests/integration"
SPAWNS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "spawnl", "spawnle", "spawnlp", "spawnlpe",
          "spawnv", "spawnve", "spawnvp", "spawnvpe")  # fmt: skip
CALL_FAILED = pytest.StashKey[bool]()
UNIT_TIMEOUT_S = 300  # a unit test takes seconds: one that hangs (threads, sockets) fails long before the suite's 1200


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.fixture(autouse=True)
def starts_no_process(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[None]:
    tried: list[str] = []

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            tried.append(what)
            raise AssertionError(f"{STARTS_NO_PROCESS} ({what})")

        return refused

    class RefusedPopen(subprocess.Popen):
        """Starts nothing; a subclass, so that `isinstance` checks and subclasses of Popen still work."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse("subprocess.Popen")()

    monkeypatch.setattr(subprocess, "Popen", RefusedPopen)
    for name in SPAWNS:
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name}"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing.Process.start"))
    yield
    if tried and not request.node.stash.get(CALL_FAILED, False):  # raised in the test, but caught and hidden
        pytest.fail(f"{STARTS_NO_PROCESS} (it tried {', '.join(tried)})", pytrace=False)
