"""The fuzz bench (`diloco.bench.fuzz`) in full: the parsers in process, a live listener and a live relay fed
malformed, truncated, oversized and trickled connections (an honest round completes on the listener afterwards, and
the relay leases every port to an honest rank), and malformed records stored in a real DHT and read back; its result
and report."""

from __future__ import annotations

import json
from pathlib import Path

from diloco.bench import fuzz, mutator


def test_fuzz_small_run_reports_every_target_and_leaves_the_listener_working(tmp_path: Path) -> None:
    result = fuzz.run_fuzz(3000, 3, tmp_path)  # ~20 s: the listener and DHT targets get ~50 and ~10 inputs
    assert json.loads((tmp_path / "fuzz.json").read_text()) == json.loads(json.dumps(result, default=str))
    targets = result["targets"]
    assert {"listener.round_hello", "listener.state_request", "relay.control", "dht.read", "codec.int8",
            "progress.read"} <= set(targets)  # fmt: skip
    for name, tally in targets.items():
        assert tally["inputs"] > 0 and tally["inputs"] == (tally["accepted"] + tally["refusals"] + tally["crashes"]
                                                           + tally["hangs"]), name  # fmt: skip
        assert tally["hangs"] == 0 and tally["crashes"] == 0, (name, tally["examples"])
        assert tally["seconds"] >= 0 and len(tally["examples"]) <= mutator.EXAMPLES
    assert targets["listener.state_request"]["refusals"] > 0 and targets["dht.read"]["refusals"] > 0
    assert result["inputs"] == sum(t["inputs"] for t in targets.values())
    assert result["hangs"] == result["crashes"] == 0
    assert result["seed"] == 3 and len(result["load_average"]) == 3
    assert result["honest_round_before"] == "completed" and result["honest_round"] == "completed"
    assert result["listener_refused"] > 0 and result["listener_threads_left"] == 0
    assert targets["relay.control"]["refusals"] > 0
    assert result["relay_ports_free_after"] == "4 of 4" and result["relay_honest_lease"] == "carried a connection"
    doc = fuzz.markdown(result)
    assert "An honest round on the fuzzed listener afterwards: **completed**" in doc
    assert "an honest lease **carried a connection**" in doc
    assert all(f"| `{name}` | " in doc for name in targets)
