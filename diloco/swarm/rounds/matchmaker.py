"""Matchmaking: rank 0 of each worker group finds the other groups that average the same round, through hivemind.

Once per round a group's rank 0 enters hivemind's matchmaking under the run's prefix and the round's index, with
what its group brings (its shape, its ranks' endpoints, its weight: ``diloco.swarm.rounds.group_round``). hivemind
forms the group, gives it a secret id and gathers every member's announcement in one order for all; no tensor byte
moves through hivemind. The ranks of the groups then average among themselves (``group_round``). A lone group, one
that gives up or is stopped, gets no match and a ``RoundReport`` that says so; nothing here raises on the network.
A round waits for groupmates ``matchmaking_time`` or the wait its caller gives (``Matchmaker.match``), and closes
as soon as the expected groups are in (``Matchmaker.expect``).

Matchmaking runs in a background process (``ExactAverager``, a hivemind ``DecentralizedAverager`` that shares the
rank's DHT daemon). Its class name is part of its RPC names, so it stays ``ExactAverager``: groups of earlier versions
of diloco matchmake with it. hivemind is pinned to 1.1.12; this module relies on these private names of
``DecentralizedAverager``: ``_run_allreduce_inplace_`` (called once per all-reduce attempt once a group formed),
``_step`` (the coroutine of one step, run as a task in the averager process),
``_running_groups`` (a future per group whose result must offer ``finalize`` and ``rpc_aggregate_part``),
``_matchmaking`` (its ``target_group_size``, ``min_matchmaking_time`` and ``request_timeout``, and its
``potential_leaders``' ``target_group_size`` and ``min_matchmaking_time``: set per round), ``_outer_pipe``,
``_p2p``, ``_parent_pid``, ``run`` and the ``_rpc_handlers`` / ``_stub_type`` class caches of
``hivemind.p2p.ServicerBase``; and ``StepControl.stage`` / ``allow_allreduce`` / ``cancel`` from
``step(require_trigger=True, wait=False)``.
"""

from __future__ import annotations

import ctypes
import logging
import math
import multiprocessing as mp
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass

import hivemind
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import NoCompression
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from diloco.swarm.records.dht import detach_from_parent
from diloco.swarm.rounds.report import RoundReport

logger = logging.getLogger(__name__)

ROUND_BITS = 20  # round indices are told apart modulo 2**20
GROUP_ID_MAX = 64  # bytes; hivemind's group ids are 20
MAX_REQUEST_TIMEOUT_S = 3.0  # hivemind's request_timeout: at most this, and below the round's wait


def request_timeout_for(wait: float) -> float:
    """hivemind's ``request_timeout`` for a matchmaking wait of ``wait`` seconds: how long a peer waits for a leader
    to answer its join request. hivemind requires it below the wait (``min_matchmaking_time``): two peers that ask each
    other at once deadlock until it runs out."""
    return min(MAX_REQUEST_TIMEOUT_S, wait / 2)


class RoundStats(ctypes.Structure):
    """What the averager process tells the caller about the current round, in shared memory."""

    _fields_ = [("group_size", ctypes.c_int64)]  # peers in the last group that formed

    def clear(self) -> None:
        ctypes.memset(ctypes.addressof(self), 0, ctypes.sizeof(self))


