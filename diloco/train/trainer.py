"""One worker group's training run: build everything, run the inner loop, let the outer loop wrap it.

Run it with `torchrun --nproc_per_node=N -m diloco.train --path-model ... --fake-data ...` (or plain
`python -m diloco.train ...` for one process). Flags: `diloco train --help`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from diloco import checkpoint, console, export, galaxy_moment, lora, parallel, preflight, quantized
from diloco.config import Config
from diloco.data import Data, Shard, build_data
from diloco.distenv import DistEnv, stop_with_launcher
from diloco.errors import FieldError, UsageError, first_line
from diloco.fresh import Fresh
from diloco.metrics import (
    Metrics,
    host_peak_mb,
    peak_memory_mb,
    peak_reserved_mb,
    write_json_atomic,
)
from diloco.model import (
    checkpoint_of,
    decoder_layers,
    is_fresh,
    load_model,
    refuse_misfits,
    trainable_parameters,
)
from diloco.outer.auto import galaxy_moment as takes_galaxy_moment
from diloco.outer.auto import outer_setting
from diloco.outer.build import build_outer
from diloco.outer.diloco import JoinError
from diloco.outer.loop import OuterLoop
from diloco.profiling import NoProfiler, build_profiler
from diloco.schedule import cosine_with_warmup
from diloco.shards import Checkpoint
from diloco.train.stop import StopRequest

log = logging.getLogger("diloco")


@dataclass
class Run:
    """Everything the loop needs, built once."""

    config: Config
    env: DistEnv
    device: torch.device
    run_dir: Path
    model: torch.nn.Module  # the Hugging Face model sharded in place (FSDP2), or a DDP wrapper around it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: ShardedGradScaler
    data: Data
    grad_accum: int
    halves: galaxy_moment.Halves | None  # under --hv.inner-moment galaxy: the variance of each step's gradient
    max_steps: int  # --max-steps, or --epochs × steps_per_epoch
    steps_per_epoch: int | None  # one pass over this group's share of the data; None on fake data
    metrics: Metrics
    outer: OuterLoop
    stop: StopRequest
    profiler: NoProfiler  # --profile-steps: torch.profiler over a window of inner steps
    step: int = 0
    last_loss: float | None = None
    last_eval_loss: float | None = None
    scheduled_eval_at: int = 0  # where the run stood (`OuterLoop.position`) at the last --eval-interval check
    startup_host_peak_mb: list[float] = field(default_factory=list)  # per rank, once built and resumed
    checkpoint_s: list[float] = field(default_factory=list)  # seconds of each checkpoint written
    eval_s: list[float] = field(default_factory=list)  # seconds of each evaluation
    resume_s: float | None = None  # seconds of the load of the checkpoint resumed from


# ---------------------------------------------------------------- the hot loop


def inner_step(run: Run) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches. Returns this rank's mean loss (no sync).
    Under --hv.inner-moment galaxy the step's gradient is also reduced after its first half of micro-batches (one
    micro-batch is split in two), whose snapshot gives the optimizer the gradient's variance (`galaxy_moment`)."""
    model, halves = run.model, run.halves
    pieces = [run.data.train.next_batch() for _ in range(run.grad_accum)]
    first, share = 0, 0.0
    if halves is not None:
        pieces, first, share = halves.split(pieces)
        sequences = sum(len(piece) for piece in pieces)  # a piece's loss weighs by its share of them
    total = torch.zeros((), device=run.device)
    for micro, piece in enumerate(pieces):
        batch = piece.to(run.device, non_blocking=True)
        last = micro == len(pieces) - 1
        model.set_requires_gradient_sync(last or micro == first - 1)  # reduce once per step (twice for halves)
        # use_cache=False: a KV cache is for generation; building one per forward costs memory and recompiles
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss = loss / run.grad_accum if halves is None else loss * (len(piece) / sequences)
        run.scaler.scale(loss).backward()
        total += loss.detach()
        if halves is not None and micro == first - 1:
            halves.snapshot()
    run.scaler.unscale_(run.optimizer)
    clip = 1.0
    if run.config.max_grad_norm:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), run.config.max_grad_norm)
        if halves is not None:  # reading the norm waits for the device: only when the variance needs it
            clip = galaxy_moment.clip_factor(norm, run.config.max_grad_norm)
    if halves is not None:
        scale = float(run.scaler.get_scale()) if run.scaler.is_enabled() else 1.0
        halves.observe(run.optimizer, share, scale, clip)  # type: ignore[arg-type]
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return total


