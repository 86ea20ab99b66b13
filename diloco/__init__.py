"""diloco: decentralized DiLoCo training with FSDP worker groups and hivemind."""

__version__ = "0.1.0"
