"""`diloco bench scale`: what a corpus of gigabytes, a model of a billion parameters and the outer path of a real
model's size cost a worker group on this machine (the outer part: ``diloco.bench.scale_outer``).

- corpus: text generated here (the lines of tinyshakespeare.txt, shuffled by a seeded generator, numbered), a small
  one and a large one (`ScaleSetup`);
- cold: a 2-rank group (``torchrun``, galaxy size 1, the byte tokenizer, a token cache of its own) on the small
  corpus, then on the large one, whose token store it builds first: each rank's peak RSS (VmHWM, read from /proc
  every `POLL_S` while it runs), the store's build rate (from its manifest), the data's start-up (the
  trainer's "ready in" figure);
- warm: the large corpus again, the store in place: the data's start-up and peak RSS per rank;
- load: a model of the quick run's or a billion parameters, built by a 2-rank FULL_SHARD group that takes no step,
  fresh from its config (each rank draws its own shards, a unit at a time), then from its weights written here as
  safetensors (each rank reads its own shards): each rank's peak RSS once the model is built (the trainer's summary)
  and over the whole run;
- BPE: a byte-level BPE tokenizer trained here with `tokenizers` on a sample, saved as a Hugging Face tokenizer
  folder; the rate at which this process builds a token store of part of the corpus with it (its threads on every
  core).

Targets (reported, never asserted): the large corpus adds at most `RSS_TARGET_MB` to a rank's peak RSS over the
small one; a second run's data start-up under `WARM_TARGET_S`; once the model is loaded, no rank's peak above
`LOAD_TARGET` × its float32 bytes + `LOAD_SLACK_MB`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shlex
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from diloco import procs
from diloco.bench import BenchError, section_head
from diloco.bench.models import write_model
from diloco.bench.scale_outer import markdown_lines, measure_outer
from diloco.bench.wire import started, summary, wait_all
from diloco.corpus import TINYSHAKESPEARE
from diloco.data import ByteTokenizer, HFTokenizer
from diloco.data.store import open_store, store_key

__all__ = ["markdown", "measure"]

log = logging.getLogger("diloco")

MODEL = "llama-1m-bytes"
RSS_TARGET_MB, WARM_TARGET_S = 100.0, 5.0
LOAD_TARGET, LOAD_SLACK_MB = 0.6, 1000.0  # a rank's peak while loading: at most 0.6 × the float32 model + 1 GB
POLL_S = 0.2
BPE_VOCAB, EOS = 8192, "<|endoftext|>"
READY = re.compile(r"ready in ([\d.]+) s\)")


@dataclasses.dataclass(frozen=True)
class ScaleSetup:
    small_mb: int
    large_mb: int
    bpe_sample_mb: int  # text the BPE tokenizer is trained on
    bpe_rate_mb: int  # text tokenized with it to time the rate
    ranks: int
    seq_length: int
    batch: int
    steps: int
    timeout_s: float
    checkpoint: str  # the model whose weights the checkpoint run loads


def scale_setup(quick: bool) -> ScaleSetup:
    """Quick: 2 and 20 MB, a 14M checkpoint. Full: 10 MB and 2 GB, BPE timed on 200 MB, a 1B checkpoint."""
    if quick:
        return ScaleSetup(small_mb=2, large_mb=20, bpe_sample_mb=1, bpe_rate_mb=4, ranks=2, seq_length=128, batch=2,
                          steps=2, timeout_s=300.0, checkpoint="llama-14m-fresh")  # fmt: skip
    return ScaleSetup(small_mb=10, large_mb=2000, bpe_sample_mb=20, bpe_rate_mb=200, ranks=2, seq_length=256, batch=2,
                      steps=2, timeout_s=1800.0, checkpoint="llama-1b-fresh")  # fmt: skip


# ---------------------------------------------------------------- inputs


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> Path:
    """`megabytes` MB of text: the corpus's lines in a seeded order, chunk after chunk, each line numbered (so no
    two chunks are alike)."""
    lines = TINYSHAKESPEARE.read_text(encoding="utf-8").splitlines()
    rng, target, written, chunk = np.random.default_rng(seed), megabytes * 10**6, 0, 0
    with path.open("w", encoding="utf-8") as out:
        while written < target:
            order = rng.permutation(len(lines))
            text = "".join(f"{chunk}.{i} {lines[i]}\n" for i in order)[: target - written]
            out.write(text)
            written += len(text.encode("utf-8"))
            chunk += 1
    return path


def train_bpe(sample: Path, folder: Path) -> Path:
    """A byte-level BPE tokenizer of `BPE_VOCAB` ids trained on `sample`, as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train([str(sample)], trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=[EOS], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS).save_pretrained(folder)
    return folder


