"""`diloco bench nat`: a public group and two groups behind home routers (nftables NAT, 100 Mbit/s uplinks) in network
namespaces, then the two homes alone through a relay; the figures come from the groups' own rows and logs, and the
namespaces are gone afterwards. Needs root and nft."""

from __future__ import annotations

import pytest

from tests.support.bench import bench
from tests.support.netns import assert_none_left, namespaces

pytestmark = pytest.mark.xdist_group("netns")


@pytest.mark.slow
def test_nat_quick(tmp_path) -> None:
    before = namespaces()
    data, doc = bench("nat", tmp_path, timeout=720)
    paths = [(g["where"], g["ranks"], g["path"]) for g in data["groups"]]
    assert paths == [("public", 1, "direct"), ("home 1", 1, "outbound only"), ("home 2", 2, "outbound only")]
    steps, local = data["setup"]["steps"], data["setup"]["local_steps"]
    for group in data["groups"]:
        assert 1 <= group["full_rounds"] <= group["rounds"] == steps // local, group
        assert group["bytes_sent"] > 0 and group["bytes_received"] > 0 and group["median_wire_s"] > 0, group
        assert (group["bytes_inbound"] > 0) == (group["path"] == "direct"), group  # nobody dialled the homes
    homes = data["groups"][1:]
    # a home's ideal is its larger direction over its 100 Mbit/s uplink, and no round beats the bandwidth
    assert all(g["ideal_s"] == pytest.approx(max(g["bytes_sent"], g["bytes_received"]) * 8 / 100e6) for g in homes)
    assert data["groups"][0]["ideal_s"] is None and data["round_vs_ideal"] >= 0.9, data
    assert data["swarm_rounds"] >= 1 and "| home 2 | 2 | outbound only |" in doc and "×** the ideal" in doc
    assert all(g["bytes_relayed"] == 0 for g in data["groups"])
    # the homes alone: both relayed, both reduce (dialled at the relay), and every byte crosses the relay
    relayed = data["relayed"]
    assert [(g["where"], g["ranks"], g["path"]) for g in relayed["groups"]] == [("home 1", 1, "relayed"),
                                                                                ("home 2", 2, "relayed")]
    for group in relayed["groups"]:
        assert group["bytes_inbound"] > 0 and group["bytes_relayed"] == group["bytes_sent"] + group["bytes_received"]
        assert group["ideal_s"] == pytest.approx(max(group["bytes_sent"], group["bytes_received"]) * 8 / 100e6)
    assert relayed["swarm_rounds"] >= 1 and relayed["round_vs_ideal"] >= 0.9 and "| home 2 | 2 | relayed |" in doc
    assert_none_left(before, set(data["namespaces"]) | set(relayed["namespaces"]))
