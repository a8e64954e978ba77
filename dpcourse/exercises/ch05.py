"""Checkers for chapter 05's exercises (training on k devices)."""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..collectives import allreduce, get_params
from ..hardware import devices
from ..lenet import init_lenet_params, lenet, loss
from ..training import Settings, sgd, train_batch
from . import answered, count


def check_steps(answer: int | None) -> None:
    """Exercise 1: the number of SGD steps of train(4, batch_size=1024) with this machine's
    default settings."""
    if answer is None:
        return print("not answered yet")
    s = Settings.for_devices(devices(4))
    per_epoch = math.ceil((s.train_size or 60_000) / 1024)
    expected = s.num_epochs * per_epoch
    if answer == expected:
        print(f"correct: {s.num_epochs} epochs of {per_epoch} steps")
    elif answer == per_epoch:
        print("not quite: that is one epoch; count all of them")
    else:
        print("not quite: count ceil(training images / 1024) steps per epoch, times the epochs")


def _largest_update_difference(k: int, lr: float) -> tuple[float, float]:
    """One step of train_batch on k simulated devices, 64 images each, at lr, against one plain
    step on one device on the same 64k images at the rule's 0.025k. Returns the largest
    difference of a parameter (relative to that parameter's largest reference update) and how
    far the step moved, as a multiple of the reference step's length."""
    g = torch.Generator().manual_seed(k)
    X, y = torch.rand(64 * k, 1, 28, 28, generator=g), torch.randint(0, 10, (64 * k,), generator=g)
    params = init_lenet_params(0, scale=0.1)
    ref = get_params(params, torch.device("cpu"))
    loss(lenet(X, ref), y).sum().backward()
    sgd(ref, 0.025 * k, 64 * k)
    devs = devices(k, simulate=True)
    replicas = [get_params(params, d) for d in devs]
    train_batch(X, y, replicas, devs, lr)
    rel = max(float((p.detach() - r.detach()).abs().max() / (r.detach() - p0).abs().max())
              for p, r, p0 in zip(replicas[0], ref, params))
    moved = sum(float((p.detach() - p0).norm() ** 2) for p, p0 in zip(replicas[0], params))
    wanted = sum(float((r.detach() - p0).norm() ** 2) for r, p0 in zip(ref, params))
    return rel, math.sqrt(moved / wanted)


def check_lr_for_k(lr_for: Callable[[int], float] | None) -> None:
    """Exercise 2: lr_for(k), the learning rate for k devices with 64 images each (global batch
    64k) by the linear scaling rule, from 1 device at batch 64 and lr 0.025. Runs one step on
    k = 1, 2, 4, 8 simulated devices and compares every parameter with the rule's step."""
    if lr_for is None:
        return print("not answered yet")
    for k in (1, 2, 4, 8):
        lr = lr_for(k)
        rel, ratio = _largest_update_difference(k, lr)
        if rel > 1e-4:
            where = f"on {count(k, 'device')} (batch {64 * k})"
            if lr <= 0:
                return print(f"not quite: {where} your lr {lr} does not step down the gradient")
            return print(f"not quite: {where} your lr {lr} moves the parameters {ratio:.2f}x as "
                         "far as the linear scaling rule's step. Section 6: k small steps of "
                         "batch 64 at 0.025 are about one step of batch 64k at which rate?")
    print("correct: the rate grows with the global batch, 0.025 per 64 images. (With the global "
          "batch fixed, as in section 2, the rate would not depend on k.)")