class ExactAverager(hivemind.DecentralizedAverager):
    """A ``DecentralizedAverager`` that forms groups and gathers, and moves no bytes: once a group formed, its id goes
    to ``matched_id`` and the round's result is set at once (the caller's ranks average themselves).

    ``stats`` holds the current round's figures in shared memory (a ``RoundStats``, or a subclass's).
    """

    _rpc_handlers = None  # collect our own RPC handlers/stub (the cache is a class attribute in ServicerBase)
    _stub_type = None
    stats_type: type[RoundStats] = RoundStats

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: hivemind.DHT, **kwargs):
        method = mp.get_start_method(allow_none=True) or mp.get_all_start_methods()[0]
        if method != "fork":
            # hivemind pickles pipes between forked processes (MPFuture); under 'spawn' the averager never gets ready
            raise RuntimeError(f"hivemind averagers need the 'fork' start method, this process uses {method!r}")
        self.stats = mp.RawValue(self.stats_type)
        self.matched_id = mp.RawArray(ctypes.c_char, 1 + GROUP_ID_MAX)  # length byte, then the last group's id
        kwargs.setdefault("compression", NoCompression())
        super().__init__(averaged_tensors, dht, **kwargs)

    def run(self):
        detach_from_parent(self._parent_pid)
        self.prepare()
        super().run()

    def prepare(self) -> None:
        """In the averager process, before it serves: what a subclass starts there."""

    async def _step(self, **kwargs) -> None:
        try:
            await super()._step(**kwargs)
        except InvalidStateError:
            # the caller gave the round up (``cancel``) just as the group formed: hivemind then sets the result of a
            # cancelled step and its task ends with this error, which asyncio would print as a traceback ("Task
            # exception was never retrieved") in the trainer's output. The round is over either way
            logger.debug("a round given up as its group formed: its step was already cancelled")

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ):
        group_id = self.formed(group_info, group_id)
        self._running_groups[group_id].set_result(Matched())  # done here (else hivemind warns each round)

    def formed(self, group_info: GroupInfo, group_id: bytes | None) -> bytes:
        """A group formed: tell the caller its size and secret id (shared memory); returns the id."""
        group_id = group_info.group_id if group_id is None else group_id
        self.stats.group_size = len(group_info.peer_ids)
        if len(group_id) > GROUP_ID_MAX:
            raise AllreduceException(f"a group id of {len(group_id)} bytes")
        self.matched_id.raw = bytes([len(group_id)]) + group_id.ljust(GROUP_ID_MAX, b"\0")  # the caller reads it
        return group_id

    def set_target_group_size(self, size: int) -> None:
        """Close matchmaking as soon as `size` peers (this one included) are in; applies from the next round on."""
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result(timeout=10.0)

    async def _set_target_group_size(self, size: int, future: MPFuture) -> None:
        try:  # the leader's rule (assemble when full; refuse followers beyond it) and the wait for leaders
            self._matchmaking.target_group_size = self._matchmaking.potential_leaders.target_group_size = size
            future.set_result(None)
        except Exception as e:
            if not future.done():
                future.set_exception(e)

    def set_matchmaking_time(self, seconds: float) -> None:
        """Wait `seconds` for groupmates (hivemind's ``min_matchmaking_time``, and a ``request_timeout`` below it);
        applies from the next ``step`` on, which must also be given ``scheduled_time`` = now + `seconds` (hivemind's
        default for it reads the value given at construction, in the caller's process)."""
        future = MPFuture()
        self._outer_pipe.send(("_set_matchmaking_time", [], dict(seconds=seconds, future=future)))
        future.result(timeout=10.0)

    async def _set_matchmaking_time(self, seconds: float, future: MPFuture) -> None:
        try:  # how long this peer declares itself (and re-declares itself after finding nobody), and thus when a
            # leader assembles whoever joined; the time a peer waits for a leader's answer; the queue's horizon
            matchmaking = self._matchmaking
            matchmaking.min_matchmaking_time = matchmaking.potential_leaders.min_matchmaking_time = seconds
            matchmaking.request_timeout = request_timeout_for(seconds)
            future.set_result(None)
        except Exception as e:
            if not future.done():
                future.set_exception(e)

    def idle(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until this averager no longer looks for a group. A cancelled step's
        search ends in the averager process only after its DHT requests return (seconds under load); a step started
        before would spend its own matchmaking time waiting for that search. Returns whether it ended in time."""
        future = MPFuture()
        self._outer_pipe.send(("_idle", [], dict(future=future)))
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            return False

    async def _idle(self, future: MPFuture) -> None:
        try:
            async with self._matchmaking.lock_looking_for_group:  # free once the last search has wound down
                pass
            future.set_result(True)
        except Exception as e:
            if not future.done():
                future.set_exception(e)

    async def _shutdown(self, timeout: float | None) -> None:
        try:
            await super()._shutdown(timeout)
        finally:  # hivemind never closes the averager's replica of the DHT's p2p client: its socket stays in /tmp
            if getattr(self, "_p2p", None) is not None:
                await self._p2p.shutdown()  # a replica: closes the client and removes its socket, not the daemon


class Matched:
    """Stands in for hivemind's ``AllReduceRunner`` in ``_running_groups`` once a group was handed to the caller."""

    def finalize(self, cancel: bool = False) -> set:
        return set()

    async def rpc_aggregate_part(self, stream: AsyncIterator, context) -> AsyncIterator[averaging_pb2.AveragingData]:
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)  # no parts come over libp2p


@dataclass(frozen=True)
class Match:
    """A group formed by ``Matchmaker.match``: its secret id, what each member gathered (in the group's order, the
    same for every member), this peer's place in it, and each member's peer id (base58, in that order)."""

    group_id: bytes
    gathered: list[object]
    index: int
    peers: tuple[str, ...] = ()


