"""Swarm layer: DHT peers, peer identity and bit-identical averaging. The only module that imports hivemind.

Averaging rounds are formed by hivemind's matchmaking; their bytes go over TCP (``diloco.butterfly``) or, for
groups with a ``transport="p2pd"`` member, over hivemind's libp2p streams (``ExactAllReduceRunner``).

hivemind is pinned to 1.1.12, so this module subclasses a few of its internals. It relies on:

* ``AllReduceRunner``: ``_communicate_with_peer`` (its own-part branch), ``_accumulate_parts_streaming``
  (the reducer's reply stream), ``_get_peer_stub``, and the attributes ``tensor_part_container``
  (``return_deltas``, ``failed_size``, ``compression``, ``_input_parts_by_peer``), ``tensor_part_reducer``,
  ``parts_for_local_averaging``, ``sender_peer_ids``, ``ordered_peer_ids``, ``weight``, ``_ban_sender`` and
  ``banned_senders``; ``TensorPartReducer.sender_failed_after``, ``finished`` and ``num_parts``.
* ``TensorPartContainer``: ``iterate_output_tensors`` is replaced (``_PartsContainer``) by a copy of its loop over
  ``local_tensors``, ``num_parts_by_tensor``, ``num_parts_by_peer``, ``_output_parts_by_peer``,
  ``_output_part_available``, ``_outputs_consumed`` and ``finished`` that yields each tensor's parts unjoined.
* ``DecentralizedAverager``: ``_run_allreduce_inplace_`` (called once per all-reduce attempt while the averager
  holds its tensor lock, with ``weight``, ``sender_timeout`` and ``compression`` among its keyword arguments),
  ``GroupInfo.gathered`` (per peer: ``serializer.dumps([bandwidth, mode, serializer.dumps(gather)])``, in
  ``peer_ids`` order), ``allreduce_kwargs``, ``_running_groups`` (a future per group whose result must offer
  ``finalize`` and ``rpc_aggregate_part``), ``_p2p``, ``_parent_pid``, ``run`` and the ``_rpc_handlers`` /
  ``_stub_type`` class caches of ``hivemind.p2p.ServicerBase``; for state sharing ``get_current_state`` (served
  by hivemind's ``rpc_download_state``), ``allow_state_sharing``, ``_outer_pipe`` (commands to the averager
  process), ``serializer`` and ``get_stub``.
* ``DHT``: ``run``, ``_parent_pid`` and ``_inner_pipe`` (its request pipe, read by ``DHT.run``).
* ``StepControl.stage`` / ``allow_allreduce`` / ``cancel`` from ``step(require_trigger=True, wait=False)``.
* ``hivemind.compression.serialization._BASE_COMPRESSION_TYPES``: the decoder registry, patched inside the averager
  process only (``ExactAverager.run``) because the stock 8-bit decoder fails on numpy >= 2.4.
* Identity files in hivemind's format: a libp2p ``crypto_pb2.PrivateKey`` protobuf holding an RSA key (DER),
  which is the only kind ``PeerID.from_identity`` (and so ``P2P.create(identity_path=...)``) can read.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import re
import signal
import socket
import stat
import threading
import time
import warnings
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from functools import partial
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import AsyncIterator, Callable, Literal, Sequence

import hivemind
import numpy as np
import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
)
from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, crypto_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import get_dht_time
from multiaddr import Multiaddr

from diloco import butterfly
from diloco.butterfly import all_finite
from diloco.catchup import Progress
from diloco.config import RankUsageError, UsageError, first_line

logger = logging.getLogger(__name__)


class Uniform8Bit(Uniform8BitQuantization):
    """hivemind's ``Uniform8BitQuantization`` (per part: 256 levels over mean +- 3 sigma, codebook = bucket means)
    with a decoder that works on numpy 2.4 (installed here): hivemind 1.1.12 calls ``int()`` on a 1-element array,
    which numpy 2.4 rejects, so stock 8-bit all-reduce loses every remote part (peers silently keep their own
    values there). Same wire format as stock."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        indices = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        values = torch.as_tensor(codebook)[torch.as_tensor(indices, dtype=torch.int64)]
        values = values.to(getattr(torch, serialized_tensor.dtype)).reshape(tuple(serialized_tensor.size))
        return values.requires_grad_(serialized_tensor.requires_grad)


