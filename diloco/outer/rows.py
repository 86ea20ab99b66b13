"""The metrics row of an outer step (``metrics.jsonl``): what a round did, and the state it left the group in.

Collective over the group's ranks: the byte counts and the pseudo-gradient's norm are summed over them, and
``params_sha256`` hashes the whole model (``Group.sha``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from diloco.outer.links import Group, RoundResult


def round_row(
    group: Group,
    step: int,
    outer_step: int,
    digest: str,
    *,
    source: int | None,
    report: RoundResult | None = None,
    num_peers: int = 0,
    pseudo_gradient: torch.Tensor | None = None,
    with_sha: bool = True,
) -> dict[str, Any]:
    """The row at inner step `step`: the outer step and digest, the round's figures when there was one (`report`),
    the world rank of the group whose state was loaded (`source`), and with `with_sha` the model's hash."""
    sha = group.sha() if with_sha else None
    # outer_digest: of the outer parameters, equal in groups that share the swarm's state (the model itself
    # differs after a round that applied nothing, until the next one)
    row: dict[str, Any] = {"step": step, "outer_step": outer_step, "outer_digest": digest}
    if source is not None:
        row["loaded_state_from"] = source  # world rank of the group this one downloaded the state from
    if report is not None and pseudo_gradient is not None:
        row |= {
            "num_peers": num_peers,
            "averaging_s": report.seconds,
            "wait_s": report.seconds - report.allreduce_seconds,  # idle until the round's group formed
            "bytes_sent": int(group.sum(float(report.bytes_sent))),  # all ranks of the group
            "bytes_received": int(group.sum(float(report.bytes_received))),
            # of both, over connections other groups' ranks opened (0 in a group nobody can dial); the rest went over
            # connections this group's ranks opened
            "bytes_inbound": int(group.sum(float(report.bytes_inbound))),
            # of both, those that crossed a relay (to or from a rank dialled at one: diloco dht --relay-ports)
            "bytes_relayed": int(group.sum(float(report.bytes_relayed))),
            "rejected": int(group.sum(float(report.rejected))),
            "dropped": int(group.sum(float(report.dropped))),
            "pseudo_grad_norm": math.sqrt(group.sum(float(pseudo_gradient.square().sum()))),
        }
        if report.transport:
            row["transport"] = report.transport  # what carried this rank's bytes: tcp or p2pd
        if report.round_id:
            row["round"] = report.round_id  # equal in the rows of the groups that averaged together
        if report.behind:
            row["sat_out"] = True  # behind the round's others' outer step: it applied nothing
    if with_sha:
        row["params_sha256"] = sha
    return row
