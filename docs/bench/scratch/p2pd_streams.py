"""Scratch run (docs/allreduce.md): what two p2pd daemons carry at all on this machine, with nothing else running:
400 MiB over one libp2p stream one way, then one stream each way at once (what a round of two peers asks of them).
Arguments are extra p2pd flags, e.g. `-muxer=mplex` or `-tls=false` (Noise then secures the connection).
Run from the repository root: PYTHONPATH=. python docs/bench/scratch/p2pd_streams.py [P2PD_FLAG ...]"""

import asyncio
import sys
import time

from hivemind.p2p import P2P

PAYLOAD, CHUNK = 400 << 20, 1 << 20


def with_flags(flags: list[str]) -> None:
    """Every daemon `P2P.create` starts from now on gets `flags` after hivemind's own."""
    make = P2P._make_process_args
    P2P._make_process_args = staticmethod(lambda *a, **k: make(*a, **k) + flags)


async def transfer(peers: list[tuple[P2P, P2P]]) -> float:
    """Send PAYLOAD bytes from each (source, sink) pair's source to its sink at once; seconds until every sink has
    read them all."""
    received: dict[P2P, asyncio.Event] = {}

    def sink_of(p2p: P2P):
        async def sink(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got = 0
            while got < PAYLOAD and (data := await reader.read(CHUNK)):
                got += len(data)
            writer.close()
            received[p2p].set()

        return sink

    for _, sink in peers:
        received[sink] = asyncio.Event()
        await sink.add_binary_stream_handler("sink", sink_of(sink))

    async def send(source: P2P, sink: P2P) -> None:
        _, _, writer = await source.call_binary_stream_handler(sink.peer_id, "sink")
        chunk = bytes(CHUNK)
        for _ in range(PAYLOAD // CHUNK):
            writer.write(chunk)
            await writer.drain()
        await received[sink].wait()

    start = time.perf_counter()
    await asyncio.gather(*(send(source, sink) for source, sink in peers))
    seconds = time.perf_counter() - start
    for _, sink in peers:
        await sink.remove_binary_stream_handler("sink")
    return seconds


async def main(flags: list[str]) -> None:
    with_flags(flags)
    a = await P2P.create()
    b = await P2P.create(initial_peers=await a.get_visible_maddrs())
    try:
        one = await transfer([(b, a)])
        both = await transfer([(b, a), (a, b)])
    finally:
        await b.shutdown()
        await a.shutdown()
    print(f"p2pd flags {flags or 'none'}: one stream one way {PAYLOAD / one / 1e6:.0f} MB/s; one stream each way at "
          f"once {PAYLOAD / both / 1e6:.0f} MB/s per direction")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
