"""Chapter 04: cutting a minibatch into one shard per device, and feeding minibatches."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import Dataset

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


class Transformed(Dataset):
    """Items of data with transform applied to each image as it is read: per-item CPU work
    that a DataLoader's worker processes can share out."""

    def __init__(self, data: Dataset, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.data, self.transform = data, transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        X, y = self.data[i]
        return self.transform(X), y
