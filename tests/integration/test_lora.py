"""LoRA (`--lora-r`): adapters on a frozen base train alone, are the whole outer state (rounds, checkpoints), export in
peft's format and reload to the same model; groups of any shape average them bit-identically; a resume is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from diloco import checkpoint, lora, parallel
from diloco.errors import FieldError
from diloco.model import decoder_layers, load_model, params_sha256, trainable_parameters
from tests.support.groups import finish, group_args, outer_rows, start_group
from tests.support.paths import TINY_MODEL
from tests.support.procs import FAST, run_and_resume, summary
from tests.support.swarm import diloco_dht

R = 2  # adapters of about 2% of the tiny llama's parameters


def sharded_lora(folder: Path, seed: int) -> torch.nn.Module:
    model = lora.add_adapters(load_model(folder, seed=0), R, None, 0.0, ["all-linear"], seed)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    parallel.shard_model(model, decoder_layers(model), mesh, "FULL_SHARD", "32-true", cpu_offload=False)
    return model


def loss(model: torch.nn.Module, batch: torch.Tensor) -> float:
    with torch.no_grad():
        return model(input_ids=batch, labels=batch, use_cache=False).loss.item()


def test_adapters_train_alone_checkpoint_alone_and_reload_from_the_export(
    tmp_path: Path, base: Path, one_process_group: None
) -> None:
    """Only the adapters train and make the local shards; a checkpoint holds them (no base parameter) and loads into
    another LoRA model; final/ reloads with peft to the same parameters and loss, and final/merged with transformers
    to the same logits."""
    model = sharded_lora(base, seed=0)
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in name or ".lora_B." in name for name in names)
    every = sum(p.numel() for p in model.parameters())
    assert sum(s.numel() for s in parallel.local_shards(model)) == sum(p.numel() for p in trainable_parameters(model))
    assert sum(s.numel() for s in parallel.local_shards(model)) < 0.05 * every
    optimizer = parallel.build_optimizer(model, "FULL_SHARD", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    batch = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    for _ in range(3):
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)
    state = parallel.full_state_dict(model)
    sha = parallel.sha_of(model, state)

    saved = checkpoint.save(tmp_path / "ckpt", 3, checkpoint.ModelAndOptimizer(model, optimizer), {}, 0, 1)
    written = [k for k in dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata if k.startswith("app.")]
    assert {k.removeprefix("app.model.") for k in written if k.startswith("app.model.")} == names
    other = sharded_lora(base, seed=1)  # other adapters, the same base
    assert parallel.sha_of(other, parallel.full_state_dict(other)) != sha
    checkpoint.load(saved, checkpoint.ModelAndOptimizer(other, parallel.build_optimizer(
        other, "FULL_SHARD", lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)), 0)  # fmt: skip
    assert parallel.sha_of(other, parallel.full_state_dict(other)) == sha

    from peft import PeftModel

    lora.save(model, state, tmp_path / "final", merge=True)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "final")
    assert params_sha256(list(reloaded.named_parameters())) == sha
    assert loss(reloaded, batch) == loss(model, batch)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / lora.MERGED)
    with torch.no_grad():
        expected = reloaded(input_ids=batch).logits
        assert torch.allclose(merged(input_ids=batch).logits, expected, atol=1e-5)


def test_a_low_precision_run_holds_its_base_in_it_and_computes_the_same(base: Path, one_process_group: None) -> None:
    """Under bf16-mixed the frozen base is held in bf16 and the adapters in float32. FSDP computes in bf16 either way,
    so the loss and the adapters' gradients are those of a float32 base, bit for bit."""
    batch = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for lowered in (False, True):
        model = lora.add_adapters(load_model(base, seed=0), R, None, 0.0, ["all-linear"], 0)
        if lowered:
            lora.base_in(model, torch.bfloat16)
            dtypes = {p.requires_grad: p.dtype for p in model.parameters()}
            assert dtypes == {False: torch.bfloat16, True: torch.float32}, dtypes
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        parallel.shard_model(model, decoder_layers(model), mesh, "FULL_SHARD", "bf16-mixed", cpu_offload=False)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        results.append((loss.item(), [p.grad.full_tensor() for p in trainable_parameters(model)]))
    (loss32, grads32), (loss16, grads16) = results
    assert loss16 == loss32 and all(torch.equal(a, b) for a, b in zip(grads16, grads32, strict=True))


def test_a_target_module_the_model_lacks_is_named() -> None:
    with pytest.raises(FieldError, match=r"^lora_target_modules no_such_proj: .*no_such_proj"):
        lora.add_adapters(load_model(TINY_MODEL, seed=0), R, None, 0.0, ["no_such_proj"], 0)


@pytest.mark.slow
def test_a_one_rank_and_a_two_rank_lora_group_average_the_adapters_alone(tmp_path: Path, base: Path) -> None:
    """Two LoRA groups (1 rank; 2 ranks FULL_SHARD) of one swarm: every round carries at most 5% of the full model's
    float32 bytes, both end with the same model, and each one's final/ reloads with peft to it."""
    own = ["--path-model", str(base), "--lora-r", str(R), "--max-steps", "10", "--hv.averaging-timeout", "60"]
    dirs, logs = [tmp_path / "w0", tmp_path / "w1"], [tmp_path / "w0.log", tmp_path / "w1.log"]
    two_ranks = ["--sharding-strategy", "FULL_SHARD", "--per-device-train-batch-size", "1"]
    with diloco_dht(tmp_path / "id.pem") as peers:
        procs = [start_group(group_args(0, 2, peers, dirs[0], *own), logs[0])]
        procs.append(start_group(group_args(1, 2, peers, dirs[1], *own, *two_ranks), logs[1], torchrun=True, ranks=2))
        finish(procs, logs, timeout=300)
    finals = [summary(d) for d in dirs]
    assert all(s["status"] == "ok" and s["outer_steps"] == 2 for s in finals), finals
    assert finals[0]["params_sha256"] == finals[1]["params_sha256"]
    full_bytes = 4 * sum(p.numel() for p in load_model(base, seed=0).parameters())
    rounds = [r for d in dirs for r in outer_rows(d) if r.get("num_peers") == 2]
    assert rounds and all(0 < r["bytes_sent"] <= 0.05 * full_bytes for r in rounds), (rounds, full_bytes)
    from peft import PeftModel

    for d in dirs:
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), d / "final")
        assert params_sha256(list(reloaded.named_parameters())) == finals[0]["params_sha256"]


@pytest.mark.slow
def test_a_resumed_lora_run_ends_as_the_uninterrupted_one(tmp_path: Path, base: Path) -> None:
    """A 2-rank FULL_SHARD LoRA group checkpoints at step 3 of 6 (the adapters and their AdamW state alone) and a run
    resumed from there ends with the same model (both runs in the same torchrun ranks: `tests.support.runs`)."""
    common = [*FAST, "--fake-data", "--path-model", str(base), "--lora-r", str(R), "--total-batch-size", "4",
              "--max-steps", "6", "--sharding-strategy", "FULL_SHARD"]  # fmt: skip
    straight, again = run_and_resume(tmp_path, common, at=3)
    assert summary(again)["params_sha256"] == summary(straight)["params_sha256"]
    assert summary(again)["final_eval_loss"] == summary(straight)["final_eval_loss"]
