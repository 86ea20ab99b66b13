"""The DHT peer: start, serve (``diloco dht``), stop, and the rendezvous of worker groups at start.

Each trainer rank runs one hivemind DHT peer in a background process that owns one p2pd daemon; ``diloco dht``
runs one as the swarm's bootstrap peer. hivemind is pinned to 1.1.12; this module relies on these private names
of ``hivemind.DHT``: ``run`` (overridden), ``_parent_pid``, ``_inner_pipe`` (its request pipe, read by
``DHT.run``) and ``_ready`` (``set_result`` once the node is up), the ``caller`` that ``hivemind.p2p.p2p_daemon``
puts on the log records it relays from p2pd, ``DHTNode.p2p._client.connect`` (p2pd's connect command, for the
rendezvous) and ``hivemind.dht.node._SearchState`` (``__init__`` and its ``serializer``: ``_Tolerant``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time
from multiaddr import Multiaddr

from diloco.errors import FieldError, first_line
from diloco.procs import check_tempdir, exit_with_parent
from diloco.swarm.records.addresses import without_p2p
from diloco.swarm.records.fork_locks import make_hivemind_locks_kill_safe
from diloco.swarm.records.identity import ensure_identity
from diloco.swarm.records.ownership import checking_validator
from diloco.swarm.records.rejoin import keep_joined

logger = logging.getLogger(__name__)

RETRY_PAUSE_S = 1.0  # between start-up attempts whose DHT ping went unanswered


def start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    identity_path: Path | None = None,
    client_mode: bool = False,
    startup_timeout: float = 30,
    validator: object | None = None,
) -> hivemind.DHT:
    """Start a hivemind DHT peer in a background process (which owns one p2pd daemon).

    :param initial_peers: multiaddrs of running peers to bootstrap from (``/ip4/1.2.3.4/tcp/31337/p2p/Qm...``);
        empty to start a new swarm. If none of them answers, start-up fails: it never goes on alone.
    :param host_maddrs: multiaddrs to listen on, e.g. ``/ip4/0.0.0.0/tcp/31337`` (port 0 = any free port).
    :param announce_maddrs: public multiaddrs to advertise instead of the listening ones (explicit ports);
        empty to advertise what libp2p sees.
    :param identity_path: private key file (created if missing, see ``ensure_identity``) making the peer id
        stable; None for a random peer id.
    :param client_mode: if True, this peer does not serve DHT requests or accept incoming averaging requests
        (for peers behind NAT); it can still average with non-client peers.
    :param validator: signs this peer's owned records and checks everyone's (``ownership.Owner.validator``);
        None: checks only (``ownership.checking_validator``). Every DHT peer of ours checks: see
        ``diloco.swarm.records.ownership``.
    :param startup_timeout: seconds to wait for the daemon to start and the bootstrap to finish. Only a safety
        net: p2pd gives up on initial peers that do not answer by itself, after about 5 s (at once on a closed
        port), and a peer that is not a DHT fails its ping after 3 s. An unanswered ping is retried while this
        time lasts: an overloaded peer (or machine) is slow, not wrong.
    :returns: the running DHT; call ``.shutdown()`` when done.
    :raises FieldError: bad input, as one line naming the option (``initial_peers``, ``host_maddrs``,
        ``announce_maddrs`` or ``identity``): no initial peer answered, a host port in use, an unusable identity
        file. No process is left behind.
    :raises UsageError: a TMPDIR too long for torch's shared-memory socket (see ``check_tempdir``).
    """
    check_tempdir()
    make_hivemind_locks_kill_safe()  # before the first fork: a DHT or averager process killed mid-reply hangs no one
    kwargs = {}
    if identity_path is not None:
        try:
            kwargs["identity_path"] = str(ensure_identity(identity_path))
        except ValueError as e:
            raise FieldError(f"{{identity}}: {e}") from None
    kwargs |= dict(host_maddrs=list(host_maddrs), announce_maddrs=list(announce_maddrs) or None,
                   record_validators=[validator or checking_validator()])  # fmt: skip
    started = time.monotonic()
    while True:
        left_s = max(startup_timeout - (time.monotonic() - started), 1.0)
        dht = _DHT(initial_peers=list(initial_peers) or None, client_mode=client_mode, startup_timeout=left_s,
                   start=False, **kwargs)  # fmt: skip
        try:
            dht.run_in_background(await_ready=True, timeout=left_s)
            keep_joined(dht, initial_peers)  # a peer that lost all others (an outage) finds the swarm again
            return dht
        except BaseException as e:
            waited_s = time.monotonic() - started
            _stop_failed_start(dht)
            if _unanswered_ping(e) and waited_s + RETRY_PAUSE_S < startup_timeout:
                # p2pd reached the peer but its DHT did not answer a ping within 3 s: a busy peer (or a busy
                # machine here) rather than a wrong address, so try again while the start-up time lasts
                logger.warning("the DHT peers at %s did not answer a ping yet; trying again", " ".join(initial_peers))
                time.sleep(RETRY_PAUSE_S)
                continue
            usage_error = _startup_usage_error(e, initial_peers, waited_s)
            if usage_error is None:
                raise
            raise usage_error from None


def _unanswered_ping(error: BaseException) -> bool:
    return "initial_peers responded" in first_line(error)


def _startup_usage_error(error: BaseException, initial_peers: Sequence[str], waited_s: float) -> FieldError | None:
    """The bad input behind a failed DHT start as one line naming the option; None for failures that are not.

    :param waited_s: seconds from the start until the failure, quoted for an unreachable initial peer.
    """
    # p2pd's reasons come as "Daemon failed to start: <date> <time> <reason>"
    reason = re.sub(r"^Daemon failed to start: \d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", first_line(error))
    peers = " ".join(initial_peers)
    timed_out = isinstance(error, TimeoutError) or "Daemon failed to start in" in reason
    # p2pd could not dial any of them / they did not answer a DHT ping / nothing at all within startup_timeout
    if "bootstrap peers" in reason or "initial_peers responded" in reason or (initial_peers and timed_out):
        return FieldError(
            f"{{initial_peers}}: no DHT peer answered at {peers} (gave up after {waited_s:.1f} s); is it running and "
            "reachable from here, and is the /p2p/ peer id the one it printed?",
        )
    if "invalid p2p multiaddr" in reason:
        return FieldError(f"{{initial_peers}} {peers}: each address needs its /p2p/<peer id> part")
    if "failed to listen" in reason:  # the port differs per rank (+ local rank), so every rank reports its own
        listen = re.search(r"listen \w+ (\S+):(\d+): (?:bind: )?([^\]]+)", reason)
        if listen is None:
            return FieldError(f"{{host_maddrs}}: {reason}", per_rank=True)
        host, port, why = listen.groups()
        return FieldError(f"{{host_maddrs}}: cannot listen on {host} port {port}: {why}", per_rank=True)
    if "explicit port in announce_maddrs" in reason:
        return FieldError("{announce_maddrs}: announce an explicit port, not port 0")
    return None


def _stop_failed_start(dht: hivemind.DHT) -> None:
    """End a DHT process whose start failed or timed out, and its p2pd: hivemind's ``shutdown`` would wait for a
    node that never came up (and log a warning)."""
    if dht.pid is None:  # never forked
        return
    dht.join(timeout=1.0)  # after a start-up error the process exits by itself, and p2pd with it
    if dht.is_alive():  # still starting (a timeout): stop its process group, p2pd included
        with contextlib.suppress(ProcessLookupError):
            os.killpg(dht.pid, signal.SIGTERM)
        dht.join(timeout=3.0)
    if dht.is_alive():
        dht.kill()
        dht.join()


class _DHT(hivemind.DHT):
    """hivemind.DHT whose process (and so its p2pd) ends with the process that started it, and which survives
    requests from averager processes that exited before the DHT read them."""

    def run(self) -> None:
        detach_from_parent(self._parent_pid)
        self._inner_pipe = _RequestPipe(self._inner_pipe)
        _tolerate_undecodable_entries()  # (in this process alone: the DHT's)
        # a daemon that fails to start logs its shutdown (seen: "swarm listener for /p2p-circuit accept error:
        # listener closed" at ERROR) beside the one line start_dht gives for it: quiet until the node is up
        started = threading.Event()
        announce = self._ready.set_result
        self._ready.set_result = lambda result: (started.set(), announce(result))
        logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_QuietUntil(started))
        super().run()

    async def _drop_request(self, reason: str) -> None:
        logger.warning(f"DHT dropped a request from a process that exited: {reason}")


class _Tolerant(MSGPackSerializer):
    """hivemind's serializer for the values a DHT search found, reading an entry it cannot decode as None. hivemind
    decodes every entry of a key before it answers the read, and a decoding error there leaves the read unanswered
    for good: one entry any peer can store (a map with integer keys: "int is not allowed for map key") would hang
    every reader of that key. As None the entry is one the readers refuse and count (``ownership.owned_records``)."""

    @classmethod
    def loads(cls, buf: bytes) -> object:
        try:
            return super().loads(buf)
        except Exception:  # noqa: BLE001 - (ValueError, TypeError, msgpack's own): a stranger's bytes, not a record
            return None


def _tolerate_undecodable_entries() -> None:
    """Every search state of this process decodes what it found with ``_Tolerant`` (hivemind hands its protocol's
    serializer to each one, so the class default alone would not do)."""
    from hivemind.dht.node import _SearchState

    made = _SearchState.__init__

    def tolerant(self, *args, **kwargs) -> None:
        made(self, *args, **kwargs)
        self.serializer = _Tolerant

    _SearchState.__init__ = tolerant


class _QuietUntil(logging.Filter):
    """Drops p2pd's own log lines (hivemind relays them with a ``caller``) until `started` is set: for good in a DHT
    process whose start failed."""

    def __init__(self, started: threading.Event) -> None:
        super().__init__()
        self.started = started

    def filter(self, record: logging.LogRecord) -> bool:
        return self.started.is_set() or not hasattr(record, "caller")


class _RequestPipe:
    """The DHT process' end of its request pipe.

    A request carries an MPFuture whose reply pipe is unpickled through the requester's resource-sharer thread; if
    the requester (e.g. an averager that was just shut down) is gone, unpickling fails. hivemind's DHT loop does not
    catch EOFError, so the whole DHT process died (and other errors stalled it for 3 s). A request that cannot be
    unpickled becomes a call to ``_DHT._drop_request`` instead.
    """

    def __init__(self, connection):
        self._connection = connection

    def fileno(self) -> int:
        return self._connection.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._connection.poll(timeout)

    def recv(self) -> tuple[str, list, dict]:
        message = self._connection.recv_bytes()  # errors of the pipe itself propagate as before
        try:
            return ForkingPickler.loads(message)  # what Connection.recv does
        except Exception as e:  # EOFError, ConnectionResetError, FileNotFoundError, ...
            return "_drop_request", [repr(e)], {}


def detach_from_parent(parent_pid: int) -> None:
    """Called first thing in a forked background process: die with the parent, not with its signal handlers.

    hivemind's DHT and averager processes hold both ends of their control pipes, so they never see the trainer
    exit; after a SIGKILL (or a SIGTERM that skips atexit) they would live on with their p2pd daemon.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # handlers inherited from the trainer (e.g. serve_dht's) must go
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which then shuts us down
    # A process group of our own (p2pd, started from here, joins it): torchrun stops a rank with killpg, and a
    # terminal's Ctrl-C goes to the whole foreground group; either would kill the daemon under a round that the
    # trainer is about to finish cleanly. The owner shuts us down, and we die with it otherwise.
    os.setpgid(0, 0)
    exit_with_parent(parent_pid, poll_s=1.0)  # p2pd exits when its parent does


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Multiaddrs (with ``/p2p/<peer id>``) under which other peers can reach ``dht``."""
    return [str(maddr) for maddr in dht.get_visible_maddrs()]


def serve_dht(
    identity: Path,
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    stop_event: threading.Event | None = None,
    print_fn: Callable[[str], object] = print,
    services: Sequence[Callable[[hivemind.DHT], object]] = (),
) -> int:
    """Run a bootstrap DHT peer until SIGINT/SIGTERM or ``stop_event``; the body of ``diloco dht``.

    Prints one line ``--hv.initial-peers <maddr> ...`` to paste into the workers' command line.

    :param identity: private key file (created if missing) so the printed multiaddrs survive restarts.
    :param host_maddrs: multiaddrs to listen on, e.g. ``/ip4/0.0.0.0/tcp/31337``.
    :param announce_maddrs: public multiaddrs to advertise (may be empty).
    :param stop_event: optional event that stops the peer when set (for tests and embedding).
    :param print_fn: where the ready line goes.
    :param services: each is called with the running DHT before the ready line (what the peer serves besides the
        DHT: ``diloco dht`` answers dial-back requests, ``diloco.swarm.rounds.reachability.serve``).
    :returns: process exit code (0).
    :raises FieldError: bad input (identity file, a port in use), naming the option as ``start_dht`` does.
    """
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    try:
        dht = start_dht(
            initial_peers=[],
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs,
            identity_path=identity,
        )
        try:
            for service in services:
                service(dht)
            print_fn("--hv.initial-peers " + " ".join(visible_maddrs(dht)))
            while not stop.is_set() and not (stop_event is not None and stop_event.is_set()):
                stop.wait(0.2)  # short waits keep the main thread responsive to signals
        finally:
            dht.shutdown()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def _install_stop_handlers(stop: threading.Event) -> dict[int, object]:
    """Make SIGINT/SIGTERM set ``stop``; only possible (and only done) in the main thread. Returns old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda *_: stop.set())
    return previous




