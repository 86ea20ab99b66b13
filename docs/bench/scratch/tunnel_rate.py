"""Scratch run (docs/allreduce.md): `bench allreduce`'s groups-p2pd arm on loopback only (whole-group rounds over
libp2p streams through two p2pd daemons), for one tree of the code. Run it on two trees one after the other, with
nothing else on the machine, to compare two versions of the tunnel on the same host and load.
Run from the repository root of the tree to measure:
PYTHONPATH=. python docs/bench/scratch/tunnel_rate.py OUT.json [PEERS ...]   (peers default: 2)

It reports throughput only, so the bench's PSS sampling is switched off: reading a peer's PSS walks its page tables
(smaps_rollup), and every 0.2 s over 600 MB tensors that took 20-40% of the rounds' throughput on this 2-core host.
Trees from before the bench timed its rounds without it are measured the same way."""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diloco import procs
from diloco.bench import allreduce

SIZES = (10_000_000, 50_000_000, 150_000_000)
ROUNDS = 5  # the median is not the first, cold round


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    procs.tree_pss_mb = lambda pids: 0.0  # see the docstring: the same in every tree measured
    out, peers = Path(sys.argv[1]), [int(k) for k in sys.argv[2:]] or [2]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"commit": commit, "load_start": load(), "started": time.time(), "rows": []}
    with tempfile.TemporaryDirectory(prefix="tunnel-rate-") as work:
        with allreduce.places((max(peers), None), work_dir=Path(work)) as (at,):
            for k in peers:
                for row in allreduce.swarm_arm(SIZES, ["groups-p2pd"], k, ROUNDS, at):
                    row.pop("reports")
                    result["rows"].append(row)
                    cpu = {kind: round(v, 2) for kind, v in row["cpu_s_median"].items()}
                    print(f"{commit} k={k} {row['bytes'] / 1e6:.0f} MB: median {row['median_s']:.2f} s, "
                          f"{row['mb_s']:.0f} MB/s per peer, rounds {[round(s, 2) for s in row['allreduce_s']]}, "
                          f"CPU {cpu}", flush=True)  # fmt: skip
    result["load_end"] = load()
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"load {result['load_start']} -> {result['load_end']}")


if __name__ == "__main__":
    main()
