"""`diloco bench wire`: workers in network namespaces, bytes counted by the kernel and by the trainer; the
namespaces and every process are gone afterwards, also when an arm fails. Needs root (`ip netns`)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from diloco.bench import BenchError, netns, wire
from diloco.bench.arms import Workload
from tests.support.bench import bench
from tests.support.netns import assert_none_left, namespaces

ARMS = ["diloco-none", "diloco-int8", "diloco-sparse", "ddp"]  # the quick run's: no fp16
DILOCO = ARMS[:3]


def used_namespaces(data: dict) -> set[str]:
    """The namespaces the bench ran its workers in, read from the commands it recorded."""
    commands = [c for arm in data["arms"] for c in arm["commands"]]
    return {m.group(1) for c in commands if (m := re.match(r"ip netns exec (\S+) ", c))}


def sent(arm: dict, worker: int, counter: str) -> int:
    return arm["workers"][worker][f"{counter}_sent_bytes"]


def per_worker_total(arm: dict) -> float:
    """OS-counted bytes sent + received, mean of the workers."""
    return sum(w["os_sent_bytes"] + w["os_received_bytes"] for w in arm["workers"]) / len(arm["workers"])


@pytest.mark.slow
def test_wire_quick(tmp_path: Path) -> None:
    before = namespaces()
    data, doc = bench("wire", tmp_path, timeout=480)  # 80 s alone, 206 s seen under the suite's load
    arms = {arm["name"]: arm for arm in data["arms"]}
    assert list(arms) == ARMS
    assert data["model"] == "llama-2m-fresh" and data["parameters"] > 100_000
    assert data["parameter_bytes"] == 4 * data["parameters"]
    rounds = data["inner_steps"] // data["local_steps"]
    assert rounds >= 2 and data["outer_rounds"] == {name: rounds for name in DILOCO}
    for name in DILOCO:
        arm = arms[name]
        assert arm["inner_steps"] == [data["inner_steps"]] * 2
        # every round ran; under load a matchmaking split can leave a round to each worker alone (no bytes):
        # both workers then count the same rounds with all peers, and the bytes per such round are compared below
        assert arm["outer_rounds"] == [rounds, rounds], arm
        assert 1 <= arm["rounds_with_all_peers"][0] == arm["rounds_with_all_peers"][1] <= rounds, arm
        for w in arm["workers"]:
            assert w["os_sent_bytes"] > w["payload_sent_bytes"] > 0, (name, w)
            assert w["os_received_bytes"] > w["payload_received_bytes"] > 0, (name, w)
            assert w["difference_sent_bytes"] == w["os_sent_bytes"] - w["payload_sent_bytes"]
            assert w["ratio_sent"] == pytest.approx(w["os_sent_bytes"] / w["payload_sent_bytes"])
        assert arm["dht_os_sent_bytes"] > 0 and arm["dht_os_received_bytes"] > 0
    # two peers, butterfly all-reduce: each sends half its tensor and the averaged other half, about the model
    none, int8, sparse = (sent(arms[n], 0, "payload") / arms[n]["rounds_with_all_peers"][0] for n in DILOCO)
    assert data["parameter_bytes"] <= none < 1.01 * data["parameter_bytes"]
    assert 0.2 < int8 / none < 0.3
    assert sparse / none < 0.05  # a 64th of each 64-value row and its scale, sent and relayed
    ddp = arms["ddp"]
    computed = data["parameter_bytes"] * data["inner_steps"]  # 2·(n−1)/n = 1 for n = 2
    for w in ddp["workers"]:
        assert w["payload_sent_bytes"] == w["payload_received_bytes"] == computed
        assert w["os_sent_bytes"] > computed and w["os_received_bytes"] > computed
    assert ddp["payload"] == "computed" and ddp["inner_steps"] == [data["inner_steps"]] * 2
    assert per_worker_total(ddp) > per_worker_total(arms["diloco-none"])
    for name in DILOCO:
        expected = per_worker_total(ddp) / per_worker_total(arms[name])
        assert data["ddp_over_diloco"][name]["os"] == pytest.approx(expected)
    assert data["ddp_over_diloco"]["diloco-none"]["os"] > 1
    # per round with both workers: a round a matchmaking split left to each worker alone sends no payload, and the
    # state download that repairs the split (the whole outer state and momentum, uncompressed) counts in the kernel's
    # total: the totals compare only when every round of both arms had both workers (under the suite's load, int8 once
    # had 1 round of 3 with both and 12 MB sent, 45 times its payload); the payloads above compare in any case
    per_round = {n: per_worker_total(arms[n]) / arms[n]["rounds_with_all_peers"][0] for n in DILOCO}
    if all(arms[n]["rounds_with_all_peers"] == arms[n]["outer_rounds"] for n in ("diloco-none", "diloco-int8")):
        assert per_round["diloco-none"] > 2 * per_round["diloco-int8"], per_round
    assert "## wire (quick): " in doc and "- command: `diloco bench wire --quick --out " in doc
    assert "| arm | worker | OS sent (MB) | OS received (MB) | trainer sent (MB) |" in doc
    for name in ARMS:
        assert f"| {name} | 0 | " in doc and f"| {name} | 1 | " in doc
    assert "computed, not counted" in doc and "DDP ÷ DiLoCo" in doc
    used = used_namespaces(data)
    assert len(used) == 2
    assert_none_left(before, used)


def recording(made: list[netns.Host]):
    """A stand-in for `netns.hosts` that also appends the hosts it makes to `made`."""
    real = netns.hosts

    @contextmanager
    def hosts(count: int, **kwargs) -> Iterator[list[netns.Host]]:
        with real(count, **kwargs) as made_now:
            made.extend(made_now)
            yield made_now

    return hosts


@pytest.mark.slow
def test_failed_arm_leaves_no_namespace_and_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model folder without a config: the first arm's workers fail, the bench raises one line, and every
    namespace, bridge and process it made is gone (the DHT peers of all three arms were already running)."""
    before = namespaces()
    children_before = {c.pid for c in psutil.Process().children(recursive=True)}  # e.g. torch_shm_manager
    made: list[netns.Host] = []
    broken = Workload(tmp_path / "no-model", seq_length=32, per_device_batch=2, total_batch=2, steps=4, skip=0)
    (tmp_path / "no-model").mkdir()
    monkeypatch.setattr(wire, "wire_setup", lambda quick: wire.WireSetup(broken, local_steps=2, timeout_s=120.0, matchmaking_s=10.0))
    monkeypatch.setattr(wire.netns, "hosts", recording(made))
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    with pytest.raises(BenchError, match=r"diloco-none worker \d exited with code") as failed:
        wire.measure(True, work_dir, {})
    assert "\n" not in str(failed.value)
    assert len(made) == 6 and (work_dir / "dht-sparse.log").exists()  # all DHT peers had been started
    assert_none_left(before, {h.name for h in made})
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert not any(h.veth in links for h in made)
    addresses = [f"/ip4/{h.ip}/" for h in made]
    procs = psutil.process_iter(["cmdline"])
    mine = [p for p in procs if any(a in " ".join(p.info["cmdline"] or []) for a in addresses)]
    assert not mine, [p.info["cmdline"] for p in mine]  # the DHT peers and their p2pd daemons
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in children_before]
    assert not left, left
