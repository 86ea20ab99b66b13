"""The architectures people train, each from a tiny config the test writes (`tests.support.architectures`): their
blocks are what FSDP2 wraps, a tied lm_head stays one parameter through sharding, averaging, a resume and the
export, groups of any shape train them together bit-identically, and a resumed run equals the uninterrupted one."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, PreTrainedModel

from diloco import checkpoint, parallel
from diloco.model import (
    decoder_layers,
    load_model,
    parameter_layers,
    params_sha256,
    save_hf,
)
from tests.support.architectures import ARCHITECTURES, VOCAB, write_config
from tests.support.groups import finish, group_args, outer_rows, start_group
from tests.support.paths import TORCHRUN
from tests.support.procs import FAST, metrics, run_cmd, summary
from tests.support.swarm import diloco_dht

TIED = {"gpt2", "qwen2", "qwen3", "gemma", "gemma2"}  # lm_head.weight is the token embedding's weight


def tied(model: PreTrainedModel) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def sha(model: torch.nn.Module) -> str:
    return params_sha256(list(model.named_parameters()))


def assert_reloads(final: Path, params_sha: str, model_type: str) -> None:
    """The exported folder loads with transformers to the same parameters, tied as the architecture ties them."""
    exported = AutoModelForCausalLM.from_pretrained(final)
    assert sha(exported) == params_sha
    assert tied(exported) == (model_type in TIED)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_blocks_are_found_a_tie_survives_sharding_and_the_export_reloads(
    tmp_path: Path, model_type: str, one_process_group: None
) -> None:
    """`decoder_layers` finds the config's num_hidden_layers blocks (of a class `_no_split_modules` names), every
    block's parameters map to it, a tied lm_head is the embedding's parameter before and after `fully_shard` (so
    `parameters()`, which the outer loop averages, yields it once), a sharded step trains, the export reloads, and
    a checkpoint holds a tied weight once and loads back into another sharded model, tied."""
    model = load_model(write_config(model_type, tmp_path / "model"), seed=0)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert all(type(layer).__name__ in model._no_split_modules for layer in layers)
    homes = parameter_layers(model)
    assert len(homes) == len(list(model.parameters())) and set(homes) == {None, *range(len(layers))}
    assert tied(model) == (model_type in TIED)
    count = len(list(model.parameters()))

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    parallel.shard_model(model, layers, mesh, "FULL_SHARD", "32-true", cpu_offload=False)
    assert tied(model) == (model_type in TIED) and len(list(model.parameters())) == count
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    optimizer.step()
    assert tied(model) == (model_type in TIED)

    state = parallel.full_state_dict(model)
    save_hf(model, state, tmp_path / "final")
    assert_reloads(tmp_path / "final", parallel.sha_of(model, state), model_type)

    # a checkpoint writes a tied weight once, and a fresh sharded model (its own seed) loads it back tied
    saved = checkpoint.save(tmp_path / "ckpt", 1, checkpoint.ModelAndOptimizer(model, optimizer), {}, 0, 1)
    written = dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    assert ("app.model.lm_head.weight" in written) == (model_type not in TIED)
    assert len([k for k in written if k.startswith("app.model.")]) == len(state) - (model_type in TIED)
    other = load_model(tmp_path / "model", seed=1)
    parallel.shard_model(other, decoder_layers(other), mesh, "FULL_SHARD", "32-true", cpu_offload=False)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    checkpoint.load(saved, checkpoint.ModelAndOptimizer(other, other_optimizer), 0)
    assert tied(other) == (model_type in TIED)
    assert parallel.sha_of(other, parallel.full_state_dict(other)) == parallel.sha_of(model, state)
    assert other_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    if model_type in TIED:  # a checkpoint written under both names (as before) loads too
        both = checkpoint.ModelAndOptimizer(model, optimizer)
        both.aliases = {}
        older = checkpoint.save(tmp_path / "older", 1, both, {}, 0, 1)
        assert "app.model.lm_head.weight" in dcp.FileSystemReader(str(older)).read_metadata().state_dict_metadata
        fresh = load_model(tmp_path / "model", seed=2)
        parallel.shard_model(fresh, decoder_layers(fresh), mesh, "FULL_SHARD", "32-true", cpu_offload=False)
        checkpoint.load(older, checkpoint.ModelAndOptimizer(fresh, torch.optim.AdamW(fresh.parameters())), 0)
        assert tied(fresh) and parallel.sha_of(fresh, parallel.full_state_dict(fresh)) == parallel.sha_of(model, state)


@pytest.fixture(scope="module")
def shared_dht(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """One `diloco dht` for the architectures' swarms (each test its own run id): a bootstrap peer per test cost
    12 s of a test's setup under the suite's load."""
    with diloco_dht(tmp_path_factory.mktemp("architectures-dht") / "id.pem") as peers:
        yield peers


@pytest.fixture(scope="module")
def swarmed(tmp_path_factory: pytest.TempPathFactory, shared_dht: list[str]) -> dict[str, tuple[Path, Path, list[int]]]:
    """Per architecture, a 1-rank group and a 2-rank FULL_SHARD group (a micro-batch of one sequence per rank: the
    same batch) take five rounds at H = 5 under a run id of the architecture's (under CI's load a pair's matchmaking
    once formed a round in one group and not in the other: the first timed out for 60 s while the second took its
    three rounds alone; five leave room for a round together after such a failure). Each group trains every
    architecture one after another in the same torchrun ranks (`tests.support.runs`: a torchrun and three torch
    imports per architecture spared); the two meet in each architecture's rounds. Each waits up to 60 s for the
    other to join (the averaging timeout; 15 s in `SWARM`): under load a torchrun group once joined 24 s after the
    other, which had started alone. A round waits up to 30 s for the other group (3 s in `SWARM`): the 2-rank group's
    steps are slower, and under load a pair was seen to end without a round together. And the two start each
    architecture together (`tests.support.runs` with a meeting folder): a 2-rank torchrun starts slower. Each
    architecture's (1-rank
    run, 2-rank run, the two runs' exit codes)."""
    root = tmp_path_factory.mktemp("architectures-swarm")
    two_ranks = ["--sharding-strategy", "FULL_SHARD", "--per-device-train-batch-size", "1"]
    runs: list[list[list[str]]] = [[], []]
    dirs = {}
    for model_type in ARCHITECTURES:
        own = ["--path-model", str(write_config(model_type, root / model_type / "model")), "--max-steps", "25",
               "--hv.averaging-timeout", "60", "--hv.matchmaking-time", "30",
               "--hv.run-id", f"architecture-{model_type}"]  # fmt: skip
        dirs[model_type] = (root / model_type / "w0", root / model_type / "w1")
        runs[0].append(group_args(0, 2, shared_dht, dirs[model_type][0], *own))
        runs[1].append(group_args(1, 2, shared_dht, dirs[model_type][1], *own, *two_ranks))
    logs = [root / "w0.log", root / "w1.log"]
    procs = []
    (root / "meet").mkdir()  # the two groups start each architecture together: a 2-rank torchrun starts slower
    for i, ranks in enumerate((1, 2)):
        (root / f"runs-{i}.json").write_text(json.dumps(runs[i]))
        procs.append(start_group([str(root / f"runs-{i}.json"), str(root / "meet"), "2"], logs[i], torchrun=True,
                                 ranks=ranks, module="tests.support.runs"))  # fmt: skip
    with contextlib.suppress(AssertionError):  # a failed run is its architecture's test's failure, not every one's
        finish(procs, logs, timeout=900)
    ended = r"^RUN (\d+) EXIT (-?\d+)$"
    codes = [{int(i): int(c) for i, c in re.findall(ended, log.read_text(), re.M)} for log in logs]
    assert all(len(c) == len(ARCHITECTURES) for c in codes), [log.read_text()[-3000:] for log in logs]
    return {t: (*dirs[t], [codes[0][i], codes[1][i]]) for i, t in enumerate(ARCHITECTURES)}


