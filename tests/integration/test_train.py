"""The trainer end to end: real torchrun processes on CPU with gloo."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from diloco.model import params_sha256
from tests.support.paths import CORPUS, ROOT, TORCHRUN
from tests.support.procs import (
    FAST,
    Result,
    assert_ok,
    child_env,
    metrics,
    python_train,
    run_cmd,
    summary,
    torchrun,
)

FAKE = [*FAST, "--fake-data", "--total-batch-size", "8"]
# The reference run: two ranks, FULL_SHARD, float32, 4 steps, evaluated every 2. Every run whose model is compared
# with it trains with these flags (and its own, which win); it runs once per module (per xdist worker).
REFERENCE = [*FAKE, "--max-steps", "4", "--eval-interval", "2", "--eval-steps", "2", "--sharding-strategy",
             "FULL_SHARD"]  # fmt: skip


# The tests that compare with the reference (and the variants) run on one xdist worker, so each runs once.
ONE_WORKER = pytest.mark.xdist_group("reference")


@dataclass(frozen=True)
class Reference:
    result: Result
    run_dir: Path

    @property
    def sha(self) -> str:
        return summary(self.run_dir)["params_sha256"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = torchrun([*REFERENCE, "--run-dir", str(run_dir)])
    assert_ok(result)
    return Reference(result, run_dir)


@ONE_WORKER
def test_two_ranks_train_and_write_every_output(reference: Reference) -> None:
    result, run_dir = reference.result, reference.run_dir
    assert "step 4/4 | loss" in result.stdout  # rank 0's progress line
    rows = metrics(run_dir)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_mb"] > 0 for r in train_rows)
    assert [r["lr"] for r in train_rows][:3] == pytest.approx([0.0, 5e-3, 1e-2])  # linear warm-up over 2 steps
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 2, 4]  # the start, every interval, the last step
    done = summary(run_dir)
    assert done["status"] == "ok" and done["steps"] == 4 and done["wall_s"] > 0
    assert done["final_loss"] == train_rows[-1]["loss"] and done["final_eval_loss"] == rows[-1]["eval_loss"]
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert params_sha256(list(exported.named_parameters())) == done["params_sha256"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs compared with the reference, by name: each one's arguments (its own flags after the reference's win).
CLIP = ["--max-grad-norm", "0.05"]
VARIANTS = {
    **{s: [*REFERENCE, "--sharding-strategy", s]
       for s in ("NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "DDP", "ZERO1")},
    "gc": [*REFERENCE, "--gradient-checkpointing"],
    "seed": [*REFERENCE, "--seed", "7"],
    **{f"clip-{s}": [*REFERENCE, "--sharding-strategy", s, *CLIP] for s in ("NO_SHARD", "DDP", "ZERO1")},
    **{f"{p}-{s}": [*REFERENCE, "--precision", p, "--sharding-strategy", s]
       for p, s in [("bf16-mixed", "FULL_SHARD"), ("fp16-mixed", "FULL_SHARD"), ("bf16-mixed", "DDP"),
                    ("fp16-mixed", "ZERO1")]},
}  # fmt: skip
# The uninterrupted runs that resumed ones (each a launch of its own) must match, with checkpoints on the way.
RESUME = [*FAKE, "--max-steps", "10", "--lr", "3e-3"]
RESUME_BY_STRATEGY = {
    s: [*FAKE, "--max-steps", "8", "--lr", "3e-3", "--sharding-strategy", s] for s in ("DDP", "ZERO1")
}
VARIANTS |= {"straight": [*RESUME, "--ckpt.interval", "5"]}
VARIANTS |= {f"straight-{s}": [*args, "--ckpt.interval", "4"] for s, args in RESUME_BY_STRATEGY.items()}


def resumes(root: Path) -> dict[str, list[str]]:
    """Runs that resume the straight runs' checkpoints (in `root`): they run after them, in the same ranks. The
    10-step schedule from step 5 into a fresh folder and from 'latest' in place (on to step 12); DDP and ZERO1
    from step 4."""
    straight = root / "straight" / "checkpoints"
    return {
        "resumed": [*RESUME, "--ckpt.resume", str(straight / "step-5")],
        "latest": [*RESUME, "--max-steps", "12", "--ckpt.path", str(straight), "--ckpt.resume", "latest"],
        **{f"resumed-{s}": [*args, "--ckpt.resume", str(root / f"straight-{s}" / "checkpoints" / "step-4")]
           for s, args in RESUME_BY_STRATEGY.items()},
    }  # fmt: skip


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every VARIANTS run, then the `resumes` of the straight ones, one after another in the same two torchrun ranks
    (`tests.support.runs`: the real command line, a process group of its own per run; it spares a torchrun and two
    torch imports per run). Their run folders by name. The reference is a launch of its own, so a run that shared
    its processes and matches it proves that the sharing changed nothing."""
    root = tmp_path_factory.mktemp("variants")
    named = VARIANTS | resumes(root)
    runs = root / "runs.json"
    runs.write_text(json.dumps([[*args, "--run-dir", str(root / name)] for name, args in named.items()]))
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "tests.support.runs", str(runs)]
    result = run_cmd(cmd, timeout=60 + 30 * len(named))
    stacks = sorted(root.glob("runs.stacks-rank*.txt"))  # (tests.support.runs.STACKS_FILE)
    stuck = "".join(f"{p.name}:\n{p.read_text()}" for p in stacks if p.stat().st_size)
    assert result.returncode == 0 or not stuck, stuck[-8000:]  # where a rank was stuck (tests.support.runs)
    assert_ok(result)
    assert result.stdout.count(" EXIT 0") == len(named), result.output[-3000:]
    return {name: root / name for name in named}


