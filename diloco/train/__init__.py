"""The trainer of one worker group: ``torchrun ... -m diloco.train`` (``__main__``: the flags, checked before torch
is imported) and ``trainer`` (building the run and the inner loop, read top to bottom)."""
