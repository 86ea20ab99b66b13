"""hivemind's libp2p all-reduce, made exact: after a round every groupmate holds the very same bytes, and reducers
screen what they average as the TCP transport does.

Used for groups with a ``--hv.transport p2pd`` member (libp2p streams, encrypted; several times slower than
TCP). hivemind is pinned to 1.1.12, and this module subclasses its internals. It relies on these private names:

* ``AllReduceRunner``: ``_communicate_with_peer`` (its own-part branch), ``_accumulate_parts_streaming``
  (the reducer's reply stream), ``_get_peer_stub``, ``_ban_sender``, and the attributes ``tensor_part_container``
  (``return_deltas``, ``failed_size``, ``total_size``, ``compression``, ``prefetch``, ``_input_parts_by_peer``),
  ``tensor_part_reducer``, ``parts_for_local_averaging``, ``sender_peer_ids``, ``ordered_peer_ids``, ``peer_id``,
  ``weight`` and ``banned_senders``; ``TensorPartReducer.sender_failed_after``, ``finished``, ``num_parts`` and
  ``accumulate_part``.
* ``TensorPartContainer``: ``iterate_output_tensors`` is replaced (``_PartsContainer``) by a copy of its loop over
  ``local_tensors``, ``num_parts_by_tensor``, ``num_parts_by_peer``, ``_output_parts_by_peer``,
  ``_output_part_available``, ``_outputs_consumed`` and ``finished`` that yields each tensor's parts unjoined;
  ``register_processed_part`` and ``register_failed_reducer`` are called.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import AsyncIterator, Callable

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import (
    AllreduceException,
    BannedException,
    TensorPartContainer,
)
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor

from diloco.swarm.rounds.screening import (
    all_finite,
    part_norm,
    reference_norm,
    rejection,
)

logger = logging.getLogger(__name__)


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce after which every peer of the group holds the very same bytes.

    Stock hivemind sends each sender ``compress(average - its_part)`` and adds it to the local tensor, so peers end
    up with different rounding (and different quantization errors). Here each reducer encodes its averaged part
    once (with the part's compression), sends those bytes to every sender, decodes the same bytes for its own
    part, and the outputs are the decoded averages themselves (to be copied, not added).

    Outputs of a reducer that failed are this peer's own inputs (not zeros) and are counted in
    ``tensor_part_container.failed_size``; the caller must treat a nonzero value as a failed round. The runner
    yields, per tensor, the list of its averaged parts in order (``_PartsContainer``), not one joined tensor.
    ``bytes_sent`` / ``bytes_received`` count serialized messages of this run.

    Screening (reducer side): before a contribution (a sender's part, our own included) is added to the average
    of one of our parts, it is rejected (``screening.rejection``) if it holds NaN/Inf, its weight is not a finite
    number >= 0, or its L2 norm exceeds ``screening.MAX_NORM_RATIO`` times the reference norm of that part
    (``screening.reference_norm``): the lower median of the norms of the finite contributions of all senders to
    the same part (a part is judged once every sender delivered it or was banned; the whole part cannot be
    averaged before that anyway). A rejected sender is banned for the rest of
    the run (hivemind's ban path: the remaining senders are averaged, the banned one gets a truncated reply and
    fails its round). Rejecting our own contribution is what keeps a bad peer from poisoning the part it
    reduces: it still averages the others' parts, then fails its own round. Parts of a sender accepted before
    its bad part was seen stay in their averages, which every groupmate receives alike, so the groupmates that
    complete still hold identical bytes. ``rejected`` counts the senders rejected here.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        container = self.tensor_part_container
        container.return_deltas = False  # only read by register_failed_reducer: fall back to our input
        container.__class__ = _PartsContainer  # outputs as lists of parts: no full-size torch.cat per tensor
        own_parts = container._input_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]
        self._part_infos = tuple(info for _, info in own_parts)
        self._encoded: dict[int, asyncio.Future] = {}  # part index -> encoded average (a sliding window of two)
        self._oldest_kept_part = 0
        self.bytes_sent = self.bytes_received = 0
        self.rejected = 0
        # part index -> {sender index: L2 norm of its contribution (nan/inf: non-finite values)}
        self._norms: list[dict[int, float]] = [{} for _ in range(self.tensor_part_reducer.num_parts)]
        self._reference_norms: dict[int, float] = {}  # part index -> lower median of the finite norms
        self._progress = asyncio.Event()  # set (and replaced) whenever a norm is recorded or a sender is banned

    async def _encode_average(self, part_index: int, averaged_part: torch.Tensor) -> runtime_pb2.Tensor:
        """Encode the average of one of our parts exactly once; every caller gets the same message."""
        if part_index not in self._encoded:
            if part_index < self._oldest_kept_part:
                raise AllreduceException(f"result of part {part_index} was requested after it was dropped")
            # a peer asking for part k has fetched part k-1 (each sender's stream is sequential), so older
            # results can go: this keeps at most two encoded parts in memory
            self._oldest_kept_part = max(self._oldest_kept_part, part_index - 1)
            for old in [index for index in self._encoded if index < self._oldest_kept_part]:
                del self._encoded[old]
            compress = self.tensor_part_container.compression.compress
            self._encoded[part_index] = asyncio.get_running_loop().run_in_executor(
                None, compress, averaged_part, self._part_infos[part_index], False
            )
        return await self._encoded[part_index]

    async def _communicate_with_peer(self, peer_id: PeerID):
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        # our own part: use the decoded bytes the others receive, not the exact average
        peer_index = self.ordered_peer_ids.index(self.peer_id)
        sender_index = self.sender_peer_ids.index(self.peer_id)
        loop = asyncio.get_running_loop()
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            reason = await self._screen(sender_index, part_index, part_norm(tensor_part), self.weight)
            if reason is not None:
                await self._reject(sender_index, part_index, reason)
                # keep reducing the others' parts (their rpc streams need the reducer), then fail our round
                await self._wait_until(self._all_senders_banned)
                self.tensor_part_container.register_failed_reducer(peer_index)
                return
            averaged_part = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            encoded = await self._encode_average(part_index, averaged_part)
            decoded = await loop.run_in_executor(None, deserialize_torch_tensor, encoded)
            self.tensor_part_container.register_processed_part(peer_index, part_index, decoded)

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Reducer side: add a sender's parts to the running averages, reply with the encoded averages."""
        part_index = 0

        def decode(msg: averaging_pb2.AveragingData) -> tuple[torch.Tensor, float, float]:
            tensor_part = deserialize_torch_tensor(msg.tensor_part)
            return tensor_part, msg.weight, part_norm(tensor_part)

        try:
            async for tensor_part, weight, norm in amap_in_executor(
                decode, self._count_received(stream), max_prefetch=self.tensor_part_container.prefetch
            ):
                reason = await self._screen(sender_index, part_index, norm, weight)
                if reason is not None:
                    await self._reject(sender_index, part_index, reason)
                    break  # the sender's reply stream ends short: its round fails
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    logger.debug(f"sender {sender_index} is already banned")
                    break
                encoded = await self._encode_average(part_index - 1, averaged_part)
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
                self.bytes_sent += reply.ByteSize()
                yield reply
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def _screen(self, sender_index: int, part_index: int, norm: float, weight: float) -> str | None:
        """Record a sender's contribution to one of our parts; once all senders' are known, say why to reject it."""
        reducer = self.tensor_part_reducer
        if reducer.sender_failed_after[sender_index] != float("inf"):
            return None  # banned meanwhile: accumulate_part raises BannedException
        norms = self._norms[part_index]
        norms[sender_index] = norm
        self._notify()
        # every sender has delivered this part or was banned (then it never will): the set of norms is final
        await self._wait_until(
            lambda: all(
                index in norms or after != float("inf") for index, after in enumerate(reducer.sender_failed_after)
            )
        )
        if part_index not in self._reference_norms:
            self._reference_norms[part_index] = reference_norm(norms.values())
        return rejection(norm, weight, self._reference_norms[part_index])

    async def _reject(self, sender_index: int, part_index: int, reason: str) -> None:
        peer_id = self.sender_peer_ids[sender_index]
        if peer_id in self.banned_senders:
            return
        self.rejected += 1
        who = "our own contribution" if peer_id == self.peer_id else f"the contribution of peer {peer_id}"
        logger.warning(f"averaging: rejected {who} from part {part_index} on ({reason}); averaging without it")
        await self._ban_sender(peer_id)

    async def _ban_sender(self, peer_id: PeerID):
        await super()._ban_sender(peer_id)
        self._notify()

    def _all_senders_banned(self) -> bool:
        return all(after != float("inf") for after in self.tensor_part_reducer.sender_failed_after)

    def _notify(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    async def _wait_until(self, condition: Callable[[], bool]) -> None:
        """Wait until ``condition()`` holds (checked after each recorded norm or ban) or the reducer is finished."""
        finished = self.tensor_part_reducer.finished
        while not condition() and not finished.is_set():
            waiters = {asyncio.ensure_future(self._progress.wait()), asyncio.ensure_future(finished.wait())}
            try:
                # re-check now and then too: hivemind can fail a sender without going through _ban_sender
                await asyncio.wait(waiters, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    def _get_peer_stub(self, peer: PeerID) -> _CountingStub:
        return _CountingStub(super()._get_peer_stub(peer), self)

    async def _count_received(self, stream: AsyncIterator) -> AsyncIterator:
        async for msg in stream:
            self.bytes_received += msg.ByteSize()
            yield msg

    async def _count_sent(self, stream: AsyncIterator) -> AsyncIterator:
        async for msg in stream:
            self.bytes_sent += msg.ByteSize()
            yield msg


class _PartsContainer(TensorPartContainer):
    """hivemind's TensorPartContainer whose output iterator yields each tensor's averaged parts as a list, in
    order, instead of ``torch.cat`` of them: the averager copies them into its tensor at the end, which saves a
    full-size allocation (and its page faults) and one pass over the data per round. Set on a container by
    ``ExactAllReduceRunner`` (``__class__``); the loop is hivemind 1.1.12's ``iterate_output_tensors``."""

    async def iterate_output_tensors(self) -> AsyncIterator[list[torch.Tensor]]:
        assert not self._outputs_consumed, "output tensors are already iterated and no longer available."
        self._outputs_consumed = True
        peer_index = num_parts_processed = 0
        for tensor_index in range(len(self.local_tensors)):
            tensor_parts = []
            while len(tensor_parts) < self.num_parts_by_tensor[tensor_index]:
                if num_parts_processed >= self.num_parts_by_peer[peer_index]:
                    num_parts_processed = 0
                    peer_index += 1
                    continue
                if not self._output_parts_by_peer[peer_index]:
                    self._output_part_available[peer_index].clear()
                    await self._output_part_available[peer_index].wait()
                    if self.finished.is_set():
                        raise AllreduceException("All-reduce was terminated during iteration")
                tensor_parts.append(self._output_parts_by_peer[peer_index].popleft())
                num_parts_processed += 1
            yield tensor_parts


class _CountingStub:
    """Wraps a groupmate's stub so that the sender side of ``rpc_aggregate_part`` is counted in both directions."""

    def __init__(self, stub, runner: ExactAllReduceRunner):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, requests: AsyncIterator) -> AsyncIterator:
        replies = await self._stub.rpc_aggregate_part(self._runner._count_sent(requests))
        return self._runner._count_received(replies)


async def average_into(runner: ExactAllReduceRunner, tensors: Sequence[torch.Tensor]) -> None:
    """Run the all-reduce and copy its result into ``tensors``, or raise ``AllreduceException`` and leave them
    untouched: all results are kept until the end, so a failure changes nothing (a retry re-sends the inputs)."""
    averaged = [parts async for parts in runner]
    failed = runner.tensor_part_container.failed_size
    if failed:
        raise AllreduceException(f"{failed} of {runner.tensor_part_container.total_size} values not averaged")
    # reducers screen what they average; this catches one that does not (another version, a bad actor)
    if not all(all_finite(part) for parts in averaged for part in parts):
        raise AllreduceException("a groupmate returned non-finite averages")
    for tensor, parts in zip(tensors, averaged):
        torch.cat(parts, out=tensor.view(-1))  # straight into the tensor, no full-size temporary
