"""The swarm averager: averages a tensor with the peers of the same prefix that are ready, leaving every groupmate
bit-identical. The trainer's rank 0 uses it to matchmake for its whole group (``match_only``, then
``diloco.swarm.group_round``); its full rounds are those of the benches' ``tcp`` and ``p2pd`` arms and of diloco
before groups of any shape averaged together.

``SwarmAverager`` is what the trainer calls: one round per outer step, with whoever is ready; it never raises on
network failures and reports what happened (``RoundReport``). Rounds run in a background process
(``ExactAverager``, a hivemind ``DecentralizedAverager``): hivemind's matchmaking forms the group, then the bytes go
over TCP (``diloco.swarm.tcp``) or, for groups with a ``p2pd`` member, over libp2p (``diloco.swarm.libp2p``).

hivemind is pinned to 1.1.12; besides what ``libp2p`` lists, this module relies on these private names of
``DecentralizedAverager``: ``_run_allreduce_inplace_`` (called once per all-reduce attempt while the averager
holds its tensor lock, with ``weight`` and ``sender_timeout`` among its keyword arguments), ``GroupInfo.gathered``
(per peer: ``serializer.dumps([bandwidth, mode, serializer.dumps(gather)])``, in ``peer_ids`` order),
``allreduce_kwargs``, ``_allreduce_timeout``, ``_running_groups`` (a future per group whose result must offer
``finalize`` and ``rpc_aggregate_part``), ``_p2p``, ``_parent_pid``, ``run``, ``peer_id``, ``prefix`` and the
``_rpc_handlers`` / ``_stub_type`` class caches of ``hivemind.p2p.ServicerBase``; ``serializer``;
``StepControl.stage`` / ``allow_allreduce``
/ ``cancel`` from ``step(require_trigger=True, wait=False)``; and
``hivemind.compression.serialization._BASE_COMPRESSION_TYPES``, the decoder registry, patched inside the averager
process only (``ExactAverager.run``) because the stock 8-bit decoder fails on numpy >= 2.4.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
import multiprocessing as mp
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from typing import AsyncIterator, Literal

import hivemind
import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import NoCompression
from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture

from diloco.config import FieldError
from diloco.screening import all_finite
from diloco.swarm import tcp
from diloco.swarm.addresses import announced_hosts
from diloco.swarm.codecs import WIRE_FORMATS, Uniform8Bit, WireFormat
from diloco.swarm.dht import detach_from_parent
from diloco.swarm.libp2p import ExactAllReduceRunner, average_into
from diloco.swarm.listener import Listener, listen_socket

logger = logging.getLogger(__name__)

Compression = Literal["none", "fp16", "int8", "int4"]
Transport = Literal["tcp", "p2pd"]


class RoundStats(ctypes.Structure):
    """The figures of one round, in shared memory: the averager process writes them, the trainer reads them.
    Bytes and rejections add up over the attempts of a round (hivemind retries a failed all-reduce)."""

    _fields_ = [
        ("bytes_sent", ctypes.c_int64),  # serialized bytes this peer sent (tensor parts and averaged parts)
        ("bytes_received", ctypes.c_int64),
        ("group_size", ctypes.c_int64),  # peers in the last group that tried to average
        ("rejected", ctypes.c_int64),  # contributions this peer, as a reducer, left out
        ("over_tcp", ctypes.c_int64),  # 1: the last all-reduce went over TCP (its result is in ``tcp_out``)
        ("dropped", ctypes.c_int64),  # groupmates this peer, as a reducer, left out for their frames or silence
    ]

    def clear(self) -> None:
        ctypes.memset(ctypes.addressof(self), 0, ctypes.sizeof(self))

    def add(self, sent: int, received: int, rejected: int, dropped: int = 0) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.rejected += rejected
        self.dropped += dropped


class ExactAverager(hivemind.DecentralizedAverager):
    """DecentralizedAverager whose rounds leave all groupmates with bit-identical tensors.

    A round either overwrites all local tensors with the group average or, if any part could not be averaged,
    leaves them untouched and fails (so ``step`` retries or raises instead of returning mixed results).
    ``stats`` holds the figures of the current round in shared memory (``RoundStats``).
    Peers only group with other ``ExactAverager`` peers: RPC names include the class name.

    The bytes of a round travel over plain TCP (``diloco.swarm.tcp``) when every groupmate gathered a TCP endpoint
    (``step(gather={"tcp": [hosts, port]})``), otherwise over libp2p (``diloco.swarm.libp2p``); both screen alike.

    :param listen_socket: a listening socket for the TCP transport (``listener.listen_socket``), taken over by the
        averager process; None: this averager only averages over libp2p.
    :param wire: the wire format of parts and averages, on both transports.
    :param match_only: form groups and gather, move no bytes: the group's id goes to ``matched_id`` and its members'
        ranks average among themselves afterwards (``diloco.swarm.group_round``).
    """

    _rpc_handlers = None  # collect our own RPC handlers/stub (the cache is a class attribute in ServicerBase)
    _stub_type = None

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: hivemind.DHT,
        listen_socket: socket.socket | None = None,
        wire: WireFormat = WIRE_FORMATS["none"],
        match_only: bool = False,
        **kwargs,
    ):
        method = mp.get_start_method(allow_none=True) or mp.get_all_start_methods()[0]
        if method != "fork":
            # hivemind pickles pipes between forked processes (MPFuture); under 'spawn' the averager never gets ready
            raise RuntimeError(f"hivemind averagers need the 'fork' start method, this process uses {method!r}")
        self.stats = mp.RawValue(RoundStats)
        self.wire = wire
        self.match_only = match_only
        self.matched_id = mp.RawArray(ctypes.c_char, 1 + GROUP_ID_MAX)  # length byte, then the last group's id
        self._listen_socket = listen_socket  # inherited by the forked averager process
        self._listener: Listener | None = None
        # the TCP rounds' output, in shared memory (the caller copies its result from here: one copy fewer than
        # through the averaged tensors) and touched now (fresh pages in the first round cost more than a copy)
        numel = sum(tensor.numel() for tensor in averaged_tensors)
        self.tcp_out = torch.zeros(numel if listen_socket is not None else 0).share_memory_()
        # a format without a hivemind codec (int4) never travels through hivemind: match_only, checked by the caller
        super().__init__(averaged_tensors, dht, compression=wire.hivemind or NoCompression(), **kwargs)

    def run(self):
        detach_from_parent(self._parent_pid)
        # deserialize_torch_tensor decodes through this registry; fix the 8-bit decoder in this process only
        _BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = Uniform8Bit()
        warnings.filterwarnings("ignore", message="torch.quantize_per_tensor", category=UserWarning)
        # torch rebuilds its intra-op thread pool in a forked child on first use; do it here, in one thread,
        # before rounds start several threads at once (seen on a GPU box: "Invalid thread pool!" in a reader
        # thread on the first round, which then left a groupmate out of an "ok" average)
        torch.set_num_threads(torch.get_num_threads())
        if self._listen_socket is not None:
            timeout = self.allreduce_kwargs["sender_timeout"]
            # a groupmate that learnt of the group first waits for us as long as the round may last
            self._listener = Listener(self._listen_socket, timeout, self._allreduce_timeout).start()
        super().run()

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ):
        group_id = group_info.group_id if group_id is None else group_id
        self.stats.group_size = len(group_info.peer_ids)
        if len(group_id) > GROUP_ID_MAX:
            raise AllreduceException(f"a group id of {len(group_id)} bytes")
        self.matched_id.raw = bytes([len(group_id)]) + group_id.ljust(GROUP_ID_MAX, b"\0")  # the caller reads it
        if self.match_only:  # the caller's ranks average with the group's ranks themselves
            self._running_groups[group_id].set_result(_TcpGroup(None))  # done here (else hivemind warns each round)
            return
        endpoints = self._tcp_endpoints(group_info)
        self.stats.over_tcp = int(endpoints is not None and self._listener is not None)
        if self.stats.over_tcp:
            return await self._run_tcp_allreduce(tensors, group_info, group_id, endpoints, **kwargs)
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        try:
            await average_into(runner, tensors)
        finally:
            self.stats.add(runner.bytes_sent, runner.bytes_received, runner.rejected)

    def _tcp_endpoints(self, group_info: GroupInfo) -> list[tuple[list[str], int]] | None:
        """Every groupmate's TCP endpoint from the data gathered in matchmaking, or None if one has none (an
        averager over libp2p only): then the whole group goes over libp2p, as each member decides alike."""
        endpoints = []
        for gathered in group_info.gathered:
            user_data = self.serializer.loads(self.serializer.loads(gathered)[2])
            endpoint = user_data.get("tcp") if isinstance(user_data, dict) else None
            if endpoint is None:
                return None
            hosts, port = endpoint
            endpoints.append((list(hosts), int(port)))
        return endpoints

    async def _run_tcp_allreduce(
        self,
        tensors: Sequence[torch.Tensor],
        group_info: GroupInfo,
        group_id: bytes,
        endpoints: list[tuple[list[str], int]],
        *,
        weight: float,
        sender_timeout: float,
        **_,
    ) -> None:
        vector = tcp.flatten(list(tensors))
        round_ = tcp.Round(
            vector, self.tcp_out, group_id=group_id, index=group_info.peer_ids.index(self.peer_id),
            endpoints=endpoints, weight=weight, codec=self.wire.tcp, timeout=sender_timeout,
        )  # fmt: skip
        self._running_groups[group_id].set_result(_TcpGroup(round_))
        self._listener.register(round_)
        try:
            await asyncio.get_running_loop().run_in_executor(None, round_.run)
        except tcp.RoundFailed as e:
            raise AllreduceException(str(e)) from None
        except asyncio.CancelledError:  # hivemind's allreduce timeout: stop the round's threads
            round_.abort()
            raise
        finally:
            self._listener.unregister(round_)
            self.stats.add(round_.bytes_sent, round_.bytes_received, round_.rejected, round_.dropped)
        # reducers screen what they average; this catches one that does not (another version, a bad actor)
        if not all_finite(self.tcp_out):
            raise AllreduceException("a groupmate returned non-finite averages")
        # the result stays in tcp_out (stats.over_tcp says so): the averaged tensors keep this round's inputs


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

    async def _shutdown(self, timeout: float | None) -> None:
        try:
            await super()._shutdown(timeout)
        finally:  # hivemind never closes the averager's replica of the DHT's p2p client: its socket stays in /tmp
            if getattr(self, "_p2p", None) is not None:
                await self._p2p.shutdown()  # a replica: closes the client and removes its socket, not the daemon


class _TcpGroup:
    """Stands in for hivemind's ``AllReduceRunner`` in ``_running_groups`` while the group averages over TCP, or
    once a ``match_only`` averager handed the group to its caller (`round_` None)."""

    def __init__(self, round_: tcp.Round | None):
        self.round = round_

    def finalize(self, cancel: bool = False) -> set:
        if self.round is not None:
            self.round.abort()  # the averager shuts down: end the round's threads
        return set()

    async def rpc_aggregate_part(self, stream: AsyncIterator, context) -> AsyncIterator[averaging_pb2.AveragingData]:
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)  # no parts come over libp2p this round


@dataclass(frozen=True)
class RoundReport:
    """Outcome of one ``SwarmAverager.average`` call.

    :param num_peers: peers (worker groups) in the averaging group, including this one; 1 = nobody else was ready
        (tensors kept as they were). When ``ok`` is False: the size of the group that failed (0 if none formed).
    :param seconds: wall time of matchmaking + all-reduce, in seconds.
    :param bytes_sent: serialized bytes this peer sent in the round (tensor parts and averaged parts).
    :param bytes_received: serialized bytes this peer received in the round.
    :param ok: False when the round failed and the tensors were left untouched. Peers with ok=True of the same
        group hold identical bytes; at least one peer of a group reports ok=False if any part went wrong.
    :param transport: what carried the round's bytes: "tcp" or "p2pd"; "" when no group formed.
    :param allreduce_seconds: of ``seconds``, the part from the moment the group was formed (matchmaking over) to
        the result in the tensors; 0 when no group formed.
    :param round_id: a short id of the round's group (hex, the same for every member of one round): which groups
        averaged together; "" when no group formed.
    :param dropped: groupmates this peer, as a reducer, left out of its span for what they sent or did not send: a
        frame too long, short or undecodable, silence past the timeout, a broken connection (their values are
        ``rejected``'s business).
    :param rejected: groupmates' contributions (and this peer's own) that this peer, as a reducer, left out of the
        average for holding NaN/Inf or a norm ``screening.MAX_NORM_RATIO`` times the group's; a rejected peer's round
        fails, the others complete without it (ok=True).
    :param behind: this group was behind the round's others' outer step and sat the round out (ok=False; see
        ``progress.abreast``).
    """

    num_peers: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    ok: bool
    rejected: int = 0
    transport: str = ""
    allreduce_seconds: float = 0.0
    round_id: str = ""
    dropped: int = 0
    behind: bool = False


def round_id(group_id: bytes) -> str:
    """A short public name of a round's group: the members' rows name one round alike, without its secret id."""
    return hashlib.sha256(b"round-id" + group_id).hexdigest()[:12] if group_id else ""


ROUND_BITS = 20  # round indices are told apart modulo 2**20
GROUP_ID_MAX = 64  # bytes; hivemind's group ids are 20


@dataclass(frozen=True)
class Match:
    """A group formed by ``SwarmAverager.match``: its secret id, what each member gathered (in the group's order,
    the same for every member) and this peer's place in it."""

    group_id: bytes
    gathered: list[object]
    index: int


