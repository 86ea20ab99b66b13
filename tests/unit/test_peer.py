"""One rank's ``SwarmPeer`` (``diloco.swarm.peer``) over stand-ins: how many groups it expects in a round, and the
status heartbeat that keeps a live group counted while its training loop sends nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

from diloco.swarm.records.arrivals import FLOOR_S, LAST_SLACK_S, STALE_S
from diloco.swarm.records.heartbeat import Heartbeat
from diloco.swarm.records.status import Status
from tests.support.records import record


def test_a_trainer_expects_the_groups_whose_status_records_are_not_stale() -> None:
    """Itself, the others whose record is not stale by the rule the wait for arrivals uses (``STALE_S``, plus two
    of their inner steps: none here, the records give no batch) and that have not left, and never fewer than its
    last round had."""
    from diloco.swarm.peer import SwarmPeer

    averager = SimpleNamespace(peer_id="me", matchmaking_time=5.0, averaging_timeout=20.0, target_group_size=4)
    peer = SwarmPeer(SimpleNamespace(), averager, "progress", 1.0, "status")
    now = time.time()
    records = [
        record(0, peer="me", heard_at=now - 100),  # itself, however stale its own record
        record(1, peer="b", heard_at=now - STALE_S + 2),  # a beat or two late: still coming
        record(2, peer="c", heard_at=now - STALE_S - 2),  # killed a while ago
        record(3, peer="d", heard_at=now - 1, state="finished"),  # left
    ]
    assert peer.expected_groups(records) == 2
    records.append(record(2, peer="c2", heard_at=now - 2, state="joining"))  # it restarted
    assert peer.expected_groups(records) == 3
    peer._last_peers = 4
    assert peer.expected_groups(records) == 4
    assert peer.expected_groups(None) == 4  # records unreadable: every group of the galaxy


def test_a_group_of_the_last_round_whose_record_went_stale_no_longer_holds_the_count_up() -> None:
    """The count never falls below the last round's (a DHT read that missed a record must not shrink it), but a
    group of that round whose record now says it is gone (stale: killed; or done) is taken off it: the first round
    after a death no longer waits out its whole wait for the dead group."""
    from diloco.swarm.peer import SwarmPeer
    from diloco.swarm.rounds.report import RoundReport

    expected: list[int] = []
    averager = SimpleNamespace(peer_id="me", matchmaking_time=5.0, averaging_timeout=20.0, target_group_size=3,
                               expect=lambda groups, wait: expected.append(groups))  # fmt: skip
    rounds = SimpleNamespace(average=lambda *a, **k: RoundReport(num_peers=3, seconds=0.1, bytes_sent=1,
                                                                 bytes_received=1, ok=True))  # fmt: skip
    peer = SwarmPeer(SimpleNamespace(), averager, "progress", 1.0, "status", rounds=rounds)
    now = time.time()
    alive = [record(0, peer="me", heard_at=now), record(1, peer="b", heard_at=now - 1),
             record(2, peer="c", heard_at=now - 1)]  # fmt: skip
    peer.status_records = lambda: alive  # type: ignore[method-assign]
    assert peer.average([], 1, 1.0, lambda: False).num_peers == 3 and expected == [3]
    assert peer.expected_groups(alive) == 3
    assert peer.expected_groups(alive[:2]) == 3  # group 2's record missed by a read: still counted
    dead = [*alive[:2], record(2, peer="c", heard_at=now - STALE_S - 2)]  # killed a while ago
    assert peer.expected_groups(dead) == 2
    done = [*alive[:2], record(2, peer="c", heard_at=now - 1, state="done")]
    assert peer.expected_groups(done) == 2
    back = [*dead, record(2, peer="c2", heard_at=now - 1, state="joining")]  # restarted: its old record is stale
    assert peer.expected_groups(back) == 3


def test_under_a_token_budget_the_last_round_waits_for_the_live_groups_whose_peers_answer() -> None:
    """Every group's round under a token budget is due at one moment: a round waits the floor for the others, but
    the run's last round (the outer loop says so) waits ``LAST_SLACK_S`` for them, as under fixed H: a group one
    busy step late there has no later round for its inner steps. A group whose peer does not answer, or that is
    done, is not waited for."""
    from diloco.swarm.peer import SwarmPeer

    averager = SimpleNamespace(peer_id="me", matchmaking_time=5.0, averaging_timeout=20.0, target_group_size=3)
    peer = SwarmPeer(SimpleNamespace(), averager, "progress", 1.0, "status", round_steps=None, wait_cap=3600.0)
    answering = {"b"}
    peer.alive = lambda peer_id: peer_id in answering  # type: ignore[method-assign]
    now = time.time()
    records = [record(0, peer="me", heard_at=now), record(1, peer="b", heard_at=now - 1, step=3, batch="2x32",
                                                              tokens_per_s=64.0)]  # fmt: skip
    assert peer.round_wait(records, 1) == FLOOR_S
    assert peer.round_wait(records, 2, last=True) == LAST_SLACK_S
    answering.clear()  # its peer is gone: a record alone does not hold the last round
    assert peer.round_wait(records, 2, last=True) == FLOOR_S
    answering.add("b")
    done = [records[0], record(1, peer="b", heard_at=now - 1, state="done")]
    assert peer.round_wait(done, 2, last=True) == FLOOR_S


def until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_heartbeat_resends_the_last_record_while_nothing_newer_goes_out() -> None:
    """Fresh times, the same step (the group sits where it is); a record the group sends itself postpones the next
    beat; nothing before the first record, nothing after `stop`."""
    published: list[Status] = []
    beat = Heartbeat(published.append, period=0.2)
    time.sleep(0.4)
    assert published == [] and beat._thread is None  # (rank 1 and up never send a record: no thread)
    first = record(0, heard_at=time.time(), step=7)
    beat.sent(first)
    until(lambda: len(published) >= 2)
    assert published[1].heard_at - published[0].heard_at >= 0.19  # one beat a period, not more
    assert all(r.step == 7 and r.heard_at > first.heard_at for r in published)
    assert [r.heard_at for r in published] == sorted(r.heard_at for r in published)
    newer = record(0, heard_at=time.time(), step=9)
    beat.sent(newer)
    before = len(published)
    time.sleep(0.1)
    assert len(published) == before  # the group's own record just went out
    until(lambda: published[-1].step == 9)
    beat.stop()
    stopped = len(published)
    time.sleep(0.4)
    assert len(published) == stopped and beat.beats == stopped


def test_a_joining_record_is_resent_as_it_is_so_it_outlives_its_expiry() -> None:
    """A join can outlast a status record's life (a large state download). Its record's time orders rival claims
    (``agreement.rival_model``), so it goes out again unchanged, at its own slower period; a record of a group that
    left is never re-sent."""
    published: list[Status] = []
    beat = Heartbeat(published.append, period=0.05, joining_period=0.3)
    joining = record(0, heard_at=time.time() - 100, state="joining")
    beat.sent(joining)
    time.sleep(0.2)
    assert published == []  # not at the training period
    until(lambda: len(published) >= 2)
    assert all(r == joining for r in published)  # its time kept
    beat.sent(record(0, heard_at=time.time(), state="stopped"))
    left = len(published)
    time.sleep(0.5)
    beat.stop()
    assert len(published) == left
