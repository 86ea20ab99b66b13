"""Scratch run (docs/benchmarks.md, bench hetero's section): one of `diloco bench hetero`'s equal-trio arms alone,
full setup, without the whole bench's solo runs and arms. Same code path as the bench: `hetero.dead_arm` (a group
killed mid-run) or `hetero.pause_arm` (a group away on evaluations).
Run from the repository root, as root (cgroup quotas):
PYTHONPATH=. python docs/bench/scratch/hetero_arm.py dead|pause WORK_DIR"""

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from diloco.bench import hetero
from diloco.bench.hetero_dead import dead_lines
from diloco.bench.hetero_pause import pause_lines

ARMS = {"dead": (hetero.dead_arm, dead_lines), "pause": (hetero.pause_arm, pause_lines)}


def main() -> None:
    name, work = sys.argv[1], Path(sys.argv[2])
    run_arm, lines = ARMS[name]
    work.mkdir(parents=True, exist_ok=True)
    setup = hetero.hetero_setup(False)
    model = hetero.write_model(hetero.MODEL, work / "models")
    started = time.time()
    with ExitStack() as stack:
        peers, dht = hetero.start_dht(stack, work)
        figures, commands = run_arm(setup, model, work, peers, dht)
    load = Path("/proc/loadavg").read_text().split()[0]
    result = {name: figures, "commands": commands, "wall_s": time.time() - started, "load_avg_1m_end": float(load)}
    (work / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines(figures, " ".join(figures["flags"]))))


if __name__ == "__main__":
    main()
