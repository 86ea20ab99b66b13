"""Scratch run (docs/outer-step.md, "Groups of different speeds"): `diloco bench hetero`'s equal trio (three 1-rank
groups at 0.4 of a core each) under arms of its flags, over several seeds, for the final eval loss of the token pace
against fixed H. Same code path as the bench (`hetero.trio_launches`, `hetero.run_phase`); each group gets `--seed S`.
Arms: the bench's (`hetero.ARM_FLAGS`), or `NAME=FLAGS` for flags of one's own (e.g. `tokens-group=--hv.pace tokens
--hv.inner-moment group`). Run from the repository root, as root (cgroup quotas):
PYTHONPATH=. python docs/bench/scratch/equal_pace.py WORK_DIR OUT.jsonl SEEDS [--trio unequal] ARM [ARM ...]
e.g. ... /tmp/ep equal-pace.jsonl 0,1,2 fixed tokens"""

import json
import shlex
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from diloco.bench import hetero


def arm_of(spec: str) -> tuple[str, list[str]]:
    name, _, flags = spec.partition("=")
    return name, (shlex.split(flags) if flags else hetero.ARM_FLAGS[name])


def main() -> None:
    work, out, seeds = Path(sys.argv[1]), Path(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")]
    trio, specs = ("equal", sys.argv[4:]) if sys.argv[4] != "--trio" else (sys.argv[5], sys.argv[6:])
    arms = [arm_of(spec) for spec in specs]
    work.mkdir(parents=True, exist_ok=True)
    setup = hetero.hetero_setup(False)
    model = hetero.write_model(hetero.MODEL, work / "models")
    with ExitStack() as stack:
        peers, dht = hetero.start_dht(stack, work)
        for seed in seeds:
            for name, flags in arms:
                hetero.ARM_FLAGS[name] = flags  # `arm_flags` reads the arm's flags from there
                run = f"{name}-s{seed}-{int(time.time())}"
                extra = {i: ["--seed", str(seed)] for i in range(len(hetero.CORES))}
                launches = hetero.trio_launches(setup, model, work, peers, trio, name, run, extra)
                load = float(Path("/proc/loadavg").read_text().split()[0])
                started = time.time()
                hetero.run_phase(launches, work, setup.timeout_s, dht)
                groups = [hetero.group_figures(x.run_dir, setup) for x in launches]
                lrs = [[row["lr"] for row in hetero.read_rows(x.run_dir) if "lr" in row] for x in launches]
                record = {
                    "trio": trio, "arm": name, "flags": flags, "seed": seed, "load_start": load,
                    "wall_s": time.time() - started,
                    "final_eval_loss": groups[0]["final_eval_loss"],
                    "same_model": len({g["params_sha256"] for g in groups}) == 1,
                    "inner_steps": [g["inner_steps"] for g in groups],
                    "steps_per_round": [g["steps_per_round"] for g in groups],
                    "weights": [g["weights"] for g in groups], "lrs": lrs,
                    "command": shlex.join(launches[0].command),
                }  # fmt: skip
                with out.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                print(f"{trio} {name} seed {seed}: eval loss {record['final_eval_loss']:.4f}, steps "
                      f"{record['inner_steps']}, per round {record['steps_per_round'][0]}, "
                      f"{record['wall_s']:.0f} s, load {load}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
