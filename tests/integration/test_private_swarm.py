"""A swarm made private with `--hv.swarm-key`, with real processes on loopback: the keyed groups average together;
a group without the key and one with another key, under the same run id and world ranks, never average with them,
never take their world ranks, and `diloco status` shows each swarm only to holders of its key."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.groups import finish, group_args, outer_rows, start_group
from tests.support.paths import DILOCO, ROOT
from tests.support.procs import child_env, summary


def keygen(path: Path) -> Path:
    done = subprocess.run([str(DILOCO), "keygen", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and str(path) in done.stdout, done.stderr
    return path


def status_json(peers: list[str], *extra: str) -> dict:
    done = subprocess.run([str(DILOCO), "status", "--hv.initial-peers", *peers, "--hv.run-id", "private", "--json",
                           *extra], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode in (0, 3), done.stderr
    return json.loads(done.stdout) if done.returncode == 0 else {"groups": []}


@pytest.mark.slow
def test_only_holders_of_the_key_meet(tmp_path: Path, dht_peer: list[str]) -> None:
    key, other = keygen(tmp_path / "swarm.key"), keygen(tmp_path / "other.key")
    steps = ["--max-steps", "15", "--hv.run-id", "private", "--hv.averaging-timeout", "10"]
    groups = {  # name: (world rank, key flags)
        "keyed0": (0, ["--hv.swarm-key", str(key)]),
        "keyed1": (1, ["--hv.swarm-key", str(key)]),
        "open": (0, []),  # world rank 0 of the keyed swarm too
        "other": (1, ["--hv.swarm-key", str(other)]),
    }
    logs = {name: tmp_path / f"{name}.log" for name in groups}
    procs = {name: start_group(group_args(rank, 2, dht_peer, tmp_path / name, *steps, *flags), logs[name])
             for name, (rank, flags) in groups.items()}  # fmt: skip
    finish(list(procs.values()), list(logs.values()), timeout=300)
    rows = {name: outer_rows(tmp_path / name) for name in groups}
    assert any(r.get("num_peers") == 2 for r in rows["keyed0"]), rows["keyed0"]
    for name in ("open", "other"):  # alone all along: nobody of their own swarm came
        assert rows[name] and all(r.get("num_peers", 1) <= 1 for r in rows[name]), (name, rows[name])
    finals = {name: summary(tmp_path / name)["params_sha256"] for name in groups}
    assert finals["keyed0"] == finals["keyed1"] and len(set(finals.values())) == 3
    said = logs["keyed0"].read_text() + logs["keyed1"].read_text()
    assert "is taken by a running worker group" not in said and "without a valid seal" not in said
    ranks = {
        "keyed": [g["world_rank"] for g in status_json(dht_peer, "--hv.swarm-key", str(key))["groups"]],
        "open": [g["world_rank"] for g in status_json(dht_peer)["groups"]],
    }
    assert ranks == {"keyed": [0, 1], "open": [0]}, ranks


def test_keygen_refuses_to_overwrite_and_status_a_bad_key(tmp_path: Path) -> None:
    key = keygen(tmp_path / "swarm.key")
    again = subprocess.run([str(DILOCO), "keygen", str(key)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and again.stderr.strip().startswith("error: ") and "exists" in again.stderr
    key.chmod(0o644)
    shown = subprocess.run([str(DILOCO), "status", "--hv.initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/"
                            "12D3KooWSShrJm4CSvrqkmVgos7VPu8p47kbbw2i8PgUB4EuDHv6", "--hv.swarm-key", str(key)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 2 and "--hv.swarm-key" in shown.stderr and "chmod 600" in shown.stderr, shown.stderr
    assert "Traceback" not in shown.stderr + again.stderr
