"""Command line: argv (+ an optional TOML file) -> validated config -> one call. No training logic here."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import tomllib
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import cyclopts
import pydantic
from cyclopts import App, Parameter

from diloco import preflight
from diloco.bench.cli import bench_app
from diloco.cli import deepspeed
from diloco.cli.spellings import translate
from diloco.config import Config, HvConfig
from diloco.console import log_warning, setup_logging
from diloco.distenv import DistEnv
from diloco.errors import FieldError, RankUsageError, UsageError, first_line

USAGE_EXIT = 2
TRAIN_ONLY = "diloco.train"  # the name of `python -m diloco.train`'s app
QUIET_RANK_WAIT_S = 5.0  # how long a rank that leaves the report of a bad input to rank 0 waits for it


def train(config: Config) -> int:
    """Train one worker group (under torchrun for several ranks).

    --config FILE.toml reads flags from a TOML file: keys spelled as the flags without their dashes (path-model =
    "models/x", max-steps = 1000), [hv] and [ckpt] tables for --hv.* and --ckpt.*; flags on the command line win.
    --deepspeed ds_config.json reads a DeepSpeed config as the flags it maps to, ahead of those given beside it
    (docs/cli.md); the deepspeed launcher's --local_rank N is ignored. OpenDiLoCo's train_fsdp.py flags are taken
    too (docs/seeds.md)."""
    env = DistEnv.from_environ()
    env.export()  # an srun step without torchrun: the variables torch's env:// rendezvous (and rank 0 gating) read
    setup_logging(env.rank)
    preflight.check_run(config, env.world_size)  # before torch: bad input fails in a fraction of a second
    if (unused := config.hv.unused_alone()) and env.rank == 0:
        logging.getLogger("diloco").warning(
            "%s ignored: with --hv.galaxy-size 1 this group trains alone (plain torch.distributed, no DHT); give "
            "--hv.galaxy-size N for a swarm", ", ".join(flag(f"hv.{name}") for name in unused),
        )  # fmt: skip
    from diloco.train import trainer as training

    return training.main(config, env)


# hivemind-dht's spellings work too, so its users' scripts run unchanged
_DHT_IDENTITY = Parameter(
    name=["--identity", "--identity-path", "--identity_path"],
    help="Private key file; created with mode 0600 when missing.",
)
_DHT_HOSTS = Parameter(
    name=["--host-maddrs", "--host_maddrs"], consume_multiple=True, help="Multiaddrs to listen on."
)
_DHT_ANNOUNCE = Parameter(
    name=["--announce-maddrs", "--announce_maddrs"], consume_multiple=True, help="Multiaddrs to announce to peers."
)


_DHT_RELAY = Parameter(name="--relay-ports", help=(
    "FIRST-LAST: relay for worker groups behind home routers (nobody can dial them): FIRST is the relay's control "
    "port, the others are leased to such ranks (two for a group's rank 0, one for each other rank). Open them all "
    "to the internet. Every byte of a round to a relayed rank crosses this machine twice."
))


def dht(
    *,
    identity: Annotated[Path, _DHT_IDENTITY] = Path("keys/id.pem"),
    host_maddrs: Annotated[list[str], _DHT_HOSTS] = ["/ip4/0.0.0.0/tcp/0"],  # noqa: B006
    announce_maddrs: Annotated[list[str], _DHT_ANNOUNCE] = [],  # noqa: B006
    relay_ports: Annotated[str | None, _DHT_RELAY] = None,
) -> int:
    """Run a hivemind DHT bootstrap peer with a stable peer id until SIGINT/SIGTERM."""
    from functools import partial

    from diloco.config import HvConfig

    setup_logging(0)
    warnings.showwarning = log_warning  # e.g. a readable identity file: one line, not Python's two
    HvConfig(host_maddrs=host_maddrs, announce_maddrs=announce_maddrs)  # the same multiaddr checks as training
    ports = _port_range(relay_ports) if relay_ports is not None else None
    # hivemind: only once the flags are valid
    from diloco.swarm.records.dht import serve_dht
    from diloco.swarm.relay.server import Relay
    from diloco.swarm.rounds import reachability

    relay = None
    if ports is not None:
        try:
            relay = Relay("0.0.0.0", ports[0], ports[1:]).start()
        except OSError as e:
            raise UsageError(f"--relay-ports {relay_ports}: cannot listen on port {ports[0]}: {e.strerror or e}"
                             ) from None  # fmt: skip
        logging.getLogger("diloco").info("relaying for ranks nobody can dial: control port %d, %d port(s) to lease",
                                         ports[0], len(ports) - 1)  # fmt: skip
    try:
        # (its FieldErrors name this command's parameters); it dials joining ranks back: they learn if they are
        # reachable, and of the relay when they are not
        serve = partial(reachability.serve, relay_port=relay.control_port if relay is not None else None)
        return serve_dht(identity, host_maddrs, announce_maddrs, services=[serve])
    finally:
        if relay is not None:
            relay.close()


def _port_range(spec: str) -> list[int]:
    """The ports of ``--relay-ports FIRST-LAST``: at least two, each in 1024..65535."""
    first, _, last = spec.partition("-")
    try:
        ports = list(range(int(first), int(last or first) + 1))
    except ValueError:
        ports = []
    if len(ports) < 2 or ports[0] < 1024 or ports[-1] > 65535:
        raise UsageError(f"--relay-ports {spec}: give FIRST-LAST, two or more ports from 1024 to 65535 (FIRST is the "
                         "control port, the others are leased)")  # fmt: skip
    return ports


_DEFAULT_RUN_ID = HvConfig.model_fields["run_id"].default  # the run id a worker group uses when given none


class _HvFlags(pydantic.BaseModel):
    """The ``--hv.*`` flags of a command other than train, checked as training checks them (errors name
    ``--hv.<field>``)."""

    hv: HvConfig


def keygen(path: Annotated[Path, Parameter(help="Where to write the key (refused if the file exists).")], /) -> int:
    """Write a new swarm key: a random secret, mode 0600. Give it to every worker group of the swarm with
    --hv.swarm-key PATH (and to `diloco status`); copy it to the other machines over a channel you trust."""
    from diloco.swarm.records.swarm_key import keygen as write_key

    write_key(path)
    print(f"wrote a swarm key to {path} (mode 0600); pass --hv.swarm-key {path} to every group of the swarm")
    return 0


def status(
    *,
    initial_peers: Annotated[list[str], Parameter(name="--hv.initial-peers", consume_multiple=True, negative="", help=(
        "Multiaddrs of DHT peers of the run, each ending in /p2p/ and the peer id, as `diloco dht` prints them."
    ))] = [],  # noqa: B006
    run_id: Annotated[str, Parameter(name="--hv.run-id", help=(
        "The run's swarm name (its groups' --hv.run-id)."
    ))] = _DEFAULT_RUN_ID,
    swarm_key: Annotated[Path | None, Parameter(name="--hv.swarm-key", help=(
        "The swarm's key file, when its groups run with --hv.swarm-key."
    ))] = None,
    watch: Annotated[float | None, Parameter(help="Redraw every SECONDS until Ctrl+C (then exit 0).")] = None,
    as_json: Annotated[bool, Parameter(name="--json", negative="", help=(
        "One JSON object (run_id, time, groups) instead of the table; with --watch, one per line."
    ))] = False,
) -> int:  # fmt: skip
    """Show the worker groups of a run, one row each: step, outer step, tokens/s, last round, when last heard.

    Joins the DHT as a client (no training, no averaging) and reads the status records the groups publish.

    Exit codes:
      0  shown (or --watch ended by Ctrl+C)
      1  no DHT peer answered at --hv.initial-peers
      2  bad flags
      3  no worker group of --hv.run-id published a status in the last 3 minutes"""
    # plain Python: hivemind only once the flags are valid
    from diloco.cli import monitor

    _HvFlags(hv={"initial_peers": initial_peers, "run_id": run_id, "swarm_key": swarm_key})
    if watch is not None and watch <= 0:
        raise UsageError(f"--watch {watch:g}: give a positive number of seconds")
    try:
        return monitor.show(initial_peers, run_id, watch, as_json, swarm_key=swarm_key)
    except monitor.StatusError as e:
        print(f"error: {_one_line(as_flags(e.within('hv')))}", file=sys.stderr)
        return e.exit_code
    except FieldError as e:
        raise e.within("hv") from None


def launch(
    *train_args: Annotated[str, Parameter(help="Flags for every worker group's `diloco.train`, after `--`.")],
    workers: Annotated[int, Parameter(help="Worker groups to start (the galaxy size).")] = 2,
    nproc_per_worker: Annotated[int, Parameter(help="Ranks (torchrun processes) per worker group.")] = 1,
) -> int:
    """Start a DHT and WORKERS worker groups on this machine: `diloco launch --workers 2 -- <train flags>`."""
    from diloco import launch as launcher

    if workers < 1 or nproc_per_worker < 1:
        raise UsageError("--workers and --nproc-per-worker must be at least 1")
    seen: list[Config] = []
    run_app(build_app(train_only=True, train_fn=lambda config: seen.append(config) or 0), list(train_args),
            world_size=nproc_per_worker)  # fmt: skip
    preflight.check_files(seen[0])  # fail here, before a DHT or any worker starts (each checks the rest itself)
    preflight.check_batch(seen[0], nproc_per_worker)
    setup_logging(0)
    return launcher.launch(seen[0], list(train_args), workers, nproc_per_worker)


def slurm(
    *train_args: Annotated[str, Parameter(help="Flags for every worker group's `diloco.train`, after `--`.")],
    groups: Annotated[int, Parameter(help="Worker groups (the galaxy size), one srun step each.")] = 2,
    nodes_per_group: Annotated[int, Parameter(help="Nodes per worker group (one torchrun on each).")] = 1,
    groups_per_node: Annotated[int, Parameter(help="One-node groups packed on one node (CPU runs).")] = 1,
    ranks_per_node: Annotated[int | None, Parameter(help=(
        "Ranks of a group on one node [default: --gpus-per-node ÷ --groups-per-node, or 1]."
    ))] = None,
    gpus_per_node: Annotated[int, Parameter(help="GPUs to ask for on each node (0: CPU only).")] = 0,
    cpus_per_task: Annotated[int, Parameter(help="CPUs per rank.")] = 1,
    time: Annotated[str | None, Parameter(help="sbatch --time, e.g. 24:00:00.")] = None,
    partition: Annotated[str | None, Parameter(help="sbatch --partition.")] = None,
    account: Annotated[str | None, Parameter(help="sbatch --account.")] = None,
    job_name: Annotated[str, Parameter(help="sbatch --job-name; also names the log files.")] = "diloco",
    output: Annotated[Path, Parameter(help=(
        "Folder for sbatch's log and, per job, the DHT's and each group's log (created now: Slurm does not)."
    ))] = Path("runs/slurm"),
    script_file: Annotated[Path | None, Parameter(name=["--script", "-o"], help="Write the script here "
                                                  "instead of printing it.")] = None,
    submit: Annotated[bool, Parameter(negative="", help="Submit it with sbatch and print the job id.")] = False,
) -> int:  # fmt: skip
    """Write an sbatch script for GROUPS worker groups, each one srun step of torchrun, plus a DHT step unless
    --hv.initial-peers is among the train flags: `diloco slurm --groups 2 -- <train flags>`."""
    from diloco import slurm as slurm_script

    per_node = ranks_per_node if ranks_per_node is not None else max(1, gpus_per_node // groups_per_node)
    layout = slurm_script.Layout(groups, nodes_per_group, groups_per_node, per_node, cpus_per_task, gpus_per_node)
    job = slurm_script.Job(job_name, output, time, partition, account)
    seen: list[Config] = []
    checked = [*train_args, "--hv.galaxy-size", str(groups), "--hv.world-rank", str(groups - 1)]
    run_app(build_app(train_only=True, train_fn=lambda config: seen.append(config) or 0), checked,
            world_size=nodes_per_group * per_node)  # fmt: skip
    preflight.check_files(seen[0])  # here, not in the job an hour later (the cluster's nodes see the same files)
    preflight.check_batch(seen[0], nodes_per_group * per_node)
    text = slurm_script.script(layout, job, seen[0], list(train_args), Path.cwd())
    (Path.cwd() / output).mkdir(parents=True, exist_ok=True)
    if script_file is None and not submit:
        print(text, end="")
        return 0
    path = script_file or Path.cwd() / output / f"{job_name}.sbatch"
    path.write_text(text)
    if submit:
        print(slurm_script.submit(path))
    return 0


def plot(
    *run_dirs: Annotated[Path, Parameter(help="Run folders; each folder under them holding a metrics.jsonl is one "
                                              "worker group (runs/<name>/worker-0, worker-1, ...).")],  # fmt: skip
    output: Annotated[Path | None, Parameter(name=["--output", "-o"], help="PNG to write [default: "
                                             "<first RUN_DIR>/loss.png].")] = None,  # fmt: skip
) -> int:
    """Train and eval loss of every worker group against inner step and wall-clock, outer steps marked, in one
    PNG: `diloco plot runs/<name> -o loss.png`."""
    # plain Python until the folders are read: matplotlib only to draw
    from diloco.plot import plot_runs

    if not run_dirs:
        raise UsageError("plot needs at least one RUN_DIR (a run folder holding metrics.jsonl files)")
    if output is not None and output.suffix.lower() != ".png":
        raise UsageError(f"--output {output}: must be a .png file")
    setup_logging(0)
    plot_runs(list(run_dirs), output)
    return 0


def build_app(train_only: bool = False, train_fn: Callable[[Config], int] = train) -> App:
    """`diloco` with its subcommands, or (train_only) the flags of `python -m diloco.train`."""

    def train_command(*, config: Config) -> int:
        return train_fn(config)

    train_command.__doc__ = train.__doc__
    common: dict[str, Any] = {
        "print_error": False,
        "exit_on_error": False,
        "result_action": "return_value",
        "default_parameter": Parameter(allow_repeating=True),  # argparse habit: a repeated flag's last value wins
        # plain text: markdown would swallow `<run name>` in "runs/<run name>/worker-<...>" as an HTML tag
        "help_format": "plaintext",
    }
    if train_only:
        return App(name=TRAIN_ONLY, default_command=train_command, help=train.__doc__, **common)
    about = "Decentralized DiLoCo training: FSDP worker groups averaging through hivemind."
    app = App(name="diloco", help=about, **common)
    app.command(train_command, name="train")
    app.command(dht)
    app.command(status)
    app.command(keygen)
    app.command(launch)
    app.command(slurm)
    app.command(plot)
    app.command(bench_app())
    return app


def run_app(app: App, argv: Sequence[str], world_size: int | None = None) -> int:
    """Parse and call; every user error becomes one line on stderr and exit code 2. `world_size`: the ranks of the
    worker group a training command is for, where they are not this process's (a launcher checking its groups'
    flags) [default: the launcher's environment]."""
    try:
        tokens, config_file = _pop_config_flag(list(argv))
        training = app.name[0] == TRAIN_ONLY or tokens[:1] == ["train"]
        if training:  # other trainers' habits in the flags of a training command: OpenDiLoCo's, DeepSpeed's
            head, flags = ([], tokens) if app.name[0] == TRAIN_ONLY else (tokens[:1], tokens[1:])
            flags, warning = deepspeed.expand(translate(flags), world_size)
            tokens = [*head, *flags]
            if warning and DistEnv.from_environ().is_main:  # every rank reads the same file: rank 0 says it
                print(f"warning: {warning}", file=sys.stderr)
        if config_file is not None:
            app.config = _config_source(config_file, flat=training)
        result = app(tokens)
    except FieldError as e:
        _usage_exit(as_flags(e))
    except (UsageError, cyclopts.CycloptsError, pydantic.ValidationError) as e:
        _usage_exit(e)
    return result if isinstance(result, int) else 0


def flag(field: str) -> str:
    """How the command line spells a config field: ``hv.world_rank`` -> ``--hv.world-rank``."""
    return "--" + field.replace("_", "-")


def as_flags(error: FieldError) -> UsageError:
    """A lower layer's error as the command line reports it: every field it names spelled as its flag."""
    return error.spelled(flag)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """`diloco ...` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    code = run_app(build_app(), argv)
    if argv[:1] == ["train"]:
        _exit_now(code)
    sys.exit(code)


def train_entry(argv: Sequence[str] | None = None) -> NoReturn:
    """`python -m diloco.train ...` (what torchrun runs)."""
    _exit_now(run_app(build_app(train_only=True), sys.argv[1:] if argv is None else argv))


def _exit_now(code: int) -> NoReturn:
    """Leave without interpreter finalization once training has written and closed everything: gloo's worker
    threads can still hold tensors then, and destroying them during finalization aborts the process (seen
    here about once in 20 runs as 'terminate called without an active exception', exit -6). What finalization
    would have removed is removed here: multiprocessing's temp folder (``pymp-*`` in TMPDIR), one per rank."""
    import multiprocessing.process
    import shutil

    sys.stdout.flush()
    sys.stderr.flush()
    tempdir = multiprocessing.process.current_process()._config.get("tempdir")
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)
    os._exit(code)


