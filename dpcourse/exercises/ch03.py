"""Checkers for chapter 03's exercises (data synchronisation)."""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from ..collectives import allreduce
from ..lenet import init_lenet_params
from ..ring import ring_allreduce, ring_schedule
from . import answered, count, is_int


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


def ring_sum_trees(k: int) -> list[object]:
    """How the ring sums each chunk, played on ring_schedule(k): chunk c's sum as a tree of
    additions over device numbers, canonical (each addition's two operands sorted), since
    one float addition gives the same bits in either order."""
    def add(a: object, b: object) -> object:
        return tuple(sorted((a, b), key=repr))
    held = [[d for _ in range(k)] for d in range(k)]  # the tree each device holds per chunk
    for phase, transfers in ring_schedule(k):
        for src, dst, c in transfers:
            piece = held[src][c]
            held[dst][c] = add(held[dst][c], piece) if phase == "reduce-scatter" else piece
    assert all(row == held[0] for row in held), "the ring left the devices with other sums"
    return held[0]


def _left_fold(order: list[int]) -> object:
    """The tree of ((order[0] + order[1]) + order[2]) + ..., canonical as in ring_sum_trees."""
    tree: object = order[0]
    for d in order[1:]:
        tree = tuple(sorted((tree, d), key=repr))
    return tree


def check_addition_order(addition_order: Callable[[int, int], list[int]] | None) -> None:
    """Exercise 5: addition_order(k, c), the devices whose values the ring adds into chunk c,
    in the order of the additions, against the schedule played for k = 1 to 8."""
    if not answered(addition_order):
        return
    for k in range(1, 9):
        trees = ring_sum_trees(k)
        for c in range(k):
            order = addition_order(k, c)
            if (not isinstance(order, (list, tuple)) or sorted(order) != list(range(k))
                    or not all(is_int(d) for d in order)):
                return print(f"not quite: addition_order({k}, {c}) = {order!r}; give a list "
                             f"of the {k} device numbers, each once")
            if _left_fold(list(order)) != trees[c]:
                return print(f"not quite: addition_order({k}, {c}) = {list(order)}, but on "
                             f"{count(k, 'device')} chunk {c} starts on device {c}, which "
                             f"sends it to device {(c + 1) % k}; follow it around the ring")
    print("correct: chunk c is summed in the ring's order c, c+1, ..., c-1 (mod k), starting "
          "on its own device")


def check_differing_chunks(answer: set[int] | None, k: int = 4, n: int = 4_000) -> None:
    """Exercise 5: the chunks of the ring's sum on k devices that may differ in their bits from
    the naive allreduce's (device 0's tensor, then 1's, ...); tried on random float32 too."""
    if not answered(answer):
        return
    if not isinstance(answer, (set, frozenset, list, tuple)) or not all(is_int(c) for c in answer):
        return print(f"not quite: give a set of chunk numbers such as {{0, 2}}, not {answer!r}")
    naive, trees = _left_fold(list(range(k))), ring_sum_trees(k)
    truth = {c for c, tree in enumerate(trees) if tree != naive}
    if set(answer) == truth:
        g = torch.Generator().manual_seed(0)
        data = [torch.randn(n, generator=g) for _ in range(k)]
        by_naive, by_ring = [t.clone() for t in data], [t.clone() for t in data]
        allreduce(by_naive), ring_allreduce(by_ring)
        differ = [int((a != b).sum()) for a, b in zip(by_naive[0].tensor_split(k),
                                                      by_ring[0].tensor_split(k))]
        same = all(torch.equal(t, by_ring[0]) for t in by_ring)
        return print(f"correct: chunks {sorted(truth)}. On {n:,} random float32 numbers per "
                     f"device, elements that differ from the naive sum, chunk by chunk: {differ}; "
                     f"all {k} devices hold the same bits: {same}")
    for c in sorted(set(answer) - truth):
        print(f"not quite: chunk {c} is added in the naive order, "
              + ("device 0's value first" if c == 0 else "") + ": it cannot differ")
    for c in sorted(truth - set(answer)):
        print(f"not quite: chunk {c} is summed starting with device {c}'s value, not device 0's "
              "then 1's: its rounding can differ")


