"""Scratch run for issue 15 (docs/benchmarks.md, 2026-11-26 UTC): does the 4-group gap with auto (galaxy moment)
still grow with the run's length, and does the seed noise shrink? The `defaults` workload with S inner steps per
group; each arm [k, H, outer lr (0: DDP at k·B), momentum, outer-lr warm-up, seed, inner moment, S, and optionally the inner lr (else the workload's)].
Run from the repository root: PYTHONPATH=. python docs/bench/scratch/run_length.py OUT.jsonl ARMS_JSON"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from diloco.bench.convergence import baselines, diloco_arm, run_arms, workload
from diloco.bench.models import model_folder


def main() -> None:
    out = Path(sys.argv[1])
    w = workload(False, "defaults")
    w = replace(w, model=model_folder(w.model, out.parent / "work" / "models"))
    specs = []
    for k, h, lr, momentum, warmup, seed, moment, steps, *inner_lr in json.loads(sys.argv[2]):
        if not lr:
            specs.append(replace(baselines(k, w, seed)[1], steps=steps, lr=(inner_lr or [None])[0]))
            continue
        arm = diloco_arm(k, w, h, (lr, momentum, warmup), seed)
        specs.append(replace(arm, inner_moment=moment, steps=steps, lr=(inner_lr or [None])[0]))
    with open(out, "a") as f:
        for r in run_arms(specs, w, Path("diloco/corpus/tinyshakespeare.txt"), 2):
            r.pop("curve", None)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(r["name"], r["k"], r["seed"], r["steps"], r["lr"], r.get("outer"), r.get("outer_warmup"), r["inner_moment"],
                  round(r["final_eval_loss"], 4), r["groups_identical"], round(r["wall_s"]), flush=True)


if __name__ == "__main__":
    main()
