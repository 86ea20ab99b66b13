"""Hub ids (`org/name`) for --path-model, --tokenizer and --dataset in real runs: read through a Hugging Face cache
built here, offline (``tests.support.hub_cache``), or downloaded from a hub on loopback; and their one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fakehub import FakeHub
from tests.support.hub_cache import (
    COMMIT,
    cache_dataset,
    cache_model,
    cache_tokenizer,
    hub_env,
    prepare_dataset,
)
from tests.support.parse import usage_error
from tests.support.paths import CORPUS, TORCHRUN
from tests.support.procs import FAST, assert_ok, python_train, run_cmd, summary


def train_args(run_dir: Path, *names: str) -> list[str]:
    return [*FAST, *names, "--max-steps", "2", "--total-batch-size", "2", "--run-dir", str(run_dir)]


def test_a_dataset_configuration_needs_a_hub_dataset(capsys: pytest.CaptureFixture[str]) -> None:

    alone = usage_error([*FAST, "--fake-data", "--dataset-config", "wikitext-2-raw-v1"], capsys)
    assert "--dataset-config" in alone and "--dataset ID" in alone
    local = python_train([*FAST, "--dataset", str(CORPUS), "--dataset_config_name", "x"], timeout=60)
    assert local.returncode == 2 and local.stderr.count("\n") == 1, local.output  # checked before torch loads
    assert "--dataset-config x: --dataset" in local.stderr and "local path" in local.stderr


def test_hub_ids_load_weights_tokenizer_and_dataset_from_the_cache(tmp_path: Path) -> None:
    hf_home, run_dir = tmp_path / "hf", tmp_path / "run"
    saved = cache_model(hf_home, "tiny-org/llama", weights=True)
    cache_tokenizer(hf_home, "tiny-org/words")
    cache_dataset(hf_home, "tiny-org/hamlet")
    names = ["--path-model", "tiny-org/llama", "--tokenizer", "tiny-org/words", "--dataset", "tiny-org/hamlet"]
    result = python_train([*train_args(run_dir, *names), "--max-steps", "0"], env=hub_env(hf_home))
    assert_ok(result)
    assert summary(run_dir)["status"] == "ok"
    assert summary(run_dir)["params_sha256"] == saved  # after 0 steps: the cached weights, not a fresh init
    assert f"{200 * 23:,} tokens" in result.output  # 22 words and EOS per document: the cached word tokenizer


def test_a_cached_config_alone_trains_a_fresh_model_on_a_prepared_dataset(tmp_path: Path) -> None:
    hf_home, run_dir = tmp_path / "hf", tmp_path / "run"
    cache_model(hf_home, "tiny-org/fresh", weights=False)
    prepare_dataset(hf_home, "tiny-org/hamlet", tmp_path / "src")
    result = python_train(train_args(run_dir, "--path-model", "tiny-org/fresh", "--dataset", "tiny-org/hamlet"),
                          env=hub_env(hf_home))  # fmt: skip
    assert_ok(result)
    assert summary(run_dir)["steps"] == 2 and summary(run_dir)["status"] == "ok"


def online_env(hf_home: Path, endpoint: str) -> dict[str, str]:
    """A hub that answers (the loopback FakeHub), an empty cache, nothing offline; no proxy in the way. The FakeHub
    is a thread of the test's process: under the suite's load it may answer slower than huggingface_hub's 10 s."""
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_ENDPOINT": endpoint,
           "HF_HUB_ETAG_TIMEOUT": "60", "HF_HUB_DOWNLOAD_TIMEOUT": "60"}  # fmt: skip
    return env | {name: "" for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")}


@pytest.mark.slow
def test_ids_missing_from_the_cache_are_downloaded_once_per_machine(tmp_path: Path) -> None:
    """Online, with an empty cache: both ranks of a group need the model, the tokenizer and the dataset; the first
    downloads the model and tokenizer under a lock in the cache, the other finds the files, and the weights are the
    hub's. The dataset streams into the token store, which the other rank waits for and reads."""
    source = tmp_path / "published"  # what the hub serves: repositories laid out as folders
    saved = cache_model(source, "tiny-org/llama", weights=True)
    cache_tokenizer(source, "tiny-org/words")
    cache_dataset(source, "tiny-org/hamlet")
    served = {f"{kind}s/{repo}": source / "hub" / f"{kind}s--{repo.replace('/', '--')}" / "snapshots" / COMMIT
              for kind, repo in (("model", "tiny-org/llama"), ("model", "tiny-org/words"), ("dataset", "tiny-org/hamlet"))}  # fmt: skip
    run_dir = tmp_path / "run"
    names = ["--path-model", "tiny-org/llama", "--tokenizer", "tiny-org/words", "--dataset", "tiny-org/hamlet"]
    train = [*train_args(run_dir, *names), "--max-steps", "0", "--total-batch-size", "4"]
    with FakeHub(served) as hub:
        command = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "diloco.train", *train]
        result = run_cmd(command, timeout=180, env=online_env(tmp_path / "hf", hub.url))
    assert_ok(result)
    assert summary(run_dir)["params_sha256"] == saved  # the hub's weights, not a fresh init
    weights = [name for name in hub.downloads if name.startswith("tiny-org/llama/") and "safetensors" in name]
    assert weights and hub.downloads["tiny-org/llama/config.json"] == 1
    # one download per file of the model and the tokenizer; the dataset, not cached, is streamed into the token
    # store (`datasets` reads its file for the schema, then for the rows) and nothing of it lands in the cache
    streamed = {name: n for name, n in hub.downloads.items() if name.startswith("tiny-org/hamlet/")}
    assert streamed and all(n <= 2 for n in streamed.values()), hub.downloads
    assert all(n == 1 for name, n in hub.downloads.items() if name not in streamed), hub.downloads
    assert not list((tmp_path / "hf").rglob("*.parquet")), list((tmp_path / "hf").rglob("*.parquet"))
    assert hub.downloads["tiny-org/words/tokenizer.json"] == 1
    assert (tmp_path / "hf" / "hub" / "models--tiny-org--llama" / "snapshots").is_dir()