def evaluate(run: Run) -> float | None:
    """Mean held-out loss over every rank of the group; None without an eval split."""
    if not run.data.eval_batches:
        return None
    run.model.eval()
    with torch.no_grad():
        losses = [
            run.model(input_ids=b.to(run.device), labels=b.to(run.device), use_cache=False).loss
            for b in run.data.eval_batches
        ]
    run.model.train()
    return parallel.all_reduce_mean(torch.stack(losses).mean().item())


def train_loop(run: Run) -> str:
    """Inner steps until max_steps or a stop request; the outer loop runs after each. Returns the status.
    Under a swarm-wide token budget the end and the LR follow the swarm's position, not this group's steps."""
    cfg = run.config
    tokens_per_step = step_tokens(run.data, run.grad_accum, run.env)
    tick = time.perf_counter()
    while run.outer.position(run.step) < run.max_steps:
        lr = run.scheduler.get_last_lr()[0]  # the rate this step uses
        loss = inner_step(run)
        run.step += 1
        run.profiler.step(run.step)
        if run.step % cfg.log_interval == 0 or run.step == run.max_steps:
            run.last_loss = parallel.all_reduce_mean(loss.item())
            if not math.isfinite(run.last_loss):
                raise FloatingPointError(f"loss is {run.last_loss} at step {run.step}: stopping this group")
            elapsed, tick = time.perf_counter() - tick, time.perf_counter()
            row = {
                "step": run.step,
                "loss": run.last_loss,
                "lr": lr,
                "tokens_per_s": tokens_per_step * cfg.log_interval / elapsed,
                "peak_memory_mb": peak_memory_mb(run.device),
            }
            if run.steps_per_epoch:
                row["epoch"] = round(run.step / run.steps_per_epoch, 4)  # passes over this group's share so far
            if cfg.hv.token_paced():
                row["swarm_step"] = run.outer.position(run.step)  # the swarm's, in steps of an average group
            run.metrics.log(row)
            run.outer.progress(row)  # the swarm's status heartbeat; never waits for the network
        if parallel.any_rank(run.stop.requested):  # agreed (host-side: no wait for the accelerator), before a round
            return "interrupted"
        outer = run.outer.after_inner_step(run.step)
        if outer is not None:
            for row in outer.rows:
                run.metrics.log(row)
            run.step = outer.step  # a group that was behind continues where the swarm is
        follow_schedule(run)
        evaluated = eval_due(run)
        if evaluated and run.outer.position(run.step) < run.max_steps:  # the last step: evaluated at the end
            with away(run, run.eval_s):
                log_eval(run)
        if cfg.ckpt.interval and run.step % cfg.ckpt.interval == 0:
            with away(run, run.checkpoint_s):
                save_checkpoint(run)
        if outer is not None or evaluated:
            tick = time.perf_counter()  # keep outer steps and evals out of the inner throughput
    return "ok"


def eval_due(run: Run) -> bool:
    """Each time the run passes a multiple of --eval-interval, and at the end of every epoch when training by
    --epochs. The run's position is its step, or under a token budget the swarm's: all groups evaluate at the same
    progress of the swarm, however many steps each took."""
    every, at = run.config.eval_interval, run.outer.position(run.step)
    passed = bool(every) and at // every > run.scheduled_eval_at // every
    run.scheduled_eval_at = at
    epoch_end = run.config.epochs is not None and run.step % run.steps_per_epoch == 0
    return passed or epoch_end


def follow_schedule(run: Run) -> None:
    """Set the LR schedule to where the run stands (``OuterLoop.position``): the inner steps themselves, so a
    no-op, unless the group just took the swarm's step count or trains under a swarm-wide token budget."""
    at = run.outer.position(run.step)
    if at == run.scheduler.last_epoch:
        return
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        run.scheduler.last_epoch = at - 1
        run.scheduler.step()


