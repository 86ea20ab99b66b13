"""Scratch run (docs/benchmarks.md, bench scale's section, 2026-11-29 UTC): a LoRA run's base of Llama-2-7B's shape
(`tests/models/llama-7b-fresh`, config only) drawn fresh and quantized to 4 bits a tensor at a time on the CPU, as
`--load-in-4bit` builds it (`diloco.quantized.load_quantized`): this process's peak RSS against the float32 model.
Run from the repository root: PYTHONPATH=. python docs/bench/scratch/quantized_load.py"""

import resource
import time

import torch

from diloco.quantized import load_quantized, parameter_count

started = time.monotonic()
model = load_quantized("tests/models/llama-7b-fresh", 42, None, 4, torch.bfloat16, torch.device("cpu"))
seconds = time.monotonic() - started
count = parameter_count(model)
held = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"parameters {count / 1e9:.3f}B; float32 {count * 4 / 2**30:.1f} GiB; held {held / 2**30:.2f} GiB; "
      f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB; {seconds:.0f} s; "
      f"torch threads {torch.get_num_threads()}")  # fmt: skip
