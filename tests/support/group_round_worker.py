"""One rank of a worker group in a cross-shape round, for `tests/integration/test_group_round.py`: no hivemind, the
round's members meet through files (each rank writes its TCP endpoint and public key, then waits for everyone's).

Usage: [torchrun --nproc-per-node W] tests/support/group_round_worker.py DIR GROUP GROUPS...
GROUPS: every group's STRATEGY:W:NODES, in round order (HYBRID_SHARD's nodes: ranks of one machine stand in). Group g trains canonical vector randn(seed g) and weighs 1 + g.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from diloco.swarm.rounds import tcp
from diloco.swarm.rounds.group_round import Member, Replicas, RoundInfo, run_round
from diloco.swarm.rounds.hello import public_bytes
from diloco.swarm.rounds.layout import Shape, group_layout
from diloco.swarm.rounds.listener import Listener, listen_socket

MODEL_SHAPES = [(200, 16), (16,), (90, 16), (7,), (1, 4), (3, 5, 2)]  # (1, 4): an empty shard at 2 ranks
GROUP_ID = b"a test round's secret group id.."
TIMEOUT_S = 60.0


def canonical(group: int) -> torch.Tensor:
    total = sum(int(torch.Size(s).numel()) for s in MODEL_SHAPES)
    return torch.randn(total, generator=torch.Generator().manual_seed(group))


def sharded(full: torch.Tensor, shape: Shape) -> torch.nn.Module:
    """A module whose parameters (MODEL_SHAPES, in order) hold `full`, sharded by FSDP2 as the trainer does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module, offset = torch.nn.Module(), 0
    for i, dims in enumerate(MODEL_SHAPES):
        numel = int(torch.Size(dims).numel())
        module.register_parameter(f"p{i}", torch.nn.Parameter(full[offset : offset + numel].reshape(dims).clone()))
        offset += numel
    if shape.strategy == "NO_SHARD":
        mesh = init_device_mesh("cpu", (shape.world_size, 1), mesh_dim_names=("replicate", "shard"))
    elif shape.strategy == "HYBRID_SHARD":  # as diloco.parallel.build_mesh: replicated across nodes
        per_node = shape.world_size // shape.nodes
        mesh = init_device_mesh("cpu", (shape.nodes, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (shape.world_size,), mesh_dim_names=("shard",))
    fully_shard(module, mesh=mesh)
    return module


def wait_for(paths: list[Path], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)


def main(folder: Path, group: int, shape: Shape, groups: list[Shape]) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if shape.world_size > 1:
        dist.init_process_group("gloo")
    replicas = Replicas(shape, rank) if shape.world_size > 1 else None
    layout = group_layout(MODEL_SHAPES, shape)[rank]
    full = canonical(group)
    vector = torch.cat([full[p.start : p.stop] for p in layout.held])
    if shape.world_size > 1:  # the layout is FSDP2's: the local shards of a module that holds `full`, sharded
        local = torch.cat([p.to_local().reshape(-1) for p in sharded(full, shape).parameters()])
        assert torch.equal(local, vector), f"rank {rank}: FSDP2's local shards are not the layout's"
    out = torch.full_like(vector, float("nan"))
    # announced only now, ready to run the round: the groups start seconds apart under load (torchrun, FSDP2), and
    # what is tested here is the round, not its timeouts (generous ones: a groupmate is waited for, not dropped)
    listener = Listener(listen_socket("127.0.0.1", 0), TIMEOUT_S).start()
    signer = Ed25519PrivateKey.generate()
    mine = folder / f"endpoint-{group}-{rank}.json"
    mine.with_suffix(".tmp").write_text(json.dumps([listener._sock.getsockname()[1], public_bytes(signer).hex()]))
    mine.with_suffix(".tmp").rename(mine)  # whole or not at all
    everyone = [[folder / f"endpoint-{g}-{r}.json" for r in range(s.world_size)] for g, s in enumerate(groups)]
    wait_for([p for paths in everyone for p in paths])
    announced = [[json.loads(p.read_text()) for p in paths] for paths in everyone]  # per group, (port, key) per rank
    members = tuple(
        Member(s, tuple((("127.0.0.1",), port) for port, _ in ranks), 1.0 + g,
               tuple(bytes.fromhex(key) for _, key in ranks))
        for g, (s, ranks) in enumerate(zip(groups, announced))
    )  # fmt: skip
    outcome = run_round(RoundInfo(GROUP_ID, members, group), rank, MODEL_SHAPES, vector, out, listener=listener,
                        codec=tcp.RAW, timeout=TIMEOUT_S, signer=signer)  # fmt: skip
    if replicas is not None:
        replicas.fill(out)
    listener.close()
    held = [(p.start, p.stop, p.local) for p in layout.held]
    result = {"ok": outcome.ok, "error": outcome.error, "out": out, "held": held, "bytes_sent": outcome.bytes_sent}
    torch.save(result, folder / f"result-{group}-{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    folder, group, *all_groups = sys.argv[1:]
    shapes = [Shape(strategy, int(size), int(nodes)) for strategy, size, nodes in (s.split(":") for s in all_groups)]
    main(Path(folder), int(group), shapes[int(group)], shapes)
