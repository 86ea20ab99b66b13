"""Scratch run for issue 15 (docs/benchmarks.md, 2026-11-26 06:25 UTC): the `defaults` study's k = 8 arms, DDP and
auto at H = 25, on seeds 1 and 2 (the study runs k = 8 on seed 0 alone), through the bench's own `run_arms`.
Run from the repository root: PYTHONPATH=. python docs/bench/scratch/k8_seeds.py OUT.jsonl"""

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
    specs = []
    for seed in (1, 2):
        specs.append(baselines(8, w, seed)[1])
        specs.append(diloco_arm(8, w, 25, auto_outer(25, 8, w.warmup_steps, w.steps), seed, auto=True))
    with open(out, "a") as f:
        for r in run_arms(specs, w, Path("diloco/corpus/tinyshakespeare.txt"), 2):
            r.pop("curve", None)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(r["name"], r["seed"], r.get("outer"), round(r["final_eval_loss"], 4), flush=True)


if __name__ == "__main__":
    main()
