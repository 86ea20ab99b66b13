"""Scratch measurement for issue 40 (docs/outer-step.md, the galaxy's second moment): the CPU of an inner step with
the galaxy moment's two halves against plain AdamW, both in one process, steps alternating (so the host's drift
falls on both alike): a 1-rank group's FSDP2 model over gloo, one torch thread, as `train.inner_step` takes them.
Ran 2026-12-01 00:27-00:29 UTC (load 0.9):
PYTHONPATH=. python docs/bench/scratch/moment_ab.py MODEL BATCH SEQ MICRO_BATCHES STEPS  (llama-1m-bytes 8 128 1 60)"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from diloco.bench.models import MODELS
from diloco.galaxy_moment import GalaxyAdamW, Halves, clip_factor

torch.set_num_threads(1)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29534"), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
name = sys.argv[1]
batch_size, seq = int(sys.argv[2]), int(sys.argv[3])
accum = int(sys.argv[4])
n = int(sys.argv[5])
mesh = init_device_mesh("cpu", (1,))


def build(mode):
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in MODELS[name].items() if k not in ("architectures", "transformers_version")})
    model = LlamaForCausalLM(cfg)
    for l in model.model.layers:
        fully_shard(l, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    params = [p for p in model.parameters() if p.requires_grad]
    if mode == "galaxy":
        opt = GalaxyAdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, galaxy_batches=3)
        halves = Halves(params)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        halves = None
    return model, opt, halves


g = torch.Generator().manual_seed(1)


def step(model, opt, halves):
    batch = torch.randint(0, 256, (batch_size, seq), generator=g)
    pieces = list(batch.chunk(accum))
    first = 0
    share = 0
    if halves:
        pieces, first, share = halves.split(pieces)
    for i, piece in enumerate(pieces):
        model.set_requires_gradient_sync(i == len(pieces) - 1 or (halves is not None and i == first - 1))
        loss = model(input_ids=piece, labels=piece, use_cache=False).loss
        (loss * (len(piece) / batch_size)).backward()
        if halves and i == first - 1:
            halves.snapshot()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if halves:
        halves.observe(opt, share, 1.0, clip_factor(norm, 1.0))
    opt.step()
    opt.zero_grad(set_to_none=True)


runs = {m: build(m) for m in ("group", "galaxy")}
for _ in range(3):
    for m in runs:
        step(*runs[m])
ts = {m: [] for m in runs}
for _ in range(n):
    for m in runs:
        t = time.process_time()
        step(*runs[m])
        ts[m].append(time.process_time() - t)
ratios = [a / b for a, b in zip(ts["galaxy"], ts["group"])]
print(
    json.dumps(
        {
            "model": name,
            "batch": batch_size,
            "seq": seq,
            "micro_batches": accum,
            "group_ms": round(1000 * statistics.median(ts["group"]), 1),
            "galaxy_ms": round(1000 * statistics.median(ts["galaxy"]), 1),
            "ratio_of_medians": round(statistics.median(ts["galaxy"]) / statistics.median(ts["group"]), 3),
            "ratio_of_sums": round(sum(ts["galaxy"]) / sum(ts["group"]), 3),
            "median_pair_ratio": round(statistics.median(ratios), 3),
        }
    )
)
dist.destroy_process_group()