def head(source: Path, path: Path, megabytes: int) -> Path:
    """The first `megabytes` MB of `source` (cut at a line end) in `path`."""
    with source.open("rb") as f:
        data = f.read(megabytes * 10**6)
    path.write_bytes(data[: data.rfind(b"\n") + 1])
    return path


# ---------------------------------------------------------------- runs


class PeakRss:
    """Polls the VmHWM (peak resident set) of a process's children (torchrun's ranks) every `POLL_S` until
    `stop`; `peaks` keeps the last value read per pid, in MB."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peaks = pid, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scale-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                children = psutil.Process(self.pid).children()
            except psutil.Error:
                return
            for child in children:
                peak = vm_hwm_mb(child.pid)
                if peak is not None:
                    self.peaks[child.pid] = peak


def vm_hwm_mb(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) / 1024 if found else None


def ranks_peak_rss(command: list[str], name: str, log_path: Path, run_dir: Path, setup: ScaleSetup) -> list[float]:
    """Run the torchrun `command` (a group writing to `run_dir`) to its end: each rank's peak RSS in MB. A
    `BenchError` unless the run ended ok and every rank's memory was read."""
    with ExitStack() as stack:
        proc = started(stack, command, log_path, procs.child_env())
        with PeakRss(proc.pid) as rss:
            wait_all([(name, proc, log_path)], setup.timeout_s)
    summary(run_dir)  # (BenchError unless it ended ok)
    if len(rss.peaks) != setup.ranks:
        raise BenchError(f"{name}: {len(rss.peaks)} ranks' memory read in {log_path}")
    return list(rss.peaks.values())


def group_run(setup: ScaleSetup, model: Path, corpus: Path, cache: Path, work_dir: Path, name: str) -> dict[str, Any]:
    """A 2-rank group (galaxy size 1) training `setup.steps` steps on `corpus` with the token cache `cache`: each
    rank's peak RSS, the data's start-up and (when it built the store) the build's figures, from its log."""
    run_dir, log_path = work_dir / name, work_dir / f"{name}.log"
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={setup.ranks}",
               "-m", "diloco.train", "--path-model", str(model), "--dataset", str(corpus), "--token-cache", str(cache),
               "--seq-length", str(setup.seq_length), "--per-device-train-batch-size", str(setup.batch),
               "--total-batch-size", str(setup.batch * setup.ranks), "--max-steps", str(setup.steps),
               "--eval-steps", "1", "--precision", "32-true", "--no-torch-compile", "--metric-logger-type", "dummy",
               "--run-dir", str(run_dir)]  # fmt: skip
    log.info("bench scale %s: %s", name, shlex.join(command))
    store = cache / store_key(corpus, None, ByteTokenizer())
    existed, began = store.exists(), time.monotonic()
    peaks = ranks_peak_rss(command, name, log_path, run_dir, setup)
    text = log_path.read_text(errors="replace")
    ready = [float(s) for s in READY.findall(text)]
    manifest = json.loads((store / "manifest.json").read_text())
    if not ready:
        raise BenchError(f"{name}: no data start-up in {log_path}")
    return {
        "name": name,
        "corpus_mb": corpus.stat().st_size / 1e6,
        "peak_rss_mb": sorted(peaks),
        "data_ready_s": max(ready),  # the slower rank's (the one that waited for the store, if one was built)
        "wall_s": time.monotonic() - began,
        "built": None if existed else {"tokens": manifest["tokens"], "seconds": manifest["build_seconds"],
                                       "mb_per_s": manifest["source_bytes"] / 1e6 / manifest["build_seconds"]},
        "command": shlex.join(command),
    }  # fmt: skip


def write_weights(name: str, folder: Path) -> tuple[Path, Path, int]:
    """Model `name` as a config alone (`folder/config`) and with weights (a fresh initialisation, seed 0) as
    safetensors (`folder/name`), and its number of parameters."""
    from diloco.model import load_model

    config = write_model(name, folder / "config")
    model = load_model(config, seed=0)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder / name)
    return config, folder / name, params


