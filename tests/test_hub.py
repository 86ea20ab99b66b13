"""Hub ids (`org/name`) for --path-model, --tokenizer and --dataset, read through a Hugging Face cache built here,
offline: the layout `hf download` leaves (hub/<type>s--ORG--NAME/snapshots/<commit>/..., refs/main)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .conftest import (
    CORPUS,
    FAST,
    TINY_MODEL,
    TORCHRUN,
    assert_ok,
    python_train,
    run_cmd,
    summary,
)
from .fakehub import FakeHub

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEXT = "to be or not to be that is the question whether tis nobler in the mind to suffer the slings and arrows"


def snapshot(hf_home: Path, repo_type: str, repo_id: str) -> Path:
    """An empty snapshot folder of `repo_id`, with refs/main naming it, as the hub cache lays it out."""
    repo = hf_home / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    folder = repo / "snapshots" / COMMIT
    folder.mkdir(parents=True)
    return folder


def cache_model(hf_home: Path, repo_id: str, weights: bool) -> str:
    """The tiny llama in the cache, with weights (returns their hash) or as config.json alone."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from diloco.model import params_sha256

    folder = snapshot(hf_home, "model", repo_id)
    if not weights:
        shutil.copy(TINY_MODEL / "config.json", folder / "config.json")
        return ""
    torch.manual_seed(1234)  # not the trainer's --seed: a fresh init would not match these weights
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    model.save_pretrained(folder)
    return params_sha256(list(model.named_parameters()))


def cache_tokenizer(hf_home: Path, repo_id: str) -> None:
    """A word-level tokenizer trained offline on TEXT, with an EOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel(unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(snapshot(hf_home, "model", repo_id))


def cache_dataset(hf_home: Path, repo_id: str, column: str = "text") -> None:
    """A parquet train split, as `hf download --repo-type dataset` leaves it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = snapshot(hf_home, "dataset", repo_id) / "data"
    data.mkdir()
    pq.write_table(pa.table({column: [TEXT] * 200}), data / "train-00000-of-00001.parquet")


def cache_dataset_configs(hf_home: Path, repo_id: str) -> None:
    """A dataset of two configurations, each a subfolder of parquet files, as wikitext lays them out on the hub:
    `small` has the text column, `other` does not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = snapshot(hf_home, "dataset", repo_id)
    for config, column in (("small", "text"), ("other", "words")):
        (folder / config).mkdir()
        pq.write_table(pa.table({column: [TEXT] * 50}), folder / config / "train-00000-of-00001.parquet")


def prepare_dataset(hf_home: Path, repo_id: str, work: Path) -> None:
    """A dataset as `datasets` keeps it once prepared (what `load_dataset(ID)` reads offline):
    datasets/ORG___NAME/default/0.0.0/<hash>/{dataset_info.json, NAME-train.arrow}. Prepared from a local folder
    named NAME, then moved under the id's namespace."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    org, name = repo_id.split("/")
    (work / name).mkdir(parents=True)
    pq.write_table(pa.table({"text": [TEXT] * 200}), work / name / "train.parquet")
    datasets.load_dataset(str(work / name), split="train", cache_dir=str(hf_home / "datasets"))
    (hf_home / "datasets" / name).rename(hf_home / "datasets" / f"{org}___{name}")


def hub_env(hf_home: Path) -> dict[str, str]:
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def train_args(run_dir: Path, *names: str) -> list[str]:
    return [*FAST, *names, "--max-steps", "2", "--total-batch-size", "2", "--run-dir", str(run_dir)]


def test_cached_ids_resolve_to_their_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process (huggingface_hub reads HF_HOME once, at import: the cache root is patched instead)."""
    from diloco import hub
    from diloco.data import HFTokenizer, tokenize_corpus
    from diloco.model import load_model, params_sha256

    monkeypatch.setattr(hub, "hub_cache", lambda: tmp_path / "hf" / "hub")
    saved = cache_model(tmp_path / "hf", "tiny-org/llama", weights=True)
    cache_tokenizer(tmp_path / "hf", "tiny-org/words")
    cache_dataset(tmp_path / "hf", "tiny-org/hamlet")
    assert params_sha256(list(load_model("tiny-org/llama", seed=0).named_parameters())) == saved
    tokens = tokenize_corpus(Path("tiny-org/hamlet"), HFTokenizer("tiny-org/words"))
    assert len(tokens) == 200 * 23  # 22 words and EOS per document


def test_a_snapshot_being_downloaded_is_read_once_the_download_ends(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A groupmate on this machine downloads the tokenizer: its snapshot folder is there, still without files, and
    the other rank waits for the download (the lock) instead of reading a half-written folder."""
    import threading

    from diloco import hub
    from diloco.data import HFTokenizer

    monkeypatch.setattr(hub, "hub_cache", lambda: tmp_path / "hf" / "hub")
    partial = snapshot(tmp_path / "hf", "model", "tiny-org/words")  # refs/main and an empty folder, as at the start
    downloading, done = threading.Event(), threading.Event()

    def groupmate() -> None:
        with hub.download_lock("tiny-org/words"):
            downloading.set()
            done.wait(30)
            shutil.rmtree(partial.parent.parent)  # the download ends: the snapshot, whole
            cache_tokenizer(tmp_path / "hf", "tiny-org/words")

    thread = threading.Thread(target=groupmate)
    thread.start()
    assert downloading.wait(30)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(HFTokenizer("tiny-org/words")))
    reader.start()
    reader.join(1.0)
    waited = reader.is_alive() and not got  # still waiting on the lock, not failed on an empty folder
    done.set()
    thread.join(30)
    reader.join(30)
    assert waited and len(got) == 1 and got[0].inner.eos_token == "</s>"


def test_a_hub_dataset_configuration_is_its_subfolder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dataset ID --dataset-config NAME`, as seed 003's load_dataset('wikitext', 'wikitext-2-raw-v1')."""
    from diloco import hub
    from diloco.data import HFTokenizer, tokenize_corpus
    from diloco.errors import FieldError

    monkeypatch.setattr(hub, "hub_cache", lambda: tmp_path / "hf" / "hub")
    cache_tokenizer(tmp_path / "hf", "tiny-org/words")
    cache_dataset_configs(tmp_path / "hf", "tiny-org/wiki")
    tokens = tokenize_corpus(Path("tiny-org/wiki"), HFTokenizer("tiny-org/words"), "small")
    assert len(tokens) == 50 * 23
    with pytest.raises(FieldError, match="tiny-org/wiki: no 'text' column \\(columns: words\\)"):
        tokenize_corpus(Path("tiny-org/wiki"), HFTokenizer("tiny-org/words"), "other")


def test_a_dataset_configuration_needs_a_hub_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    from .conftest import usage_error

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


def test_ids_missing_from_the_cache_are_downloaded_once_per_machine(tmp_path: Path) -> None:
    """Online, with an empty cache: both ranks of a group need the model, the tokenizer and the dataset; the first
    downloads each under a lock in the cache, the other finds the files, and the weights are the hub's."""
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
    assert all(count == 1 for count in hub.downloads.values()), hub.downloads  # one download per file
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


def test_a_local_folder_keeps_priority_over_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco import hub

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.is_hub_id("org/name")
    assert hub.is_hub_id("org/other") and hub.is_hub_id("gpt2")
    assert not hub.is_hub_id("/abs/path") and not hub.is_hub_id("a/b/c") and not hub.is_hub_id("corpus.txt")
