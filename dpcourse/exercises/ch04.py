"""Checkers for chapter 04's exercises (splitting minibatches)."""
from __future__ import annotations

import random
from fractions import Fraction
from typing import Callable, Iterable

import torch

from ..split import split_batch
from . import answered, count, is_int


def check_shard_sizes(n: int, k: int, answer: list[int] | None) -> None:
    """Exercise 1: the shard sizes split_batch gives a batch of n on k devices."""
    if answer is None:
        return print("not answered yet")
    expected = [len(c) for c in torch.arange(n).chunk(k)]
    if list(answer) == expected:
        print(f"correct: {n} over {k} gives {expected}")
    elif sum(answer) != n:
        print(f"not quite: your shards hold {sum(answer)} examples, the batch has {n}")
    else:
        print(f"not quite: start with shards of ceil({n} / {k}) examples")


def check_idle(fn: Callable[[int, int], int] | None) -> None:
    """Exercise 2: fn(n, k) is the number of devices that get no shard, for n <= 300, k <= 16."""
    if fn is None:
        return print("not answered yet")
    for k in range(1, 17):
        devs = [torch.device("cpu", i) for i in range(k)]
        for n in range(1, 301):
            expected = k - len(split_batch(torch.zeros(n, 1), torch.zeros(n), devs)[0])
            if fn(n, k) != expected:
                return print(f"not quite: for n={n}, k={k} you say {fn(n, k)}, "
                             f"split_batch leaves {expected} idle")
    print("correct for every n up to 300 and k up to 16")


def idle_batch_sizes(k: int = 8, largest: int = 256) -> list[int]:
    """Batch sizes 1..largest for which split_batch leaves at least one of k devices idle."""
    devs = [torch.device("cpu", i) for i in range(k)]
    return [n for n in range(1, largest + 1)
            if len(split_batch(torch.zeros(n, 1), torch.zeros(n), devs)[0]) < k]


def check_idle_batches(answer: Iterable[int] | None, k: int = 8, largest: int = 256) -> None:
    """Exercise 2: the batch sizes between 1 and largest that leave a device idle on k devices."""
    if answer is None:
        return print("not answered yet")
    expected, given = idle_batch_sizes(k, largest), sorted(set(answer))
    missing = [n for n in expected if n not in given]
    extra = [n for n in given if n not in expected]
    if not missing and not extra:
        return print(f"correct: {len(expected)} batch sizes, the largest {expected[-1]}")
    print(f"not quite: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
          f"wrongly included {extra[:5]}{' ...' if len(extra) > 5 else ''} "
          f"(on {k} devices, shards of ceil(n / {k}) can run out before the last device)")


def weighted_cases(count: int = 200, seed: int = 0) -> list[tuple[int, list[float]]]:
    """Batch sizes and device speeds for exercise 3: hand-picked traps, then random ones."""
    traps = [(256, [3, 1]), (100, [1, 1, 1]), (10, [5, 1, 1, 1]), (7, [1, 2, 4]),
             (11, [1, 1, 1, 1]), (10, [1] * 7), (5, [1] * 8), (1, [2.5, 1.0]), (64, [0.5, 1.5])]
    rng = random.Random(seed)
    rand = [(rng.randint(1, 300), [rng.randint(1, 10) for _ in range(rng.randint(1, 8))])
            for _ in range(count)]
    return traps + rand


def check_weighted_sizes(fn: Callable[[int, list[float]], list[int]] | None) -> None:
    """Exercise 3: fn(n, speeds) gives whole-number shard sizes summing to n, each less than one
    example away from n * speed / sum(speeds)."""
    if fn is None:
        return print("not answered yet")
    for n, speeds in weighted_cases():
        sizes = list(fn(n, list(speeds)))
        ideal = [n * Fraction(s) / sum(map(Fraction, speeds)) for s in speeds]  # exact
        whole = all(is_int(s) for s in sizes)
        if len(sizes) != len(speeds) or not whole or sum(sizes) != n:
            return print(f"not quite: for n={n}, speeds {speeds} you give {sizes}; "
                         f"one whole number per device, {n} in all")
        far = [i for i, (a, b) in enumerate(zip(sizes, ideal)) if abs(a - b) >= 1]
        if far:
            return print(f"not quite: for n={n}, speeds {speeds} you give {sizes}, ideal "
                         f"{[round(float(b), 2) for b in ideal]}: device {far[0]}'s shard is "
                         "not less than one example away from its ideal share")
    print("correct: every size less than one example away from its ideal share, "
          f"in {len(weighted_cases())} cases")


def check_dropped(answer: tuple[int, int] | None) -> None:
    """Exercise 4: examples drop_last=True discards per epoch, (100 in batches of 30,
    60,000 in batches of 256)."""
    if answer is None:
        return print("not answered yet")
    expected = (100 % 30, 60_000 % 256)
    if tuple(answer) == expected:
        print(f"correct: {expected[0]} of 100 (10 %) and {expected[1]} of 60,000 (0.16 %)")
    else:
        print(f"not quite: {tuple(answer)}; the dropped batch is what is left after the "
              "last full batch (n mod batch size)")


def check_mean_weights(fn: Callable[[list[int]], list[float]] | None) -> None:
    """Exercise 5: fn(shard sizes) gives the weights that turn shard means into the batch mean
    (compared in float64 to 1e-6 relative, so float32 weights pass)."""
    if fn is None:
        return print("not answered yet")
    g = torch.Generator().manual_seed(0)
    for n, k in ((10, 3), (30, 8), (7, 4), (256, 3)):
        losses = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
        shards = losses.chunk(k)
        weights = [float(w) for w in fn([len(s) for s in shards])]
        if len(weights) != len(shards):
            return print(f"not quite: {len(shards)} shards need {len(shards)} weights, "
                         f"you give {len(weights)}")
        got, mean = sum(w * float(s.mean()) for w, s in zip(weights, shards)), float(losses.mean())
        if abs(got - mean) > 1e-6 * abs(mean):
            return print(f"not quite: for {n} examples on {k} devices your weights "
                         f"{[round(w, 6) for w in weights]} give {got:.10f}, "
                         f"the batch mean is {mean:.10f}")
    print("correct: weight each shard's mean by its share of the batch, size / n")


