"""A Hugging Face cache built by the test, offline: the layout `hf download` leaves (hub/<type>s--ORG--NAME/
snapshots/<commit>/..., refs/main) with the tiny llama, a word-level tokenizer and parquet datasets of TEXT, and a
dataset as `datasets` keeps it once prepared."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.paths import TINY_MODEL

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