def sha(run_dir: Path) -> str:
    return summary(run_dir)["params_sha256"]


@ONE_WORKER
def test_sharding_strategies_and_checkpointing_compute_the_same_model(reference: Reference, variants: dict) -> None:
    """NO_SHARD (FSDP2, replicated), SHARD_GRAD_OP (ZeRO-2), FULL_SHARD (ZeRO-3, the reference), HYBRID_SHARD,
    torch DDP, DDP with a ZeRO-1 optimizer and activation recomputation only change where memory lives, never the
    arithmetic: in float32 the models are identical (with clipping inactive: see the next test)."""
    for strategy in ("NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "DDP", "ZERO1", "gc"):
        assert sha(variants[strategy]) == reference.sha, strategy
    # final/ is each tensor gathered in turn: the same model whichever ranks held which shards (and unwrapped from
    # DDP: no `module.`)
    for strategy in ("NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "DDP", "ZERO1"):
        exported = AutoModelForCausalLM.from_pretrained(variants[strategy] / "final")
        assert params_sha256(list(exported.named_parameters())) == reference.sha, strategy
    assert sha(variants["seed"]) != reference.sha


@ONE_WORKER
def test_clipping_ddp_and_zero1_match_no_shard(reference: Reference, variants: dict) -> None:
    """When clipping bites, the norm's summation order matters: replicated ranks (NO_SHARD, DDP, ZERO1) sum each
    whole gradient the same way and agree bit for bit; FULL_SHARD adds per-shard sums and may differ in the last
    bits (measured: it does here)."""
    shas = {s: sha(variants[f"clip-{s}"]) for s in ("NO_SHARD", "DDP", "ZERO1")}
    assert len(set(shas.values())) == 1, shas
    assert shas["DDP"] != reference.sha  # clipping did change the model


@pytest.mark.slow
@ONE_WORKER
def test_hybrid_shard_across_two_nodes(tmp_path: Path, reference: Reference) -> None:
    """Two torchrun 'nodes' on loopback, one rank each: HYBRID_SHARD replicates across them."""
    port = free_port()
    run_dir = tmp_path / "hybrid"
    procs = []
    for node in range(2):
        cmd = [str(TORCHRUN), "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=hybrid", "-m", "diloco.train", *REFERENCE,
               "--sharding-strategy", "HYBRID_SHARD", "--run-dir", str(run_dir)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))  # fmt: skip
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode == 0 for p in procs), outputs
    assert summary(run_dir)["params_sha256"] == reference.sha


