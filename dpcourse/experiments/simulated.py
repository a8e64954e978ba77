"""Chapters 02-06: what the simulated devices' chapters measure in one process."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..collectives import get_params
from ..lenet import init_lenet_params, lenet, loss
from ..training import sgd, train_batch
from .timing import alternate, median_seconds

Step = Callable[[torch.Tensor, torch.Tensor], Any]


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
        medians = median_seconds(alternate({str(n): lambda n=n: step(n) for n in threads}, repeats))
    finally:
        torch.set_num_threads(before)
    return {int(n): t for n, t in medians.items()}


def plain_step(device: torch.device, lr: float = 0.1) -> Step:
    """Chapter 02's SGD step of LeNet (initial scale 0.1) on one device, as step(X, y); it
    returns the summed loss of the batch, as train_batch does."""
    params = get_params(init_lenet_params(0, scale=0.1), device)

    def step(X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        X, y = X.to(device), y.to(device)
        total = loss(lenet(X, params), y).sum()
        total.backward()
        sgd(params, lr, len(y))
        return total.detach()
    return step


def data_parallel_step(devs: list[torch.device], allreduce: Callable[[list[torch.Tensor]], Any],
                       lr: float = 0.1) -> Step:
    """train_batch of LeNet (initial scale 0.1) on devs with allreduce, as step(X, y)."""
    replicas = [get_params(init_lenet_params(0, scale=0.1), d) for d in devs]
    return lambda X, y: train_batch(X, y, replicas, devs, lr, allreduce)


def epoch_seconds(batches: list[tuple[torch.Tensor, torch.Tensor]], steps: dict[str, Step],
                  rounds: int = 3, *, warmup: int = 1,
                  devices: Sequence[torch.device] = ()) -> dict[str, float]:
    """Median seconds of one pass of each step over batches, the steps alternated round after
    round after warmup untimed passes each (timing.alternate; the GPUs in devices synchronised)."""
    passes = {name: (lambda step=step: [step(X, y) for X, y in batches])
              for name, step in steps.items()}
    return median_seconds(alternate(passes, rounds, warmup=warmup, devices=devices))