def _pop_config_flag(tokens: list[str]) -> tuple[list[str], Path | None]:
    """Take `--config FILE` out of argv (before a bare ``--``: what follows is another command's, e.g. the training
    flags of `diloco launch ... -- --config run.toml`); flags given on the command line then win over the file."""
    for i, token in enumerate(tokens):
        if token == "--":
            break
        if token == "--config":
            if i + 1 >= len(tokens):
                raise UsageError("--config needs a TOML file path")
            return tokens[:i] + tokens[i + 2 :], Path(tokens[i + 1])
        if token.startswith("--config="):
            return tokens[:i] + tokens[i + 1 :], Path(token.split("=", 1)[1])
    return tokens, None


def _config_source(path: Path, flat: bool) -> cyclopts.config.Toml:
    """Flags from a TOML file: for training, its top-level keys (``path-model = ...``, tables ``[hv]`` and
    ``[ckpt]``), as `python -m diloco.train` takes it, or a file that keeps them under ``[train]``; for the other
    commands, keys under a table named after the command."""
    if not path.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        tables = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: not a TOML file ({first_line(e)})") from None
    under_train = set(tables) == {"train"} and isinstance(tables["train"], dict)
    return cyclopts.config.Toml(path, must_exist=True, allow_unknown=False, use_commands_as_keys=not flat,
                                root_keys=("train",) if flat and under_train else ())  # fmt: skip


