"""Chapter 09: ZeRO by hand - each rank keeps and steps one shard of the optimizer (stage 1),
and keeps only its shard's averaged gradients (stage 2, a communication hook).

``ShardedOptimizer(params, torch.optim.AdamW, lr=...)`` is used where a plain optimizer
would be, once the gradients are the same on every rank (after ``ScratchDDP``, torch's DDP,
or identical inputs). The parameters are split among the ranks with balanced sizes; each
rank builds the real optimizer over its own shard only, so it holds only that shard's state
(Adam's two moments), steps only that shard, and then every owner broadcasts its updated
parameters, so that all ranks end each step with the same parameters as the plain
optimizer's. ``ddp.register_comm_hook(GradientSharding(opt), reduce_scatter_hook)`` adds
stage 2: each bucket is reduce-scattered to the ranks owning its parameters, and the other
gradients are dropped before each step.

ShardedOptimizer: whole parameters are shared out (partition; a repeated parameter counts
once), so the shards are as even as the tensor sizes allow. ``param_groups`` holds every
parameter and hyperparameter (schedulers work as usual); ``optim`` is this rank's
optimizer_cls over its shard and ``state`` its state. Parameters without a gradient are
skipped, as torch's optimizers skip them; frozen parameters weigh nothing in the split. After
stepping, each rank broadcasts its shard as one flat buffer per dtype, so every rank receives
the parameters it does not own: the volume of an all-gather, without padding the shards to
equal sizes as dist.all_gather_into_tensor needs. clip_grad_norm_ clips by the norm over all
ranks' gradients.

GradientSharding: the collective itself is issued by the hook, so every rank issues its
collectives in the same order, as a DDP's other collectives; gloo's reduce_scatter returns no
future, so a helper thread waits for it. When backward ends, the gradients of parameters
other ranks own are dropped (under ScratchDDP; torch's DDP writes them after that, so there
they go before the step): between steps a rank holds only its shard's. Until backward ends
every gradient exists in full, as with DDP: a hook returns the whole bucket's buffer, which
the DDP writes into every gradient (torch's hook_with_zero_step has the same contract). A
second synchronised backward before the step must add to the average a rank holds, not
average it again with the others' missing share: so the first gradient of each backward sets
aside the averages the last synchronised backward left, and the reduce-scatter adds them
back. Under no_sync every rank accumulates its full local gradients, as with DDP; the step
must follow a synchronised backward (else it raises).

reduce_scatter_hook lays the bucket's gradients out owner by owner, so dist.reduce_scatter
sends each rank the average of its own piece only: (w-1)/w of the bucket per rank on a ring,
half an allreduce's volume (gloo's reduce_scatter is not built that way and, on the CPU, is
not faster than its allreduce). The other ranks' gradients are dropped when backward ends.
"""
import math
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from .comm_hooks import HelperThread