@contextlib.contextmanager
def away(run: Run, took: list[float]) -> Iterator[None]:
    """The block leaves the inner steps for about as long as the longest of its kind so far, `took` (none yet: no
    estimate): the other groups' rounds expect this group that much later, rather than averaging without it."""
    run.outer.pause(max(took) if took else None)
    try:
        yield
    finally:
        run.outer.pause(None)


def log_eval(run: Run) -> None:
    started = time.perf_counter()
    run.last_eval_loss = evaluate(run)
    run.eval_s.append(time.perf_counter() - started)
    if run.last_eval_loss is not None:
        row = {"step": run.step, "eval_loss": run.last_eval_loss, "eval_perplexity": math.exp(run.last_eval_loss)}
        if run.config.hv.token_paced():
            row["swarm_step"] = run.outer.position(run.step)
        run.metrics.log(row)


# ---------------------------------------------------------------- building


def build_model(config: Config, env: DistEnv,
                device: torch.device) -> tuple[torch.nn.Module, bool, Checkpoint | Fresh | None]:  # fmt: skip
    """The model to train, adapters included; whether this rank built it on the meta device; and where each rank
    takes its own shards from, a checkpoint or a fresh draw (``parallel.parallelize`` gives the model its values). In
    an FSDP group of several ranks, a checkpoint's safetensors files are read and a fresh model is drawn that way;
    otherwise rank 0 loads or draws the model and the others build it on the meta device and take rank 0's values.
    A quantized base (``diloco.quantized``) is loaded and quantized by every rank on its own device.
    Collective in a group of several ranks: a model one rank cannot load is the same error on every rank."""
    error: FieldError | None = None
    on_meta, weights, fresh = parallel.builds_on_meta(env, config.cpu_offload), None, False
    low = parallel.low_precision(config.precision)
    try:
        if config.quantized_bits is not None:  # every rank quantizes the whole base on its own device
            on_meta = False
            model = quantized.load_quantized(config.path_model, config.seed, config.attn_implementation,
                                             config.quantized_bits, low or torch.float32, device)  # fmt: skip
        else:
            if parallel.reads_shards(env, config.sharding_strategy, config.cpu_offload, bool(config.lora)):
                weights = checkpoint_of(config.path_model)
                fresh = weights is None and is_fresh(config.path_model)
            on_meta = on_meta or weights is not None or fresh
            model = load_model(config.path_model, config.seed, config.attn_implementation, meta=on_meta)
            if weights is not None:  # what from_pretrained checks on rank 0 otherwise
                refuse_misfits(config.path_model, weights.misfits(model))
            if fresh:  # each rank draws its own shards, a unit at a time
                weights = Fresh(model, decoder_layers(model), config.seed)
        if config.lora:
            model = lora.add_adapters(model, config.lora_r, config.lora_alpha, config.lora_dropout,
                                      config.lora_target_modules, config.seed)  # fmt: skip
            if low is not None:  # the frozen base in the run's low precision
                lora.base_in(model, low)
    except FieldError as e:
        error = e
    if env.world_size > 1:
        errors = parallel.all_gather_object(error)
        error = next((e for e in errors if e is not None), None)
        # every rank draws from rank 0's generator from here on, as when each rank built the model alike
        torch.set_rng_state(parallel.broadcast_object(torch.get_rng_state()))
    if error is not None:
        raise error
    return model, on_meta, weights


