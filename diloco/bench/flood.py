"""The flood bench: one rank under a flood of connections and state requests from one stranger's address, while
an honest peer averages with it and downloads its state; what the flood costs the rank's memory, and whether the
honest work goes through.

The rank is a child process (``python -m diloco.bench.flood``) with a ``Listener`` and a ``StateService`` over a
real state (outer parameters and momentum, as a trainer serves them: ``SharedCopies``). The attacker opens
``connections`` TCP connections and holds them (a third silent, a third sending garbage, a third trickling a byte
every second), opening another each time the rank closes one, and sends ``requests_per_s`` state requests, each
for the whole state and read a few KiB at a time. It connects from 127.0.0.2, an address of its own on loopback, so
the rank's per-host cap applies to it, while the honest peer uses 127.0.0.1. The rank's memory is read from
``/proc/<pid>/status`` (VmHWM: the peak resident set) before and after.
"""

from __future__ import annotations

import json
import os
import random
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from diloco.swarm.rounds import transfer
from diloco.swarm.rounds.layout import Shape, group_layout
from diloco.swarm.rounds.listener import Listener, listen_socket
from diloco.swarm.rounds.tcp import RAW, Round, RoundFailed, close_socket

HONEST, ATTACKER = "127.0.0.1", "127.0.0.2"
HELLO_S = 2.0  # the rank's handshake timeout: a silent or trickling connection holds a slot this long
TIMEOUT_S = 5.0  # the rank's and the honest peer's per-read timeout
ROUND_NUMEL = 2**20  # values of an honest round (4 MiB)
SEED = 1  # the state's values: the honest peer knows them, and checks what it downloads


def sizes(quick: bool) -> dict[str, Any]:
    """The bench's knobs: full, or `quick` (a smaller, shorter flood, to check it works). Each state tensor is
    larger than glibc's largest mmap threshold (32 MiB), as a trainer's are: a copy freed goes back to the system at
    once. (A smaller one may stay in the heap of the thread that freed it while the next is taken elsewhere, and
    the peak RSS would count allocator slack as copies.)"""
    if quick:
        return {"state_numel": 9 * 2**20, "connections": 200, "requests_per_s": 50, "seconds": 6.0}
    return {"state_numel": 12 * 2**20, "connections": 1000, "requests_per_s": 100, "seconds": 20.0}


def state_tensors(numel: int) -> list[torch.Tensor]:
    """The rank's outer parameters and momentum (seeded: the honest peer recomputes them)."""
    generator = torch.Generator().manual_seed(SEED)
    return [torch.randn(numel, generator=generator), torch.randn(numel, generator=generator)]


def round_vector(index: int) -> torch.Tensor:
    return torch.randn(ROUND_NUMEL, generator=torch.Generator().manual_seed(100 + index))


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of process `pid`, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024
    return fields


