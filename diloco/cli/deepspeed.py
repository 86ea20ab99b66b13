"""What a DeepSpeed user brings: a ``ds_config.json`` (``--deepspeed PATH``), read as this trainer's own flags, and the
``deepspeed`` launcher's ``--local_rank N``, accepted and ignored (the rank comes from the environment, as torchrun
sets it).

The file maps to flags (``to_flags``) placed before the user's, so a flag given beside the file wins over the key
it maps to, and a refusal tied to that flag no longer applies. Keys that mean something here become flags; keys
without a meaning here (tuning of DeepSpeed's own engine: buckets, overlap, ``stage3_*``, logging, NVMe) are named
together in one warning line; a key that cannot be honoured without changing the result (optimizer offload
without parameter offload, another optimizer, plain Adam with L2, another ``eps``, curriculum learning, ...) is a
`UsageError`: one line, exit code 2. A value ``"auto"`` (Hugging Face's habit) leaves the flag's value as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from diloco.config import Config
from diloco.distenv import DistEnv
from diloco.errors import UsageError, first_line

FILE_FLAGS = ("--deepspeed", "--deepspeed_config", "--deepspeed-config")  # HF's spelling, and DeepSpeed's own
LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")
AUTO = "auto"
STAGES = {0: "DDP", 1: "ZERO1", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}  # ZeRO stage -> --sharding-strategy
ADAM_EPS = 1e-8  # torch's AdamW default, which this trainer's inner optimizer uses (no flag sets another)
# a flag given beside the file, under any of its spellings -> the flag the file would set
SAME_FLAG = {
    "--no-cpu-offload": "--cpu-offload",
    "--no-gradient-checkpointing": "--gradient-checkpointing",
    "--total-steps": "--max-steps",
    "--epochs": "--max-steps",  # a length in passes replaces a length in steps
}
# sections that change what is trained (so cannot be ignored) and have no equal here -> what to do
REFUSED_WHEN_ON = {
    "amp": "NVIDIA Apex AMP is not used here: drop it and enable bf16 or fp16 (--precision)",
    "curriculum_learning": "batches are not reordered or shortened here: drop it",
    "data_efficiency": "batches are not sampled or routed by difficulty here: drop it",
    "progressive_layer_drop": "every layer trains at every step here: drop it",
    "elasticity": "the batch is fixed by --total-batch-size here, whatever the ranks: drop it",
    "compression_training": "the model is trained unquantized and unpruned here: drop it",
    "sparse_attention": "the attention is the model's own here (--attn-implementation): drop it",
}
ON_WITHOUT_SWITCH = {"compression_training", "sparse_attention"}  # sections that have no "enabled" key
QUANTIZED = ("zero_quantized_weights", "zero_quantized_gradients")  # ZeRO++: communication quantized, results differ
SCHEDULES = {  # DeepSpeed's schedulers this one stands in for -> how its shape differs from warm-up + cosine
    "warmuplr": "WarmupLR holds the peak lr after warm-up",
    "warmupdecaylr": "WarmupDecayLR decays linearly to 0 at total_num_steps",
    "warmupcosinelr": None,
}


def expand(argv: Sequence[str], world_size: int | None = None) -> tuple[list[str], str | None]:
    """A training command's `argv` with ``--local_rank`` dropped and ``--deepspeed PATH`` replaced by the flags the
    file maps to, ahead of the user's own; and the warning line naming what the file holds that is ignored here
    (None: nothing). `world_size`: the ranks of this worker group [default: as the launcher's environment says]."""
    rest, path = _take_flags(argv)
    if path is None:
        return rest, None
    ds = read(path)
    ranks = world_size if world_size is not None else DistEnv.from_environ().world_size
    try:
        added, warning = to_flags(ds, rest, ranks)
    except UsageError as e:
        raise UsageError(f"--deepspeed {path}: {e}") from None
    return [*added, *rest], warning and f"--deepspeed {path}: {warning}"


def read(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; anything else is a `UsageError` naming the file. Duplicate keys are refused, as
    DeepSpeed refuses them (which of two values would win is not obvious)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"--deepspeed {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--deepspeed {path}: cannot be read ({first_line(e)})") from None
    try:
        ds = json.loads(text, object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, ValueError) as e:
        raise UsageError(f"--deepspeed {path}: not a JSON file ({first_line(e)})") from None
    if not isinstance(ds, dict):
        raise UsageError(f"--deepspeed {path}: a DeepSpeed config is a JSON object {{...}}, not a {_json_type(ds)}")
    return ds


def to_flags(ds: dict[str, Any], argv: Sequence[str], world_size: int) -> tuple[list[str], str | None]:
    """The flags DeepSpeed config `ds` maps to, but those `argv` gives (they win), for a worker group of
    `world_size` ranks; and the warning line (None: nothing to warn about). A key whose meaning cannot be honoured
    here is a `UsageError` naming it.

    ``zero_optimization.stage`` 0/1/2/3 -> ``--sharding-strategy DDP/ZERO1/SHARD_GRAD_OP/FULL_SHARD``; parameter
    offload to CPU -> ``--cpu-offload`` (FSDP then offloads the optimizer state too: only less device memory);
    optimizer offload alone is refused (it would move the parameters off the device too, slowing every step).
    ``bf16``/``fp16.enabled`` -> ``--precision``; ``gradient_clipping`` -> ``--max-grad-norm``; the three batch keys
    -> ``--per-device-train-batch-size`` and ``--total-batch-size`` by DeepSpeed's rule (``_batch``); an Adam(W)
    ``optimizer``'s lr, betas, weight_decay -> ``--lr``, ``--adam-betas``, ``--weight-decay`` (its eps must be
    1e-8, torch's, which this trainer uses: a user who wrote another expects it to be used); a Warmup*LR
    ``scheduler``'s steps -> ``--warmup-steps``, ``--max-steps`` (the shape is always linear warm-up + cosine to 0:
    a difference is said in the warning); ``activation_checkpointing`` -> ``--gradient-checkpointing``."""
    m = _Mapping(_given(argv))
    handlers: dict[str, Callable[[Any, _Mapping], None]] = {
        "zero_optimization": _zero,
        "gradient_clipping": lambda v, m: m.set("--max-grad-norm", "gradient_clipping", v, _at_least(0)),
        "optimizer": _optimizer,
        "scheduler": lambda v, m: _scheduler(v, m, _optimizer_lr(ds)),
        "activation_checkpointing": _checkpointing,
    }
    _precision(ds, m)
    _batch(ds, m, world_size)
    for key, value in ds.items():
        if key in handlers:
            handlers[key](value, m)
        elif key not in (*BATCH_KEYS, "bf16", "bfloat16", "fp16"):
            _other(key, value, m)
    return m.tokens(), m.warning()


class _Mapping:
    """What a file maps to, gathered key by key: flags (unless given beside the file), ignored keys, notes."""

    def __init__(self, given: dict[str, str]) -> None:
        self.given = given  # flag -> its last value on the command line ("" for a switch)
        self.flags: dict[str, list[str]] = {}
        self.ignored: list[str] = []
        self.notes: list[str] = []

    def put(self, flag: str, *values: str) -> None:
        if flag not in self.given:
            self.flags[flag] = list(values)

    def set(self, flag: str, key: str, value: Any, parse: Callable[[Any, str], list[str]]) -> None:
        """`flag` from `key`'s `value`, checked by `parse` (unless the flag is given, or the value is absent or
        auto)."""
        if flag not in self.given and value is not None and value != AUTO:
            self.put(flag, *parse(value, key))

    def refuse(self, message: str, flag: str | None = None) -> None:
        """A key that cannot be honoured, unless `flag`, given beside the file, settles it."""
        if flag is None or flag not in self.given:
            raise UsageError(message)

    def tokens(self) -> list[str]:
        return [token for flag, values in self.flags.items() for token in (flag, *values)]

    def warning(self) -> str | None:
        ignored = [f"ignored, no meaning here: {', '.join(self.ignored)}"] if self.ignored else []
        return "; ".join([*ignored, *self.notes]) or None


def _given(argv: Sequence[str]) -> dict[str, str]:
    """The flags on the command line (before a bare ``--``), each under the name of the flag a file sets, with its
    last value ("" for a switch or a value in the next token that is not read here)."""
    given: dict[str, str] = {}
    for i, token in enumerate(argv):
        if token == "--":
            break
        if token.startswith("--"):
            name, eq, inline = token.partition("=")
            following = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
            given[SAME_FLAG.get(name, name)] = inline if eq else following
    return given


# ---------------------------------------------------------------- sections


def _zero(value: Any, m: _Mapping) -> None:
    zero = _object(value, "zero_optimization")
    m.set("--sharding-strategy", "zero_optimization.stage", zero.get("stage"), _stage)
    params = _offloaded(zero, "offload_param", m)
    optimizer = _offloaded(zero, "offload_optimizer", m)
    if params:
        m.put("--cpu-offload")
    elif optimizer:
        m.refuse("zero_optimization.offload_optimizer without offload_param: FSDP offloads parameters, gradients and "
                 "optimizer state together, and moving the parameters off the device would slow every step; set "
                 'offload_param.device to "cpu" too, or drop offload_optimizer (or give --cpu-offload or '
                 "--no-cpu-offload beside the file)", "--cpu-offload")  # fmt: skip
    for key, setting in zero.items():
        if key in QUANTIZED and setting is True:
            m.refuse(f"zero_optimization.{key}: ZeRO++ quantizes what the ranks exchange, which changes the result; "
                     "this trainer exchanges full precision: drop it")  # fmt: skip
        elif key not in ("stage", "offload_param", "offload_optimizer"):
            m.ignored.append(f"zero_optimization.{key}")


def _offloaded(zero: dict[str, Any], key: str, m: _Mapping) -> bool:
    """Whether ``zero_optimization.<key>`` sends its state to CPU memory; NVMe is ignored (no equal here)."""
    if zero.get(key) is None:
        return False
    section = _object(zero[key], f"zero_optimization.{key}")
    device = section.get("device", "none")
    m.ignored += [f"zero_optimization.{key}.{name}" for name in section if name != "device"]
    if device == "nvme":
        m.ignored.append(f"zero_optimization.{key}.device nvme")
    elif device not in ("cpu", "none", AUTO, None):
        raise UsageError(f'zero_optimization.{key}.device {device!r}: give "cpu", "nvme" or "none"')
    return device == "cpu"


def _precision(ds: dict[str, Any], m: _Mapping) -> None:
    """bf16 (or its old name bfloat16) and fp16: at most one enabled; neither leaves --precision as it is."""
    bf16 = _enabled(ds, "bf16", m) or _enabled(ds, "bfloat16", m)
    fp16 = _enabled(ds, "fp16", m)
    if bf16 and fp16:
        m.refuse("bf16.enabled and fp16.enabled are both true: enable one (or give --precision)", "--precision")
    elif bf16 or fp16:
        m.put("--precision", "bf16-mixed" if bf16 else "fp16-mixed")


def _enabled(ds: dict[str, Any], key: str, m: _Mapping) -> bool:
    """``<key>.enabled`` is true; its other keys (loss scaling, ...) are named as ignored: the trainer scales fp16
    losses dynamically itself."""
    if ds.get(key) is None:
        return False
    section = _object(ds[key], key)
    m.ignored += [f"{key}.{name}" for name in section if name != "enabled"]
    enabled = section.get("enabled", False)
    if enabled not in (True, False, AUTO):
        raise UsageError(f'{key}.enabled {enabled!r}: give true, false or "auto"')
    return enabled is True


def _optimizer(value: Any, m: _Mapping) -> None:
    section = _object(value, "optimizer")
    params = _object(section.get("params", {}), "optimizer.params")
    kind = section.get("type")
    if kind not in (None, AUTO) and (not isinstance(kind, str) or kind.lower() not in ("adam", "adamw")):
        m.refuse(f"optimizer.type {kind}: the inner optimizer here is AdamW; use \"AdamW\" or drop the optimizer "
                 "section")  # fmt: skip
    if isinstance(kind, str) and kind.lower() == "adam" and params.get("adam_w_mode", True) is False:
        m.refuse("optimizer.params.adam_w_mode false is Adam with L2 regularization; the inner optimizer here is "
                 "AdamW (decoupled weight decay): drop adam_w_mode, or set it to true")  # fmt: skip
    m.set("--lr", "optimizer.params.lr", params.get("lr"), _above(0))
    m.set("--adam-betas", "optimizer.params.betas", params.get("betas"), _betas)
    m.set("--weight-decay", "optimizer.params.weight_decay", params.get("weight_decay"), _at_least(0))
    eps = params.get("eps")
    if eps not in (None, AUTO) and eps != ADAM_EPS:
        m.refuse(f"optimizer.params.eps {eps}: the inner AdamW here uses eps 1e-8 (torch's) and no flag sets "
                 "another; drop eps, or set it to 1e-8")  # fmt: skip
    if params.get("amsgrad", False) is not False or params.get("bias_correction", True) is not True:
        m.refuse("optimizer.params: amsgrad and bias_correction change AdamW's update; the inner AdamW here has "
                 "amsgrad false and bias correction on: drop them")  # fmt: skip
    handled = ("lr", "betas", "weight_decay", "eps", "adam_w_mode", "amsgrad", "bias_correction")
    m.ignored += [f"optimizer.params.{key}" for key in params if key not in handled]
    m.ignored += [f"optimizer.{key}" for key in section if key not in ("type", "params")]


def _optimizer_lr(ds: dict[str, Any]) -> Any:
    """The optimizer's lr as the file gives it (None: none)."""
    optimizer = ds.get("optimizer")
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    lr = params.get("lr") if isinstance(params, dict) else None
    return None if lr == AUTO else lr


def _scheduler(value: Any, m: _Mapping, optimizer_lr: Any) -> None:
    """Warmup*LR: the steps map to flags; the shape here is linear warm-up, then cosine decay to 0 at --max-steps,
    and how DeepSpeed's differs is said in the warning rather than refused (the steps, the part that matters most,
    are honoured)."""
    section = _object(value, "scheduler")
    params = _object(section.get("params", {}), "scheduler.params")
    kind = section.get("type")
    name = kind.lower() if isinstance(kind, str) else kind
    if name not in SCHEDULES:
        raise UsageError(f"scheduler.type {kind or 'missing'}: the schedule here is linear warm-up, then cosine decay "
                         "(--warmup-steps, --max-steps); use WarmupCosineLR, or drop the scheduler section")  # fmt: skip
    m.set("--warmup-steps", "scheduler.params.warmup_num_steps", params.get("warmup_num_steps"), _steps)
    m.set("--max-steps", "scheduler.params.total_num_steps", params.get("total_num_steps"), _steps)
    peak = params.get("warmup_max_lr")
    if peak not in (None, AUTO) and optimizer_lr is not None and peak != optimizer_lr:
        m.refuse(f"scheduler.params.warmup_max_lr {peak} and optimizer.params.lr {optimizer_lr} differ (DeepSpeed "
                 "trains at warmup_max_lr): keep one of them, or give --lr", "--lr")  # fmt: skip
    elif optimizer_lr is None:
        m.set("--lr", "scheduler.params.warmup_max_lr", peak, _above(0))
    m.notes += _schedule_notes(SCHEDULES[name], params)
    handled = ("warmup_num_steps", "total_num_steps", "warmup_max_lr", "warmup_type", "warmup_min_lr",
               "warmup_min_ratio", "cos_min_ratio")  # fmt: skip
    m.ignored += [f"scheduler.params.{key}" for key in params if key not in handled]
    m.ignored += [f"scheduler.{key}" for key in section if key not in ("type", "params")]


def _schedule_notes(shape: str | None, params: dict[str, Any]) -> list[str]:
    """How DeepSpeed's schedule differs from this trainer's, each a phrase of the warning line."""
    here = "here the lr follows a linear warm-up from 0, then a cosine decay to 0 at --max-steps"
    notes = [shape] if shape else []
    if params.get("warmup_type", "log") not in ("linear", AUTO):  # DeepSpeed's default warm-up is logarithmic
        notes.append(f"warmup_type {params.get('warmup_type', 'log')}")
    notes += [key for key in ("warmup_min_lr", "warmup_min_ratio", "cos_min_ratio") if params.get(key) not in
              (None, 0, AUTO)]  # fmt: skip
    return [f"scheduler: {', '.join(notes)} ({here})"] if notes else []


def _checkpointing(value: Any, m: _Mapping) -> None:
    """Any activation_checkpointing section asks for recomputation; its settings (partitioning, CPU copies) are
    DeepSpeed's own."""
    section = _object(value, "activation_checkpointing")
    m.put("--gradient-checkpointing")
    m.ignored += [f"activation_checkpointing.{key}" for key in section]


def _other(key: str, value: Any, m: _Mapping) -> None:
    """A section that changes what is trained is refused when on; anything else is named as ignored."""
    if key in REFUSED_WHEN_ON and isinstance(value, dict) and value.get("enabled", key in ON_WITHOUT_SWITCH) is True:
        m.refuse(f"{key}: {REFUSED_WHEN_ON[key]}")
    m.ignored.append(key)


# ---------------------------------------------------------------- the batch

BATCH_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps")
BATCH_FLAGS = ("--per-device-train-batch-size", "--total-batch-size", None)  # accumulation is derived here
CLI, FILE, AUTO_RANK, DEFAULT = 3, 2, 1, 0  # who says a batch term, strongest first


def _batch(ds: dict[str, Any], m: _Mapping, world_size: int) -> None:
    """DeepSpeed's rule, train_batch_size = micro batch × accumulation × ranks: any two determine the third. Each
    term comes from a flag beside the file, else the file's number, else (auto) the flag's value; accumulation,
    which has no flag here, is 1 when neither the file nor the two others say (DeepSpeed's default). The two
    strongest terms (micro batch before total on a tie) set the third; the file's three numbers that disagree are
    an error, and the file's accumulation gives way to a flag given beside it (a note says so)."""
    terms = [_batch_term(ds, key, flag, m) for key, flag in zip(BATCH_KEYS, BATCH_FLAGS, strict=True)]
    if all(rank != FILE for _, rank, _ in terms) or any(rank == CLI and value is None for value, rank, _ in terms):
        return  # the file states no batch, or a flag beside it is not a number (the flag's own check reports it)
    micro, total, accum = terms
    if micro[0] is None and total[0] is None:  # the file gives the accumulation alone: the micro batch is the flag's
        micro = _flag_value("--per-device-train-batch-size", "train_micro_batch_size_per_gpu")
    elif (micro[0] is None or total[0] is None) and accum[0] is None:
        accum = (1, DEFAULT, "gradient_accumulation_steps 1 (DeepSpeed's default)")
    terms = [micro, total, accum]
    # the weakest term (an unknown one first, then the least authoritative; accumulation before total before micro)
    weakest = min(range(3), key=lambda i: (terms[i][0] is not None, terms[i][1], -i))
    solved = _solve(terms, weakest, world_size)
    stated, rank, name = terms[weakest]
    if stated is not None and rank >= FILE and solved[weakest] != stated:
        if max(term[1] for term in terms) < CLI:
            raise UsageError(f"{total[2]} ≠ {micro[2]} × {accum[2]} × {_ranks(world_size)} = "
                             f"{micro[0] * accum[0] * world_size} (DeepSpeed's rule: train_batch_size = "
                             "train_micro_batch_size_per_gpu × gradient_accumulation_steps × ranks)")  # fmt: skip
        m.notes.append(f"{name} gives way to the flags beside the file ({solved[weakest]} here)")
    m.put("--per-device-train-batch-size", str(solved[0]))
    m.put("--total-batch-size", str(solved[1]))


def _batch_term(ds: dict[str, Any], key: str, flag: str | None, m: _Mapping) -> tuple[int | None, int, str]:
    """(value, who says it, how an error names it) of one batch term; value None: unknown."""
    if flag is not None and flag in m.given:
        given = m.given[flag]
        return (int(given) if given.isdigit() else None), CLI, f"{flag} {given}"
    value = ds.get(key)
    if value == AUTO and flag is not None:
        return _flag_value(flag, key)
    if value is None or value == AUTO:
        return None, DEFAULT, key
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{key} {value!r}: give a whole number of sequences, at least 1")
    return value, FILE, f"{key} {value}"


def _flag_value(flag: str, key: str) -> tuple[int, int, str]:
    """The batch term `key` as the flag's default says it (the flag is not on the command line)."""
    default = Config.model_fields[flag.removeprefix("--").replace("-", "_")].default
    return default, AUTO_RANK, f"{key} auto ({flag} {default})"


def _solve(terms: list[tuple[int | None, int, str]], unknown: int, world_size: int) -> tuple[int, int, int]:
    """(micro, total, accumulation) with term `unknown` computed from the two others; a share that is not whole is a
    `UsageError` naming the terms."""
    (micro, _, micro_name), (total, _, total_name), (accum, _, accum_name) = terms
    if unknown == 1:
        return micro, micro * accum * world_size, accum
    known, known_name = (accum, accum_name) if unknown == 0 else (micro, micro_name)
    per_step = known * world_size
    if total % per_step:
        raise UsageError(f"{total_name} is not a multiple of {known_name} × {_ranks(world_size)} = {per_step}")
    share = total // per_step
    return (share, total, accum) if unknown == 0 else (micro, total, share)


def _ranks(world_size: int) -> str:
    return f"{world_size} rank{'s' if world_size != 1 else ''} (WORLD_SIZE)"


# ---------------------------------------------------------------- values


def _object(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UsageError(f"{key}: give a JSON object {{...}}, not a {_json_type(value)}")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"{key} {value!r}: give a number")
    return value


def _at_least(low: float) -> Callable[[Any, str], list[str]]:
    def parse(value: Any, key: str) -> list[str]:
        if _number(value, key) < low:
            raise UsageError(f"{key} {value}: give a number of at least {low:g}")
        return [str(value)]

    return parse


def _above(low: float) -> Callable[[Any, str], list[str]]:
    def parse(value: Any, key: str) -> list[str]:
        if _number(value, key) <= low:
            raise UsageError(f"{key} {value}: give a number above {low:g}")
        return [str(value)]

    return parse


def _steps(value: Any, key: str) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{key} {value!r}: give a whole number of steps, at least 0")
    return [str(value)]


def _betas(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or len(value) != 2:
        raise UsageError(f"{key} {value!r}: give two numbers, [beta1, beta2]")
    return [str(_number(beta, key)) for beta in value]


def _stage(value: Any, key: str) -> list[str]:
    if isinstance(value, bool) or value not in STAGES:
        raise UsageError(f"{key} {value!r}: give 0, 1, 2 or 3")
    return [STAGES[value]]


def _json_type(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if duplicated := sorted({key for key in keys if keys.count(key) > 1}):
        raise ValueError(f"duplicate key {duplicated[0]!r}")
    return dict(pairs)


# ---------------------------------------------------------------- the command line


def _take_flags(argv: Sequence[str]) -> tuple[list[str], Path | None]:
    """`argv` without ``--local_rank N`` and ``--deepspeed PATH`` (before a bare ``--``), and PATH. DeepSpeed's own
    scripts say ``--deepspeed --deepspeed_config PATH``: a bare ``--deepspeed`` is taken when a path comes with the
    other spelling."""
    rest: list[str] = []
    path: str | None = None
    bare = False
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            rest += argv[i:]
            break
        name, eq, inline = token.partition("=")
        has_next = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if name in LOCAL_RANK_FLAGS:
            value = inline if eq else (argv[i + 1] if has_next else "")
            if not value.isdigit():
                raise UsageError(f"{name} needs a number (it is ignored: the rank comes from LOCAL_RANK)")
            i += 1 if eq else 2
            continue
        if name in FILE_FLAGS:
            if eq or has_next:
                path = inline if eq else argv[i + 1]
            bare = bare or not (eq or has_next)
            i += 2 if has_next and not eq else 1
            continue
        rest.append(token)
        i += 1
    if path == "" or (bare and path is None):
        raise UsageError("--deepspeed needs a DeepSpeed JSON config file: --deepspeed ds_config.json")
    return rest, Path(path) if path is not None else None
