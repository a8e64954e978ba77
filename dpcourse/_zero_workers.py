"""Functions the ZeRO tests run on every rank with ``launch`` (chapter 09)."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ._workers import tied_net
from .ddp import ScratchDDP
from .zero import ShardedOptimizer

STEPS = 10
UNUSED_STEP = 3  # the step in which TiedNet.sometimes gets no gradient
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def tiny_net(seed: int) -> nn.Module:
    """One parameter in all (fewer than the ranks), float64."""
    torch.manual_seed(seed)
    return nn.Linear(6, 8, bias=False).double()


MODELS: dict[str, Callable[[int], nn.Module]] = {"tied": tied_net, "tiny": tiny_net}


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's global batch of 12 examples (float64), this rank's share of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(12, 6, generator=g, dtype=torch.float64).chunk(world)[rank]
    y = torch.randn(12, 8, generator=g, dtype=torch.float64).chunk(world)[rank]
    return x, y


def backward(model: nn.Module, step: int, rank: int = 0, world: int = 1) -> None:
    """Mean squared error of model on its share of step's batch, then backward."""
    x, y = batch(step, rank, world)
    kwargs = {"use_sometimes": step != UNUSED_STEP} if _is_tied(model) else {}
    nn.functional.mse_loss(model(x, **kwargs), y).backward()


def _is_tied(model: nn.Module) -> bool:
    inner = getattr(model, "module", model)
    return hasattr(inner, "sometimes")


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0,
          world: int = 1) -> list[torch.Tensor]:
    """steps training steps; the flat parameters after each."""
    after = []
    for step in steps:
        opt.zero_grad()
        backward(model, step, rank, world)
        opt.step()
        after.append(flat(model))
    return after


def flat(model: nn.Module) -> torch.Tensor:
    """Every parameter of model, in order, as one vector (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def sharded_against_plain(model_name: str, opt_name: str) -> dict:
    """STEPS steps of ShardedOptimizer and of the plain optimizer on the same model and the
    same (whole) batches on every rank: parameters after each step, owners, state."""
    cls, kwargs = OPTIMIZERS[opt_name]
    model, reference = MODELS[model_name](0), MODELS[model_name](0)
    params = list(model.parameters())
    opt = ShardedOptimizer(params + params[:2], cls, **kwargs)  # repeated: stepped once
    plain = cls(reference.parameters(), **kwargs)
    ours, theirs = train(model, opt, range(STEPS)), train(reference, plain, range(STEPS))
    return {"case": (model_name, opt_name), "ours": ours, "plain": theirs,
            "owners": [opt.owner(p) for p in params], "numels": [p.numel() for p in params],
            "trainable": [p.requires_grad for p in params],
            "with_state": [p in opt.state for p in params],
            "local_params": sum(len(g["params"]) for g in opt.optim.param_groups)}


def state_dict_round_trip() -> dict:
    """AdamW for 4 steps, sharded and plain; then each loads the other's state into a fresh
    optimizer of the other kind, and all four go on for 4 steps."""
    cls, kwargs = OPTIMIZERS["AdamW"]
    model, reference = tied_net(0), tied_net(0)
    opt, plain = ShardedOptimizer(model.parameters(), cls, **kwargs), cls(
        reference.parameters(), **kwargs)
    train(model, opt, range(4))
    train(reference, plain, range(4))
    # copies, as if saved to a file: load_state_dict may share the tensors it is given
    consolidated = copy.deepcopy(opt.state_dict())
    plain_state = copy.deepcopy(plain.state_dict())
    to_plain_model, to_sharded_model = copy.deepcopy(model), copy.deepcopy(reference)
    to_plain = cls(to_plain_model.parameters(), lr=1.0)  # hyperparameters come with the state
    to_plain.load_state_dict(copy.deepcopy(consolidated))
    to_sharded = ShardedOptimizer(to_sharded_model.parameters(), cls, lr=1.0)
    to_sharded.load_state_dict(copy.deepcopy(plain_state))
    return {"consolidated": consolidated, "plain_state": plain_state,
            "sharded": train(model, opt, range(4, 8))[-1],
            "plain": train(reference, plain, range(4, 8))[-1],
            "plain_from_sharded": train(to_plain_model, to_plain, range(4, 8))[-1],
            "sharded_from_plain": train(to_sharded_model, to_sharded, range(4, 8))[-1],
            "lr_after_load": to_sharded.param_groups[0]["lr"]}


def add_param_group_check() -> dict:
    """SGD with momentum on the embedding only for 3 steps, then the other parameters added
    as a second group with their own lr for 3 steps: sharded against plain."""
    runs, owners_before, owners_after = [], None, None
    for sharded in (True, False):
        model = tied_net(0)
        first, rest = list(model.embed.parameters()), [
            p for n, p in model.named_parameters() if not n.startswith("embed.")]
        cls, kwargs = OPTIMIZERS["SGD"]
        opt = ShardedOptimizer(first, cls, **kwargs) if sharded else cls(first, **kwargs)
        train(model, opt, range(3))
        if sharded:
            owners_before = [opt.owner(p) for p in first]
        opt.add_param_group({"params": rest, "lr": 0.05})
        if sharded:
            owners_after = [opt.owner(p) for p in first]
            groups_lr = [g["lr"] for g in opt.optim.param_groups]
        runs.append(train(model, opt, range(3, 6))[-1])
    return {"sharded": runs[0], "plain": runs[1], "owners_before": owners_before,
            "owners_after": owners_after, "local_lrs": groups_lr}


def zero2_against_zero1(bucket_cap_mb: float) -> dict:
    """AdamW on a TiedNet initialised differently on every rank, with each rank's share of
    the batches: plain AdamW after ScratchDDP, ZeRO-1 (ScratchDDP + ShardedOptimizer) and
    ZeRO-2 (the same, with shard_gradients); the gradients each holds after the last
    backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cls, kwargs = OPTIMIZERS["AdamW"]
    out: dict[str, Any] = {}
    for stage in ("ddp", "zero1", "zero2"):
        ddp = ScratchDDP(tied_net(seed=rank), bucket_cap_mb)
        opt = (cls(ddp.parameters(), **kwargs) if stage == "ddp"
               else ShardedOptimizer(ddp.parameters(), cls, **kwargs))
        if stage == "zero2":
            ddp.shard_gradients(opt)
        train(ddp, opt, range(STEPS - 1), rank, world)
        opt.zero_grad()
        backward(ddp, STEPS - 1, rank, world)
        params = list(ddp.parameters())
        out[stage] = {"grads": [None if p.grad is None else p.grad.clone() for p in params]}
        opt.step()
        out[stage]["params"] = flat(ddp)
        if stage != "ddp":
            out[stage]["owners"] = [opt.owner(p) for p in params]
    out["trainable"] = [p.requires_grad for p in params]
    return out


