"""What the HSDP tests launch on every rank (q replica groups of g ranks): ours, torch's
fully_shard on a 2-D mesh, plain ScratchFSDP; ranks import it from tests/."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.fsdp import ScratchFSDP
from dpcourse.hsdp import scratch_hsdp

STEPS = 3


def net(seed: int, width: int) -> nn.Module:
    """Two units and a root: a small MLP on 12 features."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 5)).double()


def batch(step: int, rank: int, world: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's global batch of size samples, this rank's contiguous share of it."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 12, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (size,), generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def train(model: nn.Module, case: dict[str, Any]) -> None:
    """STEPS steps of AdamW on the mean cross-entropy of this rank's share."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(STEPS):
        x, y = batch(step, rank, world, case["batch"])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def one_process(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The reference: one process on the global batches, from seed 0's model."""
    model = net(0, case["width"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(STEPS):
        x, y = batch(step, 0, 1, case["batch"])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def ours(case: dict[str, Any]) -> dict[str, Any]:
    """scratch_hsdp over groups of case["g"] ranks (each rank starts from its own random model:
    rank 0's is the one sharded), trained; its full state and the bytes it sent across groups
    and inside its group."""
    model = scratch_hsdp(net(dist.get_rank(), case["width"]), case["g"])
    train(model, case)
    return {"state": model.full_state_dict(), "across": model.replicate.bytes_handed,
            "inside": dict(model.timeline.bytes), "shards": [u.shard.numel() for u in model.units]}


def torchs(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """torch's HSDP: fully_shard on a (q, g) mesh, each Linear a unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size() // case["g"], case["g"]),
                            mesh_dim_names=("replicate", "shard"))
    model = net(0, case["width"])
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, case)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def plain_fsdp(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """ScratchFSDP over every rank, for groups of all the ranks (q = 1)."""
    model = ScratchFSDP(net(dist.get_rank(), case["width"]))
    train(model, case)
    return model.full_state_dict()


def runs(case: dict[str, Any]) -> dict[str, Any]:
    """Ours, torch's, and plain ScratchFSDP when there is one group, on this rank."""
    return {"ours": ours(case), "torch": torchs(case),
            "fsdp": plain_fsdp(case) if case["g"] == dist.get_world_size() else None}


def errors() -> list[str]:
    """What a wrong group size and a ring with groups raise, on this rank."""
    from dpcourse.hsdp import hsdp_groups
    said = []
    for bad in (lambda: hsdp_groups(3), lambda: hsdp_groups(0),
                lambda: ScratchFSDP(net(0, 3), ring=True, group=dist.group.WORLD)):
        try:
            bad()
            said.append("no error")
        except ValueError as error:
            said.append(str(error))
    return said
