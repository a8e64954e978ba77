"""Chapter 07: DistributedDataParallel built by hand (and chapter 09's ZeRO-2 option).

``ScratchDDP(module)`` is a drop-in for ``torch.nn.parallel.DistributedDataParallel`` on the
loop ``out = model(x); loss.backward(); opt.step()``: rank 0's parameters and buffers are
broadcast at construction, and gradients are averaged across ranks in buckets whose
allreduce starts, asynchronously, as soon as the bucket's last gradient is ready - while
backward goes on. When ``backward()`` returns, every gradient is synchronised.

Chapter 09: after ``ddp.shard_gradients(opt)`` (opt a ``zero.ShardedOptimizer``) each bucket
is reduce-scattered instead of all-reduced (ZeRO-2): each rank keeps only the averaged
gradients of the parameters it owns (``GradientShards``).
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import p2p
from .shm import SharedMemoryAllreduce
from .zero import ShardedOptimizer


@torch.no_grad()
def broadcast_parameters(module: nn.Module) -> None:
    """Step 1: give every rank rank 0's parameters and buffers, so that all start alike."""
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t, src=0)


@torch.no_grad()
def average_gradients(module: nn.Module) -> None:
    """Step 2, after backward: replace each gradient by its average over the ranks."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def make_buckets(params: list[nn.Parameter], bucket_cap_mb: float) -> list[list[nn.Parameter]]:
    """params in reverse order, grouped into buckets of at most bucket_cap_mb MiB.

    Backward produces gradients roughly from the last layer to the first, hence the reverse
    order. A parameter larger than the cap gets a bucket of its own; bucket_cap_mb=0 gives
    one bucket per parameter. A bucket holds one dtype and one device.
    """
    if bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
    cap = bucket_cap_mb * 2**20
    buckets: list[list[nn.Parameter]] = []
    size = 0.0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        last = buckets[-1][-1] if buckets else None
        if (last is None or cap == 0 or size + nbytes > cap or p.dtype != last.dtype
                or p.device != last.device):
            buckets.append([])
            size = 0.0
        buckets[-1].append(p)
        size += nbytes
    return buckets


@dataclass
class Bucket:
    """One bucket: its parameters, how many are ready, and its allreduce in flight."""
    params: list[nn.Parameter]
    ready: int = 0
    flat: torch.Tensor | None = None
    work: Any = None  # a torch.distributed Work, or a Future of the helper thread
    times: dict[str, float] = field(default_factory=dict)


class ScratchDDP(nn.Module):
    """Average gradients across the ranks of the default group, bucket by bucket.

    bucket_cap_mb: bucket size cap in MiB (0: one bucket per parameter). ring, or shm: reduce
    the buckets with our p2p.ring_allreduce, or chapter 08's shared-memory allreduce (CPU,
    one host), in a helper thread, instead of dist.all_reduce.
    broadcast_buffers: re-broadcast rank 0's buffers before each forward that will synchronise,
    as torch does. Buckets launch in index order, so a parameter unused on one rank holds back
    the buckets after its own until backward ends (correct, but no overlap for them).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, *, ring: bool = False,
                 shm: bool = False, broadcast_buffers: bool = True) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ScratchDDP needs the default process group: build it in a "
                               "function run by dpcourse.launch.launch")
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.world = dist.get_world_size()
        params = [p for p in module.parameters() if p.requires_grad]  # tied ones once
        self.buckets = [Bucket(ps) for ps in make_buckets(params, bucket_cap_mb)]
        self._where = {p: i for i, b in enumerate(self.buckets) for p in b.params}
        if ring and shm:
            raise ValueError("ScratchDDP: choose ring=True or shm=True, not both")
        self._allreduce = (p2p.ring_allreduce if ring
                           else SharedMemoryAllreduce().allreduce if shm else None)
        self._executor = ThreadPoolExecutor(1, "scratch-ddp") if self._allreduce else None
        self._syncing = False  # whether the current forward's backward synchronises
        self._next = 0  # the next bucket to launch: buckets go in index order on every rank
        self._callback_queued = False
        self.launched_in_backward = 0  # buckets whose allreduce overlapped backward, last step
        self.allreduces = 0  # bucket collectives since construction (ZeRO-2: reduce-scatters)
        self.shards: GradientShards | None = None  # chapter 09's ZeRO-2 (shard_gradients)
        broadcast_parameters(module)
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; the next backward synchronises unless inside no_sync()."""
        self._syncing = (self.require_backward_grad_sync and self.world > 1
                         and torch.is_grad_enabled())  # as torch: no sync for evaluation
        if self.broadcast_buffers and self._syncing:
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, src=0)
        self._reset()
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forward and backward inside skip synchronisation."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def shard_gradients(self, optimizer: ShardedOptimizer) -> None:
        """ZeRO-2: from now on reduce-scatter each bucket to the ranks owning its parameters.

        optimizer: the zero.ShardedOptimizer over this module's parameters. After each
        synchronised backward a rank holds the averaged gradients of the parameters it owns;
        the other gradients are None (for their norm: ShardedOptimizer.clip_grad_norm_). Each
        bucket is laid out owner by owner and dist.reduce_scatter sends rank r the sum of its
        piece: on a ring, (w-1)/w of the bucket per rank, half an allreduce's volume (that is
        the algorithm's volume: gloo's reduce_scatter is not built that way and, on the CPU,
        not faster than its allreduce). The memory saved is the gradients kept between steps:
        during backward a bucket's full gradients and its pieces exist, as with DDP.
        """
        if not isinstance(optimizer, ShardedOptimizer):
            raise TypeError("shard_gradients needs a zero.ShardedOptimizer over this module's "
                            f"parameters, got {type(optimizer).__name__}")
        if self._allreduce is not None:
            raise ValueError("shard_gradients uses dist.reduce_scatter: build ScratchDDP "
                             "without ring=True or shm=True")
        self.shards = GradientShards(self.module, self.buckets, optimizer)

    def timeline(self) -> list[tuple[int, float, float]]:
        """(bucket, launched, finished) of the last synchronised backward, perf_counter s.

        After shard_gradients, gloo's reduce_scatter has no future to note its end: there
        "finished" is when the end of backward waited for it (an upper bound)."""
        return [(i, b.times["launched"], b.times["finished"])
                for i, b in enumerate(self.buckets) if "finished" in b.times]

    # --- during backward ---

    def _reset(self) -> None:
        for b in self.buckets:
            b.ready, b.flat, b.work, b.times = 0, None, None, {}
        self._next, self._callback_queued, self.launched_in_backward = 0, False, 0

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: param's gradient is final for this backward."""
        if not self._syncing:
            return
        if not self._callback_queued:  # runs once backward has finished
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        self.buckets[self._where[param]].ready += 1
        while (self._next < len(self.buckets)
               and self.buckets[self._next].ready == len(self.buckets[self._next].params)):
            self._launch(self._next)
            self.launched_in_backward += 1

    def _launch(self, i: int) -> None:
        """Start averaging bucket i (a parameter without gradient counts as zeros)."""
        bucket = self.buckets[i]
        self._next = i + 1
        bucket.times["launched"] = time.perf_counter()
        self.allreduces += 1
        if self.shards is not None:  # chapter 09's ZeRO-2
            bucket.flat, bucket.work = _launch_reduce_scatter(self.shards.chunks[i], self.world)
            return
        bucket.flat = _flat_grads(bucket.params, bucket.params[0])
        bucket.flat.div_(self.world)  # as torch's DDP: divide first, then sum
        if self._executor is not None:
            bucket.work = self._executor.submit(_timed, self._allreduce, bucket.flat,
                                                bucket.times)
        else:
            bucket.work = dist.all_reduce(bucket.flat, async_op=True)
            bucket.work.get_future().add_done_callback(
                lambda _, times=bucket.times: times.setdefault("finished", time.perf_counter()))

    def _finish(self) -> None:
        """End of backward: launch what is left (unused parameters), wait, write grads."""
        while self._next < len(self.buckets):  # a parameter unused on every rank: zeros
            self._launch(self._next)  # (as chapter 07 does; torch's DDP leaves it None)
        for i, bucket in enumerate(self.buckets):
            if isinstance(bucket.work, Future):
                bucket.work.result()
            else:
                bucket.work.wait()
                bucket.times.setdefault("finished", time.perf_counter())
            if self.shards is not None:
                self.shards.write(i, bucket.flat)
            else:
                _write_grads(bucket.params, bucket.flat)
            bucket.flat = bucket.work = None
        self._syncing = False


