"""Where this process sits in its worker group, as its launcher describes it: read once, at the edge.

The launcher is torchrun (RANK, WORLD_SIZE, ...) or, for `srun -n N python -m diloco.train` without torchrun,
Slurm (SLURM_PROCID, SLURM_NTASKS, ...). No torch here: the command line reads it before deciding whether to
import anything heavy.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from diloco.errors import UsageError

PR_SET_PDEATHSIG = 1  # prctl(2) option
SLURM_PORT_BASE = 15000  # rendezvous ports derived from a Slurm job id lie in [15000, 45000)
SLURM_PORT_SPAN = 30000
SLURM_PORTS_PER_JOB = 64  # distinct ports for the first 64 steps (or worker groups) of one job


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in its worker group, as torchrun or srun describes it (alone: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    under_launcher: bool = False
    rendezvous: dict[str, str] | None = None  # from Slurm: what torchrun would have set (MASTER_ADDR, RANK, ...)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> DistEnv:
        """Read torchrun's variables once, at the edge; without them, an srun step of several tasks."""
        if "RANK" in environ:
            world_size = int(environ["WORLD_SIZE"])
            return cls(
                rank=int(environ["RANK"]),
                world_size=world_size,
                local_rank=int(environ.get("LOCAL_RANK", 0)),
                local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world_size)),
                under_launcher=True,
            )
        # SLURM_STEP_ID: srun sets it, the batch script (whose SLURM_NTASKS is the job's, not its own) does not
        if "SLURM_STEP_ID" in environ and int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", 1))) > 1:
            return cls.from_slurm(environ)
        return cls()

    @classmethod
    def from_slurm(cls, environ: Mapping[str, str]) -> DistEnv:
        """The tasks of one srun step are one worker group: without this, `srun -n 2 python -m diloco.train`
        would be two silent copies each training alone. The rendezvous is the step's first host (MASTER_ADDR,
        unless set) on `slurm_port(job id, step id)` (MASTER_PORT, unless set)."""
        try:
            world_size = int(environ.get("SLURM_STEP_NUM_TASKS") or environ["SLURM_NTASKS"])
            rank, local_rank = int(environ["SLURM_PROCID"]), int(environ.get("SLURM_LOCALID", 0))
            node_id = int(environ.get("SLURM_NODEID", 0))
        except (KeyError, ValueError) as e:
            raise UsageError(f"srun step: SLURM_PROCID and SLURM_NTASKS must be set to numbers ({e})") from None
        per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", ""))
        local_world_size = tasks_on_node(per_node, node_id) if per_node else world_size
        nodelist = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", "localhost"))
        port = slurm_port(int(environ.get("SLURM_JOB_ID", 0)), int(environ.get("SLURM_STEP_ID", 0)))
        rendezvous = {
            "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist),
            "MASTER_PORT": environ.get("MASTER_PORT") or str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world_size),
        }
        return cls(rank, world_size, local_rank, local_world_size, under_launcher=True, rendezvous=rendezvous)

    def export(self, environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
        """Set, in this one place, the variables torch's env:// rendezvous reads (and torchrun would have set),
        for an srun step started without torchrun; a no-op otherwise."""
        if self.rendezvous is not None:
            environ.update(self.rendezvous)

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


def slurm_port(job_id: int, step_id: int) -> int:
    """A TCP port every task of one srun step computes alike, distinct for the first 64 steps of a job and for
    jobs whose ids differ by less than 30000 / 64: 15000 + (64 * job id + step id) mod 30000."""
    return SLURM_PORT_BASE + (SLURM_PORTS_PER_JOB * job_id + step_id) % SLURM_PORT_SPAN


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """The task count of node `node_id` in Slurm's compressed form, e.g. "2(x3),1": 2 on nodes 0-2, 1 on 3."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise UsageError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r}: not Slurm's form (e.g. 2(x3),1)")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts[min(node_id, len(counts) - 1)]


def first_host(nodelist: str) -> str:
    """The first host name of a Slurm node list ("node[6-7]" -> "node6"), as `scontrol show hostnames` says."""
    if re.fullmatch(r"[\w.-]+", nodelist):
        return nodelist  # one plain host name: no need to ask scontrol
    if shutil.which("scontrol") is None:
        raise UsageError(f"SLURM_JOB_NODELIST={nodelist}: scontrol is not on PATH to expand it; set MASTER_ADDR")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    hosts = out.stdout.split()
    if out.returncode or not hosts:
        raise UsageError(f"scontrol show hostnames {nodelist}: {' '.join(out.stderr.split()) or 'no host'}")
    return hosts[0]
