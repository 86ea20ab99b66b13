"""A worker group's place in the swarm: joining, its world rank, catching up with the swarm's state, the round
of each outer step, and the end-of-run settle.

`DiLoCo` is the `OuterLoop` of a group in a swarm. It runs the outer step (`diloco.outer.optimizer.OuterOptimizer`) on
the average of the groups' pseudo-gradients, and keeps every group on one state: before its first inner step and
before each round a group compares its progress record with the others' and downloads the outer state
(parameters, momentum, outer step, and on joining the inner step count) from a group that is ahead or holds the
swarm's state (`diloco.outer.catchup`: which group to ask, and whether what came is that state). So late joiners,
resumed groups and groups whose round failed end bit-identical with the others. After the last inner step every
group waits (bounded) until the live groups hold one final state, so all export one model.

It reaches the other groups only through the `Swarm` protocol (`diloco.outer.links`; `diloco.swarm.peer.SwarmPeer` in
training, the in-memory `diloco.outer.memory` in tests and benches), and the other ranks of its own group through
`Group`: it never imports hivemind.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from diloco.outer.admission import Admission
from diloco.outer.beacon import Beacon, outer_setting
from diloco.outer.catchup import CatchUp, JoinError
from diloco.outer.claims import Claims
from diloco.outer.error_feedback import ErrorFeedback, NoFeedback
from diloco.outer.fragments import Runs, fragment_of
from diloco.outer.inflight import InFlight
from diloco.outer.ledger import Ledger
from diloco.outer.links import Group, RoundResult, Swarm
from diloco.outer.loop import OuterReport
from diloco.outer.optimizer import OuterOptimizer
from diloco.outer.pace import FixedSteps, Pace
from diloco.outer.rows import round_row
from diloco.outer.state_transfer import StateTransfer
from diloco.swarm.records.fingerprint import ModelId
from diloco.swarm.records.status import Status
from diloco.swarm.rounds.digest import Digest, ShardDigest
from diloco.swarm.rounds.screening import all_finite
from diloco.swarm.rounds.transfer import SharedCopies

log = logging.getLogger("diloco")

# a pause is announced this many times as long as the caller expects: one evaluation took 1.3x the one before on a
# shared machine; announcing more costs the others nothing when the group is back sooner (their round closes once
# every expected group is in), only when it dies away, and then at most one round's bound
PAUSE_MARGIN = 1.5

__all__ = ["DiLoCo", "JoinError"]


class DiLoCo(Admission, StateTransfer):
    """The outer loop of one worker group in a swarm (one instance per rank; methods marked collective are
    called by every rank of the group together).

    :param shards: this rank's local parameter shards, in a fixed order (the same in every group).
    :param swarm: carries the bytes and the progress records.
    :param group: collectives over the ranks of this group.
    :param world_rank: this group's index in the swarm (the config's `hv.world_rank`).
    :param local_steps: H, inner steps between outer steps (unless `pace` is given).
    :param outer_lr: outer SGD learning rate.
    :param outer_momentum: Nesterov momentum of the outer SGD; 0 means plain SGD.
    :param outer_warmup: outer steps over which the outer lr rises linearly to `outer_lr` (0: none).
    :param stop: true once the run was asked to stop; an averaging round then gives up.
    :param join_timeout: seconds a joining group keeps trying to download the state from live peers before it
        gives up (it never starts from its own state while peers with a state are alive).
    :param final_step: the run's last inner step; it ends with an outer step even when it is not a multiple of
        `local_steps`, so no inner step is left out of the final model. None: no last step.
    :param settle_timeout: seconds a finished group waits for live groups that do not hold its final state yet
        (one still in its last round, or one whose last round failed and must download).
    :param sharding: the group's FSDP sharding strategy, and `transport` its --hv.transport, in its status record.
    :param pace: when outer steps are due and where the LR schedule stands (`diloco.outer.pace`); default:
        `FixedSteps(local_steps, final_step)`.
    :param tokens_per_step: tokens of one inner step of this group (all ranks), for the round rows.
    :param model: this group's model fingerprint; a live group of another model makes `claim_world_rank` leave (in
        a keyed swarm) or warn.
    :param digest: how the ranks' outer shards add up to the group's digest (``diloco.swarm.rounds.digest``): equal in
        groups that hold one state; default: sha256 over the shards (groups of one shape only).
    :param fragments: with ``--hv.fragments F``: where each fragment's parameters sit in this rank's flat shard
        (``diloco.outer.fragments``); round r averages fragment (r - 1) mod F, every H/F inner steps, and the run's last
        inner step ends with a round for every fragment. None: every round averages the whole model.
    :param overlap_steps: inner steps taken while a round is on the wire (``diloco.outer.inflight``); 0: blocking.
    :param overlap_mix: how much of its own values a parameter keeps when an overlapped round lands.
    :param aggregation: how reducers combine pseudo-gradients (``--hv.aggregation``): part of the outer setting the
        groups of a run must share, as is `wire`, the rounds' wire format (``agreement.wire_format``; "": not said).
    :param schedule: the group's schedule (``agreement.schedule``), which the groups of a run must share too;
        empty: not compared. `batch`: its inner step, ``<total batch size>x<sequence length>``.
    :param late_work: ``--hv.late-work``: after loading a newer state, ``keep`` the inner steps since the last round
        for the next one (the model moves with the outer parameters) or ``drop`` them (counted: ``Ledger``).
    :param error_decay: sparse rounds: the error feedback's decay (``diloco.outer.error_feedback``); None: none.
    :param land_wait: seconds a group that just loaded the state, and found the round under way gone without it, waits
        for a group to land that round, to load the result at once (`_join_round_or_catch_up`); 0: it does not wait.
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
        outer_warmup: int = 0,
        stop: Callable[[], bool] = lambda: False,
        join_timeout: float = 60.0,
        final_step: int | None = None,
        settle_timeout: float = 30.0,
        sharding: str = "",
        transport: str = "",
        pace: Pace | None = None,
        tokens_per_step: int = 0,
        model: ModelId | None = None,
        digest: Digest | None = None,
        fragments: list[Runs] | None = None,
        overlap_steps: int = 0,
        overlap_mix: float = 0.5,
        aggregation: str = "mean",
        wire: str = "",
        schedule: str = "",
        batch: str = "",
        claim_settle_s: float = 1.0,
        late_work: str = "drop",
        error_decay: float | None = None,
        land_wait: float = 0.0,
    ) -> None:
        self.params = OuterOptimizer(shards, outer_lr, outer_momentum, outer_warmup, fragments)
        self.feedback = NoFeedback() if error_decay is None else ErrorFeedback(
            self.params.outer.numel(), error_decay, swarm.image, self.params.fragments)  # fmt: skip
        self.claim_settle_s = claim_settle_s  # how long a claim waits for a group that started at the same moment
        self.fragments = len(fragments) if fragments else 1
        self.overlap, self.mix = overlap_steps, overlap_mix
        self.in_flight: InFlight | None = None
        self.pace = pace or FixedSteps(local_steps // self.fragments, final_step, local_steps * tokens_per_step)
        self.tokens_per_step = tokens_per_step
        self.ledger = Ledger(self.fragments, tokens_per_step)  # the inner steps against the outer state
        self.keep_late = late_work == "keep"
        # the last round this group took part in on time failed on its side (its inner steps carry over); and the
        # last load kept this group's inner steps, which have not landed in a round since
        self.round_failed = self.keeping = False
        # the boundary of the round on the wire until it is applied (or fails): the state served until then is from
        # before it (`_current_state`)
        self.wire_step: int | None = None
        self.swarm, self.group, self.world_rank = swarm, group, world_rank
        self.stop, self.join_timeout, self.land_wait = stop, join_timeout, land_wait
        self.final_step, self.settle_timeout = final_step, settle_timeout
        self.step = 0  # inner steps done, as last seen; served with the state
        self.tainted = False
        self.settled = False
        self.done = False
        self.loaded_from_peers = False
        self.downloads = 0
        self.download: dict[str, float] = {}  # the last state download's seconds and MB (all ranks), for its row
        self.downloaded: list[dict[str, float]] = []  # every one of them, for the summary
        self.loaded_from: int | None = None  # world rank of the group whose state was loaded last
        self.loaded_step: int | None = None  # and its inner step as it served that state
        self.token = group.broadcast(uuid.uuid4().hex)
        self.claims = Claims(swarm, world_rank, self.token)
        self.peers = tuple(group.gather(swarm.peer_id))
        self.digester = digest or ShardDigest()
        self.served = SharedCopies(self.params.lock)  # the outer state as the answers to downloads read it
        self.params.before_change = self.served.changing
        self.digest = ""
        self._update_digest()
        self.catchup = CatchUp(swarm, group, self.params, self.digester)
        self.model = model
        self.beacon = Beacon(
            swarm, group.is_main, world_rank, len(self.peers), sharding, transport,
            outer_setting(outer_lr, outer_momentum, outer_warmup, aggregation, wire), schedule, final_step, model,
            self.peers[0], batch, reach=swarm.reach,
        )  # fmt: skip

    @property
    def outer(self) -> torch.Tensor:
        """This rank's outer parameters (flat float32)."""
        return self.params.outer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.params.optimizer

    @property
    def outer_step(self) -> int:
        """Outer steps applied to the outer parameters (loaded ones included)."""
        return self.params.steps

    # ------------------------------------------------------------------ joining the swarm (and `Admission`'s)

    def join(self, step: int, load_from_peers: bool = True) -> OuterReport:
        """Collective, before the first inner step: load the swarm's state when another group is ahead, then serve
        this group's state to others."""
        self.step, rows = step, []
        if not self.beacon.sent:  # `claim_world_rank` sent it: its time must stay the claim's (see
            self._publish_status("joining")  # `rival_model`: the older joining record of two stays)
        if self.group.is_main:  # records of a group that claimed at the same moment are out by now
            self._adopt_budget(self._status("joining"))
        self._share_budget()
        if load_from_peers:
            loaded = self._load_on_join()
            if loaded is not None:
                self.step = step = loaded
                if self.pace.in_round(step, self.outer_step):  # the swarm is averaging now: take part, no weight
                    step, rows = self._join_round_or_catch_up(step, self.loaded_from)
        elif self.group.is_main:
            log.info("not loading the swarm's state (as asked): starting from this group's own state")
        self.settled = True
        self.pace.new_round(self.outer_step)  # (a resumed group keeps its round's start from the checkpoint)
        self.swarm.serve_state(self._current_state)
        self._publish()
        self._publish_status("training")
        return OuterReport(step, rows[-1] if rows else None, tuple(rows[:-1]))

    def _load_on_join(self) -> int | None:
        """Collective: load the state of a group that is ahead, if any (``CatchUp.on_join``). Returns the inner step
        to continue from, or None when this group is the first or the furthest (its own state is the swarm's)."""
        return self.catchup.on_join(self._plan, self._load_from, self.join_timeout, self.stop)

    # ------------------------------------------------------------------ rounds

    def budget(self) -> tuple[int, int] | None:
        return self.pace.budget()

    def position(self, step: int) -> int:
        """Where the LR schedule and the end of the run stand after inner step `step` (see `diloco.outer.pace`)."""
        return self.pace.position(step, self._paced)

    @property
    def _paced(self) -> int:
        """The outer steps the pace counts: the applied ones, and the round on the wire (see `diloco.outer.pace`)."""
        return self.outer_step + (self.in_flight is not None)

    def _new_round(self, step: int, fragment: int | None = None) -> None:
        """The outer parameters changed (an outer step, a loaded state): the model (or the one fragment a round
        averaged) was reset to them."""
        self.ledger.new_round(step, fragment)
        self.pace.new_round(self._paced)

    def after_inner_step(self, step: int) -> OuterReport | None:
        """Collective: land the round in flight when its time came; at a boundary, catch up with the swarm if this
        group is behind, then average (and apply, unless the round is overlapped)."""
        self.step = step
        tokens = self.ledger.pace_tokens(step)
        due = self.pace.due(step, self._paced, tokens)
        landed = None
        if self.in_flight is not None and (due or step >= self.in_flight.land_at):
            landed = self._land(step)  # one round in flight at a time: a due round waits for it
        if not due:
            return None if landed is None else OuterReport(step, landed)
        before = () if landed is None else (landed,)
        index = self.pace.round_index(step, self._paced)
        pseudo_gradient = self.params.pseudo_gradient(self._fragment(index))
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
                if not self.pace.in_round(step, self.outer_step):
                    ahead = self._next_round_now(step)
                    if ahead is None:
                        return OuterReport(step, self._row(step, source=source), before)
                    step = ahead
        if self.outer_step == outer_before:
            tokens = self.ledger.fragment_tokens(step, self._fragment(index))
            weight = self.pace.weight(tokens)
            rows = self._round(step, index, pseudo_gradient, weight, source, tokens)
        else:
            # a group that was behind joins the round under way: with the inner steps it kept, or with nothing
            # (zeros, as its pseudo-gradient is gone)
            step, rows = self._join_round_or_catch_up(step, source)
        return OuterReport(step, rows[-1] if rows else None, before + tuple(rows[:-1]))

    def _next_round_now(self, step: int) -> int | None:
        """Collective, under fixed H, in a group that kept its inner steps through loading the state of a round that
        formed without it: jump to the swarm's next boundary (as a group behind takes the swarm's step count) and
        take that round now, or its steps would never land (it would be as late at each round). Returns the inner
        step it continues from; None when it kept nothing, or under a token budget (due with everyone)."""
        boundary = self.pace.next_boundary(self._paced)
        if not self._keeps or boundary is None or boundary <= step or self.ledger.trained(step) == 0:
            return None
        self.ledger.kept(0, boundary - step, boundary)
        self.step = boundary
        if self.group.is_main:
            log.info("taking this group's kept inner steps to the swarm's next round now (inner step %d -> %d)",
                     step, boundary)  # fmt: skip
        return boundary

    def _fragment(self, index: int) -> int | None:
        """The fragment round `index` averages (None: the whole model)."""
        return None if self.fragments == 1 else fragment_of(index, self.fragments)

    def _join_round(self, step: int, source: int | None) -> list[dict[str, Any]]:
        """Collective: take part in the round under way (this group just loaded the state): with the inner steps
        it kept (``late_work`` keep), weighted by their tokens; else with no weight."""
        index = self.pace.round_index(step, self._paced)
        fragment = self._fragment(index)
        tokens = self.ledger.fragment_tokens(step, fragment)
        if self._keeps and tokens > 0:
            pseudo_gradient = self.params.pseudo_gradient(fragment)
            # the group it loaded from was at this very boundary: a round without it is one that group took meanwhile
            late = self.loaded_step == step
            return self._round(step, index, pseudo_gradient, self.pace.weight(tokens), source, tokens, overlap=False,
                               late=late)  # fmt: skip
        zeros = torch.zeros(self.params.numel(fragment))
        return self._round(step, index, zeros, 0.0, source, overlap=False)

    def _join_round_or_catch_up(self, step: int, source: int | None) -> tuple[int, list[dict[str, Any]]]:
        """Collective, just after a load at inner step `step`: join the round under way (`_join_round`). When that
        applied nothing (the round formed without this group: its download took longer than the others'
        matchmaking), wait up to `land_wait` for a group to land that round, and load the result now; join again when
        that load comes at a boundary, and so on. Else this group would come to its next round an outer step behind,
        download again, and could miss that round as well, round after round. Returns the inner step to go on from
        and the rows of the rounds joined and of the loads."""
        rows: list[dict[str, Any]] = []
        deadline = None  # (counted from the first round missed)
        while True:
            joined = self.outer_step
            rows += self._join_round(step, source)
            if self.outer_step > joined or not self.land_wait:
                return step, rows
            deadline = time.monotonic() + self.land_wait if deadline is None else deadline
            # (rank 0 alone reads the clock: an empty plan, once the time is up, ends the wait on every rank)
            plan = self.group.broadcast(self._plan_ahead(deadline) if self.group.is_main else None)
            if not plan or (loaded := self._load_from(plan)) is None:
                return step, rows
            if self.group.is_main:
                log.info("loaded the round this group missed as it landed (inner step %d -> %d)", step, loaded)
            self.step = step = loaded
            source = self.loaded_from
            self._publish()
            rows.append(self._row(step, source=source))
            if not self.pace.in_round(step, self.outer_step):
                return step, rows

    def _round(
        self,
        step: int,
        index: int,
        pseudo_gradient: torch.Tensor,
        weight: float,
        source: int | None,
        tokens: int = 0,
        overlap: bool = True,
        late: bool = False,
    ) -> list[dict[str, Any]]:
        """Collective: the round of boundary `step`: started in the background when rounds overlap the inner
        steps (its row comes when it lands), else averaged and applied now. At the run's last step every
        fragment then takes a blocking round of its own, so the final model holds all the inner steps. Returns
        the rows of the rounds applied, in order (none: on the wire, or stopped). `late`: this group joined, on loading
        the state, the round its source was in (``_join_round``)."""
        fragment, last = self._fragment(index), self.pace.last_round(step, index)
        pseudo_gradient = self._fold(pseudo_gradient, weight, fragment)
        what = "" if fragment is None else f" fragment {fragment}"
        log.info("outer step %d: averaging%s (round %d)", self.outer_step + 1, what, index)
        if self.overlap and overlap and not last:
            self.in_flight = InFlight(
                step, step + self.overlap, index, fragment, pseudo_gradient, weight, tokens, source,
                self.outer_step, self.pace.summary(tokens),
            ).start(self.swarm, self.stop)
            self.wire_step = step
            self.ledger.round_start = self.ledger.pace_start = step  # the next round's tokens count from here
            self.pace.new_round(self._paced)
            return []
        report = self.swarm.average([pseudo_gradient], index, weight, self.stop, fragment, self.outer_step, last)
        row = self._apply(step, fragment, report, pseudo_gradient, weight, source, tokens, mix=0.0,
                          late=late and not last)  # fmt: skip
        rows = [] if row is None else [row]
        for more in range(1, self.fragments if last and row is not None else 1):  # the other fragments, each
            fragment = self._fragment(index + more)  # with the inner steps since its own round
            tokens = self.ledger.fragment_tokens(step, fragment)
            weight = self.pace.weight(tokens) if weight else 0.0  # (a group that joined the round adds nothing)
            pseudo_gradient = self._fold(self.params.pseudo_gradient(fragment), weight, fragment)
            report = self.swarm.average([pseudo_gradient], index + more, weight, self.stop, fragment,
                                        self.outer_step, last=True)
            row = self._apply(step, fragment, report, pseudo_gradient, weight, None, tokens, mix=0.0)
            if row is None:
                break  # stopped during the round: the run ends here
            rows.append(row)
        return rows

    def _fold(self, pseudo_gradient: torch.Tensor, weight: float, fragment: int | None) -> torch.Tensor:
        """With sparse rounds, what earlier rounds did not carry is added to a contribution (not to a group's
        zeros of no weight)."""
        return self.feedback.fold(pseudo_gradient, fragment) if weight else pseudo_gradient

    def _land(self, step: int) -> dict[str, Any] | None:
        """Collective: wait for the round in flight (usually over by now) and apply it, merged with the inner
        steps taken meanwhile."""
        flight, self.in_flight = self.in_flight, None
        started = time.monotonic()
        report = flight.wait()
        waited, side_cpu_s = time.monotonic() - started, flight.side_cpu_s()
        row = self._apply(
            flight.step, flight.fragment, report, flight.pseudo_gradient, flight.weight, flight.source,
            flight.tokens, mix=self.mix, landed=flight.summary,
        )  # fmt: skip
        if row is not None:
            row |= {"step": step, "round_step": flight.step, "land_wait_s": waited,
                    "land_s": time.monotonic() - started, "side_cpu_s": side_cpu_s}  # fmt: skip
        return row

    def _apply(self, step: int, fragment: int | None, report: RoundResult, pseudo_gradient: torch.Tensor,
               weight: float, source: int | None, tokens: int, mix: float,
               landed: dict[str, Any] | None = None, late: bool = False) -> dict[str, Any] | None:  # fmt: skip
        """Collective: the outer step with a round's result (when every rank got it). None when stopped during
        the round. `landed`: for a round that was on the wire, the pace's fields for its row as of its send;
        `late`: this group joined, on loading the state, the round its source was in (not the run's last)."""
        if self.group.sum(1.0 if self.stop() else 0.0):
            log.warning("outer step %d: stopped during averaging; not applied", self.outer_step + 1)
            return None
        ranks = len(self.peers)  # one peer id per rank of this group
        all_ok = self.group.sum(1.0 if report.ok else 0.0) == ranks
        num_peers = report.num_peers if all_ok else 0
        if all_ok and self.group.sum(float(num_peers)) != num_peers * ranks:
            log.warning("outer step %d: the ranks of this group averaged with different peers", self.outer_step + 1)
            all_ok, num_peers = False, 0
        # a lone round of a group that would keep its steps, while a live group is already past this outer step: its
        # round formed without this group. Applied alone, the step would be replaced at the next load, its inner
        # steps lost; left out, they carry over and land in the swarm's next round. A `late` group that found nobody
        # knows that much without a record: the group it loaded from took the round meanwhile, whether or not its new
        # record is readable yet (under load a DHT store can take longer than the round, or fail)
        passed = all_ok and num_peers <= 1 and bool(weight) and self._keeps and (late or self._swarm_past())
        outer_before = self.outer_step
        with self.params.lock:  # a state served meanwhile has the digest of its parameters
            self.round_failed = not all_ok and not report.behind
            if all_ok and num_peers > 1:
                self.params.step(pseudo_gradient, fragment, mix)
                self.tainted, self.ledger.alone_steps = False, 0
                self.feedback.averaged(fragment)
            elif all_ok and weight and not passed:  # as the paper: a group that found nobody applies its own
                log.warning(
                    "outer step %d: no peer was ready, applying this group's own pseudo-gradient", self.outer_step + 1
                )
                self.params.step(pseudo_gradient, fragment, mix)
                self.tainted = True
                self.feedback.applied_alone(fragment)
                self.ledger.alone_steps = tokens // self.tokens_per_step if self.tokens_per_step else 0
            else:  # the outer parameters stay the swarm's; the inner progress carries over into the next round
                log.warning(
                    "outer step %d: %s; nothing applied, the inner steps carry over to the next round",
                    self.outer_step + 1, "the swarm is already past it" if passed else
                    "missed the swarm's round" if all_ok else
                    "behind the others' outer step, it sat the round out" if report.behind else "averaging failed",
                )  # fmt: skip
                self.feedback.failed(fragment)
            self._update_digest()
            self.wire_step = None
        if self.outer_step > outer_before:
            self.keeping = False  # what a load kept landed in this step
            if landed is not None:  # its successor began at its send (`_round`)
                self.ledger.reset_fragments(step, fragment)
            else:
                self._new_round(step, fragment)
        self._publish()
        self.beacon.last_round = (num_peers, time.time())
        self._publish_status("training")
        # a landed round's model holds the steps taken since its send: no other group's hash would match, and hashing
        # the whole model costs the training thread ~40 ms per landing in `bench wan`; `outer_digest` is shared
        row = self._row(step, source=source, report=report, num_peers=num_peers, pseudo_gradient=pseudo_gradient,
                        with_sha=landed is None)  # fmt: skip
        if fragment is not None:
            row["fragment"] = fragment
        if passed:
            row["sat_out"] = True  # it applied nothing: the swarm was past this outer step
        row |= {"tokens": tokens, "weight": weight} | self.params.timings  # (the gather: of this round's send)
        return row | (self.pace.summary(tokens) if landed is None else landed)

    @property
    def _keeps(self) -> bool:
        """Whether this group's inner steps kept through a load go on to a round (``late_work`` keep, or a round
        that failed on its side only: `_load_from`)."""
        return self.keep_late or self.keeping

    def _row(self, step: int, *, source: int | None, **round_fields: Any) -> dict[str, Any]:
        """Collective: the metrics row of this group's outer state at `step` (``rows.round_row``), with the inner
        steps (tokens) thrown away since the last row, and those kept through a load (``carried_steps``)."""
        row = round_row(self.group, step, self.outer_step, self.digest, source=source, **round_fields)
        return row | self.ledger.row_fields() | (self.download if source is not None else {})

    # ------------------------------------------------------------------ status for onlookers

    def progress(self, row: dict[str, Any]) -> None:
        """After each metrics row of the training loop: keep its throughput, and send a heartbeat (``Beacon``)."""
        if isinstance(row.get("tokens_per_s"), (int, float)):
            self.beacon.measured(row["tokens_per_s"])
        if self.beacon.heartbeat_due():
            self._publish_status("training", step=row.get("step", self.step))

    def pause(self, seconds: float | None) -> None:
        """Rank 0 says the group is away from its inner steps for up to `PAUSE_MARGIN` x `seconds` (None: back); see
        ``OuterLoop``."""
        announced, now = self.beacon.paused_until, time.time()
        self.beacon.paused_until = None if seconds is None else now + PAUSE_MARGIN * seconds
        back_early = announced is not None and announced > now  # the others expect it later than it comes: tell them
        if (seconds is not None or back_early) and self.beacon.sent and not self.done:
            self._publish_status("training")

    def _publish_status(self, state: str, step: int | None = None) -> Status | None:
        """Rank 0: this group's status record as of inner step `step` (default: the last one the outer loop saw)."""
        at = self.position(self.step if step is None else step)
        return self.beacon.send(state, at, self.outer_step, self.digest)

    def _status(self, state: str) -> Status | None:
        """Rank 0: the status record `_publish_status` would send now, not sent."""
        return self.beacon.record(state, self.position(self.step), self.outer_step, self.digest)

    # ------------------------------------------------------------------ checkpoints and the end

    def state_dict(self) -> dict[str, Any]:
        return self.params.state_dict() | self.ledger.state_dict() | self.feedback.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.params.load_state_dict(state)
        self.feedback.load_state_dict(state)
        self.ledger.load_state_dict(state)
        self._update_digest()

    def finish(self) -> dict[str, Any] | None:
        """Collective, after the last inner step: announce it, then until every live group that is not done or
        holds another state has caught up (at most `settle_timeout`), load the best state whenever another group
        holds one (a torn last round: the groups whose round failed download the others' result). The model
        then holds the outer parameters, so every group exports the same final model."""
        self.done = True
        self._publish()
        self._publish_status("done")
        loaded = self.catchup.settle(self._plan, self._load_from, self._record, self.settle_timeout, self.stop,
                                     on_load=self._publish)  # fmt: skip
        source = self.loaded_from if loaded else None
        stale = self.group.sum(0.0 if self.params.model_is_outer() else 1.0)
        if stale:  # the last round applied nothing here: export the swarm's model, not this group's drift
            if self.group.is_main:
                log.warning("the last round applied nothing: the final model is the swarm's outer parameters")
            self._discard(self.ledger.trained(self.step))
            self.params.reset_shards()
        if source is None and not stale:
            return None
        return self._row(self.step, source=source)

    def summary(self) -> dict[str, Any]:
        """Collective (sums over the group's ranks): the outer steps, whether the swarm's state was loaded, and
        what was refused: records without the key's seal, other owners' claims of this world rank, state
        downloads, connections at their hello."""
        refused, claims = self.catchup.refusals_here, self.claims.rejected
        return {"outer_steps": self.outer_step, "loaded_state_from_peers": self.loaded_from_peers,
                "state_downloads": self.downloaded,
                "discarded_steps": self.ledger.discarded_steps, "discarded_tokens": self.ledger.discarded_tokens,
                "rejected_records": self.swarm.rejected_records, "rejected_claims": int(self.group.sum(float(claims))),
                "rejected_states": int(self.group.sum(float(refused))),
                "refused_connections": int(self.group.sum(float(self.swarm.refused_connections)))}  # fmt: skip

    def close(self) -> None:
        """Tell onlookers how this group left, then leave the swarm (a round still in flight, which gives up once
        the run was asked to stop, ends first: it must not write into a swarm that is shutting down)."""
        if self.in_flight is not None:
            self.in_flight.thread.join(self.settle_timeout)
        try:
            self._publish_status("stopped" if self.stop() else "finished" if self.done else "failed")
        finally:
            self.swarm.shutdown()
