"""Chapter 07's experiments: the functions its notebook runs on every rank with ``launch``.

A rank imports the function it runs, so they live here and not in the notebook.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import p2p
from ..comm_hooks import Traffic, counting_hook
from ..checkpoint import load_checkpoint, save_checkpoint
from ..data_parallel import max_relative_difference
from ..ddp import ScratchDDP, average_gradients, broadcast_parameters
from ..lenet import lenet_model
from .throughput import round_robin_samples

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def hello_collectives() -> dict[str, torch.Tensor]:
    """The four collectives on this rank's tensor [10r, 10r + 1, ...]; prints what it got."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(world) + 10 * rank
    summed = mine.clone()
    dist.all_reduce(summed)  # every rank: the elementwise sum
    from_0 = mine.clone()
    dist.broadcast(from_0, src=0)  # every rank: rank 0's tensor
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)  # every rank: every rank's tensor, in rank order
    piece = torch.empty_like(mine[:1])
    dist.reduce_scatter(piece, list(mine.split(1)))  # rank r: entry r of the sum
    got = {"mine": mine, "all_reduce": summed, "broadcast": from_0,
           "all_gather": torch.cat(gathered), "reduce_scatter": piece}
    print(f"rank {rank}: " + ", ".join(f"{k} {v.tolist()}" for k, v in got.items()))
    return got


def spawn_and_capture(fn: Callable[[], Any], timeout: float = 60.0) -> tuple[int | None, str]:
    """Start fn in a spawned process, as torch.multiprocessing does: exit code and stderr.
    (This process's file descriptor 2 points at a temporary file while the child starts.)"""
    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)  # the child inherits file descriptor 2: its stderr
        try:
            proc = mp.get_context("spawn").Process(target=fn)
            proc.start()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        err.seek(0)
        return proc.exitcode, err.read().decode(errors="replace")


def free_port() -> int:
    """A TCP port free at this moment on this host: the system picks one for port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_hand(rank: int, world: int, port: int) -> float:
    """What launch does around a rank function, by hand: join the group, work, leave."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # gloo's default: 30 minutes
    try:
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)  # 1 + 2 + ... + world, on every rank
        return total.item()
    finally:
        dist.destroy_process_group()


def p2p_against_all_reduce(numels: list[int]) -> list[dict]:
    """Per size: whether our two allreduces equal dist.all_reduce, and what each sent."""
    rank, rows = dist.get_rank(), []
    for n in numels:
        x = torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(rank))
        expected = x.clone()
        dist.all_reduce(expected)
        row = {"numel": n, "rank": rank}
        for fn in (p2p.allreduce, p2p.plain_ring_allreduce, p2p.ring_allreduce):
            y = x.clone()
            row[fn.__name__] = fn(y)  # elements sent
            row[f"{fn.__name__} equal"] = torch.equal(y, expected)
        rows.append(row)
    return rows


RINGS: dict[str, Callable[[torch.Tensor], object]] = {
    "dist.all_reduce": dist.all_reduce, "p2p.allreduce": p2p.allreduce,
    "plain ring": p2p.plain_ring_allreduce, "pipelined ring": p2p.ring_allreduce}


