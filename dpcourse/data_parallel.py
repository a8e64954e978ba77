"""Chapter 06: nn.DataParallel built by hand: scatter, replicate, apply in device order, gather."""
from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from .collectives import check_devices
from .split import scatter


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices share memory (all simulated CPU devices are the one CPU)."""
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


def replicate(module: nn.Module, devs: list[torch.device]) -> list[dict[str, torch.Tensor]]:
    """The module's parameters and buffers for each device: the originals on the first device,
    differentiable copies on the others, so gradients flow back to the original parameters."""
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name, t in state.items():
        if not same_device(t.device, devs[0]):
            raise ValueError(f"the module must be on {devs[0]}, the first device, "
                             f"but {name} is on {t.device}")
    return [state] + [{name: t.to(d, copy=True) for name, t in state.items()} for d in devs[1:]]


def parallel_apply(module: nn.Module, states: list[dict[str, torch.Tensor]],
                   shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """The module run with each device's state on that device's shard, one after the other."""
    return [functional_call(module, state, (shard,)) for state, shard in zip(states, shards)]


def gather(outputs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The outputs concatenated along dim 0 on device (gradients flow back to each shard)."""
    return torch.cat([o.to(device) for o in outputs])


class ScratchDataParallel(nn.Module):
    """nn.DataParallel from scratch; works on simulated CPU devices, where PyTorch's refuses."""

    def __init__(self, module: nn.Module, devs: list[torch.device]) -> None:
        super().__init__()
        check_devices(devs, "ScratchDataParallel")
        self.module, self.devs = module, list(devs)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if X.shape[0] == 0:
            raise ValueError("empty batch: the input has no examples")
        shards = scatter(X, self.devs)
        states = replicate(self.module, self.devs[:len(shards)])
        return gather(parallel_apply(self.module, states, shards), self.devs[0])
