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


def split_batch(X: torch.Tensor, y: torch.Tensor, devs: list[torch.device]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Shards of X and y, one per device, with nn.DataParallel's sizes (torch.chunk on dim 0).

    A batch smaller than the device count gives fewer shards than devices.
    """
    check_devices(devs, "split_batch")
    check_batch(X, y)
    X_shards = [x.to(d) for x, d in zip(X.chunk(len(devs)), devs)]
    y_shards = [t.to(d) for t, d in zip(y.chunk(len(devs)), devs)]
    return X_shards, y_shards
