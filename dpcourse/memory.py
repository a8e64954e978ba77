"""Chapter 09: where the memory of data-parallel training goes, by formula and measured.

``bytes_per_rank`` is the ZeRO paper's account of the model states on each rank;
``measured_bytes`` adds up the storage of the real tensors on this rank. The drivers
``measure_stages`` and ``compare_zero`` run in the parent and start the ranks with
``launch``; the ``*_on_rank`` functions are what every rank runs.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from .ddp import ScratchDDP
from .launch import launch
from .performance import MODELS, model_batch
from .throughput import WARMUP_STEPS, medians, slowest_rank, timed_steps
from .zero import GradientSharding, ShardedOptimizer, reduce_scatter_hook

STAGES = ("ddp", "zero1", "zero2", "zero3")
MEASURED_STAGES = STAGES[:3]  # ZeRO-3 shards the parameters too: not built here
KEYS = ("parameters", "gradients", "optimizer_state")
LR = 1e-3
MEASURE_BATCH = 8  # images per rank in measure_stages' one step: the bytes do not depend on it


def bytes_per_rank(num_params: int, world_size: int, stage: str, *, param_bytes: float = 4,
                   grad_bytes: float = 4, state_bytes: float = 8) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state on each of world_size ranks.

    The account of Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
    Trillion Parameter Models" (arXiv:1910.02054), section 5: plain data parallelism keeps
    everything on every rank; ZeRO-1 splits the optimizer state over the ranks, ZeRO-2 the
    gradients as well, ZeRO-3 the parameters as well. The defaults are float32 Adam (two
    moments: 8 bytes per parameter); mixed-precision Adam is param_bytes=2, grad_bytes=2,
    state_bytes=12 (float32 master weights and moments): the paper's 16 bytes per parameter.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size}, "
                         f"{num_params}")
    level = STAGES.index(stage)  # how many of the three are split over the ranks
    split = [level >= 3, level >= 2, level >= 1]
    sizes = [param_bytes, grad_bytes, state_bytes]
    out = {key: num_params * size / (world_size if s else 1)
           for key, size, s in zip(KEYS, sizes, split)}
    out["total"] = sum(out.values())
    return out


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under tensors (views of one storage count once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr(), t.device] = storage.nbytes()
    return sum(storages.values())


def measured_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameters, non-None gradients and optimizer state tensors, in storage bytes.

    The state is that of optimizer.optim where there is one (the local optimizer of our
    ShardedOptimizer and of torch's ZeroRedundancyOptimizer: this rank's shard), else of
    optimizer. Adam's state includes a step counter per parameter tensor (a 4-byte scalar)
    that the paper's formula leaves out.
    """
    params = list(module.parameters())
    local = getattr(optimizer, "optim", optimizer)
    state = [v for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {"parameters": storage_bytes(params),
           "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
           "optimizer_state": storage_bytes(state)}
    out["total"] = sum(out.values())
    return out


def staged(stage: str, model: str) -> tuple[ScratchDDP, torch.optim.Optimizer]:
    """model wrapped in ScratchDDP with AdamW: plain ("ddp"), sharded ("zero1") or sharded
    with gradients reduce-scattered ("zero2")."""
    if stage not in MEASURED_STAGES:
        raise ValueError(f"stage must be one of {MEASURED_STAGES}, got {stage!r}")
    ddp = ScratchDDP(MODELS[model][0]())
    if stage == "ddp":
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=LR)
    opt = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, lr=LR)
    if stage == "zero2":
        ddp.register_comm_hook(GradientSharding(opt), reduce_scatter_hook)
    return ddp, opt


def train_step(ddp: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
               y: torch.Tensor) -> None:
    """One step: zero_grad, mean cross-entropy, backward, optimizer step."""
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(X), y).backward()
    opt.step()


