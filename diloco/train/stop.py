"""A run's stop request: what SIGINT and SIGTERM do to a training process, before and after its first step."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import time
from collections.abc import Iterator

log = logging.getLogger("diloco")


class StopRequest:
    """Set by SIGINT/SIGTERM; the loop stops at the next step boundary. A second signal exits at once, unless
    it comes within `echo_s` of the first: torchrun forwards the signal a terminal already sent to every rank,
    and that echo is the same request, not an impatient user.

    During start-up (`starting_up`) the first signal leaves at once: nothing is trained yet, so there is nothing
    to finish or save, and joining a swarm can take minutes on a busy machine (a DHT start retried, the catch-up's
    pings) while Slurm or a supervisor sends SIGKILL a short grace after SIGTERM."""

    def __init__(self, echo_s: float = 1.0) -> None:
        self.requested = False
        self.echo_s = echo_s
        self.first_at = 0.0
        self.starting = False
        self.during_startup = False  # the request came before the first step

    @contextlib.contextmanager
    def starting_up(self) -> Iterator[None]:
        """While the run starts: a stop request raises KeyboardInterrupt wherever the main thread is (the swarm's
        start-up cleans up after any exception); one that came before this block is heeded on entry."""
        self.starting = True
        try:
            if self.requested:
                self.during_startup = True
                raise KeyboardInterrupt
            yield
        finally:
            self.starting = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        # `kill -USR1 <rank>`: every thread's stack to stderr, for a rank that seems stuck (it goes on running)
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if not self.requested:
            self.requested, self.first_at = True, now
            if self.starting:
                self.during_startup = True
                log.warning("received %s during start-up: leaving now", signal.Signals(signum).name)
                raise KeyboardInterrupt
            log.warning("received %s: stopping after this step", signal.Signals(signum).name)
        elif now - self.first_at > self.echo_s:
            raise KeyboardInterrupt  # a second signal: leave now