def raise_file_limit() -> None:
    """As many open files as the hard limit allows: the flood holds a thousand sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ---------------------------------------------------------------- the rank (a child process)


def rank_main(numel: int) -> None:
    """The rank: serves its state, and takes part in a round when told (``round <group id hex> <port>`` on stdin);
    ``stats`` prints its counters, ``quit`` ends it. Each answer is one JSON line on stdout."""
    raise_file_limit()
    torch.set_num_threads(1)
    tensors, lock = state_tensors(numel), threading.RLock()
    shared = transfer.SharedCopies(lock)
    layout = group_layout([(numel,)], Shape("FULL_SHARD", 1))[0]

    def provider() -> transfer.Served:  # as the trainer's: the metadata of now, the live state as answers read it
        with lock:
            return {"outer_step": 1}, shared.get(tensors)

    listener = Listener(listen_socket("0.0.0.0", 0), HELLO_S, registration_timeout=TIMEOUT_S).start()
    service = transfer.StateService(layout, provider, TIMEOUT_S)
    listener.serve(service.magic, service)
    port = listener._sock.getsockname()[1]
    vector, out = round_vector(0), torch.empty(ROUND_NUMEL)

    def say(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    say(port=port, pid=os.getpid())
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["round"]:
            peer = [(["127.0.0.1"], port), (["127.0.0.1"], int(command[2]))]
            round_ = Round(vector, out, group_id=bytes.fromhex(command[1]), index=0, endpoints=peer, codec=RAW,
                           timeout=TIMEOUT_S, weight=1.0)  # fmt: skip
            listener.register(round_)
            try:
                with listener.in_round():
                    round_.run()
                say(round="ok")
            except RoundFailed as e:
                say(round=str(e))
            finally:
                listener.unregister(round_)
        elif command[:1] == ["stats"]:
            say(refused=listener.refused, open=listener.open_connections, copies=shared.copies)
        else:
            break
    listener.close()


# ---------------------------------------------------------------- the attacker


class Attacker:
    """The flood, from `source`: held connections that are silent, send garbage or trickle, reopened when the rank
    closes them, and state requests read slowly. Counts what it did."""

    def __init__(self, port: int, source: str, connections: int, requests_per_s: float, numel: int) -> None:
        self.port, self.source, self.connections, self.rate = port, source, connections, requests_per_s
        self.request = transfer.MAGIC + transfer.COUNT.pack(1) + transfer.RUN.pack(0, numel)  # the whole state
        self.opened = self.closed_by_rank = self.requests = self.answer_bytes = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._hold, daemon=True, name="flood-hold"),
                         threading.Thread(target=self._ask, daemon=True, name="flood-ask")]  # fmt: skip

    def start(self) -> Attacker:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        for thread in self._threads:
            thread.join(30.0)
        return {"connections_opened": self.opened, "connections_closed_by_rank": self.closed_by_rank,
                "state_requests": self.requests, "state_answer_bytes_read": self.answer_bytes}  # fmt: skip

    def _connect(self) -> socket.socket | None:
        try:
            sock = socket.create_connection((HONEST, self.port), timeout=2.0, source_address=(self.source, 0))
        except OSError:
            return None
        sock.setblocking(False)
        self.opened += 1
        return sock

    def _closed(self, sock: socket.socket, read: int = 4096) -> tuple[bool, int]:
        """(whether the rank closed `sock`, bytes read from it now), without blocking."""
        try:
            data = sock.recv(read)
        except BlockingIOError:
            return False, 0
        except OSError:
            return True, 0
        return not data, len(data)

    def _hold(self) -> None:
        rng, pool = random.Random(0), [None] * self.connections
        while not self._stop.is_set():
            for i, sock in enumerate(pool):
                if self._stop.is_set():
                    break
                if sock is not None and self._closed(sock)[0]:
                    close_socket(sock)
                    sock, self.closed_by_rank = None, self.closed_by_rank + 1
                fresh = sock is None
                sock = pool[i] = sock or self._connect()
                if sock is None:
                    continue
                try:
                    if i % 3 == 1 and fresh:  # garbage, once
                        sock.send(rng.randbytes(rng.randrange(1, 200)))
                    elif i % 3 == 2:  # a byte per pass (about one a second)
                        sock.send(b"D")
                except OSError:
                    pass
            self._stop.wait(1.0)
        for sock in pool:
            if sock is not None:
                close_socket(sock)

    def _ask(self) -> None:
        held: list[socket.socket] = []
        started = time.monotonic()
        while not self._stop.is_set():
            due = int((time.monotonic() - started) * self.rate) - self.requests
            for _ in range(max(due, 0)):
                self.requests += 1
                sock = self._connect()
                if sock is not None:
                    try:
                        sock.send(self.request)
                        held.append(sock)
                    except OSError:
                        close_socket(sock)
            for sock in list(held):  # slow readers: a few KiB per pass
                closed, read = self._closed(sock)
                self.answer_bytes += read
                if closed:
                    held.remove(sock)
                    close_socket(sock)
            self._stop.wait(0.01)
        for sock in held:
            close_socket(sock)


# ---------------------------------------------------------------- the bench


class Rank:
    """The rank's child process: its port, pid, and a line protocol on its stdin and stdout."""

    def __init__(self, numel: int, log_path: Path) -> None:
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "diloco.bench.flood", str(numel)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)  # fmt: skip
        first = self.read()
        self.port, self.pid = first["port"], first["pid"]

    def read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank ended (exit code {self.proc.poll()}); see {self._log.name}")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(10.0)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def honest_round(rank: Rank, listener: Listener) -> bool:
    """One round of 2 with the rank (the honest peer is index 1); whether both ended with the exact mean."""
    group_id = os.urandom(32)
    mine, out = round_vector(1), torch.empty(ROUND_NUMEL)
    endpoints = [(["127.0.0.1"], rank.port), (["127.0.0.1"], listener._sock.getsockname()[1])]
    round_ = Round(mine, out, group_id=group_id, index=1, endpoints=endpoints, codec=RAW, timeout=TIMEOUT_S,
                   weight=1.0)  # fmt: skip
    listener.register(round_)
    rank.proc.stdin.write(f"round {group_id.hex()} {endpoints[1][1]}\n")
    rank.proc.stdin.flush()
    ok = True
    try:
        round_.run()
    except RoundFailed:
        ok = False
    finally:
        listener.unregister(round_)
    theirs = rank.read()
    return ok and theirs.get("round") == "ok" and torch.equal(out, (round_vector(0) + mine) / 2)


def honest_download(rank: Rank, numel: int, expected: list[torch.Tensor]) -> bool:
    layout = group_layout([(numel,)], Shape("FULL_SHARD", 1))
    got = transfer.download(layout[0], layout, [(["127.0.0.1"], rank.port)], TIMEOUT_S)
    return got is not None and len(got[1]) == 2 and all(map(torch.equal, got[1], expected))


