"""Chapter 09: where the memory of data-parallel training goes, by formula and measured.

``bytes_per_rank`` is the ZeRO paper's account of the model states on each rank;
``measured_bytes`` adds up the storage of the real tensors on this rank (the drivers that
measure them across ranks are in ``experiments.zero_memory``).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

STAGES = ("ddp", "zero1", "zero2", "zero3")
KEYS = ("parameters", "gradients", "optimizer_state")


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
