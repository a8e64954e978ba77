"""Checkers for chapter 03's exercises (data synchronisation)."""
from __future__ import annotations

from typing import Callable

import torch

from ..collectives import allreduce
from ..lenet import init_lenet_params
from ..ring import ring_schedule


def spread_traffic(sizes: list[int], k: int) -> list[int]:
    """Elements each device sends when parameter j (sizes[j] elements) is reduced on device
    j mod k and copied back from there: the owner sends it k-1 times, every other device once."""
    return [sum((k - 1) * n if j % k == d else n for j, n in enumerate(sizes)) for d in range(k)]


def check_spread_allreduce(fn: Callable | None, ks: tuple[int, ...] = (2, 3, 4)) -> None:
    """Exercise 1: for each k in ks, fn(grads) sums every parameter across k devices in place
    and returns the elements each device sent, exactly as counted by spread_traffic."""
    if fn is None:
        return print("not answered yet")
    shapes = [p.shape for p in init_lenet_params()]
    busiest = {}
    for k in ks:
        g = torch.Generator().manual_seed(k)
        grads = [[torch.randint(-5, 6, s, generator=g).float() for s in shapes] for _ in range(k)]
        expected = [sum(grads[d][j] for d in range(k)) for j in range(len(shapes))]
        sent = fn(grads)
        wrong = [(d, j) for d in range(k) for j in range(len(shapes))
                 if not torch.equal(grads[d][j], expected[j])]
        if wrong:
            return print(f"not quite: on {k} devices, device {wrong[0][0]} does not hold the sum "
                         f"of parameter {wrong[0][1]} ({len(wrong)} wrong in all)")
        want = spread_traffic([s.numel() for s in shapes], k)
        if sent is None or list(sent) != want:
            return print(f"sums correct, but on {k} devices the elements sent should be {want}, "
                         f"you return {sent}: the owner of parameter j sends it to k-1 devices, "
                         "every other device sends it once, to the owner")
        naive = sum(allreduce([t.clone() for t in ts])[0] for ts in zip(*grads))
        busiest[k] = f"{k} devices: {max(sent):,} vs {naive:,}"
    print("correct: sums and counts; elements the busiest device sends, yours vs the naive "
          "scheme's device 0:\n  " + "\n  ".join(busiest.values()))


def check_fixed_allreduce(fn: Callable | None) -> None:
    """Exercise 2: does fn leave the sum in every tensor of a freshly built list?"""
    if fn is None:
        return print("not answered yet")
    tensors = [torch.full((4,), 10.0 ** i) for i in range(3)]
    fn([t for t in tensors])  # a fresh list, as the textbook's caller passes
    if all(torch.equal(t, torch.full((4,), 111.0)) for t in tensors):
        print("correct: every tensor holds 111")
    else:
        print("not quite: afterwards the tensors hold", [t.tolist() for t in tensors],
              "(assigning to the list's slot does not change the tensor the caller holds)")


def complete_chunks(k: int, steps: int) -> int:
    """(device, chunk) pairs that hold the complete sum after the first steps of ring_schedule(k)."""
    held = [[{i} for _ in range(k)] for i in range(k)]  # contributors per device and chunk
    for phase, transfers in ring_schedule(k)[:steps]:
        for src, dst, c in transfers:
            held[dst][c] = held[dst][c] | held[src][c] if phase == "reduce-scatter" else held[src][c]
    return sum(len(h) == k for row in held for h in row)


def check_complete_chunks(answer: int | Callable[[int, int], int] | None, k: int = 5,
                          steps: int = 6) -> None:
    """Exercise 3: complete (device, chunk) pairs after some steps, found by running the schedule;
    a function answer(k, s) is compared for k = 2..8 after every step s = 0..2(k-1)."""
    if answer is None:
        return print("not answered yet")
    if callable(answer):
        for kk in range(2, 9):
            for s in range(2 * kk - 1):
                if answer(kk, s) != complete_chunks(kk, s):
                    return print(f"not quite: for k={kk} after step {s} you say {answer(kk, s)}, "
                                 f"the schedule gives {complete_chunks(kk, s)} (steps count "
                                 "from 1; s = 0 is the start)")
        return print("correct for k = 2 to 8 after every step")
    expected = complete_chunks(k, steps)
    print("correct" if answer == expected else
          f"not quite ({answer}): how many complete chunks exist when reduce-scatter ends "
          f"(step {k - 1}), and how many does each all-gather step add?")


def check_traffic(answer: tuple[int, int] | None, k: int = 8, n: int = 25_000_000) -> None:
    """Exercise 4: (elements per device, unchunked ring; elements per device, chunked ring)."""
    if answer is None:
        return print("not answered yet")
    unchunked, chunked = answer
    right = [unchunked == (k - 1) * n, chunked == 2 * (k - 1) * n // k]
    print("correct" if all(right) else
          f"not quite: (a) is {'right' if right[0] else 'wrong'} (the whole tensor, k-1 times), "
          f"(b) is {'right' if right[1] else 'wrong'} (chunks of N/k, 2(k-1) times)")
