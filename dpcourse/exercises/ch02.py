"""Checkers for chapter 02 (LeNet from scratch on one device)."""
from __future__ import annotations

import itertools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..lenet import LENET_SHAPES, init_lenet_params
from ..training import TrainResult

PLATEAU_MARGIN = 0.1  # a run has left the plateau once a batch's loss is this far below ln 10
PLATEAU_STEPS = 48  # exercise 2's per-step losses per scale
# Exercise 5 on a CPU: train(1) runs the baseline loop's operations in the same order on the same
# device, and both add the epoch's losses as Python floats, so the results must be identical.
# On a GPU, some kernels (cuDNN's convolution backward) may add in a different order on every run;
# SGD carries those rounding differences into later steps, so GPU runs get this relative tolerance
# on the loss, and this much on the test accuracy: far above rounding, far below what another
# seed, learning rate or batch order changes.
GPU_LOSS_RTOL = 1e-3
GPU_ACC_ATOL = 0.01
NAMES = ["W1", "b1", "W2", "b2", "W3", "b3", "W4", "b4"]


def check_best_lr(answer: float | None, results: dict[float, TrainResult]) -> None:
    """Exercise 1: the learning rate whose run reached the highest final test accuracy."""
    if answer is None:
        return print("not answered yet")
    wrong = {lr: r.settings.lr for lr, r in results.items() if r.settings.lr != lr}
    if wrong:
        return print("not quite: " + "; ".join(f"results[{lr}] was trained with lr {used}"
                                              for lr, used in wrong.items()))
    if len(results) < 2:
        return print("train with at least two learning rates to compare them")
    best = max(results, key=lambda lr: results[lr].test_acc[-1])
    if answer not in results:
        return print(f"not quite: you did not train with lr {answer}; you tried {sorted(results)}")
    if results[answer].test_acc[-1] == results[best].test_acc[-1]:
        return print(f"correct: lr {answer} reached test acc {results[answer].test_acc[-1]:.3f}, "
                     f"the highest of the {len(results)} runs")
    print(f"not quite: lr {best} reached {results[best].test_acc[-1]:.3f}, "
          f"lr {answer} only {results[answer].test_acc[-1]:.3f}")


def leaves_plateau(losses: list[float]) -> bool:
    """Whether some batch's loss fell PLATEAU_MARGIN below ln 10."""
    return min(losses) < math.log(10) - PLATEAU_MARGIN


def check_plateau_scale(answer: float | None, curves: dict[float, list[float]]) -> None:
    """Exercise 2: the smallest initial scale (of those tried) that leaves the plateau."""
    if answer is None:
        return print("not answered yet")
    if len(curves) < 3:
        return print("try at least three scales (0.02, 0.03 and 0.05)")
    short = {scale: len(losses) for scale, losses in curves.items() if len(losses) < PLATEAU_STEPS}
    if short:
        return print("not quite: " + "; ".join(f"curves[{scale}] has {n} losses" for scale, n
                                              in short.items())
                     + f"; append the loss of each of the {PLATEAU_STEPS} steps")
    if answer not in curves:
        return print(f"not quite: you did not try {answer}; you tried {sorted(curves)}")
    leaving = sorted(scale for scale, losses in curves.items() if leaves_plateau(losses))
    if not leaving:
        return print("none of your runs left the plateau: try larger scales or more steps")
    if answer == leaving[0]:
        return print(f"correct: scale {answer} is the smallest of {sorted(curves)} whose loss "
                     f"fell {PLATEAU_MARGIN} below ln 10")
    if not leaves_plateau(curves[answer]):
        return print(f"not quite: with scale {answer} the loss never fell {PLATEAU_MARGIN} "
                     f"below ln 10 (lowest {min(curves[answer]):.3f})")
    print(f"not quite: scale {leaving[0]} also left the plateau, and it is smaller")