@pytest.mark.slow
def test_seed_000s_torchrun_line_trains_one_group_over_three_nodes(run_dir: Path) -> None:
    """Seed 000's launch, three machines with one GPU each, as three torchrun 'nodes' on loopback: they must meet
    in one rendezvous and train one group of 3 ranks, not three groups of one. Every node's endpoint address is
    its own here, so each tries to host the c10d store; the first to bind hosts it, the others connect to it. c10d
    ignores --node_rank (torchrun warns): ranks follow (host name, pid), so here the first node started is rank 0."""
    port = free_port()
    flags = [*FAST, "--fake-data", "--total-batch-size", "6", "--max-steps", "4", "--sharding-strategy", "FULL_SHARD",
             "--run-dir", str(run_dir)]  # fmt: skip
    procs = []
    try:
        for node in range(3):
            cmd = [str(TORCHRUN), "--nnodes=3", "--nproc_per_node=1", "--rdzv_id=100", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint=127.0.0.1:{port}", f"--node_rank={node}", "-m", "diloco.train",
                   *flags]  # fmt: skip
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))  # fmt: skip
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    # Only rank 0 of a group prints the banner: one banner, and it counts 3 ranks (three groups would print three).
    assert re.findall(r"^ +ranks +: (\d+) \(", "".join(outputs), re.MULTILINE) == ["3"], outputs
    done = summary(run_dir)
    assert done["status"] == "ok" and done["steps"] == 4 and len(done["params_sha256"]) == 64
    assert [r["step"] for r in metrics(run_dir) if "loss" in r] == [1, 2, 3, 4]


@ONE_WORKER
def test_mixed_precision_trains(reference: Reference, variants: dict) -> None:
    """FSDP2 casts parameters; DDP and ZERO1 autocast the forward (fp16 with the gradient scaler)."""
    for name in ("bf16-mixed-FULL_SHARD", "fp16-mixed-FULL_SHARD", "bf16-mixed-DDP", "fp16-mixed-ZERO1"):
        done = summary(variants[name])
        assert done["params_sha256"] != reference.sha, name
        assert done["status"] == "ok" and done["final_loss"] < 8, name


@pytest.mark.slow
def test_torch_compile_single_process(run_dir: Path) -> None:
    result = python_train([*FAKE, "--torch-compile", "--max-steps", "2", "--run-dir", str(run_dir)], timeout=300)
    assert_ok(result)
    assert summary(run_dir)["status"] == "ok"


@ONE_WORKER
def test_resume_is_bit_exact(variants: dict) -> None:
    straight, resumed, latest = variants["straight"], variants["resumed"], variants["latest"]
    assert (straight / "checkpoints" / "step-10").is_dir()
    assert [r["step"] for r in metrics(resumed) if "loss" in r] == [6, 7, 8, 9, 10]
    assert summary(resumed)["params_sha256"] == summary(straight)["params_sha256"]
    # 'latest' is the step-10 checkpoint: its run trains steps 11 and 12 only
    assert summary(latest)["steps"] == 12 and [r["step"] for r in metrics(latest) if "loss" in r] == [11, 12]


@ONE_WORKER
@pytest.mark.parametrize("strategy", ["DDP", "ZERO1"])
def test_ddp_and_zero1_resume_is_bit_exact(variants: dict, strategy: str) -> None:
    """DDP's state goes through DCP like FSDP's; ZERO1's AdamW partition and LR live in each rank's own file."""
    straight, resumed = variants[f"straight-{strategy}"], variants[f"resumed-{strategy}"]
    assert [r["step"] for r in metrics(resumed) if "loss" in r] == [5, 6, 7, 8]
    assert summary(resumed)["params_sha256"] == summary(straight)["params_sha256"]


@pytest.mark.slow
def test_real_text_loss_falls_and_is_evaluated(run_dir: Path) -> None:
    args = [*FAST, "--dataset", str(CORPUS), "--seq-length", "64", "--per-device-train-batch-size", "8",
            "--total-batch-size", "16", "--lr", "3e-3", "--max-steps", "30", "--eval-interval", "15",
            "--eval-steps", "4", "--run-dir", str(run_dir)]  # fmt: skip
    assert_ok(torchrun(args))
    rows = metrics(run_dir)
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert losses[-1] < losses[0] - 1.5  # byte-level text is learnable fast; random init sits near ln(1024)
    assert [r["step"] for r in evals] == [0, 15, 30]  # the curve starts before the first step
    assert evals[2]["eval_loss"] < evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[0]["eval_loss"] == pytest.approx(math.log(1024), abs=0.3)  # a fresh model: about uniform
    assert evals[2]["eval_perplexity"] == pytest.approx(2.718281828 ** evals[2]["eval_loss"], rel=1e-6)


