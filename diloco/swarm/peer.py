"""One trainer rank's place in the swarm: its DHT peer (with p2pd), its averager, and the worker groups' progress
records (``diloco.swarm.progress``). ``SwarmPeer`` is the ``diloco.membership.Swarm`` the outer loop talks to."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import hivemind
import torch
from hivemind.p2p import PeerID

from diloco.swarm import progress
from diloco.swarm.averager import RoundReport, SwarmAverager
from diloco.swarm.progress import Progress

State = tuple[dict, list[torch.Tensor]]


class SwarmPeer:
    """Implements ``diloco.membership.Swarm``; ``shutdown`` stops the averager, then the DHT.

    :param dht: this rank's running DHT peer (owned from now on).
    :param averager: averages with the same rank of the other groups (owned from now on).
    :param progress_key: DHT key of the groups' progress records (``progress.progress_key``).
    :param request_timeout: seconds to wait for a peer's answer (a ping, each message of a state download).
    """

    def __init__(self, dht: hivemind.DHT, averager: SwarmAverager, progress_key: str, request_timeout: float):
        self.dht, self.averager = dht, averager
        self.progress_key, self.request_timeout = progress_key, request_timeout
        self.peer_id = averager.peer_id

    def average(
        self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: Callable[[], bool]
    ) -> RoundReport:
        return self.averager.average(tensors, round_index=round_index, weight=weight, stop=stop)

    def publish(self, record: Progress) -> None:
        progress.publish(self.dht, self.progress_key, record)

    def records(self) -> list[Progress]:
        return progress.read(self.dht, self.progress_key)

    def alive(self, peer_id: str) -> bool:
        try:
            return bool(self.dht.run_coroutine(partial(_ping, peer_id)))
        except Exception:  # a malformed peer id, a DHT that is shutting down
            return False

    def serve_state(self, provider: Callable[[], State]) -> None:
        self.averager.serve_state(provider)

    def download_state(self, peer_id: str) -> State | None:
        return self.averager.download_state(peer_id, self.request_timeout)

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        finally:
            self.dht.shutdown()


async def _ping(peer_id: str, dht: hivemind.DHT, node: hivemind.DHTNode) -> bool:
    """Runs in the DHT process: whether the peer answers a DHT ping (within the protocol's wait timeout)."""
    return await node.protocol.call_ping(PeerID.from_base58(peer_id)) is not None
