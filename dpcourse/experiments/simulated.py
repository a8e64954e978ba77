"""Chapters 02-06: what the simulated devices' chapters measure in one process."""
from __future__ import annotations

import torch

from ..collectives import get_params
from ..lenet import init_lenet_params, lenet, loss
from .timing import alternate, median_seconds


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
