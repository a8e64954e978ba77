"""Chapter 12: what a checkpoint means at another world size. The data position is a global
step, whatever the number of ranks k, and a flat optimizer shard is re-cut for the new k."""
from __future__ import annotations

import torch

from .fsdp import padded_numel


def rank_indices(n: int, global_batch: int, world: int, rank: int, step: int,
                 seed: int) -> list[int]:
    """The sample indices rank takes at global step `step` (from 0, over the whole run) among
    world ranks: in epoch e, randperm(n) drawn from seed + e, cut into n // global_batch
    batches (the tail dropped); rank takes the rank-th of world contiguous slices of one."""
    if global_batch % world or not 0 <= rank < world or global_batch > n:
        raise ValueError(f"{world} ranks must divide the global batch {global_batch} (at most "
                         f"{n} samples), and rank {rank} be one of them")
    epoch, batch = divmod(step, n // global_batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    share = global_batch // world
    first = batch * global_batch + rank * share
    return order[first:first + share].tolist()


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