def _usage_exit(error: BaseException) -> NoReturn:
    """One line, on rank 0 only (every rank of a torchrun group sees the same bad input), unless only this rank
    met it."""
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"error: {_one_line(error)}", file=sys.stderr)
    elif isinstance(error, RankUsageError):
        print(f"error: rank {rank}: {_one_line(error)}", file=sys.stderr)
    else:
        # rank 0 reports it: torchrun ends the other ranks as soon as one fails, so a quiet rank that left first
        # could end rank 0 before its line (seen under load: no line at all). Wait instead; once rank 0 left,
        # torchrun's SIGTERM ends the wait (whatever handler the run had installed)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(QUIET_RANK_WAIT_S)
    sys.exit(USAGE_EXIT)


def _one_line(error: BaseException) -> str:
    if isinstance(error, cyclopts.CycloptsError) and isinstance(error.__cause__, pydantic.ValidationError):
        error = error.__cause__
    if isinstance(error, pydantic.ValidationError):
        errors = [(_field_path(e["loc"]), e) for e in error.errors()]
        loc, first = errors[0]
        flag = "--" + ".".join(str(part).replace("_", "-") for part in loc) if loc else ""
        message = first["msg"].removeprefix("Value error, ")
        if not flag or message.startswith("--"):  # a cross-field check whose message names its flags
            return message
        # a union (a number or "auto"): one error per member, all of the same field
        others = [e["msg"].removeprefix("Input should be ") for path, e in errors[1:] if path == loc]
        return f"{flag}: {', or '.join([message, *others])} (got {first['input']!r})"
    return " ".join(str(error).split())


def _field_path(loc: tuple) -> tuple:
    """A validation error's location without pydantic's union member tags (``constrained-float``,
    ``literal['auto']``): the field names only."""
    return tuple(part for part in loc if isinstance(part, int) or str(part).isidentifier())
