"""Chapter 07: how fast many processes go - allreduce bandwidth and training throughput.

Each ``compare_*`` driver runs in the parent (a notebook cell, the benchmark) and starts the
ranks with ``launch``; the ``*_on_rank`` functions are what every rank runs (top-level, so
that a new process can import them). Inside one launch the variants being compared are
timed with ``timing.alternate``; each figure is a median over the rounds.

The CPU comparisons use gloo on every host; ``gpu_scaling`` compares 1 GPU with k (nccl).
``busy_processes`` loads the cores meanwhile, to compare them beside other work.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .. import p2p
from ..comm_hooks import HelperThread, ring_hook
from ..ddp import ScratchDDP
from ..launch import launch, rank_device
from ..lenet import lenet_model
from ..shm import ShmHookState, shm_hook
from .timing import alternate, median_seconds, repeat

ALLREDUCES: dict[str, Callable[[torch.Tensor], object]] = {
    "dist.all_reduce": dist.all_reduce,
    "p2p.allreduce": p2p.allreduce,
    "p2p.ring_allreduce": p2p.ring_allreduce,
}
DDP_VARIANTS = ("ScratchDDP", "ScratchDDP, ring", "ScratchDDP, shm", "torch DDP")
NO_ALLREDUCE = "no allreduce"  # each rank trains alone: the most any allreduce can reach
WARMUP_STEPS = 3
LR = 0.05


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """Bytes per second an allreduce of nbytes in seconds moved on each rank's busiest link:
    2(w-1)/w * nbytes / seconds, the convention of NCCL's tests (comparable across w)."""
    return 2 * (world_size - 1) / world_size * nbytes / seconds


# A Python loop that keeps a core busy as long as its parent, whose pid it is given, lives.
BUSY_LOOP = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    pass\n"


