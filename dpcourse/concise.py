"""Chapter 06: training any nn.Module on k devices through a data-parallel wrapper."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from .data import load_fashion_mnist
from .hardware import Timer
from .resnet import init_weights, resnet18
from .training import TrainResult


@dataclass
class ResNetSettings:
    """The textbook's concise section, per device: batch 256 and lr 0.1, 10 epochs."""
    batch_per_device: int = 256
    lr_per_device: float = 0.1
    num_epochs: int = 10
    train_size: int | None = None
    test_size: int | None = None

    @classmethod
    def for_devices(cls, devs: list[torch.device]) -> "ResNetSettings":
        """The textbook's on accelerators; on the CPU a few steps only (ResNet-18 is slow there)."""
        if all(d.type == "cpu" for d in devs):
            return cls(batch_per_device=8, lr_per_device=0.1 * 8 / 256, num_epochs=1,
                       train_size=16, test_size=16)
        return cls()


def make_resnet18(device: torch.device, seed: int = 0) -> nn.Module:
    """The course's ResNet-18 with the textbook's init_weights reaching every layer, on device;
    the same seed gives the same weights, so runs on different wrappers start alike."""
    torch.manual_seed(seed)
    net = resnet18()
    net.apply(init_weights)
    return net.to(device)


def warm_up(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> None:
    """One untimed forward and backward pass (first-call allocations and kernel choices); the
    gradients and batch-norm statistics it leaves are discarded, so training is unchanged."""
    model.train()
    buffers = [b.clone() for b in model.buffers()]
    nn.functional.cross_entropy(model(X), y).backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)


def evaluate_module(model: nn.Module, data_iter, device: torch.device) -> float:
    """Accuracy of model (wrapped or not) over data_iter, inputs moved to device."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for X, y in data_iter:
            correct += int((model(X.to(device)).argmax(1) == y.to(device)).sum())
            total += y.numel()
    return correct / total


def train_module_epoch(model: nn.Module, train_iter, optimizer: torch.optim.Optimizer,
                       device: torch.device, bar: tqdm) -> torch.Tensor:
    """One epoch of SGD steps on model (wrapped or not), each batch moved to device (the first
    device: a wrapper scatters from there). Returns the summed loss, a tensor on device."""
    model.train()
    total = torch.zeros((), device=device)
    for X, y in train_iter:
        X, y = X.to(device), y.to(device)
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.detach() * y.numel()
        bar.update()
    return total


def train_module(model: nn.Module, devs: list[torch.device], settings: ResNetSettings,
                 seed: int = 0, progress: bool = True) -> TrainResult:
    """Train model (already wrapped for devs) with batch and lr scaled by the device count."""
    k = len(devs)
    batch_size, lr = settings.batch_per_device * k, settings.lr_per_device * k
    train_iter, test_iter = load_fashion_mnist(batch_size, settings.train_size,
                                               settings.test_size, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    result = TrainResult([str(d) for d in devs], settings, train_iter.dataset.source)
    X, y = next(iter(test_iter))  # the ordered test loader: the training order is unchanged
    warm_up(model, X.to(devs[0]), y.to(devs[0]))
    timer = Timer(devs)
    with tqdm(total=settings.num_epochs * len(train_iter), desc=f"{k} device(s)",
              disable=not progress) as bar:
        for _ in range(settings.num_epochs):
            with timer:
                total = train_module_epoch(model, train_iter, optimizer, devs[0], bar)
            result.epoch_seconds.append(timer.times[-1])
            result.train_loss.append(float(total) / len(train_iter.dataset))
            result.test_acc.append(evaluate_module(model, test_iter, devs[0]))
            bar.set_postfix(loss=f"{result.train_loss[-1]:.3f}", acc=f"{result.test_acc[-1]:.3f}")
    return result
