"""Chapter 11: synchronising less often - local SGD and DiLoCo.

``DiLoCo(model, inner_optimizer, sync_every)`` is used like an optimizer (``loss.backward();
opt.step(); opt.zero_grad()``) on a model that is NOT wrapped in a DDP: each rank takes
``sync_every`` inner steps alone on its own data; then the ranks average their pseudo-gradients
(the round's starting parameters minus the current ones) in one allreduce, and an outer SGD
with Nesterov momentum applies that average to the starting parameters, which every rank then
holds. Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023 (arXiv:2311.08105): inner AdamW, outer lr 0.7, momentum 0.9, sync every 500 steps. Plain
local SGD is outer_lr=1, outer_momentum=0; with sync_every=1 and inner SGD it is DDP exactly.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class DiLoCo:
    """Inner steps alone, an averaged outer step every sync_every of them."""

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DiLoCo needs the default process group: build it in a "
                               "function run by dpcourse.launch.launch")
        if sync_every < 1 or outer_lr <= 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"need sync_every >= 1, outer_lr > 0 and 0 <= outer_momentum < 1,"
                             f" got {sync_every}, {outer_lr}, {outer_momentum}")
        self.model, self.inner, self.sync_every = model, inner_optimizer, sync_every
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():  # every rank starts from rank 0's model
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t, src=0)
        self.start = [p.detach().clone() for p in self.params]  # the round's start
        momentum = {"momentum": outer_momentum, "nesterov": nesterov} if outer_momentum else {}
        self.outer = torch.optim.SGD(self.params, lr=outer_lr, **momentum)
        self.inner_steps, self.syncs, self.bytes_sent = 0, 0, 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """One inner step; every sync_every of them, the outer step."""
        self.inner.step()
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients and the buffers; the outer step from the round's start."""
        averaged = self._average_round()
        for p, s, delta in zip(self.params, self.start, averaged):
            p.copy_(s)
            p.grad = delta
        self.outer.step()
        for p, s in zip(self.params, self.start):
            s.copy_(p)
        self.inner.zero_grad()
        self.syncs += 1

    @torch.no_grad()
    def _average_round(self) -> list[torch.Tensor]:
        """One allreduce: each parameter's pseudo-gradient (the round's start minus it)
        averaged over the ranks, returned; the float buffers averaged in place in the same
        message; the integer buffers (BatchNorm's counters) set to rank 0's."""
        world = dist.get_world_size()
        deltas = torch.cat([(s - p).reshape(-1) for s, p in zip(self.start, self.params)])
        floats = [b for b in self.model.buffers() if b.is_floating_point()]
        flat = torch.cat([deltas, *(b.reshape(-1) for b in floats)]).div_(world)
        self.bytes_sent += flat.nbytes
        dist.all_reduce(flat)  # one message per round: the averaged pseudo-gradients
        averaged = flat.split([p.numel() for p in self.params] + [b.numel() for b in floats])
        for b, average in zip(floats, averaged[len(self.params):]):
            b.copy_(average.view_as(b))
        for b in self.model.buffers():
            if not b.is_floating_point():
                dist.broadcast(b, src=0)  # counters (BatchNorm's batches seen): rank 0's
        return [a.view_as(p).clone() for a, p in zip(averaged, self.params)]

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "outer": self.outer.state_dict(),
                "start": [s.clone() for s in self.start], "inner_steps": self.inner_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.outer.load_state_dict(state["outer"])
        with torch.no_grad():
            for s, saved in zip(self.start, state["start"]):
                s.copy_(saved)
        self.inner_steps = state["inner_steps"]
