"""The interface the training loop calls between its inner steps (`OuterLoop`), what it gets back (`OuterReport`),
and the stand-in for a group that trains alone (`NoOuter`, galaxy size 1: plain torch.distributed, no swarm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class OuterReport:
    """What the outer loop did at one inner step.

    :param step: the inner step to continue from: the step just taken, or the swarm's when this group was behind
        and loaded the swarm's state (the LR schedule follows it).
    :param row: the metrics row of the round (``outer_step``, ``num_peers``, ``params_sha256``, ...); None when
        there is nothing to log.
    :param before: rows of rounds applied at this step before `row`'s, oldest first: an overlapped round that
        landed as the next came due, and at the run's last step the other fragments' rounds.
    """

    step: int
    row: dict[str, Any] | None = None
    before: tuple[dict[str, Any], ...] = ()

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every row to log, oldest first."""
        return [*self.before, *([] if self.row is None else [self.row])]


class OuterLoop(Protocol):
    """Called by the training loop around its inner steps; owns whatever happens between worker groups."""

    def join(self, step: int, load_from_peers: bool = True) -> OuterReport:
        """Before the first inner step: take this group's place among the others. A group that joins a running
        swarm continues at the swarm's inner step; the row is that of the round in progress it took part in."""
        ...

    def after_inner_step(self, step: int) -> OuterReport | None:
        """Run the outer step when one is due (its report always has a row); None when none was due."""
        ...

    def position(self, step: int) -> int:
        """Where the LR schedule and the end of the run stand after inner step `step`: `step` itself, or under a
        swarm-wide token budget the swarm's progress in inner steps of an average group (``diloco.outer.pace``)."""
        ...

    def budget(self) -> tuple[int, int] | None:
        """Under a token budget the swarm's (tokens per round, rounds in the run); None under fixed H or alone."""
        ...

    def progress(self, row: dict[str, Any]) -> None:
        """After each metrics row of the inner loop (``step``, ``tokens_per_s``, ...): what the outer loop may
        tell others about this group's training; must return at once (no network waits)."""
        ...

    def pause(self, seconds: float | None) -> None:
        """This group is leaving its inner steps for about `seconds` (a checkpoint, an evaluation; None: back, or
        no estimate): the other groups' rounds expect it that much later. Must return at once."""
        ...

    def finish(self) -> dict[str, Any] | None:
        """After the last inner step of a run that was not stopped: end with the swarm's final state; return a
        metrics row when that changed the model, else None."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def summary(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class NoOuter:
    """Galaxy size 1: plain torch.distributed training, no DHT, no averaging."""

    def join(self, step: int, load_from_peers: bool = True) -> OuterReport:
        return OuterReport(step)

    def after_inner_step(self, step: int) -> OuterReport | None:
        return None

    def position(self, step: int) -> int:
        return step

    def budget(self) -> tuple[int, int] | None:
        return None

    def progress(self, row: dict[str, Any]) -> None:
        pass

    def pause(self, seconds: float | None) -> None:
        pass

    def finish(self) -> dict[str, Any] | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