class SwarmAverager:
    """Averages a fixed list of CPU float32 tensors with every peer of the same ``prefix`` that is ready.

    After a successful round all peers of the group hold bit-identical tensors, for every compression.
    The averager runs in a background process (started here, ~1 s) that shares the caller's DHT daemon.

    :param dht: a running DHT (see ``start_dht``); not owned, shut it down after ``shutdown()``.
    :param prefix: swarm key; only averagers with the same prefix and tensor shapes average together,
        e.g. ``f"{run_id}/rank{r}"``. Must not contain '.'.
    :param tensors: templates (shapes, float32, CPU) of the tensors passed to ``average``; they are copied.
    :param compression: wire format of tensor parts and averages: "none" (exact fp32), "fp16", or "int8"
        (``Uniform8Bit``: hivemind's uniform 8-bit quantization with its own codebook per 512 KiB part).
    :param matchmaking_time: seconds to wait for groupmates before averaging with whoever joined; with
        nobody else the round returns after about this time plus ``grace``.
    :param averaging_timeout: seconds allowed for the all-reduce once a group is formed; a failed all-reduce
        is retried (with a new group) while the round is younger than ``matchmaking_time + averaging_timeout``.
    :param target_group_size: start as soon as this many peers (including this one) joined; None waits the
        whole ``matchmaking_time`` and takes everyone.
    :param grace: seconds after ``matchmaking_time`` to wait for the group to be announced; capped at half of
        ``matchmaking_time`` so that giving up never coincides with the next matchmaking deadline (a peer that
        found nobody re-declares itself for another ``matchmaking_time``, and a latecomer may join it).
    :param startup_timeout: seconds to wait for the averager process to start.
    :param transport: what carries the tensor bytes once hivemind formed a group: "tcp" (plain TCP sockets
        between the groupmates, ``diloco.swarm.tcp``; each peer must reach the others' announced addresses
        directly) or "p2pd" (hivemind's libp2p streams: NAT traversal and relays, encrypted, several times
        slower). A group with any "p2pd" member averages over libp2p.
    :param tcp_host: address the TCP transport listens on ("0.0.0.0": every interface).
    :param tcp_port: port the TCP transport listens on (0: any free port).
    :raises FieldError: ``tcp_port`` is taken or cannot be bound (naming ``averaging_port``, or ``host_maddrs``
        for port 0 on a host that is not this machine's).
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        prefix: str,
        tensors: Sequence[torch.Tensor],
        compression: Compression = "none",
        matchmaking_time: float,
        averaging_timeout: float,
        target_group_size: int | None = None,
        grace: float = 3.0,
        startup_timeout: float = 60.0,
        transport: Transport = "tcp",
        tcp_host: str = "0.0.0.0",
        tcp_port: int = 0,
        match_only: bool = False,
    ):
        if "." in prefix or not prefix:
            raise ValueError(f"averaging prefix must be non-empty and contain no '.': {prefix!r}")
        if compression not in WIRE_FORMATS:
            raise ValueError(f"compression must be one of {sorted(WIRE_FORMATS)}, got {compression!r}")
        if WIRE_FORMATS[compression].hivemind is None and not match_only:
            raise ValueError(f"compression {compression!r} travels only in rounds of whole groups (match_only)")
        if matchmaking_time <= 0 or averaging_timeout <= 0:
            raise ValueError("matchmaking_time and averaging_timeout must be positive (seconds)")
        if transport not in ("tcp", "p2pd"):
            raise ValueError(f"transport must be 'tcp' or 'p2pd', got {transport!r}")
        for tensor in tensors:
            _check_cpu_float32(tensor)
        self._shapes = [tuple(tensor.shape) for tensor in tensors]
        listening = listen(tcp_host, tcp_port) if transport == "tcp" and not match_only else None
        # where groupmates connect: the hosts this peer's DHT announces, with the transport's port
        hosts = announced_hosts(dht.get_visible_maddrs())
        self._gather = None if listening is None else {"tcp": [hosts, listening.getsockname()[1]]}
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.grace = min(grace, matchmaking_time / 2)
        self.target_group_size = self._expected = target_group_size
        try:
            self._averager = ExactAverager(
                [tensor.detach().clone() for tensor in tensors],
                dht,
                listen_socket=listening,
                wire=WIRE_FORMATS[compression],
                match_only=match_only,
                start=False,
                prefix=prefix,
                target_group_size=target_group_size,
                min_group_size=2,  # a lone peer is handled here (by cancelling), never as a group of one
                min_matchmaking_time=matchmaking_time,
                request_timeout=min(3.0, matchmaking_time / 2),  # hivemind: must be < min_matchmaking_time
                allreduce_timeout=averaging_timeout,
                next_chunk_timeout=averaging_timeout / 4,  # drop a silent groupmate before the round times out
                allow_state_sharing=False,
            )
            self._averager.start()
        finally:
            if listening is not None:
                listening.close()  # the averager process holds its own copy
        try:
            self._averager.wait_until_ready(timeout=startup_timeout)
        except BaseException:
            self.shutdown()
            raise

    def expect(self, groups: int) -> None:
        """The groups (this one included) expected in the next round: matchmaking closes once they are all in,
        instead of waiting out ``matchmaking_time`` for groups that are gone. Between 2 and the size given at
        construction; a peer told too few would turn later ones away, so callers count generously."""
        size = max(2, min(groups, self.target_group_size or groups))
        if size != self._expected:
            self._averager.set_target_group_size(size)
            self._expected = size

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        round_index: int | None = None,
        weight: float = 1.0,
        stop: Callable[[], bool] = lambda: False,
    ) -> RoundReport:
        """Average ``tensors`` in place with the peers that are ready; never raises on network failures.

        :param tensors: CPU float32 tensors with the shapes given at construction.
        :param round_index: when given, only peers averaging the same round index meet (e.g. the outer step, so
            that a group that fell behind never mixes its pseudo-gradient into another step's average).
        :param weight: this peer's weight in the average; 0 takes the others' average and adds nothing.
        :param stop: polled while waiting; once it returns True the round is given up (``ok=False``).
        :returns: the report; on ``ok=False`` or ``num_peers == 1`` the tensors were not modified. The round
            ends within about ``matchmaking_time + averaging_timeout + grace`` seconds whatever the peers do.
        """
        if [tuple(tensor.shape) for tensor in tensors] != self._shapes:
            raise ValueError(f"expected tensors of shapes {self._shapes}")
        for tensor in tensors:
            _check_cpu_float32(tensor)
        started = time.monotonic()
        with self._averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, tensors):
                buffer.copy_(tensor)
        stats = self._averager.stats
        control = self._start_step(round_index, weight, self._gather)
        ok, num_peers, allreduce_s = self._finish_round(control, tensors, stop, started)
        transport = "" if num_peers < 2 else ("tcp" if stats.over_tcp else "p2pd")
        raw = self._averager.matched_id.raw
        return RoundReport(
            num_peers, time.monotonic() - started, stats.bytes_sent, stats.bytes_received, ok,
            rejected=stats.rejected, transport=transport, allreduce_seconds=allreduce_s, dropped=stats.dropped,
            round_id=round_id(raw[1 : 1 + raw[0]]) if num_peers > 1 else "",
        )  # fmt: skip

    def _start_step(self, round_index: int | None, weight: float, gather: object) -> StepControl:
        """Clear the round's figures and enter matchmaking, under ``<prefix>.0b<round bits>`` when a round index is
        given; the all-reduce waits for our trigger, so giving up cannot race with it."""
        if round_index is not None:
            self._averager.set_group_bits(format(round_index % 2**ROUND_BITS, f"0{ROUND_BITS}b"))
        self._averager.stats.clear()
        self._averager.matched_id.raw = bytes(1 + GROUP_ID_MAX)  # no group yet: a failed round names none
        return self._averager.step(
            weight=weight, timeout=self.matchmaking_time + self.averaging_timeout, allow_retries=True, gather=gather,
            require_trigger=True, wait=False,
        )  # fmt: skip

    def _finish_round(
        self, control: StepControl, tensors: Sequence[torch.Tensor], stop: Callable[[], bool], started: float
    ) -> tuple[bool, int, float]:
        """Trigger the all-reduce once a group is formed, or give up when nobody came. Returns (ok, num_peers,
        seconds from the group's forming to the result)."""
        grouped = self._trigger_when_grouped(control, time.monotonic() + self.matchmaking_time + self.grace, stop)
        if grouped is None:
            return False, 0, 0.0  # stopped
        if not grouped:
            return True, 1, 0.0
        formed = time.monotonic()
        deadline = started + self.matchmaking_time + self.averaging_timeout + self.grace
        while not control.done() and not stop() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not control.done():
            _cancel(control)
            logger.warning("averaging round stopped" if stop() else "averaging round timed out")
        try:
            gathered = control.result(timeout=5.0)
        except Exception as e:  # TimeoutError, AllreduceException, MatchmakingException, CancelledError, ...
            _cancel(control)
            logger.warning(f"averaging round failed, tensors left unchanged: {type(e).__name__}: {e}")
            return False, int(self._averager.stats.group_size), time.monotonic() - formed
        if self._averager.stats.over_tcp:  # over TCP the result is in tcp_out, flat
            tcp.unflatten_into(self._averager.tcp_out, list(tensors))
        else:
            with self._averager.get_tensors() as buffers:
                for buffer, tensor in zip(buffers, tensors):
                    tensor.copy_(buffer)
        return True, len(gathered), time.monotonic() - formed

    def match(self, round_index: int, gather: object, stop: Callable[[], bool] = lambda: False
              ) -> tuple[Match | None, RoundReport]:  # fmt: skip
        """Form this round's group and gather what every member brings (an averager made with ``match_only``); no
        tensor bytes move. Returns (the match, a report of the matchmaking); no match when nobody else came
        (``num_peers`` 1) or it failed or was stopped (``ok`` False)."""
        started = time.monotonic()
        control = self._start_step(round_index, 1.0, gather)
        grouped = self._trigger_when_grouped(control, time.monotonic() + self.matchmaking_time + self.grace, stop)
        if not grouped:
            return None, RoundReport(1 if grouped is False else 0, time.monotonic() - started, 0, 0, grouped is False)
        try:
            gathered = control.result(timeout=self.averaging_timeout)
        except Exception as e:  # TimeoutError, AllreduceException, MatchmakingException, CancelledError, ...
            _cancel(control)
            logger.warning(f"matchmaking failed: {type(e).__name__}: {e}")
            size = int(self._averager.stats.group_size)
            return None, RoundReport(size, time.monotonic() - started, 0, 0, False)
        raw = self._averager.matched_id.raw
        peers = [peer.to_base58() for peer in gathered]
        match = Match(raw[1 : 1 + raw[0]], list(gathered.values()), peers.index(self.peer_id))
        return match, RoundReport(len(peers), time.monotonic() - started, 0, 0, True)

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
        _cancel(control)
        # let the averager process leave matchmaking before the next round starts
        deadline = time.monotonic() + 5.0
        while control.stage != AveragingStage.FINISHED and time.monotonic() < deadline:
            time.sleep(0.005)
        return None if stop() else False

    @property
    def peer_id(self) -> str:
        """This averager's peer id (base58): the id of the DHT daemon it shares."""
        return self._averager.dht.peer_id.to_base58()

    def shutdown(self) -> None:
        """Stop the averager process (idempotent). The DHT stays up."""
        if self._averager.is_alive():
            self._averager.shutdown()

    def __enter__(self) -> SwarmAverager:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _cancel(control: StepControl) -> None:
    """Cancel a step that may have finished meanwhile (cancelling twice raises in hivemind)."""
    if not control.done():
        try:
            control.cancel()
        except InvalidStateError:
            pass


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` for the transport; `FieldError` naming the flag when it cannot."""
    try:
        return listen_socket(host, port)
    except OSError as e:
        why = e.strerror or str(e)
        field = "averaging_port" if port else "host_maddrs"  # port 0 fails only for a host not on this machine
        message = f"{{{field}}}: cannot listen on {host} port {port}: {why[:1].lower()}{why[1:]}"
        raise FieldError(message, per_rank=True) from None


def _check_cpu_float32(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
        raise ValueError(f"SwarmAverager averages CPU float32 tensors, got {tensor.dtype} on {tensor.device}")