def check_split_batch(split_batch: Callable) -> None:
    """Your split_batch: torch.chunk's shards, shard i of X and of y on devs[i], X and y cut
    alike, clear errors."""
    for k in range(1, 6):
        devs = [torch.device("cpu", i) for i in range(k)]
        for n in range(1, 21):
            X, y = torch.randn(n, 3), torch.arange(n)
            X_shards, y_shards = _two_lists(split_batch(X, y, devs))
            where = f"{count(n, 'example')} on {count(k, 'device')}"
            want = [len(c) for c in X.chunk(k)]
            got = [len(s) for s in X_shards]
            assert got == want, f"{where}: shards of {got}, want {want}"
            assert all(torch.equal(a, b) for a, b in zip(X_shards, X.chunk(k))), (
                f"{where}: the shards of X are not X's rows in order")
            assert [s.tolist() for s in y_shards] == [c.tolist() for c in y.chunk(k)], (
                f"{where}: the shards of y do not match those of X")
    placed = [torch.device("meta"), torch.device("cpu")]  # shards on meta hold no values
    for name, shards in zip("Xy", split_batch(torch.randn(4, 3), torch.arange(4), placed)):
        where = [s.device.type for s in shards]
        assert where == ["meta", "cpu"], (f"devices meta, cpu got the shards of {name} on "
                                          f"{where}: move shard i of X and of y to devs[i]")
    for what, args, helper in (
            ("labels of another length", (torch.randn(5, 3), torch.arange(4), devs), "check_batch"),
            ("an empty batch", (torch.randn(0, 3), torch.arange(0), devs), "check_batch"),
            ("no devices", (torch.randn(4, 3), torch.arange(4), []), "check_devices")):
        try:
            split_batch(*args)
        except ValueError:
            continue
        except Exception as error:  # noqa: BLE001 - torch's own error, from deeper down
            raise AssertionError(f"split_batch with {what} failed inside with "
                                 f"{type(error).__name__}: call {helper} first, which raises "
                                 "a ValueError that says what is wrong") from None
        raise AssertionError(f"split_batch accepted {what}: call {helper}, which raises a "
                             "ValueError that says so")
    print("split_batch is right: torch.chunk's shards for 1-20 examples on 1-5 devices, "
          "and clear errors for bad input")


def _two_lists(result: object) -> tuple[list, list]:
    """split_batch's result as (X's shards, y's shards), or an AssertionError saying what it
    returned instead."""
    if isinstance(result, (tuple, list)) and len(result) == 2 and all(
            isinstance(part, (tuple, list)) for part in result):
        return result[0], result[1]
    if isinstance(result, list) and result and all(
            isinstance(pair, tuple) and len(pair) == 2 for pair in result):
        raise AssertionError(f"split_batch returned a list of {count(len(result), '(X, y) pair')}"
                             ": return two lists instead, X's shards and y's shards")
    raise AssertionError(f"split_batch should return two lists (X's shards, y's shards), got "
                         f"{result!r:.60}")


def _loads(lengths: list[int], sizes: list[int]) -> list[int]:
    """The total length of each contiguous shard of the given sizes."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [sum(lengths[s:s + n]) for s, n in zip(starts, sizes)]


def _best_largest_load(lengths: list[int], k: int) -> int:
    """The smallest possible largest load of k contiguous shards (dynamic programming)."""
    n = len(lengths)
    best = [0] + [float("inf")] * n  # best[i]: the first i examples over the shards so far
    for _ in range(k):
        best = [min([best[i]] + [max(best[j], sum(lengths[j:i])) for j in range(i)])
                for i in range(n + 1)]
    return int(best[n])


def check_token_shards(token_shards: Callable[[list[int], int], list[int]] | None) -> None:
    """Exercise 6: k contiguous shard sizes that make the largest shard's total length (the
    busiest device's work) as small as possible."""
    if not answered(token_shards):
        return
    g = torch.Generator().manual_seed(0)
    cases = [([9, 9, 9, 1, 1, 1, 1, 1], 2), ([5, 1, 1, 1, 1, 1, 1, 5], 3), ([4, 4, 4], 5),
             ([1] * 10, 3), ([30, 2, 2, 2, 2, 2, 2, 2], 4)]
    cases += [(torch.randint(1, 50, (int(n),), generator=g).tolist(), k)
              for n, k in zip(torch.randint(1, 25, (20,), generator=g), [2, 3, 4, 8] * 5)]
    for lengths, k in cases:
        sizes = list(token_shards(list(lengths), k))
        whole = all(is_int(s) and s >= 0 for s in sizes)
        if len(sizes) != k or not whole or sum(sizes) != len(lengths):
            return print(f"not quite: token_shards({lengths}, {k}) = {sizes}; give {k} whole "
                         f"numbers, none negative, summing to {len(lengths)}")
        got, best = max(_loads(lengths, sizes)), _best_largest_load(lengths, k)
        if got > best:
            chunked = max(_loads(lengths, [len(c) for c in torch.arange(len(lengths)).chunk(k)]))
            return print(f"not quite: token_shards({lengths}, {k}) = {sizes} gives the busiest "
                         f"device {got}, but {best} is possible (torch.chunk's shards: {chunked})")
    print("correct: the busiest device gets as little as any contiguous split allows")
