"""Scratch run for issue 15 (docs/benchmarks.md, 2026-11-26 UTC): the inner AdamW with the galaxy's second moment
(`--hv.inner-moment galaxy`, diloco/galaxy_moment.py) on the `defaults` study's workload at H = 25, through the
bench's own `run_arms`: auto (which now takes it for 4 groups or more) at k = 4 and 8 and, at k = 2 (where auto keeps
plain AdamW), auto's outer setting with it; seeds 0-2. DDP of each k and seed: the committed runs (convergence.json,
k8-seeds.jsonl), which the bench reproduces to 4 digits.
With STUDY `map`: the map's workload where auto takes it (k = 4 and 8 at H = 10 and 25; the map's DDP of each k and
seed from convergence-map.json). With STUDY `k3`: the defaults' workload at k = 3 (DDP, auto with AdamW, auto with it); `seeds`: k = 4 on seeds 3
and 4 (the same three arms).
Run from the repository root: PYTHONPATH=. python docs/bench/scratch/galaxy_moment.py OUT.jsonl [STUDY]"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from diloco.bench.convergence import baselines, diloco_arm, run_arms, workload
from diloco.bench.models import model_folder
from diloco.config import auto_outer


def main() -> None:
    out = Path(sys.argv[1])
    study = sys.argv[2] if len(sys.argv) > 2 else "defaults"
    w = workload(False, "defaults" if study in ("k3", "seeds") else study)
    w = replace(w, model=model_folder(w.model, out.parent / "work" / "models"))
    specs = []
    cells = [(k, 25, seed) for k in (2, 4, 8) for seed in (0, 1, 2)]
    if study == "map":  # where auto now takes the galaxy moment: k = 4 (seeds 0, 1) and 8 (seed 0), H = 10 and 25
        cells = [(4, h, seed) for h in (10, 25) for seed in (0, 1)] + [(8, h, 0) for h in (10, 25)]
    if study == "k3":  # 3 groups, where auto kept AdamW when this ran: DDP, auto with AdamW, and with the moment
        cells = [(3, 25, seed) for seed in (0, 1, 2)]
        specs = [baselines(3, w, seed)[1] for seed in (0, 1, 2)]
        specs += [replace(diloco_arm(3, w, 25, auto_outer(25, 3, w.warmup_steps, w.steps), s, auto=True),
                          inner_moment="group") for s in (0, 1, 2)]  # fmt: skip
    if study == "seeds":  # 4 groups on two more seeds: DDP, auto with AdamW, and auto (the galaxy moment)
        cells = [(4, 25, seed) for seed in (3, 4)]
        specs = [baselines(4, w, seed)[1] for seed in (3, 4)]
        specs += [replace(diloco_arm(4, w, 25, auto_outer(25, 4, w.warmup_steps, w.steps), s, auto=True),
                          inner_moment="group") for s in (3, 4)]  # fmt: skip
    for k, h, seed in cells:
        arm = diloco_arm(k, w, h, auto_outer(h, k, w.warmup_steps, w.steps), seed, auto=True)
        specs.append(replace(arm, name=f"{arm.name}+galaxy-moment", inner_moment="galaxy"))
    with open(out, "a") as f:
        for r in run_arms(specs, w, Path("diloco/corpus/tinyshakespeare.txt"), 2):
            r.pop("curve", None)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(r["name"], r["k"], r["seed"], r.get("outer"), r["inner_moment"], round(r["final_eval_loss"], 4),
                  r["groups_identical"], round(r["wall_s"]), flush=True)


if __name__ == "__main__":
    main()