def load_run(setup: ScaleSetup, model: Path, work_dir: Path, name: str) -> dict[str, Any]:
    """A 2-rank FULL_SHARD group builds `model` (fresh from its config, or its weights) and takes no step: each
    rank's peak RSS once the model is built and sharded (the trainer's summary), and over the whole run (one
    held-out batch and the export of ``final/`` included)."""
    run_dir, log_path = work_dir / f"{name}-run", work_dir / f"{name}-run.log"
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={setup.ranks}",
               "-m", "diloco.train", "--path-model", str(model), "--fake-data", "--seq-length", "64",
               "--per-device-train-batch-size", "1", "--total-batch-size", str(setup.ranks), "--max-steps", "0",
               "--eval-steps", "1", "--sharding-strategy", "FULL_SHARD", "--precision", "32-true",
               "--no-torch-compile", "--metric-logger-type", "dummy", "--run-dir", str(run_dir)]  # fmt: skip
    log.info("bench scale %s: %s", name, shlex.join(command))
    began = time.monotonic()
    peaks = ranks_peak_rss(command, name, log_path, run_dir, setup)
    return {"name": name, "loaded_peak_mb": summary(run_dir)["startup_host_peak_mb_per_rank"],
            "run_peak_mb": sorted(peaks, reverse=True), "wall_s": time.monotonic() - began, "command": shlex.join(command)}  # fmt: skip


def load_runs(setup: ScaleSetup, work_dir: Path, floor_mb: float) -> dict[str, Any]:
    """`setup.checkpoint` built fresh, then loaded from its safetensors: each rank's peak against the target
    (`LOAD_TARGET` of the float32 model + `LOAD_SLACK_MB`) and, above `floor_mb` (a rank with a tiny model), the
    share of the model it held."""
    config, weights, params = write_weights(setup.checkpoint, work_dir / "checkpoint")
    float32_mb = 4 * params / 1e6
    target_mb = LOAD_TARGET * float32_mb + LOAD_SLACK_MB
    runs = [load_run(setup, config, work_dir, "fresh"), load_run(setup, weights, work_dir, "checkpoint")]
    for run in runs:
        run["shares"] = [(peak - floor_mb) / float32_mb for peak in run["loaded_peak_mb"]]
        run["met"] = max(run["loaded_peak_mb"]) <= target_mb
    return {"model": setup.checkpoint, "params": params, "float32_mb": float32_mb, "floor_mb": floor_mb,
            "weights_mb": sum(f.stat().st_size for f in weights.glob("*.safetensors")) / 1e6,
            "target_mb": target_mb, "runs": runs}  # fmt: skip


def bpe_rate(corpus: Path, tokenizer: Path, cache: Path) -> dict[str, Any]:
    """This process builds a token store of `corpus` with the tokenizer in `tokenizer`: MB/s and tokens per MB."""
    began = time.monotonic()
    stored = open_store(corpus, None, HFTokenizer(str(tokenizer)), cache)
    seconds = time.monotonic() - began
    megabytes = corpus.stat().st_size / 1e6
    return {"corpus_mb": megabytes, "seconds": seconds, "mb_per_s": megabytes / seconds,
            "tokens": stored.count, "tokens_per_mb": stored.count / megabytes, "dtype": stored.dtype.name}  # fmt: skip


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    setup = scale_setup(quick)
    model = write_model(MODEL, work_dir / "models")
    began = time.monotonic()
    large = write_corpus(work_dir / "large.txt", setup.large_mb)
    generated_s = time.monotonic() - began
    small = head(large, work_dir / "small.txt", setup.small_mb)
    cache = work_dir / "token-cache"
    runs = [group_run(setup, model, small, cache, work_dir, "small"),
            group_run(setup, model, large, cache, work_dir, "large-cold"),
            group_run(setup, model, large, cache, work_dir, "large-warm")]  # fmt: skip
    loaded = load_runs(setup, work_dir, floor_mb=max(runs[0]["peak_rss_mb"]))  # a rank with a tiny model
    outer = measure_outer(quick, work_dir / "outer")
    tokenizer = train_bpe(head(large, work_dir / "bpe-sample.txt", setup.bpe_sample_mb), work_dir / "bpe")
    bpe = bpe_rate(head(large, work_dir / "bpe-rate.txt", setup.bpe_rate_mb), tokenizer, cache)
    small_run, cold, warm = runs
    floor = max(small_run["peak_rss_mb"])  # a rank with a tiny model: torch, transformers, the data
    added = max(max(r["peak_rss_mb"]) for r in (cold, warm)) - floor
    return {
        "setup": dataclasses.asdict(setup),
        "model": MODEL,
        "generated_s": generated_s,
        "runs": runs,
        "bpe": bpe | {"vocab": BPE_VOCAB},
        "rss_added_mb": added,
        "rss_met": added <= RSS_TARGET_MB,
        "warm_ready_met": warm["data_ready_s"] < WARM_TARGET_S,
        "load": loaded,
        "outer": outer,
        "store_mb": (cache / store_key(large, None, ByteTokenizer()) / "tokens.bin").stat().st_size / 1e6,
    }


def markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    small, cold, warm = result["runs"]
    met = {True: "**met**", False: "**missed**"}
    lines = [
        *section_head(result),
        f"- 1-minute load average at start / end: {result['machine']['load_avg_1m']:.1f} / "
        f"{result['load_avg_1m_end']:.1f}",
        f"- corpus: tinyshakespeare.txt's lines shuffled (seeded) and numbered, {s['large_mb']:,} MB "
        f"(generated in {result['generated_s']:.0f} s) and its first {s['small_mb']} MB; the byte tokenizer",
        f"- each run: one group of {s['ranks']} ranks (torchrun, galaxy size 1), model {result['model']}, seq "
        f"{s['seq_length']}, {s['batch']} sequences per rank, {s['steps']} inner steps and one held-out batch; a token "
        "cache of the bench's own, empty before the first run; peak RSS: each rank's VmHWM (/proc, read every "
        f"{POLL_S} s); data start-up: the trainer's own \"ready in\" (the slower rank's)",
        "",
        "| run | corpus (MB) | store built | build rate (MB/s) | data start-up (s) | peak RSS per rank (MB) | wall (s) |",
        "|---|---:|---|---:|---:|---|---:|",
    ]
    for run in (small, cold, warm):
        built = run["built"]
        rate = "–" if built is None else f"{built['mb_per_s']:.1f}"
        lines.append(
            f"| {run['name']} | {run['corpus_mb']:,.0f} | {'yes' if built else 'no (reused)'} | {rate} | "
            f"{run['data_ready_s']:.1f} | {', '.join(f'{m:.0f}' for m in run['peak_rss_mb'])} | {run['wall_s']:.0f} |"
        )
    bpe = result["bpe"]
    lines += [
        "",
        f"- token store of the large corpus: {result['store_mb']:,.0f} MB on disk",
        f"- BPE (byte-level, {bpe['vocab']} ids, trained here with `tokenizers` on {s['bpe_sample_mb']} MB): this "
        f"process tokenized {bpe['corpus_mb']:.0f} MB into a store at {bpe['mb_per_s']:.1f} MB/s "
        f"({bpe['tokens_per_mb']:,.0f} tokens per MB, {bpe['dtype']})",
        f"- the large corpus adds {result['rss_added_mb']:.0f} MB to a rank's peak RSS over the small one; target "
        f"≤ {RSS_TARGET_MB:.0f} MB: {met[result['rss_met']]}",
        f"- data start-up of a second run on the large corpus: {warm['data_ready_s']:.1f} s; target under "
        f"{WARM_TARGET_S:.0f} s: {met[result['warm_ready_met']]}",
    ]
    ld = result["load"]
    lines += [
        "",
        f"Loading a model: {ld['model']} ({ld['params'] / 1e6:,.0f}M parameters, {ld['float32_mb']:,.0f} MB in "
        f"float32; {ld['weights_mb']:,.0f} MB of safetensors written here), built by a 2-rank FULL_SHARD group that "
        "takes no step. Peak RSS per rank once the model is built and sharded (the trainer's summary), and over the "
        f"whole run (one held-out batch, the export of `final/`); share: of the model, above a rank with a tiny "
        f"model ({ld['floor_mb']:,.0f} MB). Target: every rank ≤ {LOAD_TARGET} × float32 + {LOAD_SLACK_MB / 1000:.0f} "
        f"GB = {ld['target_mb']:,.0f} MB.",
        "",
        "| model from | loaded peak, rank 0 / 1 (MB) | share of the model | whole run's peaks (MB) | wall (s) | target |",
        "|---|---|---|---|---:|---|",
    ]
    for run in ld["runs"]:
        lines.append(
            f"| {run['name']} | {' / '.join(f'{m:,.0f}' for m in run['loaded_peak_mb'])} | "
            f"{' / '.join(f'{x:.2f}' for x in run['shares'])} | {' / '.join(f'{m:,.0f}' for m in run['run_peak_mb'])}"
            f" | {run['wall_s']:.0f} | {met[run['met']]} |"
        )
    lines += [
        "",
        "- fresh: each rank draws its own shards, one decoder block (or embedding, norm, head) at a time "
        "(`diloco.fresh`); from a checkpoint, each rank reads its own shards from the files",
    ]
    lines += markdown_lines(result["outer"])
    return "\n".join(lines) + "\n"
