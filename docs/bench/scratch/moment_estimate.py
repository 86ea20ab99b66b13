"""Scratch run for issue 40 (docs/outer-step.md, the galaxy's second moment; 2026-11-29 03:33-03:51 UTC, load 0.02 at
the start): the galaxy moment's variance estimate from two halves of each step (two passes of half the batch) against
one from successive steps' gradients (one pass), on the `defaults` study's workload at H = 25 through the bench's own
`run_arms`: auto at k = 4 (seeds 0-2) and k = 8 (seed 0) with each estimate (successive: not compared across an
outer step; successive-keep: compared across it too), and auto with plain AdamW (the group's moment). Stopped after
8 of its 15 arms (moment-estimate.jsonl), once the successive estimate had lost at k = 8 and at k = 4 seed 0; the
successive estimate (`GalaxyAdamW(successive=True)`, the arms' `variance`) was then removed: this runs only from
commit f571135.
Run from the repository root: PYTHONPATH=. python docs/bench/scratch/moment_estimate.py OUT.jsonl"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from diloco.bench.convergence import auto_arm, run_arms, workload
from diloco.bench.models import model_folder


def main() -> None:
    out = Path(sys.argv[1])
    w = workload(False, "defaults")
    w = replace(w, model=model_folder(w.model, out.parent / "work" / "models"))
    specs = []
    for k, seed in [(4, 0), (4, 1), (4, 2), (8, 0)]:
        arm = auto_arm(k, w, 25, seed)
        assert arm.inner_moment == "galaxy", arm
        specs += [replace(arm, name=f"{arm.name}+{v}", variance=v) for v in ("halves", "successive", "successive-keep")]
        if k == 4:
            specs.append(replace(arm, name=f"{arm.name}+group-moment", inner_moment="group"))
    with open(out, "a") as f:
        for r in run_arms(specs, w, Path("diloco/corpus/tinyshakespeare.txt"), 2):
            r.pop("curve", None)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(r["name"], r["k"], r["seed"], r["inner_moment"], r["variance"], round(r["final_eval_loss"], 4),
                  r["groups_identical"], round(r["wall_s"]), flush=True)


if __name__ == "__main__":
    main()
