"""The flood bench (`diloco.bench.flood`), quick: a rank process under a flood of held connections and state
requests from an address of its own, while an honest peer averages with it and downloads its state; its result
and report. The rank and the flood are gone afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from diloco.bench import flood


@pytest.mark.slow
def test_flood_quick_bounds_the_rank_and_lets_honest_work_through(tmp_path: Path) -> None:
    result = flood.run_flood(tmp_path, quick=True)
    assert json.loads((tmp_path / "flood.json").read_text()) == result
    knobs = flood.sizes(True)
    assert result["quick"] and result["state_bytes"] == 2 * 4 * knobs["state_numel"]
    assert result["connections_opened"] >= knobs["connections"] and result["state_requests"] > 0
    assert result["refused"] > 0 and result["connections_closed_by_rank"] > 0  # the caps and deadlines at work
    assert result["honest_rounds"] >= 1 and result["honest_rounds_ok"] == result["honest_rounds"]
    assert result["honest_downloads"] >= 1 and result["honest_downloads_ok"] == result["honest_downloads"]
    assert result["peak_rss_after_bytes"] >= result["peak_rss_before_bytes"] > 0
    assert result["peak_rss_growth_bytes"] <= result["state_bytes"] * 1.5, result  # one copy, and some slack
    # the rank's state holds still during the flood: every answer reads it live, none costs a copy
    assert result["state_copies_taken"] == 0 and len(result["load_average"]) == 3
    doc = flood.markdown(result)
    assert "connections held from" in doc and "honest downloads ok" in doc
    assert not [p for p in psutil.Process().children(recursive=True) if "diloco.bench.flood" in " ".join(p.cmdline())]