def _timed(fn: Any, tensor: torch.Tensor, times: dict[str, float]) -> Any:
    """fn(tensor), noting when it finished in times."""
    out = fn(tensor)
    times["finished"] = time.perf_counter()
    return out


@torch.no_grad()
def _launch_reduce_scatter(chunks: list[list[nn.Parameter]],
                           world: int) -> tuple[torch.Tensor, Any]:
    """ZeRO-2: start summing each rank's piece of a bucket (chunks[r]: the parameters rank r
    owns), divided by world, onto that rank; free the gradients of the parameters other
    ranks own. Returns (this rank's summed piece, the work)."""
    rank = dist.get_rank()
    like = next(p for chunk in chunks for p in chunk)
    pieces = [_flat_grads(chunk, like).div_(world) for chunk in chunks]
    flat = torch.empty_like(pieces[rank])
    work = dist.reduce_scatter(flat, pieces, async_op=True)
    for r, chunk in enumerate(chunks):
        if r != rank:
            for p in chunk:
                p.grad = None
    return flat, work


@torch.no_grad()
def _flat_grads(params: list[nn.Parameter], like: torch.Tensor) -> torch.Tensor:
    """The gradients of params (zeros where missing) as one new vector of like's dtype."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params] or [like.new_zeros(0)])


@torch.no_grad()
def _write_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy each parameter's slice of flat into its gradient (created if missing)."""
    offset = 0
    for p in params:
        piece = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is None:
            p.grad = piece.clone()
        else:
            p.grad.copy_(piece)


