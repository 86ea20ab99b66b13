"""Scratch run (docs/outer-step.md, "Why not libp2p's relay"): can two peers behind home routers reach each other
through the bootstrap peer's libp2p relay, and how much does a relayed stream carry?

A public host runs the bootstrap DHT (its daemon started with the relay flags given, if any); behind each of two
routers (``diloco.bench.routers``) a hivemind DHT client with autorelay, the bootstrap peer as its trusted relay and
its reachability forced to private. Peer "a" dials peer "b" through the relay every 5 s until a circuit opens, then
sends `--megabytes` on one stream; "b" counts what arrives. Prints when the circuit opened and how many bytes crossed.
Run from the repository root, as root (namespaces):
PYTHONPATH=. python docs/bench/scratch/relay_probe.py [--relay-flags] [--megabytes N]"""

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

PROTOCOL = "/relay-probe/1"
CHUNK = 1 << 16
RELAY_FLAGS = {"dhtServer": 1, "relayService": 1, "relayDataLimit": 1 << 34, "relayTimeLimit": "1h"}


def bootstrap(ip: str, relay_flags: bool, out: Path) -> None:
    import hivemind
    from hivemind.p2p import P2P

    if relay_flags:  # (the daemon's flags come from this mapping: the server mode's, plus the relay's limits)
        P2P.DHT_MODE_MAPPING["server"] = dict(RELAY_FLAGS)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/0.0.0.0/tcp/31337"], announce_maddrs=[f"/ip4/{ip}/tcp/31337"])
    out.write_text(str(dht.get_visible_maddrs()[0]))
    time.sleep(600)


async def home(role: str, boot: str, work: Path, megabytes: int) -> None:
    import hivemind
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    dht = hivemind.DHT(initial_peers=[boot], client_mode=True, start=True, host_maddrs=["/ip4/0.0.0.0/tcp/0"],
                       use_auto_relay=True, force_reachability="private", trusted_relays=[boot])  # fmt: skip
    p2p = await dht.replicate_p2p()
    total = megabytes << 20

    async def receive(_info, reader, writer) -> None:
        got = 0
        try:
            while got < total and (chunk := await reader.read(CHUNK)):
                got += len(chunk)
        except Exception as e:  # noqa: BLE001 - a reset stream: report what crossed
            print(f"b: stream ended after {got} bytes: {type(e).__name__}", flush=True)
            return
        print(f"b: {got} of {total} bytes arrived, then the stream ended", flush=True)
        writer.close()

    await p2p.add_binary_stream_handler(PROTOCOL, receive)
    (work / role).write_text(p2p.peer_id.to_base58())
    started = time.monotonic()
    if role == "b":
        await asyncio.sleep(330)
        return
    while time.monotonic() - started < 300:
        await asyncio.sleep(5)
        other = (work / "b").read_text().strip() if (work / "b").exists() else ""
        if not other:
            continue
        try:  # (hivemind's P2P has no public connect: its daemon client's)
            await p2p._client.connect(PeerID.from_base58(other), [Multiaddr(f"{boot}/p2p-circuit/p2p/{other}")])
        except Exception:  # noqa: BLE001 - NO_RESERVATION until b's autorelay reserved its slot
            continue
        print(f"a: circuit to b open {time.monotonic() - started:.0f} s after start", flush=True)
        _, _, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(other), PROTOCOL)
        sent = 0
        try:
            while sent < total:
                writer.write(b"x" * CHUNK)
                await writer.drain()
                sent += CHUNK
        except Exception as e:  # noqa: BLE001
            print(f"a: sending failed after {sent} bytes: {type(e).__name__}: {e}", flush=True)
        await asyncio.sleep(3)
        return
    print("a: no circuit to b in 300 s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--relay-flags", action="store_true", help=f"start the relay's daemon with {RELAY_FLAGS}")
    parser.add_argument("--megabytes", type=int, default=8)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--arg", help=argparse.SUPPRESS)
    parser.add_argument("--work", default="/tmp/relay-probe")
    args = parser.parse_args()
    work = Path(args.work)
    if args.role == "boot":
        return bootstrap(args.arg, args.relay_flags, work / "boot")
    if args.role:
        return asyncio.run(home(args.role, args.arg, work, args.megabytes))

    from diloco.bench.routers import routed

    work.mkdir(parents=True, exist_ok=True)
    for name in ("boot", "a", "b"):
        (work / name).unlink(missing_ok=True)
    me = [sys.executable, __file__, "--work", str(work), "--megabytes", str(args.megabytes)]
    with routed(public=1, homes=2) as topology:
        public = topology.public[0]
        procs = [subprocess.Popen([*public.prefix(), *me, "--role", "boot", "--arg", public.ip]
                                  + (["--relay-flags"] if args.relay_flags else []))]  # fmt: skip
        try:
            while not (work / "boot").exists():
                time.sleep(0.5)
            boot = (work / "boot").read_text()
            for role, place in (("b", topology.homes[1]), ("a", topology.homes[0])):
                procs.append(subprocess.Popen([*place.host.prefix(), *me, "--role", role, "--arg", boot]))
            procs[-1].wait(timeout=400)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
