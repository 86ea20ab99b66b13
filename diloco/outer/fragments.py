"""Which parameters each fragment holds, and where they sit in a rank's local buffer (Streaming DiLoCo's
fragments, ``--hv.fragments F``).

With F fragments the swarm averages one fragment per round, every H ÷ F inner steps, so each parameter is still
averaged once per H inner steps but at most a 1/F share of the model is on the wire at a time. A fragment is a
set of whole decoder layers (``diloco.model.decoder_layers``). The layers go to fragments *strided* (layer N to
fragment N mod F, as the paper does) or *contiguous* (F runs of consecutive layers, as equal in count as can be);
the parameters before the first layer (embeddings) join fragment 0 and those after the last one (final norm,
output head) the last fragment.

The cut depends only on the model's architecture, which the model's fingerprint already makes equal in every
group that meets, so every group agrees on it whatever its shape. Plain Python; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

FragmentLayout = Literal["strided", "contiguous"]
Runs = list[tuple[int, int]]  # [start, stop) ranges of a rank's local buffer


def fragment_params(layers: Sequence[int | None], count: int, layout: FragmentLayout = "strided") -> list[list[int]]:
    """The indices (in model order) of the parameters of each of `count` fragments.

    :param layers: for each parameter in model order, the decoder layer it belongs to (None: embeddings, final
        norm, head).
    :raises ValueError: the model has fewer decoder layers than `count` (a fragment would be empty).
    """
    numbers = sorted({layer for layer in layers if layer is not None})
    if len(numbers) < count:
        raise ValueError(f"the model has {len(numbers)} decoder layers: at most that many fragments")
    if layout == "strided":
        home = {layer: i % count for i, layer in enumerate(numbers)}
    else:
        base, extra = divmod(len(numbers), count)
        sizes = [base + (1 if f < extra else 0) for f in range(count)]
        home, i = {}, 0
        for fragment, size in enumerate(sizes):
            for layer in numbers[i : i + size]:
                home[layer] = fragment
            i += size
    fragments: list[list[int]] = [[] for _ in range(count)]
    seen_layer = False
    for index, layer in enumerate(layers):
        if layer is not None:
            seen_layer = True
            fragments[home[layer]].append(index)
        else:  # before the first layer: fragment 0; after it: the last one
            fragments[count - 1 if seen_layer else 0].append(index)
    return fragments


def local_runs(params: Sequence[int], local_numels: Sequence[int]) -> Runs:
    """Where parameters `params` (indices in model order) sit in a rank's local buffer (its shard of every
    parameter, concatenated in model order; `local_numels`: each parameter's shard size), adjacent runs merged."""
    offsets = [0]
    for numel in local_numels:
        offsets.append(offsets[-1] + numel)
    runs: Runs = []
    for index in sorted(params):
        start, stop = offsets[index], offsets[index + 1]
        if start == stop:
            continue  # FSDP can leave a rank an empty shard of a small parameter
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], stop)
        else:
            runs.append((start, stop))
    return runs


def fragment_of(round_index: int, count: int) -> int:
    """The fragment a round averages: round 1 the first, then in turn (every group derives it from the round's
    index, which all groups of a round share)."""
    return (round_index - 1) % count
