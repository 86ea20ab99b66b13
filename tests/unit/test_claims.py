"""World-rank claims and owned records, with the in-memory swarm: another owner's claim of a group's world rank is
ignored, logged once and counted, and a group's record key is kept (``diloco.outer.claims``,
``diloco.swarm.records.ownership``). That only its owner can change a group's record in real DHT peers is
tests/integration/test_claims.py's."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from diloco.outer.memory import MemorySwarm
from diloco.swarm.records.ownership import Owner
from tests.support.outer import diloco
from tests.support.records import progress_record as record

CLAIM_WARNING = "ignoring a record that claims this group's world rank 0"


def test_a_live_claim_of_a_held_world_rank_is_ignored_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """Group 0 holds world rank 0. A stranger (another owner, alive) publishes a record of rank 0 with the group's
    token copied; a dead group that held the rank before left its record. At every boundary the group rejects the
    stranger's claim (one warning, counted once) and not its dead predecessor's; its own record stays its own."""
    hub = MemorySwarm(1)
    net = torch.nn.Linear(2, 1)
    group = diloco(net, hub.member("g0"), lr=1.0, momentum=0.0, h=1, final_step=4)
    hub.member("old").publish(record(0, "old-token", "old"))  # never serves: dead
    group.claim_world_rank()
    group.join(0)
    stranger = hub.member("x")
    stranger.publish(record(0, group.token, "x"))
    stranger.serve_state(lambda: ({}, []))  # answers: alive
    with caplog.at_level(logging.WARNING, logger="diloco"):
        for step in (1, 2, 3):
            group.after_inner_step(step)
    warnings = [r.getMessage() for r in caplog.records if CLAIM_WARNING in r.getMessage()]
    assert len(warnings) == 1 and "owner x" in warnings[0], warnings
    assert group.summary()["rejected_claims"] == 1
    held = {r.owner: r for r in hub.member("g1").records() if r.world_rank == 0}
    assert set(held) == {"g0", "old", "x"} and held["g0"].token == group.token and held["g0"].outer_step == 3


def test_a_claim_before_the_group_holds_its_rank_is_a_rival_not_a_rejected_claim() -> None:
    """A live group already holding the world rank makes a newcomer leave (`Claims.rival`); nothing is counted."""
    hub = MemorySwarm(1)
    first = hub.member("first")
    first.publish(record(0, "t1", "first"))
    first.serve_state(lambda: ({}, []))
    newcomer = diloco(torch.nn.Linear(2, 1), hub.member("g0"), lr=1.0, momentum=0.0)
    assert newcomer.claims.rival() == "first"
    newcomer.claims.check(newcomer.swarm.records())
    assert newcomer.claims.rejected == 0


def test_a_live_group_that_misses_a_ping_is_still_a_rival() -> None:
    """On a loaded machine a live group's DHT can miss a ping (a newcomer with its world rank once trained in the
    suite): `rival` asks again, a moment later, before it takes the group for gone; a group that never answers is
    gone."""
    hub = MemorySwarm(1)
    first = hub.member("first")
    first.publish(record(0, "t1", "first"))
    first.serve_state(lambda: ({}, []))
    newcomer = diloco(torch.nn.Linear(2, 1), hub.member("g0"), lr=1.0, momentum=0.0)
    pings: list[str] = []
    answer = newcomer.swarm.alive

    def missing_twice(peer: str) -> bool:
        pings.append(peer)
        return len(pings) > 2 and answer(peer)

    newcomer.swarm.alive = missing_twice  # type: ignore[method-assign]
    newcomer.claims.gap_s = 0.2
    started = time.monotonic()
    assert newcomer.claims.rival() == "first" and pings == ["first"] * 3
    assert time.monotonic() - started >= 2 * 0.2  # the tries are apart
    pings.clear()
    newcomer.swarm.alive = lambda peer: pings.append(peer) is not None  # type: ignore[method-assign]  # never
    assert newcomer.claims.rival() is None and pings == ["first"] * 3


def test_a_groups_record_key_is_kept_once_it_holds_its_rank_and_read_back_on_resume(tmp_path) -> None:
    """`Owner.load` reads the run folder's key, or makes a new one that only `save` writes (mode 0600, never over
    an existing key); the same key means the same subkeys, so a resumed group replaces its own records."""
    path = tmp_path / "run" / "owner.key"
    fresh = Owner.load(path)
    assert not path.exists()  # a group refused at its start writes nothing
    fresh.save(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    resumed = Owner.load(path)
    assert resumed.id == fresh.id and resumed.subkey(3) == fresh.subkey(3) and resumed.subkey(3).startswith("3[owner:")
    Owner.ephemeral().save(path)  # another key is not written over it
    assert Owner.load(path).id == fresh.id