Compression = Literal["none", "fp16", "int8"]
Transport = Literal["tcp", "p2pd"]
COMPRESSIONS: dict[str, type[CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "int8": Uniform8Bit,  # lower error and ~20x faster than Quantile8BitQuantization; no bitsandbytes needed
}


# ----------------------------------------------------------------------------------------------------------- identity


def ensure_identity(path: Path) -> Path:
    """Create the peer's private key file at ``path`` unless it exists, then validate it.

    :param path: key file; parent folders are created, a new file gets mode 0600. Reusing it keeps the peer id
        stable across restarts.
    :returns: ``path``
    :raises ValueError: the file cannot be created, cannot be read or is not a key hivemind can use (one line
        naming the file). A file that group or others can read only warns (``UserWarning``).
    """
    path = Path(path)
    if not path.exists():
        _write_new_identity(path)
    identity_peer_id(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        warnings.warn(
            f"identity file {path} is accessible to group/others (mode {mode:o}); run: chmod 600 {path}", stacklevel=2
        )
    return path


def identity_peer_id(path: Path) -> str:
    """Return the base58 peer id of the key stored at ``path``; ``ValueError`` if unreadable or invalid."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read identity file {path}: {e.strerror or e}") from None
    try:
        return PeerID.from_identity(data).to_base58()
    except Exception as e:  # protobuf DecodeError, cryptography ValueError, ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"identity file {path} is not a valid libp2p RSA private key: {reason}") from None


def _write_new_identity(path: Path) -> None:
    """Write a new RSA key in hivemind's format, atomically, never replacing a key another process just wrote;
    ``ValueError`` naming the file when it cannot be written."""
    # hivemind 1.1.12 reads identity files only as RSA (PeerID.from_identity uses load_der_private_key), so an
    # Ed25519 key would make P2P.create fail whenever initial_peers are given. Same bytes as P2P.generate_identity.
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, key.SerializeToString())
    except OSError as e:
        blocker = next((parent for parent in path.parents if parent.exists()), None)
        reason = f"{blocker} is a file, not a folder" if blocker and not blocker.is_dir() else e.strerror or e
        raise ValueError(f"cannot create identity file {path}: {reason}") from None


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` with mode 0600; if ``path`` appeared meanwhile, keep that one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # independent of umask
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if a concurrent rank created the file first: keep theirs
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


# ---------------------------------------------------------------------------------------------------------------- DHT


@dataclass(frozen=True)
class Flags:
    """How the calling command line spells the options that ``start_dht`` reports bad input against."""

    initial_peers: str = "--hv.initial-peers"
    host_maddrs: str = "--hv.host-maddrs"
    announce_maddrs: str = "--hv.announce-maddrs"
    identity: str = "--identity"


TRAIN_FLAGS = Flags()
DHT_FLAGS = Flags(initial_peers="--initial-peers", host_maddrs="--host-maddrs", announce_maddrs="--announce-maddrs")


def start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    identity_path: Path | None = None,
    client_mode: bool = False,
    startup_timeout: float = 30,
    flags: Flags = TRAIN_FLAGS,
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
    :param startup_timeout: seconds to wait for the daemon to start and the bootstrap to finish. Only a safety
        net: p2pd gives up on initial peers that do not answer by itself, after about 5 s (at once on a closed
        port), and a peer that is not a DHT fails its ping after 3 s.
    :param flags: the caller's names for these options, quoted in ``UsageError`` messages.
    :returns: the running DHT; call ``.shutdown()`` when done.
    :raises UsageError: bad input, as one line naming the flag: no initial peer answered, a host port in use,
        an unusable identity file. No process is left behind.
    """
    kwargs = {}
    if identity_path is not None:
        try:
            kwargs["identity_path"] = str(ensure_identity(identity_path))
        except ValueError as e:
            raise UsageError(f"{flags.identity}: {e}") from None
    dht = _DHT(
        initial_peers=list(initial_peers) or None,
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None,
        client_mode=client_mode,
        startup_timeout=startup_timeout,
        start=False,
        **kwargs,
    )
    started = time.monotonic()
    try:
        dht.run_in_background(await_ready=True, timeout=startup_timeout)
    except BaseException as e:
        waited_s = time.monotonic() - started
        _stop_failed_start(dht)
        usage_error = _startup_usage_error(e, flags, initial_peers, waited_s)
        if usage_error is None:
            raise
        raise usage_error from None
    return dht


def _startup_usage_error(
    error: BaseException, flags: Flags, initial_peers: Sequence[str], waited_s: float
) -> UsageError | None:
    """The bad input behind a failed DHT start as one line naming the flag; None for failures that are not.

    :param waited_s: seconds from the start until the failure, quoted for an unreachable initial peer.
    """
    # p2pd's reasons come as "Daemon failed to start: <date> <time> <reason>"
    reason = re.sub(r"^Daemon failed to start: \d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", first_line(error))
    peers = " ".join(initial_peers)
    timed_out = isinstance(error, TimeoutError) or "Daemon failed to start in" in reason
    # p2pd could not dial any of them / they did not answer a DHT ping / nothing at all within startup_timeout
    if "bootstrap peers" in reason or "initial_peers responded" in reason or (initial_peers and timed_out):
        return UsageError(
            f"{flags.initial_peers}: no DHT peer answered at {peers} (gave up after {waited_s:.1f} s); is it "
            "running and reachable from here, and is the /p2p/ peer id the one it printed?"
        )
    if "invalid p2p multiaddr" in reason:
        return UsageError(f"{flags.initial_peers} {peers}: each address needs its /p2p/<peer id> part")
    if "failed to listen" in reason:  # the port differs per rank (+ local rank), so every rank reports its own
        listen = re.search(r"listen \w+ (\S+):(\d+): (?:bind: )?([^\]]+)", reason)
        if listen is None:
            return RankUsageError(f"{flags.host_maddrs}: {reason}")
        host, port, why = listen.groups()
        return RankUsageError(f"{flags.host_maddrs}: cannot listen on {host} port {port}: {why}")
    if "explicit port in announce_maddrs" in reason:
        return UsageError(f"{flags.announce_maddrs}: announce an explicit port, not port 0")
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
        _detach_from_parent(self._parent_pid)
        self._inner_pipe = _RequestPipe(self._inner_pipe)
        super().run()

    async def _drop_request(self, reason: str) -> None:
        logger.warning(f"DHT dropped a request from a process that exited: {reason}")


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


def _detach_from_parent(parent_pid: int) -> None:
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

    def exit_when_orphaned() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)  # p2pd exits when its parent does

    threading.Thread(target=exit_when_orphaned, name="exit-with-parent", daemon=True).start()


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Multiaddrs (with ``/p2p/<peer id>``) under which other peers can reach ``dht``."""
    return [str(maddr) for maddr in dht.get_visible_maddrs()]


def serve_dht(
    identity: Path,
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    stop_event: threading.Event | None = None,
    print_fn: Callable[[str], object] = print,
) -> int:
    """Run a bootstrap DHT peer until SIGINT/SIGTERM or ``stop_event``; the body of ``diloco dht``.

    Prints one line ``--hv.initial-peers <maddr> ...`` to paste into the workers' command line.

    :param identity: private key file (created if missing) so the printed multiaddrs survive restarts.
    :param host_maddrs: multiaddrs to listen on, e.g. ``/ip4/0.0.0.0/tcp/31337``.
    :param announce_maddrs: public multiaddrs to advertise (may be empty).
    :param stop_event: optional event that stops the peer when set (for tests and embedding).
    :param print_fn: where the ready line goes.
    :returns: process exit code (0).
    :raises UsageError: bad input (identity file, a port in use), one line naming ``diloco dht``'s flag.
    """
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    try:
        dht = start_dht(
            initial_peers=[],
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs,
            identity_path=identity,
            flags=DHT_FLAGS,
        )
        try:
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


# ------------------------------------------------------------------------------------------------ exact all-reduce

# Screening: ``butterfly.MAX_NORM_RATIO`` (with why 100) and ``butterfly.screen`` say what a reducer rejects.


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
    of one of our parts, it is rejected (``butterfly.rejection``) if it holds NaN/Inf, its weight is not a finite
    number >= 0, or its L2 norm exceeds ``butterfly.MAX_NORM_RATIO`` times the reference norm of that part
    (``butterfly.reference_norm``): the lower median of the norms of the finite contributions of all senders to
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
            reason = await self._screen(sender_index, part_index, self._part_norm(tensor_part), self.weight)
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
            return tensor_part, msg.weight, self._part_norm(tensor_part)

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

    @staticmethod
    def _part_norm(part: torch.Tensor) -> float:
        """L2 norm accumulated in float64 (finite for any finite float32 part); nan or inf iff a value is."""
        return float(torch.linalg.vector_norm(part, dtype=torch.float64))

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
            self._reference_norms[part_index] = butterfly.reference_norm(norms.values())
        return butterfly.rejection(norm, weight, self._reference_norms[part_index])

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


class ExactAverager(hivemind.DecentralizedAverager):
    """DecentralizedAverager whose rounds leave all groupmates with bit-identical tensors.

    A round either overwrites all local tensors with the group average or, if any part could not be averaged,
    leaves them untouched and fails (so ``step`` retries or raises instead of returning mixed results).
    ``stats`` holds, in shared memory: bytes sent, bytes received, size of the last group that tried to average,
    contributions rejected.
    Peers only group with other ``ExactAverager`` peers: RPC names include the class name.

    The bytes of a round travel over plain TCP (``diloco.butterfly``) when every groupmate gathered a TCP endpoint
    (``step(gather={"tcp": [hosts, port]})``), otherwise over libp2p (``ExactAllReduceRunner``); both screen alike.

    :param listen_socket: a listening socket for the TCP transport (``butterfly.listen_socket``), taken over by the
        averager process; None: this averager only averages over libp2p.
    """

    _rpc_handlers = None  # collect our own RPC handlers/stub (the cache is a class attribute in ServicerBase)
    _stub_type = None

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: hivemind.DHT,
        listen_socket: socket.socket | None = None,
        **kwargs,
    ):
        method = mp.get_start_method(allow_none=True) or mp.get_all_start_methods()[0]
        if method != "fork":
            # hivemind pickles pipes between forked processes (MPFuture); under 'spawn' the averager never gets ready
            raise RuntimeError(f"hivemind averagers need the 'fork' start method, this process uses {method!r}")
        # [3]: senders this peer rejected; [4]: 1 if the last all-reduce went over TCP
        self.stats = mp.Array(ctypes.c_int64, 5)
        self._listen_socket = listen_socket  # inherited by the forked averager process
        self._listener: butterfly.Listener | None = None
        # the TCP rounds' output, in shared memory (the caller copies its result from here: one copy fewer than
        # through the averaged tensors) and touched now (fresh pages in the first round cost more than a copy)
        numel = sum(tensor.numel() for tensor in averaged_tensors)
        self.tcp_out = torch.zeros(numel if listen_socket is not None else 0).share_memory_()
        super().__init__(averaged_tensors, dht, **kwargs)

    def run(self):
        _detach_from_parent(self._parent_pid)
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
            self._listener = butterfly.Listener(self._listen_socket, timeout, self._allreduce_timeout).start()
        super().run()

    # State sharing: hivemind serves ``get_current_state()`` (run in the host process by a background thread) to
    # ``rpc_download_state``; its own downloader picks the peer by priority, ours asks the peer it is told to.
    state_provider: Callable[[], tuple[dict, list[torch.Tensor]]] | None = None

    def get_current_state(self) -> tuple[dict, list[torch.Tensor]]:
        if self.state_provider is None:
            raise RuntimeError("this peer serves no state yet")
        return self.state_provider()

    def download_state_from(self, peer: str, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """The state ``peer`` serves (its metadata and tensors), or None if it does not answer within ``timeout``
        seconds per message or serves none."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(peer=peer, timeout=timeout, future=future)))
        return future.result(timeout=4 * timeout + 10)  # the averager process sets a result in every case

    async def _download_state_from(self, peer: str, timeout: float, future: MPFuture) -> None:
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), timeout)
            metadata, tensors, parts = None, [], []
            async for message in aiter_with_timeout(stream, timeout=timeout):
                if message.metadata:
                    metadata = self.serializer.loads(message.metadata)
                if message.tensor_part.dtype and parts:  # a dtype marks the first part of the next tensor
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    parts = []
                parts.append(message.tensor_part)
            if parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            future.set_result((metadata, tensors) if metadata is not None else None)
        except Exception as e:
            logger.warning(f"could not download the state of {peer}: {type(e).__name__}: {e}")
            if not future.done():
                future.set_result(None)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ):
        group_id = group_info.group_id if group_id is None else group_id
        endpoints = self._tcp_endpoints(group_info)
        if endpoints is not None and self._listener is not None:
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
        self.stats[2], self.stats[4] = len(group_info.peer_ids), 0
        try:
            # keep all results until the end: a failure must leave every tensor untouched (a retry re-sends them)
            averaged = [parts async for parts in runner]
            failed = runner.tensor_part_container.failed_size
            if failed:
                raise AllreduceException(f"{failed} of {runner.tensor_part_container.total_size} values not averaged")
            # reducers screen what they average; this catches one that does not (another version, a bad actor)
            if not all(all_finite(part) for parts in averaged for part in parts):
                raise AllreduceException("a groupmate returned non-finite averages")
            for tensor, parts in zip(tensors, averaged):
                torch.cat(parts, out=tensor.view(-1))  # straight into the tensor, no full-size temporary
        finally:
            self.stats[0] += runner.bytes_sent
            self.stats[1] += runner.bytes_received
            self.stats[3] += runner.rejected

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
        compression: CompressionBase,
        **_,
    ) -> None:
        vector = tensors[0].view(-1) if len(tensors) == 1 else torch.cat([tensor.view(-1) for tensor in tensors])
        round_ = butterfly.Round(
            vector, self.tcp_out, group_id=group_id, index=group_info.peer_ids.index(self.peer_id),
            endpoints=endpoints, weight=weight, codec=_codec(compression), timeout=sender_timeout,
        )  # fmt: skip
        self._running_groups[group_id].set_result(_TcpGroup(round_))
        self.stats[2], self.stats[4] = len(group_info.peer_ids), 1
        self._listener.register(round_)
        try:
            await asyncio.get_running_loop().run_in_executor(None, round_.run)
        except butterfly.RoundFailed as e:
            raise AllreduceException(str(e)) from None
        except asyncio.CancelledError:  # hivemind's allreduce timeout: stop the round's threads
            round_.abort()
            raise
        finally:
            self._listener.unregister(round_)
            self.stats[0] += round_.bytes_sent
            self.stats[1] += round_.bytes_received
            self.stats[3] += round_.rejected
        # reducers screen what they average; this catches one that does not (another version, a bad actor)
        if not all_finite(self.tcp_out):
            raise AllreduceException("a groupmate returned non-finite averages")
        # the result stays in tcp_out (stats[4] = 1 says so): the averaged tensors keep this round's inputs


