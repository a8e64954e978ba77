"""Chapter 03: copying parameters to devices and summing gradients across them."""
from __future__ import annotations

import torch


def check_devices(devs: list[torch.device], what: str) -> None:
    """Raise a clear error if devs is empty."""
    if len(devs) == 0:
        raise ValueError(f"{what} needs at least one device, got an empty device list")


def check_collective(tensors: list[torch.Tensor], what: str) -> None:
    """Raise a clear error unless tensors is a non-empty list of same-shape, same-dtype,
    non-aliasing tensors."""
    if len(tensors) == 0:
        raise ValueError(f"{what} needs at least one tensor, got an empty list")
    first = tensors[0]
    for i, t in enumerate(tensors[1:], start=1):
        if t.shape != first.shape:
            raise ValueError(f"{what}: tensor {i} has shape {tuple(t.shape)} "
                             f"but tensor 0 has shape {tuple(first.shape)}")
        if t.dtype != first.dtype:
            raise TypeError(f"{what}: tensor {i} has dtype {t.dtype} "
                            f"but tensor 0 has dtype {first.dtype}")
    seen: dict[tuple[str, int], int] = {}
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        key = (str(t.device), t.data_ptr())
        if key in seen:
            raise ValueError(f"{what}: tensors {seen[key]} and {i} share memory; "
                             "each device needs its own copy (see get_params)")
        seen[key] = i


def get_params(params: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Independent copies of params on device that require grad (never the source itself)."""
    return [p.detach().to(device, copy=True).requires_grad_() for p in params]


def broadcast(tensor: torch.Tensor, devs: list[torch.device]) -> list[torch.Tensor]:
    """One independent copy of tensor per device."""
    check_devices(devs, "broadcast")
    return [tensor.detach().to(d, copy=True) for d in devs]


@torch.no_grad()
def allreduce(tensors: list[torch.Tensor]) -> list[int]:
    """Sum tensors in place: reduce onto the first, then copy the sum back to the others.

    Returns the number of elements each device sent: (k-1)*N for the first, N for the rest.
    """
    check_collective(tensors, "allreduce")
    first = tensors[0]
    for t in tensors[1:]:
        first.add_(t.to(first.device))
    for t in tensors[1:]:
        t.copy_(first)
    n, k = first.numel(), len(tensors)
    return [(k - 1) * n] + [n] * (k - 1)
