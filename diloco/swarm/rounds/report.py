"""What one averaging round reports to the outer loop (``RoundReport``), and the round's public name."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundReport:
    """Outcome of one averaging round (``GroupRounds.average``), or of its matchmaking (``Matchmaker.match``).

    :param num_peers: peers (worker groups) in the averaging group, including this one; 1 = nobody else was ready
        (tensors kept as they were). When ``ok`` is False: the size of the group that failed (0 if none formed).
    :param seconds: wall time of matchmaking + all-reduce, in seconds.
    :param bytes_sent: serialized bytes this peer sent in the round (tensor parts and averaged parts).
    :param bytes_received: serialized bytes this peer received in the round.
    :param ok: False when the round failed and the tensors were left untouched. Peers with ok=True of the same
        group hold identical bytes; at least one peer of a group reports ok=False if any part went wrong.
    :param transport: what carried the round's bytes: "tcp" or "p2pd"; "" when no group formed.
    :param allreduce_seconds: of ``seconds``, the part from the moment the group was formed (matchmaking over) to
        the result in the tensors; 0 when no group formed.
    :param round_id: a short id of the round's group (hex, the same for every member of one round): which groups
        averaged together; "" when no group formed.
    :param dropped: groupmates this peer, as a reducer, left out of its span for what they sent or did not send: a
        frame too long, short or undecodable, silence past the timeout, a broken connection (their values are
        ``rejected``'s business).
    :param rejected: groupmates' contributions (and this peer's own) that this peer, as a reducer, left out of the
        average for holding NaN/Inf or a norm ``diloco.swarm.rounds.screening.MAX_NORM_RATIO`` times the group's; a
        rejected peer's round fails, the others complete without it (ok=True).
    :param bytes_inbound: of ``bytes_sent`` and ``bytes_received``, those over connections other peers opened to this
        one (it reduced their parts); the rest went over connections it opened. 0 for a rank nobody can dial.
    :param bytes_relayed: of those bytes, the ones that crossed a relay (``diloco.swarm.relay``): to and from a rank
        dialled at a relay, this one or its reducer. 0 when no rank of the round is relayed.
    :param behind: this group was behind the round's others' outer step and sat the round out (ok=False; see
        ``group_round.abreast``).
    """

    num_peers: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    ok: bool
    rejected: int = 0
    transport: str = ""
    allreduce_seconds: float = 0.0
    round_id: str = ""
    dropped: int = 0
    behind: bool = False
    bytes_inbound: int = 0
    bytes_relayed: int = 0


def round_id(group_id: bytes) -> str:
    """A short public name of a round's group: the members' rows name one round alike, without its secret id."""
    return hashlib.sha256(b"round-id" + group_id).hexdigest()[:12] if group_id else ""
