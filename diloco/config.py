"""Configuration: pydantic models validated once at the edge, then passed down as objects.

Field names become the CLI flags (``path_model`` -> ``--path-model``, ``ckpt.interval`` -> ``--ckpt.interval``);
field descriptions are the CLI help. Derived values are properties or methods, never written back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

from cyclopts import Parameter
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diloco.fragments import FragmentLayout


class UsageError(ValueError):
    """Bad user input: reported as one line naming the flag or file, exit code 2, no traceback. Under torchrun
    only rank 0 reports it: every rank sees the same input."""


class RankUsageError(UsageError):
    """Bad input that only this rank meets (e.g. its own port, the given one + local rank): every rank that
    meets it reports it, naming itself."""


class FieldError(UsageError):
    """Bad input met below the command line, naming the config fields it concerns instead of flags: lower layers
    know fields, not how a command spells them. The message holds each field as a placeholder, ``{dataset}`` or
    ``{ckpt.resume}``; the command line turns them into its flags (``spelled``: ``--dataset``, ``--ckpt.resume``).

    A layer given a slice of the config (the swarm gets ``Config.hv``) names that slice's fields
    (``{world_rank}``); whoever handed it the slice puts the slice's name in front (``within("hv")``). A field of
    the whole config that the layer was handed as a plain value (the swarm's ``final_step`` is ``max_steps``) is
    written from the root, ``{/max_steps}``, and keeps its name.

    :param message: the line to show, with ``{field}`` placeholders.
    :param per_rank: only this rank meets it (see ``RankUsageError``).
    """

    def __init__(self, message: str, per_rank: bool = False) -> None:
        super().__init__(_FIELD.sub(lambda m: m.group(2), message))
        self.message, self.per_rank = message, per_rank

    @property
    def fields(self) -> list[str]:
        return [name for _, name in _FIELD.findall(self.message)]

    def within(self, prefix: str) -> FieldError:
        """The same error with every field under ``prefix`` (``world_rank`` -> ``hv.world_rank``) but those written
        from the root (``{/max_steps}``)."""
        return FieldError(_FIELD.sub(lambda m: m.group(0) if m.group(1) else f"{{{prefix}.{m.group(2)}}}",
                                     self.message), self.per_rank)  # fmt: skip

    def spelled(self, spell: Callable[[str], str]) -> UsageError:
        """This error as a command line reports it, each field spelled by ``spell`` (field -> flag)."""
        kind = RankUsageError if self.per_rank else UsageError
        return kind(_FIELD.sub(lambda m: spell(m.group(2)), self.message))


_FIELD = re.compile(r"\{(/?)([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)\}")


def first_line(error: BaseException) -> str:
    """The gist of a library's error, to quote inside a one-line UsageError."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


Precision = Literal["fp16-mixed", "bf16-mixed", "32-true"]
ShardingStrategy = Literal["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "DDP", "ZERO1"]
Compression = Literal["none", "fp16", "int8", "int4"]
Transport = Literal["tcp", "p2pd"]
Aggregation = Literal["mean", "trimmed-mean", "centered-clip"]  # see diloco.aggregation
InnerMoment = Literal["group", "galaxy"]  # see diloco.galaxy_moment
ROBUST_MIN = 3  # contributions a robust aggregation needs (fewer: the mean)
METRIC_SINKS = ("dummy", "tensorboard", "wandb")  # what --metric-logger-type may list; dummy adds no sink
Maddrs = Annotated[list[str], Parameter(consume_multiple=True)]


class OuterSetting(NamedTuple):
    """The outer SGD of a run: lr, Nesterov momentum (0: plain SGD), and the outer steps over which the lr rises
    linearly to `lr` (0: none)."""

    lr: float
    momentum: float
    warmup: int


# --hv.inner-moment auto: the galaxy's second moment (diloco.galaxy_moment) for AUTO_GALAXY_MIN_K groups or more
# at H up to AUTO_GALAXY_MAX_H. Scratch runs of `bench convergence`'s arms (docs/benchmarks.md, 2026-11-26
# 09:25-10:40 UTC), gap to DDP on seeds 0, 1, 2: on the defaults' workload (H = 25) 3 groups went from +2.5/+3.9/
# +4.5% to -0.2/+2.4/+2.4%, 4 from +2.9/+4.6/+5.2% to +1.8/+3.8/+1.3%, 8 from +1.8/+8.4/+6.0% to -0.1/+6.1/+5.5%;
# on the map's (0.14M model, 2000 steps) k = 4 and 8 gained 2.4-3.7 points at H = 10 and 25 (six cells and
# seeds) and k = 4 lost 1.0-2.5 at H = 50 and 100; 2 groups were even on the defaults' workload (-0.5 to +0.1
# points) and lost 0.9 and 1.6 points on the map's (H = 25, 50).
AUTO_GALAXY_MIN_K, AUTO_GALAXY_MAX_H = 3, 25

# --hv.outer-lr / --hv.outer-momentum auto, from `diloco bench convergence` (docs/benchmarks.md, 2026-11-24; README,
# "The outer step"). A run of at least AUTO_MOMENTUM_STEPS outer steps takes the paper's 0.7 / 0.9: in the map's
# 2000-step runs at H = 10 and 25 (200 and 80 outer steps) it was the best or within 1.5 points of it (mean of
# seeds 0 and 1 at k = 2 and 4: behind 1.0 / 0 by 1.3 at k = 2, H = 10, behind 1.0 / 0.5 by 1.5 and 0.3 at H = 25,
# k = 2 and 4; the seeds of one arm differ by 1.6 points in the median). Fewer outer steps: no momentum
# (the paper's setting ended 9-15% above DDP at 8 outer steps and up to +48% at 4-8 outer steps of H 250-500),
# and by H and the galaxy size k, (largest H, largest k, lr): an outer lr above 1 helped at H = 25, but only with
# the warm-up below (1.2 without it: +8.6% at k = 4). With it, 2 groups did best at 1.4 (seeds 0-2: -3.3%, +0.5%,
# +0.8% against 1.0's -2.3%, +1.3%, +2.3%), 4 groups at 1.2 (1.5: +2.9%, +5.3%; 1.7 and 2.0 worse on seed 1).
# 3+ groups at H <= AUTO_GALAXY_MAX_H, where auto also takes the galaxy moment (above): 1.3, the best of the lrs
# tried with it at k = 4 (docs/benchmarks.md, 2026-11-26 11:30-12:58 UTC): seeds 0-4 +1.4/+3.0/+1.3/+0.5/-4.0%
# against 1.2's +1.8/+3.8/+1.3/-0.3/-3.7%, fresh seeds 5 and 6 +1.7/+5.9% against +1.8/+6.1%; 8 groups
# -0.0/+5.4/+5.3% against -0.1/+6.1/+5.5%; 3 groups even (+0.6/+2.5/+1.3% against -0.2/+2.4/+2.4%). The lr depends on H
# and k alone, not on the moment a group ends up with, so that every group of a swarm takes the same outer step.
AUTO_MOMENTUM_STEPS = 50
# Not taken: 1.0 / 0.5 for 3+ groups over 20-49 outer steps. On the map's workload (0.14M model, H = 50 and 100)
# it beat 1.2 / 0 with the warm-up by 0.7-5.1 points at k = 4 and 8, but on the defaults' (1.1M model, H = 25, S =
# 400 and 500: 16 and 20 outer steps, k = 4) it lost by 5-11 points on every seed, and with the warm-up by 0.1-2.5
# (docs/benchmarks.md, 2026-11-26 01:00-01:34).
AUTO_LR: tuple[tuple[float, float, float], ...] = (
    (100, 2, 1.4),
    (AUTO_GALAXY_MAX_H, math.inf, 1.3),
    (100, math.inf, 1.2),
    (math.inf, math.inf, 1.0),
)
# --hv.outer-lr-warmup auto, up to this H: the outer lr rises over the outer steps that cover this many inner
# warm-ups (--warmup-steps). The same bench found the harm in the first outer steps, while the inner lr warms up:
# an outer warm-up over 3 outer steps or an inner warm-up 3× as long each took k = 4 from +7.1% to +4.1% / +2.9%.
AUTO_WARMUP_H, AUTO_WARMUP_SPAN = 100, 3
# At most AUTO_WARMUP_SHARE of the run's outer steps, but never capped below AUTO_WARMUP_FLOOR: with a long inner
# warm-up the span above covers most of a short run and leaves the outer lr below its value in most rounds.
# 4 groups, H = 25, 8 outer steps (seeds 0 and 6, docs/benchmarks.md, 2026-11-26 19:10-19:55): with 60, 100 and
# 150 inner warm-up steps 3 outer steps of warm-up beat the span's 8, 12 and 18 (60: by 1.4-2.3 points) and beat
# none (100 and 150: by 0.3-1.2 points). The floor keeps the measured 3 in runs of a few outer steps, where the
# first rounds need the warm-up most (none: +7.8% against +3.8% at 8 outer steps, k = 4).
AUTO_WARMUP_SHARE, AUTO_WARMUP_FLOOR = 3 / 8, 3


def auto_outer(h: float, galaxy_size: int, warmup_steps: int, max_steps: int) -> OuterSetting:
    """The outer setting `auto` picks for H inner steps per outer step, `galaxy_size` groups, an inner warm-up
    of `warmup_steps` steps and a run of `max_steps` inner steps."""
    if max_steps / h >= AUTO_MOMENTUM_STEPS:
        return OuterSetting(0.7, 0.9, 0)
    lr = next(lr for max_h, max_k, lr in AUTO_LR if h <= max_h and galaxy_size <= max_k)
    warmup = math.ceil(AUTO_WARMUP_SPAN * warmup_steps / h) if h <= AUTO_WARMUP_H else 0
    warmup = min(warmup, max(AUTO_WARMUP_FLOOR, math.ceil(AUTO_WARMUP_SHARE * max_steps / h)))
    return OuterSetting(lr, 0.0, warmup if warmup > 1 else 0)  # one step of warm-up is none


def auto_inner_moment(h: float, galaxy_size: int) -> InnerMoment:
    """The inner AdamW's second moment `auto` picks for H inner steps per outer step and `galaxy_size` groups."""
    return "galaxy" if galaxy_size >= AUTO_GALAXY_MIN_K and h <= AUTO_GALAXY_MAX_H else "group"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CkptConfig(_Strict):
    """Checkpointing: sharded model and optimizer through torch.distributed.checkpoint."""

    interval: int | None = Field(None, gt=0, description="Write a checkpoint every N inner steps.")
    path: Path | None = Field(None, description="Folder of step-N checkpoints [default: <run-dir>/checkpoints].")
    resume: str | None = Field(
        None, description="Checkpoint folder to continue from, or 'latest' for the newest step-N under --ckpt.path."
    )


class HvConfig(_Strict):
    """The decentralized (hivemind) outer loop. With galaxy size 1 none of it starts."""

    initial_peers: Maddrs = Field(
        default_factory=list,
        description="Multiaddrs of DHT peers to bootstrap from, each ending in /p2p/ and the peer id, as "
        "`diloco dht` prints them. Start-up fails when none answers (p2pd gives up after about 5 s).",
    )
    galaxy_size: int = Field(1, ge=1, description="Number of worker groups expected in the swarm.")
    world_rank: int = Field(0, ge=0, description="Index of this worker group, 0 <= world rank < galaxy size.")
    local_steps: int = Field(500, gt=0, description="H: inner steps between two outer steps.")
    inner_moment: Literal["auto", "group", "galaxy"] = Field(
        "auto",
        description="The second moment the inner AdamW divides by: group (its own batch's, plain AdamW), galaxy "
        "(that of all --hv.galaxy-size groups' batches together, from each step's gradient variance over two halves "
        "of its micro-batches: steps as long as DDP's over the galaxy; see diloco/galaxy_moment.py), or auto "
        "(galaxy for 3 groups or more at H <= 25, else group).",
    )
    target_tokens: int | None = Field(
        None,
        gt=0,
        description="Instead of H: the swarm takes an outer step once its groups together trained N tokens since "
        "the last one; fast groups run more inner steps than slow ones, each weighted by its tokens.",
    )
    fragments: int = Field(
        1,
        ge=1,
        description="Streaming DiLoCo: average the model in F fragments of whole decoder layers, one every H/F "
        "inner steps (each still once per H steps; with --hv.target-tokens N, every N/F tokens of the swarm): 1/F "
        "of the bytes on the wire at a time. 1: the whole model.",
    )
    fragment_layout: FragmentLayout = Field(
        "strided",
        description="Which layers make a fragment: strided (layer i in fragment i mod F, as the paper) or "
        "contiguous (F runs of consecutive layers).",
    )
    overlap_steps: int = Field(
        0,
        ge=0,
        description="Inner steps that go on while a round is on the wire; its result is then merged (see "
        "--hv.overlap-mix). 0: every rank waits for the round (blocking).",
    )
    overlap_mix: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="With --hv.overlap-steps T > 0: a landed round sets each parameter to mix x its value + "
        "(1 - mix) x the new outer value, keeping a share of the T steps taken meanwhile (0: keep none).",
    )
    outer_lr: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="Learning rate of the outer SGD; auto: the paper's 0.7 for runs of 50 outer steps or more, "
        "else 1.0-1.4 by H, galaxy size and outer steps (README, 'The outer step').",
    )
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] | Literal["auto"] = Field(
        "auto",
        description="Nesterov momentum of the outer SGD; auto: the paper's 0.9 for runs of 50 outer steps or more, "
        "else 0.",
    )
    outer_lr_warmup: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="Outer steps over which the outer lr rises linearly to its value (0: none); auto: in runs of "
        "fewer than 50 outer steps up to H = 100, the outer steps that cover 3 × --warmup-steps inner steps, at "
        "most 3 of every 8 outer steps of the run (or 3).",
    )
    aggregation: Aggregation = Field(
        "mean",
        description="How each reducer combines the groups' pseudo-gradients: mean (weighted), trimmed-mean (per "
        "value, drops the largest and smallest fifth, at least one each) or centered-clip (clips each group's pull "
        "on the median); the robust two blunt a hostile or broken group, with 3 groups or more. Every group of a "
        "run uses one.",
    )
    matchmaking_time: float = Field(5.0, gt=0, description="Seconds to wait for peers when forming a round.")
    averaging_timeout: float = Field(60.0, gt=0, description="Seconds before an averaging round is abandoned.")
    skip_load_from_peers: bool = Field(False, description="Do not download the outer state from peers on join.")
    compression: Compression = Field(
        "none",
        description="Pseudo-gradient compression on the wire: none (float32), fp16, int8 (256 levels per 128k "
        "values), int4 (15 levels per block of 64 values, 7.1x fewer bytes than none).",
    )
    transport: Transport = Field(
        "tcp",
        description="What carries the averaging bytes once the DHT formed a group: tcp (direct sockets between "
        "groups; they must reach each other's announced addresses) or p2pd (hivemind's libp2p: NAT traversal, "
        "relays, encryption; several times slower).",
    )
    averaging_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port for the averaging bytes with --hv.transport tcp; 0 = any free port, a fixed port P "
        "is P + local rank for each rank under torchrun.",
    )
    run_id: str = Field(
        "diloco", pattern=r"^[A-Za-z0-9_-]+$", description="Swarm name: keeps separate runs apart on one DHT."
    )
    swarm_key: Path | None = Field(
        None,
        description="A secret every group of the swarm holds (`diloco keygen PATH` writes one, mode 0600): records, "
        "rounds and state downloads of groups without it are ignored. None: an open swarm (README, 'Security').",
    )
    host_maddrs: Maddrs = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        description="Multiaddrs this peer listens on; port 0 = any free port, a fixed port P is P + local rank "
        "for each rank under torchrun.",
    )
    announce_maddrs: Maddrs = Field(
        default_factory=list,
        description="Multiaddrs announced to other peers, with explicit ports (shifted by the local rank like "
        "--hv.host-maddrs).",
    )

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs")
    @classmethod
    def _valid_maddrs(cls, values: list[str]) -> list[str]:
        from multiaddr import Multiaddr

        for value in values:
            try:
                Multiaddr(value)
            except Exception as e:  # the package raises several types; all mean "not a multiaddr"
                raise ValueError(f"{value!r} is not a valid multiaddr ({e})") from None
        return values

    @field_validator("announce_maddrs")
    @classmethod
    def _explicit_ports(cls, values: list[str]) -> list[str]:
        for value in values:
            parts = value.split("/")
            if any(proto in ("tcp", "udp") and port == "0" for proto, port in pairwise(parts)):
                raise ValueError(f"{value!r}: announce an explicit port, not port 0")
        return values

    def steps_per_round(self, tokens_per_step: int) -> float:
        """H: --hv.local-steps, or under --hv.target-tokens that of equal groups (target tokens ÷ (galaxy size ×
        tokens per inner step))."""
        if self.target_tokens is not None:
            return self.target_tokens / (self.galaxy_size * max(tokens_per_step, 1))
        return self.local_steps

    def outer_setting(self, tokens_per_step: int, warmup_steps: int, max_steps: int) -> OuterSetting:
        """The outer SGD's lr, momentum and lr warm-up: each as set, or for "auto" from ``auto_outer`` for this
        run's H (with --hv.target-tokens, that of equal groups: target tokens ÷ (galaxy size × tokens per inner
        step)), galaxy size, inner warm-up and length.

        :param tokens_per_step: tokens of one inner step of this group (all ranks).
        :param warmup_steps: the inner lr's warm-up steps (``Config.warmup_steps``).
        :param max_steps: the run's inner steps (--max-steps, or from --epochs).
        """
        auto = auto_outer(self.steps_per_round(tokens_per_step), self.galaxy_size, warmup_steps, max_steps)
        return OuterSetting(
            auto.lr if self.outer_lr == "auto" else self.outer_lr,
            auto.momentum if self.outer_momentum == "auto" else self.outer_momentum,
            auto.warmup if self.outer_lr_warmup == "auto" else self.outer_lr_warmup,
        )

    def check_overlap(self, tokens_per_step: int) -> None:
        """Under --hv.target-tokens, refuse an overlap that would not land before the next round of an average
        group: that is N ÷ (F × galaxy size × tokens per inner step) inner steps after it (a faster group makes
        more, a slower one fewer; a round that comes due first lands the one in flight at once)."""
        if self.target_tokens is None or not self.overlap_steps:
            return
        steps = self.target_tokens / (self.fragments * self.galaxy_size * max(tokens_per_step, 1))
        if self.overlap_steps >= steps:
            raise FieldError(
                f"{{overlap_steps}} {self.overlap_steps} must be smaller than the inner steps between two rounds: "
                f"{{target_tokens}} {self.target_tokens} / ({{fragments}} {self.fragments} x {{galaxy_size}} "
                f"{self.galaxy_size} x {tokens_per_step} tokens per inner step) = {steps:.1f}"
            )

    def outer_is_auto(self) -> bool:
        """Whether any of the outer setting is left to `auto`."""
        return "auto" in (self.outer_lr, self.outer_momentum, self.outer_lr_warmup)

    def unused_alone(self) -> list[str]:
        """The fields set explicitly that a lone group (galaxy size 1: no DHT, no averaging) does not use; the
        world rank still names its run folder."""
        if self.galaxy_size != 1:
            return []
        given = self.model_fields_set - {"galaxy_size", "world_rank"}
        return [name for name in type(self).model_fields if name in given]

    @model_validator(mode="after")
    def _one_pace(self) -> HvConfig:
        if self.target_tokens is not None and "local_steps" in self.model_fields_set:
            raise ValueError("pass either --hv.local-steps (H inner steps per group) or --hv.target-tokens (the "
                             "swarm's tokens per outer step), not both")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _rounds_fit(self) -> HvConfig:
        # under --hv.target-tokens a fragment's round comes every N/F tokens of the swarm: the inner steps that
        # makes depend on the group's tokens per step, checked where they are known (`Config.check_overlap`)
        if self.target_tokens is None:
            if self.local_steps % self.fragments:
                raise ValueError(f"--hv.local-steps {self.local_steps} must be a multiple of --hv.fragments "
                                 f"{self.fragments} (a fragment's round every H/F inner steps)")  # fmt: skip
            if self.overlap_steps and self.overlap_steps >= self.local_steps // self.fragments:
                raise ValueError(f"--hv.overlap-steps {self.overlap_steps} must be smaller than --hv.local-steps / "
                                 f"--hv.fragments = {self.local_steps // self.fragments}: a round lands before the "
                                 "next one starts")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _robust_needs_groups(self) -> HvConfig:
        if self.aggregation != "mean" and self.galaxy_size < ROBUST_MIN:
            raise ValueError(f"--hv.aggregation {self.aggregation} needs --hv.galaxy-size {ROBUST_MIN} or more: "
                             "with fewer groups no majority can outvote a hostile one (use mean)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _rank_in_galaxy(self) -> HvConfig:
        if self.world_rank >= self.galaxy_size:
            raise ValueError(
                f"--hv.world-rank {self.world_rank} must be smaller than --hv.galaxy-size {self.galaxy_size}"
            )
        return self


@Parameter(name="*")
class Config(_Strict):
    """One training run of one worker group."""

    path_model: Path = Field(
        description="Hugging Face model folder, or hub id read through the cache (config.json alone: fresh init)."
    )
    fake_data: bool = Field(False, description="Train on random tokens (deterministic by --seed, no I/O).")
    dataset: Path | None = Field(None, description="A .txt, .jsonl or .parquet file or a folder of them, or a hub id.")
    dataset_config: Annotated[str | None, Parameter(alias=["--dataset-config-name", "--dataset_config_name"])] = Field(
        None,
        description="The configuration of a hub --dataset, as load_dataset(ID, NAME) takes it (e.g. wikitext with "
        "wikitext-2-raw-v1).",
    )
    tokenizer: str | None = Field(None, description="Hugging Face tokenizer folder or hub id [default: byte-level].")
    seq_length: int = Field(1024, gt=1, description="Tokens per packed sequence.")
    per_device_train_batch_size: int = Field(32, gt=0, description="Sequences per rank per micro-batch.")
    total_batch_size: int = Field(512, gt=0, description="Sequences per inner step over all ranks of this group.")
    lr: float = Field(4e-4, gt=0, description="Peak inner (AdamW) learning rate.")
    weight_decay: float = Field(0.1, ge=0, description="Inner AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="Inner AdamW betas (two numbers in [0, 1)).")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the gradient's global L2 norm to this; 0: no clipping.")
    warmup_steps: int = Field(1000, ge=0, description="Linear warm-up steps before the cosine decay.")
    max_steps: Annotated[int, Parameter(alias="--total-steps")] = Field(
        88_000, ge=0, description="Inner steps to train for."
    )
    epochs: int | None = Field(
        None, gt=0, description="Train for N passes over this group's share of --dataset instead of --max-steps."
    )
    precision: Precision = Field("bf16-mixed", description="Parameter/compute precision.")
    sharding_strategy: ShardingStrategy = Field(
        "FULL_SHARD",
        description="How the model is spread over the group's ranks: FSDP2 (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, "
        "HYBRID_SHARD) or torch DDP (DDP; ZERO1: DDP with the AdamW state partitioned over ranks).",
    )
    cpu_offload: bool = Field(False, description="Keep sharded parameters and optimizer state in CPU memory.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    torch_compile: bool = Field(True, description="Compile each decoder layer with torch.compile.")
    metric_logger_type: str = Field(
        "dummy",
        description="Extra metric sinks besides metrics.jsonl, comma-separated: dummy (none), tensorboard "
        "(event files in <run dir>/tensorboard), wandb; e.g. tensorboard,wandb.",
    )
    project: str = Field("diloco", description="wandb project name.")
    seed: int = Field(42, ge=0, description="Seed for initialisation, data order and fake data.")
    eval_interval: int | None = Field(None, gt=0, description="Evaluate every N inner steps (and at the last).")
    eval_steps: int = Field(10, gt=0, description="Batches per evaluation and rank.")
    log_interval: int = Field(1, gt=0, description="Write a metrics row every N inner steps.")
    run_name: str | None = Field(None, description="Name of the run folder under runs/ [default: a timestamp].")
    run_dir: Path | None = Field(None, description="Output folder [default: runs/<run name>/worker-<hv.world-rank>].")
    ckpt: Annotated[CkptConfig, Parameter(name="ckpt")] = Field(default_factory=CkptConfig)
    hv: Annotated[HvConfig, Parameter(name="hv")] = Field(default_factory=HvConfig)

    @field_validator("metric_logger_type")
    @classmethod
    def _known_sinks(cls, value: str) -> str:
        names = [name.strip() for name in value.split(",")]
        unknown = [name for name in names if name not in METRIC_SINKS]
        if unknown:
            raise ValueError(
                f"unknown metric sink {unknown[0]!r}: choose from {', '.join(METRIC_SINKS)}, comma-separated to combine"
            )
        return ",".join(dict.fromkeys(names))

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError("each beta must be in [0, 1)")
        return value

    @property
    def metric_sinks(self) -> list[str]:
        """The extra sinks --metric-logger-type names, in order, without ``dummy`` (which adds none)."""
        return [name for name in self.metric_logger_type.split(",") if name != "dummy"]

    @model_validator(mode="after")
    def _one_data_source(self) -> Config:
        if self.fake_data and self.dataset is not None:
            raise ValueError("pass either --fake-data or --dataset, not both")
        if not self.fake_data and self.dataset is None:
            raise ValueError("no data: pass --dataset PATH (a .txt/.jsonl/.parquet file or folder) or --fake-data")
        if self.dataset_config is not None and self.dataset is None:
            raise ValueError("--dataset-config names a configuration of a hub --dataset: pass --dataset ID too")
        if self.epochs is not None and "max_steps" in self.model_fields_set:
            raise ValueError("pass either --epochs or --max-steps (--total-steps), not both")
        if self.epochs is not None and self.fake_data:
            raise ValueError("--epochs needs --dataset: fake data has no end to count passes by (use --max-steps)")
        return self

    @model_validator(mode="after")
    def _offload_needs_fsdp(self) -> Config:
        if self.cpu_offload and self.sharding_strategy in ("DDP", "ZERO1"):
            raise ValueError(f"--cpu-offload needs an FSDP --sharding-strategy; {self.sharding_strategy} keeps the "
                             "model and optimizer state on the device")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _galaxy_moment_needs_the_whole_state(self) -> Config:
        if self.hv.inner_moment == "galaxy" and self.sharding_strategy == "ZERO1":
            raise ValueError("--hv.inner-moment galaxy needs each rank's whole AdamW state (or its FSDP shards); "
                             "ZERO1 partitions it: use DDP or an FSDP --sharding-strategy")  # fmt: skip
        return self

    def galaxy_moment(self, tokens_per_step: int, grad_accum: int) -> bool:
        """Whether the inner AdamW takes the galaxy's second moment (--hv.inner-moment, auto resolved for this
        run's H and galaxy size). It splits each step's micro-batches in two halves: `auto` keeps plain AdamW
        where there are none (one micro-batch of one sequence) or under ZERO1; `galaxy` refuses such a run."""
        hv = self.hv
        if hv.galaxy_size == 1:
            return False
        choice = hv.inner_moment
        if choice == "auto":
            choice = auto_inner_moment(hv.steps_per_round(tokens_per_step), hv.galaxy_size)
        halves = grad_accum > 1 or self.per_device_train_batch_size > 1
        if choice == "galaxy" and not halves and hv.inner_moment == "galaxy":
            raise UsageError("--hv.inner-moment galaxy needs two halves of each inner step: a "
                             "--per-device-train-batch-size of at least 2, or a --total-batch-size of two "
                             "micro-batches per rank")  # fmt: skip
        return choice == "galaxy" and halves and self.sharding_strategy != "ZERO1"

    def outer_setting(self, tokens_per_step: int, max_steps: int) -> OuterSetting:
        """The swarm's outer SGD setting (``HvConfig.outer_setting`` with this run's inner warm-up) for a run of
        `max_steps` inner steps."""
        return self.hv.outer_setting(tokens_per_step, self.warmup_steps, max_steps)

    def grad_accumulation(self, world_size: int) -> int:
        """Micro-batches per inner step: total ÷ (per-device × ranks), which must be a whole number."""
        per_step = self.per_device_train_batch_size * world_size
        if self.total_batch_size % per_step:
            raise UsageError(
                f"--total-batch-size {self.total_batch_size} is not a multiple of --per-device-train-batch-size "
                f"{self.per_device_train_batch_size} × {world_size} ranks = {per_step}"
            )
        return self.total_batch_size // per_step

    def check_batch(self, world_size: int) -> int:
        """`grad_accumulation`, and that the galaxy moment, where asked for, finds two halves in a step; returns
        the micro-batches per inner step."""
        grad_accum = self.grad_accumulation(world_size)
        self.galaxy_moment(self.total_batch_size * self.seq_length, grad_accum)
        return grad_accum

    def check_files(self) -> None:
        """Fail before any work starts when a named file or folder is missing, or a hub id is in no cache while
        the hub is off or unreachable (one connection attempt at most: see ``diloco.hub``)."""
        from diloco import hub

        if hub.is_hub_id(str(self.path_model)):
            hub.check_name("path_model", str(self.path_model))
        elif not self.path_model.is_dir():
            raise UsageError(f"--path-model {self.path_model}: no such local folder, nor a Hugging Face hub id")
        elif not (self.path_model / "config.json").is_file():
            raise UsageError(f"--path-model {self.path_model}: no config.json in that folder")
        if self.dataset is not None and hub.is_hub_id(str(self.dataset)):
            hub.check_name("dataset", str(self.dataset), "dataset")
        elif self.dataset_config is not None:
            raise UsageError(f"--dataset-config {self.dataset_config}: --dataset {self.dataset} is a local path, not a "
                             "hub dataset with configurations")  # fmt: skip
        elif self.dataset is not None and not self.dataset.exists():
            raise UsageError(f"--dataset {self.dataset}: no such file or folder")
        if self.hv.swarm_key is not None:
            from diloco.swarm.swarm_key import SwarmKey  # plain Python

            try:
                SwarmKey.load(self.hv.swarm_key)
            except FieldError as e:
                raise e.within("hv") from None
        if self.tokenizer is not None and hub.is_hub_id(self.tokenizer):
            hub.check_name("tokenizer", self.tokenizer)
        elif self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise UsageError(f"--tokenizer {self.tokenizer}: no such local tokenizer folder")
