"""Chapter 00: which devices the course runs on, real or simulated."""
from __future__ import annotations

import time

import torch


def accelerators() -> list[torch.device]:
    """The real accelerators of this machine: every CUDA GPU, else Apple's MPS, else none."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        return [torch.device("mps")]
    return []


def devices(n: int | None = None, *, simulate: bool = False) -> list[torch.device]:
    """n real accelerators if there are that many, else n simulated ones, announced: the
    accelerators round-robin, or cpu:0, cpu:1, ... (always these with simulate=True)."""
    real = [] if simulate else accelerators()
    if n is None:
        return real or [torch.device("cpu")]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:  # a bool is an int too
        raise ValueError(f"devices(n) needs a whole number n >= 1, got {n!r}")
    if len(real) >= n:
        return real[:n]
    if n == 1 and not simulate:
        return [torch.device("cpu")]  # one device is no simulation: it is the CPU itself
    requested = f"{n} device{'s' if n > 1 else ''} requested"
    if real:
        gpus = f"{len(real)} {'GPU' if real[0].type == 'cuda' else real[0].type.upper()}"
        print(f"{requested}, {gpus}{'s' if len(real) > 1 else ''}: simulating {n} devices "
              f"round-robin on {', '.join(map(str, real))}")
        return [real[i % len(real)] for i in range(n)]
    reason = "simulation requested" if simulate else "0 GPUs"
    print(f"{requested}, {reason}: simulating {n} device{'s' if n > 1 else ''} on the CPU")
    return [torch.device("cpu", i) for i in range(n)]


def synchronize(devs: list[torch.device]) -> None:
    """Wait until every queued kernel on devs has finished (a no-op on the CPU)."""
    for d in devs:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
        elif d.type == "mps":
            torch.mps.synchronize()


class Timer:
    """Wall-clock timer that synchronises devs before reading the clock."""

    def __init__(self, devs: list[torch.device] | None = None) -> None:
        self.devs = devs or []
        self.times: list[float] = []

    def __enter__(self) -> "Timer":
        synchronize(self.devs)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.devs)
        self.times.append(time.perf_counter() - self._start)
