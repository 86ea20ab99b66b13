"""Metrics sinks read back by a real TensorBoard server."""

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

from diloco import procs
from tests.support.tensorboard import TAGS, log_rows

TENSORBOARD = Path(sys.executable).parent / "tensorboard"


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
