"""One rank's ``SwarmPeer`` (``diloco.swarm.peer``) over stand-ins: how many groups it expects in a round."""

from __future__ import annotations

import time

from tests.support.records import record


def test_a_trainer_expects_the_groups_whose_status_records_are_fresh() -> None:
    """Itself, the others heard from within two heartbeats and a failed round (5 + 20 s here) that have not left,
    and never fewer than its last round had."""
    from types import SimpleNamespace

    from diloco.swarm.peer import SwarmPeer

    averager = SimpleNamespace(peer_id="me", matchmaking_time=5.0, averaging_timeout=20.0, target_group_size=4)
    peer = SwarmPeer(SimpleNamespace(), averager, "progress", 1.0, "status")
    now = time.time()
    records = [
        record(0, peer="me", heard_at=now - 100),  # itself, however stale its own record
        record(1, peer="b", heard_at=now - 30),  # a failed round ago: still coming
        record(2, peer="c", heard_at=now - 40),  # killed a while ago
        record(3, peer="d", heard_at=now - 1, state="finished"),  # left
    ]
    assert peer.expected_groups(records) == 2
    records.append(record(2, peer="c2", heard_at=now - 2, state="joining"))  # it restarted
    assert peer.expected_groups(records) == 3
    peer._last_peers = 4
    assert peer.expected_groups(records) == 4
    assert peer.expected_groups(None) == 4  # records unreadable: every group of the galaxy