@pytest.mark.slow
@pytest.mark.xdist_group("architectures-swarm")
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_a_one_rank_and_a_two_rank_group_train_it_together_bit_identically(
    swarmed: dict[str, tuple[Path, Path, list[int]]], model_type: str
) -> None:
    """The architecture's 1-rank and 2-rank groups (`swarmed`) end with the same model after at least one round
    together, and each one's export reloads with transformers."""
    *dirs, codes = swarmed[model_type]
    assert codes == [0, 0], (codes, [(d / "summary.json").exists() for d in dirs])
    finals = [summary(d) for d in dirs]
    assert all(s["status"] == "ok" and s["outer_steps"] == 5 for s in finals), finals
    assert finals[0]["params_sha256"] == finals[1]["params_sha256"]
    together = [{r["outer_step"]: r["params_sha256"] for r in outer_rows(d) if r.get("num_peers") == 2} for d in dirs]
    shared = together[0].keys() & together[1].keys()
    rounds = [[(r["outer_step"], r.get("num_peers")) for r in outer_rows(d)] for d in dirs]
    assert shared and all(together[0][step] == together[1][step] for step in shared), rounds  # a round of both
    for d in dirs:
        assert_reloads(d / "final", finals[0]["params_sha256"], model_type)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, list[int]]]:
    """Per architecture, one 2-rank FULL_SHARD group (galaxy size 1) checkpoints at step 3 of 6, and a run resumed
    from there: every architecture's two runs in the same torchrun ranks, one after another (`tests.support.runs`:
    a torchrun and two torch imports per architecture spared). Each architecture's (straight run, resumed run, the
    two runs' exit codes)."""
    root = tmp_path_factory.mktemp("architectures-resume")
    runs, dirs = [], {}
    for model_type in ARCHITECTURES:
        base = [*FAST, "--fake-data", "--path-model", str(write_config(model_type, root / model_type / "model")),
                "--total-batch-size", "4", "--max-steps", "6", "--log-interval", "1",
                "--sharding-strategy", "FULL_SHARD"]  # fmt: skip
        straight, again = root / model_type / "straight", root / model_type / "resumed"
        resume = ["--ckpt.resume", str(straight / "checkpoints" / "step-3")]
        runs += [[*base, "--ckpt.interval", "3", "--run-dir", str(straight)], [*base, *resume, "--run-dir", str(again)]]
        dirs[model_type] = (straight, again)
    (root / "runs.json").write_text(json.dumps(runs))
    result = run_cmd([str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "tests.support.runs",
                      str(root / "runs.json")], timeout=900)  # fmt: skip
    codes = {int(i): int(code) for i, code in re.findall(r"^RUN (\d+) EXIT (-?\d+)$", result.stdout, re.M)}
    assert len(codes) == len(runs), result.output[-3000:]  # every run ended (failed or not): the ranks lived
    return {t: (*dirs[t], [codes[2 * i], codes[2 * i + 1]]) for i, t in enumerate(ARCHITECTURES)}


@pytest.mark.slow
@pytest.mark.xdist_group("architectures-resume")
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_resume_is_bit_exact(resumed: dict[str, tuple[Path, Path, list[int]]], model_type: str) -> None:
    """A run resumed from the step-3 checkpoint (`resumed`) ends with the uninterrupted run's model, and its export
    reloads, tied as the architecture ties it."""
    straight, again, codes = resumed[model_type]
    assert codes == [0, 0], (codes, (straight / "summary.json").exists(), (again / "summary.json").exists())
    assert [r["step"] for r in metrics(again) if "loss" in r] == [4, 5, 6]
    assert summary(again)["params_sha256"] == summary(straight)["params_sha256"]
    assert_reloads(again / "final", summary(again)["params_sha256"], model_type)
