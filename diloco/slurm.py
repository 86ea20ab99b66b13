"""An sbatch script for a DiLoCo run on a Slurm cluster: one job, one srun step per worker group, one DHT step.

Why steps and not one srun over all tasks: each worker group is its own torch.distributed world (torchrun on its
nodes, its own rendezvous), and the groups meet only through the DHT; steps started in the background and
`wait`ed keep them apart while one job holds all the nodes. No torch or hivemind here.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from diloco.config import Config
from diloco.distenv import SLURM_PORT_BASE, SLURM_PORT_SPAN, SLURM_PORTS_PER_JOB
from diloco.errors import FieldError, UsageError
from diloco.launch import group_flags

DHT_WAIT_S = 120  # how long the script waits for the DHT's --hv.initial-peers line before giving up


@dataclass(frozen=True)
class Layout:
    """How the job is cut: `groups` worker groups of `nodes_per_group` nodes with `ranks_per_node` ranks (one
    torchrun per node) each; `groups_per_node` > 1 packs several one-node groups on a node (CPU runs, or nodes
    with GPUs for several groups)."""

    groups: int = 2
    nodes_per_group: int = 1
    groups_per_node: int = 1
    ranks_per_node: int = 1
    cpus_per_task: int = 1  # CPUs per rank
    gpus_per_node: int = 0  # GPUs the job asks for on each node; 0: CPU only

    def __post_init__(self) -> None:
        for name in ("groups", "nodes_per_group", "groups_per_node", "ranks_per_node", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise FieldError(f"{{{name}}} {getattr(self, name)}: must be at least 1")
        if self.groups_per_node > 1 and self.nodes_per_group > 1:
            raise FieldError("{groups_per_node} > 1 packs one-node groups: it needs {nodes_per_group} 1")
        if self.gpus_per_node and self.groups_per_node * self.ranks_per_node > self.gpus_per_node:
            raise FieldError(
                f"{{groups_per_node}} {self.groups_per_node} × {{ranks_per_node}} {self.ranks_per_node} ranks need "
                f"more than {{gpus_per_node}} {self.gpus_per_node}"
            )

    @property
    def nodes(self) -> int:
        return -(-self.groups * self.nodes_per_group // self.groups_per_node)

    def first_node(self, group: int) -> int:
        """Index, in the job's node list, of the first node of worker group `group` (its rendezvous host)."""
        return group * self.nodes_per_group // self.groups_per_node


@dataclass(frozen=True)
class Job:
    """What sbatch needs besides the layout; None leaves a setting to the cluster's defaults."""

    name: str = "diloco"
    output: Path = Path("runs/slurm")  # sbatch's log, and per job: the DHT's and each group's log
    time: str | None = None
    partition: str | None = None
    account: str | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[\w.-]+", self.name):
            raise FieldError(f"{{job_name}} {self.name!r}: use letters, digits, '.', '-', '_'")


def script(layout: Layout, job: Job, config: Config, train_args: Sequence[str], workdir: Path) -> str:
    """The whole sbatch script. `config` is `train_args` parsed (already validated): it tells whether the user
    gave a DHT (--hv.initial-peers: no DHT step) and where runs and checkpoints go."""
    bin_dir = Path(sys.executable).parent
    lines = _header(layout, job, workdir)
    own_dht = not config.hv.initial_peers
    if own_dht:
        lines += _dht_step(bin_dir)
    lines += ["", "PIDS=()"]
    for group in range(layout.groups):
        args = [shlex.quote(a) for a in train_args] + _group_args(config, group, layout.groups)
        if own_dht:
            args += ["--hv.initial-peers", "$PEERS"]  # unquoted on purpose: one word per multiaddr
        lines += _group_step(layout, group, bin_dir, args)
    lines += [
        "",
        "failed=0",
        'for i in "${!PIDS[@]}"; do',
        '  wait "${PIDS[$i]}" || { echo "worker group $i failed: see $OUT/worker-$i.log"; failed=1; }',
        "done",
        'echo "worker groups done (failed: $failed); logs in $OUT"',
        'exit "$failed"',
    ]
    return "\n".join(lines) + "\n"


def _header(layout: Layout, job: Job, workdir: Path) -> list[str]:
    output = (workdir / job.output).resolve()
    tasks_per_node = min(layout.groups_per_node, layout.groups)
    sbatch = {
        "job-name": job.name,
        "nodes": layout.nodes,
        "ntasks": layout.groups * layout.nodes_per_group,
        "ntasks-per-node": tasks_per_node,
        "cpus-per-task": layout.ranks_per_node * layout.cpus_per_task,
        "gpus-per-node": layout.gpus_per_node or None,
        "time": job.time,
        "partition": job.partition,
        "account": job.account,
        "output": f"{output}/{job.name}-%j.out",
        "chdir": workdir.resolve(),
    }
    lines = ["#!/bin/bash"] + [f"#SBATCH --{key}={value}" for key, value in sbatch.items() if value is not None]
    return lines + [
        f"# {layout.groups} DiLoCo worker groups of {layout.nodes_per_group} node(s) × {layout.ranks_per_node} "
        "rank(s), written by `diloco slurm`.",
        "set -uo pipefail",
        "export PYTHONUNBUFFERED=1",
        f"OUT={shlex.quote(str(output))}/$SLURM_JOB_ID",
        'mkdir -p "$OUT"',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"port() {{ echo $(( {SLURM_PORT_BASE} + ({SLURM_PORTS_PER_JOB} * SLURM_JOB_ID + $1) % {SLURM_PORT_SPAN} ));"
        " }  # diloco.distenv.slurm_port",
    ]


