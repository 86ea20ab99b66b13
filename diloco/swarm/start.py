"""Starting one trainer rank's side of the swarm: its DHT peer, its listener, rank 0's matchmaker, the rounds of whole
groups, and the ``SwarmPeer`` that owns them all.

Collective over the ranks of one worker group (every rank calls ``start_peer`` together). Nothing is ever gathered to
one rank: groups average as wholes, one matchmaking per group (its rank 0), then every rank sends the parts of its
shard to the ranks that reduce them, in whatever group and shape (``rounds.group_round``). The bytes go over plain
TCP, per pair of ranks dialled directly, opened by the rank behind a router, or through a relay; a rank that prefers
libp2p streams (``--hv.transport p2pd``) and can be dialled takes them as well (``rounds.tunnel``), and two such
ranks use them. Groups of any preference share a run.

Each rank makes a signing key of its own once (``group_rounds``); rank 0 announces every rank's public key with the
group in matchmaking, and a rank's round connections are signed with it (``rounds.hello``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.swarm.records.arrivals import default_wait, wait_cap

if TYPE_CHECKING:
    from diloco.config import HvConfig
    from diloco.distenv import DistEnv
    from diloco.swarm.peer import SwarmPeer
    from diloco.swarm.records.fingerprint import ModelId
    from diloco.swarm.records.swarm_key import SwarmKey
    from diloco.swarm.rounds.group_round import GroupRounds

log = logging.getLogger("diloco")

REQUEST_TIMEOUT_S = 5.0  # a ping, or one message of a state download
# seconds a connection for an unknown round waits at a rank that is in no round (a matchmaking split left it out):
# far longer than ranks of one group take to enter a round together, far shorter than --hv.averaging-timeout
IDLE_WAIT_S = 5.0


def start_peer(
    hv: HvConfig,
    env: DistEnv,
    *,
    gather: Callable[[Any], list[Any]],
    broadcast: Callable[[Any], Any],
    side_broadcast: Callable[[], Callable[[Any], Any]],
    model: ModelId | None,
    model_shapes: Sequence[tuple[int, ...]],
    sharding: str,
    fragments: list[list[int]] | None = None,
    owner_key: Path | None = None,
    final_step: int | None = None,
) -> SwarmPeer:
    """Collective: this rank's DHT peer, listener and rounds (rank 0: also the matchmaker for the group and the key
    that signs the group's records).

    :param hv: the swarm's settings (``Config.hv``).
    :param env: where this process sits in its group (its rank shifts fixed ports).
    :param gather: every rank's object on every rank; ``broadcast``: rank 0's object on every rank (the group's
        collectives).
    :param side_broadcast: makes a broadcast over a process group of its own (collective), for rounds that overlap
        the inner steps (``hv.overlap_steps``): they run on a thread of their own, and must not interleave with the
        model's collectives on the training thread.
    :param model: the group's model fingerprint: groups of another model never meet this one (it is part of the
        matchmaking and progress keys).
    :param model_shapes: every parameter's full shape, in the model's order (what the rank's shards are cut from).
    :param sharding: the group's sharding strategy (its shape in rounds and records).
    :param fragments: with ``hv.fragments`` > 1: each fragment's parameter indices (``diloco.outer.fragments``).
    :param owner_key: rank 0: the file of the key that signs the group's DHT records (``ownership.Owner``: read
        when there; ``SwarmPeer.save_owner`` writes it once the group holds its world rank); None: a new key for
        this run, kept nowhere.
    :param final_step: the run's last inner step (its round is the last; the others wait longer for it).
    :raises FieldError: bad input (an unreachable initial peer, a port in use), naming the ``HvConfig`` field; nothing
        is left running.
    """
    from diloco.swarm.peer import SwarmPeer
    from diloco.swarm.records.addresses import offset_port
    from diloco.swarm.records.budget import tokens_key
    from diloco.swarm.records.dht import start_dht
    from diloco.swarm.records.fingerprint import run_key
    from diloco.swarm.records.ownership import Owner
    from diloco.swarm.records.progress import progress_key
    from diloco.swarm.records.status import status_key
    from diloco.swarm.records.swarm_key import SealedStore, SwarmKey
    from diloco.swarm.rounds.deadline import fixed_timeout
    from diloco.swarm.rounds.matchmaker import Matchmaker

    key = SwarmKey.load(hv.swarm_key) if hv.swarm_key is not None else None
    run_id = hv.run_id if key is None else key.run_id(hv.run_id)  # a keyed swarm's DHT keys: unknown to others
    owner = None  # rank 0 publishes the group's records, under its own key; the others only check everyone's
    if env.rank == 0:
        owner = Owner.load(owner_key) if owner_key is not None else Owner.ephemeral()
    join_dht = partial(
        start_dht,
        initial_peers=hv.initial_peers,
        host_maddrs=[offset_port(m, env.local_rank) for m in hv.host_maddrs],
        announce_maddrs=[offset_port(m, env.local_rank) for m in hv.announce_maddrs],
        validator=None if owner is None else owner.validator,
    )
    dht = join_dht()
    run = run_key(run_id, model)
    # rank 0 matchmakes for its whole group under a key every shape and transport preference shares; rounds and
    # states travel over the ranks' listeners, so the other ranks need no matchmaker
    prefix = f"{run}-groups"
    port = hv.averaging_port + env.local_rank if hv.averaging_port else 0
    matchmaker = door = None
    try:
        door = open_door(hv, env, dht, port)
        if door.dht_maddrs is not None:  # rank 0 at a relay: its DHT peer is dialled there too, so it may lead
            dht.shutdown()
            dht = join_dht(host_maddrs=door.dht_maddrs[0], announce_maddrs=door.dht_maddrs[1])
        elif not door.reach.dialable or door.lease is not None:
            # a DHT peer nobody can dial would stay in the others' routing tables (each of its requests puts it back)
            # and cost their lookups a timeout each: it rejoins as a client, which asks and stores but serves nothing
            dht.shutdown()
            dht = join_dht(client_mode=True)
        if env.rank == 0:  # a group whose rank 0 cannot be dialled never leads a matchmaking: it joins the others'
            matchmaker = Matchmaker(dht, prefix=prefix, matchmaking_time=default_wait(hv.matchmaking_time),
                                    averaging_timeout=fixed_timeout(hv.averaging_timeout),
                                    target_group_size=hv.galaxy_size,
                                    client_mode=not door.reach.dialable)  # fmt: skip
        rounds = group_rounds(hv, env, gather, broadcast, side_broadcast, door, matchmaker, model_shapes, sharding,
                              fragments, key, model.fingerprint if model else "")  # fmt: skip
    except BaseException:
        if matchmaker is not None:
            matchmaker.shutdown()
        if door is not None:
            door.close()
        dht.shutdown()
        raise
    records = dht if key is None else SealedStore(dht, key)  # records sealed with the key, and read only so
    return SwarmPeer(
        records, matchmaker, progress_key(run), REQUEST_TIMEOUT_S, status_key=status_key(run_id),
        tokens_key=tokens_key(run_id), rounds=rounds, owner=owner, members_key=f"{prefix}-members",
        round_steps=None if hv.token_paced() else hv.local_steps // hv.fragments,
        wait_cap=wait_cap(hv.matchmaking_time), final_step=final_step,
    )  # fmt: skip


@dataclass(frozen=True)
class Door:
    """How others reach this rank: its listener, its TCP endpoint ``([hosts], port)``, how it reaches theirs
    (`connect`), the `tunnel` that brings it libp2p streams too (None: it takes none), whether it can be dialled
    (`reach`, ``rounds.reachability``), and for a rank dialled through a relay its ports there (`lease`,
    ``relay.lease.Lease``) and, for rank 0, the multiaddrs its DHT peer restarts with to be dialled there too
    (`dht_maddrs`: host, announce)."""

    listener: Any
    endpoint: tuple[tuple[str, ...], int]
    connect: Callable[..., Any]
    tunnel: Any
    reach: Any
    lease: Any = None
    dht_maddrs: tuple[list[str], list[str]] | None = None

    @property
    def p2p(self) -> str:
        """The libp2p peer id at which this rank takes streams as well ("": it does not)."""
        return self.tunnel.peer_id if self.tunnel is not None else ""

    def close(self) -> None:
        from diloco.swarm.rounds.listener import close_with_tunnel

        try:
            close_with_tunnel(self.listener, self.tunnel)
        finally:
            if self.lease is not None:
                self.lease.close()


def open_door(hv: HvConfig, env: DistEnv, dht: Any, port: int) -> Door:
    """This rank's listener (a TCP socket on `port`) and whether others can dial it: an initial peer dials it back
    (``rounds.reachability``). A rank found ``direct`` dials others back from then on too; one found ``outbound
    only`` leases ports at a relay when one is offered, or says so, once. With ``--hv.transport p2pd`` a rank that
    can be dialled takes libp2p streams too (a ``tunnel.Tunnel`` into the same listener)."""
    from diloco.swarm.records.addresses import announced_hosts, listen_host
    from diloco.swarm.rounds import reachability, tcp
    from diloco.swarm.rounds.deadline import fixed_timeout
    from diloco.swarm.rounds.listener import Listener, listen

    fixed = fixed_timeout(hv.averaging_timeout)
    timeout = fixed / tcp.ROUND_STEPS  # a step of a round under a fixed --hv.averaging-timeout, and a hello's wait
    listening = listen(listen_host(hv.host_maddrs), port)
    listener = Listener(listening, timeout, registration_timeout=fixed, idle_wait=IDLE_WAIT_S).start()
    endpoint = (tuple(announced_hosts(dht.get_visible_maddrs())), listening.getsockname()[1])
    try:
        probes = reachability.Probes()
        listener.serve(reachability.MAGIC, probes)
        reach = reachability.check(dht, reachability.peer_ids(hv.initial_peers), endpoint, probes)
        if reach.kind == reachability.DIRECT:
            reachability.serve(dht)
        if reach.kind == reachability.OUTBOUND and reach.relay is not None:
            relayed = _at_relay(hv, env, dht, listener, probes, reach)
            if relayed is not None:
                lease, reach, endpoint, dht_maddrs = relayed
                _say_reach(reach, env.rank, False)
                return Door(listener, endpoint, connect_over(None), None, reach, lease, dht_maddrs)
        _say_reach(reach, env.rank, bool(hv.announce_maddrs))
        tunnel = None
        if hv.transport == "p2pd" and reach.kind in (reachability.DIRECT, reachability.UNCHECKED):
            from diloco.swarm.rounds.tunnel import Tunnel

            tunnel = Tunnel(dht, listener)  # (its DHT peer stays as it is: only an undialable one restarts)
    except BaseException:
        listener.close()
        raise
    return Door(listener, endpoint, connect_over(tunnel), tunnel, reach)


def connect_over(tunnel: Any) -> Callable[..., Any]:
    """How this rank dials an endpoint: TCP ``([hosts], port)``, or with a `tunnel` a libp2p peer id
    ``((peer id,), 0)``."""
    from diloco.swarm.rounds import tcp

    if tunnel is None:
        return tcp.connect

    def connect(endpoint: Any, timeout: float, handshake: Any = None) -> Any:
        return (tunnel.connect if endpoint[1] == 0 else tcp.connect)(endpoint, timeout, handshake)

    return connect


def _at_relay(hv: HvConfig, env: DistEnv, dht: Any, listener: Any, probes: Any, reach: Any) -> tuple | None:
    """For a rank nobody can dial, whose dial-back peer offers a relay: ports leased at the relay (its listener's,
    and rank 0's DHT peer's), checked as the rank's own were (the peer dials the leased port back). Returns (the
    lease, the new reach, the endpoint at the relay, rank 0's DHT multiaddrs or None), or None (said why) when the
    relay leases nothing or cannot be dialled back: the rank then dials out only."""
    from diloco.swarm.relay.lease import Lease, forward_to
    from diloco.swarm.rounds import reachability

    peer, control_port = reach.relay
    hosts = reachability.hosts_of(hv.initial_peers, peer)
    dht_port = _free_port() if env.rank == 0 else None
    targets = [listener.handle] + ([forward_to(dht_port)] if dht_port is not None else [])
    try:
        lease = Lease((hosts, control_port), targets)
    except ConnectionError as e:
        log.warning("rank %d cannot be dialled, and the relay of peer %s leased it no port (%s)", env.rank,
                    peer[-8:], e)  # fmt: skip
        return None
    endpoint = ((lease.host,), lease.ports[0])
    verdict = reachability.check(dht, [peer], endpoint, probes)
    if verdict.kind != reachability.DIRECT:
        lease.close()
        log.warning("rank %d cannot be dialled, and peer %s could not dial it at its relay either (%s)", env.rank,
                    peer[-8:], verdict.detail)  # fmt: skip
        return None
    relayed = reachability.Reach(reachability.RELAYED, f"at {lease.host} port {lease.ports[0]}, leased from the "
                                 f"relay of peer {peer[-8:]}; {reach.detail}")  # fmt: skip
    dht_maddrs = None
    if dht_port is not None:
        dht_maddrs = ([f"/ip4/0.0.0.0/tcp/{dht_port}"], [f"/ip4/{lease.host}/tcp/{lease.ports[1]}"])
    return lease, relayed, endpoint, dht_maddrs


def _free_port() -> int:
    """A TCP port free on this machine now (for a daemon started right after)."""
    import socket

    with socket.create_server(("0.0.0.0", 0)) as probe:
        return int(probe.getsockname()[1])


def _say_reach(reach: Any, rank: int, announced: bool) -> None:
    from diloco.swarm.rounds.reachability import DIRECT, OUTBOUND, RELAYED

    say = log.info if rank == 0 else log.debug  # (every rank of a group sits on one network, as a rule)
    if reach.kind == DIRECT:
        say("rank %d can be dialled: direct (%s)", rank, reach.detail)
    elif reach.kind == RELAYED:
        say("rank %d can be dialled through a relay: relayed (%s)", rank, reach.detail)
    elif reach.kind != OUTBOUND:
        say("rank %d: whether others can dial it is unchecked (%s); they will try", rank, reach.detail)
    elif announced:
        log.warning("--hv.announce-maddrs: nobody can dial this rank at the addresses announced (%s); it dials out "
                    "only (outbound only: it reduces nothing and serves no state)", reach.detail)  # fmt: skip
    else:
        log.warning("rank %d cannot be dialled (%s): it dials out only, as behind a home router (outbound only: it "
                    "reduces nothing and serves no state)", rank, reach.detail)  # fmt: skip


def group_rounds(hv: HvConfig, env: DistEnv, gather: Callable[[Any], list[Any]], broadcast: Callable[[Any], Any],
                 side_broadcast: Callable[[], Callable[[Any], Any]], door: Door, matchmaker: object,
                 model_shapes: Sequence[tuple[int, ...]], sharding: str,
                 fragments: list[list[int]] | None = None, key: SwarmKey | None = None,
                 model: str = "") -> GroupRounds:  # fmt: skip
    """Collective: this rank's signing key (made here, once per process), every rank's endpoint, public key and
    whether it can be dialled, and the replicas' process groups, for rounds of whole groups
    (``group_round.GroupRounds``) over `door` (``open_door``) of the model of fingerprint `model` ("": unknown).
    Rank 0 keeps the deadlines of the group's rounds (``rounds.deadline``: with ``--hv.averaging-timeout auto``
    they follow its recent rounds); a connection's hello and its wait for its round take the setting's fixed
    value."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from diloco.swarm.rounds import tcp
    from diloco.swarm.rounds.codecs import rounds_codec
    from diloco.swarm.rounds.deadline import Deadlines, fixed_timeout
    from diloco.swarm.rounds.group_round import GroupRounds, Replicas
    from diloco.swarm.rounds.hello import public_bytes
    from diloco.swarm.rounds.layout import Shape

    shape = Shape(sharding or "FULL_SHARD", env.world_size, env.num_nodes)
    timeout = fixed_timeout(hv.averaging_timeout) / tcp.ROUND_STEPS
    signer = Ed25519PrivateKey.generate()
    endpoints, public_keys, dialable, relayed, p2p = zip(*gather((door.endpoint, public_bytes(signer),
                                                                  door.reach.dialable, door.lease is not None,
                                                                  door.p2p)))  # fmt: skip
    replicas = Replicas(shape, env.rank) if env.world_size > 1 and shape.grid()[1] > 1 else None
    if hv.overlap_steps and env.world_size > 1:  # (after the replicas' groups: every rank makes them in one order)
        broadcast = side_broadcast()
    return GroupRounds(
        matchmaker if env.rank == 0 else None, rank=env.rank, shape=shape, model_shapes=model_shapes,
        endpoints=endpoints, broadcast=broadcast, listener=door.listener, codec=rounds_codec(hv),
        timeout=timeout, replicas=replicas, connect=door.connect, tunnel=door.tunnel,
        dialable=dialable, reach=door.reach.kind, relayed=relayed, p2p=p2p,
        fragments=fragments, aggregation=hv.aggregation, key=key, signer=signer, public_keys=public_keys, model=model,
        deadlines=Deadlines(hv.averaging_timeout) if env.rank == 0 else None,
    )  # fmt: skip
