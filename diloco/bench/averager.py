"""Rank-by-rank averaging rounds: one tensor per peer averaged through hivemind's matchmaking, its bytes over plain TCP
(``diloco.swarm.rounds.tcp``) or hivemind's libp2p streams (``diloco.bench.libp2p``). The benches' ``tcp`` and
``p2pd`` arms measure these transports with it; the trainer averages whole groups instead (the matchmaker of
``diloco.swarm.rounds.matchmaker`` forms the round, ``group_round`` moves the bytes).

``SwarmAverager`` averages a fixed list of tensors with whoever is ready and leaves every groupmate bit-identical; it
never raises on network failures and reports what happened (``RoundReport``). Its process (``FullAverager``) extends
the matchmaker's with the round itself. Beside the names ``matchmaker`` lists, it relies on these private names of
hivemind 1.1.12: ``GroupInfo.gathered`` (per peer: ``serializer.dumps([bandwidth, mode, serializer.dumps(gather)])``,
in ``peer_ids`` order), ``allreduce_kwargs``, ``_allreduce_timeout``, ``get_tensors``, ``serializer``, and
``hivemind.compression.serialization._BASE_COMPRESSION_TYPES``, the decoder registry, patched inside the averager
process only (``FullAverager.run``) because the stock 8-bit decoder fails on numpy >= 2.4.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import socket
import time
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Literal

import hivemind
import torch
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import NoCompression
from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES
from hivemind.proto import averaging_pb2

from diloco.bench.libp2p import ExactAllReduceRunner, average_into
from diloco.swarm.records.addresses import announced_hosts
from diloco.swarm.rounds import tcp
from diloco.swarm.rounds.codecs import WIRE_FORMATS, Uniform8Bit, WireFormat
from diloco.swarm.rounds.listener import Listener, listen
from diloco.swarm.rounds.matchmaker import (
    ExactAverager,
    Matchmaker,
    RoundStats,
    cancel,
)
from diloco.swarm.rounds.report import RoundReport, round_id
from diloco.swarm.rounds.screening import all_finite

logger = logging.getLogger(__name__)

Compression = Literal["none", "fp16", "int8", "int4"]
Transport = Literal["tcp", "p2pd"]


class FullStats(RoundStats):
    """The figures of one full round, in shared memory: the averager process writes them, the caller reads them.
    Bytes and rejections add up over the attempts of a round (hivemind retries a failed all-reduce)."""

    _fields_ = [
        ("bytes_sent", ctypes.c_int64),  # serialized bytes this peer sent (tensor parts and averaged parts)
        ("bytes_received", ctypes.c_int64),
        ("rejected", ctypes.c_int64),  # contributions this peer, as a reducer, left out
        ("over_tcp", ctypes.c_int64),  # 1: the last all-reduce went over TCP (its result is in ``tcp_out``)
        ("dropped", ctypes.c_int64),  # groupmates this peer, as a reducer, left out for their frames or silence
    ]

    def add(self, sent: int, received: int, rejected: int, dropped: int = 0) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.rejected += rejected
        self.dropped += dropped


class FullAverager(ExactAverager):
    """The matchmaker's averager process, plus the round: it overwrites all local tensors with the group average or,
    if any part could not be averaged, leaves them untouched and fails (so ``step`` retries or raises instead of
    returning mixed results). Peers only group with other ``FullAverager`` peers: RPC names include the class name.

    The bytes of a round travel over plain TCP when every groupmate gathered a TCP endpoint
    (``step(gather={"tcp": [hosts, port]})``), otherwise over libp2p; both screen alike.

    :param listen_socket: a listening socket for the TCP transport (``listener.listen_socket``), taken over by the
        averager process; None: this averager only averages over libp2p.
    :param wire: the wire format of parts and averages, on both transports.
    """

    _rpc_handlers = None
    _stub_type = None
    stats_type = FullStats

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: hivemind.DHT,
        listen_socket: socket.socket | None = None,
        wire: WireFormat = WIRE_FORMATS["none"],
        **kwargs,
    ):
        self.wire = wire
        self._listen_socket = listen_socket  # inherited by the forked averager process
        self._listener: Listener | None = None
        # the TCP rounds' output, in shared memory (the caller copies its result from here: one copy fewer than
        # through the averaged tensors) and touched now (fresh pages in the first round cost more than a copy)
        numel = sum(tensor.numel() for tensor in averaged_tensors)
        self.tcp_out = torch.zeros(numel if listen_socket is not None else 0).share_memory_()
        super().__init__(averaged_tensors, dht, compression=wire.hivemind or NoCompression(), **kwargs)

    def prepare(self) -> None:
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

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ):
        group_id = self.formed(group_info, group_id)
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


class _TcpGroup:
    """Stands in for hivemind's ``AllReduceRunner`` in ``_running_groups`` while the group averages over TCP."""

    def __init__(self, round_: tcp.Round):
        self.round = round_

    def finalize(self, cancel: bool = False) -> set:
        self.round.abort()  # the averager shuts down: end the round's threads
        return set()

    async def rpc_aggregate_part(self, stream: AsyncIterator, context) -> AsyncIterator[averaging_pb2.AveragingData]:
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)  # no parts come over libp2p this round


