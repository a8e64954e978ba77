"""Chapter 12: what a checkpoint means at another world size. The data position is a global
step, whatever the number of ranks k: ``rank_indices`` is the one cut of a global batch among
k ranks (chapter 13 cuts it among a changing quorum the same way). A flat optimizer shard is
re-cut for the new k (``reshard``), and ``state_at_world_size`` gives a rank its state from a
checkpoint that another number of ranks wrote.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from .fsdp import padded_numel


def rank_indices(n: int, global_batch: int, world: int, rank: int, step: int,
                 seed: int) -> list[int]:
    """The sample indices rank takes at global step `step` (from 0, over the whole run) among
    world ranks: in epoch e, randperm(n) drawn from seed + e, cut into n // global_batch
    batches (the tail dropped); rank takes positions floor(rank G / world) up to
    floor((rank + 1) G / world) of one (G / world each when world divides G)."""
    if not 1 <= world <= global_batch <= n or not 0 <= rank < world:
        raise ValueError(f"need 1 <= ranks <= global batch <= samples and 0 <= rank < ranks, "
                         f"got {world} ranks, global batch {global_batch}, {n} samples, "
                         f"rank {rank}")
    epoch, batch = divmod(step, n // global_batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    start = batch * global_batch
    return order[start + rank * global_batch // world:
                 start + (rank + 1) * global_batch // world].tolist()


class GlobalBatchSampler:
    """train_ddp's batches under --global-batch-size G: rank's share of each global batch of
    an epoch (rank_indices), the same global batches for every world size k. train_ddp
    averages each rank's mean loss, so k must divide G there (equal shares)."""

    def __init__(self, n: int, global_batch: int, rank: int, world: int, seed: int) -> None:
        if global_batch % world or global_batch > n:
            allowed = [k for k in range(1, global_batch + 1) if global_batch % k == 0]
            raise ValueError(f"--global-batch-size {global_batch} on {world} processes: the "
                             f"number of processes k must divide it (it allows k in {allowed}), "
                             f"and it may be at most --train-size {n}")
        self.n, self.global_batch, self.rank, self.world = n, global_batch, rank, world
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.epoch * len(self), (self.epoch + 1) * len(self)):
            yield rank_indices(self.n, self.global_batch, self.world, self.rank, step,
                               self.seed)


def reshard(shards: list[torch.Tensor], numel: int, world: int) -> list[torch.Tensor]:
    """The flat shards (zero-padded, as FSDP cuts them) of a tensor of numel elements, re-cut
    for world ranks: the same elements in order, each new shard padded_numel(numel, world) //
    world long, the padding zeros."""
    if sum(len(shard) for shard in shards) < numel:
        raise ValueError(f"{len(shards)} shards hold {sum(map(len, shards))} elements, "
                         f"fewer than the tensor's {numel}")
    whole = torch.cat(shards)[:numel]
    padded = torch.zeros(padded_numel(numel, world), dtype=whole.dtype)
    padded[:numel] = whole
    return [piece.clone() for piece in padded.chunk(world)]


def state_at_world_size(path: object, state: dict[str, Any], rank: int, world: int,
                        fsdp_numels: list[int] | None) -> dict[str, Any]:
    """Rank's state from a train_ddp checkpoint written by another number of ranks (the same
    --global-batch-size): FSDP's optimizer shards re-divided (fsdp_numels: each unit's
    numel), DDP's optimizer state (the same on every rank: checked) rank 0's, no random
    state. Refused, naming path, if it holds state each rank owns."""
    ranks, held = state["ranks"], len(state["ranks"])
    owned = [what for what, there in (
        ("PowerSGD's error feedback (--comm-hook powersgd)", ranks[0]["hook"] is not None),
        ("DiLoCo's parameters, one set per rank (--diloco)", ranks[0]["model"] is not None),
        ("each rank's dropout masks (--dropout)", state["args"]["dropout"] > 0)) if there]
    if owned:
        raise RuntimeError(f"checkpoint {path} was written by {held} processes and holds state "
                           f"each of them owns: {'; '.join(owned)}. It resumes on {held} "
                           f"processes only, not {world}")
    if fsdp_numels is not None:
        optimizer = redivided_optimizer([r["optimizer"] for r in ranks], fsdp_numels, rank,
                                        world)
    else:
        optimizer = ranks[0]["optimizer"]
        differ = [r for r, mine in enumerate(ranks) if not identical(mine["optimizer"], optimizer)]
        if differ:
            raise RuntimeError(f"checkpoint {path}: the optimizer state of rank(s) {differ} "
                               "differs from rank 0's, which data parallelism keeps the same "
                               "on every rank; it cannot be resumed at another world size")
    return {"optimizer": optimizer, "hook": None, "model": None, "rng": None}


def redivided_optimizer(states: list[dict[str, Any]], numels: list[int], rank: int,
                        world: int) -> dict[str, Any]:
    """Rank's optimizer state among world ranks from the per-shard states (parameter i: a flat
    shard of a unit of numels[i] elements) that the checkpoint's ranks held: each flat state
    tensor re-cut as the parameters are (reshard)."""
    def redivided(i: int, key: str, value: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and value.dim() == 1):
            return value  # a count or a scalar, the same on every rank
        return reshard([state["state"][i][key] for state in states], numels[i], world)[rank]
    return {"state": {i: {key: redivided(i, key, value) for key, value in entries.items()}
                      for i, entries in states[0]["state"].items()},
            "param_groups": states[0]["param_groups"]}


def identical(a: Any, b: Any) -> bool:
    """Whether a and b (tensors in dicts, lists, tuples) are equal, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(identical, a, b))
    return a == b
