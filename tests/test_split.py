import math

import pytest
import torch

from dpcourse import devices, split_batch

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