def build_run(config: Config, env: DistEnv, device: torch.device, run_dir: Path, stop: StopRequest) -> Run:
    grad_accum = config.grad_accumulation(env.world_size)
    galaxy = takes_galaxy_moment(config, config.total_batch_size * config.seq_length, grad_accum)  # tokens per step
    model, on_meta, weights = build_model(config, env, device)
    data = build_data(
        dataset=config.dataset,
        dataset_config=config.dataset_config,
        tokenizer_spec=config.tokenizer,
        vocab_size=model.config.vocab_size,
        seq_length=config.seq_length,
        batch_size=config.per_device_train_batch_size,
        eval_steps=config.eval_steps,
        seed=config.seed,
        shard=Shard.of(config.hv.world_rank, config.hv.galaxy_size, env.rank, env.world_size),
        eval_shard=Shard(env.rank, env.world_size),
        token_cache=config.token_cache,
    )
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(model)
    if config.torch_compile:
        for layer in layers:
            layer.compile()
    model = parallel.parallelize(
        model, layers, config.sharding_strategy, env, device, config.precision, config.cpu_offload, on_meta, weights
    )
    optimizer = parallel.build_optimizer(
        model,
        config.sharding_strategy,
        lr=config.lr,
        betas=config.adam_betas,
        weight_decay=config.weight_decay,
        galaxy_batches=float(config.hv.galaxy_size) if galaxy else None,  # groups of equal batches: k of them
        fused=parallel.fused_adamw(device, config.precision, config.cpu_offload),
    )
    steps_per_epoch = data.steps_per_epoch(grad_accum)
    max_steps = total_steps(config, steps_per_epoch)
    scheduler = cosine_with_warmup(optimizer, config.warmup_steps, max(max_steps, 1))
    # joining the swarm can fail on bad input: nothing is written before it
    outer = build_outer(config, env, model, device, lambda: stop.requested, max_steps,
                        step_tokens(data, grad_accum, env), run_dir)  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = Metrics.build(
        enabled=env.is_main,
        run_dir=run_dir,
        extra_sinks=config.metric_sinks,
        max_steps=max_steps,
        project=config.project,
        run_name=run_dir.parent.name if config.run_dir is None else run_dir.name,
        config=config.model_dump(mode="json"),
    )
    return Run(
        config=config,
        env=env,
        device=device,
        run_dir=run_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=ShardedGradScaler(device=device.type, enabled=config.precision == "fp16-mixed"),
        data=data,
        grad_accum=grad_accum,
        halves=galaxy_moment.Halves(trainable_parameters(model)) if galaxy else None,
        max_steps=max_steps,
        steps_per_epoch=steps_per_epoch,
        metrics=metrics,
        outer=outer,
        stop=stop,
        profiler=build_profiler(config.profile_start, config.profile_steps, run_dir, device, env.is_main),
    )


def step_tokens(data: Data, grad_accum: int, env: DistEnv) -> int:
    """Tokens of one inner step of the whole group: every micro-batch of every rank."""
    return data.tokens_per_batch * grad_accum * env.world_size


def total_steps(config: Config, steps_per_epoch: int | None) -> int:
    """--max-steps, or --epochs passes over this group's share of the data (the same count in every group)."""
    if config.epochs is None:
        return config.max_steps
    if not steps_per_epoch:  # a share smaller than one inner step's batch
        raise FieldError(
            "{epochs}: one pass over this group's share of {dataset} is less than one inner step of "
            "{total_batch_size} sequences; use {max_steps}"
        )
    return config.epochs * steps_per_epoch


def local_state(run: Run) -> dict[str, Any]:
    """What each rank keeps for itself: identical-on-all-ranks state is cheap enough to store per rank."""
    return {
        "step": run.step,
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "data": run.data.train.state_dict(),
        "rng": torch.get_rng_state(),
        "outer": run.outer.state_dict(),
    }


def save_checkpoint(run: Run) -> None:
    started = time.perf_counter()
    folder = checkpoint.save(
        preflight.ckpt_folder(run.config, run.run_dir),
        run.step,
        checkpoint.ModelAndOptimizer(run.model, run.optimizer),
        local_state(run),
        run.env.rank,
        run.env.world_size,
    )
    run.checkpoint_s.append(time.perf_counter() - started)
    log.info("checkpoint written to %s in %.1f s", folder, run.checkpoint_s[-1])
    if run.config.ckpt.topk and run.env.is_main:  # the other ranks' files are in the same folders
        for gone in checkpoint.prune(folder.parent, run.config.ckpt.topk):
            log.info("removed %s (--ckpt.topk %d)", gone, run.config.ckpt.topk)


def resume(run: Run, path: Path) -> None:
    started = time.perf_counter()
    state = checkpoint.load(path, checkpoint.ModelAndOptimizer(run.model, run.optimizer), run.env.rank)
    run.step = state["step"]
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    run.data.train.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"])
    run.outer.load_state_dict(state["outer"])
    run.resume_s = time.perf_counter() - started
    log.info("resumed from %s at step %d in %.1f s", path, run.step, run.resume_s)


# ---------------------------------------------------------------- finishing


