"""DHT records without a DHT: a status record with every field set, a progress record, a record's owned subkey, and a
dict that stands in for hivemind.DHT's store/get."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from diloco.swarm.records.progress import Progress
from diloco.swarm.records.status import Status

NOW = 1_800_000_000.0


def owned(world_rank: int, owner: str = "test") -> str:
    """A record's subkey as a group signs it (``diloco.swarm.records.ownership``), with a stand-in for its public key:
    the fake DHTs of unit tests check no signature."""
    return f"{world_rank}[owner:{owner}]"


def record(world_rank: int = 0, **changes: Any) -> Status:
    """A status record of a group training at step 25 of 30, heard 3 s before NOW; `changes` replace its fields."""
    fields: dict[str, Any] = {
        "world_rank": world_rank, "ranks": 2, "sharding": "FULL_SHARD", "state": "training", "step": 25,
        "max_steps": 30, "outer_step": 5, "tokens_per_s": 1234.4, "digest": "0123456789abcdef", "round_peers": 2,
        "round_at": NOW - 12, "heard_at": NOW - 3,
    }  # fmt: skip
    return Status(**fields | changes)


def progress_record(world_rank: int, token: str, peer: str, outer_step: int = 0, settled: bool = True) -> Progress:
    """A progress record of the group that started with `token` (its claim of `world_rank`), its DHT peer `peer`."""
    return Progress(world_rank=world_rank, outer_step=outer_step, step=0, digest="d", tainted=False,
                    settled=settled, token=token, peers=(peer,))  # fmt: skip


class FakeDHT:
    """hivemind.DHT's store/get over a dict: subkeys, latest values, nothing else."""

    def __init__(self) -> None:
        self.values: dict[str, dict[Any, Any]] = {}

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None, **kwargs: Any) -> bool:
        self.values.setdefault(key, {})[subkey] = SimpleNamespace(value=value, expiration_time=expiration_time)
        return True

    def get(self, key: str, latest: bool = False) -> Any:
        return SimpleNamespace(value=dict(self.values[key])) if key in self.values else None
