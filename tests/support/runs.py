"""Several training runs, one after another, in the same torchrun ranks:
``torchrun ... -m tests.support.runs RUNS.json [MEET_DIR GROUPS]``, where the file holds a list of argument lists for
``diloco.train``. With ``MEET_DIR GROUPS``, each run starts only when the ranks 0 of ``GROUPS`` such torchruns are all
there (files in ``MEET_DIR``): groups that train a run together start it together, however unequal their starts.

Each run goes through the real command line (parsing, validation, process group, FSDP, checkpoints, summary) as
``python -m diloco.train`` would; only the processes are shared, which spares a torch import (about 6 CPU-seconds)
and a torchrun per run when a test compares the arithmetic of many strategies. Prints ``RUN <i> EXIT <code>`` per
run on rank 0 and exits 0 only if every run did.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

from diloco.cli.app import build_app, run_app

MEET_TIMEOUT_S = 600.0
RUN_WATCH_S = 300.0  # a run of these tests takes under a minute, the wait for the other groups' torchruns included
STACKS_FILE = "{runs}.stacks-rank{rank}.txt"  # two groups' torchruns can share a folder: named after the runs' file


def meet(i: int, meeting: tuple[Path, int] | None) -> None:
    """Rank 0: wait until `groups` torchruns arrived at run `i` (each leaves a file named after its pid)."""
    if meeting is None or os.environ.get("RANK", "0") != "0":
        return
    folder, groups = meeting
    (folder / f"{i}.{os.getpid()}").touch()
    deadline = time.monotonic() + MEET_TIMEOUT_S
    while len(list(folder.glob(f"{i}.*"))) < groups:
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {i}: fewer than {groups} groups arrived within {MEET_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def own_store(i: int) -> None:
    """Point run `i`'s process group at a store of its own. Every run's gloo rendezvous writes the same keys, so in
    torchrun's one agent store a rank could read its peer's address from the run before and dial a closed port:
    rank 0 picks a free port, tells the others through the agent's store, and hosts the run's store there."""
    import torch.distributed as dist

    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=MEET_TIMEOUT_S))  # while rank 0 waits in `meet`
    if os.environ["RANK"] == "0":
        with socket.socket() as s:
            s.bind((os.environ["MASTER_ADDR"], 0))
            agent.set(f"tests.support.runs/{i}", str(s.getsockname()[1]))
    port = agent.get(f"tests.support.runs/{i}").decode()
    os.environ.update(MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="False")


def main(path: Path, meeting: tuple[Path, int] | None = None) -> int:
    runs = json.loads(path.read_text())
    # a rank stuck in a run or between runs (seen once: a rank that never reached the next run's store) writes every
    # thread's stack to STACKS_FILE beside the runs' file after RUN_WATCH_S; a fixture shows it when the runs fail
    stacks = (path.parent / STACKS_FILE.format(runs=path.stem, rank=os.environ.get("RANK", "0"))).open("w")
    codes = []
    agent_port = os.environ["MASTER_PORT"]
    for i, args in enumerate(runs):
        os.environ["MASTER_PORT"] = agent_port
        faulthandler.dump_traceback_later(RUN_WATCH_S, file=stacks)
        meet(i, meeting)  # the other ranks wait for rank 0 in own_store
        own_store(i)
        try:
            code = run_app(build_app(train_only=True), args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            faulthandler.cancel_dump_traceback_later()
        codes.append(code)
        if os.environ.get("RANK", "0") == "0":
            print(f"RUN {i} EXIT {code}", flush=True)
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    exit_code = main(Path(sys.argv[1]), (Path(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as `diloco.train` leaves: gloo's threads may still hold tensors at finalization