def against_torch_zero() -> dict:
    """STEPS steps of AdamW with our ShardedOptimizer and with torch's ZeroRedundancyOptimizer
    on the same model and batches on every rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    cls, kwargs = OPTIMIZERS["AdamW"]
    model, reference = tied_net(0), tied_net(0)
    ours = train(model, ShardedOptimizer(model.parameters(), cls, **kwargs), range(STEPS))
    theirs = train(reference, ZeroRedundancyOptimizer(reference.parameters(), cls, **kwargs),
                   range(STEPS))
    return {"ours": ours[-1], "torch": theirs[-1]}


def _error_of(fn: Callable[[], Any]) -> str | None:
    """'TypeName: message' of what fn() raised, or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
        return f"{type(exc).__name__}: {exc}"
    return None


def errors() -> dict:
    """What ShardedOptimizer and shard_gradients raise for wrong input."""
    model = tied_net(0)
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    wrong = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    return {
        "class name": _error_of(lambda: ShardedOptimizer(model.parameters(), "AdamW")),
        "not an optimizer": _error_of(lambda: ShardedOptimizer(model.parameters(), nn.Linear)),
        "no parameters": _error_of(lambda: ShardedOptimizer([], torch.optim.SGD, lr=0.1)),
        "wrong state": _error_of(lambda: opt.load_state_dict(wrong)),
        "ring": _error_of(lambda: ScratchDDP(tied_net(0), ring=True).shard_gradients(opt)),
        "other parameters": _error_of(lambda: ScratchDDP(tied_net(0)).shard_gradients(opt)),
    }


def zero_checks(cases: list[tuple[str, str]], full: bool) -> dict:
    """Every check of tests/test_zero.py that needs a process group, in one launch; full:
    also the state-dict, add_param_group, torch and error checks (rank-count independent)."""
    out: dict[str, Any] = {
        "sharded": [sharded_against_plain(m, o) for m, o in cases],
        "zero2": {cap: zero2_against_zero1(cap) for cap in (25.0, 0.0)}}
    if full:
        out.update(round_trip=state_dict_round_trip(), add_group=add_param_group_check(),
                   torch_zero=against_torch_zero(), errors=errors())
    return out
