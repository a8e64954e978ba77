"""Chapter 02: the textbook's LeNet, written with bare parameter tensors (and chapter 01's
profile of it, step by step)."""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

LENET_SHAPES = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]


def init_lenet_params(seed: int = 0, scale: float = 0.01) -> list[torch.Tensor]:
    """LeNet's eight parameters on the CPU: weights ``randn * scale``, biases zero."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale if len(s) > 1 else torch.zeros(s)
            for s in LENET_SHAPES]


def lenet(X: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """Logits for images X of shape (n, 1, 28, 28): two conv/relu/avg-pool stages, two dense."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    h = F.avg_pool2d(F.relu(F.conv2d(X, W1, b1)), kernel_size=2, stride=2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, W2, b2)), kernel_size=2, stride=2)
    h = F.relu(h.reshape(h.shape[0], -1) @ W3 + b3)
    return h @ W4 + b4


def loss(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy per example (the caller sums, so shards add up to the whole batch)."""
    return F.cross_entropy(y_hat, y, reduction="none")


def profile_steps(steps: list[tuple[str, Callable, list[torch.Tensor]]],
                  X: torch.Tensor) -> list[dict]:
    """Chapter 01: run steps, each (name, function, parameters used), in order from X; return
    one row per step: params, out, acts, macs, gather and exchanges, counted for X."""
    rows, h = [], X
    for name, step, used in steps:
        out = step(h)
        is_view = out.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
        rows.append({"layer": name,
                     "params": sum(p.numel() for p in used),
                     "out": out.numel(),
                     "acts": 0 if is_view else out.numel(),
                     "macs": out.numel() * used[0].numel() // out.shape[1] if used else 0,
                     "gather": h.numel() if used and h is not X else 0,
                     "exchanges": 1 if used and h is not X else 0})
        h = out
    return rows


class LeNet(nn.Module):
    """The same LeNet as an nn.Module, for the wrappers of chapter 06 (nn.DataParallel and ours)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in params])

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return lenet(X, list(self.params))


class DropoutLeNet(LeNet):
    """LeNet with dropout p on the input of each dense layer while training (train_ddp
    --dropout): the same parameters, under the same state_dict keys."""

    def __init__(self, params: list[torch.Tensor], p: float) -> None:
        super().__init__(params)
        self.p = p

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        W1, b1, W2, b2, W3, b3, W4, b4 = self.params
        h = F.avg_pool2d(F.relu(F.conv2d(X, W1, b1)), kernel_size=2, stride=2)
        h = F.avg_pool2d(F.relu(F.conv2d(h, W2, b2)), kernel_size=2, stride=2)
        h = F.relu(F.dropout(h.reshape(h.shape[0], -1), self.p, self.training) @ W3 + b3)
        return F.dropout(h, self.p, self.training) @ W4 + b4


class DropoutLinear(nn.Linear):
    """nn.Linear with dropout p on its input while training: in a Sequential it keeps its
    index, so the state_dict keys and chapter 10's unit names stay those without dropout."""

    def __init__(self, in_features: int, out_features: int, p: float) -> None:
        super().__init__(in_features, out_features)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.dropout(x, self.p, self.training))


def lenet_model(seed: int = 0, dropout: float = 0.0) -> LeNet:
    """The course's LeNet as an nn.Module, weights drawn from seed at the CPU scale 0.1; with
    dropout p > 0 before each dense layer."""
    params = init_lenet_params(seed, scale=0.1)
    return DropoutLeNet(params, dropout) if dropout else LeNet(params)


@torch.no_grad()
def lenet_layers(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    """The same LeNet (the same weights as lenet_model(seed)) built from nn.Conv2d and nn.Linear
    layers, which a wrapper can take one by one (chapter 10's units); with dropout p > 0, its
    dense layers are DropoutLinear (the same indices and keys)."""
    W1, b1, W2, b2, W3, b3, W4, b4 = init_lenet_params(seed, scale=0.1)
    dense = partial(DropoutLinear, p=dropout) if dropout else nn.Linear
    model = nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2),
                          nn.Conv2d(20, 50, 5), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                          dense(800, 128), nn.ReLU(), dense(128, 10))
    layers = [m for m in model if isinstance(m, (nn.Conv2d, nn.Linear))]
    for layer, weight, bias in zip(layers, (W1, W2, W3.T, W4.T), (b1, b2, b3, b4)):
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return model