def run_flood(work_dir: Path, quick: bool) -> dict[str, Any]:
    """The flood against one rank process; the result (also written to ``work_dir / "flood.json"``) has the rank's
    peak memory growth during the flood (over its peak after an honest round and download: ``peak_rss_growth_*``;
    over its start: ``peak_rss_growth_from_start_*``), in bytes and in copies of its state, the honest rounds and
    downloads that succeeded during the flood, and the rank's refused connections."""
    work_dir.mkdir(parents=True, exist_ok=True)
    knobs, load = sizes(quick), os.getloadavg()
    numel = knobs["state_numel"]
    raise_file_limit()
    expected = state_tensors(numel)
    rank = Rank(numel, work_dir / "flood-rank.log")
    listener = Listener(listen_socket(HONEST, 0), TIMEOUT_S).start()
    rounds, downloads = [], []
    try:
        start = memory(rank.pid)
        # a round and a download before the flood: their buffers (and one state copy) are the honest baseline
        warm = [honest_round(rank, listener), honest_download(rank, numel, expected)]
        before = memory(rank.pid)
        attacker = Attacker(rank.port, ATTACKER, knobs["connections"], knobs["requests_per_s"], numel).start()
        started = time.monotonic()
        try:
            time.sleep(min(2.0, knobs["seconds"] / 4))  # the flood is on
            while time.monotonic() - started < knobs["seconds"]:
                rounds.append(honest_round(rank, listener))
                downloads.append(honest_download(rank, numel, expected))
                time.sleep(0.5)
            during = rank.ask("stats")
        finally:
            attacked = attacker.stop()
        after = memory(rank.pid)
    finally:
        listener.close()
        rank.close()
    state_bytes = 2 * 4 * numel
    growth = after["VmHWM"] - before["VmHWM"]
    total = after["VmHWM"] - start["VmHWM"]
    result: dict[str, Any] = {
        "quick": quick,
        **knobs,
        "state_bytes": state_bytes,
        "attacker": f"{ATTACKER} (an address of its own on loopback); honest peer {HONEST}",
        "flood_seconds": round(time.monotonic() - started, 1),
        **attacked,
        "honest_warmup_ok": all(warm),
        "peak_rss_start_bytes": start["VmHWM"],
        "peak_rss_before_bytes": before["VmHWM"],
        "peak_rss_after_bytes": after["VmHWM"],
        "peak_rss_growth_bytes": growth,
        "peak_rss_growth_state_copies": round(growth / state_bytes, 2),
        "peak_rss_growth_from_start_bytes": total,
        "peak_rss_growth_from_start_state_copies": round(total / state_bytes, 2),
        "honest_rounds": len(rounds),
        "honest_rounds_ok": sum(rounds),
        "honest_downloads": len(downloads),
        "honest_downloads_ok": sum(downloads),
        "refused": during["refused"],
        "open_connections": during["open"],
        "state_copies_taken": during["copies"],
        "load_average": [round(x, 2) for x in load],
    }
    result["met"] = growth <= state_bytes and result["honest_rounds_ok"] == result["honest_rounds"] > 0 and (
        result["honest_downloads_ok"] == result["honest_downloads"] > 0)  # fmt: skip
    (work_dir / "flood.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def measure(quick: bool, work_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """`diloco bench flood`: ``run_flood`` (the bench's contract: ``diloco.bench``)."""
    return run_flood(work_dir, quick)


def markdown(result: dict[str, Any]) -> str:
    """The result as a short section: the flood, the rank's memory, the honest work."""
    from diloco.bench import section_head

    mib = 2**20
    head = section_head(result) if "machine" in result else []
    lines = [
        *head,
        f"\n{result['connections']:,} connections held from {result['attacker']}, and "
        f"{result['requests_per_s']} state requests/s, for {result['flood_seconds']} s (load average "
        f"{result['load_average'][0]} at the start): the attacker opened {result['connections_opened']:,} "
        f"connections in all, the rank refused {result['refused']:,}.\n",
        "| | |",
        "|---|---:|",
        f"| state (outer parameters + momentum) | {result['state_bytes'] / mib:.0f} MiB |",
        f"| rank's peak RSS at start / after an honest round and download / after the flood | "
        f"{result['peak_rss_start_bytes'] / mib:.0f} / {result['peak_rss_before_bytes'] / mib:.0f} / "
        f"{result['peak_rss_after_bytes'] / mib:.0f} MiB |",
        f"| growth during the flood | {result['peak_rss_growth_bytes'] / mib:.0f} MiB "
        f"({result['peak_rss_growth_state_copies']} state copies; target at most 1) |",
        f"| growth from the start (honest work included) | {result['peak_rss_growth_from_start_bytes'] / mib:.0f} "
        f"MiB ({result['peak_rss_growth_from_start_state_copies']} state copies) |",
        f"| state copies taken | {result['state_copies_taken']} |",
        f"| honest rounds ok | {result['honest_rounds_ok']} of {result['honest_rounds']} |",
        f"| honest downloads ok | {result['honest_downloads_ok']} of {result['honest_downloads']} |",
        f"| state requests sent / answer bytes read by the attacker | {result['state_requests']:,} / "
        f"{result['state_answer_bytes_read'] / mib:.1f} MiB |",
    ]
    lines.append(f"\nTarget (growth of at most one state copy, every honest round and download ok): "
                 f"**{'met' if result['met'] else 'missed'}**.")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    rank_main(int(sys.argv[1]))
