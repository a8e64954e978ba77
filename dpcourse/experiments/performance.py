"""Chapter 08: where the time of data-parallel training goes, measured across processes.

As in ``throughput`` (chapter 07), each driver runs in the parent and starts the ranks with
``launch``; the ``*_on_rank`` functions are what every rank runs (top-level, so that a
new process can import them). The variants compared in one launch are timed in
alternation, a barrier before each, and each figure is the median over the rounds of the
slowest rank's time (the allreduce sweep keeps every call: see per_size). Every rank runs
one intra-op thread (``launch``'s default).
"""
from __future__ import annotations

import statistics
import time
from contextlib import ExitStack, nullcontext
from functools import partial
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..cost_model import fit_alpha_beta, relative_errors
from ..ddp import ScratchDDP
from ..launch import launch, rank_device
from ..lenet import lenet_model
from ..resnet import resnet18
from ..shm import SharedMemoryAllreduce
from ..shm_steps import SHM_STEPS
from .throughput import (ALLREDUCES, LR, WARMUP_STEPS, bus_bandwidth, random_batch,
                         round_robin_samples, train_step_fn)
from .timing import alternate, median_seconds, repeat, slowest_rank

MIB = 2**20
SWEEP_NUMELS = [4**k * 1024 for k in range(8)]  # float32: 4 KiB, 16 KiB, ..., 64 MiB
MEMCPY = "memcpy"
FIT_FROM, FIT_TO = 64 * 2**10, 64 * 2**20  # bytes: the range the fits' 30% goal covers


# Allreduces built collectively on every rank: name -> a factory of a context manager with an
# .allreduce(tensor) method, called with no argument (SharedMemoryAllreduce: default buffer),
# and the steps that lead to it (chapter 08, section 2; swept only when named).
RANK_ALLREDUCES: dict[str, Callable[[], ContextManager]] = {"shm": SharedMemoryAllreduce,
                                                             **SHM_STEPS}


# --- allreduce latency and bus bandwidth, next to the copy bound -----------------------------

def allreduce_sweep_on_rank(numels: list[int], repeats: int,
                            names: list[str]) -> dict[str, dict[int, list[float]]]:
    """round_robin_samples of the named allreduces and of "memcpy" (x.copy_ of as many bytes
    from another tensor, every rank at once)."""
    source = torch.ones(max(numels, default=0), device=rank_device())
    with ExitStack() as built:  # closed on every rank, also when a case raises
        cases = {name: ALLREDUCES[name] if name in ALLREDUCES
                 else built.enter_context(RANK_ALLREDUCES[name]()).allreduce for name in names}
        cases[MEMCPY] = lambda x: x.copy_(source[:x.numel()])
        return round_robin_samples(cases, numels, repeats)


def allreduce_sweep(numels: Sequence[int] = SWEEP_NUMELS[:6], world_size: int = 2,
                    repeats: int = 3, timeout: float = 120.0, names: Sequence[str] | None = None,
                    backend: str = "gloo") -> dict[str, dict[int, list[float]]]:
    """Seconds of every call (the slowest rank's) of each named allreduce on float32 tensors
    of each numel, and of "memcpy": a Tensor.copy_ of the same bytes on every rank at once.

    names: from ALLREDUCES ("dist.all_reduce" is the backend's own) and RANK_ALLREDUCES; by
    default ALLREDUCES and "shm" under gloo, ALLREDUCES under nccl (tensors on each rank's
    GPU). One launch of world_size processes; per_size gives one figure per size.
    """
    if names is None:
        names = [*ALLREDUCES, "shm"] if backend == "gloo" else [*ALLREDUCES]
    unknown = [n for n in names if n not in ALLREDUCES and n not in RANK_ALLREDUCES]
    if unknown:
        raise ValueError(f"unknown allreduce(s) {unknown}: choose from "
                         f"{[*ALLREDUCES, *RANK_ALLREDUCES]}")
    return launch(allreduce_sweep_on_rank, list(numels), repeats, list(names),
                  world_size=world_size, backend=backend, timeout=timeout)[0]


STATISTICS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}


