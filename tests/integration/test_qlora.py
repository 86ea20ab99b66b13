"""LoRA on a quantized base (`--load-in-4bit`, `--load-in-8bit`: bitsandbytes, on the CPU here): the base is the one
transformers' own 4-bit and 8-bit loading gives, built a tensor at a time from a checkpoint or a fresh draw; groups
of any shape average the adapters alone bit-identically; a resume is exact; the export reloads onto transformers'
quantized base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from diloco.model import load_model, params_sha256
from diloco.quantized import load_quantized, parameter_count, quantizable
from tests.support.architectures import VOCAB, write_config
from tests.support.groups import finish, group_args, outer_rows, start_group
from tests.support.paths import TINY_MODEL
from tests.support.procs import FAST, run_and_resume, summary
from tests.support.swarm import diloco_dht

R = 2
CPU = torch.device("cpu")


def transformers_quantized(folder: Path, bits: int) -> torch.nn.Module:
    """`folder` as transformers loads it in `bits` bits (QLoRA's NF4 with double quantization; LLM.int8())."""
    settings = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)
                if bits == 4 else BitsAndBytesConfig(load_in_8bit=True))  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=settings, device_map={"": "cpu"},
                                                dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
def test_the_base_is_the_one_transformers_quantizes(base: Path, bits: int) -> None:
    """Every linear layer of the decoder blocks is a bitsandbytes layer holding what transformers' own loading holds
    (so an adapter reloads onto the base it trained on: the same weights, and the same scales, which the logits
    show), the rest stays float32, nothing trains, and the model counts its parameters as the float model does."""
    ours, theirs = load_quantized(base, 0, None, bits, torch.float32, CPU), transformers_quantized(base, bits)
    layer = {4: "Linear4bit", 8: "Linear8bitLt"}[bits]
    linears = [name for name, _ in quantizable(load_model(base, seed=0))]
    assert linears and [(name, type(m).__name__) for name, m in quantizable(ours)] == [(n, layer) for n in linears]
    assert ours.lm_head.weight.dtype == ours.model.embed_tokens.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in ours.parameters())
    assert parameter_count(ours) == sum(p.numel() for p in load_model(base, seed=0).parameters())
    mine, other = ours.state_dict(), theirs.state_dict()  # ours leaves the scales out (checkpoints skip the base)
    assert set(mine) < set(other) and all(key.startswith(tuple(linears)) for key in set(other) - set(mine))
    assert all(torch.equal(mine[k], other[k]) for k in mine), bits
    batch = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    ours.eval()  # (LLM.int8() multiplies otherwise in training)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=batch).logits, theirs(input_ids=batch).logits)


@pytest.mark.parametrize("model_type", ["gpt2", "qwen2"])
def test_other_architectures_quantize_as_transformers_does(tmp_path: Path, model_type: str) -> None:
    """GPT-2's linear layers are ``Conv1D`` (the weight transposed) and its head is tied; Qwen2's projections have
    biases and its head is tied: each base is transformers' own 4-bit one, and the tie stays one parameter."""
    load_model(write_config(model_type, tmp_path / "config"), seed=0).save_pretrained(tmp_path / "base")
    ours, theirs = load_quantized(tmp_path / "base", 0, None, 4, torch.float32, CPU), transformers_quantized(
        tmp_path / "base", 4)  # fmt: skip
    assert len(quantizable(ours)) == len(quantizable(load_model(tmp_path / "base", seed=0)))
    assert all(type(m).__name__ == "Linear4bit" for _, m in quantizable(ours))
    assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    mine, other = ours.state_dict(), theirs.state_dict()
    assert set(mine) < set(other) and all(torch.equal(mine[k], other[k]) for k in mine)
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ours.eval()  # (GPT-2's dropout)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=batch).logits, theirs(input_ids=batch).logits)


