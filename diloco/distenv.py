"""Where this process sits in its worker group, as its launcher describes it: read once, at the edge.

No torch here: the command line reads it before deciding whether to import anything heavy.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1  # prctl(2) option


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in its worker group, as torchrun describes it (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    under_launcher: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> DistEnv:
        """Read torchrun's variables once, at the edge."""
        if "RANK" not in environ:
            return cls()
        world_size = int(environ["WORLD_SIZE"])
        return cls(
            rank=int(environ["RANK"]),
            world_size=world_size,
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world_size)),
            under_launcher=True,
        )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def stop_with_launcher(env: DistEnv) -> None:
    """Ask the kernel for SIGTERM when the launcher dies (Linux). torchrun starts each rank in a session of its
    own, so `kill -9 <torchrun>` would otherwise leave the ranks training, orphaned; with this they stop as if
    stopped with SIGTERM (checkpoint, summary), and their hivemind processes with them."""
    if not env.under_launcher or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)
