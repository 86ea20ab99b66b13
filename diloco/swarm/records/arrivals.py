"""When the other worker groups will reach a round, from their status records: how long a group at a boundary waits.

A group that reaches a round first would otherwise wait a fixed ``--hv.matchmaking-time`` and average alone, and a
slower group arriving a moment later would find the round gone. Each group's status record (``status.Status``) says
where it stood (``step``), how fast it trains (``tokens_per_s`` over ``batch``'s tokens per inner step) and when it
said so (``heard_at``). Under fixed H a round's boundary is one inner step in every group, so a group's arrival is
``heard_at + (boundary - step) / steps per second``. `plan_wait` waits for every live group that should arrive
within the bound (one round's worth of this group's own time), and for no group whose record is stale: a dead group
costs at most one bound per round until its heartbeat is stale, then nothing. Matchmaking still closes as soon as
every expected group is in (``Matchmaker.expect``).

Plain Python over records; the clock is passed in, so tests need no network.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from diloco.swarm.records.status import HEARTBEAT_S, NO_MORE_ROUNDS, Status

FLOOR_S = 5.0  # the least wait: boundaries a second or two apart in groups of one speed, records a heartbeat old
SLACK = 0.1  # the wait goes this share past the latest expected arrival (rates move), and at least ...
SLACK_S = 2.0  # ... this many seconds
# the last round's wait goes this far past the latest arrival: groups that finished lose nothing by waiting, a group
# that misses it has no later round for its inner steps, and one slow step (a busy machine) must not cost them
LAST_SLACK, LAST_SLACK_S = 1.0, 30.0
STALE_S = 3 * HEARTBEAT_S  # a record older than this (and two inner steps) is a group not to wait for: a live one's
# rank 0 re-sends its record every HEARTBEAT_S, in rounds and pauses too (``heartbeat``); a dead one sends nothing
SKEW_S = 30.0  # a record written further ahead of this clock is not a group's (a forged time never goes stale)
AUTO_CAP_S = 3600.0  # --hv.matchmaking-time auto: the bound limits the wait, this only guards against a bad clock


def wait_cap(setting: float | str) -> float:
    """The longest a round waits for the groups coming, for ``--hv.matchmaking-time`` `setting` (seconds or auto)."""
    return AUTO_CAP_S if setting == "auto" else float(setting)


def default_wait(setting: float | str) -> float:
    """A round's wait when no record says who is coming (none readable), for ``--hv.matchmaking-time`` `setting`."""
    return FLOOR_S if setting == "auto" else float(setting)


def tokens_per_step(batch: str) -> int | None:
    """Tokens of one inner step of a group from its status record's ``batch`` (``<total batch size>x<seq length>``);
    None when it is not that (an earlier trainer's record, or garbage)."""
    size, _, length = batch.partition("x")
    if not (size.isdigit() and length.isdigit()) or int(size) * int(length) == 0:
        return None
    return int(size) * int(length)


def stale_after(record: Status) -> float:
    """Seconds after which the record of a group that trains is stale: ``STALE_S``, plus two of its inner steps (a
    heartbeat goes out with a metrics row: a group of slow steps sends fewer)."""
    per_step = tokens_per_step(record.batch)
    if not per_step or not record.tokens_per_s or record.tokens_per_s <= 0:
        return STALE_S
    return STALE_S + 2 * per_step / record.tokens_per_s


def live(record: Status, now: float) -> bool:
    """Whether the group of `record` may still come to a round: it has rounds to come (not done, not left) and its
    record is not stale (`stale_after`). The one rule for both the wait (`plan_wait`) and the count of the groups a
    round expects (``SwarmPeer.expected_groups``)."""
    return record.state not in NO_MORE_ROUNDS and now - record.heard_at <= stale_after(record)


def arrival(record: Status, boundary: int, now: float) -> float | None:
    """Seconds from `now` until the group of `record` reaches inner step `boundary` (0: there or past it); None when
    its record gives no rate (no metrics row yet, or a record without a batch). A group away from its inner steps
    (a checkpoint, an evaluation: ``Status.paused_until``) resumes them at the end of its pause."""
    if record.step >= boundary:
        return 0.0
    per_step = tokens_per_step(record.batch)
    if not per_step or not record.tokens_per_s or record.tokens_per_s <= 0:
        return None
    steps_per_s = record.tokens_per_s / per_step
    resumes = record.heard_at if record.paused_until is None else max(record.heard_at, record.paused_until)
    return max(0.0, resumes + (boundary - record.step) / steps_per_s - now)


def plan_wait(
    records: Iterable[Status],
    *,
    me: str,
    boundary: int | None,
    now: float,
    bound: float,
    cap: float,
    floor: float = FLOOR_S,
    unknown: float | None = None,
    galaxy_size: int | None = None,
    last: bool = False,
) -> float:
    """Seconds the round at inner step `boundary` waits for the other groups (between `floor` and `cap`).

    :param records: the groups' status records; this group's own (peer `me`) and those of groups that took their
        last round (done, or left) or whose record is stale (`stale_after`) are not waited for.
    :param boundary: the round's inner step under fixed H; None when every group's round is due at one moment (a
        token budget): then each live group is expected now.
    :param bound: the longest arrival waited for: one round's worth of this group's own time.
    :param unknown: how long a live group whose record gives no pace yet is waited for (default: `bound`).
    :param galaxy_size: world ranks at or above it are no group of the run (None: any).
    :param last: the run's last round: the wait goes ``LAST_SLACK`` / ``LAST_SLACK_S`` past the latest arrival.

    A stranger in an open swarm can write status records too: one written ahead of this clock by more than
    ``SKEW_S``, or of a world rank outside the galaxy, is not waited for; any other costs at most the bound.
    """
    floor = min(floor, cap)
    latest = None  # the latest arrival waited for
    for record in records:
        if record.peer == me or not live(record, now):
            continue
        if record.heard_at > now + SKEW_S or (galaxy_size is not None and record.world_rank >= galaxy_size):
            continue
        eta = 0.0 if boundary is None else arrival(record, boundary, now)
        if eta is None:  # coming, at an unknown pace (its first metrics row is not out)
            eta = bound if unknown is None else min(unknown, bound)
        if eta <= bound:
            latest = eta if latest is None else max(latest, eta)
    if latest is None:
        return floor
    slack, slack_s = (LAST_SLACK, LAST_SLACK_S) if last else (SLACK, SLACK_S)
    wait = latest + max(slack_s, slack * latest)
    return min(cap, max(floor, wait)) if math.isfinite(wait) else cap
