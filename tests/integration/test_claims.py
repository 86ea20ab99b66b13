"""Owned records in real DHT peers on loopback: a group's record can be changed by its owner only
(``diloco.swarm.records.ownership``). The claims of a world rank are tests/unit/test_claims.py's."""

from __future__ import annotations

import dataclasses
import time

from diloco.swarm.records import progress
from diloco.swarm.records.ownership import Owner
from tests.support.hostile_peer import Lenient
from tests.support.records import progress_record as record


def test_only_its_owner_can_change_a_groups_record_in_the_dht() -> None:
    """Real DHT peers: group 0's peer (its owner key in its validator) and a stranger's peer that signs its own
    records and checks nobody's. The stranger stores group 0's record again, altered, under group 0's subkey with a
    later expiry, and the same under a subkey without an owner: group 0's peer keeps its own record and reads no
    other, whichever peer answers; the stranger's own record of rank 0 reads back as a claim of its own."""
    from diloco.swarm.records.dht import start_dht, visible_maddrs

    loopback = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "announce_maddrs": []}
    owner, stranger = Owner.ephemeral(), Owner.ephemeral()
    honest = start_dht(initial_peers=[], validator=owner.validator, **loopback)
    attacker = None
    try:
        attacker = start_dht(initial_peers=visible_maddrs(honest), validator=Lenient(stranger.validator._private_key),
                             **loopback)  # fmt: skip
        key, mine = "run-groups-progress", record(0, "t0", honest.peer_id.to_base58(), outer_step=5)
        progress.publish(honest, key, mine, owner.subkey(0))
        found = attacker.get(key, latest=True)
        expires = found.value[owner.subkey(0)].expiration_time
        forged = dataclasses.replace(mine, outer_step=10**6).to_dict()
        attacker.store(key, subkey=owner.subkey(0), value=forged, expiration_time=expires + 3600)
        attacker.store(key, subkey="0", value=forged, expiration_time=expires + 3600)
        progress.publish(attacker, key, record(0, "t0", attacker.peer_id.to_base58()), stranger.subkey(0))
        time.sleep(1.0)
        read = {r.owner: r for r in progress.read(honest, key)}
        assert set(read) == {owner.id, stranger.id}, read
        assert read[owner.id].outer_step == 5 and read[stranger.id].outer_step == 0
        # the attacker's own peer took the altered record (it checks nothing), and hands it out; a reader's
        # peer drops it for its signature
        assert attacker.get(key, latest=True).value[owner.subkey(0)].value["outer_step"] == 10**6
    finally:
        for dht in (attacker, honest):
            if dht is not None:
                dht.shutdown()
