"""One rank of `test_galaxy_moment.py`'s strategy check: 3 inner steps of `trainer.inner_step` on a small llama under
each sharding strategy with the galaxy's second moment (k = 2, two micro-batches per rank, no clipping), plain AdamW
and k = 1; rank 0 writes each model's largest difference to DDP's, k = 1's to AdamW's, and that of a FULL_SHARD run
resumed from a checkpoint (DCP: the optimizer's variance average too) before its last step to the uninterrupted one.

Usage: torchrun --nproc_per_node 2 tests/support/galaxy_moment_worker.py OUT.json CORPUS"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from diloco import checkpoint, parallel
from diloco.distenv import DistEnv
from diloco.galaxy_moment import Halves
from diloco.model import decoder_layers, load_model
from diloco.train import trainer

MODEL = Path(__file__).resolve().parents[1] / "models" / "llama-0.1m-bytes"
STEPS, ACCUM, BATCH, SEQ = 3, 2, 2, 32


class Batches:
    """Fixed random token batches, different per rank and micro-batch, the same in every run."""

    def __init__(self, rank: int) -> None:
        self.generator = torch.Generator().manual_seed(1000 + rank)

    def next_batch(self) -> torch.Tensor:
        return torch.randint(0, 256, (BATCH, SEQ), generator=self.generator)


def run(env: DistEnv, strategy: str, galaxy_batches: float | None, save: Path | None = None,
        resume: Path | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The full parameters after STEPS inner steps (every rank gets them). `save`: a checkpoint after step
    STEPS - 1; `resume`: start from that checkpoint and take the last step only."""
    device = torch.device("cpu")
    model = load_model(MODEL, 0)
    model = parallel.parallelize(model, decoder_layers(model), strategy, env, device, "32-true", False)  # type: ignore[arg-type]
    optimizer = parallel.build_optimizer(model, strategy, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,  # type: ignore[arg-type]
                                         galaxy_batches=galaxy_batches)  # fmt: skip
    state = SimpleNamespace(
        model=model, optimizer=optimizer, grad_accum=ACCUM, device=device, data=SimpleNamespace(train=Batches(env.rank)),
        halves=None if galaxy_batches is None else Halves(model.parameters()),
        scaler=ShardedGradScaler(device="cpu", enabled=False), scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        config=SimpleNamespace(max_grad_norm=0.0),
    )  # fmt: skip
    sharded = checkpoint.ModelAndOptimizer(model, optimizer)
    first = 0
    if resume is not None:
        checkpoint.load(resume, sharded, env.rank)
        first = STEPS - 1
        for _ in range(first * ACCUM):  # the data of the steps taken before the checkpoint
            state.data.train.next_batch()
    for step in range(first, STEPS):
        trainer.inner_step(state)  # type: ignore[arg-type]
        if save is not None and step == STEPS - 2:
            checkpoint.save(save, step + 1, sharded, {}, env.rank, env.world_size)
    full = {}
    for name, p in parallel.unwrap(model).named_parameters():
        full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
    return full


def main() -> None:
    out = Path(sys.argv[1])
    env = DistEnv.from_environ()
    torch.set_num_threads(1)
    parallel.init_process_group(env, torch.device("cpu"))
    ckpt = out.parent / "ckpt"
    models = {s: run(env, s, 2.0, save=ckpt if s == "FULL_SHARD" else None) for s in ("FULL_SHARD", "NO_SHARD", "DDP")}
    resumed = run(env, "FULL_SHARD", 2.0, resume=ckpt / f"step-{STEPS - 1}")
    resume_diff = max(float((resumed[n] - models["FULL_SHARD"][n]).abs().max()) for n in resumed)
    models["adamw"] = run(env, "DDP", None)
    models["adamw_k1"] = run(env, "DDP", 1.0)  # k = 1, with halves: AdamW's steps, but for float rounding
    ddp = models["DDP"]
    diffs = {name: max(float((m[n] - ddp[n]).abs().max()) for n in ddp) for name, m in models.items()}
    k1 = max(float((models["adamw"][n] - models["adamw_k1"][n]).abs().max()) for n in ddp)
    if env.rank == 0:
        out.write_text(json.dumps({"max_diff_to_ddp": diffs, "adamw_k1_to_adamw": k1, "resumed_diff": resume_diff}))
    torch.distributed.barrier()  # no rank tears the group down while the other still reads from it
    parallel.destroy_process_group()


if __name__ == "__main__":
    main()
