"""Device detection, process groups, and wrapping the model for data parallelism (FSDP2 on a device mesh, or
torch DDP with an optional ZeRO-1 optimizer): the only module that knows about meshes and wrappers."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from diloco import shards
from diloco.config import Precision, ShardingStrategy
from diloco.distenv import DistEnv
from diloco.errors import FieldError
from diloco.fresh import Fresh
from diloco.galaxy_moment import GalaxyAdamW
from diloco.model import Sha256Stream, params_sha256, trainable_parameters
from diloco.shards import Checkpoint


def pick_device(env: DistEnv) -> torch.device:
    """One accelerator per local rank when there is one, the CPU otherwise."""
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def describe_device(device: torch.device) -> str:
    """For the start-up banner: the accelerator's name, or the CPU."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} torch threads)"


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float = 600) -> None:
    """nccl for accelerator tensors plus gloo for CPU-side objects; plain gloo on CPU."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if env.under_launcher:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:  # a plain `python -m diloco.train`: a group of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def backend() -> str:
    """The process group's backend (gloo, or cpu:gloo,cuda:nccl)."""
    return str(dist.get_backend())


def barrier() -> None:
    dist.barrier()


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def uses_ddp(strategy: ShardingStrategy) -> bool:
    """DDP and ZERO1 wrap the model in torch DDP (every rank holds the full model); the others are FSDP2."""
    return strategy in ("DDP", "ZERO1")


def parallelize(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    strategy: ShardingStrategy,
    env: DistEnv,
    device: torch.device,
    precision: Precision,
    cpu_offload: bool,
    on_meta: bool = False,
    source: Checkpoint | Fresh | None = None,
) -> torch.nn.Module:
    """The model the loop trains, on `device`: the same module sharded in place (FSDP2), or a `DataParallel` around
    it. Collective in a group of several ranks. `source` (``reads_shards``): every rank built the model on the
    meta device and takes its own shards from there, a checkpoint's files or a fresh draw. Otherwise `on_meta`
    (``builds_on_meta``): this rank built it on the meta device and takes rank 0's values, its shards only; rank 0
    sends its model one tensor at a time and lets go of each once sent, so no rank holds the model twice."""
    if uses_ddp(strategy):
        assert not cpu_offload, "Config rejects --cpu-offload with DDP and ZERO1"
        if on_meta:
            model.to_empty(device=device)
        else:
            model.to(device)
        return DataParallel(model, device, precision)  # sends rank 0's parameters and buffers to every rank
    mesh = build_mesh(strategy, env, device)
    if source is not None:
        shard_model(model, layers, mesh, strategy, precision, cpu_offload)
        source.load_into(model, device)
    elif env.world_size > 1 and not cpu_offload:
        full = shards.parameters_to_meta(model) if env.rank == 0 else {}
        shard_model(model, layers, mesh, strategy, precision, cpu_offload)
        take_from_rank0(model, full, device)
    else:  # a group of one, or CPU offload (every rank built the whole model: FSDP2 pins the shards it keeps)
        model.to(device)
        full = model.state_dict() if env.world_size > 1 and env.rank == 0 else {}
        shard_model(model, layers, mesh, strategy, precision, cpu_offload)
        if env.world_size > 1:  # rank 0's values everywhere, copied into the shards one tensor at a time
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            broadcast_buffers(model)
    return model


