"""A stranger that forges round-token records (``diloco.swarm.records.budget``) for the token-budget tests: it starts a
DHT peer of its own, reads the groups' records under the run's tokens key, and every half second stores, signed with
its own key,

- for world rank 1 and world ranks 3 .. 19: 10**15 tokens at 10**12 tokens/s, at the outer step the groups train
  for (as it reads it from their records): were they counted, every group's estimate would reach any budget at once;
- for world rank 2: a record of outer step 10**6, a claim that a group is far ahead (no progress record backs it).

It prints a line per store, for ROUNDS seconds.

Usage: python -m tests.support.forged_tokens RUN_ID SECONDS INITIAL_PEER...
"""

from __future__ import annotations

import sys
import time

from diloco.swarm.records import budget
from diloco.swarm.records.budget import RoundTokens
from diloco.swarm.records.dht import start_dht
from diloco.swarm.records.ownership import Owner, owned_records

HUGE = 10**15
AHEAD = 10**6
FILLED = (1, *range(3, 20))  # world ranks of 10**15 tokens: one in a galaxy of 3, the rest outside it


def forge(dht, owner: Owner, run_id: str, seconds: float) -> None:
    """Mirror the groups' outer step with records of huge tokens, and claim outer step 10**6, every 0.5 s."""
    key = budget.tokens_key(run_id)
    deadline, stores = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        found = owned_records(dht.get(key, latest=True), RoundTokens.from_dict)
        honest = [record for signer, record in found if signer != owner.id]
        step = max((r.outer_step for r in honest if r.outer_step < AHEAD), default=0)
        now = time.time()
        for world_rank in FILLED:
            record = RoundTokens(world_rank, step, HUGE, 10.0**12, now)
            budget.publish(dht, key, record, owner.subkey(world_rank))
        budget.publish(dht, key, RoundTokens(2, AHEAD, HUGE, 10.0**12, now), owner.subkey(2))
        stores += 1
        print(f"forged token records {stores}: {HUGE} tokens at outer step {step}, outer step {AHEAD}", flush=True)
        time.sleep(0.5)


def main(run_id: str, seconds: float, peers: list[str]) -> None:
    owner = Owner.ephemeral()
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                    validator=owner.validator)  # fmt: skip
    try:
        forge(dht, owner, run_id, seconds)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    run, seconds, *initial = sys.argv[1:]
    main(run, float(seconds), initial)
