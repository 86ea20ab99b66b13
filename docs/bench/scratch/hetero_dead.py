"""Scratch run (docs/benchmarks.md, bench hetero's section, 2026-11-27 UTC): `diloco bench hetero`'s dead-group arm
alone, full setup, to measure the status heartbeat (a group counted by the rule the wait for arrivals uses) without
the whole bench's solo runs and arms. Same code path as the bench: `hetero.dead_arm`.
Run from the repository root, as root (cgroup quotas): PYTHONPATH=. python docs/bench/scratch/hetero_dead.py WORK_DIR"""

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from diloco.bench import hetero
from diloco.bench.hetero_dead import dead_lines


def main() -> None:
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    setup = hetero.hetero_setup(False)
    model = hetero.write_model(hetero.MODEL, work / "models")
    started = time.time()
    with ExitStack() as stack:
        peers, dht = hetero.start_dht(stack, work)
        dead, commands = hetero.dead_arm(setup, model, work, peers, dht)
    load = Path("/proc/loadavg").read_text().split()[0]
    result = {"dead": dead, "commands": commands, "wall_s": time.time() - started, "load_avg_1m_end": float(load)}
    (work / "dead.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(dead_lines(dead, dead["flags"])))


if __name__ == "__main__":
    main()
