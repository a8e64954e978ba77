"""What the ZeRO tests launch on every rank; ranks import it from tests/ (pytest's
sys.path, which a rank inherits)."""
from __future__ import annotations

import copy
import math
import tempfile
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Container, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from dpcourse.experiments import zero_demos
from dpcourse.experiments.zero_memory import ring_bytes
from dpcourse.comm_hooks import allreduce_hook
from dpcourse.ddp import ScratchDDP
from dpcourse.memory import measured_bytes
from dpcourse.zero import GradientSharding, ShardedOptimizer, reduce_scatter_hook
from workers import tied_net

STEPS = 10
ACCUMULATION_STEPS = 4
UNUSED_STEP = 3  # the step in which TiedNet.sometimes gets no gradient
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
STAGE_WAYS = {"ddp": "AdamW", "zero1": "ZeRO-1", "zero2": "ZeRO-2"}  # zero_demos' names
STAGES = tuple(STAGE_WAYS)
ACCUMULATIONS = {"both synchronised": (True, True), "no_sync first": (False, True),
                 "no_sync between": (True, False, True)}  # which micro-batches synchronise


def tiny_net(seed: int) -> nn.Module:
    """One parameter in all (fewer than the ranks), float64."""
    torch.manual_seed(seed)
    return nn.Linear(6, 8, bias=False).double()


def tied_net32(seed: int) -> nn.Module:
    """TiedNet in float32."""
    return tied_net(seed).float()


MODELS: dict[str, Callable[[int], nn.Module]] = {"tied": tied_net, "tiny": tiny_net,
                                                 "tied32": tied_net32}


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's global batch of 12 examples (float64), this rank's share of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(12, 6, generator=g, dtype=torch.float64).chunk(world)[rank]
    y = torch.randn(12, 8, generator=g, dtype=torch.float64).chunk(world)[rank]
    return x, y


def backward(model: nn.Module, step: int, rank: int = 0, world: int = 1,
             unused: Container[int] = (UNUSED_STEP,)) -> None:
    """Mean squared error of model on its share of step's batch (in the model's dtype), then
    backward; TiedNet.sometimes gets no gradient in the steps in unused."""
    dtype = next(model.parameters()).dtype
    x, y = (t.to(dtype) for t in batch(step, rank, world))
    kwargs = {"use_sometimes": step not in unused} if _is_tied(model) else {}
    nn.functional.mse_loss(model(x, **kwargs), y).backward()


def _is_tied(model: nn.Module) -> bool:
    inner = getattr(model, "module", model)
    return hasattr(inner, "sometimes")


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0,
          world: int = 1, unused: Container[int] = (UNUSED_STEP,),
          scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
          ) -> list[torch.Tensor]:
    """steps training steps (then scheduler.step() if given); the flat parameters after each."""
    after = []
    for step in steps:
        opt.zero_grad()
        backward(model, step, rank, world, unused)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        after.append(flat(model))
    return after


def two_groups(model: nn.Module) -> list[dict[str, Any]]:
    """TiedNet's embed and sometimes layers (lr 0.05), the rest (weight decay 0.3)."""
    first = ("embed.", "sometimes.")
    return [{"params": [p for n, p in model.named_parameters() if n.startswith(first)],
             "lr": 0.05},
            {"params": [p for n, p in model.named_parameters() if not n.startswith(first)],
             "weight_decay": 0.3}]


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
    """AdamW with two groups for 4 steps (the sometimes layer unused: no state), sharded and
    plain; then each loads the other's state into a fresh optimizer of the other kind, and
    all four go on for 4 steps."""
    cls, kwargs = OPTIMIZERS["AdamW"]
    model, reference = tied_net(0), tied_net(0)
    opt, plain = ShardedOptimizer(two_groups(model), cls, **kwargs), cls(
        two_groups(reference), **kwargs)
    train(model, opt, range(4), unused=range(4))
    train(reference, plain, range(4), unused=range(4))
    # rank 0's consolidated state, as if rank 0 saved it and every rank read the file back
    # (copies: on the CPU the state's tensors are the optimizer's own, updated in place)
    saved = [opt.state_dict()]  # None on the other ranks
    returned_none = saved[0] is None
    dist.broadcast_object_list(saved, src=0)
    consolidated = copy.deepcopy(saved[0])
    plain_state = copy.deepcopy(plain.state_dict())
    to_plain_model, to_sharded_model = copy.deepcopy(model), copy.deepcopy(reference)
    to_plain = cls(two_groups(to_plain_model), lr=1.0)  # hyperparameters come with the state
    to_plain.load_state_dict(copy.deepcopy(consolidated))
    to_sharded = ShardedOptimizer(two_groups(to_sharded_model), cls, lr=1.0)
    to_sharded.load_state_dict(copy.deepcopy(plain_state))
    return {"consolidated": consolidated, "plain_state": plain_state,
            "state_dict_returned_none": returned_none,
            "sharded": train(model, opt, range(4, 8))[-1],
            "plain": train(reference, plain, range(4, 8))[-1],
            "plain_from_sharded": train(to_plain_model, to_plain, range(4, 8))[-1],
            "sharded_from_plain": train(to_sharded_model, to_sharded, range(4, 8))[-1],
            "lrs_after_load": [g["lr"] for g in to_sharded.optim.param_groups]}


