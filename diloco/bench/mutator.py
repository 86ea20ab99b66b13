"""The fuzzer's machinery: a seeded mutator that turns valid examples into malformed, truncated, oversized,
wrong-typed and deeply nested ones, a watchdog that times every call, and the tally of one target's outcomes
(``diloco.bench.fuzz`` holds the targets)."""


from __future__ import annotations

import json
import queue
import random
import re
import reprlib
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

HANG_S = 2.0  # a single parse taking longer than this is a hang
EXAMPLES = 5  # crashes and hangs kept per target, with their input and traceback
BIG = 10**6  # items of the large lists, characters of the large strings
DEEP = 100_000  # nesting of the deep values
MAX_STORED = 2**16  # bytes of a value stored in the DHT (records are a few hundred)


class Refused(Exception):
    """A parser's input was refused by its contract (None, False, or the ValueError it documents)."""


class Broken(Exception):
    """A parser returned a value outside its contract (a wrong type, a wrong size)."""


class Hung(Exception):
    """The listener held a connection, or the DHT a read, past its bound: counted as a hang."""


@dataclass
class Tally:
    """What one target made of its inputs."""

    inputs: int = 0
    accepted: int = 0
    refusals: int = 0
    crashes: int = 0
    hangs: int = 0
    seconds: float = 0.0
    examples: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Target:
    """A parser under test: its valid examples, how an input is made of one, and how it is called.

    :param call: parses one input; returns normally when it accepted it, raises ``Refused`` (or one of
        `refusals`) when it refused it; anything else it raises is a crash.
    :param weight: its share of the inputs, relative to the others'.
    """

    name: str
    seeds: list[Any]
    make: Callable[[Mutator, Any], Any]
    call: Callable[[Any], None]
    refusals: tuple[type[BaseException], ...] = ()
    weight: float = 1.0


def short(value: Any) -> str:
    """A bounded description of any input (deep, huge, or with an int too long to print)."""
    described = reprlib.Repr()
    described.maxlevel, described.maxstring, described.maxother = 4, 60, 60
    described.maxlist, described.maxdict, described.maxlong = 6, 8, 40
    try:
        return described.repr(value)[:300]
    except Exception as e:  # noqa: BLE001 - an int past Python's digit limit, a recursion: describe it otherwise
        return f"<{type(value).__name__}: {type(e).__name__}>"


def _deep(depth: int, wrap: Callable[[Any], Any]) -> Any:
    value: Any = None
    for _ in range(depth):
        value = wrap(value)
    return value


