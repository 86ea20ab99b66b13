"""The parsers of what peers send, fuzzed in process (`diloco.bench.fuzz`): seeded malformed, truncated, oversized,
wrong-typed and deeply nested inputs are refused, never crash a parser and never hang it."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from diloco.bench import fuzz

INPUTS, SEED = 2000, 1
TARGETS = [
    "progress.from_dict", "status.from_dict", "budget.RoundTokens.from_dict", "progress.read", "status.read",
    "budget.parse", "swarm_key.opened", "swarm_key.member_signed", "group_round.announced", "transfer._meta",
    "catchup.META", "codec.none", "codec.fp16", "codec.int8", "codec.int4", "frames.receive",
]  # fmt: skip


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return fuzz.run_fuzz(INPUTS, SEED, tmp_path_factory.mktemp("fuzz"), sockets=False, dht=False)


def test_every_parser_is_fuzzed_and_the_counts_add_up(result: dict[str, Any]) -> None:
    assert list(result["targets"]) == TARGETS
    targets = result["targets"].values()
    assert INPUTS * 0.9 <= result["inputs"] == sum(t["inputs"] for t in targets) <= INPUTS * 1.1
    assert all(t["inputs"] == t["accepted"] + t["refusals"] + t["crashes"] + t["hangs"] for t in targets)
    assert result["crashes"] == sum(t["crashes"] for t in targets)


@pytest.mark.parametrize("target", TARGETS)
def test_a_parser_refuses_malformed_input_and_neither_crashes_nor_hangs(result: dict[str, Any], target: str) -> None:
    tally = result["targets"][target]
    assert tally["crashes"] == 0 and tally["hangs"] == 0, tally["examples"]
    assert tally["refusals"] >= tally["inputs"] // 4  # many inputs are malformed: refused, and counted so
    assert tally["accepted"] > 0  # inputs close to valid ones get past the first check


def test_the_inputs_follow_the_seed(tmp_path: Path) -> None:
    first, again = (fuzz.run_fuzz(200, 5, tmp_path, sockets=False, dht=False) for _ in range(2))
    counts = [{name: (t["accepted"], t["refusals"]) for name, t in r["targets"].items()} for r in (first, again)]
    assert counts[0] == counts[1]


def test_a_crash_is_counted_with_its_input_and_traceback() -> None:
    def parse(value: Any) -> None:
        if value == 3:
            raise KeyError("boom")
        raise fuzz.Refused()

    target = fuzz.Target("demo", [1, 2, 3], lambda m, seed: seed, parse)
    mutator, watchdog = fuzz.Mutator(random.Random(0)), fuzz.Watchdog(hang_s=0.5)
    tally = fuzz.fuzz_target(target, 30, mutator, watchdog)
    assert tally.inputs == 30 and tally.crashes > 0 and tally.refusals == 30 - tally.crashes
    assert tally.examples[0]["input"] == "3" and "KeyError: 'boom'" in tally.examples[0]["error"]
    hang = fuzz.Target("slow", [0], lambda m, seed: seed, lambda value: time.sleep(1))
    assert fuzz.fuzz_target(hang, 1, mutator, watchdog).hangs == 1


def test_the_report_has_a_row_per_target(result: dict[str, Any]) -> None:
    doc = fuzz.markdown(result)
    assert f"{result['inputs']:,} inputs (seed {SEED})" in doc
    assert all(f"| `{name}` | " in doc for name in TARGETS)