def per_size(samples: dict[str, dict[int, list[float]]],
             statistic: str = "min") -> dict[str, dict[int, float]]:
    """One figure per allreduce and size: "min", the fastest call (timeit's convention: what
    the algorithm costs, the slower calls add interference), or "median" (a typical call)."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {tuple(STATISTICS)}, got {statistic!r}")
    return {name: {n: STATISTICS[statistic](ts) for n, ts in by_numel.items()}
            for name, by_numel in samples.items()}


def copy_bound_busbw(nbytes: int, copy_seconds: float) -> float:
    """The bus bandwidth no copy-based allreduce can pass: nbytes / copy_seconds.

    Each rank must read the other ranks' parts of its share ((w-1)/w * nbytes) and receive
    the other shares' sums (as many): 2(w-1)/w * nbytes. Copied at nbytes / copy_seconds (the
    rate when every rank copies at once), that takes 2(w-1)/w * copy_seconds at least, so
    busbw = 2(w-1)/w * nbytes / seconds <= nbytes / copy_seconds.
    """
    return nbytes / copy_seconds


def memcpy_bound(nbytes: int = 64 * MIB, world_size: int = 2, repeats: int = 5,
                 timeout: float = 60.0) -> float:
    """Bus-bandwidth bound (bytes/s) from world_size processes each copying nbytes (float32)
    with Tensor.copy_ at the same time, barrier-synchronised; the fastest of the repeats (each
    the slowest rank's time)."""
    numel = nbytes // 4
    seconds = launch(allreduce_sweep_on_rank, [numel], repeats, [], world_size=world_size,
                     backend="gloo", timeout=timeout)[0][MEMCPY][numel]
    return copy_bound_busbw(4 * numel, min(seconds))


def sweep_busbw(seconds: dict[str, dict[int, float]], world_size: int) -> dict[str, dict]:
    """The sweep's seconds (per_size) as bus bandwidth (bytes/s): nccl-tests' convention for the
    allreduces, copy_bound_busbw for "memcpy"."""
    return {name: {n: copy_bound_busbw(4 * n, t) if name == MEMCPY
                   else bus_bandwidth(4 * n, t, world_size) for n, t in by_numel.items()}
            for name, by_numel in seconds.items()}


# --- models and their fixed random batches ---------------------------------------------------

def resnet18_model() -> nn.Module:
    """d2l's ResNet-18 (11.2 M parameters, the same on every rank: seed 0)."""
    torch.manual_seed(0)
    return resnet18()


# name -> (model factory, image side): ResNet-18 on 8x8 images keeps its parameters (and so
# its gradients) while its steps stay short on one core.
MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "lenet": (lenet_model, 28), "resnet18": (resnet18_model, 8)}


def model_batch(model: str, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random one-channel images of the model's side and labels 0-9."""
    return random_batch(batch_size, seed, side=MODELS[model][1])


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of the gradients DDP averages: every trainable parameter's."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


# --- anatomy of a ScratchDDP step ------------------------------------------------------------

def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of the (start, end) intervals: time with at least one in flight."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def anatomy_on_rank(model: str, steps: int, batch_size: int,
                    bucket_cap_mb: float) -> dict[str, object]:
    """Per round: an iteration inside no_sync() (forward, backward), then a synchronised one
    (forward, backward, optimizer step); a barrier before each forward and each backward.
    Medians over steps rounds, after warm-up rounds, of the slowest rank's times."""
    ddp = ScratchDDP(MODELS[model][0](), bucket_cap_mb)
    X, y = model_batch(model, batch_size, seed=dist.get_rank())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    samples: dict[str, list[float]] = {}
    timeline: list[tuple[int, float, float]] = []

    def iteration(sync: bool) -> dict[str, float]:
        nonlocal timeline
        opt.zero_grad()
        with nullcontext() if sync else ddp.no_sync():
            dist.barrier()
            t0 = time.perf_counter()
            loss = nn.functional.cross_entropy(ddp(X), y)
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
        if not sync:
            return {"forward_no_sync": t1 - t0, "backward_no_sync": t3 - t2}
        opt.step()
        t4 = time.perf_counter()
        timeline = [(i, a - t2, b - t2) for i, a, b in ddp.timeline()]
        return {"forward": t1 - t0, "backward_sync": t3 - t2, "optimizer": t4 - t3,
                "comm": busy_seconds([(a, b) for _, a, b in timeline])}

    for _ in range(WARMUP_STEPS):
        iteration(False)
        iteration(True)
    for _ in range(steps):
        for phase, seconds in {**iteration(False), **iteration(True)}.items():
            samples.setdefault(phase, []).append(seconds)
    slowest = iter(slowest_rank([t for ts in samples.values() for t in ts]))  # one collective
    median = {phase: statistics.median([next(slowest) for _ in ts])
              for phase, ts in samples.items()}
    return {"phases": median, "timeline": timeline, "buckets": len(ddp.buckets),
            "bucket_bytes": [sum(p.numel() * p.element_size() for p in b.params)
                             for b in ddp.buckets],
            "gradient_bytes": gradient_bytes(ddp.module)}