class Mutator:
    """Seeded mutations of Python values (records, announcements) and of bytes (wire messages, JSON)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        # built once: the harness makes ~100k inputs, and these cost milliseconds each
        self.big = [0] * BIG, "x" * BIG, {i: i for i in range(BIG // 10)}, bytes(BIG)
        self.deep = _deep(DEEP, lambda v: [v]), _deep(DEEP, lambda v: {"a": v})

    def nasty(self) -> Any:
        """A value no field expects."""
        r = self.rng
        choices: list[Callable[[], Any]] = [
            lambda: None, lambda: True, lambda: -1, lambda: 2**63, lambda: 2**64 + 1, lambda: 10**400,
            lambda: -(10**4000), lambda: float("nan"), lambda: float("inf"), lambda: -float("inf"), lambda: 1e308,
            lambda: "", lambda: "\udcff\x00", lambda: "٣", lambda: b"bytes", lambda: bytearray(b"x"),
            lambda: [], lambda: {}, lambda: (), lambda: {1: 2, b"k": None, None: 1, (1, 2): [], 1.5: "f"},
            lambda: r.choice(self.big), lambda: r.choice(self.deep), lambda: [float("nan")] * 3,
            lambda: [[["127.0.0.1"], 10**30]], lambda: SimpleNamespace(value=1), lambda: object(),
            lambda: r.randrange(-(2**70), 2**70), lambda: r.random() * 10 ** r.randrange(-30, 300),
            lambda: "".join(chr(r.randrange(0x110000)) for _ in range(r.randrange(1, 20))),
            lambda: r.randbytes(r.randrange(0, 64)),
        ]  # fmt: skip
        return r.choice(choices)()

    def value(self, seed: Any, depth: int = 0) -> Any:
        """`seed` with one to three changes: a field replaced, dropped, added, renamed, or an element changed."""
        value = seed
        for _ in range(self.rng.randint(1, 3)):
            value = self._once(value, depth)
        return value

    def _once(self, value: Any, depth: int) -> Any:
        r = self.rng
        if r.random() < 0.08 or depth > 3 or (isinstance(value, (dict, list, tuple, str)) and len(value) > 1000):
            return self.nasty()  # (a large value already: copying it again costs time, not coverage)
        if isinstance(value, dict) and value:
            value = dict(value)
            key = r.choice(list(value))
            move = r.randrange(6)
            if move == 0:
                del value[key]
            elif move == 1:
                value[r.choice([key + "_", b"peers", 7, None, "owner", "\x00"])] = self.nasty()
            elif move == 2:
                value[key.encode() if isinstance(key, str) else str(key)] = value.pop(key)
            elif move == 3:
                value[key] = self._once(value[key], depth + 1)
            else:
                value[key] = self.nasty()
            return value
        if isinstance(value, (list, tuple)) and value:
            items = list(value)
            i = r.randrange(len(items))
            move = r.randrange(5)
            if move == 0:
                del items[i]
            elif move == 1:
                items.insert(i, self.nasty())
            elif move == 2:
                items = items * r.choice([2, 1000])
            else:
                items[i] = self._once(items[i], depth + 1)
            return items if r.random() < 0.7 else tuple(items)
        if isinstance(value, bool):
            return r.choice([not value, int(value), str(value), None])
        if isinstance(value, int):
            return r.choice([-value, value + 1, 2**63, 10**400, float(value), str(value), bool(value % 2)])
        if isinstance(value, float):
            return r.choice([float("nan"), float("inf"), -value, int(value), value * 1e300, 10**400, str(value)])
        if isinstance(value, str):
            return r.choice([value.encode(), value * 300, value[: len(value) // 2], value + "\x00", 1, None])
        return self.nasty()

    def bytes(self, seed: bytes) -> bytes:
        """`seed` (bytes) with one to four changes: bits flipped, cut short, extended, spliced, overwritten."""
        data = bytearray(seed)
        r = self.rng
        for _ in range(r.randint(1, 4)):
            move = r.randrange(8)
            at = r.randrange(len(data) + 1)
            if move == 0 and data:
                data[min(at, len(data) - 1)] ^= 1 << r.randrange(8)
            elif move == 1:
                del data[at:]
            elif move == 2:
                data[at:at] = r.randbytes(r.randrange(1, 64))
            elif move == 3:
                data[at : at + 8] = r.choice([b"\xff" * 8, b"\x00" * 8, (2**63).to_bytes(8, "big"),
                                              (2**31).to_bytes(8, "little")])  # fmt: skip
            elif move == 4:
                data = bytearray(r.randbytes(r.randrange(0, 256)))
            elif move == 5 and data:
                lo = r.randrange(len(data))
                data[at:at] = data[lo : lo + r.randrange(1, 64)]
            elif move == 6:
                del data[at : at + r.randrange(1, 16)]
            else:
                data[at:at] = bytes([r.randrange(256)]) * r.randrange(1, 2000)
        return bytes(data)

    def json(self, seed: Any) -> bytes:
        """JSON text of a mutated `seed`, or text no JSON parser should take kindly (deep, huge numbers, bad UTF-8)."""
        r = self.rng
        move = r.randrange(10)
        if move == 0:
            return b"[" * r.choice([1000, DEEP]) + b"]" * r.randrange(2)
        if move == 1:
            return b'{"a":' * r.choice([1000, 30_000]) + b"1" + b"}" * r.randrange(3)
        if move == 2:
            return r.choice([b"9" * 5000, b"1e999", b"NaN", b"-Infinity", b'{"a": 1e99999}', b"\xff\xfe{}",
                             b'{"a":1,"a":2}', b"\xef\xbb\xbf{}", b"", b"null",
                             b'"' + b"\\u0000" * 100 + b'"'])  # fmt: skip
        if move in (3, 4):
            return self.number(json.dumps(seed).encode())
        try:
            text = json.dumps(self.value(seed)).encode()
        except (TypeError, ValueError, RecursionError):
            text = json.dumps(seed).encode()
        return self.bytes(text) if move < 7 else text

    def number(self, text: bytes) -> bytes:
        """JSON `text` with one of its numbers made huge, infinite or not a number."""
        numbers = list(re.finditer(rb"-?[0-9][0-9.eE+-]*", text))
        if not numbers:
            return text
        at = self.rng.choice(numbers)
        number = self.rng.choice([b"9" * 400, b"9" * 400, b"-" + b"9" * 400, b"1e999", b"NaN", b"-Infinity", b"-0"])
        return text[: at.start()] + number + text[at.end() :]


# ---------------------------------------------------------------- running targets under a watchdog


class Watchdog:
    """Runs calls on a worker thread and waits at most ``HANG_S`` for each; a call that overruns is a hang, its
    worker is left behind (a daemon) and a fresh one takes the next call."""

    def __init__(self, hang_s: float = HANG_S) -> None:
        self.hang_s = hang_s
        self._start()

    def _start(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        threading.Thread(target=self._work, args=(self._jobs, self._done), daemon=True, name="fuzz-worker").start()

    @staticmethod
    def _work(jobs: queue.Queue, done: queue.Queue) -> None:
        while True:
            call, value = jobs.get()
            try:
                call(value)
                done.put((None, None))
            except BaseException as e:  # noqa: BLE001 - classified by the caller
                done.put((e, traceback.format_exc(limit=-4)))

    def run(self, call: Callable[[Any], None], value: Any) -> tuple[BaseException | None, str | None] | None:
        """(exception or None, its traceback) of ``call(value)``; None when it did not return within ``hang_s``."""
        self._jobs.put((call, value))
        try:
            return self._done.get(timeout=self.hang_s)
        except queue.Empty:
            self._start()
            return None


def fuzz_target(target: Target, inputs: int, mutator: Mutator, watchdog: Watchdog) -> Tally:
    """`inputs` inputs made from `target`'s seeds, each parsed under `watchdog`."""
    tally, started = Tally(), time.monotonic()
    for _ in range(4 * inputs):  # (bounded: a target whose values mostly fail to serialize still ends)
        if tally.inputs >= inputs:
            break
        try:
            value = target.make(mutator, mutator.rng.choice(target.seeds))
        except (RecursionError, ValueError, TypeError, OverflowError):
            continue  # the mutator could not serialize this one (a deep value as JSON): no input, make another
        tally.inputs += 1
        outcome = watchdog.run(target.call, value)
        if outcome is None:
            tally.hangs += 1
            _example(tally, "hang", value, f"no answer within {watchdog.hang_s} s")
            continue
        error, trace = outcome
        if isinstance(error, Hung):
            tally.hangs += 1
            _example(tally, "hang", value, str(error))
        elif error is None:
            tally.accepted += 1
        elif isinstance(error, Refused) or isinstance(error, target.refusals):
            tally.refusals += 1
        else:
            tally.crashes += 1
            _example(tally, "crash", value, f"{type(error).__name__}: {str(error)[:300]}\n{trace}")
    tally.seconds = round(time.monotonic() - started, 3)
    return tally


def _example(tally: Tally, kind: str, value: Any, what: str) -> None:
    if len(tally.examples) < EXAMPLES:
        tally.examples.append({"kind": kind, "input": short(value), "error": what[-2000:]})