def rendezvous(
    dht: hivemind.DHT, key: str, member: str, expected: int, timeout: float, stop: Callable[[], bool] = lambda: False
) -> int:
    """Announce `member` (with this peer's addresses) under `key` and wait until `expected` distinct members are
    there, `timeout` seconds passed, or `stop()` is true; then connect to the members seen.

    Worker groups start seconds apart (imports, data loading); meeting here first lets their first outer
    round find each other. Connecting matters too: matchmaking opens streams to other groups' peers by peer id,
    and p2pd finds their addresses through libp2p's own DHT, which was seen not to know them for whole runs
    (under Slurm: "routing: not found" in every round). A connection puts them in p2pd's peerstore. Returns how
    many members were seen.
    """
    deadline = time.monotonic() + timeout
    mine = {"peer_id": dht.peer_id.to_base58(), "maddrs": [without_p2p(m) for m in visible_maddrs(dht)]}
    seen: dict = {}
    while True:
        dht.store(key, subkey=member, value=mine, expiration_time=get_dht_time() + timeout + 60)
        found = dht.get(key, latest=True)
        seen = found.value if found is not None and isinstance(found.value, dict) else {}
        if len(seen) >= expected or time.monotonic() >= deadline or stop():
            break
        time.sleep(0.5)
    others = [entry.value for name, entry in seen.items() if name != member and isinstance(entry.value, dict)]
    dht.run_coroutine(partial(_connect, others))
    return len(seen)


async def _connect(peers: list[dict], dht: hivemind.DHT, node: hivemind.DHTNode) -> None:
    """Runs in the DHT process: connect p2pd to each peer (entries a member of another version wrote, or that
    do not answer, are skipped: matchmaking then falls back on libp2p's routing)."""

    async def connect(peer: dict) -> None:
        try:
            maddrs = [Multiaddr(m) for m in peer["maddrs"]]
            await asyncio.wait_for(node.p2p._client.connect(PeerID.from_base58(peer["peer_id"]), maddrs), 5.0)
        except Exception as e:  # noqa: BLE001 - best effort
            logger.debug(f"could not connect to {peer}: {type(e).__name__}: {e}")

    await asyncio.gather(*(connect(peer) for peer in peers))
