"""The checkers of chapters 03 and 04 say "correct" to right answers and reject known wrong ones."""
import numpy as np
import pytest
import torch

from dpcourse import split_batch
from dpcourse.exercises.ch03 import (check_addition_order, check_complete_chunks,
                                     check_differing_chunks, check_spread_allreduce)
from dpcourse.exercises.ch04 import check_idle_batches, check_mean_weights, check_weighted_sizes


def verdict(capsys) -> str:
    """The first word of what the checker printed: "correct", "not" (quite) or "sums"."""
    return capsys.readouterr().out.split()[0].rstrip(":")


def spread_allreduce(grads, owners_of=None):
    """Exercise 1 written independently; owners_of fixes the device count used for the owners."""
    k, sent = len(grads), [0] * len(grads)
    m = owners_of or k
    for j, tensors in enumerate(zip(*grads)):
        total = sum(t.clone() for t in tensors)
        for d, t in enumerate(tensors):
            t.copy_(total)
            sent[d] += t.numel() * (m - 1 if d == j % m else 1) if d < m else t.numel()
    return sent


def test_addition_order_accepts_the_ring_from_the_chunks_own_device(capsys):
    check_addition_order(lambda k, c: [(c + i) % k for i in range(k)])
    assert verdict(capsys) == "correct"
    check_addition_order(lambda k, c: [(c + i) % k for i in (1, 0, *range(2, k))][:k])  # b + a
    assert verdict(capsys) == "correct"  # one float addition gives the same bits both ways
    check_addition_order(lambda k, c: list(range(k)))  # the naive order
    assert capsys.readouterr().out == ("not quite: addition_order(3, 1) = [0, 1, 2], but on 3 "
                                       "devices chunk 1 starts on device 1, which sends it to "
                                       "device 2; follow it around the ring\n")
    check_addition_order(lambda k, c: [c])
    assert "give a list of the 2 device numbers" in capsys.readouterr().out


def test_differing_chunks_are_all_but_chunk_0_on_four_devices(capsys):
    check_differing_chunks({1, 2, 3})
    out = capsys.readouterr().out
    assert out.startswith("correct: chunks [1, 2, 3].") and "same bits: True" in out
    check_differing_chunks({0, 1, 2, 3})
    assert capsys.readouterr().out == ("not quite: chunk 0 is added in the naive order, device "
                                       "0's value first: it cannot differ\n")
    check_differing_chunks({1, 2})
    assert "chunk 3 is summed starting with device 3's value" in capsys.readouterr().out
    check_differing_chunks("123")
    assert "give a set of chunk numbers" in capsys.readouterr().out


def test_spread_allreduce_is_checked_on_2_3_and_4_devices(capsys):
    check_spread_allreduce(spread_allreduce)
    assert verdict(capsys) == "correct"
    check_spread_allreduce(lambda grads: spread_allreduce(grads, owners_of=3))  # right for k=3 only
    assert "on 2 devices the elements sent should be" in capsys.readouterr().out


def test_complete_chunks_accepts_the_count_and_a_formula_for_every_step(capsys):
    check_complete_chunks(15)
    check_complete_chunks(lambda k, s: k * (s - k + 2) if s >= k - 1 else 0)
    check_complete_chunks(10)
    check_complete_chunks(lambda k, s: k * (s - k + 3) if s >= k - 2 else 0)  # steps from 0
    verdicts = [line.split(":")[0].split(" (")[0] for line in capsys.readouterr().out.splitlines()]
    assert verdicts == ["correct", "correct for k = 2 to 8 after every step", "not quite",
                        "not quite"]


def largest_remainder(n, speeds):
    """Round every ideal share down, then give one more to those that lost the most."""
    ideal = [n * s / sum(speeds) for s in speeds]
    sizes = [int(x) for x in ideal]
    for i in sorted(range(len(speeds)), key=lambda i: sizes[i] - ideal[i])[:n - sum(sizes)]:
        sizes[i] += 1
    return sizes


def rest_to_last(rounding):
    """Round every share with rounding, then give the last device whatever is left."""
    def sizes(n, speeds):
        out = [rounding(n * s / sum(speeds)) for s in speeds]
        out[-1] += n - sum(out)
        return out
    return sizes


@pytest.mark.parametrize("fn, want", [
    (largest_remainder, "correct"),
    (lambda n, speeds: [np.int64(s) for s in largest_remainder(n, speeds)], "correct"),
    (rest_to_last(int), "not"),    # 11 over 4 equal devices: [2, 2, 2, 5]
    (rest_to_last(round), "not"),  # 10 over 7 equal devices: [1, 1, 1, 1, 1, 1, 4]
    (lambda n, speeds: [n * s / sum(speeds) for s in speeds], "not"),  # not whole numbers
])
def test_weighted_sizes_checker(capsys, fn, want):
    check_weighted_sizes(fn)
    assert verdict(capsys) == want


def test_the_wrong_weighted_sizes_fail_where_the_review_found_them():
    assert rest_to_last(int)(11, [1] * 4) == [2, 2, 2, 5]
    assert rest_to_last(round)(10, [1] * 7) == [1] * 6 + [4]


@pytest.mark.parametrize("fn, want", [
    (lambda sizes: [s / sum(sizes) for s in sizes], "correct"),
    (lambda sizes: torch.tensor(sizes) / sum(sizes), "correct"),  # float32 weights
    (lambda sizes: [1 / len(sizes)] * len(sizes), "not"),         # the plain mean of means
    (lambda sizes: [s / sum(sizes) for s in sizes][:-1], "not"),  # one weight missing
])
def test_mean_weights_checker(capsys, fn, want):
    check_mean_weights(fn)
    assert verdict(capsys) == want


def test_idle_batches_checker_compares_with_split_batch(capsys):
    devs = [torch.device("cpu", i) for i in range(8)]
    idle = [n for n in range(1, 257)
            if len(split_batch(torch.zeros(n, 1), torch.zeros(n), devs)[0]) < 8]
    check_idle_batches(idle)
    check_idle_batches(range(1, 8))           # only the batches smaller than 8
    check_idle_batches(idle + [50])
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == [
        "correct", "not quite", "not quite"]
