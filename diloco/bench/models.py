"""The tiny models the benches train, as code: each bench writes the configs it needs into its work dir, so
`diloco bench` runs from an installed package, with no checkout beside it.

The values are those of the test suite's model configs (a test compares them), so results stay comparable with
runs that read those files. Every model is a fresh (randomly initialised) llama: only its config
is written, no weights and no tokenizer (the benches use fake data or the byte tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# What every model here shares; MODELS adds the shape of each
_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 2048,
    "mlp_bias": False,
    "model_type": "llama",
    "pad_token_id": None,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "transformers_version": "5.23.0",
    "use_cache": True,
    "vocab_size": 1024,
}


def _llama(hidden: int, intermediate: int, layers: int, heads: int, head_dim: int, **more: Any) -> dict[str, Any]:
    shape = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
    }
    return _LLAMA | shape | more


MODELS: dict[str, dict[str, Any]] = {
    # 0.26M parameters: the quick runs of strategies, overhead and wire
    "llama-2m-fresh": _llama(64, 256, 2, 2, 32),
    # 1.3M: the full wire run
    "llama-1m-fresh": _llama(128, 512, 4, 4, 32),
    # ~1M with a vocabulary that holds the byte tokenizer's 258 ids: convergence, on real text
    "llama-1m-bytes": _llama(128, 384, 5, 4, 32, max_position_embeddings=512, vocab_size=260),
    # 0.14M, byte vocabulary: convergence's map over H up to 500, whose runs are 10× longer
    "llama-0.1m-bytes": _llama(64, 192, 2, 2, 32, max_position_embeddings=512, vocab_size=260),
    # the full runs of strategies and overhead
    "llama-14m-fresh": _llama(384, 1024, 7, 6, 64),
    # 207M: the outer part of the full scale run (three groups of it train together in 24 GB)
    "llama-200m-fresh": _llama(1024, 2816, 16, 16, 64),
    # 1.08B, tied embeddings: the checkpoint part of the full scale run (its config names no architectures class)
    "llama-1b-fresh": {key: value for key, value in _llama(
        2048, 8192, 16, 32, 64, num_key_value_heads=8, vocab_size=50304, bos_token_id=1, eos_token_id=2,
        rms_norm_eps=1e-06, tie_word_embeddings=True, transformers_version="5.24.0").items() if key != "architectures"},
}


def config(name: str) -> dict[str, Any]:
    """The config.json of model `name` (a key of MODELS), as a dict."""
    if name not in MODELS:
        raise KeyError(f"no bench model {name!r}; there are {', '.join(MODELS)}")
    return json.loads(json.dumps(MODELS[name]))  # a deep copy: nested values are not shared with the table


def write_model(name: str, folder: Path) -> Path:
    """Write model `name`'s config.json into `folder/name` (created) and return that folder, which is what
    `--path-model` and `diloco.model.load_model` take. Writing it again is harmless."""
    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config(name), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def model_folder(model: str | Path, folder: Path) -> Path:
    """A model folder for `model`: a path is used as it is (a test's own model), a name is written into
    `folder` with `write_model`."""
    return model if isinstance(model, Path) else write_model(model, folder)
