"""`diloco bench scale --quick`: a 2-rank group on a small and a large generated corpus (the large one's token store
built by the first run, reused by the second), each rank's peak RSS, a 2-rank group loading a model fresh and from a
checkpoint, the outer path of three groups (one late), and a BPE tokenizer trained and timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.paths import DILOCO
from tests.support.procs import assert_ok, run_cmd


@pytest.mark.slow
def test_scale_quick(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    assert_ok(run_cmd([str(DILOCO), "bench", "scale", "--quick", "--out", str(tmp_path), "--doc", str(doc)],
                      timeout=600))  # fmt: skip
    data = json.loads((tmp_path / "scale-quick.json").read_text())
    small, cold, warm = data["runs"]
    assert [r["name"] for r in data["runs"]] == ["small", "large-cold", "large-warm"]
    assert small["built"] is not None and cold["built"] is not None and warm["built"] is None  # reused
    assert cold["corpus_mb"] == pytest.approx(data["setup"]["large_mb"], rel=0.01)
    assert cold["built"]["tokens"] > cold["corpus_mb"] * 1e6 * 0.99 and cold["built"]["mb_per_s"] > 0  # bytes: 1 id each
    assert data["store_mb"] == pytest.approx(2 * cold["built"]["tokens"] / 1e6)  # uint16 ids
    for run in data["runs"]:
        assert len(run["peak_rss_mb"]) == 2 and min(run["peak_rss_mb"]) > 50 and run["data_ready_s"] >= 0, run
    assert warm["data_ready_s"] < cold["data_ready_s"]  # nothing to tokenize the second time
    assert data["rss_added_mb"] == pytest.approx(
        max(max(cold["peak_rss_mb"]), max(warm["peak_rss_mb"])) - max(small["peak_rss_mb"]))
    ld = data["load"]
    assert ld["model"] == "llama-14m-fresh" and ld["params"] > 10e6 and ld["weights_mb"] >= ld["float32_mb"] * 0.99
    assert ld["target_mb"] == pytest.approx(0.6 * ld["float32_mb"] + 1000)
    assert [run["name"] for run in ld["runs"]] == ["fresh", "checkpoint"]
    for run in ld["runs"]:
        assert len(run["loaded_peak_mb"]) == len(run["run_peak_mb"]) == 2 and min(run["loaded_peak_mb"]) > 50, run
        assert max(run["loaded_peak_mb"]) <= max(run["run_peak_mb"]) + 1, run  # the whole run includes the load
        assert run["shares"] == pytest.approx([(m - ld["floor_mb"]) / ld["float32_mb"] for m in run["loaded_peak_mb"]])
        assert run["met"] == (max(run["loaded_peak_mb"]) <= ld["target_mb"])
    outer = data["outer"]
    assert outer["setup"]["model"] == "llama-2m-fresh" and len(outer["groups"]) == 3
    assert all(g["rounds"] >= 2 for g in outer["groups"]), outer["groups"]  # the late one too, after its download
    assert outer["groups"][2]["download_mb"] > 0 and outer["resumed"]["resume_s"] > 0
    for key, seconds in outer["seconds"].items():
        assert seconds is not None and seconds >= 0, key
        assert outer["seconds_per_gb"][key] == pytest.approx(seconds / outer["float32_gb"])
    assert outer["held_met"] == (max(g["held_ratio"] for g in outer["groups"]) <= 1.25)
    bpe = data["bpe"]
    assert bpe["vocab"] == 8192 and bpe["dtype"] == "uint16" and bpe["mb_per_s"] > 0
    assert 1e5 < bpe["tokens_per_mb"] < 1e6  # BPE: fewer ids than bytes
    assert isinstance(data["rss_met"], bool) and isinstance(data["warm_ready_met"], bool)
    section = doc.read_text()
    assert "## scale (quick): " in section and "| large-warm | 20 | no (reused) | – |" in section
    assert "- BPE (byte-level, 8192 ids, trained here with `tokenizers`" in section
    assert "Loading a model: llama-14m-fresh (" in section and "| checkpoint | " in section
    assert "The outer path: llama-2m-fresh (" in section and "| 2 (late) | " in section