class SwarmAverager(Matchmaker):
    """Averages a fixed list of CPU float32 tensors with every peer of the same ``prefix`` that is ready.

    After a successful round all peers of the group hold bit-identical tensors, for every compression. Takes
    ``Matchmaker``'s parameters, and:

    :param tensors: templates (shapes, float32, CPU) of the tensors passed to ``average``; they are copied.
    :param compression: wire format of tensor parts and averages: "none" (exact fp32), "fp16", or "int8"
        (``Uniform8Bit``: hivemind's uniform 8-bit quantization with its own codebook per 512 KiB part).
    :param averaging_timeout: seconds allowed for the all-reduce once a group is formed; a failed all-reduce
        is retried (with a new group) while the round is younger than ``matchmaking_time + averaging_timeout``.
    :param transport: what carries the tensor bytes once hivemind formed a group: "tcp" (plain TCP sockets
        between the groupmates; each peer must reach the others' announced addresses directly) or "p2pd"
        (hivemind's libp2p streams: encrypted, several times slower). A group with any
        "p2pd" member averages over libp2p.
    :param tcp_host: address the TCP transport listens on ("0.0.0.0": every interface).
    :param tcp_port: port the TCP transport listens on (0: any free port).
    :raises FieldError: ``tcp_port`` is taken or cannot be bound.
    """

    averager_type = FullAverager

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        prefix: str,
        tensors: Sequence[torch.Tensor],
        compression: Compression = "none",
        transport: Transport = "tcp",
        tcp_host: str = "0.0.0.0",
        tcp_port: int = 0,
        **matchmaking: object,
    ):
        if compression not in WIRE_FORMATS:
            raise ValueError(f"compression must be one of {sorted(WIRE_FORMATS)}, got {compression!r}")
        if WIRE_FORMATS[compression].hivemind is None:
            raise ValueError(f"compression {compression!r} travels only in rounds of whole groups")
        if transport not in ("tcp", "p2pd"):
            raise ValueError(f"transport must be 'tcp' or 'p2pd', got {transport!r}")
        for tensor in tensors:
            _check_cpu_float32(tensor)
        self._shapes = [tuple(tensor.shape) for tensor in tensors]
        listening = listen(tcp_host, tcp_port) if transport == "tcp" else None
        # where groupmates connect: the hosts this peer's DHT announces, with the transport's port
        hosts = announced_hosts(dht.get_visible_maddrs())
        self._gather = None if listening is None else {"tcp": [hosts, listening.getsockname()[1]]}
        try:
            super().__init__(dht, prefix=prefix, tensors=tensors, listen_socket=listening,
                             wire=WIRE_FORMATS[compression], **matchmaking)  # fmt: skip
        finally:
            if listening is not None:
                listening.close()  # the averager process holds its own copy

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
        return RoundReport(
            num_peers, time.monotonic() - started, stats.bytes_sent, stats.bytes_received, ok,
            rejected=stats.rejected, transport=transport, allreduce_seconds=allreduce_s, dropped=stats.dropped,
            round_id=round_id(self.matched_id()) if num_peers > 1 else "",
        )  # fmt: skip

    def _finish_round(
        self, control: StepControl, tensors: Sequence[torch.Tensor], stop: Callable[[], bool], started: float
    ) -> tuple[bool, int, float]:
        """Trigger the all-reduce once a group is formed, or give up when nobody came. Returns (ok, num_peers,
        seconds from the group's forming to the result)."""
        grouped = self._trigger_when_grouped(control, time.monotonic() + self.matchmaking_time + self.grace, stop)
        if not grouped:
            self._leave()
            return grouped is False, int(grouped is False), 0.0  # nobody came (ok, alone), or stopped
        formed = time.monotonic()
        deadline = started + self.matchmaking_time + self.averaging_timeout + self.grace
        while not control.done() and not stop() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not control.done():
            cancel(control)
            logger.warning("averaging round stopped" if stop() else "averaging round timed out")
        try:
            gathered = control.result(timeout=5.0)
        except Exception as e:  # TimeoutError, AllreduceException, MatchmakingException, CancelledError, ...
            cancel(control)
            logger.warning(f"averaging round failed, tensors left unchanged: {type(e).__name__}: {e}")
            return False, int(self._averager.stats.group_size), time.monotonic() - formed
        if self._averager.stats.over_tcp:  # over TCP the result is in tcp_out, flat
            tcp.unflatten_into(self._averager.tcp_out, list(tensors))
        else:
            with self._averager.get_tensors() as buffers:
                for buffer, tensor in zip(buffers, tensors):
                    tensor.copy_(buffer)
        return True, len(gathered), time.monotonic() - formed


def _check_cpu_float32(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
        raise ValueError(f"SwarmAverager averages CPU float32 tensors, got {tensor.dtype} on {tensor.device}")
