"""`diloco bench <name>`: each bench's flags, checked here before the bench imports torch, and the call that runs it
(``diloco.bench.run``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from cyclopts import App, Parameter

from diloco.console import setup_logging
from diloco.errors import UsageError

BENCH_OUT = Path("docs/bench")
BENCH_DOC = Path("docs/benchmarks.md")


def _bench(name: str, quick: bool, out: Path, doc: Path, **options: Any) -> int:
    from diloco import bench

    setup_logging(0)
    command = bench.command_line(name, quick, out, doc, (BENCH_OUT, BENCH_DOC), options)
    try:
        bench.run(name, quick, out, doc, command, options)
    except bench.BenchError as e:
        logging.getLogger("diloco").error("%s", e)
        return 1
    except bench.Stopped as e:  # everything it started is gone by now: one line, and the shell's code for the signal
        logging.getLogger("diloco").error("bench %s %s", name, e)
        return 128 + e.signum
    return 0


_QUICK = Parameter(help="Tiny model and few steps: about a minute on 2 idle CPU cores.")
_OUT = Parameter(help="Folder for the result JSON (strategies.json, overhead-quick.json, ...).")
_DOC = Parameter(help="Markdown file the section goes to, in place of the one the last run of the same bench wrote.")
_ARMS = Parameter(help="Only these arms, comma-separated (default: all of tcp, p2pd, groups, groups-p2pd, "
                  "groups-keyed); the JSON is then allreduce-<arms>.json.")  # fmt: skip
_DATA = Parameter(help="Text to train and evaluate on: a .txt, .jsonl or .parquet file, byte-tokenized, its last "
                  "10% held out (e.g. tinyshakespeare.txt). Required.")  # fmt: skip
_TRAIN_CORES = Parameter(help="Hold each worker's training process to this share of its core once it trains (a "
                         "cgroup quota) and move its DHT, averager and p2pd off that core, as beside an "
                         "accelerator that trains; the JSON is then wan-cores<C>.json. Default: each worker and its "
                         "helpers share one core.")  # fmt: skip
_SLOW_LINK = Parameter(help="The 10 Mbit/s study instead: blocking rounds in int8 against sparse rounds "
                       "(--hv.compression sparse), no DDP; the JSON is then wan-10mbit.json.")  # fmt: skip
_STUDY = Parameter(help="defaults: k = 2, 4, 8 groups at H = 25, no outer flags against DDP and the trials of "
                   "the 4-group gap (the ~1M model, 3 seeds); map: the gap to DDP of each outer setting over H = "
                   "10-500 and k = 2, 4, 8 (a 0.14M model, 2000 inner steps); streaming: blocking rounds against "
                   "--hv.fragments 2, strided and contiguous, blocking and overlapped (k = 2, H = 20); late: groups "
                   "that come late to rounds keep (--hv.late-work keep) or drop their inner steps, against no "
                   "lateness (k = 2 and 4, H = 25).")  # fmt: skip
_MODEL = Parameter(help="The model every arm trains: a bench model's name (e.g. llama-14m-fresh; an unknown name "
                   "lists them) or a local model folder. Default: llama-2m-fresh with --quick, else "
                   "llama-14m-fresh.")  # fmt: skip


BENCH_HELP = {
    "strategies": "DDP, ZERO1, NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, CPU offload, gradient checkpointing: tokens/s "
    "and peak memory, 2 ranks, each arm beside its DeepSpeed ZeRO stage.",
    "overhead": "Inner-step tokens/s of a DiLoCo worker (DHT and averager running) against galaxy size 1, "
    "alternating.",
    "convergence": "Held-out loss at equal tokens: one group, DDP, DiLoCo with no outer flags and over H and outer "
    "lr/momentum/warm-up, on real text (--study defaults or map).",
    "wire": "Bytes each worker sends and receives over a run (DiLoCo none/fp16/int8 vs DDP), counted by the kernel "
    "on veth links between network namespaces and by the trainer; needs root.",
    "allreduce": "One averaging round (diloco tcp vs hivemind p2pd transport) for 10M-150M parameters, 2 and 4 "
    "peers, against a socket, a p2pd stream and gloo, on loopback and a shaped 1 Gbit/s link (that part needs root "
    "and ip/tc; without them, loopback only).",
    "hetero": "Three worker groups throttled to 0.8, 0.4 and 0.2 core, and to 0.4 each (cgroup quota; needs root): "
    "the token pace against fixed H (today's and the old defaults): tokens/s alone and together, full rounds, "
    "discarded steps, eval loss, and where the CPU went.",
    "shapes": "A 1-rank and a 2-rank FULL_SHARD group in one swarm against two 1-rank groups: identical after "
    "every round, and the round time; and the pair of unequal speed under the old and today's defaults.",
    "scale": "A 2 GB corpus against a 10 MB one: each rank's peak RSS, the token store's build rate (bytes and a "
    "BPE tokenizer trained here) and a second run's data start-up.",
    "compression": "Held-out loss at equal tokens and bytes per value of each --hv.compression (none, fp16, int8, "
    "int4): 2 groups, H = 25, against DDP, on real text.",
    "poison": "One hostile group among four honest ones (50x, sign-flipped, noise pseudo-gradients) under each "
    "--hv.aggregation (mean, trimmed-mean, centered-clip): eval loss against the swarm without it, on real text.",
    "churn": "A 30-minute soak: four worker groups of mixed shapes, two of them killed (kill -9), stopped (SIGTERM), "
    "restarted from checkpoints or rejoining fresh every 10-30 s (seeded); divergences, hangs, one final model, "
    "throughput retained against the swarm without churn, RSS over time (cgroups; needs root).",
    "flood": "One rank under a flood of held, garbage and trickling connections and state requests from a stranger's "
    "address while an honest peer averages with it and downloads its state: the rank's peak RSS growth, honest work "
    "done, connections refused.",
    "fuzz": "Malformed, truncated, oversized, wrong-typed and deeply nested inputs thrown at every parser (records, "
    "announcements, seals, metadata, codecs, frames) and at a live listener and DHT: crashes, hangs, refusals.",
    "nat": "Rounds through home routers: a 1-rank and a 2-rank group each behind a router doing NAT (nftables) with a "
    "100 Mbit/s uplink, beside a public 1-rank group, then alone with `diloco dht --relay-ports` (network namespaces; "
    "needs root and nft): each group's path, bytes and time on the wire per round against its uplink's ideal.",
    "wan": "Time to a loss on a slow link: DDP, DiLoCo blocking, and fragments overlapping the inner steps (with int4) "
    "on real text, 2 workers behind tbf links of 100 Mbit/s and 1 Gbit/s (network namespaces; needs root).",
}


def _bench_command(name: str) -> Callable[..., int]:
    """`diloco bench <name>`: cyclopts reads the flags from the signature and the help from the docstring. Only
    convergence, compression, poison and wan read data (`--data`): the others train on fake data. strategies takes a
    `--model`."""

    def command(
        *,
        quick: Annotated[bool, _QUICK] = False,
        out: Annotated[Path, _OUT] = BENCH_OUT,
        doc: Annotated[Path, _DOC] = BENCH_DOC,
    ) -> int:
        return _bench(name, quick, out, doc)

    def with_data(
        *,
        data: Annotated[Path | None, _DATA] = None,
        quick: Annotated[bool, _QUICK] = False,
        out: Annotated[Path, _OUT] = BENCH_OUT,
        doc: Annotated[Path, _DOC] = BENCH_DOC,
    ) -> int:
        return _bench(name, quick, out, doc, data=_data_file(name, data))

    def with_cores(
        *,
        data: Annotated[Path | None, _DATA] = None,
        train_cores: Annotated[float | None, _TRAIN_CORES] = None,
        slow_link: Annotated[bool, _SLOW_LINK] = False,
        quick: Annotated[bool, _QUICK] = False,
        out: Annotated[Path, _OUT] = BENCH_OUT,
        doc: Annotated[Path, _DOC] = BENCH_DOC,
    ) -> int:
        options: dict[str, Any] = {} if train_cores is None else {"train_cores": _train_cores(train_cores)}
        if slow_link:
            options["slow_link"] = True
        return _bench(name, quick, out, doc, data=_data_file(name, data), **options)

    def with_study(
        *,
        data: Annotated[Path | None, _DATA] = None,
        study: Annotated[Literal["defaults", "map", "streaming", "late"], _STUDY] = "defaults",
        quick: Annotated[bool, _QUICK] = False,
        out: Annotated[Path, _OUT] = BENCH_OUT,
        doc: Annotated[Path, _DOC] = BENCH_DOC,
    ) -> int:
        options = {"study": study} if study != "defaults" else {}  # the default stays out of the command line
        return _bench(name, quick, out, doc, data=_data_file(name, data), **options)

    def with_model(
        *,
        model: Annotated[str | None, _MODEL] = None,
        quick: Annotated[bool, _QUICK] = False,
        out: Annotated[Path, _OUT] = BENCH_OUT,
        doc: Annotated[Path, _DOC] = BENCH_DOC,
    ) -> int:
        if model is None:
            return _bench(name, quick, out, doc)
        return _bench(name, quick, out, doc, model=_bench_model(model))

    def with_arms(
        *,
        arms: Annotated[str | None, _ARMS] = None,
        quick: Annotated[bool, _QUICK] = False,
        out: Annotated[Path, _OUT] = BENCH_OUT,
        doc: Annotated[Path, _DOC] = BENCH_DOC,
    ) -> int:
        if arms is None:
            return _bench(name, quick, out, doc)
        return _bench(name, quick, out, doc, arms=_arm_list(arms))

    readers = {"convergence": with_study, "compression": with_data, "poison": with_data, "wan": with_cores}
    chosen = (readers | {"strategies": with_model, "allreduce": with_arms}).get(name, command)
    chosen.__doc__ = BENCH_HELP[name]
    return chosen


def _data_file(bench: str, data: Path | None) -> Path:
    """--data as given, or a usage error (here, before the bench imports torch)."""
    if data is None or not data.is_file():
        raise UsageError(f"--data {data}: no such file" if data else f"bench {bench} needs --data FILE (a text file)")
    return data


def _train_cores(cores: float) -> float:
    """--train-cores of `bench wan`: a share of one core the kernel can enforce, or a usage error naming the flag."""
    if not 0.01 <= cores <= 1.0:
        raise UsageError(f"--train-cores {cores:g}: a share of one core, from 0.01 to 1")
    return cores


def _arm_list(arms: str) -> list[str]:
    """--arms of `bench allreduce` as a list, or a usage error naming the flag (here, before torch)."""
    from diloco.bench.allreduce_report import ARMS

    chosen = [arm.strip() for arm in arms.split(",") if arm.strip()]
    unknown = [arm for arm in chosen if arm not in ARMS]
    if unknown or not chosen:
        raise UsageError(f"--arms {arms}: not a comma-separated list of {', '.join(ARMS)}")
    return list(dict.fromkeys(chosen))


def _bench_model(model: str) -> str | Path:
    """A bench model's name as it is, a local folder as a Path; anything else is a usage error (before torch)."""
    from diloco.bench.models import MODELS

    if model in MODELS:
        return model
    if Path(model).is_dir():
        return Path(model)
    raise UsageError(f"--model {model}: neither a model folder nor one of {', '.join(MODELS)}")


def bench_app() -> App:
    """The `bench` subcommand with one command per bench."""
    app = App(name="bench", help="Measure the trainer; write JSON and append a dated table to a document.")
    for name in BENCH_HELP:
        app.command(_bench_command(name), name=name)
    return app
