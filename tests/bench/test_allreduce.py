"""`diloco bench allreduce`: averaging rounds of both transports against a socket, a p2pd stream and gloo on loopback
and on a shaped link between network namespaces; every figure measured and consistent, nothing left behind. Needs
root."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import math
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from diloco.bench import BenchError, allreduce
from tests.support.netns import namespaces
from tests.support.paths import DILOCO, ROOT
from tests.support.procs import child_env

MARK = "DILOCO_TEST_ALLREDUCE"  # an environment variable every process the bench starts inherits


def marked(mark: str, ignore: tuple[str, ...] = ()) -> list[str]:
    """Command lines of the running processes (zombies and those named in ``ignore`` aside) whose environment
    holds MARK=mark."""
    found = []
    for proc in psutil.process_iter(["cmdline", "name"]):
        with contextlib.suppress(psutil.Error):
            mine = proc.environ().get(MARK) == mark and proc.info["name"] not in ignore
            if mine and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(proc.info["cmdline"] or []))
    return found


def wait_none_marked(mark: str, ignore: tuple[str, ...] = (), timeout: float = 10.0) -> list[str]:
    """Wait until no marked process runs (they exit on their own within a second or two); the survivors."""
    deadline = time.monotonic() + timeout
    while (left := marked(mark, ignore)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def expected_arms() -> list[str]:
    """Both transports once SwarmAverager has the parameter, hivemind's p2pd path alone before; and the trainer's
    rounds of whole groups once there are any, over p2pd too once they can be, and keyed once rounds are sealed."""
    from diloco.bench.averager import SwarmAverager

    arms = ["tcp", "p2pd"] if "transport" in inspect.signature(SwarmAverager).parameters else ["p2pd"]
    arms += ["groups"] if importlib.util.find_spec("diloco.swarm.rounds.group_round") else []
    arms += ["groups-p2pd"] if importlib.util.find_spec("diloco.swarm.rounds.tunnel") else []
    return arms + (["groups-keyed"] if importlib.util.find_spec("diloco.swarm.rounds.frames") else [])


def run_quick(tmp_path: Path, mark: str) -> tuple[dict, str, int]:
    """`diloco bench allreduce --quick` with MARK set; (its JSON, the markdown it appended, its pid)."""
    doc = tmp_path / "benchmarks.md"
    command = [str(DILOCO), "bench", "allreduce", "--quick", "--out", str(tmp_path), "--doc", str(doc)]
    proc = subprocess.Popen(command, cwd=ROOT, env=child_env() | {MARK: mark}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its workers exit once it is gone
        out, _ = proc.communicate()
        raise AssertionError(f"bench allreduce --quick timed out:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    return json.loads((tmp_path / "allreduce-quick.json").read_text()), doc.read_text(), proc.pid


def check_swarm(row: dict, peers: int, rounds: int) -> None:
    """Each transport's row: every peer completed every round with the whole group, times and bytes consistent."""
    for transport, sw in row["arms"].items():
        assert sw["transport"] == transport and sw["peers"] == peers
        assert sw["bytes"] == 4 * sw["size"] == row["bytes"]
        assert len(sw["allreduce_s"]) == len(sw["reports"]) == rounds
        for reports in sw["reports"]:
            assert len(reports) == peers
            for report in reports:
                assert report["ok"] and report["num_peers"] == peers, report
                carrier = {"groups-p2pd": "p2pd"}.get(transport, "tcp" if "groups" in transport else transport)
                assert report.get("transport", carrier) == carrier, report
                assert 0 < report["allreduce_s"] <= report["round_s"], report
                # each peer sends (k-1)/k of its values and the average of its 1/k to k-1 peers, receives as much
                assert report["bytes_sent"] >= 2 * (peers - 1) / peers * sw["bytes"], report
                assert report["bytes_received"] >= 2 * (peers - 1) / peers * sw["bytes"], report
            assert len({report["checksum"] for report in reports}) == 1
        assert sw["median_s"] > 0 and sw["mb_s"] == pytest.approx(sw["bytes"] / sw["median_s"] / 1e6)
        cpu = sw["cpu_s_median"]
        assert cpu["averager"] + cpu["caller"] > 0, cpu
        if transport in ("p2pd", "groups-p2pd"):
            assert cpu["p2pd"] > 0, cpu  # the bytes go through the daemons
        assert sw["tree_peak_rss_mb"] > 0
        # measured, not checked: at 1 MB the PSS of shared libraries moving between processes (the suite's) swamps
        # it (-2.8 seen under load); the full run's 40-600 MB tensors are what the column is for
        assert sw["tree_peak_pss_mb"] > 0 and math.isfinite(sw["held_per_payload"])


