"""`diloco bench <name>`: benchmarks that measure the trainer and record what they measured.

Each bench is a module here with `measure(quick, work_dir, info, **options) -> dict` (the figures, every one
measured, none typed in; `options` are the bench's own flags, e.g. convergence's `data`) and
`markdown(result) -> str` (a dated section for docs/benchmarks.md). `run` adds the date, the machine and the
exact command, writes `<out>/<name>[-quick].json` (a bench with studies names it: `stem(quick, **options)`) and
puts the section into the doc in place of the one its last run wrote (`record_doc`). A bench needs nothing beside the
installed package: the models it trains are written into its work dir (`bench.models`), and data comes from a flag.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger("diloco")

DOC_HEAD = """# Benchmarks

One section per bench: the latest full run (not `--quick`) of each, as the run wrote it, with its date, machine,
1-minute load average and exact command. The line `<!-- diloco bench: STEM -->` above a section names the run's
JSON, `bench/STEM.json` (the plots are beside it); a new run of that bench replaces the section under its marker.
Older runs are in this file's git history.
"""
MARKER = "<!-- diloco bench: {stem} -->"  # the start of a bench's section; the anchor below it is #bench-<stem>
ANCHOR = '<a id="bench-{stem}"></a>'


class BenchError(RuntimeError):
    """An arm failed or measured nothing: the bench stops with one line and exit code 1."""


# ---------------------------------------------------------------- stopped by a signal

# SIGTERM (a test's timeout, `kill`, a scheduler) and SIGHUP (the terminal closed) would otherwise end the bench at
# once, skipping every `finally`: its processes (some inside network namespaces), namespaces, bridge and temp folder
# would outlive it. SIGINT already raises KeyboardInterrupt.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal reached the bench: raised in the main thread so that every `finally` and `__exit__` on the way
    out runs. A BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class _Signals:
    """What the handler installed by `stop_on_signals` knows: whether it has raised already (later signals are
    logged and dropped: they would cut the cleanup short), and how deep in `shielded` sections the main thread is
    (a signal there waits until the section ends)."""

    raised = False
    shield_depth = 0
    pending: int | None = None


def _handle(signum: int, frame: object) -> None:
    if _Signals.raised:
        log.warning("received %s again: still removing what the bench started", signal.Signals(signum).name)
    elif _Signals.shield_depth:
        _Signals.pending = signum
    else:
        _Signals.raised = True
        log.warning("received %s: stopping the bench, removing what it started", signal.Signals(signum).name)
        raise Stopped(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise `Stopped` in the main thread (once); the previous handlers come back on exit.
    Outside the main thread (where Python allows no handler) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _handle) for sig in STOP_SIGNALS}
    _Signals.raised, _Signals.pending = False, None
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stopping() -> bool:
    """Whether a stop signal reached the bench (within `stop_on_signals`)."""
    return _Signals.raised


@contextmanager
def shielded() -> Iterator[None]:
    """A cleanup that a stop signal must not cut in half (deleting namespaces, the temp folder): a signal that comes
    meanwhile raises `Stopped` once the section is done."""
    _Signals.shield_depth += 1
    try:
        yield
    finally:
        _Signals.shield_depth -= 1
        if not _Signals.shield_depth and _Signals.pending is not None:  # nested: the outermost section raises
            signum, _Signals.pending = _Signals.pending, None
            _handle(signum, None)


# ---------------------------------------------------------------- the machine


def machine() -> dict[str, Any]:
    """CPU model, cores (present and usable by this process), RAM in GiB, torch version, GPU names if any, and
    the 1-minute load average now (other work on the machine skews every figure)."""
    import torch

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpus": gpus,
        "load_avg_1m": os.getloadavg()[0],
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(info: dict[str, Any]) -> str:
    gpu = ", ".join(info["gpus"]) or "none"
    return (
        f"{info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable), {info['ram_gib']} GiB RAM, "
        f"torch {info['torch']}, Python {info['python']}, GPU: {gpu}"
    )


def section_head(result: dict[str, Any]) -> list[str]:
    """The first lines of every bench's section: its title with the date, the machine and the exact command."""
    return [
        f"## {result['bench']}{' (quick)' if result['quick'] else ''}: {result['date']}",
        "",
        f"- machine: {machine_line(result['machine'])}",
        f"- command: `{result['command']}`",
    ]


# ---------------------------------------------------------------- running a bench


def record_doc(doc: Path, stem: str, section: str) -> None:
    """Put a bench's section into the benchmarks document under its marker: in place of the section the last run of
    the same bench (and study) wrote, or at the end; the document is created with its head when missing."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text(encoding="utf-8") if doc.exists() else DOC_HEAD
    marker = MARKER.format(stem=stem)
    block = f"{marker}\n{ANCHOR.format(stem=stem)}\n{section.strip()}\n"
    start = text.find(marker + "\n")
    if start < 0:
        text = f"{text.rstrip()}\n\n{block}"
    else:
        end = text.find(MARKER.split("{")[0], start + len(marker))  # the next section's marker, or the end
        text = text[:start] + block + ("\n" + text[end:] if end >= 0 else "")
    doc.write_text(text, encoding="utf-8")


def command_line(
    name: str, quick: bool, out: Path, doc: Path, defaults: tuple[Path, Path], options: dict[str, Any] | None = None
) -> str:
    """The `diloco bench` command that reproduces this result (`options`: the bench's own flags)."""
    parts = ["diloco", "bench", name, *(["--quick"] if quick else [])]
    for key, value in (options or {}).items():
        parts += ["--" + key.replace("_", "-"), ",".join(value) if isinstance(value, list) else str(value)]
    if out != defaults[0]:
        parts += ["--out", str(out)]
    if doc != defaults[1]:
        parts += ["--doc", str(doc)]
    return shlex.join(parts)


def run(name: str, quick: bool, out: Path, doc: Path, command: str, options: dict[str, Any] | None = None) -> Path:
    """Run bench `name` (with its own flags `options`), write `<out>/<name>[-quick].json`, put its section into
    `doc`. Returns the JSON path. A stop signal raises `Stopped` once what the bench started is gone."""
    with stop_on_signals():
        return _run(name, quick, out, doc, command, options)


def _run(name: str, quick: bool, out: Path, doc: Path, command: str, options: dict[str, Any] | None) -> Path:
    module = importlib.import_module(f"diloco.bench.{name}")
    study = getattr(module, "STUDY_MODULES", {}).get((options or {}).get("study"))
    if study is not None:  # a study with a module of its own (which may build on the bench's)
        module = importlib.import_module(study)
    info = machine()
    tmp = tempfile.mkdtemp(prefix=f"diloco-bench-{name}-")
    try:
        body = module.measure(quick, Path(tmp), info, **(options or {}))
    finally:
        with shielded():
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "bench": name,
        "quick": quick,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": info,
        "load_avg_1m_end": os.getloadavg()[0],
        "command": command,
        **body,
    }
    out.mkdir(parents=True, exist_ok=True)
    doc.parent.mkdir(parents=True, exist_ok=True)
    stem = module.stem(quick, **(options or {})) if hasattr(module, "stem") else f"{name}{'-quick' if quick else ''}"
    path = out / f"{stem}.json"
    if hasattr(module, "plot"):  # a PNG beside the JSON, linked from the doc
        picture = module.plot(result, out)
        result["plot"] = os.path.relpath(picture.resolve(), doc.resolve().parent)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    record_doc(doc, stem, module.markdown(result))
    log.info("bench %s: results in %s, its section in %s", name, path, doc)
    return path
