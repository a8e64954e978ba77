"""What the chapter 11 tests (compression hooks, DiLoCo) launch on every rank; ranks import it
from tests/ (pytest's sys.path, which a rank inherits)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock


import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpcourse.compression import PowerSGDState, allreduce_hook, bf16_hook, powersgd_hook
from dpcourse.ddp import GradBucket, ScratchDDP
from dpcourse.experiments.comm_demos import (TorchsFirstQs, all_reduce_payload, torch_powersgd,
                                             torch_powersgd_on_cpu)
from dpcourse.local_sgd import DiLoCo

STEPS = 6


def net(seed: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A small conv net: a 4-d kernel, matrices and biases."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 12), nn.Tanh(), nn.Linear(12, 10)).to(dtype)


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's global batch of 12 images (float64), this rank's share of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(12, 1, 6, 6, generator=g, dtype=torch.float64)
    return x.chunk(world)[rank], torch.randint(0, 10, (12,), generator=g).chunk(world)[rank]


def train(model: nn.Module, opt: Any, steps: int, rank: int = 0, world: int = 1,
          after_step: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
    """steps steps of mean cross-entropy on this rank's share; the final state."""
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        x, y = batch(step, rank, world)
        opt.zero_grad()
        F.cross_entropy(model(x.to(dtype)), y).backward()
        opt.step()
        if after_step is not None:
            after_step()
    inner = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


HOOKS: dict[str, Callable[[], tuple[Any, Callable]]] = {
    "allreduce": lambda: (None, allreduce_hook), "bf16": lambda: (None, bf16_hook),
    "powersgd": lambda: (PowerSGDState(2, start_step=1), powersgd_hook),
    "powersgd full rank": lambda: (PowerSGDState(10_000, start_step=0), powersgd_hook)}


def hooked(wrapper: str, hook: str, dtype: torch.dtype = torch.float64,
           bucket_cap_mb: float = 25.0, **torchs: Any) -> dict[str, Any]:
    """STEPS SGD steps under wrapper ("scratch", "torch", "none": plain DDP) with hook;
    torchs: more arguments for torch's DDP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = net(rank, dtype)
    ddp = (ScratchDDP(model, bucket_cap_mb) if wrapper == "scratch"
           else DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **torchs))
    state = None
    if hook != "none":
        state, fn = HOOKS[hook]()
        ddp.register_comm_hook(state, fn)
    final = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.2), STEPS, rank, world)
    return {"state": final, "bytes_sent": getattr(state, "bytes_sent", None)}


def hook_checks(signals: str) -> dict[str, Any]:
    """Every hook on both DDPs, and plain torch DDP (the reference) in float64 and float32;
    PowerSGD against torch's powerSGD_hook; whether each hook returns before its average
    arrives (signals: a folder for the ranks' handshake)."""
    out = {(w, h): hooked(w, h) for w in ("scratch", "torch") for h in HOOKS}
    out["scratch", "none"] = hooked("scratch", "none")
    out["per-parameter buckets", "powersgd"] = hooked("scratch", "powersgd", bucket_cap_mb=0)
    out["torch per-parameter buckets", "powersgd"] = hooked("torch", "powersgd", bucket_cap_mb=0,
                                                             find_unused_parameters=True)
    out["against torch's powerSGD_hook"] = {r: against_torch_powersgd(r) for r in (2, 8, 16)}
    out["done when returned"] = done_when_returned(Path(signals))
    out["bf16 in float32"] = hooked("scratch", "bf16", torch.float32)
    out["plain in float32"] = hooked("scratch", "none", torch.float32)
    out["powersgd bytes"] = powersgd_bytes()
    out["error feedback"] = error_feedback_sums()
    return out


def powersgd_bytes() -> dict[str, int]:
    """Bytes one step sends: before start_step (everything) and compressed at rank 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = ScratchDDP(net(rank))
    state = PowerSGDState(2, start_step=1)
    ddp.register_comm_hook(state, powersgd_hook)
    sent = []
    for step in range(2):
        x, y = batch(step, rank, world)
        F.cross_entropy(ddp(x), y).backward()
        sent.append(state.bytes_sent - sum(sent))
    return {"plain": sent[0], "compressed": sent[1]}


def error_feedback_sums(steps: int = 5) -> dict[str, torch.Tensor]:
    """A 6 x 5 matrix gradient, random on every rank and step, through powersgd_hook at rank
    1 with error feedback: the sum of what arrived, the ranks' mean error at the end, and the
    sum of the true averages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    param = nn.Parameter(torch.zeros(6, 5, dtype=torch.float64))
    state = PowerSGDState(1, start_step=0)
    arrived, true = torch.zeros(6, 5, dtype=torch.float64), torch.zeros(6, 5, dtype=torch.float64)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        grad = torch.randn(6, 5, generator=g, dtype=torch.float64)
        average = grad.clone()
        dist.all_reduce(average)
        true += average / world
        bucket = GradBucket(0, grad.reshape(-1).clone(), [param], True)
        arrived += powersgd_hook(state, bucket).wait().view(6, 5)
    error = state.errors[param].clone()
    dist.all_reduce(error)
    return {"arrived": arrived, "mean_error": error / world, "true": true}


def diloco_checks() -> dict[str, Any]:
    """DiLoCo as DDP (sync_every=1, SGD inside, outer lr 1, no momentum) against torch's DDP;
    and DiLoCo proper (AdamW inside, Nesterov outside, sync every 3): the parameters every
    rank holds after each sync, and the bytes sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = net(rank)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.2), 1, outer_lr=1.0,
                 outer_momentum=0.0)
    as_ddp = train(model, opt, STEPS, rank, world)
    ddp = DistributedDataParallel(net(0))
    reference = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.2), STEPS, rank, world)
    model = net(rank)
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=0.01), 3)
    synced = []
    train(model, opt, STEPS, rank, world, after_step=lambda: synced.append(
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        if opt.inner_steps % 3 == 0 else None))
    return {"as_ddp": as_ddp, "ddp": reference, "synced": [s for s in synced if s is not None],
            "syncs": opt.syncs, "bytes_sent": opt.bytes_sent,
            "numel": sum(p.numel() for p in model.parameters())}


def wide_net(seed: int) -> nn.Module:
    """LeNet's small matrices in a float64 net: a 20 x 9 kernel, a 128 x 320 and a 10 x 128."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 20, 3), nn.Tanh(), nn.Flatten(), nn.Linear(320, 128),
                         nn.Tanh(), nn.Linear(128, 10)).double()


