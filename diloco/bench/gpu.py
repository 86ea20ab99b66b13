"""The figures `bin/gpu-check` prints: for each run, tokens/s, model FLOPs utilisation (MFU) against the card's
dense bf16 peak, peak memory; for swarm runs, the outer step's device-to-host and host-to-device seconds per round;
for a profiled run, the accelerator's busy share and its top kernels.

MFU counts the model's FLOPs per token as 6 × N + 12 × L × d_attn × T (forward and backward: N the parameters of the
matrix multiplies, the output head included and the embedding lookup not; L layers, d_attn = heads × head dim,
T the sequence length; PaLM's appendix B), so figures compare across cards and projects. Recomputation under
gradient checkpointing is not counted (it is work, not progress). A LoRA run (a spec ending in `:lora`) counts
4 × N: its frozen base computes no weight gradients, and the adapters' own FLOPs (under 1% at rank 16) are left out.

    python -m diloco.bench.gpu --out runs/gpu-check/gpu.json NAME=RUN_DIR:MODEL_DIR:SEQ[:lora] ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from diloco.plot import read_rows

# dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from each card's datasheet: name substring -> (peak, source)
PEAKS = [
    ("H200", 989.4, "NVIDIA H200 datasheet: 1,979 TFLOPS bf16 with sparsity, half of it dense"),
    ("H100 PCIe", 756.0, "NVIDIA H100 datasheet (PCIe): 1,513 TFLOPS bf16 with sparsity, half of it dense"),
    ("H100", 989.4, "NVIDIA H100 datasheet (SXM): 1,979 TFLOPS bf16 with sparsity, half of it dense"),
    ("A100", 312.0, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense"),
]


def peak_tflops(device_name: str) -> tuple[float, str] | None:
    """The card's dense bf16 peak and where the figure comes from; None for a card not in `PEAKS`."""
    for part, tflops, source in PEAKS:
        if part in device_name:
            return tflops, source
    return None


def flops_per_token(model_dir: Path, seq_length: int, lora: bool = False) -> tuple[float, int, int]:
    """(FLOPs per trained token, all parameters, matrix-multiply parameters) of the model in `model_dir`, built
    on the meta device (no memory); with `lora`, of training adapters on it (no weight gradients of the base)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_length
    return (4 if lora else 6) * matmul + attention, total, matmul


def rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics rows (none when it wrote none: a run that failed to start)."""
    path = run_dir / "metrics.jsonl"
    return read_rows(path) if path.exists() else []


def steady_tokens_per_s(metrics: list[dict[str, Any]]) -> float | None:
    """Median tokens/s of the logged rows after the first (which holds compilation and warm-up)."""
    speeds = [r["tokens_per_s"] for r in metrics if "tokens_per_s" in r][1:]
    return statistics.median(speeds) if speeds else None


def run_figures(name: str, run_dir: Path, model_dir: Path, seq: int, peak: float | None,
                lora: bool = False) -> dict[str, Any]:  # fmt: skip
    metrics = rows(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "no summary"}
    flops, total, matmul = flops_per_token(model_dir, seq, lora)
    speed = steady_tokens_per_s(metrics)
    out: dict[str, Any] = {
        "run": name, "status": summary.get("status"), "parameters": total, "matmul_parameters": matmul,
        "seq_length": seq, "lora": lora, "flops_per_token": flops, "tokens_per_s": speed,
        "tflops": None if speed is None else speed * flops / 1e12,
        "peak_memory_mb": max(summary.get("peak_memory_mb_per_rank") or [0]) or None,
        "peak_reserved_mb": max(summary.get("peak_reserved_mb_per_rank") or [0]) or None,
        "final_loss": summary.get("final_loss"),
    }  # fmt: skip
    out["mfu"] = None if out["tflops"] is None or peak is None else out["tflops"] / peak
    outer = [r for r in metrics if "pseudo_gradient_s" in r]
    if outer:  # one row per round: the device-to-host gather, and the step with the copy back
        out["rounds"] = len(outer)
        out["params_sha256"] = summary.get("params_sha256")
        for key in ("pseudo_gradient_s", "outer_apply_s", "averaging_s"):
            values = [r[key] for r in outer if key in r]
            out[f"{key}_median"] = round(statistics.median(values), 4) if values else None
    profile = run_dir / "profile.json"
    if profile.exists():
        report = json.loads(profile.read_text())
        out["profile"] = {key: report[key] for key in ("steps", "wall_s", "device_busy_fraction")}
        out["profile"]["top_device"] = report["top_device"][:8]
    return out


def table(figures: list[dict[str, Any]]) -> str:
    lines = ["| run | params | seq | tokens/s | TFLOP/s | MFU | peak GPU memory (MB) | status |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for f in figures:
        speed = "n/a" if f["tokens_per_s"] is None else f"{f['tokens_per_s']:.3g}"
        tflops = "n/a" if f["tflops"] is None else f"{f['tflops']:.0f}"
        mfu = "n/a" if f["mfu"] is None else f"{f['mfu']:.1%}"
        memory = "n/a" if f["peak_memory_mb"] is None else f"{f['peak_memory_mb']:.0f}"
        lines.append(f"| {f['run']} | {f['parameters'] / 1e6:.0f}M | {f['seq_length']} | {speed} | {tflops} | "
                     f"{mfu} | {memory} | {f['status']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=RUN_DIR:MODEL_DIR:SEQ[:lora]")
    parser.add_argument("--out", type=Path, required=True, help="JSON with every figure")
    args = parser.parse_args(argv)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    found = peak_tflops(device)
    peak = None if found is None else found[0]
    figures = []
    for spec in args.runs:
        name, _, rest = spec.partition("=")
        run_dir, model_dir, seq, *kind = rest.split(":")
        figures.append(run_figures(name, Path(run_dir), Path(model_dir), int(seq), peak, kind == ["lora"]))
    report = {"device": device, "peak_tflops": peak, "peak_source": None if found is None else found[1],
              "runs": figures}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"device: {device}; dense bf16 peak: {peak} TFLOP/s ({report['peak_source']})")
    print(table(figures))
    for f in figures:
        if "rounds" in f:
            print(f"{f['run']}: {f['rounds']} rounds, median seconds: device->host {f['pseudo_gradient_s_median']}, "
                  f"outer step + host->device {f['outer_apply_s_median']}, averaging {f['averaging_s_median']}; "
                  f"params_sha256 {f['params_sha256']}")  # fmt: skip
        if "profile" in f:
            p = f["profile"]
            print(f"{f['run']} profile, steps {p['steps']}: accelerator busy {p['device_busy_fraction']} of "
                  f"{p['wall_s']:.2f} s; top kernels: " + "; ".join(
                      f"{k['name'][:60]} {k['s']:.3f} s" for k in p["top_device"][:5]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