def _dht_step(bin_dir: Path) -> list[str]:
    """The bootstrap peer on the job's first node, sharing its CPUs (--overlap); its line of initial peers is
    kept in $OUT/initial-peers. It is the job's first srun, step 0: stopped with SIGTERM by scancel when the script
    exits (a signal to srun would end it with SIGKILL, leaving no time to stop p2pd), and killed if it is still
    there 10 s later (a DHT stuck in its shutdown once held a finished job until its time limit)."""
    diloco = shlex.quote(str(bin_dir / "diloco"))
    return [
        "",
        "# the DHT bootstrap peer on the first node; the worker groups read its --hv.initial-peers line",
        f'srun --overlap --nodes=1 --ntasks=1 --nodelist="${{NODES[0]}}" {diloco} dht --identity "$OUT/dht-id.pem" \\',
        '  --host-maddrs /ip4/0.0.0.0/tcp/0 >"$OUT/dht.log" 2>&1 &',
        "DHT=$!",
        "stop_dht() {  # SIGTERM, as srun's own would be SIGKILL; the step is killed if it is not gone after 10 s",
        '  scancel --signal=TERM "$SLURM_JOB_ID.0" 2>/dev/null',
        '  for _ in $(seq 20); do kill -0 "$DHT" 2>/dev/null || return 0; sleep 0.5; done',
        '  scancel "$SLURM_JOB_ID.0" 2>/dev/null; wait "$DHT" 2>/dev/null',
        "}",
        "trap stop_dht EXIT",
        f"for _ in $(seq {DHT_WAIT_S * 2}); do",
        '  grep -q -- "--hv.initial-peers" "$OUT/dht.log" && break',
        '  kill -0 "$DHT" 2>/dev/null || break',
        "  sleep 0.5",
        "done",
        'grep -o -- "--hv.initial-peers .*" "$OUT/dht.log" | head -1 | cut -d" " -f2- >"$OUT/initial-peers"',
        '[ -s "$OUT/initial-peers" ] || { echo "the DHT did not start:"; cat "$OUT/dht.log"; exit 1; }',
        'PEERS=$(cat "$OUT/initial-peers")',
    ]


def _group_args(config: Config, group: int, groups: int) -> list[str]:
    """This group's place in the galaxy and its own run and checkpoint folders (a repeated flag's last value
    wins); every group gets the same run name, so they land side by side as runs/<name>/worker-<i>."""
    args = [shlex.quote(arg) for arg in group_flags(config, group, groups)]
    if config.run_dir is None and config.run_name is None:
        args += ["--run-name", '"slurm-$SLURM_JOB_ID"']  # left for the shell to expand
    return args


def _group_step(layout: Layout, group: int, bin_dir: Path, args: list[str]) -> list[str]:
    """One srun step: one torchrun per node of the group, its rendezvous on the group's first node."""
    first, k = layout.first_node(group), layout.nodes_per_group
    nodes = f'"${{NODES[{first}]}}"' if k == 1 else f'"$(IFS=,; echo "${{NODES[*]:{first}:{k}}}")"'
    gpus = f" --gpus-per-node={layout.ranks_per_node}" if layout.gpus_per_node else ""
    torchrun = shlex.quote(str(bin_dir / "torchrun"))
    return [
        "",
        f"# worker group {group}",
        f"srun --nodes={k} --ntasks={k} --ntasks-per-node=1 --cpus-per-task="
        f"{layout.ranks_per_node * layout.cpus_per_task}{gpus} --exclusive --nodelist={nodes} \\",
        f"  {torchrun} --nnodes={k} --nproc_per_node={layout.ranks_per_node} --rdzv_backend=c10d \\",
        f'  --rdzv_endpoint="${{NODES[{first}]}}:$(port {group})" --rdzv_id="$SLURM_JOB_ID-{group}" -m diloco.train \\',
        f'  {" ".join(args)} >"$OUT/worker-{group}.log" 2>&1 &',
        "PIDS+=($!)",
    ]


def submit(path: Path) -> str:
    """`sbatch FILE`; returns the job id."""
    if shutil.which("sbatch") is None:
        raise UsageError("--submit: sbatch is not on PATH (write the script with -o FILE and submit it there)")
    out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=False)
    if out.returncode:
        raise UsageError(f"sbatch {path}: {' '.join(out.stderr.split()) or f'exit {out.returncode}'}")
    return out.stdout.strip().split(";")[0]
