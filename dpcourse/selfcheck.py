"""`python3 course.py check`: every chapter's device-dependent paths, at small sizes, on the
devices this machine has, as a table (chapter, what ran, on which devices, result, seconds).

With 2 GPUs or more: real devices, nn.DataParallel, nccl. With one: the simulated devices on it,
and the multi-process paths on gloo (NCCL does not put two ranks on one GPU). Without: the CPU
paths, and the GPU paths listed as not run. Exits non-zero only when a path that ran failed.
Each check compares with an independent reference (one device, one process, torch's own).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import allreduce, broadcast, get_params
from .compression import PowerSGDState, powersgd_hook
from .data_parallel import ScratchDataParallel
from .ddp import ScratchDDP
from .fsdp import ScratchFSDP
from .hardware import accelerators, devices
from .launch import launch, rank_device
from .lenet import init_lenet_params, lenet, lenet_layers, loss
from .ring import ring_allreduce
from .shm import SharedMemoryAllreduce
from .split import split_batch
from .training import train_batch
from .zero import ShardedOptimizer

TOLERANCE = 1e-4  # float32, relative to the largest element: one step, several devices


@dataclass
class Check:
    chapter: str
    what: str
    run: Callable[[], str]  # returns the devices it ran on; raises when wrong
    needs_gpus: int = 0


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    gap = ((got.detach().cpu().double() - want.detach().cpu().double()).abs().max()
           / want.detach().cpu().double().abs().max().clamp_min(1e-12)).item()
    if not gap <= TOLERANCE:
        raise AssertionError(f"{what}: off by {gap:.1e} of the largest element")


def names(devs: list[torch.device]) -> str:
    return ", ".join(map(str, devs))


def check_tensors() -> str:
    devs = devices(2)
    x = torch.arange(6.0).reshape(2, 3)
    for d in devs:
        if not torch.equal(x.to(d).cpu(), x):
            raise AssertionError(f"a round trip through {d} changed the tensor")
    return names(devs)


def check_collectives() -> str:
    devs = devices(3)
    parts = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    want = sum(parts)
    for name, reduce in (("allreduce", allreduce), ("ring_allreduce", ring_allreduce)):
        tensors = [p.to(d) for p, d in zip(parts, devs)]
        reduce(tensors)
        for t in tensors:
            close(t, want, name)
    copies = broadcast(want, devs)
    if not all(torch.equal(c.cpu(), want) for c in copies):
        raise AssertionError("broadcast made unequal copies")
    return names(devs)


def check_train_batch() -> str:
    devs = devices(2)
    X, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    params = init_lenet_params(0, scale=0.1)
    one = get_params(params, devs[0])
    loss(lenet(X.to(devs[0]), one), y.to(devs[0])).sum().backward()
    want = [(p - 0.1 * p.grad / 16).detach() for p in one]
    device_params = [get_params(params, d) for d in devs]
    shards = split_batch(X, y, devs)
    if sum(len(s) for s in shards[0]) != 16:
        raise AssertionError("split_batch lost examples")
    train_batch(X, y, device_params, devs, 0.1)
    for replica in device_params:
        for got, w in zip(replica, want):
            close(got, w, "train_batch")
    return names(devs)


def check_data_parallel() -> str:
    devs = devices(2)
    X, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    results = {}
    for name, wrap in (("one device", lambda m: m), ("ScratchDataParallel",
                                                     lambda m: ScratchDataParallel(m, devs))):
        model = lenet_layers(0).to(devs[0])
        F.cross_entropy(wrap(model)(X.to(devs[0])), y.to(devs[0])).backward()
        results[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    if all(d.type == "cuda" for d in devs):
        model = lenet_layers(0).to(devs[0])
        dp = nn.DataParallel(model, device_ids=[d.index for d in devs])
        F.cross_entropy(dp(X.to(devs[0])), y.to(devs[0])).backward()
        close(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), results["one device"],
              "nn.DataParallel")
    close(results["ScratchDataParallel"], results["one device"], "ScratchDataParallel")
    return names(devs)


def one_step(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
             y: torch.Tensor) -> None:
    opt.zero_grad()
    F.cross_entropy(model(X), y).backward()
    opt.step()


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1).cpu() for v in state.values()])


RANK_WAYS = {
    "07": ("ScratchDDP", lambda m: (ScratchDDP(m), None)),
    "07 ": ("torch's DistributedDataParallel", lambda m: (nn.parallel.DistributedDataParallel(
        m, device_ids=[m[0].weight.device.index] if m[0].weight.is_cuda else None), None)),
    "09": ("ZeRO-1: ShardedOptimizer under ScratchDDP", lambda m: (ScratchDDP(m), "sharded")),
    "10": ("ScratchFSDP", lambda m: (ScratchFSDP(m), None)),
    "11": ("PowerSGD hook at full rank, on ScratchDDP", lambda m: (ScratchDDP(m), "powersgd")),
}


def on_rank() -> dict[str, str]:
    """One SGD step of every multi-process way on this rank's share of a batch, each against
    one process on the whole batch: "ok" or what was wrong, by way."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
    reference = lenet_layers(0).to(device)
    one_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), X.to(device), y.to(device))
    want = flat(reference.state_dict())
    mine = X.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
    out = {}
    for key, (what, wrap) in RANK_WAYS.items():
        try:
            model, extra = wrap(lenet_layers(rank).to(device))
            opt = (ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
                   if extra == "sharded" else torch.optim.SGD(model.parameters(), lr=0.1))
            if extra == "powersgd":
                model.register_comm_hook(PowerSGDState(10_000, start_step=0), powersgd_hook)
            one_step(model, opt, *mine)
            got = model.full_state_dict() if isinstance(model, ScratchFSDP) else model.module.state_dict()
            close(flat(got), want, what)
            out[key] = "ok"
        except Exception as error:  # noqa: BLE001 - reported in the table
            out[key] = f"FAILED: {type(error).__name__}: {error}"
    out["08"] = shared_memory_on_rank() if device.type == "cpu" else "not run: CPU tensors only"
    return out


