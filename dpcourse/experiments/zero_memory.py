"""Chapter 09: bytes per rank and step time of DDP, ZeRO-1 and ZeRO-2, measured across ranks.

The drivers ``measure_stages`` and ``compare_zero`` run in the parent and start the ranks
with ``launch``; the ``*_on_rank`` functions are what every rank runs.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..ddp import ScratchDDP
from ..launch import launch
from ..memory import STAGES, bytes_per_rank, measured_bytes
from ..zero import GradientSharding, ShardedOptimizer, reduce_scatter_hook
from .performance import MODELS, model_batch
from .throughput import WARMUP_STEPS
from .timing import alternate, median_seconds, repeat

MEASURED_STAGES = STAGES[:3]  # ZeRO-3 shards the parameters too: not built here
ADAMW_LR = 1e-3
MEASURE_BATCH = 8  # images per rank in measure_stages' one step: the bytes do not depend on it


def staged(stage: str, model: str) -> tuple[ScratchDDP, torch.optim.Optimizer]:
    """model wrapped in ScratchDDP with AdamW: plain ("ddp"), sharded ("zero1") or sharded
    with gradients reduce-scattered ("zero2")."""
    if stage not in MEASURED_STAGES:
        raise ValueError(f"stage must be one of {MEASURED_STAGES}, got {stage!r}")
    ddp = ScratchDDP(MODELS[model][0]())
    if stage == "ddp":
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=ADAMW_LR)
    opt = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, lr=ADAMW_LR)
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
    during backward every gradient exists in full, as with DDP (zero.GradientSharding).
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


RING_HALVES = {"all_reduce": 2, "reduce_scatter": 1, "broadcast": 1}  # x (k-1)/k of the bytes


@contextmanager
def ring_bytes() -> Iterator[dict[str, float]]:
    """While inside, {collective: bytes} this rank sends in dist.all_reduce,
    dist.reduce_scatter and dist.broadcast, counted from the tensors handed to them with the
    ring's law (chapter 03): (k-1)/k of them per reduce-scatter or broadcast (the owners'
    broadcasts together being an all-gather), twice that per allreduce."""
    share = (dist.get_world_size() - 1) / dist.get_world_size()
    sent = dict.fromkeys(RING_HALVES, 0.0)
    originals = {name: getattr(dist, name) for name in RING_HALVES}

    def counting(name: str) -> Any:
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            handed = args[0] if name == "reduce_scatter" else [tensor]  # (output, inputs)
            sent[name] += RING_HALVES[name] * share * sum(t.nbytes for t in handed)
            return originals[name](tensor, *args, **kwargs)
        return call

    try:
        for name in RING_HALVES:
            setattr(dist, name, counting(name))
        yield sent
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def compare_on_rank(steps: int, batch_size: int, repeats: int) -> dict[str, dict[str, Any]]:
    """LeNet with AdamW under each measured stage, the stages alternated in repeats rounds of
    steps steps after a warm-up: median seconds per step (slowest rank), this rank's bytes
    of gradients and optimizer state after the last step, and the bytes it sends in one
    more step (ring_bytes)."""
    X, y = model_batch("lenet", batch_size, seed=dist.get_rank())
    built = {stage: staged(stage, "lenet") for stage in MEASURED_STAGES}

    def step(stage: str) -> None:
        train_step(*built[stage], X, y)

    for stage in MEASURED_STAGES:
        for _ in range(WARMUP_STEPS):
            step(stage)
    median = median_seconds(alternate({s: repeat(partial(step, s), steps)
                                       for s in MEASURED_STAGES}, repeats, warmup=0))
    sent = {}
    for stage in MEASURED_STAGES:
        with ring_bytes() as sent[stage]:
            step(stage)
    return {stage: {"seconds_per_step": median[stage] / steps, "bytes_sent": sent[stage],
                    **measured_bytes(built[stage][0].module, built[stage][1])}
            for stage in MEASURED_STAGES}


def compare_zero(world_size: int = 2, steps: int = 10, batch_size: int = 64, repeats: int = 3,
                 timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    """LeNet training with AdamW under "ddp" (ScratchDDP), "zero1" (+ ShardedOptimizer) and
    "zero2" (+ reduce_scatter_hook), alternated in one launch of world_size processes of
    batch_size images each: {stage: {"seconds_per_step": median of the slowest rank,
    "optimizer_state_bytes": [each rank's], "gradient_bytes": [each rank's], "bytes_sent":
    [each rank's {collective: bytes sent in one step}]}}."""
    ranks = launch(compare_on_rank, steps, batch_size, repeats, world_size=world_size,
                   backend="gloo", timeout=timeout)
    return {stage: {"seconds_per_step": ranks[0][stage]["seconds_per_step"],
                    "optimizer_state_bytes": [r[stage]["optimizer_state"] for r in ranks],
                    "gradient_bytes": [r[stage]["gradients"] for r in ranks],
                    "bytes_sent": [r[stage]["bytes_sent"] for r in ranks]}
            for stage in MEASURED_STAGES}