def partition(sizes: list[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """The rank owning each item: largest first, each to the least loaded rank (lowest
    rank on ties), starting from loads (numels already owned; zeros by default).

    Deterministic, so every rank computes the same split; greedy ("longest processing time
    first"), so from equal loads the largest and smallest differ by at most the largest item.
    ShardedOptimizer gives a frozen parameter size 0: it has no state to balance.
    """
    loads = list(loads) if loads is not None else [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties in order
        owners[i] = min(range(world_size), key=lambda r: loads[r])
        loads[owners[i]] += sizes[i]
    return owners


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: optimizer_cls(**defaults) over this rank's shard of params only (whole
    parameters shared out by partition); needs the default process group and gradients
    already equal on every rank. The module's docstring says the rest."""

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                 **defaults: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs the default process group: build it in "
                               "a function run by dpcourse.launch.launch")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls,
                                                               torch.optim.Optimizer)):
            raise TypeError("optimizer_cls must be a torch.optim.Optimizer subclass such as "
                            f"torch.optim.AdamW, got {optimizer_cls!r}")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._owners: dict[nn.Parameter, int] = {}
        self._loads = [0] * self.world  # numel owned by each rank
        super().__init__(params, defaults)  # calls add_param_group for each group
        self.optim = optimizer_cls(
            [self._local_group(g) for g in self.param_groups], **defaults)
        for group, local in zip(self.param_groups, self.optim.param_groups):
            group.update({k: v for k, v in local.items() if k != "params"})  # class defaults
        self.state = self.optim.state

    def owner(self, param: torch.Tensor) -> int:
        """The rank that keeps param's optimizer state and steps it."""
        if param not in self._owners:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not one of this "
                             "optimizer's parameters")
        return self._owners[param]

    def shard(self, rank: int | None = None) -> list[nn.Parameter]:
        """The parameters rank (default: this one) owns, in param_groups order."""
        rank = self.rank if rank is None else rank
        return [p for g in self.param_groups for p in g["params"] if self._owners[p] == rank]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its parameters are shared out among the ranks, the others keep theirs."""
        param_group = dict(param_group)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group["params"] = list(dict.fromkeys(params))  # a tied parameter once
        super().add_param_group(param_group)
        new = self.param_groups[-1]["params"]
        sizes = [p.numel() if p.requires_grad else 0 for p in new]  # frozen: no state
        for p, size, rank in zip(new, sizes, partition(sizes, self.world, self._loads)):
            self._owners[p] = rank
            self._loads[rank] += size
        if hasattr(self, "optim"):  # after __init__: the local optimizer gets the group too
            self.optim.add_param_group(self._local_group(self.param_groups[-1]))
            self.param_groups[-1].update(
                {k: v for k, v in self.optim.param_groups[-1].items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's shard, then give every rank every owner's updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})  # e.g. a new lr
        self.optim.step()
        self._share_parameters()
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over all the parameters, for sharded gradients: the
        total norm (float64) of the gradients each rank owns, combined across the ranks, so it
        works after ZeRO-2 where a rank holds only those. Clips every gradient this rank holds;
        returns the total norm. A collective: every rank must call it."""
        norm_type = float(norm_type)
        device = self.param_groups[0]["params"][0].device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        norms = [torch.linalg.vector_norm(p.grad, norm_type, dtype=torch.float64).to(device)
                 for p in self.shard() if p.grad is not None]
        if math.isinf(norm_type):
            total = torch.stack([zero, *norms]).max()
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            total = sum([n.pow(norm_type) for n in norms], zero)
            dist.all_reduce(total)
            total = total.pow(1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's 1e-6
        for p in self._all_params():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return total

    def state_dict(self) -> dict[str, Any] | None:
        """On rank 0, the full state, as a plain optimizer_cls over all params would give it
        (tensors on the CPU); None on the other ranks, which never hold more than their shard.

        A collective: EVERY rank must call it, not only the one that saves, since each rank
        holds only its own shard's state and rank 0 gathers (gather_object) the shards; a
        call on rank 0 alone waits for the others until the timeout.
        """
        index = {p: i for i, p in enumerate(self._all_params())}
        own = {index[p]: {k: v.cpu() if isinstance(v, torch.Tensor) else v
                          for k, v in self.state[p].items()}
               for p in self.shard() if p in self.state}
        everyone: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(own, everyone, dst=0)
        if everyone is None:
            return None
        state = {i: s for part in everyone for i, s in part.items()}
        groups = [{**group, "params": [index[p] for p in group["params"]]}
                  for group in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (rank 0's state_dict(), or a plain optimizer's), given on every
        rank (each reads the saved file); each rank keeps its own shard's part."""
        groups = state_dict["param_groups"]
        theirs = [len(g["params"]) for g in groups]
        ours = [len(g["params"]) for g in self.param_groups]
        if theirs != ours:
            raise ValueError("the loaded state's parameter groups do not match this "
                             f"optimizer's: parameters per group {theirs} loaded, {ours} here")
        params = self._all_params()
        local: dict[str, Any] = {"state": {}, "param_groups": []}
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            mine = [i for i in saved["params"] if self._owners[params[i]] == self.rank]
            start = sum(len(g["params"]) for g in local["param_groups"])
            local["param_groups"].append({**saved, "params": list(range(start,
                                                                         start + len(mine)))})
            for j, i in enumerate(mine, start):
                if i in state_dict["state"]:
                    local["state"][j] = state_dict["state"][i]
        self.optim.load_state_dict(local)
        self.state = self.optim.state

    # --- helpers ---

    def _all_params(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """group restricted to the parameters this rank owns (possibly none)."""
        return {**group, "params": [p for p in group["params"]
                                    if self._owners[p] == self.rank]}

    def _share_parameters(self) -> None:
        """Every rank in turn broadcasts its shard, one flat buffer per (device, dtype), in
        the same order on every rank (owners and parameters are the same everywhere)."""
        for rank in range(self.world):
            shard = self.shard(rank)
            for kind in dict.fromkeys((p.device, p.dtype) for p in shard):
                params = [p for p in shard if (p.device, p.dtype) == kind]
                sizes = [p.numel() for p in params]
                if rank == self.rank:
                    flat = torch.cat([p.detach().reshape(-1) for p in params])
                else:
                    flat = torch.empty(sum(sizes), device=kind[0], dtype=kind[1])
                dist.broadcast(flat, src=rank)
                if rank != self.rank:
                    for p, piece in zip(params, flat.split(sizes)):
                        p.copy_(piece.view_as(p))


class GradientSharding(HelperThread):
    """State of reduce_scatter_hook (ZeRO-2): the ShardedOptimizer (who owns what), a helper
    thread that waits for gloo's reduce_scatter, and what keeps accumulation right when a
    rank keeps only its own averaged gradients. The module's docstring says the rest."""

    def __init__(self, optimizer: ShardedOptimizer) -> None:
        if not isinstance(optimizer, ShardedOptimizer):
            raise TypeError("GradientSharding needs a zero.ShardedOptimizer over the module's "
                            f"parameters, got {type(optimizer).__name__}")
        super().__init__()
        self.optimizer = optimizer
        self.averaged: dict[nn.Parameter, weakref.ref] = {}  # left by the last sync
        self.set_aside: dict[nn.Parameter, torch.Tensor] = {}
        self._drop_queued = False
        for p in optimizer._all_params():
            if p.requires_grad:
                p.register_hook(self._before_accumulate)
        optimizer.register_step_pre_hook(self._before_step)

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        """Tensor hook, before a gradient accumulates: set aside the averages the last
        synchronised backward left, if still in place (once per backward)."""
        for p, written in self.averaged.items():
            if p.grad is not None and p.grad is written():
                self.set_aside[p] = p.grad
                p.grad = None
        self.averaged.clear()

    def _queue_drop(self) -> None:
        """Once per backward: after the DDP has written the gradients, keep only our own."""
        if not self._drop_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._drop_others)
            self._drop_queued = True

    def _drop_others(self) -> None:
        opt, self._drop_queued = self.optimizer, False
        for p in opt._all_params():
            if opt.owner(p) != opt.rank:
                p.grad = None
            elif p.grad is not None:
                self.averaged[p] = weakref.ref(p.grad)

    def _before_step(self, *_: Any) -> None:
        """Step pre-hook: the others' gradients go (if a DDP wrote them after backward's end,
        as torch's does); nothing may still be set aside (dropped: the next step can run)."""
        self._drop_others()
        if self.set_aside:
            self.set_aside.clear()
            raise RuntimeError("ZeRO-2: a backward under no_sync came after the last "
                               "synchronised one, so this rank's gradients miss a part: "
                               "synchronise the last micro-batch before step()")


def reduce_scatter_hook(state: GradientSharding,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """ZeRO-2's communication hook: dist.reduce_scatter leaves each rank the average of its
    own piece of the bucket; the future's buffer holds those averages, zeros elsewhere."""
    opt = state.optimizer
    state._queue_drop()
    buffer, params = bucket.buffer(), bucket.parameters()
    slices = buffer.split([p.numel() for p in params])
    owners = [opt.owner(p) for p in params]
    pieces = [torch.cat([g for g, o in zip(slices, owners) if o == r] or [buffer[:0]])
              .div_(opt.world) for r in range(opt.world)]
    own = [(g, state.set_aside.pop(p, None)) for p, g, o in zip(params, slices, owners)
           if o == opt.rank]
    mine = torch.empty_like(pieces[opt.rank])
    work = dist.reduce_scatter(mine, pieces, async_op=True)  # issued here: in launch order
    return state.submit(_own_averages, work, buffer, own, mine)


@torch.no_grad()
def _own_averages(work: dist.Work, buffer: torch.Tensor,
                  own: list[tuple[torch.Tensor, torch.Tensor | None]],
                  mine: torch.Tensor) -> torch.Tensor:
    """Once the reduce-scatter is done: buffer with this rank's sums (plus what was set
    aside) in its own slices (views of buffer), zeros elsewhere."""
    work.wait()
    buffer.zero_()
    for (g, kept), piece in zip(own, mine.split([g.numel() for g, _ in own])):
        g.copy_(piece)
        if kept is not None:
            g += kept.reshape(-1)
    return buffer
