"""`diloco slurm` writes the sbatch script we mean, and `srun python -m diloco.train` is one group: in-process,
no Slurm needed (bin/slurm-check runs the script on a real one-node Slurm)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diloco.cli import app as cli
from diloco.distenv import DistEnv, first_host, slurm_port, tasks_on_node
from diloco.errors import UsageError
from tests.support.paths import TINY_MODEL

TRAIN = [
    "--path-model", str(TINY_MODEL), "--fake-data", "--seq-length", "32", "--per-device-train-batch-size", "2",
    "--total-batch-size", "16", "--max-steps", "8", "--hv.local-steps", "4",
]  # fmt: skip
PEER = "/ip4/10.0.0.1/tcp/30001/p2p/QmWkmQwrYmcrKbAjtcnh2G3fwsXH1jpm6cNXZLVTQg7LFm"


def slurm_script(capsys: pytest.CaptureFixture[str], tmp_path: Path, *flags: str, train: list[str] = TRAIN) -> str:
    assert cli.run_app(cli.build_app(), ["slurm", "--output", str(tmp_path / "out"), *flags, "--", *train]) == 0
    return capsys.readouterr().out


def group_steps(script: str) -> list[str]:
    """Each worker group's srun command, continuation lines joined."""
    joined = script.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.startswith("srun ") and "torchrun" in line]


def test_each_group_is_a_background_srun_step_of_torchrun_on_its_own_nodes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    flags = ["--groups", "3", "--nodes-per-group", "2", "--gpus-per-node", "4", "--time", "01:00:00"]
    script = slurm_script(capsys, tmp_path, *flags, "--partition", "gpu", "--account", "lab", "--job-name", "run7")
    for line in ("--nodes=6", "--ntasks=6", "--ntasks-per-node=1", "--cpus-per-task=4", "--gpus-per-node=4",
                 "--time=01:00:00", "--partition=gpu", "--account=lab", "--job-name=run7"):  # fmt: skip
        assert f"#SBATCH {line}\n" in script
    assert f"#SBATCH --output={(tmp_path / 'out').resolve()}/run7-%j.out\n" in script
    steps = group_steps(script)
    assert len(steps) == 3
    for i, step in enumerate(steps):
        assert step.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=4 --gpus-per-node=4 ")
        assert "--exclusive" in step and step.endswith(f'>"$OUT/worker-{i}.log" 2>&1 &')
        assert f'--nodelist="$(IFS=,; echo "${{NODES[*]:{2 * i}:2}}")"' in step
        assert "--nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d" in step
        assert f'--rdzv_endpoint="${{NODES[{2 * i}]}}:$(port {i})"' in step
        assert f"--hv.galaxy-size 3 --hv.world-rank {i} " in step and "--hv.initial-peers $PEERS" in step
        assert '--run-name "slurm-$SLURM_JOB_ID"' in step  # one run folder for all groups, worker-<i> inside
    assert script.index("PIDS+=($!)") < script.index('wait "${PIDS[$i]}"')