def check_warmup(fn: Callable[[int, float, int], float] | None) -> None:
    """Exercise 4: fn(step, lr, steps) starts at lr / 4 at step 0, rises linearly to lr at step
    `steps`, then stays at lr; checked for the CPU settings (lr 0.1) and the textbook's (0.2)."""
    if fn is None:
        return print("not answered yet")
    for lr, steps in ((0.1, 32), (0.2, 470), (0.1, 5)):
        for step in sorted({0, 1, steps // 4, steps // 2, steps - 1, steps, steps + 1, 10 * steps}):
            expected = lr / 4 + (lr - lr / 4) * min(step, steps) / steps
            got = fn(step, lr, steps)
            if abs(got - expected) > 1e-9:
                return print(f"not quite: with lr {lr} and a warm-up of {steps} steps, at step "
                             f"{step} you give {got}, expected {expected:.4f}")
    print("correct")


def _stepwise(params: list[torch.Tensor], X: torch.Tensor, y: torch.Tensor, k: int,
              lr: float) -> list[torch.Tensor]:
    """The wrong accumulation that updates after every micro-batch (k small steps)."""
    ref = get_params(params, torch.device("cpu"))
    for Xs, ys in zip(X.chunk(k), y.chunk(k)):
        loss(lenet(Xs, ref), ys).sum().backward()
        sgd(ref, lr, len(y))
    return [p.detach() for p in ref]


def check_accumulated_step(accumulated_step: Callable | None) -> None:
    """Exercise 5: accumulated_step(X, y, params, lr, k), the k shards one after the other on
    one device, gradients accumulated, one update: the one-device step of the whole batch,
    which train_batch takes on k devices."""
    if not answered(accumulated_step):
        return
    g = torch.Generator().manual_seed(2)
    X, y = torch.rand(10, 1, 28, 28, generator=g), torch.randint(0, 10, (10,), generator=g)
    start = init_lenet_params(0, scale=0.1)
    for k, n in ((1, 10), (2, 10), (3, 10), (4, 10), (4, 3)):
        params = get_params(start, torch.device("cpu"))
        accumulated_step(X[:n], y[:n], params, 0.1, k)
        where = f"batch {n} in {count(k, 'micro-batch', 'micro-batches')}"
        want = _one_device_step(start, X[:n], y[:n], 0.1)
        if _step_problem([params], want, start) is None:
            if any(p.grad is not None for p in params):
                return print(f"not quite: {where}: the step is right, but the gradients are "
                             "still there and the next step would add to them: clear them "
                             "(sgd does)")
            continue
        if _step_problem([params], _mean_per_shard_step(start, X[:n], y[:n], k, 0.1),
                         start) is None:
            return print(f"not quite: {where}: each micro-batch's loss is averaged: sum it "
                         "(.sum()), so that the micro-batches' gradients add up to the batch's")
        if _step_problem([params], _stepwise(start, X[:n], y[:n], k, 0.1), start) is None:
            return print(f"not quite: {where}: you updated after every micro-batch: let the "
                         "gradients add up over all of them, then call sgd once")
        if any(math.isclose(_step_scale(params, want, start), n / len(shard), rel_tol=1e-3)
               for shard in X[:n].chunk(k) if len(shard) < n):
            return print(f"not quite: {where}: the step is as long as if you divided by a "
                         "micro-batch's size: divide the summed gradient by the whole batch, "
                         "X.shape[0]")
        rel = max(float((p.detach() - w).abs().max() / (w - p0).abs().max())
                  for p, w, p0 in zip(params, want, start))
        return print(f"not quite: {where}: your update is {rel:.1e} (relative) away from the "
                     "one-device step of the whole batch (train_batch's on k devices)")
    print("correct: train_batch's step on k devices, taken by one device: the gradients add "
          "up in p.grad, where the allreduce summed them across devices")


def _one_device_step(params: list[torch.Tensor], X: torch.Tensor, y: torch.Tensor,
                            lr: float, wd: float = 0.0) -> list[torch.Tensor]:
    """One plain SGD step on one device: p - lr * (summed gradient / n + wd * p)."""
    ref = get_params(params, torch.device("cpu"))
    loss(lenet(X, ref), y).sum().backward()
    with torch.no_grad():
        return [p - lr * (p.grad / len(y) + wd * p) for p in ref]


def _mean_per_shard_step(params: list[torch.Tensor], X: torch.Tensor, y: torch.Tensor, k: int,
                         lr: float) -> list[torch.Tensor]:
    """The wrong step that averages each of the k shards' losses, then divides by the batch."""
    ref = get_params(params, torch.device("cpu"))
    sum(loss(lenet(Xs, ref), ys).mean() for Xs, ys in zip(X.chunk(k), y.chunk(k))).backward()
    with torch.no_grad():
        return [p - lr * p.grad / len(y) for p in ref]


def _step_problem(device_params: list[list[torch.Tensor]], ref: list[torch.Tensor],
                  params: list[torch.Tensor]) -> str | None:
    """What is wrong with the replicas after a step, against the one-device step ref."""
    for i, replica in enumerate(device_params):
        for j, (p, r, p0) in enumerate(zip(replica, ref, params)):
            rel = float((p.detach() - r).abs().max() / (r - p0).abs().max())
            if rel > 1e-4:
                return (f"replica {i}, parameter {j}: its update is {rel:.1e} (relative) away "
                        "from the one-device step")
        if not all(torch.equal(p, q) for p, q in zip(replica, device_params[0])):
            return f"replica {i} differs from replica 0: every device must apply the same step"
    return None


def _step_scale(replica: list[torch.Tensor], ref: list[torch.Tensor],
                params: list[torch.Tensor]) -> float:
    """How many one-device steps long the replica's step is (projected onto that step)."""
    got = torch.cat([(p.detach() - p0).flatten() for p, p0 in zip(replica, params)])
    want = torch.cat([(r - p0).flatten() for r, p0 in zip(ref, params)])
    return float(got @ want / (want @ want))


def check_train_batch(train_batch: Callable) -> None:
    """Your train_batch: the one-device SGD step on every replica, with the allreduce it is
    given, the summed loss returned, idle devices handled and mismatched replicas refused."""
    g = torch.Generator().manual_seed(0)
    X, y = torch.rand(10, 1, 28, 28, generator=g), torch.randint(0, 10, (10,), generator=g)
    params = init_lenet_params(0, scale=0.1)
    for k, n in ((1, 10), (2, 10), (3, 10), (4, 3)):
        devs, calls = [torch.device("cpu", i) for i in range(k)], []
        replicas = [get_params(params, d) for d in devs]
        where = f"batch {n} on {count(k, 'device')}"

        shards = len(X[:n].chunk(k))  # devices from this index on get no shard

        def given_allreduce(grads: list[torch.Tensor | None]) -> list[int]:
            calls.append(len(grads))
            assert not any(g is p for g in grads for replica in replicas for p in replica), (
                f"{where}: the allreduce got the replicas' parameters, not their gradients: "
                "pass it [params[j].grad for params in device_params], parameter by parameter")
            missing = [i for i, grad in enumerate(grads) if grad is None]
            assert not missing or missing[0] >= shards, (
                f"{where}: device {missing[0]} had a shard but has no gradient at the allreduce: "
                "run every shard's backward first, and sgd (which clears p.grad) only after "
                "the allreduce")
            assert not missing, (f"{where}: device {missing[0]} got no shard and has no "
                                 "gradient: give an idle replica zero gradients "
                                 "(torch.zeros_like)")
            return allreduce(grads)

        got = train_batch(X[:n], y[:n], replicas, devs, 0.1, allreduce=given_allreduce)
        assert calls == [k] * 8, (f"{where}: call the given allreduce once per parameter, "
                                  f"on the list of the replicas' gradients (calls on {calls})")
        ref = _one_device_step(params, X[:n], y[:n], 0.1)
        problem = _step_problem(replicas, ref, params)
        if problem is not None and _step_problem(
                replicas, _mean_per_shard_step(params, X[:n], y[:n], k, 0.1), params) is None:
            problem = ("the step is the one of each shard's mean loss: sum each shard's loss "
                       "(.sum(), not .mean()), so that the shards' gradients add up to the "
                       "batch's; sgd divides by the whole batch")
        if problem is not None and any(math.isclose(_step_scale(replicas[0], ref, params),
                                                    n / len(shard), rel_tol=1e-3)
                                       for shard in X[:n].chunk(k) if len(shard) < n):
            problem = ("the step is as long as if you divided by a shard's size: divide the "
                       "summed gradient by the whole batch, X.shape[0]")
        assert problem is None, f"{where}: {problem}"
        want = float(loss(lenet(X[:n], params), y[:n]).sum())
        assert isinstance(got, torch.Tensor), (
            f"{where}: returned {got!r:.40}, want the summed loss of the batch, a tensor")
        assert not got.requires_grad, (
            f"{where}: the returned loss still requires grad, and keeps the step's autograd "
            "graph alive: return it detached (l.detach() for each shard's loss)")
        assert abs(float(got) - want) <= 1e-5 * abs(want), (
            f"{where}: returned {float(got):.4f}, want the summed loss of the batch, {want:.4f}")
    try:
        train_batch(X, y, [get_params(params, devs[0])], devs[:2], 0.1)
    except ValueError:
        return print("train_batch is right: the one-device step on 1-4 devices (idle ones too), "
                     "identical replicas, the summed loss")
    raise AssertionError("train_batch accepted one replica for two devices: call check_replicas")


def check_train_batch_wd(train_batch_wd: Callable | None) -> None:
    """Exercise 7: train_batch with weight decay wd, the step of one device on
    sum of losses / n + wd / 2 * (sum of squared parameters)."""
    if train_batch_wd is None:
        return print("not answered yet")
    g = torch.Generator().manual_seed(1)
    X, y = torch.rand(10, 1, 28, 28, generator=g), torch.randint(0, 10, (10,), generator=g)
    params, lr, wd = init_lenet_params(0, scale=0.1), 0.1, 0.5
    for k, n in ((1, 10), (2, 10), (3, 10), (4, 3)):
        devs = [torch.device("cpu", i) for i in range(k)]
        replicas = [get_params(params, d) for d in devs]
        train_batch_wd(X[:n], y[:n], replicas, devs, lr, wd)
        steps = {m: _one_device_step(params, X[:n], y[:n], lr, m * wd) for m in range(1, 5)}
        problem = _step_problem(replicas, steps[1], params)
        if problem is None:
            continue
        if any(_step_problem(replicas, steps[m], params) is None for m in range(2, 5)):
            return print(f"not quite: on {count(k, 'device')} your decay is counted more than "
                         "once (each device adds it before the allreduce sums them): add it once")
        return print(f"not quite: batch {n} on {count(k, 'device')}: {problem}")
    print("correct: the decay is added once, after the allreduce (or 1/k of it on each device)")