def against_torch_powersgd(matrix_rank: int) -> dict[str, Any]:
    """wide_net, STEPS SGD steps on torch's DDP under our powersgd_hook (from torch's first
    Qs) and under torch's powerSGD_hook set as ours: final states, payload bytes per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for way, (state, hook) in {"ours": (TorchsFirstQs(matrix_rank), powersgd_hook),
                               "torch": torch_powersgd(matrix_rank)}.items():
        ddp = DistributedDataParallel(wide_net(rank))
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
        sent = []
        for step in range(STEPS):
            x, y = batch(step, rank, world)
            opt.zero_grad()
            with all_reduce_payload() as payload:
                F.cross_entropy(ddp(x), y).backward()
            opt.step()
            sent.append(payload["bytes"])
        out[way] = {"state": {k: v.detach().clone() for k, v in ddp.module.state_dict().items()},
                    "bytes per step": sent}
    return out


ASYNC_HOOKS: dict[str, Callable[[], tuple[Any, Callable]]] = {
    "allreduce": lambda: (None, allreduce_hook), "bf16": lambda: (None, bf16_hook),
    "powersgd before start_step": lambda: (PowerSGDState(1, start_step=1), powersgd_hook),
    "powersgd compressing": lambda: (PowerSGDState(1, start_step=0), powersgd_hook)}


def done_when_returned(signals: Path, patience_s: float = 60.0) -> dict[str, Any]:
    """Each hook on a bucket (a 6 x 5 matrix and a bias) while rank 1 holds its part back
    until rank 0's hook has returned (a file in signals says so; after patience_s it goes on
    anyway, so that a blocking hook fails instead of hanging): on rank 0, whether the
    future was already done; on every rank, the largest gap to the exact average, relative to
the ranks' mean magnitude there."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params = [nn.Parameter(torch.zeros(6, 5)), nn.Parameter(torch.zeros(6))]
    out = {}
    for name, make in ASYNC_HOOKS.items():
        grads = [torch.randn(36, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        returned = signals / name.replace(" ", "_")
        if rank == 1:
            deadline = time.monotonic() + patience_s
            while not returned.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        state, hook = make()
        future = hook(state, GradBucket(0, grads[rank].clone(), params, False))  # not last:
        # the last compressed bucket waits for itself, since DDP may start a collective next
        done = future.done()
        if rank == 0:
            returned.touch()
        error = (future.wait() - sum(grads) / world).abs()
        out[name] = {"done": done, "gap": (error / (sum(g.abs() for g in grads) / world)).max()}
    return out


class _Forgetting(dict):
    """A dict that keeps nothing: PowerSGD's qs without warm start."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def selfchecks_powersgd_without(feature: str) -> None:
    """course.py check's PowerSGD check, our hook without feature ("error feedback" or
    "warm start"): it must raise."""
    from dpcourse import selfcheck

    class Broken(TorchsFirstQs):
        def __init__(self, matrix_rank: int) -> None:
            super().__init__(matrix_rank)
            if feature == "error feedback":
                self.error_feedback = False
            else:
                self.qs = _Forgetting()
    intact, selfcheck.TorchsFirstQs = selfcheck.TorchsFirstQs, Broken
    try:
        selfcheck.powersgd_like_torchs()
    finally:
        selfcheck.TorchsFirstQs = intact


def torchs_powersgd_trained(steps: int = 3) -> dict[str, torch.Tensor]:
    """wide_net after steps SGD steps on torch's DDP under torch's powerSGD_hook at rank 2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(wide_net(rank))
    ddp.register_comm_hook(*torch_powersgd(2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    for step in range(steps):
        x, y = batch(step, rank, world)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return ddp.module.state_dict()


def sync_of_cuda_only(device: Any = None) -> None:
    """torch.cuda.synchronize as a GPU host's torch 2.11 does it: a CPU device raises."""
    if device is not None and torch.device(device).type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {device}")


def torchs_powersgd_on_a_gpu_host() -> dict[str, Any]:
    """torch's powerSGD_hook on CPU ranks where CUDA is available (simulated): unguarded (the
    error, as text) and under torch_powersgd_on_cpu; and on this host as it is."""
    out: dict[str, Any] = {"as it is": torchs_powersgd_trained()}
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "synchronize", sync_of_cuda_only):
        try:
            out["unguarded"] = torchs_powersgd_trained()
        except RuntimeError as error:
            out["unguarded"] = str(error)
        with torch_powersgd_on_cpu():
            out["guarded"] = torchs_powersgd_trained()
    return out
