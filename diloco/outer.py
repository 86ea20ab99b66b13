"""The outer loop that wraps the inner training step. With galaxy size 1 it does nothing."""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from diloco.butterfly import all_finite
from diloco.catchup import Progress, sources
from diloco.config import UsageError

log = logging.getLogger("diloco")


class JoinError(RuntimeError):
    """This group could not take its place in the swarm (e.g. no live group ahead of it sent its state)."""


class OuterLoop(Protocol):
    """Called by the training loop after every inner step; owns whatever happens between worker groups."""

    def join(self, step: int, load_from_peers: bool = True) -> tuple[int, dict[str, Any] | None]:
        """Before the first inner step: take this group's place among the others. Returns the inner step to
        continue from (a group that joins a running swarm continues at the swarm's) and the metrics row of the
        round it joined, if it joined one in progress."""
        ...

    def after_inner_step(self, step: int) -> dict[str, Any] | None:
        """Run the outer step when one is due; return its metrics row, or None. The row's "step" is the inner
        step to continue from: a group that was behind the swarm jumps to the swarm's."""
        ...

    def finish(self) -> dict[str, Any] | None:
        """After the last inner step of a run that was not stopped: end with the swarm's final state; return a
        metrics row when that changed the model, else None."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def summary(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class NoOuter:
    """Galaxy size 1: plain torch.distributed training, no DHT, no averaging."""

    def join(self, step: int, load_from_peers: bool = True) -> tuple[int, dict[str, Any] | None]:
        return step, None

    def after_inner_step(self, step: int) -> dict[str, Any] | None:
        return None

    def finish(self) -> dict[str, Any] | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class RoundResult(Protocol):
    """What one averaging round reports (see swarm.RoundReport)."""

    num_peers: int  # worker groups in the round, this one included; 1 = averaged alone
    seconds: float
    bytes_sent: int
    bytes_received: int
    ok: bool  # False: the round failed (or was stopped) and the tensors were left as they were
    rejected: int  # contributions of other groups this rank rejected (non-finite, or an outlier norm)


State = tuple[dict[str, Any], list[torch.Tensor]]  # (small metadata, tensors) of one rank's outer state


class Swarm(Protocol):
    """This rank's link to the same-indexed rank of the other worker groups (see swarm.SwarmPeer)."""

    peer_id: str  # this rank's peer id; others download this rank's state from it

    def average(
        self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: Callable[[], bool]
    ) -> RoundResult:
        """Average in place with the groups averaging the same `round_index`; gives up when `stop()` is true."""
        ...

    def publish(self, record: Progress) -> None:
        """Store this group's progress record (rank 0 calls it)."""
        ...

    def records(self) -> list[Progress]:
        """Every group's latest progress record."""
        ...

    def alive(self, peer_id: str) -> bool:
        """Whether the peer answers now."""
        ...

    def serve_state(self, provider: Callable[[], State]) -> None:
        """Start answering state downloads of other groups with `provider()`."""
        ...

    def download_state(self, peer_id: str) -> State | None:
        """One rank's outer state from the peer, or None when it does not answer or sends none."""
        ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class Group:
    """Collectives over the ranks of this worker group (torch.distributed in training, plain calls in tests)."""

    rank: int
    sum: Callable[[float], float]
    gather: Callable[[Any], list[Any]]  # every rank's object, in rank order, on every rank
    broadcast: Callable[[Any], Any]  # rank 0's object on every rank
    sha: Callable[[], str | None]  # params_sha256 of the whole model on rank 0, None elsewhere

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def solo_group(sha: Callable[[], str | None] = lambda: None) -> Group:
    """A worker group of one rank (tests, and single-process workers)."""
    return Group(rank=0, sum=lambda v: v, gather=lambda o: [o], broadcast=lambda o: o, sha=sha)


