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


def zero3_peak_bytes(num_params: int, unit_numels: list[int], world_size: int, *,
                     prefetch: bool = True, param_bytes: float = 4, grad_bytes: float = 4,
                     state_bytes: float = 8, compute_bytes: float | None = None,
                     activation_bytes: float = 0) -> dict[str, float]:
    """The most bytes a rank holds during ZeRO-3's (fsdp.ScratchFSDP's) forward and backward.

    bytes_per_rank(..., "zero3") (the gradient shards: the reduce-scattered slices backward
    collects) plus, while unit i's backward runs (unit_numels in running order, each padded to
    a multiple of world_size, compute_bytes per number, default param_bytes):
    "gathered": unit i's parameters, and with prefetch unit i-1's (backward's next);
    "full_gradient": unit i's twice (its parameters' gradients, and the flat padded copy
    autograd makes of them) and unit i+1's, whose reduce-scatter runs meanwhile (ScratchFSDP
    keeps one in flight: it waits for it before starting the next);
    plus activation_bytes (what autograd keeps for backward). The costliest unit counts.
    """
    compute = param_bytes if compute_bytes is None else compute_bytes
    padded = [-(-n // world_size) * world_size for n in unit_numels] + [0]
    in_flight = [(g + (padded[i - 1] if prefetch and i > 0 else 0), 2 * g + padded[i + 1])
                 for i, g in enumerate(padded[:-1])]  # (gathered, full gradients) in i's
    gathered, gradients = max(in_flight, key=sum, default=(0, 0))
    out = bytes_per_rank(num_params, world_size, "zero3", param_bytes=param_bytes,
                         grad_bytes=grad_bytes, state_bytes=state_bytes)
    out.update(gathered=gathered * compute, full_gradient=gradients * compute,
               activations=activation_bytes)
    out["total"] += out["gathered"] + out["full_gradient"] + activation_bytes
    return out


def largest_model(device_bytes: float, world_size: int, stage: str, *, param_bytes: float = 2,
                  grad_bytes: float = 2, state_bytes: float = 12) -> int:
    """The most parameters whose model states fit in device_bytes on each of world_size ranks
    under stage (bytes_per_rank; by default mixed-precision Adam, 16 bytes per parameter). The
    activations and ZeRO-3's gathered units need room besides."""
    per_param = bytes_per_rank(1, world_size, stage, param_bytes=param_bytes,
                               grad_bytes=grad_bytes, state_bytes=state_bytes)["total"]
    return int(device_bytes // per_param)


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
