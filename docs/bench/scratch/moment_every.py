"""Scratch run for issue 40 (docs/outer-step.md, the galaxy's second moment): the variance estimate taken every
m-th step instead of every step (`diloco.galaxy_moment.ESTIMATE_EVERY`), which saves the second pass of a split
micro-batch on the other steps, on the `defaults` study's workload at H = 25 through the bench's own `run_arms`:
auto at k = 4 (its galaxy moment) for the given seeds, labelled with the tree's ESTIMATE_EVERY; `group` runs auto
with plain AdamW instead. Ran 2026-11-30 21:46-22:11 UTC (moment-every.jsonl) in worktrees of commit 5d5ea12 with
ESTIMATE_EVERY set to 1, 2 and 4; the estimate every m-th step lost and was then removed, so this runs only there:
PYTHONPATH=. python docs/bench/scratch/moment_every.py OUT.jsonl SEEDS [group]   (SEEDS: 0,1,2)"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from diloco import galaxy_moment
from diloco.bench.convergence import auto_arm, run_arms, workload
from diloco.bench.models import model_folder


def main() -> None:
    out, seeds = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")]
    w = workload(False, "defaults")
    w = replace(w, model=model_folder(w.model, out.parent / "work" / "models"))
    every = galaxy_moment.ESTIMATE_EVERY
    specs = []
    for seed in seeds:
        arm = auto_arm(4, w, 25, seed)
        assert arm.inner_moment == "galaxy", arm
        if "group" in sys.argv[3:]:
            specs.append(replace(arm, name=f"{arm.name}+group-moment", inner_moment="group"))
        else:
            specs.append(replace(arm, name=f"{arm.name}+every{every}"))
    with open(out, "a") as f:
        for r in run_arms(specs, w, Path("diloco/corpus/tinyshakespeare.txt"), 2):
            r.pop("curve", None)
            r["estimate_every"] = every
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(r["name"], r["k"], r["seed"], r["inner_moment"], every, round(r["final_eval_loss"], 4),
                  round(r["wall_s"]), flush=True)


if __name__ == "__main__":
    main()
