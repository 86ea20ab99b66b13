"""The figures of `bin/gpu-check` (``diloco.bench.gpu``) and the profiler's summary (``diloco.profiling``), on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diloco.bench.gpu import (
    flops_per_token,
    peak_tflops,
    run_figures,
    steady_tokens_per_s,
)
from diloco.profiling import build_profiler, busy_seconds
from tests.support.paths import ROOT

MODELS = ROOT / "tests" / "models"


def test_flops_per_token_counts_the_matrix_multiplies_the_head_and_attention() -> None:
    flops, total, matmul = flops_per_token(MODELS / "llama-124m-fresh", 1024)
    # 12 layers of q, k, v, o (768 x 768) and gate, up, down (768 x 2048), and the tied head (50304 x 768)
    layers = 12 * (4 * 768 * 768 + 3 * 768 * 2048)
    assert matmul == layers + 50304 * 768
    assert total == layers + 50304 * 768 + 12 * 2 * 768 + 768  # the tied embedding once, and the RMSNorms
    assert flops == 6 * matmul + 12 * 12 * 768 * 1024


def test_a_lora_run_counts_no_weight_gradients_of_its_base() -> None:
    flops, _, matmul = flops_per_token(MODELS / "llama-7b-fresh", 512, lora=True)
    assert matmul == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 32000 * 4096  # Llama-2-7B's shape, untied head
    assert flops == 4 * matmul + 12 * 32 * 32 * 128 * 512


def test_grouped_query_attention_counts_the_query_heads() -> None:
    flops, _, matmul = flops_per_token(MODELS / "llama-1b-fresh", 2048)
    assert flops - 6 * matmul == 12 * 16 * 32 * 64 * 2048


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.4), ("Tesla T4", None)],
)
def test_the_peak_is_the_cards_dense_bf16_figure(name: str, peak: float | None) -> None:
    found = peak_tflops(name)
    assert (found and found[0]) == peak or (found is None and peak is None)


def test_the_steady_speed_leaves_out_the_first_row() -> None:
    rows = [{"tokens_per_s": 10.0}, {"tokens_per_s": 100.0}, {"loss": 1.0}, {"tokens_per_s": 120.0},
            {"tokens_per_s": 110.0}]  # fmt: skip
    assert steady_tokens_per_s(rows) == 110.0
    assert steady_tokens_per_s([{"tokens_per_s": 5.0}]) is None


def test_busy_time_is_the_union_of_the_kernels() -> None:
    # two overlapping kernels (streams) count once, a gap does not count
    assert busy_seconds([(0, 100), (50, 150), (300, 400), (310, 320)]) == pytest.approx(250e-6)
    assert busy_seconds([]) == 0.0


def test_a_profiled_window_writes_its_summary_and_the_figures_read_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    profiler = build_profiler(2, 2, run_dir, torch.device("cpu"), is_main=True)
    model = torch.nn.Linear(64, 64)
    for step in range(1, 6):
        model(torch.randn(8, 64)).sum().backward()
        profiler.step(step)
    profiler.close()
    report = json.loads((run_dir / "profile.json").read_text())
    assert report["steps"] == [3, 4] and report["wall_s"] > 0
    assert report["device_busy_fraction"] is None  # no accelerator: host ops only
    assert any("addmm" in op["name"] or "linear" in op["name"] for op in report["top_host_self"]), report
    assert "Self CPU" in (run_dir / "profile.txt").read_text()
    assert not (tmp_path / "other").exists()
    assert build_profiler(2, 2, tmp_path / "other", torch.device("cpu"), is_main=False).step(2) is None
    assert not (tmp_path / "other").exists()  # only the group's first rank profiles
    metrics = [{"step": 5, "tokens_per_s": 1e3}, {"step": 10, "tokens_per_s": 2e3}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (run_dir / "summary.json").write_text(json.dumps({"status": "ok", "peak_memory_mb_per_rank": [12.5]}))
    figures = run_figures("r", run_dir, MODELS / "llama-124m-fresh", 1024, peak=100.0)
    flops, _, _ = flops_per_token(MODELS / "llama-124m-fresh", 1024)
    assert figures["tokens_per_s"] == 2e3 and figures["mfu"] == pytest.approx(2e3 * flops / 1e12 / 100.0)
    assert figures["peak_memory_mb"] == 12.5 and figures["profile"]["steps"] == [3, 4]


@pytest.mark.parametrize(
    ("device", "precision", "fused"),
    [("cuda", "bf16-mixed", True), ("cuda", "fp16-mixed", False), ("cpu", "bf16-mixed", False), ("meta", "32-true", True)],
)
def test_the_inner_adamw_is_fused_on_an_accelerator_without_the_gradient_scaler(
    device: str, precision: str, fused: bool
) -> None:
    from diloco import parallel

    assert parallel.fused_adamw(torch.device(device), precision) is fused  # type: ignore[arg-type]
    assert not parallel.fused_adamw(torch.device(device), precision, cpu_offload=True)  # type: ignore[arg-type]
    model = torch.nn.Linear(3, 3)
    optimizer = parallel.build_optimizer(model, "FULL_SHARD", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                         fused=fused)  # fmt: skip
    assert bool(optimizer.defaults.get("fused")) is fused and bool(optimizer.defaults.get("foreach")) is not fused
