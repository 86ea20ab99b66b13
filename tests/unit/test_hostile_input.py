"""What a stranger stores or sends, malformed: every reader refuses it (counted, warned once) and none raises."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from diloco.outer.catchup import CatchUp
from diloco.outer.links import solo_group
from diloco.outer.optimizer import OuterOptimizer
from diloco.swarm.peer import SwarmPeer
from diloco.swarm.records import budget, progress, status
from diloco.swarm.records.progress import Progress
from diloco.swarm.records.swarm_key import SealedStore, SwarmKey
from diloco.swarm.rounds import tcp, transfer
from diloco.swarm.rounds.digest import ShardDigest
from tests.support.records import FakeDHT, owned

GOOD = {"world_rank": 1, "outer_step": 3, "step": 30, "digest": "d" * 32, "tainted": False, "settled": True,
        "token": "t", "peers": ["peer-1"]}  # fmt: skip
BAD_PROGRESS = {
    "settled with no peer id": GOOD | {"outer_step": 10**6, "peers": []},
    "a string for an outer step": GOOD | {"outer_step": "x"},
    "a bool for an outer step": GOOD | {"outer_step": True},
    "a negative step": GOOD | {"step": -1},
    "lists for digest and token": GOOD | {"digest": ["d"], "token": [1]},
    "a peer id that is not text": GOOD | {"peers": [7]},
    "a string for a flag": GOOD | {"tainted": "no"},
    "a field of no record": GOOD | {"admin": True},
    "a missing field": {k: v for k, v in GOOD.items() if k != "token"},
    "not a mapping": ["world_rank", 1],
    "a shape that is no list": GOOD | {"shape": 5},
}


def test_a_valid_progress_record_reads_back() -> None:
    assert Progress.from_dict(GOOD) == Progress(**GOOD | {"peers": ("peer-1",)})


@pytest.mark.parametrize("case", BAD_PROGRESS)
def test_a_malformed_progress_record_is_not_a_record(case: str) -> None:
    assert Progress.from_dict(BAD_PROGRESS[case]) is None


def test_readers_skip_and_report_entries_that_are_not_records() -> None:
    """Under each record key a stranger's entries (signed by it: under its own subkey) that are not records are
    left out, and the reader is told of each, by owner and world rank; the valid records are all there."""
    dht = FakeDHT()
    progress.publish(dht, "p", Progress.from_dict(GOOD), owned(1, "honest"))
    dht.store("p", BAD_PROGRESS["settled with no peer id"], 0.0, owned(2, "stranger"))
    dht.store("p", GOOD | {"world_rank": 4}, 0.0, owned(3, "stranger"))  # a rank its subkey does not name
    dht.store("s", {"world_rank": 2, "ranks": "two", "state": ["training"]}, 0.0, owned(2, "stranger"))
    dht.store("t", {"world_rank": 2, "outer_step": 0, "tokens": "many"}, 0.0, owned(2, "stranger"))
    dht.store("t", {"world_rank": 3, "outer_step": 0, "tokens": 5, "tokens_per_s": 1.0, "at": 1.0, "closed": "y"},
              0.0, owned(3, "stranger"))  # fmt: skip
    told: list[tuple[str, int]] = []
    records = progress.read(dht, "p", lambda owner, rank: told.append((owner, rank)))
    assert [r.world_rank for r in records] == [1] and len(told) == 2
    assert status.read(dht, "s", lambda owner, rank: told.append((owner, rank))) == [] and len(told) == 3
    assert budget.parse(dht.get("t"), lambda owner, rank: told.append((owner, rank))) == [] and len(told) == 5


def test_a_peer_counts_malformed_records_and_warns_once_per_sender(caplog: pytest.LogCaptureFixture) -> None:
    dht = FakeDHT()
    dht.store("p", BAD_PROGRESS["lists for digest and token"], 0.0, owned(2, "stranger"))
    peer = SwarmPeer(dht, SimpleNamespace(peer_id="me"), "p", 1.0, status_key="s")  # type: ignore[arg-type]
    for _ in range(3):
        assert peer.records() == []
    assert peer.rejected_records == 3  # per read, as records without a swarm key's seal are
    assert sum("not a valid record" in r.getMessage() for r in caplog.records) == 1


def meta(**changes: Any) -> dict[str, Any]:
    return {"outer_step": 2, "step": 20, "digest": "ab", "tainted": False, "world_rank": 0} | changes


@pytest.mark.parametrize(
    "header",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b"[1, 2]", b"\xff"],
    ids=["nested lists", "nested objects", "not an object", "not utf-8"],
)
def test_state_metadata_that_is_no_json_object_is_a_value_error(header: bytes) -> None:
    """A state answer's metadata is refused as the download's other faults are (ValueError), never a RecursionError
    that escapes the download."""
    with pytest.raises((ValueError, UnicodeDecodeError)):
        transfer._meta(header)


def catch_up() -> CatchUp:
    params = OuterOptimizer([torch.zeros(4)], lr=1.0, momentum=0.0)
    return CatchUp(SimpleNamespace(rejected_states=0), solo_group(), params, ShardDigest())  # type: ignore[arg-type]


# the progress record of the group asked: it signs outer step 2 with digest "ab", the state `meta()` names
SIGNED = Progress(world_rank=0, outer_step=2, step=20, digest="ab", tainted=False, settled=True, token="t",
                  peers=("p",))


@pytest.mark.parametrize("served", [meta(), meta(round_step=None), meta(round_step=20), meta(round_step=0)],
                         ids=["no round on the wire", "round_step None", "round_step at the step", "round_step 0"])
def test_a_served_state_with_valid_metadata_is_taken(served: dict[str, Any]) -> None:
    assert catch_up()._valid((served, [torch.zeros(4)]), SIGNED) == served


def test_an_answer_cut_after_its_metadata_counts_only_when_it_names_another_state() -> None:
    """``transfer.download`` cuts an answer of another state than the signed one after its metadata: that metadata
    is kept (the caller tells an honest race from a refusal by it); an answer without tensors that names the signed
    state is a refused state."""
    catch = catch_up()
    assert catch._valid((meta(outer_step=3), []), SIGNED) == meta(outer_step=3) and catch.rejected_states == 0
    assert catch._valid((meta(), []), SIGNED) is None and catch.rejected_states == 1


@pytest.mark.parametrize(
    "served",
    [meta(tainted="no"), meta(step=-1), meta(outer_step=1.5), meta(outer_step=True), meta(digest=["ab"]),
     {k: v for k, v in meta().items() if k != "tainted"}, meta(world_rank=None), ["outer_step", 2],
     meta(round_step="4"), meta(round_step=-1), meta(round_step=21)],
    ids=["tainted a string", "a negative step", "a float step", "a bool step", "a list digest", "no tainted",
         "no world rank", "not a mapping", "a string round step", "a negative round step", "a round after the step"],
)  # fmt: skip
def test_a_served_state_whose_metadata_is_malformed_is_refused_and_counted(served: Any) -> None:
    """What loading a state reads of its metadata must be there and of its type (a state without `tainted` raised a
    KeyError in the outer loop): otherwise it is a refused state, counted in `rejected_states`."""
    catch = catch_up()
    assert catch._valid((served, [torch.zeros(4)]), SIGNED) is None and catch.rejected_states == 1


@pytest.mark.parametrize("endpoint", [(["a" * 64 + ".example"], 1), (["127.0.0.1"], 70000), (["\udcff"], 1)],
                         ids=["a label over 63 characters", "a port out of range", "a host no codec takes"])
def test_an_endpoint_nobody_can_reach_is_a_connection_error(endpoint: tuple[list[str], int]) -> None:
    """Hosts and ports come from other groups' records and announcements: one that the resolver or the socket layer
    refuses is an unreachable rank (OSError), as a closed port is."""
    with pytest.raises(OSError):
        tcp.connect(endpoint, 1.0)


@pytest.mark.parametrize(
    "value",
    [{"x": b"bytes", "mac": "00"}, {1: "a", "b": 2, "mac": "00"}, {"x": [[[]]] * 3, "mac": None},
     {"nested": json.loads("[" * 900 + "]" * 900), "mac": "00"}],
    ids=["bytes", "keys of mixed types", "no mac", "deep"],
)  # fmt: skip
def test_a_keyed_reader_refuses_unsealable_values_without_raising(value: dict[str, Any], tmp_path: Path) -> None:
    """In a keyed swarm, values an outsider stores that have no canonical form fail their seal like any other."""
    key = SwarmKey(bytes(32))
    assert key.opened("k", "0[owner:x]", value, 0.0) is None
    assert key.member_signed(value) is None
    dht = FakeDHT()
    dht.store("k", value, 0.0, owned(0, "outsider"))
    sealed = SealedStore(dht, key)
    assert sealed.get("k", latest=True).value == {} and sealed.rejected_total == 1


def test_the_status_table_shows_a_strangers_strings_without_their_escape_sequences() -> None:
    """A status record is anyone's in an open swarm: its strings reach the onlooker's terminal as text only."""
    from diloco.cli.monitor import table
    from tests.support.records import NOW, record

    shown = table([record(sharding="\x1b[2J\x1b[H" + "X" * 500, state="training\x07\r", digest="\x1b]0;title\x07")],
                  NOW)  # fmt: skip
    assert not any(not c.isprintable() for c in shown.replace("\n", "")), repr(shown)
    assert max(len(line) for line in shown.splitlines()) < 200


def rounds_seeing(gathered: list[Any], index: int = 0):
    """A group's rank 0 whose matchmaking (a stand-in) formed a round of the `gathered` announcements, its own at
    `index`."""
    from diloco.swarm.rounds.group_round import GroupRounds
    from diloco.swarm.rounds.layout import Shape
    from diloco.swarm.rounds.matchmaker import Match
    from diloco.swarm.rounds.report import RoundReport

    matcher = SimpleNamespace(match=lambda round_index, mine, stop: (Match(b"g" * 20, gathered, index),
                                                                     RoundReport(len(gathered), 0.0, 0, 0, True)))
    return GroupRounds(matcher, rank=0, shape=Shape("FULL_SHARD", 1), model_shapes=[(4,)],
                       endpoints=[(("127.0.0.1",), 1)], broadcast=lambda o: o, listener=None, codec=tcp.RAW,
                       timeout=1.0, replicas=None)  # fmt: skip


def announcement(port: int, weight: float = 1.0, outer_step: int = 2) -> dict[str, Any]:
    return {"shape": ["FULL_SHARD", 1, 1], "endpoints": [[["127.0.0.1"], port]], "weight": weight,
            "outer_step": outer_step, "keys": ["00" * 32]}  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    ["junk", {"shape": "x"}, {"shape": ["FULL_SHARD", 1, 1], "endpoints": [[["h"], "port"]], "weight": 1},
     {"shape": ["FULL_SHARD", 10**400, 1], "endpoints": [], "weight": 1}, announcement(3, weight=float("nan")),
     {"shape": ["FULL_SHARD", 1, 1], "endpoints": 5, "weight": 1, "outer_step": 2}],
    ids=["a string", "a shape of one word", "a port that is no number", "a huge rank count", "a NaN weight",
         "endpoints that are no list"],
)  # fmt: skip
def test_an_unreadable_announcement_is_left_out_and_the_round_goes_on(bad: Any) -> None:
    """Every member reads the same announcements, so all leave out the same unreadable one and average together
    without it (a stranger's garbage in matchmaking used to make the round fail for every group in it)."""
    rounds = rounds_seeing([announcement(1), bad, announcement(2)])
    info, groups, ok, behind = rounds._match(3, 1.0, lambda: False, outer_step=2)
    assert ok and not behind and groups == 2 and info is not None
    assert [m.endpoints[0] for m in info.members] == [(("127.0.0.1",), 1), (("127.0.0.1",), 2)] and info.me == 0
    assert rounds.malformed == 1
