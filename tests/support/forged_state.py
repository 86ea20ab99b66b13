"""A stranger in an open swarm that serves a forged state under the digest of the real one.

It waits for the progress record of the group that holds TARGET's world rank, then, for SECONDS seconds, keeps a
settled record of its own (world rank WORLD_RANK, signed by its own key, as anyone can) that claims the target's
digest at an outer step ``LEAD`` ahead of the target's: the record every group ranks first. Its listener answers
every state download, through the repository's own state service, with a forged state (the model's initial
parameters plus ``SHIFT``) whose metadata is self-consistent: the outer step its record claims and the forged
values' own digest (``diloco.swarm.rounds.digest``), so the values add up to the digest they are served with. It
prints a line when it publishes and for every download it answers.

Usage: python -m tests.support.forged_state MODEL_DIR RUN_ID TARGET WORLD_RANK SECONDS INITIAL_PEER...
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import torch

from diloco.model import load_model
from diloco.swarm.records import progress
from diloco.swarm.records.addresses import announced_hosts
from diloco.swarm.records.dht import start_dht
from diloco.swarm.records.fingerprint import model_id, run_key
from diloco.swarm.records.ownership import Owner
from diloco.swarm.records.progress import Progress
from diloco.swarm.rounds import transfer
from diloco.swarm.rounds.digest import CanonicalDigest
from diloco.swarm.rounds.layout import Shape, group_layout
from diloco.swarm.rounds.listener import Listener, listen_socket

LEAD = 1000  # outer steps its record claims ahead of the target's
SHIFT = 5.0  # added to every initial parameter: a state no honest group ever holds
REQUEST_TIMEOUT_S = 10.0


def forged_state(module: torch.nn.Module, shapes: list[tuple[int, ...]]) -> tuple[torch.Tensor, str]:
    """The forged outer parameters (a one-rank group's buffer: the canonical vector) and their own digest."""
    values = torch.cat([p.detach().reshape(-1).float() for p in module.parameters()]) + SHIFT
    (layout,) = group_layout(shapes, Shape("FULL_SHARD", 1))
    digest = CanonicalDigest(shapes, layout)
    return values, digest.combine([digest.partial(values)])


def target_record(dht, key: str, target: int) -> Progress:
    """The settled record of world rank `target`, once there is one."""
    while True:
        found = [r for r in progress.read(dht, key) if r.world_rank == target and r.settled]
        if found:
            return found[0]
        time.sleep(0.5)


def main(model_dir: str, run_id: str, target: int, world_rank: int, seconds: float, peers: list[str]) -> None:
    module = load_model(Path(model_dir), seed=0)
    shapes = [tuple(p.shape) for p in module.parameters()]
    values, own_digest = forged_state(module, shapes)
    owner = Owner.ephemeral()
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                    validator=owner.validator)  # fmt: skip
    key = progress.progress_key(run_key(run_id, model_id(module.named_parameters())))
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    listener = Listener(sock, REQUEST_TIMEOUT_S).start()
    answered = [0]
    try:
        print(f"watching for the record of group {target}", flush=True)
        real = target_record(dht, key, target)
        claimed = real.outer_step + LEAD
        meta = {"outer_step": claimed, "step": real.step, "digest": own_digest, "tainted": False,
                "world_rank": world_rank}  # fmt: skip

        def serve() -> transfer.State:
            answered[0] += 1
            print(f"answered state download {answered[0]} with the forged state", flush=True)
            return dict(meta), [values]

        (layout,) = group_layout(shapes, Shape("FULL_SHARD", 1))
        service = transfer.StateService(layout, serve, REQUEST_TIMEOUT_S)
        listener.serve(service.magic, service)
        hosts = announced_hosts(dht.get_visible_maddrs())
        record = Progress(world_rank=world_rank, outer_step=claimed, step=real.step, digest=real.digest, tainted=False,
                          settled=True, token=uuid.uuid4().hex, peers=(dht.peer_id.to_base58(),),
                          shape=("FULL_SHARD", 1, 1), endpoints=([hosts, port],))  # fmt: skip
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            progress.publish(dht, key, record, owner.subkey(world_rank))
            print(f"published a record of outer step {claimed} with group {target}'s digest {real.digest[:8]}; "
                  f"serving digest {own_digest[:8]}", flush=True)  # fmt: skip
            time.sleep(2.0)
    finally:
        listener.close()
        dht.shutdown()


if __name__ == "__main__":
    model, run, target, rank, seconds, *initial = sys.argv[1:]
    main(model, run, int(target), int(rank), float(seconds), initial)