def scheduled_two_groups(opt_name: str) -> dict:
    """STEPS steps with two groups (their own lr and weight decay) and StepLR dividing the
    lr by 10 every 2 steps: sharded against plain, parameters after each step, and the lr
    each of this rank's local groups had in the last step."""
    cls, kwargs = OPTIMIZERS[opt_name]
    runs = {}
    for kind in ("sharded", "plain"):
        model = tied_net(0)
        opt = (ShardedOptimizer(two_groups(model), cls, **kwargs) if kind == "sharded"
               else cls(two_groups(model), **kwargs))
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
        runs[kind] = train(model, opt, range(STEPS), scheduler=scheduler)
        if kind == "sharded":
            runs["local_lrs"] = [g["lr"] for g in opt.optim.param_groups]
    return runs


def add_param_group_check(opt_name: str) -> dict:
    """opt_name on the embedding only for 3 steps, then the other parameters added as a
    second group with their own lr for 3 steps: sharded against plain."""
    cls, kwargs = OPTIMIZERS[opt_name]
    out: dict[str, Any] = {}
    for kind in ("sharded", "plain"):
        model = tied_net(0)
        first, rest = list(model.embed.parameters()), [
            p for n, p in model.named_parameters() if not n.startswith("embed.")]
        opt = ShardedOptimizer(first, cls, **kwargs) if kind == "sharded" else cls(first, **kwargs)
        train(model, opt, range(3))
        owners_before = [opt.owner(p) for p in first] if kind == "sharded" else None
        opt.add_param_group({"params": rest, "lr": 0.05})
        if kind == "sharded":
            out.update(owners_before=owners_before, owners_after=[opt.owner(p) for p in first],
                       local_lrs=[g["lr"] for g in opt.optim.param_groups])
        out[kind] = train(model, opt, range(3, 6))[-1]
    return out


def frozen_balance() -> dict:
    """A 1000-element frozen parameter and trainable ones of 600, 400, 300 and 200: the
    numel of trainable parameters each rank owns."""
    sizes, frozen = [1000, 600, 400, 300, 200], [True, False, False, False, False]
    params = [nn.Parameter(torch.zeros(n), requires_grad=not f) for n, f in zip(sizes, frozen)]
    opt = ShardedOptimizer(params, torch.optim.AdamW, lr=0.01)
    return {"trainable_loads": [sum(p.numel() for p in opt.shard(r) if p.requires_grad)
                                for r in range(dist.get_world_size())]}


def optimizer_for(stage: str, ddp: ScratchDDP) -> torch.optim.Optimizer:
    """zero_demos' AdamW over ddp's parameters for stage, with OPTIMIZERS' AdamW settings."""
    return zero_demos.optimizer_for(STAGE_WAYS[stage], ddp, **OPTIMIZERS["AdamW"][1])


