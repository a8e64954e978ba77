"""Chapter 06: nn.DataParallel built by hand: scatter, replicate, apply in device order, gather;
SGD steps through any wrapper, and the bytes nn.DataParallel moves through device 0."""
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


def sgd_steps(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float,
              device: torch.device) -> list[torch.Tensor]:
    """SGD steps of model (wrapped or not) on batches moved to device, with the mean cross
    entropy through torch.optim; returns the parameters after the last step, on the CPU."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for X, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X.to(device)), y.to(device)).backward()
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()]


def max_relative_difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Largest difference between two parameter lists, relative to each wanted tensor's scale."""
    return max(float((g.detach().cpu() - w).abs().max() / w.abs().max())
               for g, w in zip(got, want))


def bytes_through_device0(n_params: int, n_in: int, n_out: int, k: int,
                          per_device: int = 256, bytes_per_number: int = 4) -> dict[str, float]:
    """Bytes nn.DataParallel moves through device 0 in one step on k devices, counted for a
    model of n_params numbers with n_in inputs and n_out outputs per example."""
    batch, others = per_device * k, k - 1
    return {"replicate": others * n_params * bytes_per_number,
            "scatter": others / k * batch * n_in * bytes_per_number,
            "gather": others / k * batch * n_out * bytes_per_number,
            "reduce grads": others * n_params * bytes_per_number}
