"""A round that is on the wire while the inner steps go on (``--hv.overlap-steps T``).

The outer loop (``diloco.outer.diloco.DiLoCo``) starts the round on a thread of its own and lands it T inner steps
later: it waits for the thread (the round is usually over by then), then applies the result as a blocking round
would, merging it into the model (``OuterOptimizer.step``'s `mix`). One round is in flight at a time. The thread
only calls ``Swarm.average``, which reaches the group's other ranks over process groups of its own, never the
ones the inner steps use (``diloco.swarm.start.group_rounds``), so it cannot interleave with the model's collectives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco.outer.links import RoundResult, Swarm


@dataclass
class InFlight:
    """One round started at inner step `step`, to land at `land_at`: what applying it needs."""

    step: int
    land_at: int
    index: int
    fragment: int | None
    pseudo_gradient: torch.Tensor
    weight: float
    tokens: int
    source: int | None
    outer_step: int  # the outer steps applied when it was sent (a group behind the round's others sits it out)
    summary: dict[str, Any] = field(default_factory=dict)  # the pace's fields for its row, as of the send
    report: RoundResult | None = None
    error: BaseException | None = None
    thread: threading.Thread = field(init=False, repr=False)
    cpu_at_start: tuple[float, float] = field(init=False, repr=False)  # (this process, the training thread)

    def start(self, swarm: Swarm, stop: Callable[[], bool]) -> InFlight:
        """Average `pseudo_gradient` in place on a background thread (called on the training thread)."""
        self.cpu_at_start = (time.process_time(), time.thread_time())

        def run() -> None:
            try:
                self.report = swarm.average(
                    [self.pseudo_gradient], round_index=self.index, weight=self.weight, stop=stop,
                    fragment=self.fragment, outer_step=self.outer_step,
                )  # fmt: skip
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread by `wait`
                self.error = e

        self.thread = threading.Thread(target=run, name=f"round-{self.index}", daemon=True)
        self.thread.start()
        return self

    def side_cpu_s(self) -> float:
        """CPU seconds this process spent beside the training thread since the start (called on the training
        thread): the round's threads, mostly (the transport's own CPU, which the inner steps shared their core
        with), and whatever else ran in the background meanwhile."""
        process, training = self.cpu_at_start
        return max(0.0, (time.process_time() - process) - (time.thread_time() - training))

    def wait(self, timeout: float | None = None) -> RoundResult | None:
        """The round's report once its thread ended (None: still running after `timeout`); re-raises its error."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            return None
        if self.error is not None:
            raise self.error
        return self.report