def zero2_against_zero1(bucket_cap_mb: float, model_name: str = "tied") -> dict:
    """AdamW on model_name initialised differently on every rank, with each rank's share of
    the batches: plain AdamW after ScratchDDP, ZeRO-1 (ScratchDDP + ShardedOptimizer) and
    ZeRO-2 (the same, with reduce_scatter_hook), and ZeRO-2's hook on torch's DDP; the
    gradients each holds after the last backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for stage in (*STAGES, "zero1 on torch's DDP", "zero2 on torch's DDP"):
        if stage.endswith("on torch's DDP"):  # the same hook on torch's DDP (which leaves
            ddp = nn.parallel.DistributedDataParallel(  # a gradient unused everywhere None)
                MODELS[model_name](rank), bucket_cap_mb=bucket_cap_mb or 1e-6,
                find_unused_parameters=True)
            opt = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, **OPTIMIZERS["AdamW"][1])
            if stage.startswith("zero2"):
                ddp.register_comm_hook(GradientSharding(opt), reduce_scatter_hook)
        else:
            ddp = ScratchDDP(MODELS[model_name](rank), bucket_cap_mb)
            opt = optimizer_for(stage, ddp)
        train(ddp, opt, range(STEPS - 1), rank, world)
        opt.zero_grad()
        backward(ddp, STEPS - 1, rank, world)
        params = list(ddp.parameters())
        if not stage.endswith("on torch's DDP"):  # after backward; on torch's: after the step
            out[stage] = {"grads": [None if p.grad is None else p.grad.clone() for p in params]}
        opt.step()
        out.setdefault(stage, {"grads": [None if p.grad is None else p.grad.clone()
                                         for p in params]})
        out[stage]["params"] = flat(ddp)
        if stage != "ddp":
            out[stage]["owners"] = [opt.owner(p) for p in params]
    out["trainable"] = [p.requires_grad for p in params]
    return out


def accumulation(synced: tuple[bool, ...]) -> dict:
    """ACCUMULATION_STEPS steps of AdamW, each accumulating len(synced) micro-batches (those
    not synced under no_sync; TiedNet.sometimes unused in one micro-batch of step 1), under
    each stage:
    parameters after each step, and the gradients before the last step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for stage in STAGES:
        ddp = ScratchDDP(tied_net(seed=rank), 0.0)
        opt = optimizer_for(stage, ddp)
        after = []
        for step in range(ACCUMULATION_STEPS):
            opt.zero_grad()
            for micro, sync in enumerate(synced):
                with nullcontext() if sync else ddp.no_sync():
                    x, y = batch(10 * step + micro, rank, world)
                    prediction = ddp(x, use_sometimes=(step, micro) != (1, 0))
                    nn.functional.mse_loss(prediction, y).backward()
            grads = [None if p.grad is None else p.grad.clone() for p in ddp.parameters()]
            opt.step()
            after.append(flat(ddp))
        out[stage] = {"params": after, "grads": grads,
                      "owners": [opt.owner(p) for p in ddp.parameters()] if stage != "ddp"
                      else None}
    return out


def clipping(stage: str, norm_type: float) -> dict:
    """ShardedOptimizer.clip_grad_norm_ after a synchronised backward under stage ("zero1"
    or "zero2"), and torch.nn.utils.clip_grad_norm_ on the same model under ScratchDDP
    with all gradients: the total norms, and the gradients after clipping."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp, reference = ScratchDDP(tied_net(seed=rank)), ScratchDDP(tied_net(seed=rank))
    opt = optimizer_for(stage, ddp)
    backward(ddp, 0, rank, world)
    backward(reference, 0, rank, world)
    return {"ours": opt.clip_grad_norm_(0.05, norm_type),
            "torch": nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type),
            "grads": [None if p.grad is None else p.grad.clone() for p in ddp.parameters()],
            "torch_grads": [p.grad for p in reference.parameters()],
            "owned": [opt.owner(p) == rank for p in ddp.parameters()]}


def against_torch_zero() -> dict:
    """STEPS steps of AdamW with our ShardedOptimizer and with torch's ZeroRedundancyOptimizer
    on the same model and batches on every rank."""
    cls, kwargs = OPTIMIZERS["AdamW"]
    model, reference = tied_net(0), tied_net(0)
    ours = ShardedOptimizer(model.parameters(), cls, **kwargs)
    theirs = ZeroRedundancyOptimizer(reference.parameters(), cls, **kwargs)
    return {"ours": train(model, ours, range(STEPS))[-1],
            "torch": train(reference, theirs, range(STEPS))[-1],
            "ours_bytes": measured_bytes(model, ours),
            "torch_bytes": measured_bytes(reference, theirs)}


def _error_of(fn: Callable[[], Any]) -> str | None:
    """'TypeName: message' of what fn() raised, or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
        return f"{type(exc).__name__}: {exc}"
    return None


