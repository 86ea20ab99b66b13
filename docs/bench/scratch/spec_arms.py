"""Scratch runs for issue 15 (docs/benchmarks.md, 2026-11-26/27 UTC): arms of the `defaults` workload named by
their fields, so that a trial can change any of them (the inner warm-up, the inner lr, S) for DDP and DiLoCo alike.
Each arm is a JSON object: {"k": 4, "seed": 0} alone is DDP at k·B; with "outer": [lr, momentum, warm-up] it is
DiLoCo at H = "h" (default 25) with "inner_moment" (default "galaxy"); "steps", "lr" and "warmup_steps" override the
workload's S, inner lr and inner warm-up for either. The eval curve is kept (loss after every outer step).
Run from the repository root: PYTHONPATH=. python docs/bench/scratch/spec_arms.py OUT.jsonl ARMS_JSON"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from diloco.bench.convergence import baselines, diloco_arm, run_arms, workload
from diloco.bench.models import model_folder


def spec(arm: dict, w):  # noqa: ANN001, ANN201 - scratch
    k, seed = arm["k"], arm["seed"]
    if "outer" in arm:
        s = replace(diloco_arm(k, w, arm.get("h", 25), tuple(arm["outer"]), seed),
                    inner_moment=arm.get("inner_moment", "galaxy"))
    else:
        s = baselines(k, w, seed)[1]
    fields = {f: arm[f] for f in ("steps", "lr", "warmup_steps") if f in arm}
    return replace(s, **fields, trial=json.dumps(arm))


def main() -> None:
    out = Path(sys.argv[1])
    w = workload(False, "defaults")
    w = replace(w, model=model_folder(w.model, out.parent / "work" / "models"))
    specs = [spec(a, w) for a in json.loads(sys.argv[2])]
    with open(out, "a") as f:
        for r in run_arms(specs, w, Path("diloco/corpus/tinyshakespeare.txt"), 2):
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(r["trial"], round(r["final_eval_loss"], 4), r["groups_identical"], round(r["wall_s"]), flush=True)


if __name__ == "__main__":
    main()
