"""One trainer rank's place in the swarm: its DHT peer (with p2pd), its side of the rounds of whole groups (and rank
0's matchmaker), and the worker groups' records (``diloco.swarm.records``: progress, status, round tokens).
``SwarmPeer`` is the ``diloco.outer.links.Swarm`` the outer loop talks to; ``diloco.swarm.start`` builds it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.p2p import PeerID

from diloco.swarm.records import budget, progress, status
from diloco.swarm.records.arrivals import FLOOR_S, live, plan_wait
from diloco.swarm.records.budget import RoundTokens
from diloco.swarm.records.dht import rendezvous
from diloco.swarm.records.heartbeat import Heartbeat
from diloco.swarm.records.ownership import Owner
from diloco.swarm.records.progress import Progress
from diloco.swarm.records.status import Status
from diloco.swarm.records.swarm_key import SealedStore
from diloco.swarm.rounds import transfer
from diloco.swarm.rounds.group_round import GroupRounds, announced
from diloco.swarm.rounds.layout import group_layout
from diloco.swarm.rounds.matchmaker import Matchmaker
from diloco.swarm.rounds.report import RoundReport

log = logging.getLogger("diloco")

LAST_STATUS_WAIT_S = 1.0  # at shutdown, seconds to wait for status stores under way (the group's last record)
TOKENS_READ_S = 0.5  # round-token records are read again at most this often

State = tuple[dict, list[torch.Tensor]]


class SwarmPeer:
    """Implements ``diloco.outer.links.Swarm``; ``shutdown`` stops the matchmaker, then the DHT (after the status
    stores under way, at most ``LAST_STATUS_WAIT_S``).

    :param dht: this rank's running DHT peer (owned from now on).
    :param matchmaker: rank 0's, which finds the round's groups for `rounds` (owned from now on); None on the other
        ranks.
    :param progress_key: DHT key of the groups' progress records (``progress.progress_key``).
    :param request_timeout: seconds to wait for a peer's answer (a ping, each message of a state download).
    :param status_key: DHT key of the groups' status records (``status.status_key``).
    :param tokens_key: DHT key of the groups' round-token records (``budget.tokens_key``).
    :param rounds: rounds of whole groups (``group_round.GroupRounds``; owned from now on), which ``average``
        runs; states travel over its listener (``transfer``), between groups of any shape. None: a peer that only
        publishes and reads records (it cannot average or serve a state).
    :param owner: the key that signs the group's records (rank 0: the one `dht`'s validator holds); None on a peer
        that publishes none.
    :param members_key: the DHT key of the groups' rendezvous at start (``rendezvous``).
    :param round_steps: under fixed H, the inner steps between two rounds (H, or H/F with fragments): round r is
        due at inner step r x `round_steps` in every group, so the others' status records say when they will reach
        it (``arrivals``). None: every group's round is due at one moment (a token budget).
    :param wait_cap: the longest a round waits for the groups coming (``--hv.matchmaking-time``, or
        ``arrivals.AUTO_CAP_S`` for auto); None: always the matchmaker's ``matchmaking_time``, as a fixed wait.
    :param final_step: the run's last inner step: under fixed H the last round (``round_steps``) is due there, and
        it waits for every live group on its way up to `wait_cap` (a group that finished training loses nothing by
        waiting, and a group that missed the last round would have no later one for its inner steps).
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        matchmaker: Matchmaker | None,
        progress_key: str,
        request_timeout: float,
        status_key: str,
        tokens_key: str = "",
        rounds: GroupRounds | None = None,
        owner: Owner | None = None,
        members_key: str = "",
        round_steps: int | None = None,
        wait_cap: float | None = None,
        final_step: int | None = None,
    ):
        self.dht, self.matchmaker, self.rounds, self._owner = dht, matchmaker, rounds, owner
        self.members_key = members_key
        self.round_steps, self.wait_cap, self.final_step = round_steps, wait_cap, final_step
        self._round_ended = time.monotonic()  # this group's own round takes from here to its next boundary
        self.owner = "" if owner is None else owner.id
        self.progress_key, self.request_timeout, self.status_key = progress_key, request_timeout, status_key
        self.tokens_key = tokens_key
        self._tokens: list[RoundTokens] = []  # the last round-token records read
        self._reading: Future | None = None  # a read of them under way
        self._read_at = -float("inf")
        self.peer_id = matchmaker.peer_id if matchmaker is not None else dht.peer_id.to_base58()  # (the same daemon)
        self._storing: set[Future] = set()  # record stores under way (a future nobody holds drops its result)
        self._store_failed = False  # one warning, not one per heartbeat
        self._last_peers = 0  # groups in the last round that did not fail
        self._last_others: set[int] = set()  # world ranks of the other groups counted for that round
        self._counted: set[int] = set()  # ... and for the round being planned
        self.heartbeat = Heartbeat(self._store_status)  # rank 0's status, re-sent while the training loop sends none
        self.rejected_states = 0  # state downloads refused: short, malformed, unproven (``transfer.download``)
        self.malformed: Counter[tuple[str, str, int]] = Counter()  # (DHT key, owner, world rank): entries not records

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        round_index: int,
        weight: float,
        stop: Callable[[], bool],
        fragment: int | None = None,
        outer_step: int | None = None,
        last: bool = False,
    ) -> RoundReport:
        if self.matchmaker is not None:
            try:
                records = self.status_records()
            except Exception as e:  # the DHT is shutting down: expect everyone, as without records
                log.debug("status records unreadable (%s): expecting every group", e)
                records = None
            self.matchmaker.expect(self.expected_groups(records), self.round_wait(records, round_index, last))
        try:
            report = self.rounds.average(tensors, round_index, weight, stop, fragment, outer_step)
        finally:
            self._round_ended = time.monotonic()
        if report.ok:
            self._last_peers, self._last_others = report.num_peers, self._counted
        return report

    @property
    def reach(self) -> str:
        """Whether others can dial this rank (``rounds.reachability``; "" without rounds)."""
        return self.rounds.reach if self.rounds is not None else ""

    def image(self, values: torch.Tensor, fragment: int | None = None) -> torch.Tensor:
        return values if self.rounds is None else self.rounds.image(values, fragment)

    def expected_groups(self, records: list[Status] | None) -> int:
        """Rank 0: the groups that may come to the next round: this one, the others whose status record is not
        stale and says they have rounds to come (not done, not left), and at least as many as the last round had
        (a record the DHT read missed does not shrink the count) but for those of its groups whose record now says
        they are gone. Staleness is the rule the wait for arrivals uses (``arrivals.live``): every live group's rank
        0 sends a record at least every ``HEARTBEAT_S``, in rounds and pauses too (``Heartbeat``), so a group killed
        a moment ago stops counting once its record is stale, and so does the wait for it. `records`: the status
        records (None: unreadable, every group is expected)."""
        matchmaker = self.matchmaker
        if records is None:
            return matchmaker.target_group_size or 2
        now = time.time()
        theirs = [r for r in records if r.peer != self.peer_id]
        others = {r.world_rank for r in theirs if live(r, now)}
        # (a restarted group has a stale record of its last life beside its live one: it is not gone)
        gone = ({r.world_rank for r in theirs if not live(r, now)} & self._last_others) - others
        self._counted = others
        return max(1 + len(others), self._last_peers - len(gone))

    def round_wait(self, records: list[Status] | None, round_index: int, last: bool = False) -> float | None:
        """Rank 0: how long round `round_index` waits for the groups coming (``arrivals.plan_wait``: those whose
        status records say they arrive within this group's own round time); None: the matchmaker's fixed wait (no
        cap given, or no records to go by). The run's last round (`last`, or under fixed H the round at the final
        step) waits for any live group whose peer answers, up to the cap, ``LAST_SLACK`` past its arrival."""
        if self.wait_cap is None or records is None:
            return None
        # one round of this group's own time, and the floor's jitter: a group half as fast is waited for
        bound = unknown = time.monotonic() - self._round_ended + FLOOR_S
        boundary = None  # under a token budget every group's round is due at one moment
        if self.round_steps is not None:
            boundary = round_index * self.round_steps
            if self.final_step is not None and boundary >= self.final_step:
                boundary, last = self.final_step, True
        if last:  # any live group whose peer answers (a record alone, which anyone may write, must not hold the
            # last round long)
            bound = self.wait_cap
            records = [r for r in records if r.peer != self.peer_id and r.peer and self.alive(r.peer)]
        wait = plan_wait(records, me=self.peer_id, boundary=boundary, now=time.time(), bound=bound,
                         cap=self.wait_cap, unknown=unknown,
                         galaxy_size=self.matchmaker.target_group_size, last=last)  # fmt: skip
        if wait > self.matchmaker.matchmaking_time:
            log.info("round %d: waiting up to %.0f s for the worker groups on their way", round_index, wait)
        return wait

    def rendezvous(self, world_rank: int, galaxy_size: int, timeout: float, stop: Callable[[], bool]) -> int:
        """Rank 0: meet the other groups at start (``dht.rendezvous``, at most `timeout` seconds); returns how many
        groups were seen. Groups start seconds apart (imports, data loading): meeting first lets the first round find
        them all."""
        return rendezvous(self.dht, self.members_key, str(world_rank), galaxy_size, timeout, stop)

    def save_owner(self, path: Path) -> None:
        """Rank 0: keep the key that signs this group's records in `path`, so a resumed group keeps its records."""
        if self._owner is not None:
            self._owner.save(path)

    def publish(self, record: Progress) -> None:
        if self.rounds is not None:  # where a group of any shape downloads this group's state
            shape = self.rounds.shape
            # a group some of whose ranks nobody can dial serves no state (``Progress.serves``): it names no endpoints
            endpoints = tuple([list(hosts), port] for hosts, port in self.rounds.endpoints) if all(
                self.rounds.dialable) else ()  # fmt: skip
            record = dataclasses.replace(record, shape=(shape.strategy, shape.world_size, shape.nodes),
                                         endpoints=endpoints)  # fmt: skip
        subkey = self._subkey(record.world_rank)  # (an outer step does not wait for the DHT: in the background)
        self._store_later(lambda: progress.publish(self.dht, self.progress_key, record, subkey, return_future=True))

    def records(self) -> list[Progress]:
        return progress.read(self.dht, self.progress_key, partial(self._malformed, self.progress_key))

    def publish_status(self, record: Status) -> None:
        """Returns at once: the DHT process stores it while training goes on; a failure is logged once. The
        heartbeat re-sends it while nothing newer comes."""
        self.heartbeat.sent(record)
        self._store_status(record)

    def _store_status(self, record: Status) -> None:
        subkey = self._subkey(record.world_rank)
        self._store_later(lambda: status.publish(self.dht, self.status_key, record, subkey, return_future=True))

    def status_records(self) -> list[Status]:
        return status.read(self.dht, self.status_key, partial(self._malformed, self.status_key))

    def _malformed(self, key: str, owner: str, world_rank: int) -> None:
        """An owned entry under `key` that is not a record of its kind: counted per read, logged once per sender."""
        self.malformed[key, owner, world_rank] += 1
        if self.malformed[key, owner, world_rank] == 1:
            log.warning("ignoring an entry under %s (owner %s, world rank %d) that is not a valid record: a "
                        "stranger's, or a version that writes another form", key, owner, world_rank)  # fmt: skip

    def publish_tokens(self, record: RoundTokens) -> None:
        subkey = self._subkey(record.world_rank)
        self._store_later(lambda: budget.publish(self.dht, self.tokens_key, record, subkey, return_future=True))

    def _subkey(self, world_rank: int) -> str:
        if self._owner is None:
            raise RuntimeError("this peer holds no key to sign records with (only a group's rank 0 publishes)")
        return self._owner.subkey(world_rank)

    def token_records(self) -> list[RoundTokens]:
        """The records of the last read that finished; starts the next read when none is under way and the last
        one is older than ``TOKENS_READ_S`` (so the caller, an inner step, never waits for the network)."""
        if self._reading is not None and self._reading.done():
            try:
                self._tokens = budget.parse(self._reading.result(), partial(self._malformed, self.tokens_key))
            except Exception:  # noqa: BLE001 - a failed read: keep the last records, try again
                pass
            self._reading = None
        now = time.monotonic()
        if self._reading is None and now - self._read_at >= TOKENS_READ_S:
            try:
                self._reading = self.dht.get(self.tokens_key, latest=True, return_future=True)
                self._read_at = now
            except Exception:  # noqa: BLE001 - a DHT that is shutting down
                pass
        return self._tokens

    def _store_later(self, store: Callable[[], Future]) -> None:
        try:
            future = store()
        except Exception as e:  # noqa: BLE001 - a DHT that is shutting down (its pipe closed): never stop training
            self._not_stored(e)
            return
        self._storing.add(future)
        future.add_done_callback(self._stored)

    def _stored(self, future: Future) -> None:
        """On hivemind's future thread, once a record store ended."""
        self._storing.discard(future)
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or error is not None or not future.result():
            self._not_stored(error or "no DHT peer stored it")

    def _not_stored(self, why: object) -> None:
        if not self._store_failed:
            self._store_failed = True
            log.warning("could not publish a record of this group in the DHT (%s); training goes on", why)

    @property
    def rejected_records(self) -> int:
        sealed = self.dht.rejected_total if isinstance(self.dht, SealedStore) else 0
        return sealed + sum(self.malformed.values())

    def alive(self, peer_id: str) -> bool:
        try:
            return bool(self.dht.run_coroutine(partial(_ping, peer_id)))
        except Exception:  # a malformed peer id, a DHT that is shutting down
            return False

    def serve_state(self, provider: Callable[[], transfer.Served]) -> None:
        service = transfer.StateService(self.rounds.layout, provider, self.request_timeout, self.rounds.key)
        self.rounds.listener.serve(service.magic, service)

    def download_state(self, record: Progress, rank: int,
                       wanted: Callable[[dict[str, Any]], bool] | None = None) -> State | None:  # fmt: skip
        source = announced({"shape": record.shape, "endpoints": record.endpoints, "weight": 0.0})
        if source is None:  # a record of another version, or garbage: no state from it
            log.debug("the progress record of group %d names no reachable shape", record.world_rank)
            return None
        layouts = group_layout(self.rounds.model_shapes, source.shape)
        return transfer.download(self.rounds.layout, layouts, source.endpoints, self.request_timeout,
                                 self.rounds.connect, self.rounds.key, self._refused_state, wanted=wanted)  # fmt: skip

    def _refused_state(self, why: str) -> None:
        if not self.rejected_states:
            log.warning("refused a state download (%s); later ones are only counted (rejected_states)", why)
        self.rejected_states += 1

    @property
    def refused_connections(self) -> int:
        return self.rounds.listener.refused if self.rounds is not None else 0

    def shutdown(self) -> None:
        self.heartbeat.stop()  # before the last stores are waited for: no beat after the group said it left
        deadline = time.monotonic() + LAST_STATUS_WAIT_S
        for future in list(self._storing):
            with contextlib.suppress(Exception):  # a failure or a timeout: `_stored` logs it, or nobody needs it
                future.result(timeout=max(deadline - time.monotonic(), 0.0))
        try:
            if self.rounds is not None:
                self.rounds.close()
            if self.matchmaker is not None:
                self.matchmaker.shutdown()
        finally:
            self.dht.shutdown()


async def _ping(peer_id: str, dht: hivemind.DHT, node: hivemind.DHTNode) -> bool:
    """Runs in the DHT process: whether the peer answers a DHT ping (within the protocol's wait timeout)."""
    return await node.protocol.call_ping(PeerID.from_base58(peer_id)) is not None
