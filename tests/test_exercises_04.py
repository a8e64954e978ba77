"""Chapter 04's exercise 6: shards balanced by work; the checker accepts the best split only."""
import torch

from dpcourse.exercises.ch04 import check_token_shards


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
