"""Chapter 05: hand-written data-parallel training of LeNet on k devices."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import torch
from tqdm import tqdm

from .collectives import allreduce, check_devices, get_params
from .data import load_fashion_mnist
from .hardware import Timer, devices
from .lenet import init_lenet_params, lenet, loss
from .split import split_batch


def sgd(params: list[torch.Tensor], lr: float, batch_size: int) -> None:
    """One SGD step with gradients summed over batch_size examples; clears the gradients."""
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad / batch_size
            p.grad = None


def check_replicas(device_params: list[list[torch.Tensor]], devs: list[torch.device]) -> None:
    """Raise a clear error unless there is one parameter replica per device."""
    check_devices(devs, "data-parallel training")
    if len(device_params) != len(devs):
        raise ValueError(f"one parameter replica per device is needed: {len(devs)} device(s), "
                         f"{len(device_params)} replica(s)")


def train_batch(X: torch.Tensor, y: torch.Tensor, device_params: list[list[torch.Tensor]],
                devs: list[torch.device], lr: float,
                allreduce: Callable[[list[torch.Tensor]], Any] = allreduce) -> torch.Tensor:
    """One data-parallel SGD step: forward/backward per device, allreduce, identical update.

    `allreduce` sums a list of tensors in place (chapter 03's naive one or `ring_allreduce`).
    Returns the summed loss of the batch (a tensor on the first device).
    """
    check_replicas(device_params, devs)
    X_shards, y_shards = split_batch(X, y, devs)
    losses = [loss(lenet(Xs, p), ys).sum()
              for Xs, ys, p in zip(X_shards, y_shards, device_params)]
    for l in losses:
        l.backward()
    for params in device_params[len(losses):]:  # idle devices: a batch smaller than k
        for p in params:
            p.grad = torch.zeros_like(p)
    for grads in zip(*[[p.grad for p in params] for params in device_params]):
        allreduce(list(grads))
    for params in device_params:
        sgd(params, lr, X.shape[0])
    return sum(l.detach().to(devs[0]) for l in losses)


def train_steps(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], devs: list[torch.device],
                lr: float, *, seed: int = 0, init_scale: float = 0.1,
                dtype: torch.dtype = torch.float32,
                allreduce: Callable[[list[torch.Tensor]], Any] = allreduce
                ) -> Iterator[list[list[torch.Tensor]]]:
    """Train LeNet (in dtype) with train_batch on batches; yield the replicas after each step."""
    params = [p.to(dtype) for p in init_lenet_params(seed, init_scale)]
    device_params = [get_params(params, d) for d in devs]
    for X, y in batches:
        train_batch(X.to(dtype), y, device_params, devs, lr, allreduce)
        yield device_params


def largest_difference(run_a: list[list[torch.Tensor]], run_b: list[list[torch.Tensor]]) -> float:
    """The largest absolute difference between a parameter of any replica of run_a and of run_b."""
    return max(float((p - q.to(p.device)).abs().max().detach())
               for replica_a in run_a for replica_b in run_b
               for p, q in zip(replica_a, replica_b))


def divergence(batches: list[tuple[torch.Tensor, torch.Tensor]], devs: list[torch.device],
               lr: float, ks: Iterable[int] = (2, 4, 8), *, dtype: torch.dtype = torch.float32,
               init_scale: float = 0.1) -> dict[str, list[float]]:
    """Per step, how far the replicas of a run on devs[:k] are from a run on devs[:1], for each
    k, and how far a one-device run from seed 1 is (the same steps, all in lockstep)."""
    def run(k: int, seed: int = 0) -> Iterator[list[list[torch.Tensor]]]:
        return train_steps(batches, devs[:k], lr, seed=seed, init_scale=init_scale, dtype=dtype)

    others = {f"{k} devices": run(k) for k in ks} | {"seed 1, 1 device": run(1, seed=1)}
    curves: dict[str, list[float]] = {name: [] for name in others}
    for reference, *runs in zip(run(1), *others.values()):
        for name, replicas in zip(others, runs):
            curves[name].append(largest_difference(replicas, reference))
    return curves


def sgd_displacement(params: list[torch.Tensor],
                     batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                     lr: float) -> torch.Tensor:
    """Plain SGD on one device from params (in their dtype), one step per batch; returns how far
    the parameters moved, flattened into one vector. params themselves stay unchanged."""
    ps = [p.detach().clone().requires_grad_() for p in params]
    for X, y in batches:
        loss(lenet(X.to(ps[0].dtype), ps), y).sum().backward()
        sgd(ps, lr, len(y))
    return torch.cat([(p - p0).detach().flatten() for p, p0 in zip(ps, params)])


def evaluate_accuracy(data_iter, device_params: list[list[torch.Tensor]],
                      devs: list[torch.device]) -> float:
    """Test accuracy with each batch split across all devices, each using its own replica."""
    check_replicas(device_params, devs)
    correct, total = 0, 0
    with torch.no_grad():
        for X, y in data_iter:
            X_shards, y_shards = split_batch(X, y, devs)
            correct += sum(int((lenet(Xs, p).argmax(1) == ys).sum())
                           for Xs, ys, p in zip(X_shards, y_shards, device_params))
            total += y.numel()
    return correct / total


@dataclass
class Settings:
    """Training settings; `for_devices` sizes them to the hardware."""
    batch_size: int = 256
    lr: float = 0.2
    num_epochs: int = 10
    init_scale: float = 0.01  # the textbook's; LeNet then leaves its plateau later (chapter 02)
    train_size: int | None = None  # None: the whole split
    test_size: int | None = None

    @classmethod
    def for_devices(cls, devs: list[torch.device]) -> "Settings":
        """The textbook's settings on accelerators. On the CPU: a subset and fewer epochs, weights
        drawn 10x larger so that LeNet leaves its plateau within 48 steps, and half the learning
        rate so that the loss never climbs back above its start (chapter 02 shows both)."""
        if all(d.type == "cpu" for d in devs):
            return cls(lr=0.1, num_epochs=3, init_scale=0.1, train_size=4_096, test_size=1_024)
        return cls()


@dataclass
class TrainResult:
    """What a training run measured, epoch by epoch."""
    devices: list[str]
    settings: Any  # Settings, or chapter 06's ResNetSettings
    data: str
    train_loss: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    step_loss: list[float] = field(default_factory=list)  # mean loss of each minibatch
    replica_spread: float = 0.0  # largest difference between any replica and device 0's

    @property
    def seconds_per_epoch(self) -> float:
        return sum(self.epoch_seconds) / len(self.epoch_seconds)

    def __str__(self) -> str:
        return (f"{len(self.devices)} device(s): test acc {self.test_acc[-1]:.3f}, "
                f"{self.seconds_per_epoch:.2f} s/epoch on {', '.join(self.devices)}")


def train_epoch(train_iter, device_params: list[list[torch.Tensor]], devs: list[torch.device],
                lr: Callable[[int], float], first_step: int,
                allreduce: Callable[[list[torch.Tensor]], Any], bar: tqdm
                ) -> list[tuple[torch.Tensor, int]]:
    """One epoch of train_batch steps at rate lr(step), counting steps from first_step.
    Returns (summed loss, batch size) of every step; the losses stay tensors on the device,
    so reading them does not wait for the devices inside the timed epoch."""
    losses = []
    for X, y in train_iter:
        step_lr = lr(first_step + len(losses))
        losses.append((train_batch(X, y, device_params, devs, step_lr, allreduce), len(y)))
        bar.update()
    return losses


def record_epoch(result: TrainResult, seconds: float, losses: list[tuple[torch.Tensor, int]],
                 test_acc: float, bar: tqdm) -> None:
    """Add one epoch's time, mean training loss, step losses and test accuracy to result, and
    show the loss and accuracy on the progress bar."""
    result.epoch_seconds.append(seconds)
    result.train_loss.append(sum(float(l) for l, _ in losses) / sum(n for _, n in losses))
    result.step_loss += [float(l) / n for l, n in losses]
    result.test_acc.append(test_acc)
    bar.set_postfix(loss=f"{result.train_loss[-1]:.3f}", acc=f"{test_acc:.3f}")


def settings_for(devs: list[torch.device], **given: Any) -> Settings:
    """Settings.for_devices(devs), with every given value that is not None put in its place."""
    return replace(Settings.for_devices(devs), **{k: v for k, v in given.items() if v is not None})


def train(num_devices: int | None = None, batch_size: int | None = None,
          lr: float | None = None, num_epochs: int | None = None, *,
          devs: list[torch.device] | None = None, train_size: int | None = None,
          test_size: int | None = None, seed: int = 0, source: str | None = None,
          allreduce: Callable[[list[torch.Tensor]], Any] = allreduce,
          lr_schedule: Callable[[int], float] | None = None, progress: bool = True) -> TrainResult:
    """Train LeNet on num_devices devices (or devs); lr_schedule(step), if given, replaces lr."""
    devs = devs or devices(num_devices)
    s = settings_for(devs, batch_size=batch_size, lr=lr, num_epochs=num_epochs,
                     train_size=train_size, test_size=test_size)
    train_iter, test_iter = load_fashion_mnist(s.batch_size, s.train_size, s.test_size,
                                               source, seed)
    device_params = [get_params(init_lenet_params(seed, s.init_scale), d) for d in devs]
    result, timer = TrainResult([str(d) for d in devs], s, train_iter.dataset.source), Timer(devs)
    with tqdm(total=s.num_epochs * len(train_iter), desc=f"{len(devs)} device(s)",
              disable=not progress) as bar:
        for _ in range(s.num_epochs):
            with timer:
                losses = train_epoch(train_iter, device_params, devs,
                                     lr_schedule or (lambda _: s.lr), len(result.step_loss),
                                     allreduce, bar)
            record_epoch(result, timer.times[-1], losses,
                         evaluate_accuracy(test_iter, device_params, devs), bar)
    result.replica_spread = largest_difference(device_params, device_params[:1])
    return result