class GradientShards:
    """ZeRO-2 for a ScratchDDP (made by its shard_gradients): which parameters each rank owns
    in each bucket, and the reduce-scatter that leaves each rank only its own averaged ones.

    Accumulation: a second synchronised backward before the step (without no_sync) must add
    to the averaged gradient a rank holds, not average it again with the others' None. So the
    first gradient hook of each backward sets aside this rank's averaged gradients from the
    synchronised backward before, and the next synchronised backward adds them back to its new
    average. Under no_sync every rank accumulates its full local gradients, as with DDP; the
    step must follow a synchronised backward (else it raises: the sum is incomplete).
    """

    def __init__(self, module: nn.Module, buckets: list[Bucket],
                 optimizer: ShardedOptimizer) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        known = {p for group in optimizer.param_groups for p in group["params"]}
        for name, p in module.named_parameters():
            if p.requires_grad and p not in known:
                raise ValueError(f"parameter {name!r} of the module is not one of the "
                                 "optimizer's: build the ShardedOptimizer over ddp.parameters()")
        self.chunks = [[[p for p in b.params if optimizer.owner(p) == r]
                        for r in range(self.world)] for b in buckets]
        self.averaged: dict[nn.Parameter, weakref.ref] = {}  # written by the last sync
        self.set_aside: dict[nn.Parameter, torch.Tensor] = {}
        for b in buckets:
            for p in b.params:
                p.register_hook(self._before_accumulate)
        optimizer.register_step_pre_hook(self._check_synchronised)

    @torch.no_grad()
    def write(self, i: int, flat: torch.Tensor) -> None:
        """Bucket i reduced: this rank's averaged gradients, plus what was set aside."""
        own = self.chunks[i][self.rank]
        _write_grads(own, flat)
        for p in own:
            if p in self.set_aside:
                p.grad += self.set_aside.pop(p)
            self.averaged[p] = weakref.ref(p.grad)

    def _check_synchronised(self, *_: Any) -> None:
        """Step pre-hook: nothing may still be set aside (dropped, so the next step can run)."""
        if self.set_aside:
            self.set_aside.clear()
            raise RuntimeError("ZeRO-2: a backward under no_sync came after the last "
                               "synchronised one, so this rank's gradients miss a part: "
                               "synchronise the last micro-batch before step()")

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        """Tensor hook, before a gradient accumulates: set aside the averaged gradients the
        synchronised backward before left, if still in place (once per backward)."""
        for p, written in self.averaged.items():
            if p.grad is not None and p.grad is written():
                self.set_aside[p] = p.grad
                p.grad = None
        self.averaged.clear()
