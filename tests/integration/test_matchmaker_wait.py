"""A round's own matchmaking wait (``Matchmaker.match(wait=...)``), with real DHTs and averager processes on 127.0.0.1.

A round may wait longer than ``matchmaking_time`` for a group known to be coming, or shorter when nobody is expected,
and still closes as soon as the expected peers are in.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import hivemind
import pytest

from diloco.swarm.records.dht import start_dht, visible_maddrs
from diloco.swarm.rounds.matchmaker import Match, Matchmaker
from diloco.swarm.rounds.report import RoundReport
from tests.support.dht import LOCAL, shutdown_dht

SLACK_S = 4.0  # on top of a round's expected length: DHT look-ups, averager round trips, a loaded machine


@contextlib.contextmanager
def matchmakers(bootstrap: hivemind.DHT, count: int, **kwargs) -> Iterator[list[Matchmaker]]:
    """``count`` Matchmakers, each on its own DHT peer of ``bootstrap``'s swarm; all shut down at the end, no p2pd
    daemon left."""
    dhts: list[hivemind.DHT] = []
    made: list[Matchmaker] = []
    survivors: list[int] = []
    try:
        for _ in range(count):
            dhts.append(start_dht(initial_peers=visible_maddrs(bootstrap), host_maddrs=LOCAL, announce_maddrs=[]))
            made.append(Matchmaker(dhts[-1], averaging_timeout=10.0, **kwargs))
        yield made
    finally:
        for matchmaker in made:
            matchmaker.shutdown()
        for dht in dhts:
            survivors += shutdown_dht(dht)
    assert survivors == []


def match_in_thread(matchmaker: Matchmaker, round_index: int, gather: object, wait: float | None):
    """Start ``matchmaker.match`` in a thread; returns (the thread, a list that gets (match, report, seconds))."""
    out: list[tuple[Match | None, RoundReport, float]] = []

    def run() -> None:
        started = time.monotonic()
        match, report = matchmaker.match(round_index, gather, wait=wait)
        out.append((match, report, time.monotonic() - started))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def assert_one_group_of_two(a: Match | None, b: Match | None, ra: RoundReport, rb: RoundReport) -> None:
    assert a is not None and b is not None, (ra, rb)
    assert ra.ok and rb.ok and ra.num_peers == rb.num_peers == 2, (ra, rb)
    assert len(a.gathered) == len(b.gathered) == 2 and a.gathered == b.gathered
    assert sorted(a.gathered) == ["a", "b"]
    assert a.group_id == b.group_id != b"" and a.peers == b.peers and len(set(a.peers)) == 2
    assert {a.index, b.index} == {0, 1} and a.gathered[a.index] == "a" and b.gathered[b.index] == "b"


def test_a_round_waits_its_own_time_and_closes_once_the_expected_peers_are_in(bootstrap):
    """Default wait 3 s (a lone round gives up after 4.5 s). Round 1: A waits 20 s for a group known to be coming,
    B comes 5 s later with a wait of 8 s: they match as soon as B is in (B leads: its wait ends first), well before
    B's 8 s and A's 20 s, and long after A would have given up on the default wait. (B's wait leaves a loaded
    machine's DHT look-ups time to find A: with 2 s, B gave up alone under CI load.) Round 2: A waits 20 s, B a second later
    waits 30 s and expects more peers than come: A leads (its wait ends first) and closes at once on its own
    ``expect(2)``; had B's 30 s been ignored, B's 3 s would have ended first and B would lead and wait them out."""
    with matchmakers(bootstrap, 2, prefix="own-wait", matchmaking_time=3.0) as (a, b):
        a.expect(2)
        b.expect(2)
        thread, out_a = match_in_thread(a, 1, "a", wait=20.0)
        time.sleep(5.0)
        started_b = time.monotonic()
        match_b, report_b = b.match(1, "b", wait=8.0)
        seconds_b = time.monotonic() - started_b
        thread.join(timeout=40)
        assert out_a, "A's match did not return"
        (match_a, report_a, seconds_a) = out_a[0]
        assert_one_group_of_two(match_a, match_b, report_a, report_b)
        assert 4.8 <= seconds_a < 5.0 + SLACK_S, seconds_a  # it waited for B, past the default 3 + 1.5 s
        assert seconds_b < SLACK_S, seconds_b  # well before B's own wait ran out: closed once both were in

        b.expect(8)  # B alone would wait its whole 30 s for more
        thread, out_a = match_in_thread(a, 2, "a", wait=20.0)
        time.sleep(1.0)
        started_b = time.monotonic()
        match_b, report_b = b.match(2, "b", wait=30.0)
        seconds_b = time.monotonic() - started_b
        thread.join(timeout=40)
        assert out_a, "A's match did not return"
        (match_a, report_a, seconds_a) = out_a[0]
        assert_one_group_of_two(match_a, match_b, report_a, report_b)
        assert seconds_b < 2.0, seconds_b  # B joined A (ends first), which closed at once on its expect(2)
        assert seconds_a < 1.0 + 2.0, seconds_a


def test_a_round_short_of_its_expected_peers_forms_when_its_own_wait_ends(bootstrap):
    """Two peers that expect three (default wait 4 s): the group of two forms when the leader's wait ends, whether
    that wait is longer (8 s: not at 4 s) or shorter (2.5 s: in time, where a round still waiting the default 4 s in
    hivemind would be given up, without a match, after 2.5 + 1.25 s). B starts 0.2 s after A: either may lead, and
    a follower's grace must outlast the leader's wait (with 1.5 s and B 0.5 s later, B led and formed the group the
    moment A gave up, under CI's load)."""
    with matchmakers(bootstrap, 2, prefix="short-of-peers", matchmaking_time=4.0) as (a, b):
        a.expect(3)
        b.expect(3)
        for index, wait in ((1, 8.0), (2, 2.5)):
            thread, out_a = match_in_thread(a, index, "a", wait=wait)
            time.sleep(0.2)
            match_b, report_b = b.match(index, "b", wait=wait)
            thread.join(timeout=40)
            assert out_a, "A's match did not return"
            (match_a, report_a, seconds_a) = out_a[0]
            assert_one_group_of_two(match_a, match_b, report_a, report_b)
            assert wait - 0.1 <= seconds_a < wait + SLACK_S, (wait, seconds_a)


def test_a_lone_round_with_a_short_wait_gives_up_after_it(bootstrap):
    """Nobody else: a round told to wait 2 s on a Matchmaker whose default is 10 s gives up after about 2 s plus its
    grace (3 s, capped at half of the round's wait: 1 s), not 10 + 3 s."""
    with matchmakers(bootstrap, 1, prefix="short-wait", matchmaking_time=10.0, grace=3.0) as (lone,):
        started = time.monotonic()
        match, report = lone.match(1, "alone", wait=2.0)
        seconds = time.monotonic() - started
    assert match is None and report.ok and report.num_peers == 1, report
    assert 2.0 + 1.0 - 0.1 <= report.seconds < 2.0 + 1.0 + SLACK_S, report  # when it gave up
    assert report.seconds <= seconds < report.seconds + 10.0 + SLACK_S, seconds  # the averager's search wound down


def test_the_wait_goes_to_the_averager_only_when_it_changed_and_none_restores_the_default(bootstrap):
    """A lone Matchmaker with a default of 1.5 s (grace 3 s, capped at 0.75 s): rounds that wait None, 3, 3, None
    give up after about 2.25, 4.5, 4.5 and 2.25 s; the averager process is told the wait twice (3 s, then 1.5 s
    again). Each round begins once the last one's search ended in the averager process, so its whole wait is its
    own (a search still winding down would hold the next one back by seconds under load)."""
    with matchmakers(bootstrap, 1, prefix="restore-wait", matchmaking_time=1.5, grace=3.0) as (lone,):
        told: list[float] = []
        tell = lone._averager.set_matchmaking_time

        def counting(seconds: float) -> None:
            told.append(seconds)
            tell(seconds)

        lone._averager.set_matchmaking_time = counting
        rounds = []
        for index, wait in enumerate([None, 3.0, 3.0, None]):
            match, report = lone.match(index, "alone", wait=wait)
            rounds.append((match, report, report.seconds, list(told)))
    assert all(match is None and report.ok and report.num_peers == 1 for match, report, _, _ in rounds), rounds
    assert [sent for _, _, _, sent in rounds] == [[], [3.0], [3.0], [3.0, 1.5]]
    seconds = [s for _, _, s, _ in rounds]
    assert all(2.25 - 0.1 <= seconds[i] < 4.5 - 0.1 for i in (0, 3)), seconds  # shorter than any 3 s round
    assert all(4.5 - 0.1 <= seconds[i] < 4.5 + SLACK_S for i in (1, 2)), seconds


def test_a_wait_that_is_not_positive_seconds_is_refused(bootstrap):
    with matchmakers(bootstrap, 1, prefix="bad-wait", matchmaking_time=1.0) as (lone,):
        for wait in (0.0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="positive"):
                lone.match(1, "alone", wait=wait)
        match, report = lone.match(1, "alone", wait=0.5)  # refused waits left the Matchmaker as it was
    assert match is None and report.ok and report.num_peers == 1, report