def shared_memory_on_rank() -> str:
    """Chapter 08's shared-memory allreduce against dist.all_reduce."""
    try:
        t = torch.randn(10_000, generator=torch.Generator().manual_seed(dist.get_rank()))
        want = t.clone()
        dist.all_reduce(want)
        with SharedMemoryAllreduce() as shm:
            shm.allreduce(t)
        close(t, want, "SharedMemoryAllreduce")
        return "ok"
    except Exception as error:  # noqa: BLE001 - reported in the table
        return f"FAILED: {type(error).__name__}: {error}"


LOCAL = [Check("00", "tensors to each device and back", check_tensors),
         Check("03", "broadcast, allreduce, ring_allreduce on 3 devices", check_collectives),
         Check("04-05", "split_batch and train_batch on 2 devices", check_train_batch),
         Check("06", "ScratchDataParallel (and nn.DataParallel on real GPUs)",
               check_data_parallel)]


def rank_rows(world_size: int = 2) -> list[tuple[str, str, str, str, float]]:
    """The multi-process checks, run in one launch: nccl with a GPU per rank, else gloo."""
    gpus = len([d for d in accelerators() if d.type == "cuda"])
    backend = "nccl" if gpus >= world_size else "gloo"
    where = f"{world_size} processes, {backend}" + ("" if backend == "nccl" else " on the CPU")
    start = time.perf_counter()
    try:
        results = launch(on_rank, world_size=world_size, backend=backend, timeout=180)
    except Exception as error:  # noqa: BLE001 - a crashed or hung rank fails every row
        results = [{key: f"FAILED: {error}" for key in [*RANK_WAYS, "08"]}]
    seconds = (time.perf_counter() - start) / (len(RANK_WAYS) + 1)
    rows = []
    for key in [*RANK_WAYS, "08"]:
        what = RANK_WAYS[key][0] if key in RANK_WAYS else "SharedMemoryAllreduce (chapter 08)"
        verdicts = sorted({r[key] for r in results}, key=lambda v: not v.startswith("FAILED"))
        verdict = verdicts[0]  # a failure on any rank first
        rows.append((key.strip(), what, where, verdict, seconds))
    if backend == "gloo":
        rows.append(("07-11", "the same on nccl, one GPU per process", "-",
                     f"not run: needs {world_size} GPUs", 0.0))
    return rows


def run_checks(checks: list[Check]) -> list[tuple[str, str, str, str, float]]:
    """One row per check: (chapter, what, devices, result, seconds)."""
    rows = []
    for check in checks:
        start = time.perf_counter()
        try:
            where, result = check.run(), "ok"
        except Exception as error:  # noqa: BLE001 - reported in the table
            where, result = "-", f"FAILED: {type(error).__name__}: {error}"
        rows.append((check.chapter, check.what, where, result, time.perf_counter() - start))
    return rows


def print_table(rows: list[tuple[str, str, str, str, float]]) -> None:
    print(f"\n{'chapter':7s}  {'what ran':55s}  {'devices':28s}  {'seconds':>7s}  result")
    for chapter, what, where, result, seconds in rows:
        print(f"{chapter:7s}  {what:55s}  {where:28s}  {seconds:7.1f}  {result}")


def main() -> int:
    gpus = accelerators()
    print(f"Self-check on {len(gpus)} GPU{'s' if len(gpus) != 1 else ''}"
          + (f" ({torch.cuda.get_device_name(0)})" if gpus and gpus[0].type == "cuda" else "")
          + f", torch {torch.__version__}")
    rows = run_checks(LOCAL)
    if len(gpus) < 2:
        rows.append(("06", "nn.DataParallel on 2 real GPUs", "-", "not run: needs 2 GPUs", 0.0))
    rows += rank_rows()
    print_table(rows)
    failed = [r for r in rows if r[3].startswith("FAILED")]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} rows without failure"
          + (f"; {len(failed)} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
