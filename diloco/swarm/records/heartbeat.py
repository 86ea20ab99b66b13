"""A group's status heartbeat that does not depend on its training loop.

The training loop sends a status record with its metrics rows (``diloco.outer.beacon``), but a live group also
spends long stretches without one: a round that waits for groups on its way or times out, an evaluation, a
checkpoint, a state download, its first compiled steps. Other groups must still tell it from a dead group, by the
one rule ``arrivals.stale_after``, both to wait for it and to count it (``SwarmPeer.expected_groups``). `Heartbeat`
re-sends the last record with a fresh ``heard_at`` whenever none went out for ``HEARTBEAT_S``, from a thread of its
own, until `stop`. The record keeps its inner step: a group that sits somewhere keeps its place, so its arrival at a
later boundary moves later with each beat (``arrivals.arrival``). A joining record is re-sent unchanged, less
often, so that it does not expire however long the join takes. A process that died sends nothing.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from diloco.swarm.records.status import HEARTBEAT_S, LEFT, STATUS_TTL, Status

# a joining record's time orders two groups that claim at once (``agreement.rival_model``: the older stays), so it
# is re-sent as it is, only to outlive its expiry: a join that takes longer (a large state download) stays in the
# status table and in a newcomer's check of the run's model. A group that left is gone: never re-sent
JOINING = "joining"
JOINING_RESEND_S = STATUS_TTL / 3


class Heartbeat:
    """Re-sends the last `sent` record every `period` seconds without another one (rank 0 of a group only: the others
    send no status record, so it never starts there)."""

    def __init__(self, publish: Callable[[Status], None], period: float = HEARTBEAT_S,
                 joining_period: float = JOINING_RESEND_S) -> None:  # fmt: skip
        self.publish, self.period, self.joining_period = publish, period, joining_period
        self.last: Status | None = None
        self.sent_at = 0.0
        self.beats = 0  # records re-sent
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sent(self, record: Status) -> None:
        """The group sent `record` itself: the next beat is due `period` seconds from now."""
        with self._lock:
            self.last, self.sent_at = record, time.monotonic()
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="status-heartbeat", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.period / 4)):
            record = self._due()
            if record is not None:
                self.publish(record)

    def _due(self) -> Status | None:
        with self._lock:
            joining = self.last is not None and self.last.state == JOINING
            period = self.joining_period if joining else self.period
            if self.last is None or self.last.state in LEFT or time.monotonic() - self.sent_at < period:
                return None
            if not joining:
                self.last = dataclasses.replace(self.last, heard_at=time.time())
            self.sent_at = time.monotonic()
            self.beats += 1
            return self.last
