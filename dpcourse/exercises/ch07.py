"""Checkers for chapter 07's exercises (many processes, DistributedDataParallel by hand)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from ..ddp import make_buckets
from ..lenet import init_lenet_params
from . import answered, is_int, is_number

RING_CASES = [(n, world) for world in (1, 2, 3, 4, 5, 8) for n in (0, 1, 2, 3, 5, 7, 10, 11, 1001)]


def chunk_numels(n: int, world: int) -> list[int]:
    """Sizes of the world chunks torch.tensor_split cuts n elements into: the first
    n % world chunks get one element more."""
    return [n // world + (1 if c < n % world else 0) for c in range(world)]


def ring_sent_reference(n: int, world: int, rank: int) -> int:
    """Elements rank sends in p2p.ring_allreduce of n elements: chunk (rank - step - 1) % world
    in each of the 2(world-1) steps (p2p.ring_chunks)."""
    sizes = chunk_numels(n, world)
    return sum(sizes[(rank - step - 1) % world] for step in range(2 * (world - 1)))


def _ring_hint(got: object, n: int, world: int, rank: int) -> str:
    """Why an answer for one (n, world, rank) of the ring is wrong."""
    sizes = chunk_numels(n, world)
    if not is_int(got):
        return "count whole elements: return an int"
    if world == 1:
        return "with one rank there is no neighbour: nothing is sent"
    if got == 2 * (world - 1) * sizes[rank]:
        return ("a rank does not send its own chunk every time: in step s rank r sends chunk "
                "(r - s - 1) % world, a different one each step")
    if got == 2 * (world - 1) * n // world or got == 2 * (world - 1) * n / world:
        return (f"2(world-1)/world * n holds only on average: tensor_split gives chunks of "
                f"{sizes}, so count which chunks this rank sends")
    return (f"the chunks have {sizes} elements (tensor_split: the first n % world get one more); "
            "in step s = 0 .. 2(world-1)-1 rank r sends chunk (r - s - 1) % world")


def check_ring_sent(ring_sent: Callable[[int, int, int], int] | None) -> None:
    """Exercise 1: elements each rank sends in p2p.ring_allreduce of n elements on world
    ranks, for every rank of many (n, world), with n < world, n = 0 and world = 1 among them."""
    if not answered(ring_sent):
        return
    for n, world in RING_CASES:
        for rank in range(world):
            got, want = ring_sent(n, world, rank), ring_sent_reference(n, world, rank)
            if not is_int(got) or got != want:
                print(f"not quite: ring_sent({n}, {world}, {rank}) returns {got!r}, the ring "
                      f"sends {want}: {_ring_hint(got, n, world, rank)}")
                return
    print(f"correct: every rank's count for {len(RING_CASES)} tensor sizes and world sizes")


SAMPLER_CASES = [(n, world) for world in (1, 2, 3, 4, 8) for n in (0, 1, 2, 3, 7, 8, 10, 12, 25)]


def sampler_indices(n: int, world: int, rank: int, drop_last: bool) -> list[int]:
    """The indices torch's DistributedSampler gives rank of world, without shuffling."""
    return list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False,
                                   drop_last=drop_last))


def _sampler_hint(got: list, want: list, n: int, world: int, rank: int,
                  drop_last: bool) -> str:
    """Why a rank's indices differ from the sampler's."""
    if drop_last and len(got) > len(want):
        return (f"with drop_last the tail is dropped: each rank gets n // world = {n // world} "
                f"indices and the last n % world = {n % world} are never used")
    if not drop_last and len(got) < len(want):
        return (f"without drop_last no example is dropped: the sampler pads the list by wrapping "
                f"around to the start (0, 1, ...) until it divides by {world}, so every rank gets "
                f"ceil(n / world) = {len(want)} indices")
    if len(got) != len(want):
        return f"this rank should get {len(want)} indices"
    dealt = range(rank, min(n, len(want) * world), world)  # the positions not padded
    if got[:len(dealt)] != list(dealt):
        return ("the sampler deals indices out in turn, not in blocks: rank r gets r, r + world, "
                "r + 2 world, ...")
    return ("the padding repeats indices from the start of the dataset (0, 1, ...), wrapping "
            "around again when n < world needs more than n")


def check_shard_indices(shard_indices: Callable[[int, int, int, bool], list[int]] | None) -> None:
    """Exercise 2: each rank's indices from DistributedSampler(range(n), shuffle=False), with
    and without drop_last, compared with torch's sampler itself."""
    if not answered(shard_indices):
        return
    for drop_last in (False, True):
        for n, world in SAMPLER_CASES:
            for rank in range(world):
                got = shard_indices(n, world, rank, drop_last)
                want = sampler_indices(n, world, rank, drop_last)
                if list(got) != want:
                    print(f"not quite: shard_indices({n}, {world}, {rank}, drop_last={drop_last}) "
                          f"returns {list(got)}, DistributedSampler gives {want}: "
                          f"{_sampler_hint(list(got), want, n, world, rank, drop_last)}")
                    return
    print("correct: the sampler's indices on every rank, with and without drop_last; "
          "e.g. 10 samples over 3 ranks:", [sampler_indices(10, 3, r, False) for r in range(3)])


