"""Chapter 03: the bandwidth-optimal ring allreduce (reduce-scatter, then all-gather)."""
from __future__ import annotations

import torch

from .collectives import check_collective

Transfer = tuple[int, int, int]  # (sending device, receiving device, chunk index)


def ring_schedule(k: int) -> list[tuple[str, list[Transfer]]]:
    """The 2(k-1) steps of a ring allreduce over k devices, each a phase name and its transfers.

    In every step device i sends one chunk to device i+1: during "reduce-scatter" the
    receiver adds it to its own copy, during "all-gather" it overwrites its copy.
    """
    reduce = [("reduce-scatter", [(i, (i + 1) % k, (i - s) % k) for i in range(k)])
              for s in range(k - 1)]
    gather = [("all-gather", [(i, (i + 1) % k, (i + 1 - s) % k) for i in range(k)])
              for s in range(k - 1)]
    return reduce + gather


def send_chunk(chunks: list[tuple[torch.Tensor, ...]], phase: str, src: int, dst: int,
               c: int) -> int:
    """Device src sends its chunk c to device dst, which adds it to its own copy
    ("reduce-scatter") or overwrites its copy ("all-gather"); returns the elements sent."""
    piece, target = chunks[src][c], chunks[dst][c]
    if phase == "reduce-scatter":
        target.add_(piece.to(target.device))
    else:
        target.copy_(piece)
    return piece.numel()


@torch.no_grad()
def ring_allreduce(tensors: list[torch.Tensor]) -> list[int]:
    """Sum tensors in place with a chunked ring; returns the elements each device sent.

    Each tensor is cut into k nearly equal chunks, so each device sends 2(k-1)/k * N elements.
    """
    check_collective(tensors, "ring_allreduce")
    k = len(tensors)
    flat = [t.view(-1) if t.is_contiguous() else t.contiguous().view(-1) for t in tensors]
    chunks = [f.tensor_split(k) for f in flat]
    sent = [0] * k
    for phase, transfers in ring_schedule(k):
        for src, dst, c in transfers:
            sent[src] += send_chunk(chunks, phase, src, dst, c)
    for t, f in zip(tensors, flat):
        if not t.is_contiguous():  # we summed into a contiguous copy
            t.copy_(f.view(t.shape))
    return sent