def own_shard(opt: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters whose optimizer state this rank keeps."""
    if isinstance(opt, ShardedOptimizer):
        return opt.shard()
    return [p for g in opt.param_groups for p in g["params"]]


def measure_on_rank(model: str, batch_size: int) -> dict[str, dict[str, Any]]:
    """For each measured stage, this rank's measured_bytes after one training step, and
    the numel and number of tensors of the shard it keeps state for."""
    X, y = model_batch(model, batch_size, seed=dist.get_rank())
    out = {}
    for stage in MEASURED_STAGES:
        ddp, opt = staged(stage, model)
        train_step(ddp, opt, X, y)
        shard = own_shard(opt)
        out[stage] = {"measured": measured_bytes(ddp.module, opt),
                      "shard_numel": sum(p.numel() for p in shard),
                      "shard_tensors": len(shard),
                      "num_params": sum(p.numel() for p in ddp.parameters())}
        del ddp, opt  # free this stage's tensors before the next is built
    return out


def measure_stages(world_size: int = 2, model: str = "lenet",
                   timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    """Bytes per rank after one AdamW step (float32) of model ("lenet" or "resnet18") under
    ScratchDDP: {stage: {"measured": [measured_bytes of each rank], "formula":
    bytes_per_rank(...), "shard_numel": [each rank's numel of owned parameters],
    "shard_tensors": [how many tensors]}} for "ddp", "zero1" and "zero2".

    The formula splits evenly; the shards split whole tensors, so they are only as even as
    the tensors' sizes allow, and the measured state adds Adam's 4-byte step counters. All
    are measured between steps: ZeRO-2 saves the gradients kept from one step to the next;
    during backward a bucket's full gradients and its reduce-scatter pieces exist as with DDP.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {tuple(MODELS)}, got {model!r}")
    ranks = launch(measure_on_rank, model, MEASURE_BATCH, world_size=world_size, backend="gloo",
                   timeout=timeout)
    out = {}
    for stage in MEASURED_STAGES:
        per_rank = [r[stage] for r in ranks]
        out[stage] = {"measured": [r["measured"] for r in per_rank],
                      "formula": bytes_per_rank(per_rank[0]["num_params"], world_size, stage),
                      "shard_numel": [r["shard_numel"] for r in per_rank],
                      "shard_tensors": [r["shard_tensors"] for r in per_rank]}
    return out


def compare_on_rank(steps: int, batch_size: int, repeats: int) -> dict[str, dict[str, Any]]:
    """LeNet with AdamW under each measured stage, the stages alternated in repeats rounds of
    steps steps after a warm-up: median seconds per step (slowest rank) and this rank's
    bytes of gradients and optimizer state after the last step."""
    X, y = model_batch("lenet", batch_size, seed=dist.get_rank())
    built = {stage: staged(stage, "lenet") for stage in MEASURED_STAGES}

    def step(stage: str) -> None:
        train_step(*built[stage], X, y)

    for stage in MEASURED_STAGES:
        for _ in range(WARMUP_STEPS):
            step(stage)
    order = [stage for _ in range(repeats) for stage in MEASURED_STAGES]
    seconds = slowest_rank([timed_steps(lambda: step(s), steps) / steps for s in order])
    median = medians(order, seconds)
    return {stage: {"seconds_per_step": median[stage],
                    **measured_bytes(built[stage][0].module, built[stage][1])}
            for stage in MEASURED_STAGES}


def compare_zero(world_size: int = 2, steps: int = 10, batch_size: int = 64, repeats: int = 3,
                 timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    """LeNet training with AdamW under "ddp" (ScratchDDP), "zero1" (+ ShardedOptimizer) and
    "zero2" (+ shard_gradients), alternated in one launch of world_size processes of
    batch_size images each: {stage: {"seconds_per_step": median of the slowest rank,
    "optimizer_state_bytes": [each rank's], "gradient_bytes": [each rank's]}}."""
    ranks = launch(compare_on_rank, steps, batch_size, repeats, world_size=world_size,
                   backend="gloo", timeout=timeout)
    return {stage: {"seconds_per_step": ranks[0][stage]["seconds_per_step"],
                    "optimizer_state_bytes": [r[stage]["optimizer_state"] for r in ranks],
                    "gradient_bytes": [r[stage]["gradients"] for r in ranks]}
            for stage in MEASURED_STAGES}
