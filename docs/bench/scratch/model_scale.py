"""Scratch run for issue 15 (docs/benchmarks.md, 2026-11-26 UTC): is the 4-group gap a small-model effect? The
`defaults` study's k = 4 arms, DDP and auto at H = 25, seeds 0-2, on a llama 4x the study's (hidden 256 instead of
128, intermediate 768 instead of 384; same depth, data, steps, lr and schedule), through the bench's own `run_arms`.
Run from the repository root: PYTHONPATH=. python docs/bench/scratch/model_scale.py OUT.jsonl"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from diloco.bench.convergence import baselines, diloco_arm, run_arms, workload
from diloco.bench.models import MODELS, _llama
from diloco.config import auto_outer

SHAPE = dict(hidden=256, intermediate=768, layers=5, heads=8, head_dim=32)


def main() -> None:
    out = Path(sys.argv[1])
    w = workload(False, "defaults")
    folder = out.parent / "work" / "models" / "llama-4m-bytes"
    folder.mkdir(parents=True, exist_ok=True)
    base = MODELS["llama-1m-bytes"]
    more = {key: base[key] for key in ("max_position_embeddings", "vocab_size")}
    (folder / "config.json").write_text(json.dumps(_llama(**SHAPE, **more), indent=2, sort_keys=True) + "\n")
    w = replace(w, model=folder)
    specs = []
    for seed in (0, 1, 2):
        specs.append(baselines(4, w, seed)[1])
        specs.append(diloco_arm(4, w, 25, auto_outer(25, 4, w.warmup_steps, w.steps), seed, auto=True))
    with open(out, "a") as f:
        for r in run_arms(specs, w, Path("diloco/corpus/tinyshakespeare.txt"), 2):
            r.pop("curve", None)
            r["model"] = "llama-4m-bytes (scratch)"
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(r["name"], r["seed"], r.get("outer"), round(r["final_eval_loss"], 4), round(r["wall_s"]), flush=True)


if __name__ == "__main__":
    main()
