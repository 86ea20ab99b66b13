"""Scratch run for issue 15 (docs/benchmarks.md, 2026-11-26 06:19 UTC): the `defaults` study's trial "auto, inner
batch B/2 for 2·S steps" and its fair DDP (batch k·B/2 for 2·S steps) at k = 4, H = 25, on seeds 0, 1 and 2, through
the bench's own `run_arms`. Run from the repository root: PYTHONPATH=. python docs/bench/scratch/half_batch.py OUT.jsonl"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from diloco.bench.convergence import baselines, diloco_arm, run_arms, workload
from diloco.bench.models import model_folder
from diloco.config import auto_outer


def main() -> None:
    out = Path(sys.argv[1])
    w = workload(False, "defaults")
    w = replace(w, model=model_folder(w.model, out.parent / "work" / "models"))
    k, h = 4, 25
    specs = []
    for seed in (0, 1, 2):
        auto = auto_outer(h, k, w.warmup_steps, 2 * w.steps)
        specs.append(replace(diloco_arm(k, w, h, auto, seed, auto=True), batch=w.batch // 2, steps=2 * w.steps))
        specs.append(replace(baselines(k, w, seed)[1], batch=k * w.batch // 2, steps=2 * w.steps))
    with open(out, "a") as f:
        for r in run_arms(specs, w, Path("diloco/corpus/tinyshakespeare.txt"), 2):
            r.pop("curve", None)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(r["name"], r["seed"], r["batch"], r["steps"], r.get("outer"), round(r["final_eval_loss"], 4), flush=True)


if __name__ == "__main__":
    main()
