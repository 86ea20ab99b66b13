"""Scratch run for issue 40 (docs/outer-step.md, the galaxy's second moment): what the galaxy moment's gain is
worth in compute. Plain AdamW (auto with `--hv.inner-moment group`) on the `defaults` study's workload at k = 4,
H = 25, given more inner steps than the 200 the galaxy moment had (each run's `auto` outer setting for its own
length, as the trainer would pick it), against the galaxy moment at 200 steps (moment-every.jsonl, every1). Ran
2026-12-01 00:12-00:23 UTC (moment-compute.jsonl) at commit d8946e9:
PYTHONPATH=. python docs/bench/scratch/moment_compute.py OUT.jsonl SEEDS STEPS   (SEEDS: 0,1,2; STEPS: 225,250)"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from diloco.bench.convergence import auto_arm, run_arms, workload
from diloco.bench.models import model_folder


def main() -> None:
    out = Path(sys.argv[1])
    seeds, lengths = ([int(s) for s in arg.split(",")] for arg in sys.argv[2:4])
    w = workload(False, "defaults")
    w = replace(w, model=model_folder(w.model, out.parent / "work" / "models"))
    specs = []
    for steps in lengths:
        for seed in seeds:
            arm = auto_arm(4, replace(w, steps=steps), 25, seed)
            assert arm.steps == steps, arm
            specs.append(replace(arm, name=f"{arm.name}+group-moment-{steps}", inner_moment="group"))
    with open(out, "a") as f:
        for r in run_arms(specs, w, Path("diloco/corpus/tinyshakespeare.txt"), 2):
            r.pop("curve", None)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(r["name"], r["seed"], r["steps"], r["outer"], r["outer_warmup"], round(r["final_eval_loss"], 4),
                  round(r["wall_s"]), flush=True)


if __name__ == "__main__":
    main()