def errors() -> dict:
    """What ShardedOptimizer, GradientSharding and register_comm_hook raise for wrong input."""
    model = tied_net(0)
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    wrong = {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    plain = ScratchDDP(model)
    out = {
        "class name": _error_of(lambda: ShardedOptimizer(model.parameters(), "AdamW")),
        "not an optimizer": _error_of(lambda: ShardedOptimizer(model.parameters(), nn.Linear)),
        "no parameters": _error_of(lambda: ShardedOptimizer([], torch.optim.SGD, lr=0.1)),
        "wrong state": _error_of(lambda: opt.load_state_dict(wrong)),
        "hook twice": _error_of(lambda: [plain.register_comm_hook(None, allreduce_hook)
                                         for _ in range(2)]),
        "other parameters": _error_of(lambda: other_parameters(opt)),
        "plain optimizer": _error_of(lambda: GradientSharding(
            torch.optim.SGD(model.parameters(), lr=0.1))),
    }
    out["no_sync last"] = _error_of(no_sync_last)
    return out


def other_parameters(opt: ShardedOptimizer) -> None:
    """ZeRO-2's hook on a module whose parameters are not the optimizer's: one backward."""
    ddp = ScratchDDP(tied_net(0))
    ddp.register_comm_hook(GradientSharding(opt), reduce_scatter_hook)
    backward(ddp, 0, dist.get_rank(), dist.get_world_size())


def no_sync_last() -> None:
    """ZeRO-2: a synchronised backward, then one under no_sync, then step()."""
    ddp = ScratchDDP(tied_net(dist.get_rank()))
    opt = optimizer_for("zero2", ddp)
    backward(ddp, 0, dist.get_rank(), dist.get_world_size())
    with ddp.no_sync():
        backward(ddp, 1, dist.get_rank(), dist.get_world_size())
    opt.step()


def zero_checks(cases: list[tuple[str, str]], full: bool) -> dict:
    """Every check of tests/test_zero.py that needs a process group, in one launch; full:
    also the state-dict, scheduler, add_param_group, torch and error checks (rank-count
    independent)."""
    out: dict[str, Any] = {
        "sharded": [sharded_against_plain(m, o) for m, o in cases],
        "zero2": {cap: zero2_against_zero1(cap) for cap in (25.0, 0.0)},
        "zero2_tiny": zero2_against_zero1(25.0, "tiny"),
        "accumulation": {name: accumulation(synced) for name, synced in ACCUMULATIONS.items()},
        "clipping": {(stage, norm): clipping(stage, norm) for stage in STAGES[1:]
                     for norm in (2.0, math.inf)},
        "frozen": frozen_balance()}
    if full:
        out.update(round_trip=state_dict_round_trip(),
                   scheduled={name: scheduled_two_groups(name) for name in ("Adam", "AdamW")},
                   add_group={name: add_param_group_check(name) for name in ("SGD", "Adam")},
                   torch_zero=against_torch_zero(), errors=errors())
    return out


@contextmanager
def one_rank_group() -> Iterator[None]:
    """A default process group of this process alone (gloo), destroyed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def counted_ring_bytes() -> tuple[dict[str, float], bool]:
    """ring_bytes around one allreduce, reduce-scatter and broadcast of 100 float32 each, and
    whether torch.distributed's functions are its own again afterwards."""
    before = (dist.all_reduce, dist.reduce_scatter, dist.broadcast)
    t = torch.ones(100)
    with ring_bytes() as sent:
        dist.all_reduce(t)
        dist.reduce_scatter(torch.empty(50), list(torch.ones(100).chunk(2)))
        dist.broadcast(t, src=0)
    return dict(sent), before == (dist.all_reduce, dist.reduce_scatter, dist.broadcast)