def _simulated(k: int) -> list[torch.device]:
    return [torch.device("cpu", i) for i in range(k)]


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors that t's autograd graph accumulates gradients into."""
    found, stack, seen = [], [t.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            found.append(fn.variable)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def _not_a_leaf(copy: torch.Tensor, source: torch.Tensor) -> str:
    """Why a copy that is no leaf is one: linked to the source, or made after requires_grad_()."""
    if any(leaf is source for leaf in _leaves(copy)):
        return "the copy is no leaf, autograd links it to the source: detach() before copying"
    return ("the copy is no leaf: .to recorded the copy for autograd because its input already "
            "required grad; call requires_grad_() on the copy, after .to")


def check_get_params(get_params: Callable) -> None:
    """Your get_params(params, device): equal values in new memory on device, a leaf that
    requires grad, and the source untouched, even where p.to(device) would be p itself and
    for sources that require grad themselves."""
    for device, source_grad in itertools.product((torch.device("cpu"), torch.device("cpu", 1)),
                                                 (False, True)):
        params = [p.requires_grad_(source_grad) for p in init_lenet_params(seed=0, scale=0.1)]
        before = [p.detach().clone() for p in params]
        replica = get_params(params, device)
        assert isinstance(replica, list) and len(replica) == len(params), (
            f"get_params should return a list of {len(params)} tensors, got {replica!r:.60}")
        for i, (p, r) in enumerate(zip(params, replica)):
            where = (f"on {device}, parameter {i}"
                     + (" of sources that require grad" if source_grad else ""))
            assert torch.equal(r.detach(), before[i]), f"{where}: the copy's values differ"
            assert r.data_ptr() != p.data_ptr(), (
                f"{where}: the copy is in the source's memory; ask .to for copy=True")
            assert r.device.type == device.type, f"{where}: the copy is on {r.device}"
            assert r.requires_grad, f"{where}: the copy must require grad (requires_grad_())"
            assert r.is_leaf, f"{where}: {_not_a_leaf(r, p)}"
            assert p.requires_grad == source_grad, (
                f"{where}: the source's requires_grad changed; leave the source untouched")
    print("get_params is right: independent leaf copies that require grad, the source untouched")


def check_broadcast(broadcast: Callable) -> None:
    """Your broadcast(tensor, devs): one copy per device, each in its own memory, none
    requiring grad, and a ValueError for an empty device list."""
    source = torch.arange(6.0).reshape(2, 3).requires_grad_()
    cpu = torch.device("cpu")
    for devs in [[cpu] + _simulated(k - 1) for k in (1, 2, 3, 5)] + [[cpu, cpu]]:
        k = len(devs)
        copies = broadcast(source, devs)
        assert isinstance(copies, list) and len(copies) == k, (
            f"{count(k, 'device')} should give a list of {count(k, 'copy', 'copies')}, got "
            f"{copies!r:.60}")
        memory = {source.data_ptr()} | {c.data_ptr() for c in copies}
        where = "[cpu, cpu]" if devs == [cpu, cpu] else count(k, "device")
        assert len(memory) == k + 1, (
            f"on {where} some copies share memory with each other or with the tensor: .to "
            "returns its input when it is already there; ask it for copy=True, per device")
        for d, c in zip(devs, copies):
            assert torch.equal(c, source.detach()), f"the copy for {d} has other values"
            assert not c.requires_grad, f"the copy for {d} requires grad: detach it"
    try:
        broadcast(source, [])
    except ValueError:
        return print("broadcast is right: independent copies on 1, 2, 3 and 5 devices, and a "
                     "clear error for no devices")
    raise AssertionError("broadcast(tensor, []) did not raise a ValueError: call check_devices")


def _contributions(k: int, shape: tuple[int, ...] = (3, 7)) -> list[torch.Tensor]:
    """k tensors of small whole numbers (so any order of additions sums exactly)."""
    g = torch.Generator().manual_seed(k)
    return [torch.randint(-9, 10, shape, generator=g).float() for _ in range(k)]


def _check_sums(fn: Callable, sent_for: Callable, shape: tuple[int, ...] = (3, 7)) -> None:
    """fn sums in place for k = 1..6 on simulated devices and returns sent_for(k, N)."""
    for k in range(1, 7):
        data = _contributions(k, shape)
        total = torch.stack(data).sum(0)
        tensors = [t.to(d) for t, d in zip(data, _simulated(k))]
        sent = fn(list(tensors))  # a fresh list, as train_batch passes: only writes count
        for i, t in enumerate(tensors):
            assert torch.equal(t, total), (
                f"{count(k, 'device')}: tensor {i} does not hold the sum; write it into the "
                "tensor (add_, copy_), not into the list")
        want = sent_for(k, total.numel())
        assert list(sent) == want, (f"{count(k, 'device')} of {total.numel()} elements: "
                                    f"sent {sent}, want {want}")


def check_allreduce(allreduce: Callable) -> None:
    """Your allreduce(tensors): every tensor holds the sum, written in place, and the counts
    (k-1)N for the first device, N for each other; shared memory is refused."""
    _check_sums(allreduce, lambda k, n: [(k - 1) * n] + [n] * (k - 1))
    t = torch.ones(3)
    try:
        allreduce([t, t])
    except ValueError:
        return print("allreduce is right: the sum in place on 1-6 devices, the counts, and an "
                     "error for tensors that share memory")
    raise AssertionError("allreduce([t, t]) did not raise a ValueError: call check_collective")


def _ring_sent(k: int, n: int) -> list[int]:
    """What device i sends in a chunked ring: every chunk but (i+1) mod k in the
    reduce-scatter, every chunk but (i+2) mod k in the all-gather."""
    if k == 1:
        return [0]
    sizes = [len(c) for c in torch.arange(n).tensor_split(k)]
    return [2 * n - sizes[(i + 1) % k] - sizes[(i + 2) % k] for i in range(k)]


def check_ring_allreduce(ring_allreduce: Callable) -> None:
    """Your ring_allreduce(tensors): the sum in place on 1-6 devices (21 elements, so the
    chunks are unequal), the counts of a chunked ring, and a non-contiguous tensor too."""
    _check_sums(ring_allreduce, _ring_sent)
    data = [t.t() for t in _contributions(3)]  # transposed: not contiguous
    total = torch.stack(data).sum(0)
    ring_allreduce(data)
    assert all(torch.equal(t, total) for t in data), (
        "transposed (non-contiguous) tensors do not hold the sum: sum into a contiguous copy "
        "and copy it back")
    print("ring_allreduce is right: the sum in place on 1-6 devices, each device sending what "
          "a chunked ring sends, non-contiguous tensors too")


def tree_sent(k: int, n: int) -> list[int]:
    """Elements each device sends in a binary-tree allreduce in heap order: its tensor to its
    parent (all but device 0), then the sum to each of its children (2i+1, 2i+2)."""
    return [n * ((i > 0) + sum(c < k for c in (2 * i + 1, 2 * i + 2))) for i in range(k)]


def check_tree_allreduce(fn: Callable | None) -> None:
    """Exercise 6: fn(tensors) sums in place over a binary tree and returns what each device
    sent, as tree_sent counts it."""
    if fn is None:
        return print("not answered yet")
    try:
        _check_sums(fn, tree_sent)
    except AssertionError as err:
        return print(f"not quite: {err}")
    busiest = max(tree_sent(8, 840)) // 840
    print(f"correct: the sums, and on 8 devices the busiest device sends {busiest} N (the ring: "
          "1.75 N), over 3 levels up and 3 down (the ring: 14 steps)")