def check_gloo(gloo: dict, nbytes: int) -> None:
    assert gloo["best_s"] == min(gloo["seconds"]) > 0
    assert gloo["mb_s"] == pytest.approx(nbytes / gloo["best_s"] / 1e6)


@pytest.mark.slow
def test_allreduce_quick(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    before = namespaces()
    data, doc, pid = run_quick(tmp_path, mark)
    arms = expected_arms()
    assert data["quick"] is True and data["arms"] == arms and set(data["skipped"]) == {"tcp", "p2pd"} - set(arms)
    assert data["plan"]["sizes"] == list(allreduce.QUICK_SIZES) and data["plan"]["peers"] == [2]
    rounds = data["plan"]["rounds"]

    (row,) = data["loopback"]["rows"]
    assert (row["size"], row["peers"]) == (allreduce.QUICK_SIZES[0], 2) and list(row["arms"]) == arms
    check_swarm(row, 2, rounds)
    check_gloo(row["gloo"], row["bytes"])
    for stream in (row["socket_stream"], row["p2pd_stream"]):
        assert stream["bytes"] == row["bytes"] and stream["best_s"] == min(stream["seconds"]) > 0
        assert stream["mb_s"] == pytest.approx(stream["bytes"] / stream["best_s"] / 1e6)

    shaped = data["shaped"]
    rate = shaped["rate_mbit"] * 1e6 / 8  # bytes/s
    assert shaped["rate_mbit"] == 1000 and "netem" in shaped["latency"]
    for stream in (shaped["tcp_stream"], shaped["p2pd_stream"]):
        assert 0 < stream["mb_s"] * 1e6 <= 1.05 * rate, stream  # the shaping holds: nothing beats the link
    (link,) = shaped["rows"]
    k, payload = link["peers"], link["bytes"]
    assert link["size"] == allreduce.QUICK_SHAPED_SIZES[0] and list(link["arms"]) == arms
    assert link["required_bytes"] == pytest.approx(2 * (k - 1) / k * payload)
    assert link["link_bytes_per_s"] == pytest.approx(rate)
    assert link["ideal_s"] == pytest.approx(link["required_bytes"] / link["link_bytes_per_s"])
    check_swarm(link, 2, rounds)
    check_gloo(link["gloo"], payload)
    assert link["gloo_ratio"] == pytest.approx(link["gloo"]["best_s"] / link["ideal_s"]) and link["gloo_ratio"] > 0.9
    for sw in link["arms"].values():
        assert sw["ratio"] == pytest.approx(sw["median_s"] / link["ideal_s"]) and sw["ratio"] > 0.9  # ≥ bytes ÷ rate
        for per_round in sw["kernel_sent"] + sw["kernel_received"]:
            assert len(per_round) == 2 and all(sent >= link["required_bytes"] for sent in per_round), per_round

    assert "## allreduce (quick): " in doc and "- command: `diloco bench allreduce --quick --out " in doc
    assert "| parameters | payload MB | peers | diloco tcp s | diloco tcp MB/s per peer | hivemind p2pd s |" in doc
    hv = row["arms"]["p2pd"]
    tcp = f"{row['arms']['tcp']['median_s']:.2f} | {row['arms']['tcp']['mb_s']:.0f}" if "tcp" in arms else "– | –"
    assert f"| 0.25M | 1 | 2 | {tcp} | {hv['median_s']:.2f} | {hv['mb_s']:.0f} |" in doc
    assert "| parameters | peers | transport | round s | averager CPU s | p2pd CPU s |" in doc
    if "groups-p2pd" in arms:  # the trainer's path, over tcp and p2pd: columns after p2pd's, in both tables
        keyed = "diloco groups keyed s | diloco groups keyed MB/s per peer | " if "groups-keyed" in arms else ""
        assert ("hivemind p2pd MB/s per peer | diloco groups s | diloco groups MB/s per peer | diloco groups p2pd s | "
                f"diloco groups p2pd MB/s per peer | {keyed}gloo s |") in doc
        assert ("| ratio | diloco groups s | ratio | diloco groups p2pd s | ratio | ") in doc
        keyed = " / groups-keyed" if "groups-keyed" in arms else ""
        assert f"| gloo s | gloo ratio | kernel MB out tcp / p2pd / groups / groups-p2pd{keyed} |" in doc
    assert "| parameters | peers | required MB out | ideal s | diloco tcp s | ratio | hivemind p2pd s |" in doc
    assert "netem qdisc is missing" in doc and "- quick: payloads this small" in doc
    for transport in arms:
        name = allreduce.ARMS[transport]
        assert f"Shaped: worst {name} ratio" in doc and f"Loopback: best {name} " in doc
        assert f"| 0.25M | 2 | {name} | " in doc
    assert ("- diloco tcp: not measured" in doc) == ("tcp" not in arms)
    retried = [sw for r in (row, link) for sw in r["arms"].values() if sw["failed_rounds"]]
    assert ("Every averaging round completed" in doc) == (not retried), retried
    # a machine without network namespaces (a lent GPU box) gets the loopback tables and says why not the rest
    loopback_only = allreduce.markdown(data | {"shaped": None, "no_shaped": "needs ip, tc"})
    assert "Shaped link: not measured (it needs network namespaces: needs ip, tc)." in loopback_only
    assert "| 0.25M | 1 | 2 |" in loopback_only and "ideal s" not in loopback_only

    assert wait_none_marked(mark) == []  # workers, DHTs, averagers, p2pd daemons
    tag = f"dl{pid % 100000}"  # netns.hosts names everything after the bench's pid
    assert not {name for name in namespaces() - before if name.startswith(tag)}
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert f"{tag}br" not in links and f"{tag}h0" not in links


@pytest.mark.slow
def test_failed_peer_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers that die once their DHT runs (a negative tensor size): one-line BenchError naming the exit and the
    error, and no worker, DHT process or p2pd daemon left, the bootstrap DHT started here included."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    with pytest.raises(BenchError, match=r"exited with code 1 before READY: .*negative dimension") as failed:
        with allreduce.places((2, None), work_dir=tmp_path) as (at,):
            allreduce.swarm_arm((-1,), ["p2pd"], 2, 1, at)
    assert "\n" not in str(failed.value)
    # the bootstrap DHT started in this process left torch's shared-memory helper, which ends with this process
    helper = ("torch_shm_manager",)
    assert wait_none_marked(mark, ignore=helper) == []
    assert [p.name() for p in psutil.Process().children(recursive=True) if p.name() not in helper] == []


def test_ideal_is_bytes_over_bandwidth() -> None:
    """2 peers: each sends its half and the average of the other half: the whole payload at 125 MB/s."""
    two = allreduce.ideal(10_000_000, 2, 1000.0)
    assert two["required_bytes"] == 40e6 and two["link_bytes_per_s"] == 125e6
    assert two["ideal_s"] == pytest.approx(0.32)
    four = allreduce.ideal(10_000_000, 4, 1000.0)
    assert four["required_bytes"] == 60e6 and four["ideal_s"] == pytest.approx(0.48)
