"""The one place that composes a group's outer loop: `NoOuter` for a group alone, else `DiLoCo` over this rank's
``SwarmPeer`` (``diloco.swarm.start``) with its pace, fragments and outer setting, its world rank claimed and the
other groups met.

The trainer calls `build_outer` and nothing else of the outer loop's construction; hivemind is imported only when
there is a swarm.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from diloco import parallel
from diloco.config import Config
from diloco.distenv import DistEnv
from diloco.errors import FieldError
from diloco.model import parameter_layers, trainable_parameters
from diloco.outer.agreement import schedule, wire_format
from diloco.outer.auto import OuterSetting, outer_setting
from diloco.outer.diloco import DiLoCo
from diloco.outer.fragments import fragment_params, local_runs
from diloco.outer.links import Group, Swarm
from diloco.outer.loop import NoOuter, OuterLoop
from diloco.outer.pace import FixedSteps, Pace, TokenBudget, check_overlap
from diloco.swarm.records.arrivals import default_wait
from diloco.swarm.records.fingerprint import ModelId, model_id
from diloco.swarm.rounds.deadline import fixed_timeout
from diloco.swarm.rounds.digest import Digest

log = logging.getLogger("diloco")

# a group that found the round under way gone without it waits this long for its source to land it (`DiLoCo.land_wait`):
# a round lands once its average is in, seconds on the links diloco is made for
LAND_WAIT_S = 10.0


def build_outer(
    config: Config,
    env: DistEnv,
    model: torch.nn.Module,
    device: torch.device,
    stop: Callable[[], bool],
    max_steps: int,
    tokens_per_step: int,
    run_dir: Path,
) -> OuterLoop:
    """Galaxy size 1: `NoOuter` (no DHT, no p2pd). Otherwise, collective over the group's ranks: this group joins
    the swarm, its world rank claimed and the other groups met (at most ``--hv.averaging-timeout``); the key that
    signs its records is kept in `run_dir` (a resumed group keeps its records).

    :param model: the sharded model (FSDP2 or DDP); the local shards of its trainable parameters (with LoRA, the
        adapters) are what the outer loop averages.
    :param stop: true once the run was asked to stop.
    :param max_steps: the run's last inner step (it always ends with an outer step).
    :param tokens_per_step: tokens of one inner step of the group (all ranks): its weight under a token budget.
    :raises FieldError: bad input (an unreachable initial peer, a port in use, a world rank another running group
        holds, in a keyed swarm another model or setting than the swarm's, an overlap longer than the rounds under a
        token budget), naming config fields; nothing is left running.
    """
    if config.hv.galaxy_size == 1:
        return NoOuter()
    try:
        return _join(config, env, model, device, stop, max_steps, tokens_per_step, run_dir)
    except FieldError as e:
        raise e.within("hv") from None


def _join(config: Config, env: DistEnv, model: torch.nn.Module, device: torch.device, stop: Callable[[], bool],
          max_steps: int, tokens_per_step: int, run_dir: Path) -> DiLoCo:  # fmt: skip
    # the swarm's modules load here, only when there is a swarm (start_peer's imports bring hivemind)
    from diloco.swarm.records.ownership import KEY_FILE
    from diloco.swarm.rounds.digest import CanonicalDigest
    from diloco.swarm.start import start_peer

    hv = config.hv
    check_overlap(hv, tokens_per_step)
    group = Group(
        rank=env.rank,
        sum=parallel.all_reduce_sum,
        gather=parallel.all_gather_object,
        broadcast=parallel.broadcast_object,
        sha=lambda: parallel.params_sha(model),
    )
    plain = parallel.unwrap(model)
    fragments = _fragments(config, plain)
    model_fingerprint = model_id(plain.named_parameters())
    peer = start_peer(
        hv, env, gather=group.gather, broadcast=group.broadcast, side_broadcast=_side_broadcast,
        model=model_fingerprint, model_shapes=[tuple(p.shape) for p in trainable_parameters(plain)],
        sharding=config.sharding_strategy, fragments=fragments, owner_key=run_dir / KEY_FILE, final_step=max_steps,
    )  # fmt: skip
    try:
        shards = parallel.local_shards(model)
        digest = CanonicalDigest(peer.rounds.model_shapes, peer.rounds.layout)  # equal for one state in any shape
        outer = _diloco(config, shards, peer, group, stop, max_steps, tokens_per_step, model_fingerprint,
                        outer_setting(config, tokens_per_step, max_steps), fragments, digest)  # fmt: skip
        outer.claim_world_rank(keyed=hv.swarm_key is not None)
        if group.is_main:  # rank 0 meets the other groups for its whole group
            seen = peer.rendezvous(hv.world_rank, hv.galaxy_size, fixed_timeout(hv.averaging_timeout), stop)
            log.info("found %d of %d worker groups in the swarm", seen, hv.galaxy_size)
            peer.save_owner(run_dir / KEY_FILE)
        group.broadcast(None)
    except BaseException:
        peer.shutdown()
        raise
    return outer


def _diloco(config: Config, shards: list[torch.Tensor], swarm: Swarm, group: Group, stop: Callable[[], bool],
            max_steps: int, tokens_per_step: int, model: ModelId, outer: OuterSetting,
            fragments: list[list[int]] | None, digest: Digest) -> DiLoCo:  # fmt: skip
    """The group's outer loop over `swarm`, with its pace and the settings every group of the run must share."""
    hv = config.hv
    pace: Pace
    if hv.token_paced() and max_steps:  # a run of 0 steps has no round to pace
        given = hv.budget_given()  # else N follows H: H inner steps of this group per round of equal groups
        target = given if given is not None else hv.local_steps * hv.galaxy_size * tokens_per_step
        pace = TokenBudget(
            swarm, group, world_rank=hv.world_rank, target_tokens=target / hv.fragments,
            galaxy_size=hv.galaxy_size, tokens_per_step=tokens_per_step, max_steps=max_steps,
            follows_h=given is None,
        )  # fmt: skip  (a fragment's round every N/F tokens)
    else:
        # a fragment's round every H/F steps; its pseudo-gradient holds the H steps since its last round
        pace = FixedSteps(hv.local_steps // hv.fragments, max_steps, hv.local_steps * tokens_per_step)
    loop = DiLoCo(
        shards,
        swarm,
        group,
        world_rank=hv.world_rank,
        local_steps=hv.local_steps,
        outer_lr=outer.lr,
        outer_momentum=outer.momentum,
        outer_warmup=outer.warmup,
        stop=stop,
        join_timeout=fixed_timeout(hv.averaging_timeout),
        final_step=max_steps,
        settle_timeout=default_wait(hv.matchmaking_time) + fixed_timeout(hv.averaging_timeout) + 5,  # the last round
        sharding=config.sharding_strategy,
        transport="tcp" if hv.transport == "auto" else hv.transport,  # (auto is tcp, as earlier versions name it)
        pace=pace,
        tokens_per_step=tokens_per_step,
        model=model,
        digest=digest,
        fragments=[local_runs(f, [s.numel() for s in shards]) for f in fragments] if fragments else None,
        overlap_steps=hv.overlap_steps,
        overlap_mix=hv.overlap_mix,
        aggregation=hv.aggregation,
        wire=wire_format(hv.compression, hv.sparse_density, hv.sparse_bits, hv.sparse_rule, hv.error_decay),
        schedule=schedule(max_steps, hv.local_steps, pace.budget(), hv.fragments, hv.overlap_steps),
        batch=f"{config.total_batch_size}x{config.seq_length}",
        late_work=hv.late_work,
        error_decay=hv.error_feedback(),
        land_wait=LAND_WAIT_S,
    )
    if isinstance(pace, TokenBudget):  # a state the catch-up refused corroborates no claim of being ahead
        pace.refused = loop.catchup.refused.skipped
    return loop


def _fragments(config: Config, model: torch.nn.Module) -> list[list[int]] | None:
    """With ``--hv.fragments F`` > 1: each fragment's parameter indices (``fragments.fragment_params``)."""
    if config.hv.fragments == 1:
        return None
    try:
        return fragment_params(parameter_layers(model), config.hv.fragments, config.hv.fragment_layout)
    except ValueError as e:
        raise FieldError(f"{{fragments}} {config.hv.fragments}: {e}") from None


def _side_broadcast() -> Callable[[object], object]:
    """Collective over the group's ranks: a broadcast of rank 0's object over a gloo process group of its own."""
    import torch.distributed as dist

    return functools.partial(parallel.broadcast_object, group=dist.new_group(backend="gloo"))
