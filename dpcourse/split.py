"""Chapter 04: cutting a minibatch into one shard per device."""
from __future__ import annotations

import torch

from .collectives import check_devices


def check_batch(X: torch.Tensor, y: torch.Tensor) -> None:
    """Raise a clear error if X and y differ in length or the batch is empty."""
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} examples but y has {y.shape[0]}: "
                         "they must have the same length")
    if X.shape[0] == 0:
        raise ValueError("empty batch: X and y have no examples")


def scatter(t: torch.Tensor, devs: list[torch.device]) -> list[torch.Tensor]:
    """Chunks of t along dim 0, one per device in order (torch.chunk, as nn.parallel.scatter)."""
    return [chunk.to(d) for chunk, d in zip(t.chunk(len(devs)), devs)]


def split_batch(X: torch.Tensor, y: torch.Tensor, devs: list[torch.device]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Shards of X and y, one per device, with nn.DataParallel's sizes (torch.chunk on dim 0).

    A batch smaller than the device count gives fewer shards than devices.
    """
    check_devices(devs, "split_batch")
    check_batch(X, y)
    return scatter(X, devs), scatter(y, devs)