def test_an_id_the_hub_does_not_have_is_one_line(tmp_path: Path) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    with FakeHub({}) as hub:
        line = one_line_exit_2([*FAST, "--fake-data", "--path-model", "tiny-org/nope"],
                               online_env(tmp_path / "hf", hub.url), work)  # fmt: skip
    assert "--path-model tiny-org/nope: not a local path, and no such repository on the Hugging Face hub" in line


def one_line_exit_2(args: list[str], env: dict[str, str], cwd: Path) -> str:
    result = python_train(args, env=env, cwd=cwd)
    assert result.returncode == 2, result.output[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output[-3000:]
    assert list(cwd.iterdir()) == []  # nothing written
    return lines[0]


@pytest.mark.parametrize("flag", ["--path-model", "--tokenizer", "--dataset"])
def test_an_id_in_no_cache_is_one_line_naming_flag_and_id(flag: str, tmp_path: Path) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    args = {"--path-model": ["--fake-data"], "--tokenizer": ["--dataset", str(CORPUS)], "--dataset": []}[flag]
    line = one_line_exit_2([*FAST, *args, flag, "gpt3/foo"], hub_env(tmp_path / "empty"), work)
    assert f"{flag} gpt3/foo: not a local path, and not in the Hugging Face cache {tmp_path / 'empty'}" in line
    assert "hf download" in line


def test_an_unreachable_hub_is_one_line_in_seconds(tmp_path: Path) -> None:
    """Online but nothing answers (a closed port stands in for a machine without internet): one connection
    attempt, not huggingface_hub's half a minute of retries."""
    work = tmp_path / "cwd"
    work.mkdir()
    env = hub_env(tmp_path / "empty") | {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    env |= {name: "" for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")}
    line = one_line_exit_2([*FAST, "--fake-data", "--path-model", "gpt3/foo"], env, work)
    assert "--path-model gpt3/foo: not a local path" in line and "the hub 127.0.0.1 is unreachable" in line


def test_a_dataset_without_text_column_is_one_line(tmp_path: Path) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    cache_dataset(tmp_path / "hf", "tiny-org/numbers", column="body")
    line = one_line_exit_2([*FAST, "--dataset", "tiny-org/numbers"], hub_env(tmp_path / "hf"), work)
    assert "--dataset tiny-org/numbers: no 'text' column (columns: body)" in line