class Matchmaker:
    """Finds, once per round, the peers of the same ``prefix`` that are ready for the same round index.

    The averager process starts here (~1 s) and shares the caller's DHT daemon.

    :param dht: a running DHT (``diloco.swarm.records.dht.start_dht``); not owned, shut it down after ``shutdown()``.
    :param prefix: the run's matchmaking key; only peers with the same prefix meet. Must not contain '.'.
    :param matchmaking_time: seconds to wait for groupmates before forming a group with whoever joined; with nobody
        else the round returns after about this time plus ``grace``. The default: ``match(wait=...)`` sets a round's.
    :param averaging_timeout: seconds a formed group may take to be announced to every member.
    :param target_group_size: start as soon as this many peers (including this one) joined; None waits the whole
        ``matchmaking_time`` and takes everyone.
    :param grace: seconds after the round's wait (``matchmaking_time`` by default) to wait for the group to be
        announced; capped at half of that wait so that giving up never coincides with the next matchmaking deadline
        (a peer that found nobody re-declares itself for another such wait, and a latecomer may join it). The
        ``grace`` attribute is the grace of a round that waits ``matchmaking_time``.
    :param startup_timeout: seconds to wait for the averager process to start.
    :param averager: further keyword arguments of the averager process (``ExactAverager`` or a subclass).
    """

    averager_type: type[ExactAverager] = ExactAverager

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        prefix: str,
        matchmaking_time: float,
        averaging_timeout: float,
        target_group_size: int | None = None,
        grace: float = 3.0,
        startup_timeout: float = 60.0,
        tensors: Sequence[torch.Tensor] = (),
        **averager: object,
    ):
        if "." in prefix or not prefix:
            raise ValueError(f"averaging prefix must be non-empty and contain no '.': {prefix!r}")
        if matchmaking_time <= 0 or averaging_timeout <= 0:
            raise ValueError("matchmaking_time and averaging_timeout must be positive (seconds)")
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self._grace = grace
        self.grace = min(grace, matchmaking_time / 2)
        self._wait = matchmaking_time  # the wait the averager process has now
        self._planned: float | None = None  # the wait `expect` set for the next rounds
        self.target_group_size = self._expected = target_group_size
        # a peer nobody can dial (hivemind's client mode) never leads: it joins leaders, which refuse a request that
        # expires before their own declaration does. So it asks with a late expiration (its wait plus the averaging
        # timeout) whatever it waits itself: a leader whose wait ends after the client's own still takes it in
        self.client_mode = bool(averager.get("client_mode", False))
        self._averager = self.averager_type(
            [tensor.detach().clone() for tensor in tensors] or [torch.zeros(1)],
            dht,
            start=False,
            prefix=prefix,
            target_group_size=target_group_size,
            min_group_size=2,  # a lone peer is handled here (by cancelling), never as a group of one
            min_matchmaking_time=matchmaking_time,
            request_timeout=request_timeout_for(matchmaking_time),  # hivemind: must be < min_matchmaking_time
            allreduce_timeout=averaging_timeout,
            next_chunk_timeout=averaging_timeout / 4,  # drop a silent groupmate before the round times out
            allow_state_sharing=False,
            **averager,
        )
        self._averager.start()
        try:
            self._averager.wait_until_ready(timeout=startup_timeout)
        except BaseException:
            self.shutdown()
            raise

    def expect(self, groups: int, wait: float | None = None) -> None:
        """The groups (this one included) expected in the next round: matchmaking closes once they are all in,
        instead of waiting out ``matchmaking_time`` for groups that are gone. Between 2 and the size given at
        construction; a peer told too few would turn later ones away, so callers count generously. `wait`: how
        long the next rounds wait for them when ``match`` is given none (None: ``matchmaking_time``)."""
        self._planned = wait
        size = max(2, min(groups, self.target_group_size or groups))
        if size != self._expected:
            self._check_alive()
            self._averager.set_target_group_size(size)
            self._expected = size

    def match(self, round_index: int, gather: object, stop: Callable[[], bool] = lambda: False,
              wait: float | None = None) -> tuple[Match | None, RoundReport]:  # fmt: skip
        """Form this round's group and gather what every member brings; no tensor bytes move. Returns (the match, a
        report of the matchmaking); no match when nobody else came (``num_peers`` 1) or it failed or was stopped
        (``ok`` False).

        :param wait: seconds this round waits for groupmates (any positive value; None: ``matchmaking_time``). It
            still closes as soon as the expected peers are in (``expect``); with nobody else it gives up after about
            ``wait`` plus the grace (capped at half of ``wait``). Peers of one round may wait differently: the one
            whose wait ends first leads, and the group forms by then at the latest.
        """
        wait = self._round_wait(self._planned if wait is None else wait)
        started = time.monotonic()
        control = self._start_step(round_index, 1.0, gather, wait)
        grouped = self._trigger_when_grouped(control, time.monotonic() + wait + min(self._grace, wait / 2), stop)
        if not grouped:
            report = RoundReport(1 if grouped is False else 0, time.monotonic() - started, 0, 0, grouped is False)
            self._leave()
            return None, report
        try:
            gathered = control.result(timeout=self.averaging_timeout)
        except Exception as e:  # TimeoutError, AllreduceException, MatchmakingException, CancelledError, ...
            cancel(control)
            logger.warning(f"matchmaking failed: {type(e).__name__}: {e}")
            size = int(self._averager.stats.group_size)
            return None, RoundReport(size, time.monotonic() - started, 0, 0, False)
        peers = [peer.to_base58() for peer in gathered]
        match = Match(self.matched_id(), list(gathered.values()), peers.index(self.peer_id), tuple(peers))
        return match, RoundReport(len(peers), time.monotonic() - started, 0, 0, True)

    def matched_id(self) -> bytes:
        """The secret id of the last group that formed (b"" when none did this round)."""
        raw = self._averager.matched_id.raw
        return raw[1 : 1 + raw[0]]

    def _check_alive(self) -> None:
        """Raise if the averager process has ended: hivemind's step and group bits would wait for its answer for
        good (and a changed group size for 10 s)."""
        if not self._averager.is_alive():
            raise RuntimeError(f"this rank's averager process has ended (exit code {self._averager.exitcode}): "
                               "no more rounds can be matched")  # fmt: skip

    def _round_wait(self, wait: float | None) -> float:
        """The round's matchmaking wait: ``wait`` (positive, finite seconds), or ``matchmaking_time`` when None."""
        if wait is None:
            return self.matchmaking_time
        if not 0 < wait < math.inf:
            raise ValueError(f"a round's matchmaking wait must be positive seconds, got {wait!r}")
        return float(wait)

    def _start_step(self, round_index: int | None, weight: float, gather: object, wait: float | None = None
                    ) -> StepControl:  # fmt: skip
        """Clear the round's figures and enter matchmaking for ``wait`` seconds (None: ``matchmaking_time``), under
        ``<prefix>.0b<round bits>`` when a round index is given; the all-reduce waits for our trigger, so giving up
        cannot race with it."""
        self._check_alive()
        wait = self._round_wait(wait)
        if wait != self._wait:  # one round trip to the averager process, only when the wait changed
            self._averager.set_matchmaking_time(wait)
            self._wait = wait
        if round_index is not None:
            self._averager.set_group_bits(format(round_index % 2**ROUND_BITS, f"0{ROUND_BITS}b"))
        self._averager.stats.clear()
        self._averager.matched_id.raw = bytes(1 + GROUP_ID_MAX)  # no group yet: a failed round names none
        leeway = self.averaging_timeout if self.client_mode else 0.0
        return self._averager.step(
            weight=weight, scheduled_time=get_dht_time() + wait + leeway, timeout=wait + self.averaging_timeout,
            allow_retries=True, gather=gather, require_trigger=True, wait=False,
        )  # fmt: skip

    @staticmethod
    def _trigger_when_grouped(control: StepControl, give_up_at: float, stop: Callable[[], bool]) -> bool | None:
        """Poll the step's stage; allow the all-reduce when grouped. False (step cancelled) if no group by then,
        None if ``stop()`` became true first."""
        while time.monotonic() < give_up_at and not stop():
            if control.done():
                return True  # failed early: result() reports it
            if control.stage == AveragingStage.AWAITING_TRIGGER:
                control.allow_allreduce()
                return True
            time.sleep(0.005)
        cancel(control)
        return None if stop() else False

    def _leave(self, timeout: float = 10.0) -> None:
        """After a round that formed no group: let the averager process end its search before the next round."""
        if not self._averager.idle(timeout):
            logger.debug(f"the averager still looked for a group {timeout:.0f} s after the round gave up")

    @property
    def peer_id(self) -> str:
        """This averager's peer id (base58): the id of the DHT daemon it shares."""
        return self._averager.dht.peer_id.to_base58()

    def shutdown(self) -> None:
        """Stop the averager process (idempotent). The DHT stays up."""
        if self._averager.is_alive():
            self._averager.shutdown()

    def __enter__(self) -> Matchmaker:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def cancel(control: StepControl) -> None:
    """Cancel a step that may have finished meanwhile (cancelling twice raises in hivemind)."""
    if not control.done():
        try:
            control.cancel()
        except InvalidStateError:
            pass