def test_tensorboard_and_wandb_offline_together(run_dir: Path) -> None:
    assert_ok(python_train([*FAKE, "--max-steps", "3", "--eval-interval", "2", "--eval-steps", "1", "--project", "t",
                            "--metric-logger-type", "tensorboard,wandb", "--run-dir", str(run_dir)]))  # fmt: skip
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and any(offline_runs[0].glob("*.wandb"))
    rows = metrics(run_dir)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows if "loss" in r], rel=1e-6)
    assert [e.wall_time for e in loss] == pytest.approx([r["time"] for r in rows if "loss" in r])
    eval_steps = [r["step"] for r in rows if "eval_loss" in r]
    assert [e.step for e in events.Scalars("eval/loss")] == eval_steps and {2, 3} <= set(eval_steps)
    tags = set(events.Tags()["scalars"])
    assert {"train/lr", "train/tokens_per_s", "train/peak_memory_mb", "eval/perplexity"} <= tags


@pytest.mark.slow
def test_sigterm_stops_with_checkpoint_and_summary(run_dir: Path) -> None:
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "diloco.train", *FAKE, "--max-steps", "100000",
           "--run-dir", str(run_dir), "--ckpt.path", str(run_dir / "ckpt")]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() or len(metrics(run_dir)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.2)
        # SIGUSR1 to a rank: its threads' stacks on stderr (for a rank that seems stuck), and it trains on
        psutil.Process(proc.pid).children()[0].send_signal(signal.SIGUSR1)
        dumped = len(metrics(run_dir))
        while len(metrics(run_dir)) < dumped + 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to torchrun only; it forwards to its ranks
        stopped = time.monotonic()
        output = proc.communicate(timeout=30)[0]
        assert time.monotonic() - stopped < 15
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert re.search(r"Current thread 0x[0-9a-f]+ .*most recent call first", output), output[-3000:]
    assert 'in train_loop' in output, output[-3000:]
    done = summary(run_dir)
    assert done["status"] == "interrupted" and 5 <= done["steps"] < 100000
    assert (run_dir / "ckpt" / f"step-{done['steps']}" / "meta.json").is_file()
    assert run_cmd(["pgrep", "-s", str(proc.pid)]).stdout == ""  # nothing of its session is left


def test_killing_torchrun_stops_its_ranks_with_a_checkpoint(run_dir: Path) -> None:
    """torchrun starts ranks in sessions of their own: after `kill -9 <torchrun>` they must not train on."""
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=1", "-m", "diloco.train", *FAKE, "--max-steps", "100000",
           "--run-dir", str(run_dir), "--ckpt.path", str(run_dir / "ckpt")]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() or len(metrics(run_dir)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        ranks = psutil.Process(proc.pid).children()
        proc.kill()
        killed = time.monotonic()
        _, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive and time.monotonic() - killed < 15
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done = summary(run_dir)
    assert done["status"] == "interrupted"
    assert (run_dir / "ckpt" / f"step-{done['steps']}" / "meta.json").is_file()


def test_a_second_stop_signal_exits_at_once() -> None:
    """The first SIGINT asks for a stop at the next step; a second one (after the echo window) leaves now."""
    script = (
        "import time\nfrom diloco.train.stop import StopRequest\nstop = StopRequest(echo_s=0.5)\nstop.install()\n"
        "print('ready', flush=True)\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
        "    print('left', stop.requested, flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # the first signal only asks
        proc.send_signal(signal.SIGINT)
        assert proc.communicate(timeout=5)[0].strip() == "left True"
    finally:
        proc.kill()


def test_diverging_loss_stops_with_a_failed_summary(run_dir: Path) -> None:
    diverging = ["--max-steps", "50", "--lr", "1e30", "--warmup-steps", "0"]
    result = python_train([*FAKE, *diverging, "--run-dir", str(run_dir)])
    assert result.returncode == 1 and "loss is" in result.stderr and "Traceback" not in result.stderr
    done = summary(run_dir)
    assert done["status"] == "failed" and 0 < done["steps"] < 50 and "loss is" in done["error"]
