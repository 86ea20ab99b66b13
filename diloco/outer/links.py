"""The two links of a worker group's outer loop (`diloco.outer.diloco.DiLoCo`): `Swarm`, to the other worker groups,
and `Group`, to the other ranks of its own group. Protocols and plain data: no torch.distributed, no hivemind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from diloco.swarm.records.budget import RoundTokens
from diloco.swarm.records.progress import Progress
from diloco.swarm.records.status import Status
from diloco.swarm.rounds.transfer import Served  # a state as this rank serves it

__all__ = ["Group", "RoundResult", "Served", "State", "Swarm", "solo_group"]


class RoundResult(Protocol):
    """What one averaging round reports (see `diloco.swarm.rounds.report.RoundReport`)."""

    num_peers: int  # worker groups in the round, this one included; 1 = averaged alone
    seconds: float
    bytes_sent: int
    bytes_received: int
    ok: bool  # False: the round failed (or was stopped): the tensors are not the average (nothing to apply)
    allreduce_seconds: float  # of `seconds`, from the group's forming to the result (the rest: waiting for it)
    rejected: int  # contributions of other groups this rank rejected (non-finite, or an outlier norm)
    transport: str  # what carried the bytes: "tcp", "p2pd", or "" (no group formed)
    round_id: str  # the same in every member of one round's group ("": no group formed): who averaged together
    dropped: int  # groupmates this rank's reducer left out for their frames or their silence (not their values)
    behind: bool  # this group was behind the others' outer step and sat the round out (ok is False)
    bytes_inbound: int  # of its bytes, those over connections other ranks opened to it (0: nobody dialled it)
    bytes_relayed: int  # of its bytes, those that crossed a relay (to or from a rank dialled at one)


State = tuple[dict[str, Any], list[torch.Tensor]]  # (small metadata, tensors) of one rank's outer state


class Swarm(Protocol):
    """This rank's link to the other worker groups."""

    peer_id: str  # this rank's peer id; others download this rank's state from it
    owner: str  # who signs this group's records (``Progress.owner``); "" on ranks that publish none
    # whether others can dial this group's rank 0: "direct", "relayed", "outbound only", "unchecked"; "": unknown
    reach: str

    def average(
        self,
        tensors: Sequence[torch.Tensor],
        round_index: int,
        weight: float,
        stop: Callable[[], bool],
        fragment: int | None = None,
        outer_step: int | None = None,
        last: bool = False,
    ) -> RoundResult:
        """Average in place with the groups averaging the same `round_index`; gives up when `stop()` is true.
        With fragments (``diloco.outer.fragments``) the tensors hold this rank's shard of `fragment`'s parameters.
        `outer_step`: the outer steps this group has applied; a group behind the others' sits the round out
        (``diloco.swarm.rounds.group_round.abreast``; not ok). `last`: the run's last round, which waits longer for
        the groups still on their way (a group that misses it has no later round for its inner steps)."""

    def image(self, values: torch.Tensor, fragment: int | None = None) -> torch.Tensor:
        """What a round carries of this rank's `values` (its local buffer of `fragment`): the values the others
        receive of them, sparse rounds' selection and rounding included (``diloco.outer.error_feedback`` keeps the
        rest). Exact wire formats: the values themselves."""
        ...

    def publish(self, record: Progress) -> None:
        """Store this group's progress record (rank 0 calls it); like `publish_status` it returns at once (the
        store goes on in the background, later ones win) and never raises."""
        ...

    def records(self) -> list[Progress]:
        """Every group's latest progress record."""
        ...

    def publish_status(self, record: Status) -> None:
        """Store this group's status record for onlookers (rank 0 calls it); returns without waiting for the
        network, and never raises."""
        ...

    def status_records(self) -> list[Status]:
        """Every group's latest status record."""
        ...

    def publish_tokens(self, record: RoundTokens) -> None:
        """Store this group's round-token record (rank 0, with ``--hv.target-tokens``); like `publish_status`
        it returns at once and never raises."""
        ...

    def token_records(self) -> list[RoundTokens]:
        """The groups' round-token records as last read; returns at once (a read of the DHT may go on in the
        background)."""
        ...

    def alive(self, peer_id: str) -> bool:
        """Whether the peer answers now."""
        ...

    @property
    def rejected_records(self) -> int:
        """Records read so far and ignored: for a missing or wrong swarm-key seal, or for not being a valid record
        (a field of the wrong type or out of range, a world rank its subkey does not name)."""
        ...

    @property
    def rejected_states(self) -> int:
        """State downloads this rank refused: an answer short, malformed, unproven or unlike its other ranks'."""
        ...

    @property
    def refused_connections(self) -> int:
        """Connections this rank's listener dropped at their hello (strangers, bad MACs, replays, late senders)."""
        ...

    def serve_state(self, provider: Callable[[], Served]) -> None:
        """Start answering state downloads of other groups with `provider()`."""
        ...

    def download_state(self, record: Progress, rank: int,
                       wanted: Callable[[dict[str, Any]], bool] | None = None) -> State | None:  # fmt: skip
        """Rank `rank`'s outer state (in this rank's layout) from the group of `record`, or None when it does not
        answer or sends none. `wanted(meta)`: whether the state the answer's metadata describes is worth receiving;
        when not, that metadata with no tensors."""
        ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class Group:
    """Collectives over the ranks of this worker group (torch.distributed in training, plain calls in tests)."""

    rank: int
    sum: Callable[[float], float]
    gather: Callable[[Any], list[Any]]  # every rank's object, in rank order, on every rank
    broadcast: Callable[[Any], Any]  # rank 0's object on every rank
    sha: Callable[[], str | None]  # params_sha256 of the whole model on rank 0, None elsewhere

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def solo_group(sha: Callable[[], str | None] = lambda: None) -> Group:
    """A worker group of one rank (tests, and single-process workers)."""
    return Group(rank=0, sum=lambda v: v, gather=lambda o: [o], broadcast=lambda o: o, sha=sha)
