"""The TCP transport: a butterfly all-reduce of one flat float32 vector over plain sockets between the peers of one
averaging group.

hivemind forms the group (DHT, matchmaking: who is in it, their order, a random group id); this module only moves
the tensor bytes. hivemind's own path (libp2p streams through the p2pd daemon, protobuf, asyncio) is CPU-bound at
34-137 MB/s per peer on a 2-core CPU machine; docs/allreduce.md has the profile and the comparison.

The vector is cut into parts of at most ``Codec.part_numel`` values; the j-th peer of the group (reducer j) owns
some of them, its span (``diloco.swarm.rounds.layout.Schedule``). Every peer that holds a part of reducer j's span sends
it to reducer j, which screens the contributions (``diloco.swarm.rounds.screening``), averages them, encodes the average
once and sends the same bytes back to every sender: all peers that complete a round hold the very same values, whatever
the compression. When every peer holds the whole vector (``flat_schedule``) every peer sends every part and reducer j's
span is a contiguous run; peers of groups of different shapes each hold a shard (``plan_schedule``), and a part
comes from the one rank of each group that exchanges it.

Wire protocol, one TCP connection per (sender, reducer) pair, opened by the sender:

* hello, sender -> reducer (``diloco.swarm.rounds.hello``): its fields (a fresh nonce of the sender's among them), its
  Ed25519 signature with the sender's own key, and HMAC-SHA256 of both keyed with the group id;
* ack, reducer -> sender: HMAC-SHA256 of ``b"ack" + hello``, same key; sealed, a random nonce first, then
  HMAC-SHA256 of ``b"ack" + hello + nonce``. The keys of a sealed connection derive from the hello and that nonce:
  both ends add randomness, so no two connections share keys, even when a group id repeats;
* parts, sender -> reducer: per part of the reducer's span, its encoding as one message (``diloco.swarm.rounds.frames``:
  its byte length (u64) and its bytes; sealed, AES-256-GCM under the connection's keys);
* averages, reducer -> sender: per part, its encoded average as one message; a reducer that bans the sender closes
  early.
* end: the sender closes once it has every average; the reducer closes after that (``await_close``).

Only the group knows its id (matchmaking hands it out), so the HMACs keep strangers out; given a ``Roster`` (every
round of whole groups) members are told apart by their signatures and counted with their announced weights, capped.
In a keyed swarm the group id is the round's secret (``SwarmKey.round_secret``) and every part and average is sealed.
Every read and write of a round ends by its deadline.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable

import torch

from diloco.swarm.rounds import hello as hellos
from diloco.swarm.rounds.aggregation import Aggregation, aggregate
from diloco.swarm.rounds.codec import FP16, RAW, Codec  # noqa: F401 (re-exported: tcp.Codec, tcp.RAW, tcp.FP16)
from diloco.swarm.rounds.dial import Connect, Endpoint, connect  # (tcp.connect: the default of every caller)
from diloco.swarm.rounds.frames import Frames, bytes_of, seal_keys
from diloco.swarm.rounds.hello import Roster, public_bytes
from diloco.swarm.rounds.layout import Part, Schedule, flat_schedule
from diloco.swarm.rounds.screening import MAX_NORM_RATIO, all_finite, part_norm, screen

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

logger = logging.getLogger(__name__)

ROUND_STEPS = 4  # a round's deadline, in its `timeout`s (rounds of whole groups: ``deadline.round_deadline``)
HELLO, MAC_SIZE, MAGIC = hellos.HELLO, hellos.MAC_SIZE, hellos.MAGIC  # what the listener reads a hello by
DEADLINE_GRACE_S = 1.0  # past the deadline, what its last reads and writes get to end on their own before an abort
WINDOW = 4  # parts a reducer reads ahead of its averages, and averages ahead of its slowest reply: bounds memory


class RoundFailed(Exception):
    """The round did not leave this peer with the whole average (its output holds part of it at most)."""


class _LocalFailure(Exception):
    """A computation of this process failed (already recorded as the round's failure)."""


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat vector of `tensors` (the tensor itself, viewed flat, when there is one)."""
    return tensors[0].view(-1) if len(tensors) == 1 else torch.cat([tensor.view(-1) for tensor in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy `flat` back into `tensors`, in order."""
    offset = 0
    for tensor in tensors:
        tensor.view(-1).copy_(flat[offset : offset + tensor.numel()])
        offset += tensor.numel()


def _frames(sock: socket.socket, keys: tuple[bytes, bytes] | None, deadline: float) -> Frames:
    """A round connection's messages, sealed under (send key, receive key) if any, each ended by `deadline`."""
    return Frames(sock, *(keys or (None, None)), deadline=deadline)


def close_socket(sock: socket.socket) -> None:
    """Wake any thread blocked on the socket (shutdown), then release it."""
    for call in (lambda: sock.shutdown(socket.SHUT_RDWR), sock.close):
        try:
            call()
        except OSError:
            pass


def await_close(sock: socket.socket, timeout: float) -> None:
    """Wait until the peer closed its end of ``sock`` (dropping anything it still sends), at most ``timeout`` s.

    For the side that sent the last bytes, before it closes: over p2pd (``diloco.swarm.rounds.tunnel``) a client closing
    its end makes its daemon close the stream both ways, and p2pd's pipe may then reset it before the end-of-stream
    goes out; a reset stream loses whatever the other daemon had not handed on yet. So the side that received last
    closes first. (Over TCP, with nothing left unread, nothing is lost either way.)"""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(2**16):
                return
    except OSError:  # timed out, reset, or closed on our side (an abort)
        pass


class Round:
    """One all-reduce of ``vector`` into ``out`` with the group; ``run()`` blocks until it is over.

    :param vector: this peer's flat float32 contribution.
    :param out: flat float32 tensor of the same size that receives the average (garbage if the round fails) where
        this peer takes part in a part (with a flat schedule, everywhere). It may be `vector` itself: the average of
        a part arrives only once the reducer has the part, so after it was sent (or, as reducer, averaged).
    :param group_id: the group's secret id from matchmaking (HMAC key).
    :param index: this peer's position in the group order, which every peer sees alike.
    :param endpoints: per peer of the group, ([hosts], port) where its ``Listener`` accepts connections.
    :param connect: how to reach an endpoint (``connect``: over TCP).
    :param weight: this peer's weight in the average; 0 takes the others' average and adds nothing. Without a
        `roster` only: a reducer then counts each sender with the weight its hello carries.
    :param roster: every participant's announced public key and (capped) weight, and the digest of the round's
        announcements (``diloco.swarm.rounds.hello.Roster``): hellos must be signed by their sender's key and name
        this digest, and each sender counts with its roster weight. None: a round whose members all trust each other
        (benches, tests); the group-id MAC alone then tells members from strangers.
    :param signer: this peer's private key, the one announced for `index` in the roster (with a roster only).
    :param timeout: seconds any single step may take: connecting, a groupmate's next part, a reply. A sender
        silent that long is dropped from the average (the others go on); a silent reducer fails the round.
    :param round_timeout: seconds from now by which every read and write of the round's connections ends, however
        a peer paces its bytes (None: ``ROUND_STEPS`` x `timeout`, for rounds of whole groups the deadline that
        ``--hv.averaging-timeout`` sets). Past it the round is aborted here and fails: a peer sending a byte every
        few seconds, each within `timeout`, cannot hold it longer.
    :param schedule: who reduces and sends which parts, as this peer sees it; None: every peer holds the whole
        vector (``flat_schedule``).
    :param aggregation: how this peer, as reducer, combines the screened contributions
        (``diloco.swarm.rounds.aggregation``).
    :param sealed: seal every part and average (``diloco.swarm.rounds.frames``) under keys derived from `group_id`,
        which must then be a secret of the round's members alone (``SwarmKey.round_secret``); every peer of a round
        alike.
    """

    def __init__(
        self,
        vector: torch.Tensor,
        out: torch.Tensor,
        *,
        group_id: bytes,
        index: int,
        endpoints: Sequence[Endpoint],
        codec: Codec,
        timeout: float,
        weight: float | None = None,
        roster: Roster | None = None,
        signer: Ed25519PrivateKey | None = None,
        round_timeout: float | None = None,
        max_norm_ratio: float = MAX_NORM_RATIO,
        schedule: Schedule | None = None,
        connect: Connect = connect,
        aggregation: Aggregation = "mean",
        sealed: bool = False,
    ):
        self.started = time.monotonic()
        self.deadline = self.started + (ROUND_STEPS * timeout if round_timeout is None else round_timeout)
        self.vector, self.out, self.group_id, self.index = vector, out, group_id, index
        self.sealed, self.roster, self.signer = sealed, roster, signer
        if (roster is None) != (signer is None) or (roster is None) == (weight is None):
            raise ValueError("a round takes either a weight, or a roster and this peer's signing key")
        if roster is not None and (len(roster.keys) != len(endpoints) or roster.keys[index] != public_bytes(signer)):
            raise ValueError(f"the roster is not of this group of {len(endpoints)}, or names another key for {index}")
        self._keys: dict[int, tuple[bytes, bytes] | None] = {}  # per reducer: the keys of our connection to it
        self.aggregation = aggregation
        if codec.relay is not None and aggregation != "mean":
            raise ValueError(f"{aggregation} has no form for a relaying codec ({codec.name})")
        self.connector = connect
        self.endpoints, self.codec, self.timeout, self.max_norm_ratio = endpoints, codec, timeout, max_norm_ratio
        self.k = len(endpoints)
        self.schedule = schedule or flat_schedule(vector.numel(), self.k, codec.part_numel, index)
        if self.schedule.me != index or len(self.schedule.parts) != self.k:
            raise ValueError(f"the schedule is not peer {index}'s of a group of {self.k}")
        if any(index not in part.senders for part in self.schedule.parts[index]):
            raise ValueError("a reducer must contribute to each of its parts")
        self.digest = self.schedule.digest[:16]
        self._sends = [self.schedule.sent_to(j) for j in range(self.k)]  # our parts of each reducer's span
        self.tag = hashlib.sha256(group_id).digest()[:16]
        self.bytes_sent = self.bytes_received = 0
        self.bytes_inbound = 0  # of both, over connections other peers opened to this one (as its reducer's)
        self.bytes_to = [0] * self.k  # of both, over the connection this peer opened to each reducer
        self.rejected = 0  # senders (this peer included) whose contribution this peer, as reducer, left out
        self.dropped = 0  # groupmates left out of our span for what they sent or did not send (frames, silence)
        self._cv = threading.Condition()
        span = self.schedule.parts[index]
        self._parts: list[dict[int, torch.Tensor] | None] = [{} for _ in span]  # sender -> its part
        self._norms: list[dict[int, float]] = [{} for _ in span]
        # per sender, the parts of our span it sends (in order), and each part's place in that list
        self._sent_by = {s: [q for q, part in enumerate(span) if s in part.senders] for s in range(self.k)}
        self._place: list[dict[int, int]] = [{} for _ in span]
        for sender, places in self._sent_by.items():
            for i, q in enumerate(places):
                self._place[q][sender] = i
        self._delivered = [0] * self.k  # parts of our span each sender delivered
        self._replied = [0] * self.k  # averages of our span sent back to each sender
        self._weights: dict[int, float] = {index: weight if roster is None else roster.weights[index]}
        self._banned: dict[int, str] = {}  # sender -> why it is left out from now on
        self._results: dict[int, tuple[torch.Tensor, object]] = {}  # part of our span -> (average, its encoding)
        self._messages: list[dict[int, object]] = [{} for _ in span]  # relaying codecs: sender -> its message
        self._reduced = 0
        self._attached: set[int] = set()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._complete: set[int] = set()  # reducers whose whole span of averages is in ``out``
        self._errors: list[str] = []
        self._aborted = False

    # ---------------------------------------------------------------------------------------------- entry points

    def run(self) -> None:
        """Average with the group; raises ``RoundFailed`` unless ``out`` holds the whole average. Returns only once
        this peer's groupmates received its replies and closed (or were dropped, or let ``timeout`` pass), so leaving
        right after is safe."""
        # reducers we send nothing to (a vector shorter than the group, or parts held by our groupmates)
        self._complete.update(j for j in range(self.k) if j != self.index and not self._sends[j])
        workers = [self._thread(self._reduce)]
        reducers = [j for j in range(self.k) if j != self.index and j not in self._complete]
        workers += [self._thread(self._exchange, j) for j in reducers]
        for worker in workers:
            self._join(worker)
        while True:  # readers and writers of attached senders, which may still be appended
            with self._cv:
                pending = [thread for thread in self._threads if thread.is_alive()]
            if not pending:
                break
            for thread in pending:
                self._join(thread)
        with self._cv:
            self._aborted = True  # late connections are refused from now on
            sockets = list(self._sockets)
        for sock in sockets:
            close_socket(sock)
        problems = list(self._errors)
        if self.index in self._banned:
            problems.append(f"our own contribution was left out ({self._banned[self.index]})")
        missing = sorted(set(range(self.k)) - self._complete)
        if missing and not problems:
            problems.append(f"no averages from reducers {missing}")
        if problems:
            raise RoundFailed("; ".join(problems))

    def abort(self, reason: str = "aborted") -> None:
        """Stop every thread of the round soon (closing its sockets); ``run()`` then raises."""
        with self._cv:
            self._aborted = True
            self._errors.append(reason)
            self._cv.notify_all()
            sockets = list(self._sockets)
        for sock in sockets:
            close_socket(sock)

    def attach(self, sock: socket.socket, hello: bytes) -> None:
        """Take over a sender's connection whose hello (fields, signature and MAC) was read by the ``Listener``.
        The MAC first: a stranger is refused before any signature work."""
        expected = hellos.Hello(self.tag, -1, self.index, self.k, self.digest, self.codec.name.encode(), 0.0, b"", b"")
        sender, weight = hellos.accept(hello, self.group_id, expected, self.roster)
        if not self._sent_by[sender]:
            raise ConnectionError(f"sender {sender} holds no part of our span")
        with self._cv:
            if self._aborted or sender in self._attached or sender in self._banned:
                raise ConnectionError(f"sender {sender} is not expected (any more)")
            self._attached.add(sender)
            self._weights[sender] = weight
            self._sockets.append(sock)
        sock.settimeout(self.timeout)
        nonce = hellos.answer(sock, hello, self.group_id, self.sealed, self.deadline)
        # we answer: the second key of the pair is ours to send under
        frames = _frames(sock, seal_keys(self.group_id, hello + nonce)[::-1] if self.sealed else None, self.deadline)
        with self._cv:
            self.bytes_sent += len(nonce) + hellos.MAC_SIZE
            self.bytes_inbound += len(nonce) + hellos.MAC_SIZE
            self._threads.append(self._thread(self._read_parts, frames, sender))
            self._threads.append(self._thread(self._write_averages, frames, sender))

    # --------------------------------------------------------------------------------------------- reducer side

    def _reduce(self) -> None:
        """Average each part of our span once every sender delivered it (or was dropped); publish the encoding."""
        try:
            for q, part in enumerate(self.schedule.parts[self.index]):
                lo, hi = self._bounds(part)
                own = self.vector[lo:hi]
                if self.codec.relay is not None:  # what the others receive of it: its message, decoded
                    message = self.codec.encode_part(own, part.start)
                    self._messages[q][self.index] = message
                    own = self.codec.decode_part(memoryview(message), hi - lo, part.start)
                self._deposit(self.index, q, own, part_norm(own))
                contributions = self._wait_for_part(q)
                if contributions is None:
                    return
                average, encoded = self._average(q, contributions)
                if self.index not in self._banned:  # our own output: the bytes the others receive, decoded
                    ours = average if self.codec.raw else self.codec.decode_average(
                        memoryview(encoded), hi - lo, part.start, len(part.senders))  # fmt: skip
                    self.out[lo:hi].copy_(ours)
                    if not all_finite(ours):
                        self._fail(f"our average of part {q} holds NaN/Inf (no contribution of positive weight)")
                with self._cv:
                    self._results[q] = (average, encoded)
                    self._parts[q] = None
                    self._reduced = q + 1
                    self._cv.notify_all()
                    # bound the averages kept for slow readers; a writer that fails bans its sender, ending the wait
                    self._cv.wait_for(lambda: self._aborted or self._release() < WINDOW)
            with self._cv:
                self._complete.add(self.index)
        except Exception as e:  # a bug or an allocation failure: the round cannot complete anywhere
            self._fail(f"reducer: {type(e).__name__}: {e}")
            self.abort()

    def _wait_for_part(self, q: int) -> dict[int, tuple[torch.Tensor, float]] | None:
        """Contributions to part q that pass screening, by sender; None if the round was aborted."""
        with self._cv:
            place = self._place[q]
            ready = self._cv.wait_for(
                lambda: self._aborted or all(self._delivered[s] > i or s in self._banned for s, i in place.items()),
                timeout=self.timeout,
            )
            if self._aborted:
                return None
            if not ready:
                for sender, i in place.items():
                    if self._delivered[sender] <= i and sender not in self._banned:
                        self._ban(sender, f"no part {q} of our span within {self.timeout:.3g} s")
            live = [s for s in sorted(self._parts[q]) if s not in self._banned]
            parts = {s: self._parts[q][s] for s in live}
            norms = {s: self._norms[q][s] for s in live}
            weights = {s: self._weights[s] for s in live}
        reasons = screen(norms, weights, self.max_norm_ratio)
        with self._cv:
            for sender, reason in reasons.items():
                if sender not in self._banned:
                    self.rejected += 1
                    who = "our own contribution" if sender == self.index else f"the contribution of peer #{sender}"
                    logger.warning(f"averaging: rejected {who} from part {q} of our span on ({reason})")
                    self._ban(sender, f"rejected: {reason}", quiet=True)  # logged just above
        return {s: (parts[s], weights[s]) for s in live if s not in reasons}

    def _average(self, q: int, contributions: dict[int, tuple[torch.Tensor, float]]) -> tuple[torch.Tensor, object]:
        """Weighted mean in sender order (0/0 = NaN when nothing is left, which fails the round at every peer), or
        the round's robust rule; with a relaying codec, the kept contributions' messages and weights in sender order
        (the values: None)."""
        if self.codec.relay is not None:
            with self._cv:
                messages = self._messages[q]
                self._messages[q] = {}
            return None, self.codec.relay([(messages[s], weight) for s, (_, weight) in contributions.items()])
        if not contributions:
            average = torch.full((self.schedule.parts[self.index][q].numel,), float("nan"))
            return average, self.codec.encode(average)
        if self.aggregation != "mean":
            parts, weights = zip(*contributions.values())
            average = aggregate(parts, weights, self.aggregation)
            return average, self.codec.encode(average)
        (first, (average, weight)), *others = contributions.items()
        # a groupmate's decoded part is a buffer of this round alone: accumulate into it (our own is the input)
        if first == self.index:
            average = average * weight
        elif weight != 1.0:  # the usual weight 1 saves a pass
            average.mul_(weight)
        total = weight
        for part, weight in (contribution for _, contribution in others):
            average.add_(part, alpha=weight)
            total += weight
        average.div_(total)
        return average, self.codec.encode(average)

    def _deposit(self, sender: int, q: int, part: torch.Tensor, norm: float) -> None:
        with self._cv:
            if sender not in self._banned and self._parts[q] is not None:
                self._parts[q][sender] = part
                self._norms[q][sender] = norm
            self._delivered[sender] = self._place[q][sender] + 1
            self._cv.notify_all()

    def _read_parts(self, frames: Frames, sender: int) -> None:
        span = self.schedule.parts[self.index]
        try:
            for q in self._sent_by[sender]:
                part = span[q]
                with self._cv:
                    self._cv.wait_for(lambda: self._aborted or sender in self._banned or q - self._reduced < WINDOW)
                    if self._aborted or sender in self._banned:
                        return
                data = self._receive(frames, self.codec.max_bytes(part.numel), inbound=True)
                try:
                    values = self.codec.decode_part(data, part.numel, part.start)
                except (ValueError, RuntimeError) as e:  # (torch's words for a buffer too short)
                    raise ValueError(f"part {q}: {data.nbytes} bytes do not decode to {part.numel} values") from e
                if values.numel() != part.numel:
                    raise ValueError(f"part {q} decodes to {values.numel()} values, {part.numel} expected")
                norm = self._local(part_norm, values)
                if self.codec.relay is not None:
                    with self._cv:
                        if self._parts[q] is not None:
                            self._messages[q][sender] = data
                self._deposit(sender, q, values, norm)
        except _LocalFailure:
            return  # this peer's round failed (recorded): the sender is not to blame
        except Exception as e:  # the connection (OSError), a message too long or undecodable: the sender's
            with self._cv:
                if not self._aborted:
                    self._ban(sender, f"its parts stopped: {type(e).__name__}: {e}")

    def _write_averages(self, frames: Frames, sender: int) -> None:
        try:
            for i, q in enumerate(self._sent_by[sender]):
                with self._cv:
                    self._cv.wait_for(lambda: self._aborted or sender in self._banned or q in self._results)
                    if self._aborted or sender in self._banned:
                        return
                    encoded = self._results[q][1]
                self._send(frames, encoded, inbound=True)
                with self._cv:
                    self._replied[sender] = i + 1
                    self._release()
                    self._cv.notify_all()
            # the sender's parts were all read (its last average needed its last part): nothing else reads the socket
            await_close(frames.sock, min(self.timeout, self.deadline - time.monotonic()))
        except OSError as e:
            with self._cv:
                if not self._aborted:
                    self._ban(sender, f"its averages could not be sent: {type(e).__name__}: {e}")
        finally:
            close_socket(frames.sock)  # a banned sender sees its averages end short: its round fails

    def _release(self) -> int:
        """Forget the averages every live sender of theirs has been sent (call with the lock held); returns how many
        are still kept."""
        for q in list(self._results):
            if all(s == self.index or s in self._banned or self._replied[s] > i for s, i in self._place[q].items()):
                del self._results[q]
        return len(self._results)

    def _ban(self, sender: int, reason: str, quiet: bool = False) -> None:
        """Leave ``sender`` out of every part not averaged yet (call with the lock held)."""
        if sender not in self._banned:
            self._banned[sender] = reason
            if sender != self.index and not quiet:  # quiet: a rejected contribution, counted in `rejected`
                self.dropped += 1
                logger.warning(f"averaging: peer #{sender} left out of our span: {reason}")
            self._cv.notify_all()

    # ---------------------------------------------------------------------------------------------- sender side

    def _exchange(self, reducer: int) -> None:
        """Send our parts of ``reducer``'s span and receive its averages into ``out``."""
        sock = None
        try:
            sock = self._connect(reducer)
            frames = _frames(sock, self._keys[reducer], self.deadline)
            receiver = self._thread(self._read_averages, frames, reducer)
            for part in self._sends[reducer]:
                lo, hi = self._bounds(part)
                self._send(frames, self.codec.encode_part(self.vector[lo:hi], part.start), reducer=reducer)
            receiver.join()
        except Exception as e:  # OSError mostly; anything else must fail the round too, not just this thread
            self._fail(f"reducer #{reducer}: {type(e).__name__}: {e}")
        finally:
            if sock is not None:
                close_socket(sock)

    def _read_averages(self, frames: Frames, reducer: int) -> None:
        try:
            for part in self._sends[reducer]:
                lo, hi = self._bounds(part)
                if self.codec.raw:  # straight into the output: no copy
                    self._receive_into(frames, bytes_of(self.out[lo:hi]), reducer)
                else:
                    data = self._receive(frames, self.codec.average_max_bytes(hi - lo, len(part.senders)),
                                         reducer=reducer)  # fmt: skip
                    self.out[lo:hi].copy_(self.codec.decode_average(data, hi - lo, part.start, len(part.senders)))
                # applied, NaN/Inf would end every group's training (a reducer whose part had no contribution of
                # positive weight, or a hostile one): the round fails instead, and the inner steps carry over
                if not all_finite(self.out[lo:hi]):
                    raise ValueError(f"its average of values [{part.start}, {part.stop}) holds NaN/Inf")
            with self._cv:
                self._complete.add(reducer)
        except (OSError, ValueError, RuntimeError) as e:
            self._fail(f"averages of reducer #{reducer}: {type(e).__name__}: {e}")
            close_socket(frames.sock)  # stops our sending thread too

    def _connect(self, reducer: int) -> socket.socket:
        """A connection to ``reducer`` past the handshake."""
        return self.connector(self.endpoints[reducer], min(self.timeout, 5.0), lambda s: self._handshake(s, reducer))

    def _handshake(self, sock: socket.socket, reducer: int) -> socket.socket:
        with self._cv:
            self._sockets.append(sock)
            if self._aborted:
                raise ConnectionError("aborted")
        # a reducer may hold our next part (or its average) back for up to `timeout` while it waits for a slow
        # groupmate before dropping it: give our side of the connection twice that
        sock.settimeout(2 * self.timeout)
        digest = hellos.NO_DIGEST if self.roster is None else self.roster.digest
        fields = hellos.new_hello(self.tag, self.index, reducer, self.k, self.digest, self.codec.name,
                                  self._weights[self.index], digest)  # fmt: skip
        hello = hellos.pack(fields, self.group_id, self.signer)
        try:
            nonce = hellos.greet(sock, hello, self.group_id, self.sealed, self.deadline)
        except OSError:
            close_socket(sock)
            raise
        with self._cv:
            self._keys[reducer] = seal_keys(self.group_id, hello + nonce) if self.sealed else None
            self.bytes_sent += len(hello)
            self.bytes_received += len(nonce) + hellos.MAC_SIZE
            self.bytes_to[reducer] += len(hello) + len(nonce) + hellos.MAC_SIZE
        return sock

    # ------------------------------------------------------------------------------------------------- helpers

    @staticmethod
    def _bounds(part: Part) -> tuple[int, int]:
        """Where `part` sits in this peer's vector (and output)."""
        assert part.local is not None, "a part this peer does not take part in"
        return part.local, part.local + part.numel

    def _send(self, frames: Frames, data, inbound: bool = False, reducer: int | None = None) -> None:
        sent = frames.send(data)
        with self._cv:
            self.bytes_sent += sent
            self._count(sent, inbound, reducer)

    def _receive(self, frames: Frames, max_bytes: int, inbound: bool = False,
                 reducer: int | None = None) -> memoryview:  # fmt: skip
        data = frames.receive(max_bytes)
        with self._cv:
            self.bytes_received += frames.overhead + data.nbytes
            self._count(frames.overhead + data.nbytes, inbound, reducer)
        return data

    def _receive_into(self, frames: Frames, view: memoryview, reducer: int | None = None) -> None:
        frames.receive_into(view)
        with self._cv:
            self.bytes_received += frames.overhead + view.nbytes
            self._count(frames.overhead + view.nbytes, False, reducer)

    def _count(self, size: int, inbound: bool, reducer: int | None) -> None:
        """(under ``_cv``) `size` bytes over a connection another peer opened (`inbound`) or ours to `reducer`."""
        self.bytes_inbound += size if inbound else 0
        if reducer is not None:
            self.bytes_to[reducer] += size

    def _local(self, compute: Callable, *args):
        """``compute(*args)``; a failure of this process (not of the data) fails the round here and stops it, so
        that it never passes for a groupmate's fault (which would leave that groupmate out of an "ok" average)."""
        try:
            return compute(*args)
        except Exception as e:
            self._fail(f"{type(e).__name__} in {compute.__name__}: {e}")
            self.abort()
            raise _LocalFailure from e

    def _join(self, thread: threading.Thread) -> None:
        """Wait for one of the round's threads. Every read and write ends by the deadline on its own; should a thread
        still run a moment after it (waiting on another), the round is aborted: it fails, but never hangs."""
        thread.join(max(0.0, self.deadline + DEADLINE_GRACE_S - time.monotonic()))
        if thread.is_alive():
            self.abort(f"past the round's deadline ({self.deadline - self.started:.3g} s after it started)")
            thread.join()

    def _fail(self, problem: str) -> None:
        if time.monotonic() >= self.deadline:  # (a read or write cut by it reads "timed out" otherwise)
            problem += " (past the round's deadline)"
        with self._cv:
            self._errors.append(problem)

    def _thread(self, target: Callable, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"butterfly-{target.__name__}")
        thread.start()
        return thread
