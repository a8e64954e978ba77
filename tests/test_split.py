import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpcourse import devices, split_batch
from dpcourse.exercises.ch04 import check_dropped, check_mean_weights, check_shard_sizes
from dpcourse.split import Transformed

# The PyTorch data-parallelism tutorial: shard sizes of a 30-batch and of the last 10-batch.
TUTORIAL = {1: ([30], [10]), 2: ([15, 15], [5, 5]), 3: ([10, 10, 10], [4, 4, 2]),
            8: ([4] * 7 + [2], [2] * 5)}


@pytest.mark.parametrize("k", TUTORIAL)
def test_shard_sizes_match_the_pytorch_tutorial(k):
    devs = devices(k, simulate=True)
    for n, want in zip((30, 10), TUTORIAL[k]):
        X_shards, y_shards = split_batch(torch.randn(n, 5), torch.arange(n), devs)
        assert [len(x) for x in X_shards] == [len(t) for t in y_shards] == want


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("n", [1, 3, 7, 16, 33, 256])
def test_shards_are_torch_chunk_in_order_on_their_devices(k, n):
    devs = devices(k, simulate=True)
    X, y = torch.randn(n, 1, 4, 4), torch.randint(0, 10, (n,))
    X_shards, y_shards = split_batch(X, y, devs)
    size = math.ceil(n / k)  # torch.chunk's shard size: fewer shards when that runs out
    assert len(X_shards) == math.ceil(n / size)
    for got, want in zip(X_shards, X.chunk(k)):
        assert torch.equal(got, want)
    assert torch.equal(torch.cat(y_shards), y)


def test_mismatched_lengths_are_named():
    with pytest.raises(ValueError, match="X has 5 examples but y has 4"):
        split_batch(torch.randn(5, 3), torch.arange(4), devices(2, simulate=True))


def test_empty_batch_and_empty_device_list_are_refused():
    with pytest.raises(ValueError, match="empty batch"):
        split_batch(torch.randn(0, 3), torch.arange(0), devices(2, simulate=True))
    with pytest.raises(ValueError, match="empty device list"):
        split_batch(torch.randn(4, 3), torch.arange(4), [])


def test_transformed_applies_the_transform_to_each_item_as_it_is_read():
    data = TensorDataset(torch.arange(6.0).reshape(6, 1), torch.arange(6))
    calls = []
    ds = Transformed(data, lambda X: calls.append(1) or X * 10)
    assert len(ds) == 6 and calls == []
    X, y = ds[4]
    assert torch.equal(X, torch.tensor([40.0])) and int(y) == 4 and len(calls) == 1


def test_transformed_works_with_worker_processes():
    ds = Transformed(TensorDataset(torch.arange(8.0), torch.arange(8)), torch.neg)
    loader = DataLoader(ds, batch_size=3, num_workers=2)
    X = torch.cat([X for X, _ in loader])
    assert torch.equal(X, -torch.arange(8.0))


def test_exercise_checkers_say_correct_only_for_right_answers(capsys):
    check_shard_sizes(50, 8, [7] * 7 + [1])
    check_shard_sizes(50, 8, [7] * 6 + [4, 4])
    check_dropped((10, 96))
    check_dropped((10, 0))
    check_mean_weights(lambda sizes: [s / sum(sizes) for s in sizes])
    check_mean_weights(lambda sizes: [1 / len(sizes)] * len(sizes))  # the plain mean of means
    verdicts = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()]
    assert verdicts == ["correct", "not quite", "correct", "not quite", "correct", "not quite"]