def ring_seconds(numels: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Seconds of the fastest of repeats calls of gloo's all_reduce, the naive allreduce, the
    plain ring and the pipelined one, on float32 tensors of each numel (alternated, after a
    warm-up): the least disturbed call (chapter 08 shows why medians jump)."""
    samples = round_robin_samples(RINGS, numels, repeats)
    return {name: {n: min(seconds) for n, seconds in by_numel.items()}
            for name, by_numel in samples.items()}


def sgd_on_shards(model: nn.Module, batches: Batches, lr: float, rank: int = 0,
                  world: int = 1) -> dict[str, torch.Tensor]:
    """SGD on this rank's share of each global batch, mean loss; the final state_dict."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for X, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(X.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def state_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest difference between two state_dicts (keys with or without "module."), relative
    to each reference tensor's scale."""
    plain = {k.removeprefix("module."): v for k, v in state.items()}
    return max_relative_difference([plain[k.removeprefix("module.")] for k in reference],
                                   list(reference.values()))


def steps_one_and_two(X: torch.Tensor, y: torch.Tensor) -> dict[str, bool | float]:
    """DDP's first two steps by hand on LeNet (in X's dtype), started differently on every
    rank: broadcast, then average the gradients; against one process on the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = lenet_model(seed=rank).to(X.dtype)
    broadcast_parameters(model)  # step 1
    reference = lenet_model(seed=0).to(X.dtype)  # rank 0's start, on the whole batch
    same_start = all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                        reference.parameters()))
    F.cross_entropy(model(X.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    average_gradients(model)  # step 2
    F.cross_entropy(reference(X), y).backward()
    return {"same start": same_start,
            "gradient difference": max_relative_difference(
                [p.grad for p in model.parameters()], [q.grad for q in reference.parameters()])}


def overlap_timeline(X: torch.Tensor, y: torch.Tensor, bucket_cap_mb: float) -> dict[str, Any]:
    """One ScratchDDP step on LeNet: when backward ran, and each bucket's allreduce, in s."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ScratchDDP(lenet_model(seed=0), bucket_cap_mb)
    shard = X.chunk(world)[rank], y.chunk(world)[rank]
    for _ in range(3):  # warm-up, then the measured step
        model.module.zero_grad()
        loss = F.cross_entropy(model(shard[0]), shard[1])
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
    return {"backward": (0.0, end - start),
            "buckets": [(i, a - start, b - start) for i, a, b in model.timeline()],
            "numels": [sum(p.numel() for p in b.params) for b in model.buckets],
            "launched in backward": model.launched_in_backward}


def ddp_lenet_runs(batches: Batches, lr: float) -> dict[str, dict[str, torch.Tensor]]:
    """LeNet trained on this rank's shards (in the batches' dtype) with ScratchDDP, and again
    with torch's DDP, from starts that differ on every rank (both broadcast rank 0's)."""
    rank, world, dtype = dist.get_rank(), dist.get_world_size(), batches[0][0].dtype
    scratch = ScratchDDP(lenet_model(seed=rank).to(dtype))
    torch_ddp = nn.parallel.DistributedDataParallel(lenet_model(seed=rank).to(dtype))
    return {name: sgd_on_shards(model, batches, lr, rank, world)
            for name, model in (("ScratchDDP", scratch), ("torch DDP", torch_ddp))}


def checkpoint_on_rank_0(path: str, X: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One step, rank 0 saves, a barrier, then every rank loads into a fresh LeNet."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ScratchDDP(lenet_model(seed=rank))
    sgd_on_shards(model, [(X, y)], lr=0.1, rank=rank, world=world)
    if rank == 0:
        save_checkpoint(model, path)  # the plain module's state_dict: no "module." prefix
    dist.barrier()  # nobody reads before rank 0 has finished writing
    fresh = lenet_model(seed=100 + rank)
    load_checkpoint(fresh, path)
    return {"wrapped keys": list(model.state_dict())[:2],
            "saved keys": list(torch.load(path, weights_only=True))[:2],
            "loaded equal": all(torch.equal(a, b) for a, b in
                                zip(fresh.parameters(), model.module.parameters()))}


def only_rank_0_reduces(seconds: float) -> float:
    """A classic mistake: rank 0 sums a metric that the other ranks never send."""
    metric = torch.tensor([float(dist.get_rank())])
    if dist.get_rank() == 0:
        dist.all_reduce(metric)  # waits for every other rank, in vain
    else:
        time.sleep(seconds)  # the others get on with something else
    return metric.item()


class TwoHeads(nn.Module):
    """A body and two heads; each forward uses one head, so the other gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head_a, self.head_b = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, head: str = "a") -> torch.Tensor:
        return getattr(self, f"head_{head}")(torch.relu(self.body(x)))


def unused_head(wrapper: str) -> dict[str, Any]:
    """Two steps that never use head_b, under "ScratchDDP", "torch DDP" or "torch DDP,
    find_unused_parameters=True"; head_b's gradient afterwards (None: never written)."""
    torch.manual_seed(0)
    net = TwoHeads()
    model = (ScratchDDP(net) if wrapper == "ScratchDDP" else nn.parallel.DistributedDataParallel(
        net, find_unused_parameters=wrapper.endswith("find_unused_parameters=True")))
    for _ in range(2):
        model(torch.randn(8, 4)).sum().backward()
    grad = net.head_b.weight.grad
    return {"head_b grad": None if grad is None else grad.abs().max().item()}


def accumulation(X: torch.Tensor, y: torch.Tensor, micro: int) -> dict[str, dict[str, Any]]:
    """One step of LeNet (X's dtype) on this rank's share of the global batch X, y, in micro
    equal micro-batches, with ScratchDDP and torch's DDP: under no_sync() for all but the last,
    or synchronising each; the gradient against one process's on the whole batch, and the
    all_reduce calls and bytes each rank made (counting_hook)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = lenet_model(seed=0).to(X.dtype)
    F.cross_entropy(reference(X), y).backward()
    pieces = list(zip(X.chunk(world)[rank].chunk(micro), y.chunk(world)[rank].chunk(micro)))
    found = {}
    for wrapper in ("ScratchDDP", "torch DDP"):
        for quiet in (True, False):
            net, traffic = lenet_model(seed=rank).to(X.dtype), Traffic()
            model = (ScratchDDP(net) if wrapper == "ScratchDDP"
                     else nn.parallel.DistributedDataParallel(net))
            model.register_comm_hook(traffic, counting_hook)
            for j, (xb, yb) in enumerate(pieces):
                with model.no_sync() if quiet and j < micro - 1 else nullcontext():
                    (F.cross_entropy(model(xb), yb) / micro).backward()  # mean of the means
            found[f"{wrapper}, {'no_sync' if quiet else 'every micro-batch'}"] = {
                "difference": max_relative_difference([p.grad for p in net.parameters()],
                                                      [q.grad for q in reference.parameters()]),
                "calls": traffic.calls, "bytes": traffic.bytes}
    return found