def check_param_count(answer: int | str | None) -> None:
    """Exercise 3: LeNet's parameter count with 32 filters in the first convolution."""
    if answer is None:
        return print("not answered yet")
    try:
        answer = int(answer)
    except ValueError:
        return print(f"not quite ({answer!r}): give a whole number (an int), such as 129068")
    shapes = [(32, 1, 3, 3), (32,), (50, 32, 5, 5), (50,)] + LENET_SHAPES[4:]
    expected = sum(math.prod(shape) for shape in shapes)
    if answer == expected:
        return print("correct")
    growth = {"W1": 12 * 9, "b1": 12, "W2": 50 * 12 * 25}  # each tensor's growth from 20 to 32
    reasons = {"W1": "W1 grows too: 32 filters of 1 x 3 x 3",
               "b1": "b1 grows too: one bias per filter, 32 instead of 20",
               "W2": "W2 changes too: it has one 5x5 slice per input channel, 32 now"}
    forgotten = [kept for r in (1, 2) for kept in itertools.combinations(growth, r)
                 if answer == expected - sum(growth[name] for name in kept)]
    if forgotten:
        hint = "; ".join(reasons[name] for name in forgotten[0])
    elif answer <= 129_068:
        hint = "more filters means more parameters, not fewer"
    elif answer < expected:
        hint = "count W1 (32 x 1 x 3 x 3), b1 (32) and W2 (50 x 32 x 5 x 5) for 32 filters"
    else:
        hint = "only W1, b1 and W2 change: the second stage still gives 50 x 4 x 4 = 800 values"
    print(f"not quite ({answer:,}): {hint}")


def check_flat_size(answer: int | None) -> None:
    """Exercise 4: the flattened size for 32 x 32 images, found by running the stages."""
    if answer is None:
        return print("not answered yet")
    W1, b1, W2, b2 = init_lenet_params()[:4]
    h = F.avg_pool2d(F.relu(F.conv2d(torch.zeros(1, 1, 32, 32), W1, b1)), 2, 2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, W2, b2)), 2, 2)
    print("correct" if answer == h.numel() else
          f"not quite ({answer}): follow one side through conv (-k+1) and pool (halve, round down)")


def check_same_as_baseline(result: TrainResult | None, epoch_loss: list[float],
                           test_acc: list[float]) -> None:
    """Exercise 5: does train(1) reproduce the baseline loop's losses and accuracies?"""
    if result is None:
        return print("not answered yet")
    if len(result.train_loss) != len(epoch_loss):
        return print(f"expected {len(epoch_loss)} epochs, got {len(result.train_loss)}: "
                     "use the same settings as the baseline")
    loss_gap = max(abs(a - b) / b for a, b in zip(result.train_loss, epoch_loss))
    acc_gap = max(abs(a - b) for a, b in zip(result.test_acc, test_acc))
    if loss_gap == 0 and acc_gap == 0:
        return print("correct: identical losses and accuracies, the same steps as the baseline")
    if all(d.startswith("cpu") for d in result.devices):
        return print(f"different: losses differ by up to {loss_gap:.1e} relative, accuracies by "
                     f"{acc_gap:.3f}; on the CPU they must be identical: same data, settings "
                     "and seed as the baseline?")
    if loss_gap <= GPU_LOSS_RTOL and acc_gap <= GPU_ACC_ATOL:
        return print(f"correct on a GPU: losses agree to {loss_gap:.0e} relative (tolerance "
                     f"{GPU_LOSS_RTOL:.0e}), accuracies to {acc_gap:.3f}: rounding from "
                     "kernels that add in a varying order")
    print(f"different: losses differ by up to {loss_gap:.1e} relative, accuracies by "
          f"{acc_gap:.3f}. On a GPU some kernels (cuDNN's convolution backward) may add in a "
          "different order on every run. For identical runs, set the environment variable "
          "CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts (restart the kernel, set it in the "
          "first cell), then call torch.use_deterministic_algorithms(True) before both runs")


