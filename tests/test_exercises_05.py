"""The checkers of chapter 05 say "correct" to right answers and reject known wrong ones."""
import pytest

import torch

from dpcourse import Settings, allreduce, devices, lenet, load_fashion_mnist, loss, sgd, split_batch
from dpcourse.exercises.ch05 import (check_accumulated_step, check_lr_for_k, check_steps,
                                     check_train_batch, check_train_batch_wd, check_warmup)
from dpcourse.training import train_batch


def verdict(capsys) -> str:
    """The first word of what the checker printed: "correct", "not" (quite) or "different"."""
    return capsys.readouterr().out.split()[0].rstrip(":")


def last_line(capsys) -> str:
    """What the checker concluded (devices() announces the simulated devices before it)."""
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_steps_are_the_loaders_batches_times_the_epochs(capsys):
    s = Settings.for_devices(devices(4))
    train_iter, _ = load_fashion_mnist(1024, s.train_size, s.test_size, "synthetic")
    capsys.readouterr()
    check_steps(s.num_epochs * len(train_iter))
    assert last_line(capsys).startswith("correct")
    check_steps(len(train_iter))
    assert "that is one epoch" in last_line(capsys)
    check_steps(s.num_epochs * len(train_iter) + 1)
    assert last_line(capsys).startswith("not quite")


def test_lr_for_k_accepts_the_linear_scaling_rule(capsys):
    check_lr_for_k(lambda k: 0.025 * k)
    assert last_line(capsys).startswith("correct")


@pytest.mark.parametrize("wrong, where", [
    (lambda k: -0.1, "on 1 device (batch 64)"),  # steps up the gradient
    (lambda k: 0.025, "on 2 devices (batch 128)"),  # the rate of one device: 1/k of the step
    (lambda k: 0.1, "on 1 device (batch 64)"),  # the textbook's fixed global batch answer
    (lambda k: 0.025 * k * 1.01, "on 1 device (batch 64)"),  # 1% off: every element compared
    (lambda k: 0.025 * k ** 2, "on 2 devices (batch 128)"),
])
def test_lr_for_k_rejects_other_rates_at_the_first_k_they_miss(capsys, wrong, where):
    check_lr_for_k(wrong)
    line = last_line(capsys)
    assert line.startswith("not quite") and where in line


def test_lr_for_k_says_how_far_a_constant_rate_moves(capsys):
    check_lr_for_k(lambda k: 0.025)
    assert "0.50x as far" in last_line(capsys)


def test_warmup_accepts_the_linear_ramp_and_rejects_others(capsys):
    check_warmup(lambda step, lr, steps: lr / 4 + 0.75 * lr * min(step, steps) / steps)
    assert verdict(capsys) == "correct"
    check_warmup(lambda step, lr, steps: 0.025 + 0.075 * min(step, 32) / 32)  # the CPU's only
    assert "with lr 0.2 and a warm-up of 470 steps, at step 0" in capsys.readouterr().out
    check_warmup(lambda step, lr, steps: lr * min(step, steps) / steps)  # starts at 0
    assert "at step 0" in capsys.readouterr().out


def decayed_step(X, y, device_params, devs, lr, wd, before=False):
    """train_batch with weight decay: added once after the allreduce, or (wrong) on every
    device before it."""
    X_shards, y_shards = split_batch(X, y, devs)
    if before:
        for params in device_params:
            for p in params:
                p.grad = wd * len(y) * p.detach()
    for Xs, ys, params in zip(X_shards, y_shards, device_params):
        loss(lenet(Xs, params), ys).sum().backward()
    for params in device_params:
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
    for grads in zip(*[[p.grad for p in params] for params in device_params]):
        allreduce(list(grads))
    for params in device_params:
        for p in params:
            p.grad += 0 if before else wd * len(y) * p.detach()
        sgd(params, lr, len(y))


def test_train_batch_wd_accepts_the_decay_once_and_rejects_it_per_device(capsys):
    check_train_batch_wd(decayed_step)
    assert verdict(capsys) == "correct"
    check_train_batch_wd(lambda *a: decayed_step(*a, before=True))
    assert "counted more than once" in capsys.readouterr().out
    check_train_batch_wd(lambda X, y, d, devs, lr, wd: train_batch(X, y, d, devs, lr))
    assert "away from the one-device step" in capsys.readouterr().out


def test_train_batch_check_accepts_the_package_and_names_what_is_wrong(capsys):
    check_train_batch(train_batch)
    assert capsys.readouterr().out.startswith("train_batch is right")
    with pytest.raises(AssertionError, match="call the given allreduce"):
        check_train_batch(lambda X, y, d, devs, lr, allreduce=None: train_batch(X, y, d, devs, lr))
    with pytest.raises(AssertionError, match="away from the one-device step"):
        check_train_batch(lambda X, y, d, devs, lr, allreduce=allreduce:
                          train_batch(X, y, d, devs, 2 * lr, allreduce))
    with pytest.raises(NotImplementedError):
        check_train_batch(lambda *a, **k: (_ for _ in ()).throw(NotImplementedError()))


