"""Checkers for chapter 12's parts and exercises (beyond one node: the data position and the
optimizer state at another world size)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from ..fsdp import flat_shard, padded_numel
from . import answered, count, is_int, is_number, one_line_failure

INDEX_CASES = [(100, 12, 3), (96, 12, 4), (20, 4, 2), (7, 7, 1)]  # (n, global batch, seed)
SHARD_CASES = [(10, 3, 2), (10, 2, 4), (7, 1, 3), (9, 4, 1), (12, 4, 3)]  # (numel, k, new k)


def reference_indices(n: int, global_batch: int, world: int, rank: int, step: int,
                      seed: int) -> list[int]:
    """An independent reference: position j of a global batch goes to the rank r with
    floor(r G / k) <= j < floor((r + 1) G / k), which is r = ((j + 1) k - 1) // G."""
    per_epoch = n // global_batch
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + step // per_epoch))
    batch = order.view(-1)[:per_epoch * global_batch].view(per_epoch, global_batch)
    row = batch[step % per_epoch].tolist()
    return [i for j, i in enumerate(row) if ((j + 1) * world - 1) // global_batch == rank]


def check_rank_indices(rank_indices: Callable[..., list[int]]) -> None:
    """Part 1: rank_indices(n, G, k, r, s, seed) is rank r's cut of global batch s among k
    ranks, for every k from 1 to 7 (dividing G or not), over two epochs."""
    first = one_line_failure("rank_indices(100, 12, 3, 1, 9, 3)",
                             lambda: rank_indices(100, 12, 3, 1, 9, 3))
    for n, global_batch, seed in INDEX_CASES:
        worlds = sorted(range(1, min(global_batch, 7) + 1), key=lambda k: global_batch % k > 0)
        for world in worlds:  # the worlds that divide G first: their hint is simpler
            for rank in range(world):
                for step in range(2 * (n // global_batch)):
                    expected = reference_indices(n, global_batch, world, rank, step, seed)
                    got = one_line_failure(
                        f"rank_indices({n}, {global_batch}, {world}, {rank}, {step}, {seed})",
                        lambda: list(rank_indices(n, global_batch, world, rank, step, seed)))
                    if got != expected:
                        hint = _index_hint(got, expected, n, global_batch, world, rank, step,
                                           seed)
                        raise AssertionError(
                            f"n={n}, G={global_batch}, rank {rank} of {world}, step {step} (epoch "
                            f"{step // (n // global_batch)}): got {_shown(got)}, expected "
                            f"{_shown(expected)}: {hint}")
    print(f"correct: rank 1 of 3 at step 9 (n=100, G=12, seed 3) takes {first}; the same "
          "global batches for every k")


def _tail_kept(n: int, global_batch: int, world: int, rank: int, step: int,
               seed: int) -> list[list[int]]:
    """Two cuts that keep an epoch's last n % G samples: the permutations read as one stream,
    and ceil(n / G) batches an epoch (the last one short)."""
    def cut(epoch: int, start: int) -> list[int]:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        return order[start + rank * global_batch // world:
                     start + (rank + 1) * global_batch // world].tolist()
    epoch, start = divmod(step * global_batch, n)
    per_epoch = -(-n // global_batch)
    return [cut(epoch, start), cut(step // per_epoch, step % per_epoch * global_batch)]


def _shown(indices: list[int], first: int = 6) -> str:
    """The list, or its first few and how many there are in all when it is longer."""
    if len(indices) <= first:
        return str(indices)
    return f"[{', '.join(map(str, indices[:first]))}, ...] ({len(indices)} in all)"


def _index_hint(got: list[int], expected: list[int], n: int, global_batch: int, world: int,
                rank: int, step: int, seed: int) -> str:
    """What the wrong cut got wrong."""
    whole = reference_indices(n, global_batch, 1, 0, step, seed)  # the global batch, in order
    if got in _tail_kept(n, global_batch, world, rank, step, seed):
        return (f"an epoch has n // G = {n // global_batch} global batches: its last "
                f"{n % global_batch} samples are dropped (as DataLoader's drop_last), and the "
                "next epoch starts afresh")
    if got == whole[rank::world]:
        return "a rank takes one contiguous slice of the global batch, not a strided one"
    if sorted(got) == sorted(expected):
        return "the right samples in the wrong order: slice randperm's order as it is"
    if global_batch % world:
        return (f"{world} ranks do not divide G = {global_batch}: rank r's slice runs from "
                "floor(r G / k) up to floor((r + 1) G / k), so the slices differ by one at most")
    if len(got) != len(expected):
        return f"each rank takes G / k = {global_batch // world} samples"
    return ("the epoch is step // (n // G), shuffled from seed + epoch; the batch within it is "
            "step % (n // G), and rank r's slice starts at r * G / k inside it")


def check_reshard(reshard: Callable[[list[torch.Tensor], int, int], list[torch.Tensor]]) -> None:
    """Part 2: reshard(shards, numel, k') re-cuts k padded flat shards into FSDP's k'."""
    whole = torch.arange(1.0, 11.0, dtype=torch.float64)
    first = one_line_failure("reshard", lambda: reshard(
        [flat_shard(whole, r, 3) for r in range(3)], 10, 2))
    for numel, before, after in SHARD_CASES:
        whole = torch.linspace(-1, 1, numel, dtype=torch.float64) + 0.5
        got = list(reshard([flat_shard(whole, r, before) for r in range(before)], numel, after))
        want = [flat_shard(whole, r, after) for r in range(after)]
        where = f"{numel} elements, from {before} rank{'s' * (before > 1)} to {after}"
        if len(got) != after:
            raise AssertionError(f"{where}: {count(len(got), 'shard')}, expected one per new "
                                 f"rank: {after}")
        for r, (mine, right) in enumerate(zip(got, want)):
            if mine.shape != right.shape:
                raise AssertionError(f"{where}: shard {r} has {count(mine.numel(), 'element')}, "
                                     f"expected padded_numel({numel}, {after}) // {after} = "
                                     f"{len(right)}")
            if mine.dtype != right.dtype:
                raise AssertionError(f"{where}: shard {r} is {mine.dtype}, the shards are "
                                     f"{right.dtype}: pad with zeros of the shards' dtype")
            if not torch.equal(mine, right):
                raise AssertionError(f"{where}: shard {r} is {mine.tolist()}, expected "
                                     f"{right.tolist()} (strip the old padding, pad with zeros)")
    print(f"correct: 10 elements in 3 shards re-cut for 2 ranks: {[s.tolist() for s in first]}")


# --- exercises ---

def _as_tuple(answer: object, count: int) -> tuple | None:
    """answer as a tuple of count whole numbers (a list or any sequence will do), else None."""
    if isinstance(answer, Sequence) and not isinstance(answer, str) and len(answer) == count \
            and all(map(is_int, answer)):
        return tuple(answer)
    return None


def samples_per_epoch_reference(n: int, global_batch: int, world: int) -> tuple[int, int]:
    """(DistributedSampler's samples per epoch on world ranks, the global sampler's)."""
    distributed = sum(len(DistributedSampler(range(n), world, r)) for r in range(world))
    return distributed, n // global_batch * global_batch


EPOCH_CASES = [(4096, 96, 3), (4096, 96, 2), (1000, 64, 4), (100, 12, 1)]


def check_samples_per_epoch(samples_per_epoch: Callable[[int, int, int], tuple[int, int]] | None
                            ) -> None:
    """Exercise 1: the samples one epoch draws on k ranks, DistributedSampler and global."""
    if not answered(samples_per_epoch):
        return
    for case in EPOCH_CASES:
        got, want = samples_per_epoch(*case), samples_per_epoch_reference(*case)
        if _as_tuple(got, 2) is None:
            print(f"not quite: samples_per_epoch{case} returns {got!r}: return two whole "
                  "numbers, (DistributedSampler's, the global sampler's), as a tuple or a list")
            return
        if _as_tuple(got, 2) != want:
            n, global_batch, world = case
            print(f"not quite: n={n}, G={global_batch}, k={world}: {got!r}, want {want}: "
                  "DistributedSampler pads each rank to ceil(n / k) samples; the global sampler "
                  "drops the tail after the last whole global batch")
            return
    print("correct: 4,096 images on 3 ranks: DistributedSampler draws 4,098, "
          "the global sampler 4,032 with G=96 (and the same on 2 ranks)")


def check_resume_point(resume_point: Callable[[int, int, int], tuple[int, int, int]] | None
                       ) -> None:
    """Exercise 2: (epoch, batches to skip in it, samples seen) of a checkpoint's step."""
    if not answered(resume_point):
        return
    for step, n, global_batch in [(0, 100, 12), (8, 100, 12), (9, 100, 12), (130, 2048, 32)]:
        per_epoch = n // global_batch
        want = (step // per_epoch, step % per_epoch, step * global_batch)
        got = resume_point(step, n, global_batch)
        if _as_tuple(got, 3) is None:
            print(f"not quite: resume_point({step}, {n}, {global_batch}) returns {got!r}: return "
                  "three whole numbers, (epoch, batches, samples), as a tuple or a list")
            return
        if _as_tuple(got, 3) != want:
            print(f"not quite: step {step}, n={n}, G={global_batch}: {got!r}, want {want}: "
                  f"an epoch has n // G = {per_epoch} steps; each step draws G samples")
            return
    print("correct: step 130 of n=2048, G=32: epoch 2, skip 2 batches, 4,160 samples seen")


# exercise 3: Young's checkpoint interval, checked against failures the checker simulates
INTERVAL_CASES = [(60.0, 86_400.0), (300.0, 4 * 3_600.0), (10.0, 3_600.0)]  # (C, M) seconds
LIVES = 100_000  # runs between two failures drawn per case: losses within about 0.1%
INTERVAL_TOLERANCE = 0.01  # an interval may lose 1% (relative) more than the best one


def best_interval_reference(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum: sqrt(2 C M) seconds of training between checkpoints."""
    return math.sqrt(2 * checkpoint_seconds * mtbf_seconds)


def failure_gaps(mtbf_seconds: float, seed: int = 0) -> np.ndarray:
    """LIVES times between two failures, exponential of mean mtbf_seconds."""
    return np.random.default_rng(seed).exponential(mtbf_seconds, LIVES)


def simulated_loss(interval: float, checkpoint_seconds: float, gaps: np.ndarray) -> float:
    """The share of time a run loses when it writes a checkpoint (checkpoint_seconds) after
    every `interval` seconds of training and fails after each of gaps: between two failures
    only the intervals whose checkpoint was written count; the rest is redone."""
    cycles = np.floor_divide(gaps, interval + checkpoint_seconds)
    return float(1 - cycles.sum() * interval / gaps.sum())


def _simulated_best(checkpoint_seconds: float, gaps: np.ndarray,
                    around: float) -> tuple[float, float]:
    """(interval, loss): the least simulated loss on a grid from around / 2 to 2 around."""
    grid = [around * 2 ** (k / 8) for k in range(-8, 9)]
    return min(((t, simulated_loss(t, checkpoint_seconds, gaps)) for t in grid),
               key=lambda pair: pair[1])


def _seconds(value: float) -> str:
    return f"{value:,.0f} s" if value >= 10 else f"{value:.3g} s"


def _interval_hint(got: float, checkpoint_seconds: float, mtbf_seconds: float) -> str:
    """Why an interval loses more time than it must, from the usual slips."""
    young = best_interval_reference(checkpoint_seconds, mtbf_seconds)

    def near(value: float) -> bool:
        return abs(got - value) <= 0.02 * value
    if near(math.sqrt(checkpoint_seconds * mtbf_seconds)):
        return ("a failure strikes on average halfway through an interval, so it costs half an "
                "interval of work, not a whole one")
    if near(young / 60) or near(young / 3600):
        return "give it in seconds, as C and M are"
    if near(young / mtbf_seconds):
        return ("that is sqrt(2 C / M), the share of time lost at the best interval; the "
                "interval is M times that, in seconds")
    return ("per second of training a run loses C / t writing checkpoints and, failing every M "
            "seconds, t / (2 M) redoing work: find the t with the least sum")


def check_best_interval(best_interval: Callable[[float, float], float] | None) -> None:
    """Exercise 3: the checkpoint interval that loses the least time, against a simulation."""
    if not answered(best_interval):
        return
    for checkpoint_seconds, mtbf_seconds in INTERVAL_CASES:
        got = best_interval(checkpoint_seconds, mtbf_seconds)
        where = f"C = {checkpoint_seconds:g} s, M = {mtbf_seconds:g} s"
        if not (is_number(got) and math.isfinite(got) and got > 0):
            print(f"not quite: {where}: {got!r}: return a number of seconds > 0")
            return
        gaps = failure_gaps(mtbf_seconds)
        best, least = _simulated_best(checkpoint_seconds, gaps,
                                      best_interval_reference(checkpoint_seconds, mtbf_seconds))
        loss = simulated_loss(got, checkpoint_seconds, gaps)
        if loss > (1 + INTERVAL_TOLERANCE) * least:
            print(f"not quite: {where}: every {_seconds(got)} loses {loss:.2%} of the time in "
                  f"the simulation, every {_seconds(best)} {least:.2%}: "
                  + _interval_hint(got, checkpoint_seconds, mtbf_seconds))
            return
    checkpoint_seconds, mtbf_seconds = INTERVAL_CASES[0]
    young = best_interval_reference(checkpoint_seconds, mtbf_seconds)
    gaps = failure_gaps(mtbf_seconds)
    losses = [simulated_loss(f * young, checkpoint_seconds, gaps) for f in (0.5, 1, 2)]
    print(f"correct: a 60 s checkpoint, a failure a day: every {young / 60:.0f} min (sqrt(2 C M)); "
          f"in the simulation {losses[1]:.1%} of the time lost, {losses[0]:.1%} at half that "
          f"interval, {losses[2]:.1%} at twice")
