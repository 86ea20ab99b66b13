"""A DHT peer that lost every other peer finds the swarm again through its initial peers.

hivemind drops a peer from its routing table at the first request it leaves unanswered, and meets peers again only
through requests. So when every peer it knows fails at once (its home link down for a minute, the relay it is
dialled through restarting, the bootstrap peer restarting), its table empties and stays empty: it stores and finds
nothing for the rest of the run, and its group trains alone. ``keep_joined`` checks every ``CHECK_S`` and, while the
table is empty, connects to the initial peers and pings them, as the peer's start did; one that answers is back in
the table, and with it the rest of the swarm (a lookup of the peer's own id refills its neighbours).

hivemind is pinned to 1.1.12; this relies on ``DHT.run_coroutine``, ``DHTNode.protocol`` (its ``routing_table``'s
``uid_to_peer_id`` and ``call_ping``), ``DHTNode.find_nearest_nodes``, ``DHTNode.node_id`` and
``DHTNode.p2p._client.connect`` (p2pd's connect command).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

from diloco.swarm.records.addresses import without_p2p

log = logging.getLogger("diloco")

CHECK_S = 5.0
CONNECT_TIMEOUT_S = 5.0


def keep_joined(dht: Any, initial_peers: Sequence[str]) -> None:
    """From now on, in `dht`'s process: rejoin through `initial_peers` (multiaddrs with ``/p2p/``) whenever its
    routing table is empty. Returns at once; ends with the DHT process."""
    if initial_peers:
        dht.run_coroutine(partial(_start, list(initial_peers)))


async def _start(initial_peers: list[str], _dht: Any, node: Any) -> None:
    asyncio.get_running_loop().create_task(_watch(initial_peers, node))


async def _watch(initial_peers: list[str], node: Any) -> None:
    while True:
        await asyncio.sleep(CHECK_S)
        with contextlib.suppress(Exception):  # a rejoin that fails is tried again at the next check
            if not node.protocol.routing_table.uid_to_peer_id and await _rejoin(initial_peers, node):
                log.info("the DHT peer lost every other peer and found the swarm again through its initial peers")


async def _rejoin(initial_peers: list[str], node: Any) -> bool:
    """Connect to and ping every initial peer; whether one answered."""
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    async def ping(maddr: str) -> bool:
        with contextlib.suppress(Exception):  # unreachable, not a DHT peer: the others may do
            address = Multiaddr(maddr)
            peer = PeerID.from_base58(address.value_for_protocol("p2p"))
            transport = Multiaddr(without_p2p(maddr))
            await asyncio.wait_for(node.p2p._client.connect(peer, [transport]), CONNECT_TIMEOUT_S)
            return await node.protocol.call_ping(peer, validate=False, strict=False) is not None
        return False

    answered = any(await asyncio.gather(*(ping(m) for m in initial_peers)))
    if answered:
        with contextlib.suppress(Exception):
            await node.find_nearest_nodes([node.node_id])
    return answered