def finish(run: Run, status: str, started: float) -> dict[str, Any]:
    """The swarm's final state, final eval (or checkpoint when interrupted), export and summary. Collective."""
    if status == "ok" and (row := run.outer.finish()) is not None:
        run.metrics.log(row)
    if status == "ok" and run.data.eval_batches:
        log_eval(run)
    if status == "interrupted" and (run.config.ckpt.path or run.config.ckpt.interval):
        save_checkpoint(run)
    peaks = parallel.all_gather_object((peak_memory_mb(run.device), peak_reserved_mb(run.device)))
    summary: dict[str, Any] = {
        "status": status,
        "steps": run.step,
        "final_loss": run.last_loss,
        "final_eval_loss": run.last_eval_loss,
        **run.outer.summary(),
        # per rank: peak allocated accelerator memory (peak RSS on CPU), and on a GPU the allocator's peak reserve
        "peak_memory_mb_per_rank": [round(allocated, 1) for allocated, _ in peaks],
        # per rank: the process's peak resident memory once the model was built, sharded and resumed (before a step)
        "startup_host_peak_mb_per_rank": [round(peak, 1) for peak in run.startup_host_peak_mb],
        "checkpoint_s": [round(seconds, 3) for seconds in run.checkpoint_s],  # (rank 0's clock)
        "eval_s": [round(seconds, 3) for seconds in run.eval_s],
        "resume_s": run.resume_s,
    }
    if peaks[0][1] is not None:
        summary["peak_reserved_mb_per_rank"] = [round(reserved, 1) for _, reserved in peaks]
    sha = export.write_final(run.model, run.run_dir / "final", run.config.lora, run.config.lora_merge)
    if run.env.is_main:
        summary["params_sha256"] = sha
    summary["wall_s"] = time.perf_counter() - started
    # every rank tears gloo down together: a rank that destroyed its group while rank 0 was still exporting
    # was seen aborting ("terminate called without an active exception")
    parallel.barrier()
    return summary


def describe(run: Run) -> dict[str, str]:
    """What the start-up banner says about this group: where it writes, what it trains, how, and with whom."""
    cfg, hv = run.config, run.config.hv
    parameters = quantized.parameter_count(run.model)
    trained = sum(p.numel() for p in trainable_parameters(run.model))
    base = f" on {'an' if cfg.quantized_bits == 8 else 'a'} {cfg.quantized_bits}-bit base" if cfg.quantized_bits else ""
    adapters = f", LoRA r {cfg.lora_r}{base}: {console.count(trained)} of them train" if cfg.lora else ""
    tokens_per_step = step_tokens(run.data, run.grad_accum, run.env)
    if hv.galaxy_size == 1:
        swarm = "none (galaxy size 1: plain torch.distributed, no DHT)"
    else:
        budget = run.outer.budget()
        pace = (
            f"an outer step per {console.count(budget[0])} swarm tokens, {budget[1]} rounds"
            if budget is not None
            else f"H = {hv.local_steps} inner steps"
        )
        outer = outer_setting(cfg, tokens_per_step, run.max_steps)
        warmup = f" rising over {outer.warmup} outer steps" if outer.warmup else ""
        auto = " (auto for this H and galaxy size: --hv.outer-* set them)" if hv.outer_is_auto() else ""
        moment = "galaxy" if run.halves is not None else "group"
        moment += " (auto: --hv.inner-moment sets it)" if hv.inner_moment == "auto" else ""
        swarm = (
            f"galaxy size {hv.galaxy_size}, world rank {hv.world_rank}, {pace}, outer lr {outer.lr:g}{warmup} "
            f"momentum {outer.momentum:g}{auto}, inner AdamW moment {moment}, {hv.wire_format()} over {hv.transport}"
        )
    return {
        "run dir": str(run.run_dir),
        "ranks": f"{run.env.world_size} ({cfg.sharding_strategy}, {parallel.backend()}, {cfg.precision})",
        "device": parallel.describe_device(run.device),
        "model": f"{cfg.path_model}: {console.count(parameters)} parameters{adapters}",
        "memory": "host peak after loading " + " / ".join(f"{peak / 1024:.2f}" for peak in run.startup_host_peak_mb)
        + " GB (per rank)",
        "data": run.data.about,
        "batch": (
            f"{cfg.per_device_train_batch_size} × {cfg.seq_length} tokens per rank, {run.grad_accum} accumulation "
            f"step(s): {console.count(tokens_per_step)} tokens per inner step"
        ),
        "schedule": (
            f"{run.max_steps} inner steps from step {run.step}"
            + (f" ({cfg.epochs} epochs of {run.steps_per_epoch})" if cfg.epochs else "")
            + f", lr {cfg.lr:g}, {cfg.warmup_steps} warm-up"
        ),
        "swarm": swarm,
    }


