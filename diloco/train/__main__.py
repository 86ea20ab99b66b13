"""`python -m diloco.train` / `torchrun ... -m diloco.train`: the flags are checked before torch is imported."""

from diloco.cli.app import train_entry

train_entry()  # never returns
