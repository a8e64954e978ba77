"""Chapter 07: communication hooks, torch DDP's seam for how a bucket of gradients is averaged.

A hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``: ``bucket.buffer()``
holds this rank's undivided gradients of one bucket, flattened, and the future's value is their
average over the ranks, of the same size. The same function registers on torch's
``DistributedDataParallel.register_comm_hook(state, hook)`` and on ``ScratchDDP``'s. Chapter 08
adds ``shm.shm_hook``, chapter 09 ``zero.reduce_scatter_hook``. (Modules that define hooks
do without ``from __future__ import annotations``: torch's DDP checks the hook's annotations
against ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``, not their strings.)
"""
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import p2p


def allreduce_hook(group: dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """What DDP does without a hook: divide by the world size, then sum with dist.all_reduce."""
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class Traffic:
    """counting_hook's state: the buckets handed to all_reduce, and their bytes, on this rank."""

    def __init__(self) -> None:
        self.calls, self.bytes = 0, 0


def counting_hook(state: Traffic,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """allreduce_hook on the default group, counting each call and the bytes it reduces."""
    state.calls += 1
    state.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(None, bucket)


class HelperThread:
    """Hook state for a blocking collective (our ring, shared memory): one helper thread runs
    it, so that backward goes on meanwhile. Buckets run one after another, in launch order,
    as every rank must. Close it (or use it in a with block) when training is done; one that
    is dropped unclosed lets its thread end when it is garbage-collected."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, "dpcourse-hook")
        self._on_collect = weakref.finalize(self, self._executor.shutdown, wait=False)

    def submit(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.futures.Future:
        """A torch future of fn(*args), run on the helper thread (its exception is re-raised
        by the future's wait)."""
        future: torch.futures.Future = torch.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(error)
        self._executor.submit(run)
        return future

    def close(self) -> None:
        self._on_collect.detach()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "HelperThread":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ring_hook(state: HelperThread,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with p2p.ring_allreduce (send/recv only) on state's helper thread."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return state.submit(_summed, p2p.ring_allreduce, buffer)


def _summed(allreduce: Callable[[torch.Tensor], object], buffer: torch.Tensor) -> torch.Tensor:
    """buffer, after allreduce summed it in place."""
    allreduce(buffer)
    return buffer
