"""Chapter 04's checkers: exercise 6's shards balanced by work (the best split only), and the
cleared split_batch, whose shards must land on their devices."""
import pytest
import torch

from dpcourse.collectives import check_devices
from dpcourse.exercises.ch04 import check_token_shards
from dpcourse.split import check_batch


def greedy_bisection(lengths, k):
    """The worked solution: the smallest cap for which greedy filling needs at most k shards."""
    def fill(cap):
        sizes, load = [0], 0
        for n in lengths:
            if n > cap:
                return None
            if load + n > cap:
                sizes, load = sizes + [0], 0
            sizes[-1], load = sizes[-1] + 1, load + n
        return sizes + [0] * (k - len(sizes)) if len(sizes) <= k else None

    low, high = max(lengths), sum(lengths)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if fill(mid) else (mid + 1, high)
    return fill(low)


def test_token_shards_accepts_the_best_split_and_rejects_equal_counts(capsys):
    check_token_shards(greedy_bisection)
    assert capsys.readouterr().out.startswith("correct")
    check_token_shards(lambda lengths, k: [len(c) for c in torch.arange(len(lengths)).chunk(k)])
    assert "busiest device 28, but 18 is possible" in capsys.readouterr().out
    check_token_shards(lambda lengths, k: [len(lengths)] + [0.0] * (k - 1))
    assert "whole numbers" in capsys.readouterr().out
    check_token_shards(None)
    assert capsys.readouterr().out == "not answered yet\n"


# ---- the cleared split_batch: where the shards end up ----

def test_split_batch_check_accepts_the_package(capsys):
    from dpcourse.exercises.ch04 import check_split_batch
    from dpcourse.split import split_batch
    check_split_batch(split_batch)
    assert capsys.readouterr().out.startswith("split_batch is right")


def labels_left_in_place(X, y, devs):
    check_devices(devs, "split_batch")
    check_batch(X, y)
    return [c.to(d) for c, d in zip(X.chunk(len(devs)), devs)], list(y.chunk(len(devs)))


def sent_in_reverse(X, y, devs):
    check_devices(devs, "split_batch")
    check_batch(X, y)
    return tuple([c.to(d) for c, d in zip(t.chunk(len(devs)), devs[::-1])] for t in (X, y))


@pytest.mark.parametrize("split_batch, message", [
    (labels_left_in_place, r"the shards of y on \['cpu', 'cpu'\]: move shard i"),
    (sent_in_reverse, r"the shards of X on \['cpu', 'meta'\]: move shard i")])
def test_split_batch_check_says_where_shards_went_wrong(split_batch, message):
    from dpcourse.exercises.ch04 import check_split_batch
    with pytest.raises(AssertionError, match=message):
        check_split_batch(split_batch)


def test_split_batch_check_names_one_example_on_one_device_in_the_singular():
    from dpcourse.exercises.ch04 import check_split_batch
    with pytest.raises(AssertionError, match=r"^1 example on 1 device: shards of \[0\], want \[1\]$"):
        check_split_batch(lambda X, y, devs: ([X[:0]], [y[:0]]))


def without_check_devices(X, y, devs):
    check_batch(X, y)
    return [c.to(d) for c, d in zip(X.chunk(len(devs)), devs)], \
        [c.to(d) for c, d in zip(y.chunk(len(devs)), devs)]


def as_pairs(X, y, devs):
    check_devices(devs, "split_batch")
    check_batch(X, y)
    return [(a.to(d), b.to(d)) for a, b, d in zip(X.chunk(len(devs)), y.chunk(len(devs)), devs)]


@pytest.mark.parametrize("split_batch, message", [
    (without_check_devices, r"^split_batch with no devices failed inside with "
                            r"RuntimeError: call check_devices first"),  # chunk(0)
    (as_pairs, r"^split_batch returned a list of 1 \(X, y\) pair: return two lists instead")])
def test_split_batch_check_names_a_missing_device_check_and_pairs_in_one_line(split_batch,
                                                                             message):
    from dpcourse.exercises.ch04 import check_split_batch
    with pytest.raises(AssertionError, match=message):
        check_split_batch(split_batch)