def take_from_rank0(model: torch.nn.Module, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Collective: every rank's shards of rank 0's state dict `full` (empty elsewhere), into the sharded meta-device
    `model`. Each whole tensor travels over the CPU group (gloo) and rank 0 drops it once sent: it holds its whole model
    at first and its shards at the end, never both. Buffers outside the state dict keep the values each rank computed
    (rotary frequencies)."""
    sender = dist.get_rank() == 0

    def local_part(name: str, value: torch.Tensor) -> torch.Tensor:
        whole = full.pop(name) if sender else torch.empty(value.shape, dtype=value.dtype)
        dist.broadcast(whole, src=0)
        part = whole[shards.local_index(value)] if isinstance(value, DTensor) else whole
        return part.clone()  # (a view would keep the whole tensor)

    shards.assign(model, local_part, device)


def builds_on_meta(env: DistEnv, cpu_offload: bool) -> bool:
    """Whether this rank builds its model on the meta device and takes rank 0's values as it is sharded
    (``parallelize``): every rank but rank 0 of a group of several, so that one rank alone reads the weights or draws
    the fresh model. (Not with CPU offload: there every rank builds the whole model.)"""
    return env.world_size > 1 and env.rank != 0 and not cpu_offload


def reads_shards(env: DistEnv, strategy: ShardingStrategy, cpu_offload: bool, lora: bool) -> bool:
    """Whether each rank reads its own shards of a checkpoint's safetensors files (``diloco.shards``), or draws its
    own shards of a fresh model (``diloco.fresh``), so no rank holds the whole model: in an FSDP group of several
    ranks (DDP keeps the whole model on every rank), for a base model alone (LoRA's adapters are drawn by rank 0),
    and not under CPU offload (its shards live in pinned host memory)."""
    return env.world_size > 1 and not uses_ddp(strategy) and not cpu_offload and not lora


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers on every rank: FSDP2 leaves them whole, and a state dict may leave them out (rotary
    frequencies are not persistent)."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper (its parameter names carry no `module.` prefix)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


class DataParallel(DistributedDataParallel):
    """torch DDP with what the loop asks of an FSDP2 model: `set_requires_gradient_sync` (accumulate without
    an all-reduce on all but the last micro-batch, like `no_sync()`), and mixed precision.

    DDP has no parameter-dtype policy, so bf16-mixed/fp16-mixed mean `torch.autocast` around the forward:
    master weights, gradients and their all-reduce stay float32, matmuls run in the low precision, and
    autocast keeps precision-sensitive ops (norms, softmax, the loss) in float32. FSDP2's policy instead
    casts every parameter, so the two strategies' mixed-precision runs differ slightly; in 32-true they agree.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device, precision: Precision) -> None:
        super().__init__(module, device_ids=[device] if device.type == "cuda" else None)
        self.autocast_device = device.type
        self.autocast_dtype = low_precision(precision)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.require_backward_grad_sync = sync  # what `no_sync()` toggles; read by the next forward

    def forward(self, *args: object, **kwargs: object) -> object:
        if self.autocast_dtype is None:
            return super().forward(*args, **kwargs)
        with torch.autocast(self.autocast_device, dtype=self.autocast_dtype):
            return super().forward(*args, **kwargs)


def build_optimizer(
    model: torch.nn.Module,
    strategy: ShardingStrategy,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    galaxy_batches: float | None = None,
    fused: bool = False,
) -> torch.optim.Optimizer:
    """AdamW; under ZERO1 each rank keeps and steps the AdamW state of a 1/n partition of the parameters only
    (ZeroRedundancyOptimizer), then broadcasts its updated partition. Elementwise, so float32 results match.
    With `galaxy_batches` k: `GalaxyAdamW`, whose second moment is that of a k times larger batch.

    `fused`: torch's fused AdamW kernel instead of the multi-tensor one (see `fused_adamw`)."""
    params = trainable_parameters(model)  # (with LoRA, the adapters: the base is frozen)
    if galaxy_batches is not None:
        return GalaxyAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, galaxy_batches=galaxy_batches)
    implementation = {"fused": True} if fused else {"foreach": True}
    kwargs = {"lr": lr, "betas": betas, "weight_decay": weight_decay} | implementation
    if strategy == "ZERO1":
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def fused_adamw(device: torch.device, precision: Precision, cpu_offload: bool = False) -> bool:
    """Whether the inner AdamW takes torch's fused kernel: on an accelerator, where the multi-tensor step took 10% of
    a 1B llama's inner step on an H100 and the fused one half that (docs/gpu.md). Not under fp16-mixed: torch's
    sharded gradient scaler hands the fused step an inf flag of another shape (it fails). Not with --cpu-offload,
    whose step runs on the host (measured multi-tensor only), nor on CPU, where every result here was measured with
    the multi-tensor step."""
    return device.type != "cpu" and precision != "fp16-mixed" and not cpu_offload


def build_mesh(strategy: ShardingStrategy, env: DistEnv, device: torch.device) -> DeviceMesh:
    """NO_SHARD replicates over all ranks, HYBRID_SHARD replicates across nodes and shards within one."""
    if strategy == "NO_SHARD":
        return init_device_mesh(device.type, (env.world_size, 1), mesh_dim_names=("replicate", "shard"))
    if strategy == "HYBRID_SHARD":
        if env.world_size % env.local_world_size:
            raise FieldError("{sharding_strategy} HYBRID_SHARD needs the same number of ranks on every node")
        return init_device_mesh(
            device.type, (env.num_nodes, env.local_world_size), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh(device.type, (env.world_size,), mesh_dim_names=("shard",))


def low_precision(precision: Precision) -> torch.dtype | None:
    """The dtype a mixed-precision run computes in (None under 32-true)."""
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "32-true": None}[precision]


def mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    """Compute in the low precision, keep master weights and gradient reduction in float32."""
    return MixedPrecisionPolicy(param_dtype=low_precision(precision), reduce_dtype=torch.float32)


def shard_model(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    mesh: DeviceMesh,
    strategy: ShardingStrategy,
    precision: Precision,
    cpu_offload: bool,
) -> None:
    """fully_shard each decoder layer, then the root (FSDP2). SHARD_GRAD_OP keeps parameters gathered
    between forward and backward (ZeRO-2); FULL_SHARD reshards after forward (ZeRO-3)."""
    kwargs = {
        "mesh": mesh,
        "mp_policy": mixed_precision(precision),
        "reshard_after_forward": strategy in ("FULL_SHARD", "HYBRID_SHARD"),
    }
    if cpu_offload and mesh.device_type != "cpu":  # on a CPU-only run everything already lives in CPU memory
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def all_reduce_sum(value: float) -> float:
    """Sum a Python scalar over the ranks of this group. A CPU tensor goes over gloo (every backend here has it):
    reading an accelerator's result would wait for all the work queued before it, once per call."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item()


def all_reduce_mean(value: float) -> float:
    """Average a Python scalar over the ranks of this group."""
    return all_reduce_sum(value) / dist.get_world_size()


def local_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's part of every trainable parameter (a view: writing to it writes the parameter). Under NO_SHARD,
    DDP and ZERO1 that is the whole parameter: every rank averages the full model with its peer rank in the other
    groups, so a group of n ranks sends n times the model per round (each rank's copy, redundantly)."""
    return [p.to_local() if isinstance(p, DTensor) else p for p in trainable_parameters(model)]


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any (for stop requests that must be agreed on). Asked every inner
    step: host-side over gloo, so the host goes on queueing the next step while the accelerator works."""
    tensor = torch.tensor([int(flag)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def broadcast_object(obj: object, group: dist.ProcessGroup | None = None) -> object:
    """Rank 0's value on every rank (of `group`, default: all)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather_object(obj: object) -> list[object]:
    """Every rank's value, in rank order, on every rank."""
    box: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(box, obj)
    return box


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded model on rank 0 (CPU), an empty dict elsewhere."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def sha_of(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """params_sha256 of a full state dict (rank 0), None on the ranks that hold none."""
    if not state:
        return None
    return params_sha256([(name, state[name]) for name, _ in unwrap(model).named_parameters()])


def saved_names(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s state dict, sorted, but for the second name of a tensor held twice (a tied weight: the
    name registered first stays, as ``save_pretrained`` keeps it)."""
    seen: set[int] = set()
    names = []
    for name, tensor in unwrap(model).state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    return sorted(names)


def full_tensors(model: torch.nn.Module, names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Collective, one tensor at a time: each of `names` (of the state dict) whole on the CPU of rank 0, None on the
    other ranks. Every rank iterates to the end together (a sharded tensor is gathered by all), and nothing holds
    more than one whole tensor: exporting or hashing a model of any size needs one tensor's memory beside the shards.
    A parameter FSDP left unsharded (after a forward that keeps it so) is whole on every rank already."""
    tensors = unwrap(model).state_dict(keep_vars=True)
    sender = is_rank0()
    for name in names:
        tensor = tensors[name].detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.cpu() if sender else None
        del tensor  # (a gathered tensor lives until the next is gathered otherwise)


def params_sha(model: torch.nn.Module) -> str | None:
    """Collective: params_sha256 of the whole model on rank 0 (None elsewhere), gathered one tensor at a time."""
    names = sorted(name for name, _ in unwrap(model).named_parameters())
    digest = Sha256Stream()
    for _, tensor in full_tensors(model, names):
        digest.update(tensor)
    return digest.hexdigest() if is_rank0() else None


def is_rank0() -> bool:
    """Rank 0 of the group, or a process without one."""
    return not dist.is_initialized() or dist.get_rank() == 0