def step_anatomy(steps: int = 10, batch_size: int = 64, bucket_cap_mb: float = 25.0,
                 world_size: int = 2, model: str = "lenet",
                 timeout: float = 120.0) -> dict[str, object]:
    """A ScratchDDP training step of model ("lenet" or "resnet18") split into its parts, on
    world_size processes of batch_size images each (seconds, medians of the slowest rank):

    - forward_s: forward and loss of the synchronised iteration (with the re-broadcast of
      buffers, if the model has any); optimizer_s: SGD's step;
    - backward_no_sync_s: backward inside no_sync(), i.e. computation alone;
    - backward_sync_s: backward that also averages the gradients, from its start until
      every bucket is written back (what DDP's backward costs);
    - comm_s: time during which at least one bucket's allreduce was in flight (timeline());
    - exposed_comm_s: backward_sync_s - backward_no_sync_s, floored at 0: the communication
      backward could not hide; hidden_comm_s: comm_s - exposed_comm_s, floored at 0;
    - overlap: hidden_comm_s / comm_s, within [0, 1] (1: all communication hidden).

    Also "timeline": (bucket, launched, finished) of rank 0's last synchronised backward, in
    seconds from its start; "buckets"; "bucket_bytes" (each bucket's, in launch order);
    "gradient_bytes".
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {tuple(MODELS)}, got {model!r}")
    r = launch(anatomy_on_rank, model, steps, batch_size, bucket_cap_mb,
               world_size=world_size, backend="gloo", timeout=timeout)[0]
    p = r["phases"]
    exposed = max(0.0, p["backward_sync"] - p["backward_no_sync"])
    hidden = max(0.0, p["comm"] - exposed)
    return {"forward_s": p["forward"], "backward_no_sync_s": p["backward_no_sync"],
            "backward_sync_s": p["backward_sync"], "optimizer_s": p["optimizer"],
            "comm_s": p["comm"], "exposed_comm_s": exposed, "hidden_comm_s": hidden,
            "overlap": min(1.0, hidden / p["comm"]) if p["comm"] > 0 else 0.0,
            "timeline": r["timeline"], "buckets": r["buckets"], "bucket_bytes": r["bucket_bytes"],
            "gradient_bytes": r["gradient_bytes"]}


# --- bucket sizes ----------------------------------------------------------------------------

def bucket_sweep_on_rank(caps_mb: list[float], steps: int, batch_size: int,
                         repeats: int) -> dict[str, object]:
    """Seconds per training step of ResNet-18 under ScratchDDP with each bucket cap (one
    wrapper per cap around the same module, caps alternated in repeats rounds of steps
    steps), and the median backward inside no_sync(); the slowest rank's times."""
    net = MODELS["resnet18"][0]()
    wrappers = {cap: ScratchDDP(net, cap, broadcast_buffers=False) for cap in caps_mb}
    X, y = model_batch("resnet18", batch_size, seed=dist.get_rank())
    opt = torch.optim.SGD(net.parameters(), lr=LR)

    def step(ddp: ScratchDDP) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(X), y).backward()
        opt.step()

    pending: dict[str, torch.Tensor] = {}

    def forward_no_sync() -> None:
        opt.zero_grad()
        with wrappers[caps_mb[0]].no_sync():
            pending["loss"] = nn.functional.cross_entropy(wrappers[caps_mb[0]](X), y)

    for ddp in wrappers.values():  # one warm-up step each: the module is warm after the first
        step(ddp)
    per_step = median_seconds(alternate({cap: repeat(partial(step, wrappers[cap]), steps)
                                         for cap in caps_mb}, repeats, warmup=0))
    backward = median_seconds(alternate({"backward": lambda: pending.pop("loss").backward()},
                                        repeats, warmup=0, before=forward_no_sync))
    return {"step_seconds": {cap: t / steps for cap, t in per_step.items()},
            "backward_seconds": backward["backward"],
            "buckets": {cap: len(w.buckets) for cap, w in wrappers.items()},
            "bucket_bytes": {cap: [sum(p.numel() * p.element_size() for p in b.params)
                                   for b in w.buckets] for cap, w in wrappers.items()},
            "gradient_bytes": gradient_bytes(net)}


