"""Configuration: pydantic models validated once at the edge, then passed down as objects.

Field names become the CLI flags (``path_model`` -> ``--path-model``, ``ckpt.interval`` -> ``--ckpt.interval``);
field descriptions are the CLI help. Derived values are properties or methods, never written back.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal

from cyclopts import Parameter
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from diloco.errors import UsageError

Precision = Literal["fp16-mixed", "bf16-mixed", "32-true"]
ShardingStrategy = Literal["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD", "DDP", "ZERO1"]
Compression = Literal["none", "fp16", "int8", "int4", "sparse"]
Transport = Literal["auto", "tcp", "p2pd"]
Aggregation = Literal["mean", "trimmed-mean", "centered-clip"]  # see diloco.swarm.rounds.aggregation
InnerMoment = Literal["group", "galaxy"]  # see diloco.galaxy_moment
FragmentLayout = Literal["strided", "contiguous"]  # see diloco.outer.fragments
ROBUST_MIN = 3  # contributions a robust aggregation needs (fewer: the mean)
METRIC_SINKS = ("dummy", "tensorboard", "wandb")  # what --metric-logger-type may list; dummy adds no sink
Maddrs = Annotated[list[str], Parameter(consume_multiple=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CkptConfig(_Strict):
    """Checkpointing: sharded model and optimizer through torch.distributed.checkpoint."""

    interval: int | None = Field(None, gt=0, description="Write a checkpoint every N inner steps.")
    path: Path | None = Field(None, description="Folder of step-N checkpoints [default: <run-dir>/checkpoints].")
    resume: str | None = Field(
        None, description="Checkpoint folder to continue from, or 'latest' for the newest step-N under --ckpt.path."
    )
    topk: int | None = Field(
        None, gt=0, description="Keep only the K newest step-N checkpoints under --ckpt.path (older ones are deleted "
        "once a newer one is complete). None: keep all."
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
    local_steps: int = Field(
        500,
        gt=0,
        description="H: inner steps between two outer steps (under --hv.pace tokens: of the group that sets the "
        "swarm's token budget).",
    )
    pace: Literal["tokens", "fixed"] = Field(
        "tokens",
        description="When the swarm takes an outer step: tokens (once the groups together trained a token budget, "
        "N = H x galaxy size x the tokens of an inner step of the first group, announced to the others: each group "
        "trains at its own speed and batch, weighted by its tokens) or fixed (every group trains H inner steps per "
        "round; faster groups wait for slower ones). --hv.target-tokens sets N.",
    )
    inner_moment: Literal["auto", "group", "galaxy"] = Field(
        "auto",
        description="The second moment the inner AdamW divides by: group (its own batch's, plain AdamW), galaxy "
        "(that of all --hv.galaxy-size groups' batches together, from each step's gradient variance over two halves "
        "of its micro-batches: steps as long as DDP's over the galaxy; see diloco/galaxy_moment.py), or auto "
        "(galaxy for 3 groups or more at H <= 25, else group).",
    )
    target_tokens: Annotated[int, Field(gt=0)] | Literal["auto"] | None = Field(
        None,
        description="Instead of H: the swarm takes an outer step once its groups together trained N tokens since "
        "the last one; fast groups run more inner steps than slow ones, each weighted by its tokens. auto: N = H x "
        "galaxy size x the tokens of an inner step of the first group (as --hv.pace tokens).",
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
        "else 1.0-1.4 by H, galaxy size and outer steps (docs/outer-step.md).",
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
    matchmaking_time: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="Seconds a round waits at most for the other groups. auto: under --hv.local-steps it waits for "
        "every live group whose status record says it arrives within one of this group's own rounds (at least 5 s), "
        "and no longer; under --hv.target-tokens 5 s. Either way it closes once every live group is in.",
    )
    averaging_timeout: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="Seconds before an averaging round is abandoned (a groupmate silent for a quarter of it is "
        "dropped). auto: the first round gets 60 s plus the model's float32 bytes at 1 MiB/s, each later one 4 x the "
        "slowest of the group's last 5 rounds (or twice the deadline of a failed one among them), from 20 s up to "
        "4 x the first round's; waits that need one number (joining, settling) take 60 s. A number: that fixed "
        "deadline for every round, and those waits.",
    )
    late_work: Literal["drop", "keep"] = Field(
        "drop",
        description="What a group that arrives after the swarm's round formed does with its inner steps since its "
        "last round: drop (reset to the loaded state, as OpenDiLoCo does) or keep (it moves its model along with the "
        "new outer state, so they land in its next round, weighted by their tokens; measured 4-5% worse in held-out "
        "loss under fixed H: docs/outer-step.md). A group whose round failed on its side while the group it loads "
        "from took that round alone keeps them either way (docs/reliability.md). The rows, summary.json and "
        "`diloco status` count the inner steps thrown away.",
    )
    skip_load_from_peers: bool = Field(False, description="Do not download the outer state from peers on join.")
    compression: Compression = Field(
        "none",
        description="Pseudo-gradient compression on the wire: none (float32), fp16, int8 (256 levels per 128k "
        "values), int4 (15 levels per block of 64 values, 7.1x fewer bytes than none), sparse (per chunk of 4096 "
        "values the largest --hv.sparse-density of them, in --hv.sparse-bits bits each, with error feedback: "
        "SparseLoCo; docs/sparse.md).",
    )
    sparse_density: float = Field(
        1 / 64, gt=0, le=1,
        description="With --hv.compression sparse: the share of each chunk's values a round sends (the k largest).",
    )  # fmt: skip
    sparse_bits: int = Field(
        2, description="With --hv.compression sparse: bits per value sent, 2, 4 or 8 (sign and magnitude, scaled "
        "per chunk).",
    )
    sparse_rule: Literal["sparseloco", "nesterov"] = Field(
        "sparseloco",
        description="With --hv.compression sparse, the outer step: sparseloco (what a round did not send stays in "
        "an error buffer decayed by --hv.error-decay, which replaces the outer momentum: plain SGD at --hv.outer-lr, "
        "1.0 when auto) or nesterov (the buffer keeps all that was not sent; today's Nesterov outer step).",
    )
    error_decay: float = Field(
        0.95, ge=0, le=1, description="With --hv.sparse-rule sparseloco: the error buffer's decay per round."
    )
    transport: Transport = Field(
        "auto",
        description="How this rank prefers to carry the averaging bytes once the DHT formed a group; groups of any "
        "preference share a run. auto (or tcp): TCP per pair of ranks, dialled directly, opened by the rank behind "
        "a router, or through a relay. p2pd: libp2p streams through the p2pd daemons (encrypted; several times "
        "slower) to ranks that prefer them too and can be dialled, TCP to the others.",
    )
    averaging_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port for the averaging bytes; 0 = any free port, a fixed port P "
        "is P + local rank for each rank under torchrun.",
    )
    run_id: str = Field(
        "diloco", pattern=r"^[A-Za-z0-9_-]+$", description="Swarm name: keeps separate runs apart on one DHT."
    )
    swarm_key: Path | None = Field(
        None,
        description="A secret every group of the swarm holds (`diloco keygen PATH` writes one, mode 0600): records, "
        "rounds and state downloads of groups without it are ignored. None: an open swarm (docs/security.md).",
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

    def token_paced(self) -> bool:
        """Whether rounds follow a swarm-wide token budget (--hv.pace tokens, or --hv.target-tokens)."""
        return self.target_tokens is not None or self.pace == "tokens"

    def budget_given(self) -> int | None:
        """N as given (--hv.target-tokens N); None when it follows H (auto, or --hv.pace tokens)."""
        return self.target_tokens if isinstance(self.target_tokens, int) else None

    @model_validator(mode="after")
    def _one_pace(self) -> HvConfig:
        if self.budget_given() is not None and "local_steps" in self.model_fields_set:
            raise ValueError("pass either --hv.local-steps (H inner steps per group) or --hv.target-tokens (the "
                             "swarm's tokens per outer step), not both")  # fmt: skip
        if self.target_tokens is not None and self.pace == "fixed" and "pace" in self.model_fields_set:
            raise ValueError("--hv.pace fixed trains H inner steps per group: drop --hv.target-tokens, or use "
                             "--hv.pace tokens")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _rounds_fit(self) -> HvConfig:
        # under --hv.target-tokens a fragment's round comes every N/F tokens of the swarm: the inner steps that
        # makes depend on the group's tokens per step, checked where they are known (`Config.check_overlap`)
        if self.budget_given() is None:
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

    @field_validator("sparse_bits")
    @classmethod
    def _sparse_bits(cls, bits: int) -> int:
        if bits not in (2, 4, 8):
            raise ValueError(f"{bits}: 2, 4 or 8 bits per value")
        return bits

    @model_validator(mode="after")
    def _sparse_fits(self) -> HvConfig:
        given = {"sparse_density", "sparse_bits", "sparse_rule", "error_decay"} & self.model_fields_set
        if self.compression != "sparse" and given:
            flag = "--hv." + sorted(given)[0].replace("_", "-")
            raise ValueError(f"{flag} is a setting of sparse rounds: add --hv.compression sparse")
        if self.compression == "sparse" and self.aggregation != "mean":
            raise ValueError(f"--hv.aggregation {self.aggregation} has no sparse form: a reducer relays the groups' "
                             "sparse values unchanged (use mean with --hv.compression sparse)")  # fmt: skip
        if self.compression == "sparse" and self.sparse_rule == "sparseloco" and self.outer_momentum not in (0, "auto"):
            raise ValueError(f"--hv.outer-momentum {self.outer_momentum}: under --hv.sparse-rule sparseloco the error "
                             "buffer is the momentum (use --hv.sparse-rule nesterov for both)")  # fmt: skip
        return self

    def wire_format(self) -> str:
        """The wire format in words (the start-up banner's)."""
        if self.compression != "sparse":
            return self.compression
        rule = f"error decay {self.error_decay:g}" if self.sparse_rule == "sparseloco" else "nesterov, error kept"
        return f"sparse ({self.sparse_density:.3g} of each chunk in {self.sparse_bits} bits, {rule})"

    def error_feedback(self) -> float | None:
        """The error buffer's decay per round (sparse rounds), or None (no error feedback)."""
        if self.compression != "sparse":
            return None
        return self.error_decay if self.sparse_rule == "sparseloco" else 1.0

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
    token_cache: Path | None = Field(
        None,
        description="Folder of token stores: each --dataset is tokenized there once per machine, and every run and "
        "rank on it reads its blocks from there [default: $XDG_CACHE_HOME/diloco/tokens, else "
        "~/.cache/diloco/tokens].",
    )
    attn_implementation: str | None = Field(
        None,
        description="The attention kernel transformers builds the model with: eager, sdpa, flash_attention_2, ... "
        "[default: transformers' choice for the model].",
    )
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
    lora_r: int = Field(
        0,
        ge=0,
        description="LoRA: train rank-R adapters (peft) on a frozen base; the rounds, state downloads and checkpoints "
        "carry the adapters alone, and final/ holds them in peft's format. 0: train every parameter.",
    )
    lora_alpha: float | None = Field(
        None, gt=0, description="LoRA scaling: an adapter's output is multiplied by alpha / R [default: peft's (8)]."
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the input of each LoRA adapter.")
    lora_target_modules: Annotated[list[str], Parameter(consume_multiple=True)] = Field(
        default_factory=lambda: ["all-linear"],
        description="The modules that get adapters, by name or name suffix (q_proj v_proj ...); all-linear: every "
        "linear layer of the model but its output head (attention and MLP projections).",
    )
    lora_merge: bool = Field(
        False, description="With --lora-r: also write final/merged, the base with the adapters merged into it."
    )
    load_in_4bit: bool = Field(
        False,
        description="With --lora-r: hold the frozen base's decoder-block linear layers in 4 bits (NF4 through "
        "bitsandbytes: QLoRA), an eighth of their float32 memory. The base is not sharded: --sharding-strategy is "
        "DDP unless ZERO1 is given.",
    )
    load_in_8bit: bool = Field(
        False, description="With --lora-r: hold them in 8 bits (LLM.int8() through bitsandbytes) instead."
    )
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
    profile_steps: int = Field(
        0, ge=0, description="Profile N inner steps with torch.profiler (first rank): profile.json and profile.txt "
        "in the run folder say what keeps the accelerator busy or idle; 0: off."
    )
    profile_start: int = Field(10, ge=0, description="The inner step after which --profile-steps begins (past "
                               "compilation and warm-up).")  # fmt: skip
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
    def _lora_flags_need_lora(self) -> Config:
        given = sorted({"lora_alpha", "lora_dropout", "lora_target_modules", "lora_merge"} & self.model_fields_set)
        if given and not self.lora_r:
            raise ValueError(f"--{given[0].replace('_', '-')} sets up LoRA adapters: pass --lora-r R too")
        if self.lora_r and not self.lora_target_modules:
            raise ValueError("--lora-target-modules: name at least one module (or all-linear)")
        return self

    @property
    def lora(self) -> bool:
        return self.lora_r > 0

    @model_validator(mode="before")
    @classmethod
    def _quantized_base_is_not_sharded(cls, data: Any) -> Any:
        """A quantized base is whole on every rank (DDP), whatever the FSDP default: FSDP cannot shard its layers."""
        quantized = isinstance(data, dict) and (data.get("load_in_4bit") or data.get("load_in_8bit"))
        return {**data, "sharding_strategy": "DDP"} if quantized and "sharding_strategy" not in data else data

    @model_validator(mode="after")
    def _quantized_base_needs_lora(self) -> Config:
        flag = "--load-in-4bit" if self.load_in_4bit else "--load-in-8bit" if self.load_in_8bit else None
        if flag is None:
            return self
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("pass either --load-in-4bit or --load-in-8bit, not both")
        if not self.lora:
            raise ValueError(f"{flag} quantizes the frozen base under LoRA adapters: pass --lora-r R too")
        if self.sharding_strategy not in ("DDP", "ZERO1"):
            raise ValueError(f"{flag}: FSDP cannot shard a quantized base ({self.sharding_strategy}): use "
                             "--sharding-strategy DDP (the default with it) or ZERO1")  # fmt: skip
        if self.cpu_offload:
            raise ValueError(f"{flag}: the quantized base stays on the device, unsharded: drop --cpu-offload")
        if self.lora_merge:
            raise ValueError(f"--lora-merge: a {self.quantized_bits}-bit base has no full-precision weights to merge "
                             "into; merge final/ into the original model with peft's merge_and_unload")  # fmt: skip
        return self

    @property
    def quantized_bits(self) -> int | None:
        """The bits of the quantized base (--load-in-4bit, --load-in-8bit); None: a float32 base."""
        return 4 if self.load_in_4bit else 8 if self.load_in_8bit else None

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

    def grad_accumulation(self, world_size: int) -> int:
        """Micro-batches per inner step: total ÷ (per-device × ranks), which must be a whole number."""
        per_step = self.per_device_train_batch_size * world_size
        if self.total_batch_size % per_step:
            raise UsageError(
                f"--total-batch-size {self.total_batch_size} is not a multiple of --per-device-train-batch-size "
                f"{self.per_device_train_batch_size} × {world_size} ranks = {per_step}"
            )
        return self.total_batch_size // per_step