class DiLoCo:
    """The DiLoCo outer step over this rank's shard of the model, in plain torch, and the group's place in
    the swarm.

    Every `local_steps` inner steps, and after the run's last one: pseudo-gradient = outer parameters − current
    parameters (this rank's shard, flattened, float32 on CPU); averaged with the same rank of the other groups; an outer SGD step with
    Nesterov momentum on the outer parameters, which stay off the accelerator; the model's shard is reset to
    the new outer parameters. The inner optimizer and its state are not touched.

    Before its first inner step and before each round, the group compares its progress with the other
    groups' (see `catchup`) and downloads the outer state (parameters, momentum, outer step, and on joining
    the inner step count) from a group that is ahead or holds the swarm's state, so late joiners, resumed
    groups and groups whose round failed end bit-identical with the others. After the last inner step every
    group waits (at most `settle_timeout`) until the live groups hold one final state, so all export one model.

    :param shards: this rank's local parameter shards, in a fixed order (the same in every group).
    :param swarm: carries the bytes; never imported here, so this module knows nothing of hivemind.
    :param group: collectives over the ranks of this group.
    :param world_rank: this group's --hv.world-rank.
    :param local_steps: H, inner steps between outer steps.
    :param outer_lr: outer SGD learning rate (the paper: 0.7).
    :param outer_momentum: Nesterov momentum of the outer SGD (the paper: 0.9); 0 means plain SGD.
    :param stop: true once the run was asked to stop; an averaging round then gives up.
    :param join_timeout: seconds a joining group keeps trying to download the state from live peers before it
        gives up (it never starts from its own state while peers with a state are alive).
    :param final_step: the run's last inner step (--max-steps); it ends with an outer step even when it is not
        a multiple of `local_steps`, so no inner step is left out of the final model. None: no last step.
    :param settle_timeout: seconds a finished group waits for live groups that do not hold its final state yet
        (one still in its last round, or one whose last round failed and must download).
    """

    def __init__(
        self,
        shards: list[torch.Tensor],
        swarm: Swarm,
        group: Group,
        *,
        world_rank: int,
        local_steps: int,
        outer_lr: float,
        outer_momentum: float,
        stop: Callable[[], bool] = lambda: False,
        join_timeout: float = 60.0,
        final_step: int | None = None,
        settle_timeout: float = 30.0,
    ) -> None:
        self.shards = [s for s in shards if s.numel() > 0]  # FSDP can leave a rank an empty shard
        self.swarm, self.group, self.world_rank = swarm, group, world_rank
        self.local_steps, self.stop, self.join_timeout = local_steps, stop, join_timeout
        self.final_step, self.settle_timeout = final_step, settle_timeout
        self.outer = self._flat_shards()
        self.optimizer = torch.optim.SGD(
            [self.outer], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
        )
        self.outer_step = 0
        self.step = 0  # inner steps done, as last seen; served with the state
        self.tainted = False
        self.settled = False
        self.done = False
        self.loaded_from_peers = False
        self.downloads = 0
        self.loaded_from: int | None = None  # world rank of the group whose state was loaded last
        self.last_sha: str | None = None
        self._lock = threading.Lock()  # the state is served from a background thread
        self.token = group.broadcast(uuid.uuid4().hex)
        self.peers = tuple(group.gather(swarm.peer_id))
        self.shard_digest = self.digest = ""
        self._update_digest()

    # ------------------------------------------------------------------ joining the swarm

    def join(self, step: int, load_from_peers: bool = True) -> tuple[int, dict[str, Any] | None]:
        """Before the first inner step (collective): load the swarm's state when another group is ahead, then
        serve this group's state to others. Returns the inner step to continue from and the row of the round
        in progress it took part in, if any."""
        self.step, row = step, None
        if load_from_peers:
            loaded = self._load_on_join()
            if loaded is not None:
                self.step = step = loaded
                if self._in_round(step):  # the swarm is averaging right now: take part, adding no weight
                    zeros = torch.zeros_like(self.outer)
                    row = self._average_and_apply(step, zeros, weight=0.0, source=self.loaded_from)
        elif self.group.is_main:
            log.info("--hv.skip-load-from-peers: starting from this group's own state")
        self.settled = True
        self.swarm.serve_state(self._current_state)
        self._publish()
        return step, row

    def _boundary(self, step: int) -> bool:
        """Whether an outer step follows inner step `step`."""
        return step % self.local_steps == 0 or step == self.final_step

    def _round(self, step: int) -> int:
        """Index of the round after inner step `step`: the same in every group (a last, shorter round after a
        final step that is not a multiple of H gets the next index)."""
        return -(-step // self.local_steps)

    def _in_round(self, step: int) -> bool:
        """Whether a group at inner step `step` with this outer step is in the round of that boundary."""
        return self._boundary(step) and self._round(step) > self.outer_step

    def claim_world_rank(self) -> None:
        """Collective, before anything is written: two running groups with one world rank would train on one
        data shard and overwrite each other's progress record, so the later one leaves (UsageError)."""
        verdict = None
        if self.group.is_main:
            verdict = self._rival()
            if verdict is None:
                self._publish()
                time.sleep(1.0)  # a group starting at the same moment: the later record wins, the other leaves
                verdict = self._rival()
        verdict = self.group.broadcast(verdict)
        if verdict is not None:
            raise UsageError(
                f"--hv.world-rank {self.world_rank} is taken by a running worker group (peer {verdict}); "
                "give each group its own world rank"
            )
        if self.group.is_main:
            log.info("worker group %d joined the swarm as peer %s", self.world_rank, self.peers[0])

    def _rival(self) -> str | None:
        """Peer id of another live group holding this world rank, if any."""
        for record in self.swarm.records():
            if record.world_rank == self.world_rank and record.token != self.token and record.peers:
                if self.swarm.alive(record.peers[0]):
                    return record.peers[0]
        return None

    def _load_on_join(self) -> int | None:
        """Load the state of a group that is ahead, if any. Returns the inner step to continue from, or None
        when this group is the first or the furthest (its own state is the swarm's)."""
        deadline = time.monotonic() + self.join_timeout
        seen: list[list[Progress]] = []  # the last non-empty plan of this join
        while True:
            plan, expired, stopped = self.group.broadcast(
                (self._plan(), time.monotonic() > deadline, self.stop()) if self.group.is_main else None
            )
            if stopped:
                return None  # the run stops after its first step and checkpoints this group's own state
            if not plan and not seen:
                if self.group.is_main:
                    log.info("no worker group is ahead of this one: starting from this group's own state")
                return None
            # groups seen ahead that vanish (a DHT read that came back empty, pings lost under load) are not
            # proof that this group is the first: keep trying them until the deadline
            seen = plan or seen
            loaded = self._load_from(seen)
            if loaded is not None:
                return loaded
            if expired:
                raise JoinError(
                    f"could not download the swarm's state from {sum(map(len, seen))} live worker group(s) within "
                    f"{self.join_timeout:.0f} s; not starting from this group's own state, which would overwrite "
                    "a trained swarm"
                )
            time.sleep(1.0)

    # ------------------------------------------------------------------ the outer step

    def _flat_shards(self) -> torch.Tensor:
        return torch.cat([s.detach().reshape(-1).to("cpu", torch.float32) for s in self.shards])

    def after_inner_step(self, step: int) -> dict[str, Any] | None:
        self.step = step
        if not self._boundary(step):
            return None
        pseudo_gradient = self.outer - self._flat_shards()
        if self.group.sum(0.0 if all_finite(pseudo_gradient) else 1.0):
            raise FloatingPointError(
                f"the pseudo-gradient holds NaN/Inf at step {step}: stopping this group before it averages"
            )
        outer_before, source = self.outer_step, None
        plan = self.group.broadcast(self._plan() if self.group.is_main else None)
        if plan and (loaded := self._load_from(plan)) is not None:
            source = self.loaded_from
            if self.outer_step > outer_before:  # it was behind: go on where the swarm is
                self.step = step = loaded
                if not self._in_round(step):
                    return self._row(step, source=source)
        if self.outer_step == outer_before:
            return self._average_and_apply(step, pseudo_gradient, 1.0, source)
        # a group that was behind brings nothing current: it takes the others' average and adds nothing (zeros,
        # not its stale pseudo-gradient, which reducers could rightly reject as an outlier)
        return self._average_and_apply(step, pseudo_gradient.zero_(), 0.0, source)

    def _average_and_apply(
        self, step: int, pseudo_gradient: torch.Tensor, weight: float, source: int | None
    ) -> dict[str, Any] | None:
        """Collective: the round of boundary `step`, then the outer step. None when stopped during the round."""
        log.info("outer step %d: averaging (round %d)", self.outer_step + 1, self._round(step))
        report = self.swarm.average([pseudo_gradient], round_index=self._round(step), weight=weight, stop=self.stop)
        if self.group.sum(1.0 if self.stop() else 0.0):
            log.warning("outer step %d: stopped during averaging; not applied", self.outer_step + 1)
            return None
        ranks = len(self.peers)  # one peer id per rank of this group
        all_ok = self.group.sum(1.0 if report.ok else 0.0) == ranks
        num_peers = report.num_peers if all_ok else 0
        if all_ok and self.group.sum(float(num_peers)) != num_peers * ranks:
            log.warning("outer step %d: the ranks of this group averaged with different peers", self.outer_step + 1)
            all_ok, num_peers = False, 0
        if all_ok and num_peers > 1:
            self.apply(pseudo_gradient)
            self.tainted = False
        elif all_ok and weight:  # as the paper does: a group that found nobody applies its own pseudo-gradient
            log.warning("outer step %d: no peer was ready, applying this group's own pseudo-gradient", self.outer_step + 1)
            self.apply(pseudo_gradient)
            self.tainted = True
        else:  # the outer parameters stay the swarm's; the inner progress carries over into the next round
            log.warning(
                "outer step %d: %s; nothing applied, the inner steps carry over to the next round",
                self.outer_step + 1, "averaging failed" if not all_ok else "missed the swarm's round",
            )  # fmt: skip
        self._update_digest()
        self._publish()
        return self._row(step, source=source, report=report, num_peers=num_peers, pseudo_gradient=pseudo_gradient)

    def _row(
        self,
        step: int,
        *,
        source: int | None,
        report: RoundResult | None = None,
        num_peers: int = 0,
        pseudo_gradient: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        self.last_sha = self.group.sha()
        # outer_digest: sha256 over the ranks' outer shards, equal in groups that share the swarm's state (the
        # model itself differs after a round that applied nothing, until the next one)
        row: dict[str, Any] = {"step": step, "outer_step": self.outer_step, "outer_digest": self.digest}
        if source is not None:
            row["loaded_state_from"] = source  # world rank of the group this one downloaded the state from
        if report is not None and pseudo_gradient is not None:
            row |= {
                "num_peers": num_peers,
                "averaging_s": report.seconds,
                "bytes_sent": int(self.group.sum(float(report.bytes_sent))),  # all ranks of the group
                "bytes_received": int(self.group.sum(float(report.bytes_received))),
                "rejected": int(self.group.sum(float(getattr(report, "rejected", 0)))),
                "pseudo_grad_norm": math.sqrt(self.group.sum(float(pseudo_gradient.square().sum()))),
            }
            if getattr(report, "transport", ""):
                row["transport"] = report.transport  # what carried this rank's bytes: tcp or p2pd
        row["params_sha256"] = self.last_sha
        return row

    @torch.no_grad()
    def apply(self, pseudo_gradient: torch.Tensor) -> None:
        """Outer optimizer step with the averaged pseudo-gradient, then reset the shards to the outer params."""
        with self._lock:
            self.outer.grad = pseudo_gradient
            self.optimizer.step()
            self.outer.grad = None
            self._reset_shards()
            self.outer_step += 1

    @torch.no_grad()
    def _reset_shards(self) -> None:
        offset = 0
        for shard in self.shards:
            shard.copy_(self.outer[offset : offset + shard.numel()].view_as(shard))
            offset += shard.numel()

    # ------------------------------------------------------------------ progress and state transfer

    def _update_digest(self) -> None:
        """Collective: this rank's shard digest, and the group's digest over all ranks' shards."""
        with self._lock:
            self.shard_digest = hashlib.sha256(memoryview(self.outer.numpy())).hexdigest()
        self.digest = hashlib.sha256("".join(self.group.gather(self.shard_digest)).encode()).hexdigest()

    def _record(self) -> Progress:
        return Progress(
            world_rank=self.world_rank,
            outer_step=self.outer_step,
            step=self.step,
            digest=self.digest,
            tainted=self.tainted,
            settled=self.settled,
            token=self.token,
            peers=self.peers,
            done=self.done,
        )

    def _publish(self) -> None:
        if self.group.is_main:
            self.swarm.publish(self._record())

    def _plan(self) -> list[list[Progress]]:
        """Rank 0: the states to load, best first (see catchup.sources)."""
        return sources(self.swarm.records(), self._record(), lambda r: self.swarm.alive(r.peers[0]))

    def _current_state(self) -> State:
        """This rank's outer state as served to other groups (called from the swarm's background thread)."""
        with self._lock:
            meta = {
                "outer_step": self.outer_step,
                "step": self.step,
                "shard_digest": self.shard_digest,
                "tainted": self.tainted,
                "world_rank": self.world_rank,
            }
            tensors = [self.outer.clone()]
            momentum = self.optimizer.state.get(self.outer, {}).get("momentum_buffer")
            if momentum is not None:
                tensors.append(momentum.clone())
        return meta, tensors

    def _load_from(self, plan: list[list[Progress]]) -> int | None:
        """Collective: download the outer state from the first group of `plan` that sends every rank the same
        outer step. Returns the inner step to continue from, or None when no group could."""
        outer_before = self.outer_step
        for holders in plan:
            for record in holders:
                got = self.swarm.download_state(record.peers[self.group.rank]) if self.group.rank < len(record.peers) else None
                meta = self._valid(got)
                seen = self.group.gather(None if meta is None else (meta["outer_step"], meta["step"]))
                if any(s is None for s in seen) or len(set(seen)) != 1:
                    if self.group.is_main:
                        log.warning("could not load the state of worker group %d; trying the next", record.world_rank)
                    continue
                self._load(*got)
                self.loaded_from = record.world_rank
                if self.group.is_main:
                    log.info(
                        "loaded the outer state of worker group %d: outer step %d, inner step %d",
                        record.world_rank, meta["outer_step"], meta["step"],
                    )  # fmt: skip
                # a group that was behind adopts the inner step count; one that diverged at the same outer step
                # keeps its own (it did the same number of inner steps). Never backwards: a source that finished
                # the round this group failed may not have reached this group's next boundary yet
                return max(meta["step"], self.step) if meta["outer_step"] > outer_before else self.step
        return None

    def _valid(self, got: State | None) -> dict[str, Any] | None:
        """The metadata of a downloaded state that fits this rank's shard and arrived intact, else None."""
        if got is None:
            return None
        meta, tensors = got
        try:
            outer = tensors[0]
            fits = outer.dtype == torch.float32 and outer.numel() == self.outer.numel() and len(tensors) <= 2
            fits = fits and all(t.shape == outer.shape for t in tensors)
            intact = hashlib.sha256(memoryview(outer.contiguous().numpy())).hexdigest() == meta["shard_digest"]
            return meta if fits and intact and isinstance(meta["outer_step"], int) else None
        except (IndexError, KeyError, TypeError, AttributeError):
            return None

    @torch.no_grad()
    def _load(self, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        with self._lock:
            self.outer.copy_(tensors[0].reshape(-1))
            state = self.optimizer.state[self.outer]
            if len(tensors) > 1:
                state["momentum_buffer"] = tensors[1].reshape(-1).clone()
            else:
                state.pop("momentum_buffer", None)
            self.outer_step, self.tainted = meta["outer_step"], bool(meta["tainted"])
            self._reset_shards()
        self.loaded_from_peers = True
        self.downloads += 1
        self._update_digest()

    # ------------------------------------------------------------------ checkpoints and the end

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.clone(), "optimizer": self.optimizer.state_dict(), "outer_step": self.outer_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            if not state:  # a checkpoint from a galaxy-size-1 run: start the outer loop from the loaded weights
                self.outer.copy_(self._flat_shards())
            else:
                self.outer.copy_(state["outer"])
                self.optimizer.load_state_dict(state["optimizer"])
                self.outer_step = state["outer_step"]
        self._update_digest()

    def finish(self) -> dict[str, Any] | None:
        """Collective, after the last inner step: announce it, then until every live group that is not done or
        holds another state has caught up (at most `settle_timeout`), load the best state whenever another group
        holds one (a torn last round: the groups whose round failed download the others' result). The model
        then holds the outer parameters, so every group exports the same final model."""
        self.done = True
        self._publish()
        deadline, source = time.monotonic() + self.settle_timeout, None
        while True:
            expired = time.monotonic() > deadline or self.stop()
            plan, waiting, expired = self.group.broadcast(
                (self._plan(), self._unsettled(), expired) if self.group.is_main else None
            )
            if plan and self._load_from(plan) is not None:
                source = self.loaded_from
                self._publish()
            if not waiting or expired:
                break
            time.sleep(0.5)
        if waiting and self.group.is_main:
            log.warning("worker group(s) %s did not reach this final state within %.0f s", waiting, self.settle_timeout)
        stale = self.group.sum(0.0 if torch.equal(self._flat_shards(), self.outer) else 1.0)
        if stale:  # the last round applied nothing here: export the swarm's model, not this group's drift
            if self.group.is_main:
                log.warning("the last round applied nothing: the final model is the swarm's outer parameters")
            with self._lock:
                self._reset_shards()
        if source is None and not stale:
            return None
        return self._row(self.step, source=source)

    def _unsettled(self) -> list[int]:
        """Rank 0: world ranks of the live groups that are not done or hold another state than this one."""
        mine = self._record()
        pending = [
            r for r in self.swarm.records()
            if r.world_rank != self.world_rank and r.settled and not (r.done and r.state == mine.state)
        ]  # fmt: skip
        return sorted(r.world_rank for r in pending if self.swarm.alive(r.peers[0]))

    def summary(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_step, "loaded_state_from_peers": self.loaded_from_peers}

    def close(self) -> None:
        self.swarm.shutdown()
