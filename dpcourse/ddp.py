"""Chapter 07: DistributedDataParallel built by hand.

``ScratchDDP(module)`` is a drop-in for ``torch.nn.parallel.DistributedDataParallel`` on the
loop ``out = model(x); loss.backward(); opt.step()``: rank 0's parameters and buffers are
broadcast at construction, and gradients are averaged across ranks in buckets whose
allreduce starts, asynchronously, as soon as the bucket's last gradient is ready - while
backward goes on. When ``backward()`` returns, every gradient is synchronised, activation
checkpointing or not. How a bucket is averaged is a communication hook
(``register_comm_hook``, torch DDP's own seam).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .comm_hooks import allreduce_hook


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


class GradBucket:
    """What a communication hook receives: torch's GradBucket methods on one bucket."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list[nn.Parameter],
                 is_last: bool) -> None:
        self._index, self._buffer, self._params, self._is_last = index, buffer, params, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """This rank's undivided gradients of the bucket's parameters, flattened in order."""
        return self._buffer

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward (the first parameters)."""
        return self._is_last

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Views into buffer(), one shaped like each parameter."""
        return [piece.view_as(p) for p, piece in
                zip(self._params, self._buffer.split([p.numel() for p in self._params]))]


Hook = Callable[[Any, GradBucket], torch.futures.Future]


@dataclass
class Bucket:
    """One bucket: its parameters, how many are ready, and the future of its average."""
    params: list[nn.Parameter]
    ready: int = 0
    future: torch.futures.Future | None = None
    times: dict[str, float] = field(default_factory=dict)


class ScratchDDP(nn.Module):
    """Average gradients across the ranks of the default group, bucket by bucket (a bucket
    holds at most bucket_cap_mb MiB; 0: one per parameter), launched in index order."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, *,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ScratchDDP needs the default process group: build it in a "
                               "function run by dpcourse.launch.launch")
        self.module, self.world = module, dist.get_world_size()
        self.broadcast_buffers = broadcast_buffers  # rank 0's, as torch (see forward)
        self.find_unused_parameters = find_unused_parameters  # as torch's (see _finish)
        self.require_backward_grad_sync = True  # False inside no_sync()
        params = [p for p in module.parameters() if p.requires_grad]  # tied ones once
        self.buckets = [Bucket(ps) for ps in make_buckets(params, bucket_cap_mb)]
        self._where = {p: i for i, b in enumerate(self.buckets) for p in b.params}
        self._state, self._hook = None, allreduce_hook  # the comm hook's: the plain allreduce
        self._hook_registered, self._syncing = False, False  # _syncing: this forward's backward
        self._buffers_behind = True  # rank 0's buffers due: first forward, or after a synced one
        self.hook_calls = 0  # buckets handed to the comm hook since construction
        self._reset()  # no bucket ready or launched yet
        broadcast_parameters(module)
        self._register_hooks(params)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; the next backward synchronises unless inside no_sync(), and its
        end is queued from the output. A forward without gradients (an evaluation) leaves
        the pending backward's state alone."""
        if not torch.is_grad_enabled():  # as torch: no backward follows, nothing to prepare
            return self.module(*args, **kwargs)
        if self.broadcast_buffers and self._buffers_behind and self.world > 1:
            with torch.no_grad():  # as torch: when the last training forward synchronised
                for b in self.module.buffers():
                    dist.broadcast(b, src=0)
        self._syncing = self.require_backward_grad_sync  # a world of 1 too: its hook runs
        self._buffers_behind = self._syncing
        self._reset()
        out = self.module(*args, **kwargs)
        return _through_end_of_backward(out, self) if self._syncing else out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forward and backward inside skip synchronisation."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: Hook) -> None:
        """Average each bucket with hook(state, bucket) instead of the plain allreduce.

        As torch's DDP: hook returns a future of the bucket's averaged buffer, of the size
        of bucket.buffer(); register once, before the first backward."""
        if self._hook_registered:
            raise RuntimeError("register_comm_hook: a communication hook is already "
                               "registered (it can be registered only once)")
        if not callable(hook):
            raise TypeError(f"register_comm_hook needs a callable hook, got {hook!r}")
        self._state, self._hook, self._hook_registered = state, hook, True

    def timeline(self) -> list[tuple[int, float, float]]:
        """(bucket, launched, finished) of the last synchronised backward, perf_counter s."""
        return [(i, b.times["launched"], b.times["finished"])
                for i, b in enumerate(self.buckets) if "finished" in b.times]

    def _reset(self) -> None:
        """Before a forward: no bucket ready, launched or awaited."""
        for b in self.buckets:
            b.ready, b.future, b.times = 0, None, {}
        self._next, self._callback_queued, self.launched_in_backward = 0, False, 0
        self._ready: set[nn.Parameter] = set()  # the parameters marked ready so far

    def _register_hooks(self, params: list[nn.Parameter]) -> None:
        """_grad_ready on each parameter; with find_unused_parameters also a note of the
        parameters used since the last synchronised backward (no_sync() ones too: _leave_unused)."""
        self._used: set[nn.Parameter] = set()
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
            if self.find_unused_parameters:
                p.register_post_accumulate_grad_hook(self._used.add)

    # --- during backward ---

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: param's gradient is final for this backward."""
        if not self._syncing:
            return
        self._queue_finish()  # if forward's _EndOfBackward has not: backward skipped the output
        self._note_ready(param)
        self.buckets[self._where[param]].ready += 1
        while (self._next < len(self.buckets)
               and self.buckets[self._next].ready == len(self.buckets[self._next].params)):
            self._launch(self._next)

    def _queue_finish(self) -> None:
        """Once per backward: have autograd call _finish when the backward running now ends."""
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True

    def _note_ready(self, param: nn.Parameter) -> None:
        """Note that param's gradient is final; raise if it already was in this backward."""
        if param in self._ready:  # its bucket may have gone with a part of its gradient
            name = next(n for n, p in self.module.named_parameters() if p is param)
            raise RuntimeError(
                f"ScratchDDP: parameter {name} got its gradient twice in one "
                "backward (a block checkpointed with use_reentrant=True and run twice "
                "backpropagates twice): not supported, as in torch's DDP; checkpoint it "
                "with use_reentrant=False")
        self._ready.add(param)

    def _launch(self, i: int) -> None:
        """Hand bucket i to the comm hook (a parameter without gradient counts as zeros)."""
        bucket = self.buckets[i]
        self._next, self.hook_calls = i + 1, self.hook_calls + 1
        bucket.times["launched"] = time.perf_counter()
        flat = _flat_grads(bucket.params)
        last = i == len(self.buckets) - 1
        bucket.future = self._hook(self._state, GradBucket(i, flat, bucket.params, last))
        bucket.future.add_done_callback(
            lambda _, times=bucket.times: times.setdefault("finished", time.perf_counter()))

    def _finish(self) -> None:
        """End of backward: launch what is left (unused parameters), wait, write grads."""
        self.launched_in_backward = self._next  # the buckets _grad_ready launched
        unused_here = self._grads_unused_here()
        while self._next < len(self.buckets):  # a parameter unused on every rank: zeros
            self._launch(self._next)  # (or, with find_unused_parameters, left as it was)
        for i, bucket in enumerate(self.buckets):
            _write_average(self._hook, i, bucket, bucket.future.wait())
            bucket.future = None
        self._leave_unused(unused_here)
        self._syncing = False

    def _grads_unused_here(self) -> dict[nn.Parameter, torch.Tensor | None]:
        """With find_unused_parameters: the gradients, as they are, of the parameters this
        rank did not use since the last synchronised backward (for _leave_unused)."""
        if not self.find_unused_parameters:
            return {}
        return {p: None if p.grad is None else p.grad.clone()
                for b in self.buckets for p in b.params if p not in self._used}

    def _leave_unused(self, unused_here: dict[nn.Parameter, torch.Tensor | None]) -> None:
        """With find_unused_parameters, as torch's DDP: put back the gradient of each parameter
        that no rank used (one allreduce of who used what, after every bucket's)."""
        if not self.find_unused_parameters:
            return
        params = [p for b in self.buckets for p in b.params]
        used = torch.tensor([p not in unused_here for p in params], dtype=torch.int32,
                            device=params[0].device if params else "cpu")
        dist.all_reduce(used)
        for p, users in zip(params, used.tolist()):
            if users == 0:
                p.grad = unused_here[p]
        self._used.clear()


