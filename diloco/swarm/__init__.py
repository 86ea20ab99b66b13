"""The swarm: hivemind DHT peers, averaging between worker groups, and their progress records. The only package
that imports hivemind; the trainer comes in through one door, ``join``.

One module per concept:

- ``identity``: private key files and peer ids; ``fingerprint``: the model's, which keeps groups of different
  models apart;
- ``dht``: starting, serving (``diloco dht``) and stopping DHT peers; the rendezvous of groups at start;
- ``addresses``: multiaddrs to listen hosts, announced hosts and per-rank ports;
- ``progress``: the progress record each group publishes (schema, DHT key, publish, read) and which group holds
  the swarm's state; ``budget``: the round-token records of ``--hv.target-tokens``; ``status``: the status
  record onlookers read (``diloco status``), and ``monitor``, that command's table; ``peer``: one rank's
  ``SwarmPeer`` (DHT + averager + records);
- ``averager``: the swarm averager (rounds with whoever is ready, bit-identical results);
- ``codecs``: the ``--hv.compression`` wire formats on both transports;
- ``tcp`` and ``libp2p``: the two transports that carry a round's bytes; ``listener``: a rank's listening socket,
  and ``tunnel``: libp2p streams to and from it (``--hv.transport p2pd``);
- ``layout`` and ``group_round``: rounds of whole groups of any shape; ``transfer``: their state downloads,
  and ``digest``: the outer digest that is the same for one state in every shape;
- ``memory``: an in-memory stand-in for tests and benches.

Importing the package itself loads no hivemind (``join`` imports what it needs): ``progress``, ``status`` and
``memory`` are used without a network, and ``monitor`` loads hivemind only when it starts its client peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from diloco.config import HvConfig, OuterSetting
    from diloco.distenv import DistEnv
    from diloco.links import Group
    from diloco.membership import DiLoCo
    from diloco.swarm.fingerprint import ModelId
    from diloco.swarm.swarm_key import SwarmKey

log = logging.getLogger("diloco")

REQUEST_TIMEOUT_S = 5.0  # a ping, or one message of a state download
# seconds a connection for an unknown round waits at a rank that is in no round (a matchmaking split left it out):
# far longer than ranks of one group take to enter a round together, far shorter than --hv.averaging-timeout
IDLE_WAIT_S = 5.0


def join(
    hv: HvConfig,
    env: DistEnv,
    shards: list[torch.Tensor],
    group: Group,
    *,
    stop: Callable[[], bool],
    final_step: int | None,
    sharding: str = "",
    tokens_per_step: int = 0,
    model: ModelId | None = None,
    model_shapes: list[tuple[int, ...]],
    outer: OuterSetting,
    fragments: list[list[int]] | None = None,
    owner_key: Path | None = None,
) -> DiLoCo:
    """Collective over the ranks of this worker group: start this rank's DHT peer and listener (rank 0: also the
    averager that matchmakes for the group), claim the group's world rank, and wait (at most
    ``hv.averaging_timeout``) until the other groups are there. Returns the group's
    outer loop, which owns them all from then on (``close()`` stops them).

    Nothing is ever gathered to one rank. Groups average as wholes: one matchmaking per group (its rank 0), then
    every rank sends the parts of its shard to the ranks that reduce them, in whatever group and shape
    (``group_round``); groups of any number of ranks and any sharding average together. The bytes go over plain
    TCP (``--hv.transport tcp``) or as libp2p streams through each rank's p2pd daemon (``p2pd``: ``tunnel``); the
    groups of a run use one transport.

    :param hv: the swarm's settings (``Config.hv``).
    :param env: where this process sits in its group (its rank shifts fixed ports).
    :param shards: this rank's local parameter shards, in a fixed order.
    :param group: collectives over the ranks of this group.
    :param stop: true once the run was asked to stop.
    :param final_step: the run's last inner step (it always ends with an outer step).
    :param outer: the outer SGD's lr, momentum and lr warm-up (``Config.outer_setting``).
    :param sharding: the group's FSDP sharding strategy (``Config.sharding_strategy``), for its status record.
    :param tokens_per_step: tokens of one inner step of the group (all ranks): its weight under a token budget.
    :param model: the group's model fingerprint (``diloco.swarm.fingerprint``): groups of another model never
        meet this one (it is part of the matchmaking and progress keys), and one already training makes this
        group leave with a `FieldError` naming ``run_id``.
    :param model_shapes: every parameter's full shape, in the model's order (what ``shards`` are cut from).
    :param fragments: with ``hv.fragments`` > 1: each fragment's parameter indices (``diloco.fragments``).
    :param owner_key: rank 0: the file of the key that signs the group's DHT records (``ownership.Owner``: read
        when there, written once the group holds its world rank, so a resumed group keeps its records); None: a new
        key for this run, kept nowhere.
    :raises FieldError: bad input (an unreachable initial peer, a port in use, a world rank another running group
        holds, an overlap longer than the rounds under a token budget), naming the ``HvConfig`` field; nothing is
        left running.
    """
    import torch

    from diloco.fragments import local_runs
    from diloco.membership import DiLoCo
    from diloco.pace import FixedSteps, TokenBudget
    from diloco.swarm.addresses import offset_port
    from diloco.swarm.averager import SwarmAverager
    from diloco.swarm.budget import tokens_key
    from diloco.swarm.digest import CanonicalDigest
    from diloco.swarm.dht import rendezvous, start_dht
    from diloco.swarm.fingerprint import run_key, schedule
    from diloco.swarm.ownership import Owner
    from diloco.swarm.peer import SwarmPeer
    from diloco.swarm.progress import progress_key
    from diloco.swarm.status import status_key
    from diloco.swarm.swarm_key import SealedStore, SwarmKey

    hv.check_overlap(tokens_per_step)
    key = SwarmKey.load(hv.swarm_key) if hv.swarm_key is not None else None
    run_id = hv.run_id if key is None else key.run_id(hv.run_id)  # a keyed swarm's DHT keys: unknown to others
    owner = None  # rank 0 publishes the group's records, under its own key; the others only check everyone's
    if env.rank == 0:
        owner = Owner.load(owner_key) if owner_key is not None else Owner.ephemeral()
    dht = start_dht(
        initial_peers=hv.initial_peers,
        host_maddrs=[offset_port(m, env.local_rank) for m in hv.host_maddrs],
        announce_maddrs=[offset_port(m, env.local_rank) for m in hv.announce_maddrs],
        validator=None if owner is None else owner.validator,
    )
    run = run_key(run_id, model)
    # rank 0 matchmakes for its whole group under a key every shape shares (and one transport: their rounds travel
    # differently); rounds and states travel over the ranks' listeners, so the other ranks need no averager
    prefix = f"{run}-groups" + ("" if hv.transport == "tcp" else f"-{hv.transport}")
    port = hv.averaging_port + env.local_rank if hv.averaging_port else 0
    averager = None
    try:
        if env.rank == 0:
            averager = SwarmAverager(
                dht, prefix=prefix, tensors=[torch.zeros(1)], compression=hv.compression,
                matchmaking_time=hv.matchmaking_time, averaging_timeout=hv.averaging_timeout,
                target_group_size=hv.galaxy_size, transport=hv.transport, match_only=True,
            )  # fmt: skip
        rounds = group_rounds(hv, env, group, dht, averager, model_shapes, sharding, port, fragments, key)
    except BaseException:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
        raise
    records = dht if key is None else SealedStore(dht, key)  # records sealed with the key, and read only so
    peer = SwarmPeer(
        records, averager, progress_key(run), REQUEST_TIMEOUT_S,
        status_key=status_key(run_id), tokens_key=tokens_key(run_id), rounds=rounds, owner=owner,
    )  # fmt: skip
    try:
        if hv.target_tokens and final_step:  # a run of 0 steps has no round to pace
            pace = TokenBudget(
                peer, group, world_rank=hv.world_rank, target_tokens=hv.target_tokens / hv.fragments,
                galaxy_size=hv.galaxy_size, tokens_per_step=tokens_per_step, max_steps=final_step,
            )  # fmt: skip  (a fragment's round every N/F tokens)
        else:
            pace = FixedSteps(hv.local_steps // hv.fragments, final_step)  # a fragment's round every H/F steps
        outer = DiLoCo(
            shards,
            peer,
            group,
            world_rank=hv.world_rank,
            local_steps=hv.local_steps,
            outer_lr=outer.lr,
            outer_momentum=outer.momentum,
            outer_warmup=outer.warmup,
            stop=stop,
            join_timeout=hv.averaging_timeout,
            final_step=final_step,
            settle_timeout=hv.matchmaking_time + hv.averaging_timeout + 5,  # a group still in the last round
            sharding=sharding,
            transport=hv.transport,
            pace=pace,
            tokens_per_step=tokens_per_step,
            model=model,
            digest=CanonicalDigest(model_shapes, rounds.layout),
            fragments=[local_runs(f, [s.numel() for s in shards]) for f in fragments] if fragments else None,
            overlap_steps=hv.overlap_steps,
            overlap_mix=hv.overlap_mix,
            aggregation=hv.aggregation,
            schedule=schedule(final_step, hv.local_steps, hv.target_tokens if isinstance(pace, TokenBudget) else None,
                              tokens_per_step, hv.fragments, hv.overlap_steps),  # fmt: skip
        )
        outer.claim_world_rank()
        # groups start seconds apart (imports, data loading): meeting here first lets the first round find them all
        if group.is_main:  # rank 0 meets the other groups for its whole group
            seen = rendezvous(records, f"{prefix}-members", str(hv.world_rank), hv.galaxy_size, hv.averaging_timeout,
                              stop)  # fmt: skip
            log.info("found %d of %d worker groups in the swarm", seen, hv.galaxy_size)
            if owner is not None and owner_key is not None:
                owner.save(owner_key)
        group.broadcast(None)
    except BaseException:
        peer.shutdown()
        raise
    return outer


def group_rounds(hv: HvConfig, env: DistEnv, group: Group, dht: object, averager: object,
                 model_shapes: list[tuple[int, ...]], sharding: str, port: int,
                 fragments: list[list[int]] | None = None, key: SwarmKey | None = None):  # fmt: skip
    """Collective: this rank's listener (a TCP socket, or libp2p streams through a ``tunnel.Tunnel``), every rank's
    endpoint, and the replicas' process groups, for rounds of whole groups (``group_round.GroupRounds``). Rounds
    that overlap the inner steps (``hv.overlap_steps``) run on a thread of their own: their broadcast gets a process
    group of its own too, so it never interleaves with the model's collectives on the training thread."""
    from diloco.swarm import tcp
    from diloco.swarm.addresses import announced_hosts, listen_host
    from diloco.swarm.averager import listen
    from diloco.swarm.codecs import WIRE_FORMATS
    from diloco.swarm.group_round import GroupRounds, Replicas
    from diloco.swarm.layout import Shape
    from diloco.swarm.listener import Listener
    from diloco.swarm.tunnel import Tunnel

    shape = Shape(sharding or "FULL_SHARD", env.world_size, env.num_nodes)
    timeout = hv.averaging_timeout / 4  # as the per-rank way drops a silent groupmate
    over_tcp = hv.transport == "tcp"
    listening = listen(listen_host(hv.host_maddrs), port) if over_tcp else None
    listener = Listener(listening, timeout, registration_timeout=hv.averaging_timeout, idle_wait=IDLE_WAIT_S).start()
    tunnel = None
    try:
        if over_tcp:
            endpoint, connect = (announced_hosts(dht.get_visible_maddrs()), listening.getsockname()[1]), tcp.connect
        else:
            tunnel = Tunnel(dht, listener)
            endpoint, connect = ((tunnel.peer_id,), 0), tunnel.connect
        endpoints = group.gather(endpoint)
        replicas = Replicas(shape, env.rank) if env.world_size > 1 and shape.grid()[1] > 1 else None
        broadcast = group.broadcast
        if hv.overlap_steps and env.world_size > 1:
            broadcast = side_broadcast()
    except BaseException:
        if tunnel is not None:
            tunnel.close()
        listener.close()
        raise
    return GroupRounds(
        averager if env.rank == 0 else None, rank=env.rank, shape=shape, model_shapes=model_shapes,
        endpoints=endpoints, broadcast=broadcast, listener=listener, codec=WIRE_FORMATS[hv.compression].tcp,
        timeout=timeout, replicas=replicas, transport=hv.transport, connect=connect, tunnel=tunnel,
        fragments=fragments, aggregation=hv.aggregation, key=key,
    )  # fmt: skip


def side_broadcast() -> Callable[[object], object]:
    """Collective over the group's ranks: a broadcast of rank 0's object over a gloo process group of its own."""
    import functools

    import torch.distributed as dist

    from diloco import parallel

    return functools.partial(parallel.broadcast_object, group=dist.new_group(backend="gloo"))