def test_a_fresh_base_is_the_fresh_model_quantized(tmp_path: Path) -> None:
    """A config-only model is drawn as any fresh run draws it (``diloco.fresh``), then quantized: the same base as
    quantizing that fresh model saved with its weights."""
    load_model(TINY_MODEL, seed=7).save_pretrained(tmp_path / "drawn")
    fresh = load_quantized(TINY_MODEL, 7, None, 4, torch.float32, CPU).state_dict()
    saved = load_quantized(tmp_path / "drawn", 7, None, 4, torch.float32, CPU).state_dict()
    assert sorted(fresh) == sorted(saved) and all(torch.equal(fresh[k], saved[k]) for k in fresh)
    assert torch.initial_seed() == 7  # the adapters are drawn next, from the seed, as after any fresh draw


@pytest.mark.slow
def test_a_one_rank_and_a_two_rank_4bit_group_average_the_adapters_alone(tmp_path: Path, base: Path) -> None:
    """Two LoRA groups on a 4-bit base (1 rank; 2 ranks, DDP) of one swarm: every round carries at most 5% of the
    full model's float32 bytes, both end with the same model, and each one's final/ reloads with peft onto the base
    transformers quantizes, to that model and its final evaluation loss."""
    own = ["--path-model", str(base), "--lora-r", str(R), "--load-in-4bit", "--max-steps", "10",
           "--hv.averaging-timeout", "60", "--eval-interval", "10"]  # fmt: skip
    dirs, logs = [tmp_path / "w0", tmp_path / "w1"], [tmp_path / "w0.log", tmp_path / "w1.log"]
    with diloco_dht(tmp_path / "id.pem") as peers:
        procs = [start_group(group_args(0, 2, peers, dirs[0], *own), logs[0])]
        procs.append(start_group(group_args(1, 2, peers, dirs[1], *own, "--per-device-train-batch-size", "1"),
                                 logs[1], torchrun=True, ranks=2))  # fmt: skip
        finish(procs, logs, timeout=300)
    finals = [summary(d) for d in dirs]
    assert all(s["status"] == "ok" and s["outer_steps"] == 2 for s in finals), finals
    assert finals[0]["params_sha256"] == finals[1]["params_sha256"]
    assert "ranks    : 2 (DDP" in logs[1].read_text() and "on a 4-bit base" in logs[1].read_text()
    full_bytes = 4 * sum(p.numel() for p in load_model(base, seed=0).parameters())
    rounds = [r for d in dirs for r in outer_rows(d) if r.get("num_peers") == 2]
    assert rounds and all(0 < r["bytes_sent"] <= 0.05 * full_bytes for r in rounds), (rounds, full_bytes)
    from peft import PeftModel

    for d in dirs:
        reloaded = PeftModel.from_pretrained(transformers_quantized(base, 4), d / "final")
        assert params_sha256(list(reloaded.named_parameters())) == finals[0]["params_sha256"]


@pytest.mark.slow
def test_a_resumed_8bit_run_ends_as_the_uninterrupted_one(tmp_path: Path, base: Path) -> None:
    """A 2-rank LoRA group on an 8-bit base checkpoints at step 3 of 6 (the adapters and their AdamW state alone:
    not the base, nor its scales) and a run resumed from there ends with the same model."""
    common = [*FAST, "--fake-data", "--path-model", str(base), "--lora-r", str(R), "--load-in-8bit",
              "--total-batch-size", "4", "--max-steps", "6"]  # fmt: skip
    straight, again = run_and_resume(tmp_path, common, at=3)
    metadata = dcp.FileSystemReader(str(straight / "checkpoints" / "step-3")).read_metadata().state_dict_metadata
    model_keys = [k.removeprefix("app.model.") for k in metadata if k.startswith("app.model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys
    assert summary(again)["params_sha256"] == summary(straight)["params_sha256"]
    assert summary(again)["final_eval_loss"] == summary(straight)["final_eval_loss"]