class _EndOfBackward(torch.autograd.Function):
    """Copies of the forward's output tensors; backward through them starts in the loss's
    backward, where it queues ScratchDDP's end of backward (not in a backward nested inside,
    as a reentrant activation checkpoint's, which ends before earlier layers' gradients)."""

    @staticmethod
    def forward(ctx: Any, ddp: "ScratchDDP", *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.ddp = ddp
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors)  # not views: the caller may change them

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.ddp._queue_finish()
        return (None, *grads)


def _through_end_of_backward(out: Any, ddp: "ScratchDDP") -> Any:
    """out with its tensors that require grad passed through _EndOfBackward."""
    leaves, spec = tree_flatten(out)
    where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if where:
        copies = _EndOfBackward.apply(ddp, *(leaves[i] for i in where))
        for i, copy in zip(where, copies):
            leaves[i] = copy
    return tree_unflatten(leaves, spec)


def _write_average(hook: Hook, i: int, bucket: Bucket, averaged: Any) -> None:
    """Check that hook's result for bucket i has the bucket's size, note when it finished,
    and copy each parameter's slice of it into the parameter's .grad."""
    bucket.times.setdefault("finished", time.perf_counter())  # if no done-callback yet
    numel = sum(p.numel() for p in bucket.params)
    if not isinstance(averaged, torch.Tensor) or averaged.numel() != numel:
        got = (f"{averaged.numel()} elements" if isinstance(averaged, torch.Tensor)
               else type(averaged).__name__)
        raise ValueError(f"comm hook {getattr(hook, '__name__', hook)} "
                         f"returned {got} for bucket {i}, which holds {numel}")
    _write_grads(bucket.params, averaged)


@torch.no_grad()
def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """The gradients of params (zeros where missing) as one new vector."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])


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