def check_lenet(lenet: Callable) -> None:
    """Your lenet(X, params): the logits of the same network built from torch.nn's modules
    with the same weights, and gradients that reach every parameter."""
    params = [p.requires_grad_() for p in init_lenet_params(seed=1, scale=0.1)]
    X = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    try:
        got = lenet(X, params)
    except RuntimeError as error:
        if "cannot be multiplied" not in str(error):
            raise
        raise AssertionError(f"a dense layer got the wrong shape ({str(error).splitlines()[0]}): "
                             "flatten each image, not the whole batch: h.reshape(h.shape[0], -1)"
                             ) from None
    net = nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(20, 50, 5),
                        nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(800, 128),
                        nn.ReLU(), nn.Linear(128, 10))
    with torch.no_grad():
        for layer, (W, b) in zip([net[0], net[3], net[7], net[9]], zip(params[::2], params[1::2])):
            layer.weight.copy_(W if isinstance(layer, nn.Conv2d) else W.T)
            layer.bias.copy_(b)
        want = net(X)
    assert isinstance(got, torch.Tensor) and got.shape == (3, 10), (
        f"3 images should give logits of shape (3, 10), got "
        f"{tuple(got.shape) if isinstance(got, torch.Tensor) else got!r}")
    gap = float((got.detach() - want).abs().max())
    assert gap <= 1e-4 * float(want.abs().max()), (
        f"your logits differ from LeNet's by up to {gap:.2g}: conv, relu, avg-pool 2x2, "
        "twice, then flatten, dense, relu, dense")
    got.sum().backward()
    missing = [name for name, p in zip(NAMES, params) if p.grad is None]
    assert not missing, f"no gradient reached {missing}: compute with the parameters themselves"
    print("lenet is right: the logits of torch.nn's LeNet with the same weights, and gradients "
          "for all eight parameters")


def check_sgd(sgd: Callable) -> None:
    """Your sgd(params, lr, batch_size): p -= lr * p.grad / batch_size in place, not recorded
    by autograd, and the gradients cleared."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 2, generator=g).requires_grad_(),
              torch.randn(4, generator=g).requires_grad_()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    want = [(p - 0.5 * p.grad / 8).detach() for p in params]
    before = [p.detach().clone() for p in params]
    tensors, memory = list(params), [p.data_ptr() for p in params]
    try:
        sgd(params, 0.5, 8)
    except RuntimeError as error:
        if "leaf Variable that requires grad" not in str(error):
            raise
        raise AssertionError("sgd changed a parameter in place while autograd records, which "
                             "torch refuses for a leaf that requires grad: update it under "
                             "torch.no_grad()") from None
    for i, p in enumerate(params):
        assert p is tensors[i] and p.data_ptr() == memory[i], (
            f"parameter {i} is a new tensor: update it in place (p -= ...)")
        assert p.is_leaf and p.grad_fn is None and p.requires_grad, (
            f"parameter {i} is no longer a leaf that requires grad: update it under "
            "torch.no_grad()")
        assert not torch.equal(p.detach(), before[i]), (
            f"parameter {i} did not change: the update was not in place (p = p - ... only "
            "rebinds the name p); write p -= ...")
        gap = float((p.detach() - want[i]).abs().max())
        assert gap <= 1e-6, (f"parameter {i} is off by up to {gap:.2g} from "
                             "p - lr * p.grad / batch_size")
        assert p.grad is None, f"parameter {i} still has a gradient: set p.grad = None"
    print("sgd is right: p -= lr * p.grad / batch_size in place, unrecorded, gradients cleared")


def check_sgd_momentum(sgd_momentum: Callable | None, momentum: float = 0.9) -> None:
    """Exercise 6: three steps of sgd_momentum(params, buffers, lr, batch_size, momentum) equal
    three steps of torch.optim.SGD(lr=lr, momentum=momentum) on the mean gradient."""
    if sgd_momentum is None:
        return print("not answered yet")
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 2, generator=g).requires_grad_(),
              torch.randn(4, generator=g).requires_grad_()]
    twins = [p.detach().clone().requires_grad_() for p in params]
    optimizer = torch.optim.SGD(twins, lr=0.5, momentum=momentum)
    buffers = [None] * len(params)
    for step in range(1, 4):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=g)  # summed over a batch of 8
            q.grad = p.grad / 8
        sgd_momentum(params, buffers, 0.5, 8, momentum)
        optimizer.step()
        gap = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, twins))
        if gap > 1e-5:
            return print(f"not quite: after step {step} the parameters differ from "
                         f"torch.optim.SGD's by up to {gap:.2g}" + (
                             ": the first step's buffer is the gradient itself"
                             if step == 1 else ": buf = momentum * buf + p.grad / batch_size"))
        if any(p.grad is not None for p in params):
            return print("not quite: clear the gradients (p.grad = None), as sgd does")
    print(f"correct: three steps equal torch.optim.SGD(momentum={momentum})")
