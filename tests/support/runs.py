"""Several training runs, one after another, in the same torchrun ranks:
``torchrun ... -m tests.support.runs RUNS.json``, where the file holds a list of argument lists for ``diloco.train``.

Each run goes through the real command line (parsing, validation, process group, FSDP, checkpoints, summary) as
``python -m diloco.train`` would; only the processes are shared, which spares a torch import (about 6 CPU-seconds)
and a torchrun per run when a test compares the arithmetic of many strategies. Prints ``RUN <i> EXIT <code>`` per
run on rank 0 and exits 0 only if every run did.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from diloco.cli.app import build_app, run_app


def own_store(i: int) -> None:
    """Point run `i`'s process group at a store of its own. Every run's gloo rendezvous writes the same keys, so in
    torchrun's one agent store a rank could read its peer's address from the run before and dial a closed port:
    rank 0 picks a free port, tells the others through the agent's store, and hosts the run's store there."""
    import torch.distributed as dist

    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    if os.environ["RANK"] == "0":
        with socket.socket() as s:
            s.bind((os.environ["MASTER_ADDR"], 0))
            agent.set(f"tests.support.runs/{i}", str(s.getsockname()[1]))
    port = agent.get(f"tests.support.runs/{i}").decode()
    os.environ.update(MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="False")


def main(path: Path) -> int:
    runs = json.loads(path.read_text())
    codes = []
    agent_port = os.environ["MASTER_PORT"]
    for i, args in enumerate(runs):
        os.environ["MASTER_PORT"] = agent_port
        own_store(i)
        try:
            code = run_app(build_app(train_only=True), args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        codes.append(code)
        if os.environ.get("RANK", "0") == "0":
            print(f"RUN {i} EXIT {code}", flush=True)
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    exit_code = main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as `diloco.train` leaves: gloo's threads may still hold tensors at finalization
