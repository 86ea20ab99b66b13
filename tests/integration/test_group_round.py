"""A round of worker groups of different shapes (`diloco.swarm.rounds.group_round`) in real processes: a 1-rank group, a
2-rank NO_SHARD group and a 4-rank HYBRID_SHARD group of two "nodes" (torchrun, gloo; two shards, each replicated
twice), over TCP on loopback, end bit-identical."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.support.group_round_worker import MODEL_SHAPES, canonical
from tests.support.paths import ROOT, TORCHRUN
from tests.support.procs import child_env

GROUPS = [("FULL_SHARD", 1, 1), ("NO_SHARD", 2, 1), ("HYBRID_SHARD", 4, 2)]


def start(folder: Path, group: int, size: int) -> subprocess.Popen[bytes]:
    worker = ["tests/support/group_round_worker.py", str(folder), str(group), *(f"{s}:{w}:{n}" for s, w, n in GROUPS)]
    launch = [sys.executable] if size == 1 else [str(TORCHRUN), "--standalone", f"--nproc-per-node={size}"]
    log = (folder / f"group-{group}.log").open("wb")
    env = child_env() | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen([*launch, *worker], cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True)


def test_groups_of_three_shapes_end_bit_identical_and_replicas_complete_each_other(tmp_path: Path) -> None:
    procs = [start(tmp_path, g, size) for g, (_, size, _) in enumerate(GROUPS)]
    try:
        deadline = time.monotonic() + 180
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        logs = {g: (tmp_path / f"group-{g}.log").read_text(errors="replace")[-2000:] for g in range(len(GROUPS))}
        assert all(p.returncode == 0 for p in procs), logs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    total = sum(int(torch.Size(s).numel()) for s in MODEL_SHAPES)
    weights = [1.0 + g for g in range(len(GROUPS))]
    expected = sum(w * canonical(g).double() for g, w in enumerate(weights)) / sum(weights)
    models = []
    for g, (_, size, _) in enumerate(GROUPS):
        model = torch.full((total,), float("nan"))
        for rank in range(size):
            result = torch.load(tmp_path / f"result-{g}-{rank}.pt")
            assert result["ok"], result["error"]
            for start_, stop, local in result["held"]:  # every value a rank holds is averaged, replicas' too
                values = result["out"][local : local + stop - start_]
                assert not values.isnan().any(), (g, rank)
                if not model[start_:stop].isnan().all():
                    assert torch.equal(model[start_:stop], values), (g, rank)  # replicas agree bit for bit
                model[start_:stop] = values
        models.append(model)
    assert not models[0].isnan().any()
    assert all(torch.equal(models[0], m) for m in models[1:])  # every group holds the same bytes
    assert float((models[0].double() - expected).abs().max()) <= 1e-6
