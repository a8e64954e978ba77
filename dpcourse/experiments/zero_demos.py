"""Chapter 09's experiments: the activations it measures and the functions its notebook runs
on every rank with ``launch`` (a rank imports them, so they live in a module)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..data_parallel import max_relative_difference
from ..ddp import ScratchDDP
from ..lenet import lenet_model
from ..memory import measured_bytes
from ..zero import GradientSharding, ShardedOptimizer, reduce_scatter_hook
from .zero_memory import train_step

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def activation_bytes(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward pass of model on
    (X, y) with the cross-entropy loss: parameters left out, views of one storage once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}  # storage -> bytes of the largest tensor saved from it

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage().data_ptr()
        if storage not in params:
            saved[storage] = max(saved.get(storage, 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        F.cross_entropy(model(X), y)
    return sum(saved.values())


def train_on_shards(model: nn.Module, opt: torch.optim.Optimizer,
                    batches: Batches) -> list[list[torch.Tensor]]:
    """One step per global batch on this rank's share of it (mean loss); the parameters
    after each step (full tensors, also for FSDP's sharded ones)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    after = []
    for X, y in batches:
        train_step(model, opt, X.chunk(world)[rank], y.chunk(world)[rank])
        after.append([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                      for p in model.parameters()])
    return after


WAYS = ("AdamW", "ZeRO-1", "ZeRO-2", "torch ZeRO-1")


def optimizer_for(way: str, ddp: ScratchDDP, lr: float,
                  weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over ddp's parameters, one of WAYS: plain, our ZeRO-1, our ZeRO-2 (gradients
    reduce-scattered), or torch's ZeroRedundancyOptimizer."""
    hyper = {"lr": lr, "weight_decay": weight_decay}
    if way == "AdamW":
        return torch.optim.AdamW(ddp.parameters(), **hyper)
    if way == "torch ZeRO-1":
        return ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, **hyper)
    opt = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, **hyper)
    if way == "ZeRO-2":
        ddp.register_comm_hook(GradientSharding(opt), reduce_scatter_hook)
    return opt


def lenet_four_ways(batches: Batches, lr: float, weight_decay: float) -> dict[str, dict]:
    """LeNet (in the batches' dtype), started differently on every rank, trained under
    ScratchDDP with each of WAYS on the same batches. For each way: the largest relative
    difference from plain AdamW after each step, which gradients this rank holds at the
    end, and the bytes of its optimizer state (measured_bytes)."""
    rank, dtype = dist.get_rank(), batches[0][0].dtype
    out, plain = {}, None
    for way in WAYS:
        ddp = ScratchDDP(lenet_model(seed=rank).to(dtype))
        opt = optimizer_for(way, ddp, lr, weight_decay)
        after = train_on_shards(ddp, opt, batches)
        plain = after if plain is None else plain
        out[way] = {"differences": [max_relative_difference(a, b) for a, b in zip(after, plain)],
                    "gradients held": [p.grad is not None for p in ddp.parameters()],
                    "state bytes": measured_bytes(ddp.module, opt)["optimizer_state"]}
    return out


def state_numbers(opt: torch.optim.Optimizer) -> int:
    """How many numbers this rank's optimizer state holds (Adam's two moments; the step
    counters, one number per parameter tensor, are left out; FSDP's: the local shards)."""
    return sum(local(t).numel() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of t: the local shard of one of FSDP's DTensors, else t."""
    return t.to_local() if hasattr(t, "to_local") else t


def plain_adamw(batches: Batches, lr: float, weight_decay: float) -> list[list[torch.Tensor]]:
    """LeNet (seed 0, in the batches' dtype) trained with plain AdamW in one process on the
    whole batches: its parameters after each step."""
    model = lenet_model(seed=0).to(batches[0][0].dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    after = []
    for X, y in batches:
        train_step(model, opt, X, y)
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def fsdp_against_adamw(batches: Batches, lr: float, weight_decay: float) -> dict[str, Any]:
    """LeNet under torch's fully_shard (ZeRO-3), AdamW, against plain_adamw: the largest
    relative difference after each step, each parameter's local shape, and the numbers this
    rank holds (parameters, gradients, state)."""
    from torch.distributed.device_mesh import init_device_mesh  # FSDP: imported when used
    from torch.distributed.fsdp import fully_shard

    model = lenet_model(seed=0).to(batches[0][0].dtype)  # the same on every rank: no broadcast
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))  # not a GPU
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sharded, whole = train_on_shards(model, opt, batches), plain_adamw(batches, lr, weight_decay)
    params = list(model.parameters())
    return {"differences": [max_relative_difference(a, b) for a, b in zip(sharded, whole)],
            "local shapes": [tuple(local(p).shape) for p in params],
            "numbers": {"parameters": sum(local(p).numel() for p in params),
                        "gradients": sum(local(p.grad).numel() for p in params),
                        "optimizer_state": state_numbers(opt)}}
