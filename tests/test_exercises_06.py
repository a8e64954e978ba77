"""The checkers of chapter 06 say "correct" to right answers and reject known wrong ones."""
from functools import partial

import pytest
import torch
from torch import nn

from dpcourse.concise import ResNetSettings
from dpcourse.data_parallel import ScratchDataParallel, gather, parallel_apply, replicate
from dpcourse.exercises.ch06 import (check_bytes_received, check_cached_wrapper, check_gather,
                                     check_combine_stats, check_parallel_apply,
                                     check_parallel_loss, check_replicate,
                                     check_same_batch_settings, check_scatter)
from dpcourse.resnet import resnet18
from dpcourse.split import scatter


def said(capsys) -> str:
    return capsys.readouterr().out


def test_same_batch_settings_accepts_whole_batches_and_rejects_fractions(capsys):
    check_same_batch_settings(lambda k: ResNetSettings(256 // k, 0.1 / k))
    assert said(capsys).startswith("correct")
    check_same_batch_settings(lambda k: ResNetSettings(256 / k, 0.1 / k))  # 32.0 examples
    assert "whole number of examples" in said(capsys)
    check_same_batch_settings(lambda k: ResNetSettings(256 // k, 0.1))
    assert "learning rate" in said(capsys)
    check_same_batch_settings(lambda k: ResNetSettings(256, 0.1 / k))
    assert "global batch" in said(capsys)


def pooled_stats(counts, means, variances):
    """The batch's mean and biased variance from the shards' (independent: pooled moments)."""
    n = sum(counts)
    mean = sum(c * m for c, m in zip(counts, means)) / n
    second = sum(c * (v + m ** 2) for c, m, v in zip(counts, means, variances)) / n
    return mean, second - mean ** 2


def test_combine_stats_accepts_pooled_moments_and_names_the_usual_slips(capsys):
    check_combine_stats(pooled_stats)
    assert said(capsys).startswith("correct")
    check_combine_stats(lambda c, m, v: (torch.stack(m).mean(0), pooled_stats(c, m, v)[1]))
    assert "weigh each by its count" in said(capsys)
    check_combine_stats(lambda c, m, v: (pooled_stats(c, m, v)[0], torch.stack(v).mean(0)))
    assert said(capsys) == ("not quite: shards of [4, 4, 2] examples: the variance is off: the "
                            "shards' variances leave out how far each shard's mean lies from "
                            "the batch's: add count x (shard mean - batch mean)^2 for each "
                            "shard\n")
    check_combine_stats(lambda c, m, v: (pooled_stats(c, m, v)[0],
                                         pooled_stats(c, m, v)[1] * sum(c) / (sum(c) - 1)))
    assert "unbiased variance" in said(capsys)
    check_combine_stats(None)
    assert said(capsys) == "not answered yet\n"


def add_grad_to(original, copy, clear=True):
    copy_grad = copy.grad.to(original.device)
    original.grad = copy_grad if original.grad is None else original.grad + copy_grad
    if clear:
        copy.grad = None


class HookedCopies(nn.Module):
    """Detached copies made once, refreshed in place; a hook passes their gradients on."""

    def __init__(self, module, devs, clear=True, refresh=True):
        super().__init__()
        self.module, self.devs, self.refresh = module, list(devs), refresh
        originals = replicate(module, self.devs[:1])[0]
        self.replicas = [{n: t.detach().to(d, copy=True) for n, t in originals.items()}
                         for d in self.devs[1:]]
        for replica in self.replicas:
            for n, t in replica.items():
                t.requires_grad_().register_post_accumulate_grad_hook(
                    partial(add_grad_to, originals[n], clear=clear))

    def forward(self, X):
        originals = replicate(self.module, self.devs[:1])[0]
        if self.refresh:
            with torch.no_grad():
                for replica in self.replicas:
                    for n, t in replica.items():
                        t.copy_(originals[n])
        shards = scatter(X, self.devs)
        states = [originals] + self.replicas
        return gather(parallel_apply(self.module, states[:len(shards)], shards), self.devs[0])


class AttachedCopies(HookedCopies):
    """Copies made once without detach: autograd carries their gradients to the originals."""

    def __init__(self, module, devs):
        nn.Module.__init__(self)
        self.module, self.devs, self.refresh = module, list(devs), True
        originals = replicate(module, self.devs[:1])[0]
        self.replicas = [{n: t.to(d, copy=True) for n, t in originals.items()}
                         for d in self.devs[1:]]


class StoresButReplicates(ScratchDataParallel):
    """Keeps copies in self.replicas but computes with new ones every step."""

    def __init__(self, module, devs):
        super().__init__(module, devs)
        self.replicas = replicate(module, self.devs)[1:]


class NoReplicas(ScratchDataParallel):
    replicas = []


@pytest.mark.parametrize("wrapper", [HookedCopies, AttachedCopies])
def test_cached_wrapper_accepts_copies_with_hooks_and_attached_copies(capsys, wrapper):
    check_cached_wrapper(wrapper)
    assert said(capsys).startswith("correct")


@pytest.mark.parametrize("wrapper, reason", [
    (StoresButReplicates, "does not compute with the copies"),
    (NoReplicas, "keep the copies in self.replicas"),
    (partial(HookedCopies, clear=False), "clear each copy's .grad"),
    (partial(HookedCopies, refresh=False), "refreshed after each optimizer.step()"),
    (ScratchDataParallel, "keep the copies in self.replicas"),
])
def test_cached_wrapper_rejects_unused_missing_stale_or_uncleared_copies(capsys, wrapper, reason):
    check_cached_wrapper(wrapper)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out


def test_bytes_received_accepts_the_count_and_names_the_own_shard_mistake(capsys):
    n_params = sum(p.numel() for p in resnet18().parameters())
    shard_outputs, replica_grads = 256 * 10 * 4, n_params * 4
    check_bytes_received(3 * shard_outputs + 3 * replica_grads)
    assert said(capsys).startswith("correct")
    check_bytes_received(4 * shard_outputs + 3 * replica_grads)
    assert "its own shard" in said(capsys)
    check_bytes_received(3 * replica_grads)
    assert "gradients only" in said(capsys)
    check_bytes_received(4 * shard_outputs + 4 * replica_grads)
    assert "not from itself" in said(capsys)


def test_part_checks_accept_the_package_and_name_what_is_wrong(capsys):
    for check, right in [(check_scatter, scatter), (check_replicate, replicate),
                         (check_parallel_apply, parallel_apply), (check_gather, gather)]:
        check(right)
        assert said(capsys).startswith(f"{right.__name__} is right")
    with pytest.raises(AssertionError, match="torch.chunk gives"):
        check_scatter(lambda t, devs: [s.to(d) for s, d in zip(t.tensor_split(len(devs)), devs)])
    with pytest.raises(AssertionError, match="flow back to the original"):
        check_replicate(lambda m, devs: [
            {n: t.detach().to(d, copy=True) if i else t for n, t in
             {**dict(m.named_parameters()), **dict(m.named_buffers())}.items()}
            for i, d in enumerate(devs)])
    with pytest.raises(AssertionError, match="not the module run with state 0"):
        check_parallel_apply(lambda m, states, shards: [m(s) for s in shards])
    with pytest.raises(AssertionError, match="do not flow back"):
        check_gather(lambda outputs, d: torch.cat([o.detach() for o in outputs]).to(d))


def test_replicate_check_repeats_a_device_so_that_to_without_copy_fails():
    def without_copy(module, devs):  # t.to(d) returns t itself when t is on d already
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        return [state] + [{n: t.to(d) for n, t in state.items()} for d in devs[1:]]
    with pytest.raises(AssertionError, match=r"^devices cpu, cpu: device 1's 0.weight is the "
                                             r"original itself: t.to\(d\) returns t when t is "
                                             r"already on d \(chapters 00 and 03\); ask .to for "
                                             r"copy=True$"):
        check_replicate(without_copy)


def loss_per_device(module, X, y, devs, mean_of_means=False):
    X_shards, y_shards = scatter(X, devs), scatter(y, devs)
    outputs = parallel_apply(module, replicate(module, devs[:len(X_shards)]), X_shards)
    if mean_of_means:
        means = [nn.functional.cross_entropy(o, t) for o, t in zip(outputs, y_shards)]
        return sum(means) / len(means)
    losses = [nn.functional.cross_entropy(o, t, reduction="sum") for o, t in zip(outputs, y_shards)]
    return sum(loss.to(devs[0]) for loss in losses) / len(y)


def test_parallel_loss_accepts_summed_shards_and_rejects_means_gathers_and_detached(capsys):
    check_parallel_loss(loss_per_device)
    assert said(capsys).startswith("correct")
    check_parallel_loss(partial(loss_per_device, mean_of_means=True))
    assert "each example weighs 1/10" in said(capsys)
    check_parallel_loss(lambda m, X, y, devs: nn.functional.cross_entropy(
        ScratchDataParallel(m, devs)(X), y))
    assert "outputs were gathered" in said(capsys)
    check_parallel_loss(lambda m, X, y, devs: loss_per_device(m, X, y, devs).detach())
    assert "gradient is not" in said(capsys)
    check_parallel_loss(None)
    assert said(capsys) == "not answered yet\n"