def test_the_dht_step_runs_first_and_hands_its_peers_to_the_groups(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = slurm_script(capsys, tmp_path)
    dht = script.index(" dht --identity")
    assert script[:dht].rsplit("\n", 1)[1].startswith('srun --overlap --nodes=1 --ntasks=1 --nodelist="${NODES[0]}"')
    assert '>"$OUT/initial-peers"' in script and 'PEERS=$(cat "$OUT/initial-peers")' in script
    assert "trap stop_dht EXIT" in script and 'scancel --signal=TERM "$SLURM_JOB_ID.0"' in script  # the DHT (step 0)
    assert 'scancel "$SLURM_JOB_ID.0"' in script  # ends with the script, killed if SIGTERM did not end it
    assert dht < script.index("PEERS=") < script.index("# worker group 0")


def test_given_initial_peers_pass_through_and_no_dht_step_is_started(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = slurm_script(capsys, tmp_path, train=[*TRAIN, "--hv.initial-peers", PEER])
    assert " dht " not in script and "$PEERS" not in script
    assert all(f"--hv.initial-peers {PEER}" in step for step in group_steps(script))


def test_groups_packed_on_one_node_share_it_with_their_own_rendezvous_ports(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = slurm_script(capsys, tmp_path, "--groups", "4", "--groups-per-node", "2",
                          train=[*TRAIN, "--run-dir", "runs/x"])  # fmt: skip
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks-per-node=2\n" in script
    steps = group_steps(script)
    nodes = [re.search(r'--nodelist="\$\{NODES\[(\d)\]\}"', s)[1] for s in steps]  # type: ignore[index]
    assert nodes == ["0", "0", "1", "1"]
    assert [re.search(r"\$\(port (\d)\)", s)[1] for s in steps] == ["0", "1", "2", "3"]  # type: ignore[index]
    assert all(f"--run-dir runs/x/worker-{i} " in s for i, s in enumerate(steps))


@pytest.mark.parametrize(
    ("flags", "train", "message"),
    [
        (["--groups", "0"], TRAIN, "--groups 0: must be at least 1"),
        (["--groups-per-node", "2", "--nodes-per-group", "2"], TRAIN, "--groups-per-node > 1 packs one-node groups"),
        (["--gpus-per-node", "2", "--ranks-per-node", "4"], TRAIN, "--ranks-per-node 4 ranks need more than"),
        (["--nodes-per-group", "3"], TRAIN, "--total-batch-size 16 is not a multiple"),
        ([], [*TRAIN, "--precision", "fp8"], "--precision"),
    ],
)
def test_bad_slurm_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], train: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.run_app(cli.build_app(), ["slurm", "--output", str(tmp_path / "out"), *flags, "--", *train])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err


SRUN_STEP = {
    "SLURM_STEP_ID": "3", "SLURM_JOB_ID": "1234", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "node6", "SLURM_JOB_NODELIST": "node[6-7]",
}  # fmt: skip


def test_an_srun_step_without_torchrun_is_one_group_meeting_on_its_first_host() -> None:
    env = DistEnv.from_environ(SRUN_STEP)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.under_launcher and env.num_nodes == 2 and not env.is_main
    environ: dict[str, str] = {}
    env.export(environ)
    assert environ == {"MASTER_ADDR": "node6", "MASTER_PORT": str(slurm_port(1234, 3)), "RANK": "5",
                       "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}  # fmt: skip


def test_torchrun_variables_win_over_slurms_and_a_given_master_is_kept() -> None:
    torchrun = DistEnv.from_environ(SRUN_STEP | {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert (torchrun.rank, torchrun.world_size, torchrun.rendezvous) == (0, 2, None)
    given = DistEnv.from_environ(SRUN_STEP | {"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29500"})
    assert given.rendezvous is not None and given.rendezvous["MASTER_ADDR"] == "10.1.1.1"
    assert given.rendezvous["MASTER_PORT"] == "29500"


def test_a_batch_script_or_a_one_task_step_trains_alone() -> None:
    batch = {k: v for k, v in SRUN_STEP.items() if not k.startswith("SLURM_STEP")}  # sbatch's shell has no step id
    assert DistEnv.from_environ(batch) == DistEnv()
    assert DistEnv.from_environ(SRUN_STEP | {"SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}) == DistEnv()


def test_slurm_node_lists_and_task_counts_are_read_as_slurm_writes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [tasks_on_node("2(x3),1", node) for node in range(4)] == [2, 2, 2, 1]
    with pytest.raises(UsageError, match="SLURM_TASKS_PER_NODE"):
        tasks_on_node("two", 0)
    with pytest.raises(UsageError, match="SLURM_PROCID"):
        DistEnv.from_environ({k: v for k, v in SRUN_STEP.items() if k != "SLURM_PROCID"})
    assert first_host("node6") == "node6"  # a plain name needs no scontrol
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UsageError, match="scontrol is not on PATH"):
        first_host("node[6-7]")
    assert len({slurm_port(1234, step) for step in range(64)}) == 64
    assert all(15000 <= slurm_port(job, 0) < 45000 for job in (0, 1, 10**9))