def step_without(X, y, device_params, devs, lr, allreduce=allreduce, *, idle_zeros=True,
                 divisor=None, shard_loss="sum", sgd_first=False, detach=True):
    """train_batch written out, with one slip: no zero gradients for idle replicas, dividing
    the summed gradient by divisor(shard sizes) instead of the batch size, each shard's loss
    averaged (shard_loss="mean"), sgd before the allreduce, or the loss returned undetached."""
    X_shards, y_shards = split_batch(X, y, devs)
    losses = [getattr(loss(lenet(Xs, params), ys), shard_loss)()
              for Xs, ys, params in zip(X_shards, y_shards, device_params)]
    for l in losses:
        l.backward()
    for params in device_params[len(X_shards):] if idle_zeros else []:
        for p in params:
            p.grad = torch.zeros_like(p)
    updates = [lambda params=params: sgd(params, lr, divisor([len(s) for s in X_shards])
                                         if divisor else len(y)) for params in device_params]
    for update in updates if sgd_first else []:
        update()
    for grads in zip(*[[p.grad for p in params] for params in device_params]):
        allreduce(list(grads))
    for update in [] if sgd_first else updates:
        update()
    return sum(l.detach() if detach else l for l in losses)


def test_train_batch_check_says_to_give_an_idle_replica_zero_gradients():
    with pytest.raises(AssertionError, match="batch 3 on 4 devices: device 3 got no shard and "
                                             "has no gradient: give an idle replica zero"):
        check_train_batch(lambda *a, **k: step_without(*a, **k, idle_zeros=False))


def test_train_batch_check_says_to_divide_by_the_whole_batch():
    with pytest.raises(AssertionError, match="batch 10 on 2 devices: the step is as long as if "
                                             "you divided by a shard's size: divide the summed "
                                             "gradient by the whole batch"):
        check_train_batch(lambda *a, **k: step_without(*a, **k, divisor=lambda sizes: sizes[0]))


def test_train_batch_check_says_sgd_comes_after_the_allreduce():
    with pytest.raises(AssertionError, match=r"^batch 10 on 1 device: device 0 had a shard but "
                                             r"has no gradient at the allreduce: run every "
                                             r"shard's backward first, and sgd \(which clears "
                                             r"p.grad\) only after the allreduce$"):
        check_train_batch(lambda *a, **k: step_without(*a, **k, sgd_first=True))


def test_train_batch_check_says_to_sum_each_shards_loss_not_average_it():
    with pytest.raises(AssertionError, match=r"^batch 10 on 1 device: the step is the one of "
                                             r"each shard's mean loss: sum each shard's loss "
                                             r"\(.sum\(\), not .mean\(\)\)"):
        check_train_batch(lambda *a, **k: step_without(*a, **k, shard_loss="mean"))


def test_train_batch_check_refuses_a_loss_that_still_requires_grad():
    with pytest.raises(AssertionError, match=r"^batch 10 on 1 device: the returned loss still "
                                             r"requires grad, and keeps the step's autograd "
                                             r"graph alive: return it detached"):
        check_train_batch(lambda *a, **k: step_without(*a, **k, detach=False))


def test_train_batch_check_names_an_allreduce_of_the_parameters():
    """Before, only "your update is ... away from the one-device step"."""
    def parameters_summed(X, y, device_params, devs, lr, allreduce=allreduce):
        X_shards, y_shards = split_batch(X, y, devs)
        for Xs, ys, params in zip(X_shards, y_shards, device_params):
            loss(lenet(Xs, params), ys).sum().backward()
        for params in zip(*device_params):
            allreduce(list(params))
        for params in device_params:
            sgd(params, lr, len(y))
    with pytest.raises(AssertionError, match=r"^batch 10 on 1 device: the allreduce got the "
                                             r"replicas' parameters, not their gradients"):
        check_train_batch(parameters_summed)


def accumulated(X, y, params, lr, k, shard_loss="sum", update_each=False, per_micro=False):
    """Exercise 5 written out: the k shards one after the other, one update (or, wrong, the
    mean of each shard's loss, an update after every shard, or the summed gradient divided by
    a micro-batch's size)."""
    for Xs, ys in zip(X.chunk(k), y.chunk(k)):
        getattr(loss(lenet(Xs, params), ys), shard_loss)().backward()
        if update_each:
            sgd(params, lr, len(y))
    if not update_each:
        sgd(params, lr, len(X.chunk(k)[0]) if per_micro else len(y))


def test_accumulated_step_accepts_summed_shards_and_one_update(capsys):
    check_accumulated_step(accumulated)
    assert verdict(capsys) == "correct"
    check_accumulated_step(lambda *a: accumulated(*a, shard_loss="mean"))
    assert capsys.readouterr().out.startswith("not quite: batch 10 in 1 micro-batch: each "
                                              "micro-batch's loss is averaged: sum it")
    check_accumulated_step(lambda *a: accumulated(*a, update_each=True))
    assert capsys.readouterr().out.startswith("not quite: batch 10 in 2 micro-batches: you "
                                              "updated after every micro-batch")
    check_accumulated_step(lambda X, y, params, lr, k: accumulated(X, y, params, 2 * lr, k))
    assert "away from the one-device step" in capsys.readouterr().out
    check_accumulated_step(lambda *a: accumulated(*a, per_micro=True))
    assert capsys.readouterr().out == (  # before, only "... away from the one-device step"
        "not quite: batch 10 in 2 micro-batches: the step is as long as if you divided by a "
        "micro-batch's size: divide the summed gradient by the whole batch, X.shape[0]\n")


def test_unanswered_exercises_say_so(capsys):
    for check in (check_steps, check_lr_for_k, check_warmup, check_accumulated_step,
                  check_train_batch_wd):
        check(None)
        assert capsys.readouterr().out == "not answered yet\n"
