"""Tiny configs of the architectures people train, written into a folder the trainer reads with `--path-model`
(config.json only: it initialises the model from its seed; nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

VOCAB = 512  # --fake-data draws its tokens below the config's vocab_size
# Every transformer-style config: hidden 64, 2 layers, 4 query heads over 2 key/value heads of 16, token ids in the
# vocabulary (the defaults of several name ids of their full-size vocabulary, which an embedding of 512 rejects).
COMMON = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "vocab_size": VOCAB, "max_position_embeddings": 64, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip

# model type → what its tiny config sets beside (or instead of) COMMON; what each exercises is said beside it
KNOWN: dict[str, dict] = {
    # learned positions, LayerNorm, fused qkv Conv1D, GELU MLP; lm_head tied to the token embedding
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2),
    "qwen2": COMMON | {"tie_word_embeddings": True},  # qkv biases; tied as in Qwen2-0.5B
    "qwen3": COMMON | {"tie_word_embeddings": True},  # q/k norms; tied as in Qwen3-0.6B
    "mistral": COMMON | {"sliding_window": 16},  # a window shorter than the 32-token sequences the tests train on
    "gemma": COMMON,  # embedding scaled by √hidden, (1 + w) RMSNorm, GeGLU; tied by default
    # attention and final-logit soft-capping, sliding and full attention by turns, pre/post norms; tied by default
    "gemma2": COMMON | {"sliding_window": 16, "query_pre_attn_scalar": 16},
    "phi3": COMMON | {"partial_rotary_factor": 0.5},  # fused qkv and gate/up, rotary over half of each head
    "olmo2": COMMON,  # post-norms, q/k norms over the whole projection
    "llama": COMMON,
}
# those this transformers knows (transformers>=4.50 is allowed; qwen3 came in 4.51)
ARCHITECTURES = {model_type: config for model_type, config in KNOWN.items() if model_type in CONFIG_MAPPING}


def write_config(model_type: str, folder: Path) -> Path:
    """`folder` holding the tiny config.json of `model_type`; returns `folder`."""
    AutoConfig.for_model(model_type, **ARCHITECTURES[model_type]).save_pretrained(folder)
    return folder
