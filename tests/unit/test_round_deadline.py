"""--hv.averaging-timeout: auto follows the group's recent rounds (``diloco.swarm.rounds.deadline``), a number is
today's fixed deadline; ``GroupRounds`` runs each round under rank 0's per-round value, on every rank."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from diloco.config import HvConfig
from diloco.swarm.rounds import group_round, hello, tcp
from diloco.swarm.rounds.deadline import (
    AUTO_CAP,
    DEFAULT_S,
    FLOOR_S,
    WINDOW,
    Deadlines,
    Measured,
    first_deadline,
    fixed_timeout,
    round_bytes,
    round_deadline,
)
from diloco.swarm.rounds.layout import Shape
from diloco.swarm.rounds.transfer import MIN_RATE

MIB = 2**20


def ok(seconds: float, deadline: float = 1000.0) -> Measured:
    return Measured(seconds, deadline, True)


def test_the_setting_is_auto_by_default_and_a_number_stays_one() -> None:
    assert HvConfig().averaging_timeout == "auto"
    assert HvConfig(averaging_timeout=30).averaging_timeout == 30.0
    with pytest.raises(ValueError):
        HvConfig(averaging_timeout=0)
    assert fixed_timeout("auto") == DEFAULT_S == 60.0  # joining, settling, matchmaking: today's default
    assert fixed_timeout(30.0) == 30.0


def test_auto_gives_a_first_round_the_default_plus_its_bytes_at_the_slowest_rate() -> None:
    assert MIN_RATE == MIB
    assert round_deadline("auto", 0, []) == DEFAULT_S
    assert round_deadline("auto", 600 * MIB, []) == pytest.approx(DEFAULT_S + 600)  # a big model's first round
    assert round_bytes([(1024, 256), (256,)]) == 4 * (1024 * 256 + 256)  # float32 values


def test_auto_follows_the_slowest_of_the_recent_rounds() -> None:
    assert round_deadline("auto", MIB, [ok(10.0), ok(12.5), ok(8.0)]) == pytest.approx(4 * 12.5)
    slow_then_fast = [ok(14.0)] + [ok(6.0)] * WINDOW  # the slow one left the window
    assert round_deadline("auto", MIB, slow_then_fast) == pytest.approx(4 * 6.0)
    assert round_deadline("auto", MIB, slow_then_fast[:WINDOW]) == pytest.approx(4 * 14.0)


def test_auto_keeps_a_floor_and_a_cap() -> None:
    assert round_deadline("auto", MIB, [ok(0.05)] * 3) == FLOOR_S  # a tiny model on a fast link
    first = first_deadline("auto", 100 * MIB)
    assert round_deadline("auto", 100 * MIB, [ok(10_000.0)]) == pytest.approx(AUTO_CAP * first)


def test_a_failed_round_lengthens_the_next_deadline_never_shortens_it() -> None:
    before = round_deadline("auto", MIB, [ok(10.0)])
    after_timeout = round_deadline("auto", MIB, [ok(10.0), Measured(before, before, False)])
    assert after_timeout == pytest.approx(2 * before)
    failed_fast = round_deadline("auto", MIB, [ok(10.0), Measured(0.5, before, False)])  # a refused connection
    assert failed_fast >= before
    repeated = [Measured(before, before, False)] * 20  # failures do not grow it without bound
    assert round_deadline("auto", MIB, repeated) <= AUTO_CAP * first_deadline("auto", MIB)


def test_a_number_is_every_rounds_deadline_whatever_the_rounds_did() -> None:
    for recent in ([], [ok(0.01)], [ok(500.0)], [Measured(30.0, 30.0, False)]):
        assert round_deadline(30.0, 10_000 * MIB, recent) == 30.0
    deadlines = Deadlines(30.0)
    deadlines.record(0.1, 30.0, True)
    assert deadlines.step_timeout(MIB) == 30.0 / tcp.ROUND_STEPS  # today's --hv.averaging-timeout / 4
    with pytest.raises(ValueError):
        Deadlines(-1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def rounds_with(monkeypatch: pytest.MonkeyPatch, *, rank: int, deadlines: Deadlines | None,
                durations: list[tuple[float, bool]], broadcast=lambda o: o):  # fmt: skip
    """A one-rank group (or rank `rank` of one, with `broadcast` standing in for rank 0's) whose matchmaking (a
    stand-in) always forms a round with one other group, and whose rounds (``run_round``, a stand-in) take
    `durations` (seconds on a fake clock, ok) in turn; returns it and the timeouts its rounds ran under."""
    clock, timeouts = Clock(), []
    monkeypatch.setattr(group_round, "time", clock)

    def run_round(info, rank, shapes, vector, out, *, timeout, **_):
        timeouts.append(timeout)
        seconds, done = durations[len(timeouts) - 1]
        clock.now += seconds
        return group_round.Outcome(done, 0, 0, 0, "" if done else "timed out")

    monkeypatch.setattr(group_round, "run_round", run_round)
    from diloco.swarm.rounds.matchmaker import Match
    from diloco.swarm.rounds.report import RoundReport

    other = {"shape": ["FULL_SHARD", 1, 1], "endpoints": [[["127.0.0.1"], 2]], "weight": 1.0,
             "keys": [hello.public_bytes(Ed25519PrivateKey.generate()).hex()]}  # fmt: skip
    matcher = SimpleNamespace(match=lambda round_index, mine, stop: (Match(b"g" * 20, [mine, other], 0),
                                                                     RoundReport(2, 0.0, 0, 0, True)))  # fmt: skip
    rounds = group_round.GroupRounds(
        matcher if rank == 0 else None, rank=0, shape=Shape("FULL_SHARD", 1), model_shapes=[(MIB // 4,)],
        endpoints=[(("127.0.0.1",), 1)], broadcast=broadcast, listener=SimpleNamespace(in_round=contextlib.nullcontext),
        codec=tcp.RAW, timeout=1.0, replicas=None, deadlines=deadlines,
    )  # fmt: skip
    return rounds, timeouts


def average(rounds, index: int):
    import torch

    return rounds.average([torch.zeros(MIB // 4)], index, 1.0, lambda: False)


def test_group_rounds_run_each_round_under_rank_0s_deadline_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    durations = [(3.0, True), (2.0, True), (30.0, True), (200.0, False), (1.0, True)]
    rounds, timeouts = rounds_with(monkeypatch, rank=0, deadlines=Deadlines("auto"), durations=durations)
    reports = [average(rounds, i) for i in range(len(durations))]
    assert [r.ok for r in reports] == [d for _, d in durations]
    assert reports[0].allreduce_seconds == pytest.approx(3.0)
    first = DEFAULT_S + 1  # a round of 1 MiB at 1 MiB/s
    steps = [first, max(4 * 3.0, FLOOR_S), max(4 * 3.0, FLOOR_S), 4 * 30.0, min(2 * 4 * 30.0, AUTO_CAP * first)]
    assert timeouts == pytest.approx([s / tcp.ROUND_STEPS for s in steps])


def test_group_rounds_under_a_number_run_every_round_under_it(monkeypatch: pytest.MonkeyPatch) -> None:
    durations = [(0.1, True), (0.1, True), (29.0, False)]
    rounds, timeouts = rounds_with(monkeypatch, rank=0, deadlines=Deadlines(30.0), durations=durations)
    for i in range(len(durations)):
        average(rounds, i)
    assert timeouts == [7.5, 7.5, 7.5]


def test_a_groups_other_ranks_run_the_round_under_the_timeout_rank_0_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = []

    def broadcast(found):  # rank 0's objects, as they reach this rank
        assert found is None  # this rank does no matchmaking
        member = group_round.Member(Shape("FULL_SHARD", 1), ((("127.0.0.1",), 1),), 1.0, (b"k" * 32,))
        sent.append((group_round.RoundInfo(b"g" * 20, (member, member), 1), 2, True, False, 12.5))
        return sent[-1]

    rounds, timeouts = rounds_with(monkeypatch, rank=1, deadlines=None, durations=[(1.0, True)], broadcast=broadcast)
    assert average(rounds, 0).ok and timeouts == [12.5]


def test_a_step_given_up_as_its_group_formed_ends_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """hivemind 1.1.12 sets the result of a step the caller has just cancelled, and its task ends with
    InvalidStateError, which asyncio prints as a traceback in the trainer's output: the matchmaker's averager ends
    that step quietly instead. Any other error still ends the task."""
    import asyncio
    from concurrent.futures import InvalidStateError

    import hivemind

    from diloco.swarm.rounds.matchmaker import ExactAverager

    raised: list[BaseException] = []

    async def hivemind_step(self, **kwargs) -> None:
        raise raised[-1]

    monkeypatch.setattr(hivemind.DecentralizedAverager, "_step", hivemind_step)
    averager = object.__new__(ExactAverager)  # (no process: the coroutine alone)
    averager._parent_pid = -1  # (its __del__ then stops no process)
    raised.append(InvalidStateError("Can't set_result to a future that is CANCELLED"))
    assert asyncio.run(averager._step(step=None, future_for_init=None)) is None
    raised.append(KeyError("another"))
    with pytest.raises(KeyError):
        asyncio.run(averager._step(step=None, future_for_init=None))
