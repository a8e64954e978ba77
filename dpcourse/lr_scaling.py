"""Chapter 08: the linear scaling rule for the learning rate, with warm-up (Goyal et al. 2017).

With k times the batch, take k times the learning rate: one step on kB examples then moves
the parameters about as far as k steps on B examples would. Early in training, when the
gradient changes fast, that approximation is poor, so the rate climbs linearly to k times
over the first steps (warm-up). Chapter 07 showed that DDP on k ranks takes the same steps
as one process on the global batch, so one process is enough to study the rule.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .lenet import LeNet, init_lenet_params


def warmup_lr(lr: float, samples_seen: int, warmup_samples: int) -> float:
    """Linear warm-up: lr * samples_seen / warmup_samples until warmup_samples, then lr.

    samples_seen counts the samples of the step being taken, so the first step has a rate
    above 0; warmup_samples=0 means no warm-up.
    """
    if warmup_samples <= 0 or samples_seen >= warmup_samples:
        return lr
    return lr * samples_seen / warmup_samples


def sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
             y: torch.Tensor, lr: float) -> float:
    """One SGD step at learning rate lr on the batch (X, y); return its loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss = F.cross_entropy(model(X), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def loss_curve(X: torch.Tensor, y: torch.Tensor, batch_size: int, lr: float, samples: int,
               warmup_samples: int = 0, init_scale: float = 0.1, log_every: int = 1024,
               seed: int = 0) -> dict[str, list[float]]:
    """Train LeNet (weights randn * init_scale from seed) with SGD (sgd_step, warmup_lr) on
    batches drawn in one fixed shuffled order of (X, y), whatever batch_size: runs differ only
    by how the samples are grouped into steps. Return {"samples", "loss"}: the mean training
    loss of each interval of log_every samples."""
    if samples % log_every or log_every % batch_size:
        raise ValueError(f"batch_size ({batch_size}) must divide log_every ({log_every}), "
                         f"which must divide samples ({samples})")
    model = LeNet(init_lenet_params(seed, scale=init_scale))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    order = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))
    curve: dict[str, list[float]] = {"samples": [], "loss": []}
    losses = []
    for seen in range(batch_size, samples + 1, batch_size):
        idx = order[torch.arange(seen - batch_size, seen) % len(X)]
        rate = warmup_lr(lr, seen, warmup_samples)
        losses.append(sgd_step(model, opt, X[idx], y[idx], rate))
        if seen % log_every == 0:
            curve["samples"].append(seen)
            curve["loss"].append(sum(losses) / len(losses))
            losses = []
    return curve


def scaling_rule_runs(X: torch.Tensor, y: torch.Tensor, batch_size: int, lr: float, k: int,
                      samples: int, warmup_samples: int,
                      init_scale: float = 0.1) -> dict[str, dict[str, list[float]]]:
    """loss_curve of four runs over the same samples: batch_size with lr; k * batch_size with
    lr; with k * lr (the linear scaling rule); with k * lr and warm-up over warmup_samples."""
    big = k * batch_size
    runs = {f"B={batch_size}, lr {lr:g}": (batch_size, lr, 0),
            f"B={big}, lr {lr:g}": (big, lr, 0),
            f"B={big}, lr {k * lr:g}": (big, k * lr, 0),
            f"B={big}, lr {k * lr:g}, warm-up": (big, k * lr, warmup_samples)}
    return {label: loss_curve(X, y, b, rate, samples, warmup, init_scale)
            for label, (b, rate, warmup) in runs.items()}
