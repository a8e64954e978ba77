"""One way to time what the chapters compare: the cases alternated, round after round.

A drift in the machine's load (another program, a frequency change) then hits every case
alike, and each figure is a median over the rounds. Under a process group every timed call
starts from a barrier and counts as long as its slowest rank took: a collective is done when
its last rank is.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable, Sequence

import torch
import torch.distributed as dist

from ..hardware import synchronize


def alternate(cases: dict[Hashable, Callable[[], object]], rounds: int, *, warmup: int = 1,
              before: Callable[[], object] | None = None,
              devices: Sequence[torch.device] = ()) -> dict[Hashable, list[float]]:
    """Seconds of each call of each case: warmup untimed calls of each, then rounds rounds in
    which every case runs once, in order. before() runs, untimed, before every call;
    the GPUs in devices are synchronised around it; under a process group a barrier starts
    each call and each time is the slowest rank's."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for fn in cases.values():
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
    grouped = dist.is_available() and dist.is_initialized()
    seconds = []
    for _ in range(rounds):
        for fn in cases.values():
            if before is not None:
                before()
            synchronize(list(devices))
            if grouped:
                dist.barrier()
            start = time.perf_counter()
            fn()
            synchronize(list(devices))
            seconds.append(time.perf_counter() - start)
    if grouped:
        seconds = slowest_rank(seconds)
    calls = iter(seconds)
    samples: dict[Hashable, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name in cases:
            samples[name].append(next(calls))
    return samples


def repeat(fn: Callable[[], object], times: int) -> Callable[[], None]:
    """A case that calls fn times times (for example: steps training steps)."""
    def repeated() -> None:
        for _ in range(times):
            fn()
    return repeated


def median_seconds(samples: dict[Hashable, list[float]]) -> dict[Hashable, float]:
    """The median of each case's samples (alternate's result)."""
    return {name: statistics.median(ts) for name, ts in samples.items()}


def slowest_rank(seconds: list[float]) -> list[float]:
    """Each of this rank's timings replaced by the largest any rank measured (a collective).

    A collective is done when its last rank is done; every rank left the barrier before it
    at about the same moment, so the slowest rank's time is the collective's time.
    """
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