SUM_LOSS_HINTS = {
    256: "256 is what the 4 ranks' gradients add up to; DDP averages them, dividing by the "
         "4 ranks",
    4: "4 is the number of ranks; each rank's sum over its 64 examples is 64 times its mean",
    0.25: "the gradient grows, it does not shrink: a sum over 64 examples is 64 times their mean",
    1: "1 is the factor with reduction='mean' (why DDP averages); reduction='sum' makes each "
       "rank's gradient 64 times its mean's",
    1 / 64: "the other way round: a sum over 64 examples is 64 times their mean, not a 64th",
}


def check_sum_loss_factor(answer: float | None) -> None:
    """Exercise 3: 4 ranks, 64 examples each, reduction='sum', DDP averaging: the gradient is
    64 times the gradient of the mean loss over the global batch of 256."""
    if not answered(answer):
        return
    if not is_number(answer):
        print(f"not quite: give the factor as a number, not {answer!r}")
    elif abs(answer - 64) <= 1e-9:
        print("correct: each rank's sum is 64 x its mean; averaging 4 ranks' means gives the "
              "global mean, so the step is 64 x too large (use lr / 64, or reduction='mean')")
    else:
        hint = next((h for k, h in SUM_LOSS_HINTS.items() if abs(answer - k) <= 1e-9),
                    "write each rank's sum as 64 x its mean, then average over the 4 ranks")
        print(f"not quite: {answer}: {hint}")


def bucket_sizes_reference(numels: list[int], cap_mb: float,
                           dtype: torch.dtype = torch.float32) -> list[int]:
    """Elements per bucket that make_buckets makes for parameters of these numels, in order."""
    params = [nn.Parameter(torch.empty(n, dtype=dtype)) for n in numels]
    return [sum(p.numel() for p in bucket) for bucket in make_buckets(params, cap_mb)]


def lenet_numels() -> list[int]:
    """LeNet's parameter sizes in registration order."""
    return [p.numel() for p in init_lenet_params()]


def bucket_cases() -> list[tuple[list[int], float, torch.dtype]]:
    """(numels, cap in MiB, dtype): LeNet's at several caps, exact fits, oversized, float64."""
    lenet = lenet_numels()
    return [(lenet, 25.0, torch.float32), (lenet, 0.25, torch.float32),
            (lenet, 0.1, torch.float32), (lenet, 0.0, torch.float32),
            ([2**17, 2**17, 2**17], 1.0, torch.float32),  # half a MiB each: two fill a bucket
            ([2**18, 2**18], 1.0, torch.float32),  # exactly one MiB each
            ([10, 3 * 2**18, 20, 30], 0.5, torch.float32),  # 3 MiB: over the cap, alone
            (lenet, 0.1, torch.float64)]


def _bucket_hint(got: list, numels: list[int], cap_mb: float, dtype: torch.dtype) -> str:
    """Why bucket sizes differ from make_buckets'."""
    if sum(got) != sum(numels):
        return f"every parameter goes into exactly one bucket: the sizes add up to {sum(numels)}"
    if cap_mb == 0:
        return "cap 0 means one bucket per parameter"
    forward = bucket_sizes_reference(numels[::-1], cap_mb, dtype)  # filled first to last
    if got in (forward, forward[::-1]):
        return ("buckets are filled in reverse registration order (backward produces the last "
                "layer's gradients first), and listed in that order")
    if dtype != torch.float32 and got == bucket_sizes_reference(numels, cap_mb):
        return "these parameters are float64: 8 bytes per element (use bytes_per_element)"
    cap = f"{cap_mb * 2**20:,.1f}".removesuffix(".0")
    return (f"the cap is cap_mb * 2**20 = {cap} bytes; a bucket may fill up to "
            "exactly the cap, a new one starts only when the next parameter would exceed it, "
            "and a parameter larger than the cap gets a bucket of its own")


def check_bucket_sizes(bucket_sizes: Callable[..., list[int]] | None) -> None:
    """Exercise 4: elements per bucket, in launch order, that dpcourse.ddp.make_buckets makes,
    compared with make_buckets itself on real parameters."""
    if not answered(bucket_sizes):
        return
    for numels, cap_mb, dtype in bucket_cases():
        width = torch.empty(0, dtype=dtype).element_size()
        got = list(bucket_sizes(list(numels), cap_mb, width))
        want = bucket_sizes_reference(numels, cap_mb, dtype)
        if got != want:
            print(f"not quite: bucket_sizes({numels}, {cap_mb}, {width}) returns {got}, "
                  f"make_buckets makes {want}: {_bucket_hint(got, numels, cap_mb, dtype)}")
            return
    print("correct: the buckets of make_buckets; LeNet's at 0.25 MiB:",
          bucket_sizes_reference(lenet_numels(), 0.25), "elements")
