"""Chapter 08: the shared-memory allreduce built step by step, each step one change.

All are ``shm.SharedBuffers`` (the shared buffers, their regions and counters) with their own
round and wait, in the order the chapter builds them:

1. ``PlainBarriers``: copy the whole piece in, reduce this rank's slice into a scratch tensor
   and copy it into the buffer, copy every slice out; a gloo barrier between the phases.
2. ``SharedCounters``: the same rounds, the ranks waiting on counters in shared memory.
3. ``SharedMemoryAllreduce`` itself: the sum goes straight into shared memory, so three
   copies of the rank's slice and one wait per round go.
4. ``SharedMemoryAllreduce`` with its 2 MiB buffer, which stays in the CPU's cache.

Steps 1-3 get a buffer as large as the largest tensor the chapter measures (64 MiB): a
tensor goes through in one round. ``SHM_STEPS`` maps a label to a factory of each step;
``regions_seen`` shows, on real ranks, that what a rank writes in its buffer every rank reads.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from .shm import SharedBuffers, SharedMemoryAllreduce

WHOLE_TENSOR_BYTES = 64 << 20  # steps 1-3: a buffer as large as the sweep's largest tensor


class PlainBarriers(SharedBuffers):
    """Step 1: copy in, reduce into scratch, copy out, with a gloo barrier after each phase.

    Every barrier is a message round trip through TCP and gloo's threads, three per round."""

    def _round(self, piece: torch.Tensor, first: bool) -> None:
        """Allreduce one piece: copy it all in, reduce own slice, gather; a wait after each."""
        regions = self._regions(piece.dtype)
        slices = piece.tensor_split(self.world)
        mine = regions[self.rank]
        for q, s in enumerate(slices):
            mine[q][:s.numel()].copy_(s)
        self._arrive()
        if first:
            self._check_same_call()
        n = slices[self.rank].numel()
        total = regions[0][self.rank][:n].clone()  # a scratch tensor, in private memory
        for q in range(1, self.world):
            total += regions[q][self.rank][:n]
        mine[self.rank][:n].copy_(total)
        self._arrive()
        for q, s in enumerate(slices):
            s.copy_(regions[q][q][:s.numel()])
        self._arrive()  # nobody copies the next piece in before every rank has gathered

    def _arrive(self) -> None:
        """Wait for every rank at a barrier of the default process group (gloo; the group's
        timeout applies, not this object's)."""
        dist.barrier()


class SharedCounters(PlainBarriers):
    """Step 2: the same rounds; each rank counts in its header and waits on the others'.

    A wait costs a read of shared memory (and a sleep in the kernel if the count is not yet
    there) instead of a trip through the network stack."""

    _arrive = SharedBuffers._arrive  # the counters, as SharedMemoryAllreduce waits


# Step 3 is SharedMemoryAllreduce: SharedBuffers' counters with another _round. Each rank reduces
# straight into its own region of its buffer: no scratch tensor (a large fresh one costs a
# page fault per 4 KiB page) and no copy of it. That region can no longer hold the rank's
# own slice, which is read from the tensor instead, so it is never copied in; and as the
# next round's copy-in touches no region the others gather from, two waits suffice.
SHM_STEPS: dict[str, Callable[[], ContextManager]] = {
    "1 plain: 3 barriers": partial(PlainBarriers, WHOLE_TENSOR_BYTES),
    "2 shared counters": partial(SharedCounters, WHOLE_TENSOR_BYTES),
    "3 reduce into shared memory": partial(SharedMemoryAllreduce, WHOLE_TENSOR_BYTES),
    "4 2 MiB buffer": SharedMemoryAllreduce,
}


def regions_seen(max_bytes: int = 1 << 12) -> list[list[int]]:
    """On each rank: write 10 * rank + q into region q of this rank's buffer, wait for every
    rank, then read the first number of every region of every rank's buffer: what one rank
    writes in its own buffer, every rank reads. Returns [buffer of rank q][region r]."""
    with SharedBuffers(max_bytes) as shm:
        regions = shm._regions(torch.float32)
        for q, region in enumerate(regions[shm.rank]):
            region.fill_(10 * shm.rank + q)
        shm._arrive()  # every rank has written its own buffer
        return [[int(region[0]) for region in buffer] for buffer in regions]