# ---------------------------------------------------------------- lifecycle


def resolve_run_dir(config: Config) -> Path:
    """--run-dir, else runs/<run name>/worker-<world rank>; the default name is rank 0's clock (collective)."""
    if config.run_dir is not None:
        return config.run_dir
    name = config.run_name or parallel.broadcast_object(time.strftime("%Y%m%d-%H%M%S"))
    return Path("runs") / str(name) / f"worker-{config.hv.world_rank}"


def main(config: Config, env: DistEnv) -> int:
    """Train one worker group. Returns the exit code: 0 done, 130 stopped by a signal."""
    started = time.perf_counter()
    resume_path = preflight.check_run(config, env.world_size)
    if resume_path is not None:
        checkpoint.check(resume_path, env.world_size)
    stop = StopRequest()
    stop.install()
    stop_with_launcher(env)
    device = parallel.pick_device(env)
    parallel.init_process_group(env, device)
    run: Run | None = None
    status = "failed"
    try:
        with stop.starting_up():
            run_dir = resolve_run_dir(config)
            run = build_run(config, env, device, run_dir, stop)
            if resume_path is not None:
                resume(run, resume_path)
            run.startup_host_peak_mb = parallel.all_gather_object(host_peak_mb())  # what loading the model took
            if env.is_main:
                log.info("worker group %d starting:\n%s", config.hv.world_rank, console.banner(describe(run)))
            joined = run.outer.join(run.step, load_from_peers=not config.hv.skip_load_from_peers)
        run.step = joined.step
        follow_schedule(run)
        run.scheduled_eval_at = run.outer.position(run.step)
        for row in joined.rows:
            run.metrics.log(row)
        if config.eval_interval and run.step == 0:
            log_eval(run)  # where the curve starts (about ln(vocabulary) for a fresh model)
        status = train_loop(run)
        run.profiler.close()  # a window the run's end cut short
        summary = finish(run, status, started)
    except KeyboardInterrupt:  # a second signal, or one in start-up: no more collectives, just record what is known
        status, summary = "interrupted", interrupted_summary(run, started)
    except UsageError:
        raise
    except (FloatingPointError, JoinError) as e:  # NaN/Inf, no state to join with: a clear line, no traceback
        log.error("%s", e)
        if run is not None and env.is_main:
            write_json_atomic(run.run_dir / "summary.json", failed_summary(run, started) | {"error": str(e)})
        return 1
    except BaseException as e:
        if not (stop.during_startup and isinstance(e, Exception)):
            if run is not None and env.is_main:
                write_json_atomic(run.run_dir / "summary.json", failed_summary(run, started))
            raise
        # a rank inside a collective when the signal came, which failed as its peer ranks left on it: the stop
        log.warning("stopped during start-up (%s)", first_line(e))
        status, summary = "interrupted", interrupted_summary(run, started)
    finally:
        if run is not None:
            run.metrics.close()
            run.outer.close()
        parallel.destroy_process_group()
    if env.is_main and run is not None:
        write_json_atomic(run.run_dir / "summary.json", summary)
        log.info("run %s: %s after %d steps, summary in %s", run.run_dir, status, run.step, run.run_dir)
    return 0 if status == "ok" else 130


def interrupted_summary(run: Run | None, started: float) -> dict[str, Any]:
    """What is known without a collective: a run left at once (a second signal, or one in start-up)."""
    return {"status": "interrupted", "steps": run.step if run else 0, "wall_s": time.perf_counter() - started}


def failed_summary(run: Run, started: float) -> dict[str, Any]:
    return {
        "status": "failed",
        "steps": run.step,
        "final_loss": run.last_loss,
        "final_eval_loss": run.last_eval_loss,
        "wall_s": time.perf_counter() - started,
    }

