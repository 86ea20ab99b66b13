"""Checkpoints: sharded model and optimizer through torch.distributed.checkpoint (DCP), plus each rank's
own small state (scheduler, data position, RNG, outer state) and a meta.json written last.

Layout of `<ckpt.path>/step-N/`: DCP's `.metadata` and `__*.distcp` shards, `rank-R.pt` per rank, `meta.json`.
Under ZERO1 the AdamW state is split by ZeroRedundancyOptimizer's own partition (not a DCP-visible sharding), so each
rank's partition goes into its `rank-R.pt`, like its RNG: bit-exact on resume with the same number of ranks (which
`check_layout` requires anyway), without gathering the whole optimizer state onto one rank.
A checkpoint is written to `step-N.tmp/` and renamed once every rank has finished, so a folder named
`step-N` is always complete.

`latest` and `check_layout` look at files only; torch is imported by the functions that need it, so the command
line can check a checkpoint folder before it imports torch.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.errors import FieldError, first_line

if TYPE_CHECKING:
    import torch

STEP_DIR = re.compile(r"^step-(\d+)$")
RANK_STATE = "sharded_rank_state"  # the key of `ModelAndOptimizer.rank_state()` in each rank-R.pt


class ModelAndOptimizer:
    """DCP Stateful view of a sharded model and its optimizer (each rank saves and loads its own shards). A ZeRO-1
    optimizer's partition is no DCP state: `rank_state` hands it to the rank's own file instead."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        from diloco.parallel import unwrap
        from diloco.shards import tied_aliases

        self.model, self.optimizer = model, optimizer
        self.partitioned = isinstance(optimizer, ZeroRedundancyOptimizer)
        plain = unwrap(model)
        self.aliases = tied_aliases(plain)
        # with LoRA the base is frozen: --path-model (or --seed) gives it back, so a checkpoint holds the adapters
        self.frozen = {name for name, p in plain.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def state_dict(self) -> dict[str, Any]:
        """The model's state without frozen parameters and without the aliases of a tied weight (a tied lm_head is
        the token embedding: DCP would write it twice, a vocabulary's worth of bytes), and the optimizer's (torch
        keys a tied weight's once)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )

        options = StateDictOptions(ignore_frozen_params=bool(self.frozen))
        if self.partitioned:
            model_state, optim_state = get_model_state_dict(self.model, options=options), None
        else:
            model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        for alias in self.aliases:
            model_state.pop(alias, None)  # (a frozen one is not there)
        return {"model": model_state} if optim_state is None else {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        model_state = state["model"]
        for alias, name in self.aliases.items():  # the loaded tensor is the tied parameter's, under either name
            if name in model_state:
                model_state[alias] = model_state[name]
        options = StateDictOptions(strict=not self.frozen)  # the frozen base is not in it: only it may be missing
        if self.partitioned:
            loaded = set_model_state_dict(self.model, model_state, options=options)
        else:
            loaded = set_state_dict(self.model, self.optimizer, model_state_dict=model_state,
                                    optim_state_dict=state["optim"], options=options)  # fmt: skip
        missing = {key.removeprefix("module.") for key in loaded.missing_keys} - self.frozen  # (DDP's prefix)
        unfit = sorted(missing) + list(loaded.unexpected_keys)
        if unfit:
            raise ValueError(f"it does not fit this model: {len(unfit)} parameter(s) missing or unexpected (first: "
                             f"{unfit[0]})")

    def rank_state(self) -> dict[str, Any]:
        """What only this rank holds: its ZeRO-1 partition's AdamW state, and the hyper-parameters of the
        wrapper's param groups (the LR schedule writes the learning rate there); empty for other optimizers."""
        if not self.partitioned:
            return {}
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        return {"partition": self.optimizer.optim.state_dict(), "param_groups": groups}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if not self.partitioned:
            return
        if not state:
            raise ValueError("no ZERO1 optimizer partition in it: resume with the strategy it was saved with")
        self.optimizer.optim.load_state_dict(state["partition"])
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update(saved)


def save(
    folder: Path, step: int, sharded: ModelAndOptimizer, local_state: dict[str, Any], rank: int, world_size: int
) -> Path:
    """Collective: every rank calls it. Returns the final `step-N` folder."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = folder / f"step-{step}"
    tmp = folder / f"step-{step}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save({"app": sharded}, checkpoint_id=str(tmp))
    torch.save(local_state | {RANK_STATE: sharded.rank_state()}, tmp / f"rank-{rank}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": world_size}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
    return final


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest complete step-N checkpoints under `folder` (rank 0, after a save); returns
    what was deleted. Unfinished ``step-N.tmp`` folders are left alone: a save may be writing one."""
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)))
    gone = [path for _, path in steps[: max(len(steps) - keep, 0)]]
    for path in gone:
        shutil.rmtree(path)
    return gone


def latest(folder: Path) -> Path:
    """The newest complete step-N checkpoint under `folder`."""
    steps = [
        (int(m.group(1)), p) for p in (folder.iterdir() if folder.is_dir() else []) if (m := STEP_DIR.match(p.name))
    ]
    if not steps:
        raise FieldError(f"{{ckpt.resume}} latest: no step-N checkpoint under {{ckpt.path}} {folder}")
    return max(steps)[1]


def check_layout(path: Path, world_size: int) -> int:
    """Check that a checkpoint folder holds every file this run needs (no file is read but meta.json); return its
    step. `check` reads them too."""
    meta_file = path / "meta.json"
    if not path.is_dir():
        raise FieldError(f"{{ckpt.resume}} {path}: no such checkpoint folder")
    try:
        meta = json.loads(meta_file.read_text())
        step = int(meta["step"])
        saved_world = int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        why = "corrupt or incomplete checkpoint (bad or missing meta.json)"
        raise FieldError(f"{{ckpt.resume}} {path}: {why}") from None
    if saved_world != world_size:
        raise FieldError(f"{{ckpt.resume}} {path}: saved with {saved_world} ranks, this run has {world_size}")
    needed = [".metadata", *(f"rank-{r}.pt" for r in range(world_size))]
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise FieldError(f"{{ckpt.resume}} {path}: corrupt or incomplete checkpoint (missing {', '.join(missing)})")
    return step


def check(path: Path, world_size: int) -> int:
    """Validate a checkpoint before any work (`check_layout`, then cheap reads that catch truncated or overwritten
    files); return its step."""
    import torch
    import torch.distributed.checkpoint as dcp

    step = check_layout(path, world_size)
    try:
        dcp.FileSystemReader(str(path)).read_metadata()
        for r in range(world_size):
            torch.load(path / f"rank-{r}.pt", weights_only=False)
    except Exception as e:
        raise FieldError(f"{{ckpt.resume}} {path}: corrupt checkpoint ({first_line(e)})") from None
    return step


def load(path: Path, sharded: ModelAndOptimizer, rank: int) -> dict[str, Any]:
    """Collective: load the shards in place; return this rank's local state."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load({"app": sharded}, checkpoint_id=str(path))
        local_state = torch.load(path / f"rank-{rank}.pt", weights_only=False)
        sharded.load_rank_state(local_state.pop(RANK_STATE, {}))
        return local_state
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise FieldError(f"{{ckpt.resume}} {path}: corrupt checkpoint ({first_line(e)})") from None
