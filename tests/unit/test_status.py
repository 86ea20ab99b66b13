"""`diloco status`'s parts, in process: the status record each worker group publishes, the table and JSON it becomes,
and what the outer loop publishes. The command against real processes is tests/integration/test_status.py's."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco.cli.monitor import render, table
from diloco.outer.diloco import DiLoCo
from diloco.outer.links import solo_group
from diloco.outer.memory import Member, MemorySwarm, Report
from diloco.swarm.records import status
from diloco.swarm.records.status import Status
from tests.support.records import NOW, FakeDHT, owned, record

# ---------------------------------------------------------------- the record


def test_status_records_round_trip_through_the_dht_by_world_rank() -> None:
    dht = FakeDHT()
    key = status.status_key("my-run")
    for world_rank in (1, 0):
        status.publish(dht, key, record(world_rank), owned(world_rank))
    assert key == "my-run-status" and set(dht.values[key]) == {owned(0), owned(1)}
    expires = dht.values[key][owned(0)].expiration_time
    assert time.time() + status.STATUS_TTL - 5 < expires <= time.time() + status.STATUS_TTL
    assert status.read(dht, key) == [record(0), record(1)]
    assert status.read(dht, "another-run-status") == []
    assert len(json.dumps(record(reach="outbound only").to_dict())) < 450  # a few hundred bytes on the wire


def test_entries_that_are_not_status_records_are_skipped() -> None:
    dht = FakeDHT()
    key = status.status_key("run")
    status.publish(dht, key, record(0), owned(0))
    good = record(1).to_dict()
    dht.store(key, "junk", 0.0, subkey=owned(2))
    dht.store(key, {k: v for k, v in good.items() if k != "step"}, 0.0, subkey=owned(3))  # an older version
    dht.store(key, good | {"world_rank": 4, "step": "25"}, 0.0, subkey=owned(4))  # a string where a number goes
    dht.store(key, good | {"world_rank": 5, "tokens_per_s": [1.0]}, 0.0, subkey=owned(5))
    dht.store(key, good | {"world_rank": 6, "added_later": 1}, 0.0, subkey=owned(6))  # a newer version: still read
    dht.store(key, good | {"world_rank": 7}, 0.0, subkey="7")  # nobody's: anyone could have stored it
    dht.store(key, good | {"world_rank": 8}, 0.0, subkey=owned(9))  # another world rank than its subkey's
    assert [r.world_rank for r in status.read(dht, key)] == [0, 6]


def test_discarded_steps_round_trip_and_default_to_0_in_an_earlier_trainer_s_record() -> None:
    assert Status.from_dict(record(discarded_steps=12).to_dict()) == record(discarded_steps=12)
    earlier = {k: v for k, v in record().to_dict().items() if k != "discarded_steps"}
    assert "discarded_steps" not in earlier and Status.from_dict(earlier) == record()
    assert record().discarded_steps == 0


@pytest.mark.parametrize("value", [True, False, -1, "3", 2.0, None])
def test_a_record_whose_discarded_steps_is_not_a_count_is_not_a_record(value: Any) -> None:
    assert Status.from_dict(record().to_dict() | {"discarded_steps": value}) is None
    dht = FakeDHT()
    key = status.status_key("run")
    dht.store(key, record(0).to_dict() | {"discarded_steps": value}, 0.0, subkey=owned(0))
    dht.store(key, record(1, discarded_steps=3).to_dict(), 0.0, subkey=owned(1))
    assert status.read(dht, key) == [record(1, discarded_steps=3)]


@pytest.mark.parametrize(("peers", "word"), [(None, None), (0, "failed"), (1, "alone"), (2, "ok"), (5, "ok")])
def test_the_last_round_reads_ok_alone_or_failed_by_its_peers(peers: int | None, word: str | None) -> None:
    assert record(round_peers=peers).round == word


# ---------------------------------------------------------------- the table and the JSON


def test_the_table_has_one_aligned_row_per_group() -> None:
    groups = [
        record(0, reach="direct"),
        record(1, round_peers=1, round_at=NOW - 300, heard_at=NOW - 45, state="done", reach="outbound only"),
        record(2, round_peers=0, round_at=NOW - 2, max_steps=None, tokens_per_s=None),
        record(3, round_peers=None, round_at=None, outer_step=0, state="joining", digest="", heard_at=NOW + 2),
    ]
    lines = table(groups, NOW).splitlines()
    assert lines[0].split() == ["group", "ranks", "sharding", "step", "lost", "outer", "tokens/s", "last", "round",
                                "peers", "digest", "heard", "reach", "state"]  # fmt: skip
    assert lines[1].split() == ["0", "2", "FULL_SHARD", "25/30", "0", "5", "1,234", "ok", "12s", "ago", "2",
                                "01234567", "3s", "ago", "direct", "training"]  # fmt: skip
    assert lines[2].split() == ["1", "2", "FULL_SHARD", "25/30", "0", "5", "1,234", "alone", "5m", "ago", "1",
                                "01234567", "45s", "ago", "outbound", "only", "done"]  # fmt: skip
    assert lines[3].split() == ["2", "2", "FULL_SHARD", "25", "0", "5", "-", "failed", "2s", "ago", "0", "01234567",
                                "3s", "ago", "-", "training"]  # fmt: skip
    # a group whose clock is ahead of this one's was heard just now
    assert lines[4].split() == ["3", "2", "FULL_SHARD", "25/30", "0", "0", "1,234", "-", "-", "-", "0s", "ago",
                                "-", "joining"]  # fmt: skip
    assert len({line.rindex(" ") + 1 for line in lines}) == 1  # the last column starts at one place in every line


def test_the_lost_column_gives_discarded_steps_with_their_share_and_marks_over_10_percent() -> None:
    groups = [
        record(0, step=150, discarded_steps=12),  # 8%
        record(1, step=120, discarded_steps=41),  # 34%: marked
        record(2, step=120, discarded_steps=12),  # exactly 10%: not marked
        record(3, step=0, discarded_steps=0),
        record(4, step=0, discarded_steps=5),  # nothing left of its steps
    ]
    lines = table(groups, NOW).splitlines()
    start, end = lines[0].index("lost"), lines[0].index("outer")
    assert [line[start:end].strip() for line in lines] == ["lost", "12 (8%)", "41 (34%)!", "12 (10%)", "0", "5!"]
    assert len({line.index(" 5 ", start) for line in lines[1:]}) == 1  # the outer column starts at one place


def test_json_gives_every_field_the_round_in_words_and_ages_in_seconds() -> None:
    look = json.loads(render([record(0), record(1, round_peers=1)], "my-run", NOW, as_json=True))
    assert look["run_id"] == "my-run" and look["time"] == NOW
    first, second = look["groups"]
    assert first == record(0).to_dict() | {"round": "ok", "round_age_s": 12.0, "heard_s": 3.0}
    assert second["round"] == "alone" and second["world_rank"] == 1
    assert first["discarded_steps"] == 0
    look = json.loads(render([record(0, discarded_steps=7)], "my-run", NOW, as_json=True))
    assert look["groups"][0]["discarded_steps"] == 7


def test_an_empty_look_says_so_in_one_title_line() -> None:
    assert render([], "my-run", NOW, as_json=False).startswith("run my-run: 0 worker group(s) at ")
    assert "\n" not in render([], "my-run", NOW, as_json=False)
    assert json.loads(render([], "my-run", NOW, as_json=True))["groups"] == []


# ---------------------------------------------------------------- what the outer loop publishes


class Fixed(Member):
    """Every round ends with `num_peers` groups, or fails."""

    def __init__(self, hub: MemorySwarm, num_peers: int, ok: bool = True) -> None:
        super().__init__(hub, "g0")
        self.num_peers, self.ok, self.sent = num_peers, ok, 0

    def average(
        self, tensors: Sequence[torch.Tensor], round_index: int, weight: float, stop: object, fragment: object = None,
        outer_step: int | None = None,
        last: bool = False,
    ) -> Report:
        return Report(num_peers=self.num_peers if self.ok else 0, ok=self.ok)

    def publish_status(self, record: Status) -> None:
        self.sent += 1
        super().publish_status(record)


def outer_loop(swarm: Member, **kw: Any) -> DiLoCo:
    net = torch.nn.Linear(4, 2)
    return DiLoCo([p.data for p in net.parameters()], swarm, solo_group(), world_rank=0, local_steps=5,
                  outer_lr=0.7, outer_momentum=0.0, final_step=30, sharding="SHARD_GRAD_OP", **kw)  # fmt: skip


@pytest.mark.parametrize(("num_peers", "ok", "word"), [(3, True, "ok"), (1, True, "alone"), (2, False, "failed")])
def test_rank_0_publishes_each_round_with_its_peers_and_time(num_peers: int, ok: bool, word: str) -> None:
    hub = MemorySwarm(1)
    outer = outer_loop(Fixed(hub, num_peers, ok))
    outer.join(0)
    assert hub.statuses[0].state == "training" and hub.statuses[0].round is None
    before = time.time()
    outer.after_inner_step(5)
    published = hub.statuses[0]
    assert published.round == word and published.round_peers == (num_peers if ok else 0)
    assert before <= published.round_at <= published.heard_at <= time.time()
    assert (published.step, published.max_steps, published.ranks, published.sharding) == (5, 30, 1, "SHARD_GRAD_OP")
    assert published.outer_step == (1 if ok else 0) and published.digest == outer.digest[: status.DIGEST_CHARS]


def test_heartbeats_carry_the_throughput_at_most_every_few_seconds_and_never_the_loop() -> None:
    hub = MemorySwarm(1)
    swarm = Fixed(hub, 2)
    outer = outer_loop(swarm)
    outer.join(0)
    sent = swarm.sent
    outer.progress({"step": 1, "tokens_per_s": 99.0})  # right after the join's record: no heartbeat yet
    assert swarm.sent == sent
    outer.beacon.sent_at -= status.HEARTBEAT_S  # as if the last record were that old
    outer.progress({"step": 2, "tokens_per_s": 120.5, "loss": 3.0})
    # the median of the rows so far (99, 120.5): one slow row, after a round, does not make the group look slow
    assert swarm.sent == sent + 1 and (hub.statuses[0].step, hub.statuses[0].tokens_per_s) == (2, 109.75)
    outer.progress({"step": 3, "tokens_per_s": 130.0})
    assert swarm.sent == sent + 1  # throttled
    outer.after_inner_step(5)  # a round publishes at once, with the last throughput
    assert swarm.sent == sent + 2 and hub.statuses[0].tokens_per_s == 120.5


def test_a_group_says_how_it_left() -> None:
    hub = MemorySwarm(1)
    outer = outer_loop(Fixed(hub, 2))
    outer.join(0)
    outer.finish()
    assert hub.statuses[0].state == "done"
    outer.close()
    assert hub.statuses[0].state == "finished"
    stopped = outer_loop(Fixed(MemorySwarm(1), 2), stop=lambda: True)
    stopped.close()
    assert stopped.swarm.swarm.statuses[0].state == "stopped"
    broken = outer_loop(Fixed(MemorySwarm(1), 2))
    broken.close()  # closed without finishing: an error ended its run
    assert broken.swarm.swarm.statuses[0].state == "failed"


class FailingDHT:
    """A DHT whose status stores fail: first not stored (False), then with an error, then its pipe is closed."""

    def __init__(self) -> None:
        self.calls = 0

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None, **kwargs: Any) -> Future:
        assert kwargs == {"return_future": True}  # the training step never waits for the network
        self.calls += 1
        if self.calls == 3:
            raise BrokenPipeError("the DHT process is gone")
        future: Future = Future()
        if self.calls == 1:
            future.set_result(False)
        else:
            future.set_exception(TimeoutError("no answer"))
        return future


def test_a_status_that_cannot_be_stored_is_logged_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    from diloco.swarm.peer import SwarmPeer

    dht = FailingDHT()
    averager = SimpleNamespace(peer_id="me")
    owner = SimpleNamespace(id="me", subkey=owned)  # (signatures are the DHT's: this one stores nothing)
    peer = SwarmPeer(dht, averager, "progress", 1.0, status_key="run-status", owner=owner)  # type: ignore[arg-type]
    for _ in range(4):
        peer.publish_status(record())
    assert dht.calls == 4
    warnings = [r.getMessage() for r in caplog.records if "could not publish" in r.getMessage()]
    assert len(warnings) == 1 and "no DHT peer stored it" in warnings[0], warnings