@contextmanager
def busy_processes(n: int) -> Iterator[list[int]]:
    """Inside, n more processes each keep a core busy (their pids are given); all are ended
    on the way out, and each ends by itself if this process dies first."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"busy_processes needs a whole number n >= 0, got {n!r}")
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())],
                                          stdin=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


# --- allreduce: dist.all_reduce, p2p.allreduce, p2p.ring_allreduce ---------------------------

def round_robin_samples(cases: dict[str, Callable[[torch.Tensor], object]], numels: list[int],
                        repeats: int) -> dict[str, dict[int, list[float]]]:
    """Seconds of each of repeats calls of each case on a float32 tensor of each numel (on
    this rank's device, filled with 1 before each call, untimed: the sum stays small), the
    cases alternated after one warm-up call each (timing.alternate: each call's time is the
    slowest rank's)."""
    device = rank_device()
    samples: dict[str, dict[int, list[float]]] = {name: {} for name in cases}
    for n in numels:
        x = torch.empty(n, device=device)
        timed = alternate({name: partial(fn, x) for name, fn in cases.items()}, repeats,
                          before=partial(x.fill_, 1.0), devices=[device])
        for name, seconds in timed.items():
            samples[name][n] = seconds
    return samples


def round_robin_seconds(cases: dict[str, Callable[[torch.Tensor], object]], numels: list[int],
                        repeats: int) -> dict[str, dict[int, float]]:
    """The median of round_robin_samples for each case and numel."""
    return {name: median_seconds(by_numel)
            for name, by_numel in round_robin_samples(cases, numels, repeats).items()}


def allreduce_seconds_on_rank(numels: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """round_robin_seconds of the three allreduces of chapter 07."""
    return round_robin_seconds(ALLREDUCES, numels, repeats)


def compare_allreduce(numels: list[int], world_size: int = 2, repeats: int = 5,
                      timeout: float = 120.0) -> dict[str, dict[int, float]]:
    """Median seconds per call of "dist.all_reduce", "p2p.allreduce" and "p2p.ring_allreduce"
    on float32 tensors of each numel, on world_size processes, measured in one launch."""
    return launch(allreduce_seconds_on_rank, list(numels), repeats, world_size=world_size,
                  backend="gloo", timeout=timeout)[0]


# --- DDP: ScratchDDP (gloo's all_reduce or our ring) against torch's DDP ---------------------

def random_batch(batch_size: int, seed: int, device: torch.device = torch.device("cpu"),
                 side: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random one-channel images (LeNet's 28 x 28 by default) and labels 0-9, on device."""
    g = torch.Generator().manual_seed(seed)
    X, y = (torch.rand(batch_size, 1, side, side, generator=g),
            torch.randint(0, 10, (batch_size,), generator=g))
    return X.to(device), y.to(device)


def train_step_fn(model: nn.Module, batch_size: int, seed: int,
                  device: torch.device = torch.device("cpu")) -> Callable[[], None]:
    """One SGD step of model on its own fixed random batch (on device), mean cross-entropy."""
    X, y = random_batch(batch_size, seed, device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return step


def ddp_model(variant: str, hooks: ExitStack) -> nn.Module:
    """LeNet wrapped in the named DDP variant (NO_ALLREDUCE: not wrapped); the state of its
    comm hook, if any, is closed with hooks."""
    net = lenet_model()
    if variant == NO_ALLREDUCE:
        return net
    if variant == "torch DDP":
        return nn.parallel.DistributedDataParallel(net)
    ddp = ScratchDDP(net)
    if variant == "ScratchDDP, ring":
        ddp.register_comm_hook(hooks.enter_context(HelperThread()), ring_hook)
    elif variant == "ScratchDDP, shm":
        ddp.register_comm_hook(hooks.enter_context(ShmHookState()), shm_hook)
    return ddp


def ddp_images_per_second_on_rank(steps: int, batch_size: int, repeats: int,
                                  variants: tuple[str, ...] = DDP_VARIANTS) -> dict[str, float]:
    """Global images/s of LeNet training with each variant, the variants alternated in
    repeats rounds of steps steps (median), after a warm-up; the slowest rank's time."""
    world = dist.get_world_size()
    with ExitStack() as hooks:
        train = {v: train_step_fn(ddp_model(v, hooks), batch_size, seed=dist.get_rank())
                 for v in variants}
        for step in train.values():
            for _ in range(WARMUP_STEPS):
                step()
        seconds = median_seconds(alternate({v: repeat(train[v], steps) for v in variants},
                                           repeats, warmup=0))
    return {v: world * batch_size * steps / t for v, t in seconds.items()}


def compare_ddp(steps: int = 20, batch_size: int = 128, world_size: int = 2, repeats: int = 3,
                timeout: float = 120.0,
                variants: tuple[str, ...] = DDP_VARIANTS) -> dict[str, float]:
    """LeNet training images/s (global: world_size * batch_size per step) with each of
    variants: by default "ScratchDDP", "ScratchDDP, ring", "ScratchDDP, shm" (chapter 08's
    shared-memory allreduce) and "torch DDP"; also NO_ALLREDUCE, every rank training alone.
    Measured in one launch of world_size processes."""
    unknown = [v for v in variants if v not in (*DDP_VARIANTS, NO_ALLREDUCE)]
    if unknown or not variants:
        raise ValueError(f"variants must be some of {(*DDP_VARIANTS, NO_ALLREDUCE)}, got "
                         f"{tuple(variants)}")
    return launch(ddp_images_per_second_on_rank, steps, batch_size, repeats, tuple(variants),
                  world_size=world_size, backend="gloo", timeout=timeout)[0]


def gpu_images_per_second_on_rank(steps: int, batch_size: int) -> float:
    """Global images/s of LeNet training with torch's DDP on this rank's GPU, after a warm-up;
    the slowest rank's time, with the GPU's queue drained before the clock stops."""
    device = rank_device()
    net = lenet_model().to(device)
    step = train_step_fn(nn.parallel.DistributedDataParallel(net, device_ids=[device.index]),
                         batch_size, seed=dist.get_rank(), device=device)
    for _ in range(WARMUP_STEPS):
        step()

    def step_and_wait() -> None:
        step()
        torch.cuda.synchronize(device)
    [seconds] = alternate({"DDP": repeat(step_and_wait, steps)}, 1, warmup=0)["DDP"]
    return dist.get_world_size() * batch_size * steps / seconds


def gpu_scaling(steps: int = 50, batch_size: int = 128, timeout: float = 120.0) -> dict[str, float]:
    """LeNet images/s with torch's DDP on 1 GPU and on every GPU of this host (nccl, one
    process per GPU, batch_size images per GPU)."""
    k = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if k < 1:
        raise RuntimeError("gpu_scaling needs at least one GPU; this host has none")
    return {f"{w} GPU{'s' if w > 1 else ''}": launch(
                gpu_images_per_second_on_rank, steps, batch_size, world_size=w, backend="nccl",
                timeout=timeout)[0] for w in sorted({1, k})}


# --- processes against threads ---------------------------------------------------------------

def processes_and_threads_on_rank(steps: int, global_batch: int,
                                  repeats: int) -> dict[str, float]:
    """Global images/s of LeNet training, alternately: rank 0 alone on global_batch images
    with 1, then 2 threads while rank 1 sleeps in a barrier; then both ranks on
    global_batch/2 images each, 1 thread each: with no communication at all (the bound),
    with torch's DDP, and with ScratchDDP over shared memory; repeats rounds (median), after
    a warm-up."""
    rank = dist.get_rank()
    alone = train_step_fn(lenet_model(), global_batch, seed=0)
    with ExitStack() as hooks:
        together = {name: train_step_fn(ddp_model(variant, hooks), global_batch // 2, seed=rank)
                    for name, variant in (("2 processes x 1 thread, no allreduce", NO_ALLREDUCE),
                                          ("2 processes x 1 thread", "torch DDP"),
                                          ("2 processes x 1 thread, shm", "ScratchDDP, shm"))}

        def one_process(threads: int, n: int) -> None:  # rank 1 waits in the next barrier
            torch.set_num_threads(threads)
            repeat(alone, n if rank == 0 else 0)()
            torch.set_num_threads(1)

        def together_steps(step: Callable[[], None], n: int) -> None:
            repeat(step, n)()

        cases = {"1 process x 1 thread": partial(one_process, 1),
                 "1 process x 2 threads": partial(one_process, 2),
                 **{name: partial(together_steps, step) for name, step in together.items()}}
        for case in cases.values():
            case(WARMUP_STEPS)
        seconds = median_seconds(alternate({name: partial(case, steps)
                                            for name, case in cases.items()}, repeats, warmup=0))
        return {name: global_batch * steps / t for name, t in seconds.items()}


def compare_processes_and_threads(steps: int = 20, global_batch: int = 256, repeats: int = 3,
                                  timeout: float = 120.0) -> dict[str, float]:
    """LeNet images/s, measured in one launch of 2 processes, alternated in repeats rounds
    (median): "1 process x 1 thread" and "1 process x 2 threads" (global_batch images per
    step) against 2 processes x 1 thread (global_batch/2 images each): "..., no allreduce"
    (each trains alone: the most processes can give), "2 processes x 1 thread" (torch's DDP)
    and "..., shm" (ScratchDDP with chapter 08's shared-memory allreduce).

    One launch rather than one per configuration: starting processes takes seconds, and
    rounds within one launch compare them under the same machine load. While rank 0
    trains alone, rank 1 sleeps in a barrier and uses no core.
    """
    if global_batch < 2 or global_batch % 2:
        raise ValueError(f"global_batch must be even and >= 2, got {global_batch}")
    return launch(processes_and_threads_on_rank, steps, global_batch, repeats, world_size=2,
                  threads=1, backend="gloo", timeout=timeout)[0]