def bucket_sweep(caps_mb: Sequence[float] = (1 / 1024, 1 / 16, 4.0, 64.0), steps: int = 2,
                 batch_size: int = 16, world_size: int = 2, repeats: int = 2,
                 timeout: float = 120.0) -> dict[str, object]:
    """Seconds per ScratchDDP training step for each bucket cap (MiB), one launch.

    The model is ResNet-18 on 8x8 images: 43 MiB of gradients in 76 tensors of 40 B to 9 MiB,
    so caps from 1 KiB to 64 MiB give from dozens of buckets down to one, while tiny images
    keep a step short (LeNet's 0.49 MiB of gradients make one bucket from a 0.5 MiB cap).
    Returns "step_seconds" {cap: s}, "backward_seconds" (backward inside no_sync(), the
    input the bucket model needs), "buckets" {cap: count}, "bucket_bytes" {cap: [bytes of
    each bucket, in the order backward fills them]} and "gradient_bytes".
    Buffers are not re-broadcast, so only the buckets differ.
    """
    return launch(bucket_sweep_on_rank, list(caps_mb), steps, batch_size, repeats,
                  world_size=world_size, backend="gloo", timeout=timeout)[0]


# --- strong and weak scaling -----------------------------------------------------------------

def scaling_on_rank(per_rank_batches: dict[str, int], steps: int,
                    repeats: int) -> dict[str, float]:
    """Global images/s of LeNet training with torch's DDP for each mode's per-rank batch, the
    modes alternated in repeats rounds of steps steps (median), after a warm-up."""
    model = nn.parallel.DistributedDataParallel(lenet_model())
    train = {mode: train_step_fn(model, b, seed=dist.get_rank())
             for mode, b in per_rank_batches.items()}
    for step in train.values():
        for _ in range(WARMUP_STEPS):
            step()
    seconds = median_seconds(alternate({mode: repeat(step, steps) for mode, step in train.items()},
                                       repeats, warmup=0))
    world = dist.get_world_size()
    return {mode: world * per_rank_batches[mode] * steps / t for mode, t in seconds.items()}


def scaling(worlds: tuple[int, ...] = (1, 2, 4), modes: tuple[str, ...] = ("strong", "weak"),
            steps: int = 5, batch_size: int = 64, repeats: int = 2,
            timeout: float = 120.0) -> dict[str, dict[str, dict[int, float]]]:
    """LeNet training with torch's DDP on each number of processes, for each mode:
    {mode: {"images_per_s": {world: global images/s}, "efficiency": {world: ratio}}}.

    strong: batch_size images per step in all, split over the ranks; efficiency = speedup over
    1 process / world. weak: batch_size images per rank; efficiency = images/s per rank over
    1 process's. (Without 1 in worlds, the smallest world given stands for 1 process.) One
    launch per world size (a process group's size is fixed when it is made), both modes
    alternated inside it. Each rank runs one thread: 4 processes on a 2-core
    machine oversubscribe it, two per core.
    """
    for mode in modes:
        if mode not in ("strong", "weak"):
            raise ValueError(f"modes must be 'strong' or 'weak', got {mode!r}")
    bad = [w for w in worlds if batch_size % w]
    if "strong" in modes and bad:
        raise ValueError(f"strong scaling splits batch_size={batch_size} evenly: not over {bad}")
    rates = {}
    for w in worlds:
        per_rank = {mode: batch_size // w if mode == "strong" else batch_size for mode in modes}
        rates[w] = launch(scaling_on_rank, per_rank, steps, repeats, world_size=w,
                          backend="gloo", timeout=timeout)[0]
    base = min(worlds)
    return {mode: {"images_per_s": {w: rates[w][mode] for w in worlds},
                   "efficiency": {w: rates[w][mode] / rates[base][mode] * base / w
                                  for w in worlds}}
            for mode in modes}


# --- reading the sweep ------------------------------------------------------------------------

def size_label(nbytes: float) -> str:
    """4096 -> '4 KiB', 1.5 * 2**20 -> '1.5 MiB' (3 significant digits, or whole units)."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10), ("B", 1)):
        if nbytes >= scale or unit == "B":
            value = nbytes / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"


def fit_allreduces(seconds: dict[str, dict[int, float]]) -> dict[str, dict[str, float]]:
    """alpha, beta fitted to each allreduce's times from FIT_FROM to FIT_TO bytes, and the
    worst relative error of the fit over that range."""
    fits = {}
    for name, by_numel in seconds.items():
        points = [(4 * n, t) for n, t in by_numel.items() if FIT_FROM <= 4 * n <= FIT_TO]
        if name == MEMCPY or len({b for b, _ in points}) < 2:
            continue
        nbytes, ts = zip(*points)
        cost = fit_alpha_beta(nbytes, ts)
        worst = max(abs(e) for e in relative_errors(cost, nbytes, ts))
        fits[name] = {"alpha": cost.alpha, "beta": cost.beta, "worst_relative_error": worst}
    return fits
