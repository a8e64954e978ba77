"""Benchmark: `python -m dpcourse.bench`. Every ratio compares timings taken side by side."""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from .collectives import allreduce, get_params
from .hardware import devices, synchronize
from .lenet import init_lenet_params, lenet, loss
from .ring import ring_allreduce
from .throughput import (bus_bandwidth, compare_allreduce, compare_ddp,
                         compare_processes_and_threads)
from .training import sgd, train_batch


def interleaved(cases: dict[str, Callable[[], None]], repeats: int,
                devs: list[torch.device]) -> dict[str, float]:
    """Median seconds per case, timing the cases round-robin so drifts hit all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            synchronize(devs)
            start = time.perf_counter()
            fn()
            synchronize(devs)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def forward_backward_seconds(threads: list[int], batch_size: int = 128,
                             repeats: int = 10) -> dict[int, float]:
    """Median seconds of LeNet's forward and backward pass on batch_size images on the CPU,
    for each number of threads (torch.set_num_threads), after a warm-up."""
    X, y = torch.rand(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    params = get_params(init_lenet_params(0, scale=0.1), torch.device("cpu"))

    def step(n: int) -> None:
        torch.set_num_threads(n)
        loss(lenet(X, params), y).sum().backward()

    before = torch.get_num_threads()
    try:
        medians = interleaved({str(n): lambda n=n: step(n) for n in threads}, repeats, [])
    finally:
        torch.set_num_threads(before)
    return {int(n): t for n, t in medians.items()}


def bench_train_batch(batch_size: int, repeats: int) -> None:
    X, y = torch.rand(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    params = init_lenet_params(0, scale=0.1)
    plain = get_params(params, torch.device("cpu"))

    def plain_step() -> None:
        loss(lenet(X, plain), y).sum().backward()
        sgd(plain, 0.2, batch_size)

    cases = {"plain step, 1 device": plain_step}
    for k in (1, 2, 4, 8):
        devs = devices(k, simulate=True)
        dp = [get_params(params, d) for d in devs]
        cases[f"train_batch, k={k}"] = (lambda dp=dp, devs=devs:
                                        train_batch(X, y, dp, devs, 0.2))
    result = interleaved(cases, repeats, [])
    base = result["plain step, 1 device"]
    print(f"\nOne SGD step of LeNet on a batch of {batch_size}, simulated CPU devices "
          f"(median of {repeats}):")
    for name, t in result.items():
        print(f"  {name:22s} {t * 1e3:8.1f} ms   x{t / base:.2f} of the plain step")


def bench_allreduce(repeats: int) -> None:
    lenet_grads = init_lenet_params(0)
    n_lenet = sum(p.numel() for p in lenet_grads)
    print(f"\nallreduce vs ring_allreduce in place on simulated CPU devices (median of {repeats});"
          "\n'busiest' is the most elements one device sends, as a multiple of the tensor size N:")
    print(f"  {'tensors':32s} {'k':>2s} {'naive ms':>9s} {'ring ms':>9s} {'ring/naive':>10s}"
          f" {'busiest naive':>14s} {'busiest ring':>13s}")
    for label, shapes in ((f"LeNet gradient ({n_lenet:,} floats)", [p.shape for p in lenet_grads]),
                          ("16 MiB tensor", [(4 * 2**20,)])):
        for k in (2, 4, 8):
            per_device = [[torch.randn(s) for s in shapes] for _ in range(k)]
            cases = {c.__name__: (lambda c=c: [c(list(ts)) for ts in zip(*per_device)])
                     for c in (allreduce, ring_allreduce)}
            r = interleaved(cases, repeats, [])
            naive, ring = r["allreduce"] * 1e3, r["ring_allreduce"] * 1e3
            n = sum(t.numel() for t in per_device[0])
            busiest = [max(map(sum, zip(*[c(list(ts)) for ts in zip(*per_device)]))) / n
                       for c in (allreduce, ring_allreduce)]
            print(f"  {label:32s} {k:2d} {naive:9.2f} {ring:9.2f} {ring / naive:10.2f}"
                  f" {busiest[0]:13.2f}N {busiest[1]:12.2f}N")


def verdict(ratio: float, target: float) -> str:
    """The ratio, the issue's target next to it, and whether it is met."""
    met = "meets target" if ratio >= target else "below target"
    return f"x{ratio:.2f} (target >= {target}x: {met})"


def bench_processes(repeats: int) -> None:
    """Chapter 07 on real processes (gloo over loopback), each comparison in one run."""
    rounds = max(3, repeats // 4)  # a training round takes seconds
    numel = 16 * 2**20
    print(f"\nChapter 07, separate processes (load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores: other work slows them unevenly)."
          f"\nAllreduce of 64 MiB of float32 (median of {repeats}), "
          "bus bandwidth 2(w-1)/w * bytes / s:")
    for world in (2, 4):
        seconds = compare_allreduce([numel], world_size=world, repeats=repeats, timeout=300)
        busbw = {name: bus_bandwidth(4 * numel, t[numel], world) / 1e9
                 for name, t in seconds.items()}
        ring, gloo = busbw["p2p.ring_allreduce"], busbw["dist.all_reduce"]
        print(f"  {world} processes: gloo {gloo:.2f} GB/s, p2p.ring_allreduce {ring:.2f} GB/s, "
              f"p2p.allreduce {busbw['p2p.allreduce']:.2f} GB/s; "
              f"ring/gloo {verdict(ring / gloo, 0.9)}")
    steps = 30
    ddp = compare_ddp(steps=steps, repeats=rounds, timeout=300)
    print(f"LeNet training, 2 processes x 128 images, {steps} steps (median of {rounds} "
          "rounds): " + ", ".join(f"{name} {rate:.0f} images/s" for name, rate in ddp.items()))
    print(f"  ScratchDDP/torch DDP {verdict(ddp['ScratchDDP'] / ddp['torch DDP'], 0.95)}; "
          f"with our ring x{ddp['ScratchDDP, ring'] / ddp['torch DDP']:.2f}")
    pt = compare_processes_and_threads(steps=steps, repeats=rounds, timeout=300)
    threads, processes = pt["1 process x 2 threads"], pt["2 processes x 1 thread"]
    print(f"LeNet training, 256 images per step, {steps} steps (median of {rounds} rounds): "
          f"1 process x 2 threads {threads:.0f} images/s, 2 processes x 1 thread (torch DDP) "
          f"{processes:.0f} images/s")
    print(f"  2 processes / 1 process {verdict(processes / threads, 1.3)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    threads = sorted({1, torch.get_num_threads()})
    times = forward_backward_seconds(threads, repeats=args.repeats)
    print("\nLeNet forward and backward on 128 images (median): "
          + ", ".join(f"{n} thread(s) {t * 1e3:.1f} ms" for n, t in times.items()))
    bench_train_batch(args.batch_size, args.repeats)
    bench_allreduce(args.repeats)
    bench_processes(args.repeats)


if __name__ == "__main__":
    main()