class _TcpGroup:
    """Stands in for hivemind's ``AllReduceRunner`` in ``_running_groups`` while the group averages over TCP."""

    def __init__(self, round_: butterfly.Round):
        self.round = round_

    def finalize(self, cancel: bool = False) -> set:
        self.round.abort()  # the averager shuts down: end the round's threads
        return set()

    async def rpc_aggregate_part(self, stream: AsyncIterator, context) -> AsyncIterator[averaging_pb2.AveragingData]:
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)  # no parts come over libp2p this round


def _codec(compression: CompressionBase) -> butterfly.Codec:
    """The TCP transport's wire format for one of ``COMPRESSIONS``."""
    if isinstance(compression, Float16Compression):
        return butterfly.FP16
    if isinstance(compression, Uniform8Bit):
        return butterfly.Codec(
            "int8",
            2**17,  # 512 KiB of float32 per codebook, as over libp2p
            encode=lambda part: compression.compress(part, CompressionInfo.from_tensor(part)).SerializeToString(),
            decode=lambda data, n: compression.extract(runtime_pb2.Tensor.FromString(bytes(data))),
            max_bytes=lambda n: 4 * n + 4096,
        )
    return butterfly.RAW


# ------------------------------------------------------------------------------------------------- trainer interface


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
    :param rejected: groupmates' contributions (and this peer's own) that this peer, as a reducer, left out of the
        average for holding NaN/Inf or a norm ``butterfly.MAX_NORM_RATIO`` times the group's; a rejected peer's round
        fails, the others complete without it (ok=True).
    """

    num_peers: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    ok: bool
    rejected: int = 0
    transport: str = ""


ROUND_BITS = 20  # round indices are told apart modulo 2**20


def rendezvous(
    dht: hivemind.DHT, key: str, member: str, expected: int, timeout: float, stop: Callable[[], bool] = lambda: False
) -> int:
    """Announce `member` under `key` and wait until `expected` distinct members are there, `timeout` seconds
    passed, or `stop()` is true.

    Worker groups start seconds apart (imports, data loading); meeting here first lets their first outer
    round find each other. Returns how many members were seen.
    """
    deadline = time.monotonic() + timeout
    seen = 0
    while True:
        dht.store(key, subkey=member, value=True, expiration_time=get_dht_time() + timeout + 60)
        found = dht.get(key, latest=True)
        seen = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if seen >= expected or time.monotonic() >= deadline or stop():
            return seen
        time.sleep(0.5)


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
        between the groupmates, ``diloco.butterfly``; each peer must reach the others' announced addresses
        directly) or "p2pd" (hivemind's libp2p streams: NAT traversal and relays, encrypted, several times
        slower). A group with any "p2pd" member averages over libp2p.
    :param tcp_host: address the TCP transport listens on ("0.0.0.0": every interface).
    :param tcp_port: port the TCP transport listens on (0: any free port).
    :raises RankUsageError: ``tcp_port`` is taken or cannot be bound.
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
    ):
        if "." in prefix or not prefix:
            raise ValueError(f"averaging prefix must be non-empty and contain no '.': {prefix!r}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {sorted(COMPRESSIONS)}, got {compression!r}")
        if matchmaking_time <= 0 or averaging_timeout <= 0:
            raise ValueError("matchmaking_time and averaging_timeout must be positive (seconds)")
        if transport not in ("tcp", "p2pd"):
            raise ValueError(f"transport must be 'tcp' or 'p2pd', got {transport!r}")
        for tensor in tensors:
            _check_cpu_float32(tensor)
        self._shapes = [tuple(tensor.shape) for tensor in tensors]
        listening = _listen(tcp_host, tcp_port) if transport == "tcp" else None
        # where groupmates connect: the hosts this peer's DHT announces, with the transport's port
        self._gather = None if listening is None else {"tcp": [_announced_hosts(dht), listening.getsockname()[1]]}
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.grace = min(grace, matchmaking_time / 2)
        try:
            self._averager = ExactAverager(
                [tensor.detach().clone() for tensor in tensors],
                dht,
                start=False,
                prefix=prefix,
                target_group_size=target_group_size,
                min_group_size=2,  # a lone peer is handled here (by cancelling), never as a group of one
                min_matchmaking_time=matchmaking_time,
                request_timeout=min(3.0, matchmaking_time / 2),  # hivemind: must be < min_matchmaking_time
                compression=COMPRESSIONS[compression](),
                allreduce_timeout=averaging_timeout,
                next_chunk_timeout=averaging_timeout / 4,  # drop a silent groupmate before the round times out
                allow_state_sharing=False,
                listen_socket=listening,
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
        if round_index is not None:  # the matchmaking key becomes <prefix>.0b<round bits>
            self._averager.set_group_bits(format(round_index % 2**ROUND_BITS, f"0{ROUND_BITS}b"))
        if [tuple(tensor.shape) for tensor in tensors] != self._shapes:
            raise ValueError(f"expected tensors of shapes {self._shapes}")
        for tensor in tensors:
            _check_cpu_float32(tensor)
        started = time.monotonic()
        with self._averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, tensors):
                buffer.copy_(tensor)
        stats = self._averager.stats
        stats[:] = [0] * len(stats)
        control = self._averager.step(
            weight=weight,
            timeout=self.matchmaking_time + self.averaging_timeout,
            allow_retries=True,
            gather=self._gather,
            require_trigger=True,  # we trigger only after seeing the group, so giving up cannot race with it
            wait=False,
        )
        ok, num_peers = self._finish_round(control, tensors, stop, started)
        transport = "" if num_peers < 2 else ("tcp" if stats[4] else "p2pd")
        return RoundReport(
            num_peers, time.monotonic() - started, stats[0], stats[1], ok, rejected=stats[3], transport=transport
        )

    def _finish_round(
        self, control: StepControl, tensors: Sequence[torch.Tensor], stop: Callable[[], bool], started: float
    ) -> tuple[bool, int]:
        """Trigger the all-reduce once a group is formed, or give up when nobody came. Returns (ok, num_peers)."""
        grouped = self._trigger_when_grouped(control, time.monotonic() + self.matchmaking_time + self.grace, stop)
        if grouped is None:
            return False, 0  # stopped
        if not grouped:
            return True, 1
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
            return False, int(self._averager.stats[2])
        if self._averager.stats[4]:  # over TCP the result is in tcp_out, flat
            offset = 0
            for tensor in tensors:
                tensor.view(-1).copy_(self._averager.tcp_out[offset : offset + tensor.numel()])
                offset += tensor.numel()
        else:
            with self._averager.get_tensors() as buffers:
                for buffer, tensor in zip(buffers, tensors):
                    tensor.copy_(buffer)
        return True, len(gathered)

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

    def serve_state(self, provider: Callable[[], tuple[dict, list[torch.Tensor]]]) -> None:
        """Answer other peers' state downloads with ``provider()`` (metadata dict, CPU tensors) from now on;
        it is called in a background thread of this process."""
        self._averager.state_provider = provider
        self._averager.allow_state_sharing = True

    def download_state(self, peer_id: str, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """The state ``peer_id`` serves, or None (no answer within ``timeout`` seconds per message, or none)."""
        try:
            return self._averager.download_state_from(peer_id, timeout)
        except Exception as e:  # a dead averager process, a timeout of the future
            logger.warning(f"state download from {peer_id} failed: {type(e).__name__}: {e}")
            return None

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


def _listen(host: str, port: int) -> socket.socket:
    try:
        return butterfly.listen_socket(host, port)
    except OSError as e:
        why = e.strerror or str(e)
        flag = "--hv.averaging-port" if port else "--hv.host-maddrs"  # port 0 fails only for a host not on this machine
        raise RankUsageError(f"{flag}: cannot listen on {host} port {port}: {why[:1].lower()}{why[1:]}") from None


def _ips(maddr: Multiaddr) -> list[str]:
    """The ip4 and ip6 parts of a multiaddr, in that order."""
    ips = []
    for protocol in ("ip4", "ip6"):
        try:
            ips.append(maddr.value_for_protocol(protocol))
        except Exception:  # the multiaddr has no such part (the package raises its own error types)
            continue
    return ips


def listen_host(host_maddrs: Sequence[str]) -> str:
    """Where the TCP transport listens: the IP of the first of ``host_maddrs`` that names one, else everywhere."""
    for maddr in host_maddrs:
        if ips := _ips(Multiaddr(maddr)):
            return ips[0]
    return "0.0.0.0"


def _announced_hosts(dht: hivemind.DHT) -> list[str]:
    """The IP addresses in the multiaddrs ``dht`` announces, in order (loopback when it announces none)."""
    hosts = []
    for maddr in dht.get_visible_maddrs():
        for host in _ips(maddr):
            if host not in hosts and host not in ("0.0.0.0", "::"):
                hosts.append(host)
    # loopback last: on another machine it reaches that machine (the handshake then fails and the next is tried)
    return sorted(hosts, key=lambda host: host.startswith("127.") or host == "::1") or ["127.0.0.1"]


def _check_cpu_float32(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
        raise ValueError(f"SwarmAverager averages CPU float32 tensors, got {tensor.dtype} on {tensor.device}")


# ------------------------------------------------------------------------------------------------ one rank's swarm

PROGRESS_TTL = 24 * 3600.0  # seconds a group's progress record lives without a refresh (it refreshes every round)


class SwarmPeer:
    """One trainer rank's place in the swarm: its DHT peer (with p2pd), its averager, and the worker groups'
    progress records. Implements ``diloco.outer.Swarm``; ``shutdown`` stops the averager, then the DHT.

    :param dht: this rank's running DHT peer (owned from now on).
    :param averager: averages with the same rank of the other groups (owned from now on).
    :param progress_key: DHT key of the groups' progress records (one subkey per world rank).
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
        self.dht.store(
            self.progress_key,
            subkey=str(record.world_rank),
            value=record.to_dict(),
            expiration_time=get_dht_time() + PROGRESS_TTL,
        )

    def records(self) -> list[Progress]:
        found = self.dht.get(self.progress_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        records = (Progress.from_dict(entry.value) for entry in found.value.values())
        return [record for record in records if record is not None]

    def alive(self, peer_id: str) -> bool:
        try:
            return bool(self.dht.run_coroutine(partial(_ping, peer_id)))
        except Exception:  # a malformed peer id, a DHT that is shutting down
            return False

    def serve_state(self, provider: Callable[[], tuple[dict, list[torch.Tensor]]]) -> None:
        self.averager.serve_state(provider)

    def download_state(self, peer_id: str) -> tuple[dict, list[torch.Tensor]] | None:
        return self.averager.download_state(peer_id, self.request_timeout)

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        finally:
            self.dht.shutdown()


async def _ping(peer_id: str, dht: hivemind.DHT, node: hivemind.DHTNode) -> bool:
    """Runs in the DHT process: whether the peer answers a DHT ping (within the protocol's wait timeout)."""
    return await node.protocol.call_ping(PeerID.from_base58(peer_id)) is not None
