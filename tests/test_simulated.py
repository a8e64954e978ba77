"""Chapter 05's alternated epoch timing: the steps it times are chapter 02's plain step and
train_batch (the same SGD steps), and every step runs once per round plus a warm-up pass."""
import pytest
import torch

from dpcourse.collectives import allreduce
from dpcourse.experiments.simulated import data_parallel_step, epoch_seconds, plain_step
from dpcourse.ring import ring_allreduce


def batches(n: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(size, 1, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("k, reduce", [(1, allreduce), (3, allreduce), (3, ring_allreduce)])
def test_the_timed_steps_take_the_plain_steps(k: int, reduce) -> None:
    """An equal loss on the second batch means an equal first update (float32, 1e-5)."""
    cpu = torch.device("cpu")
    plain = plain_step(cpu, lr=0.1)
    parallel = data_parallel_step([torch.device("cpu", i) for i in range(k)], reduce, lr=0.1)
    for X, y in batches(2):  # the second loss depends on the first update
        want, got = float(plain(X, y)), float(parallel(X, y))
        assert got == pytest.approx(want, rel=1e-5)


def test_epoch_seconds_runs_every_step_once_per_round_after_a_warm_up_pass() -> None:
    calls = {"a": 0, "b": 0}

    def counting(name):
        def step(X, y):
            calls[name] += 1
        return step
    seconds = epoch_seconds(batches(3), {name: counting(name) for name in calls}, rounds=2)
    assert list(seconds) == ["a", "b"] and all(t >= 0 for t in seconds.values())
    assert calls == {"a": 3 * 3, "b": 3 * 3}


def test_epoch_seconds_without_warm_up_runs_each_step_once_per_round() -> None:
    calls = []
    epoch_seconds(batches(2), {"a": lambda X, y: calls.append("a")}, rounds=3, warmup=0)
    assert calls == ["a"] * 2 * 3
