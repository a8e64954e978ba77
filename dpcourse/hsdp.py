"""Chapter 14: hybrid sharded data parallelism (HSDP) built by hand.

The q x g ranks form q replica groups of g consecutive ranks. Inside a group, ``ScratchFSDP``
shards every unit over its g ranks (chapter 10); across groups, the ranks that hold the same
shard are replicas of each other. After a unit's gradient is reduce-scattered inside the
group, ``Replicate`` averages that shard over the q groups (one allreduce per shard), and the
wrapper divides by g: the average over every rank, as DDP over all of them. Parameters and
optimizer state stay sharded inside a group and replicated across groups. torch's own is
``fully_shard`` on a 2-D mesh (replicate x shard).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .fsdp import ScratchFSDP


class Replicate:
    """Averages a gradient shard over the groups (the ranks that hold the same shard: one
    allreduce), counting the bytes this rank hands to that allreduce."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.bytes_handed = group, dist.get_world_size(group), 0

    def __call__(self, shard_sum: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(shard_sum, group=self.group)
        self.bytes_handed += shard_sum.numel() * shard_sum.element_size()
        return shard_sum.div_(self.size)


def hsdp_groups(group_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's shard group (the group_size consecutive ranks of its replica group) and its
    replicate group (the rank holding the same shard in every group). Every rank must call it,
    in the same order as the other collectives: it builds every group of the world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(group_size, int) or group_size < 1 or world % group_size:
        raise ValueError(f"hsdp_groups: group_size must divide the world size {world} into "
                         f"replica groups, got {group_size!r}")
    shard_groups = [dist.new_group(list(range(start, start + group_size)))
                    for start in range(0, world, group_size)]
    replicate_groups = [dist.new_group(list(range(shard, world, group_size)))
                        for shard in range(group_size)]
    return shard_groups[rank // group_size], replicate_groups[rank % group_size]


def scratch_hsdp(module: nn.Module, group_size: int, **fsdp_options: Any) -> ScratchFSDP:
    """module wrapped as HSDP: ScratchFSDP over the group_size ranks of this rank's replica
    group, each reduce-scattered gradient averaged over the groups by a Replicate."""
    shard_group, replicate_group = hsdp_groups(group_size)
    return ScratchFSDP(module, group=shard_group, replicate=Replicate(replicate_group),
                       **fsdp_options)
