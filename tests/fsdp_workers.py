"""What the ScratchFSDP tests launch on every rank; ranks import it from tests/ (pytest's
sys.path, which a rank inherits)."""
from __future__ import annotations

import gc
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpcourse.fsdp import NotGathered, ScratchFSDP
from dpcourse.lenet import lenet_model

STEPS = 4
LR = 0.01


class Scale(nn.Module):
    """x * weight, with a one-element weight: a unit smaller than the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Normalize(nn.Module):
    """(x - mean) / std with the two as buffers."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("mean", torch.rand(1, generator=g))
        self.register_buffer("std", 1 + torch.rand(1, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def small_net(seed: int) -> nn.Module:
    """A small LeNet-like stack of layers on 8x8 images."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Sigmoid(), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Linear(64, 16), nn.Sigmoid(), nn.Linear(16, 10))


def tiny_net(seed: int) -> nn.Module:
    """small_net with a one-element unit in the middle."""
    net = small_net(seed)
    return nn.Sequential(*net[:5], Scale(), *net[5:])


def frozen_net(seed: int) -> nn.Module:
    """small_net with a frozen bias and two frozen layers, the first and the last (both in the
    root unit: the first sees the wrapper's own inputs)."""
    net = small_net(seed)
    net[4].bias.requires_grad_(False)
    net[0].requires_grad_(False)
    net[6].requires_grad_(False)
    return net


def buffered_net(seed: int) -> nn.Module:
    """small_net after a Normalize layer whose buffers differ from seed to seed."""
    return nn.Sequential(Normalize(seed), *small_net(seed))


def root_net(seed: int) -> nn.Module:
    """The course's LeNet (one ParameterList, used inside its forward): units=[] takes it."""
    return lenet_model(seed)


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "small": small_net, "tiny": tiny_net, "frozen": frozen_net, "buffers": buffered_net}
WAYS = [(prefetch, ring) for prefetch in (True, False) for ring in (False, True)]


def batch(step: int, rank: int = 0, world: int = 1, side: int = 8) -> tuple[torch.Tensor, ...]:
    """Step's global batch of 12 images (float64), this rank's share of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(12, 1, side, side, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (12,), generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int = 0, world: int = 1,
          side: int = 8, dtype: torch.dtype = torch.float64) -> None:
    """STEPS steps of mean cross-entropy on this rank's share of each global batch."""
    for step in range(STEPS):
        x, y = batch(step, rank, world, side)
        opt.zero_grad()
        F.cross_entropy(model(x.to(dtype)), y).backward()
        opt.step()


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def reference(name: str, optimizer: Callable = adamw) -> dict[str, torch.Tensor]:
    """One process on the global batches, from rank 0's initial model: the final state."""
    model = (root_net if name == "root" else MODELS[name])(0).double()
    train(model, optimizer([p for p in model.parameters() if p.requires_grad]),
          side=28 if name == "root" else 8)
    return model.state_dict()


def fsdp_trained(name: str, prefetch: bool, ring: bool, optimizer: Callable = adamw
                 ) -> tuple[ScratchFSDP, torch.optim.Optimizer]:
    """ScratchFSDP on every rank's own random model (rank 0's is sharded), trained."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ScratchFSDP(MODELS[name](rank).double(), prefetch=prefetch, ring=ring)
    opt = optimizer(model.parameters())
    train(model, opt, rank, world)
    return model, opt


def between_steps(model: ScratchFSDP, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a rank holds after a step: each unit's numel and its shard's numel, whether any
    full tensor survives, what the module's unit attributes are, the optimizer state sizes."""
    return {"units": [(u.numel, u.shard.numel()) for u in model.units],
            "full_alive": [u.full is not None or u.arriving is not None for u in model.units],
            "placeholders": all(isinstance(getattr(o, a), NotGathered)
                                for u in model.units for owners in u.owners for o, a, _ in owners),
            "state_numels": sorted(v.numel() for s in opt.state.values() for v in s.values()
                                   if torch.is_tensor(v) and v.dim() > 0),
            "shard_numels": sorted(u.shard.numel() for u in model.units),
            "stored_full": torch.cat([m.reshape(-1) for m in model.module.state_dict().values()
                                      ]).numel() if model.module.state_dict() else 0}


def training_checks() -> dict[str, Any]:
    """Every model and way (prefetch, ring), AdamW: the final full state dict; and SGD on
    small_net (a sum where an average belongs shows there); what is held between steps."""
    out: dict[str, Any] = {"trained": {}, "held": {}}
    for name in MODELS:
        for prefetch, ring in WAYS:
            model, opt = fsdp_trained(name, prefetch, ring)
            out["trained"][name, prefetch, ring] = model.full_state_dict()
            if (prefetch, ring) == (True, False):
                out["held"][name] = between_steps(model, opt)
    model, _ = fsdp_trained("small", True, False, sgd)
    out["sgd"] = model.full_state_dict()
    out["torch_ddp"] = torch_ddp_trained()
    out["root_unit"] = root_unit_trained()
    return out


def torch_ddp_trained() -> dict[str, torch.Tensor]:
    """torch's DDP on small_net with AdamW (every rank from seed 0): the final state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(small_net(0).double())
    train(ddp, adamw(ddp.parameters()), rank, world)
    return ddp.module.state_dict()


def root_unit_trained() -> dict[str, torch.Tensor]:
    """The course's LeNet with units=[] (one root unit), SGD on 28x28 images."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ScratchFSDP(root_net(rank).double(), units=[])
    train(model, sgd(model.parameters()), rank, world, side=28)
    return model.full_state_dict()


def one_step_gradients(model: nn.Module, rank: int = 0, world: int = 1,
                       dtype: torch.dtype = torch.float64) -> None:
    """Backward of the mean cross-entropy on this rank's share of step 0's batch."""
    x, y = batch(0, rank, world)
    F.cross_entropy(model(x.to(dtype)), y).backward()


def sgd_update(model: nn.Module, before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The change one SGD step of lr 1 made: minus the gradient, per state_dict key."""
    after = model.full_state_dict() if isinstance(model, ScratchFSDP) else model.state_dict()
    return {k: before[k] - after[k] for k in before}


def bf16_checks(ring: bool = False, name: str = "small") -> dict[str, Any]:
    """One step's averaged gradient with compute_dtype=bfloat16 (float32 master weights), the
    bytes gathered and reduce-scattered in it, and the dtypes the parameters are kept in."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ScratchFSDP(MODELS[name](rank), compute_dtype=torch.bfloat16, ring=ring)
    before = model.full_state_dict()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    one_step_gradients(model, rank, world, torch.float32)
    opt.step()
    return {"gradient": sgd_update(model, before), "master_dtypes": [
        p.dtype for p in [*model.parameters(), *model.module.parameters()]],
        "bytes": (model.timeline.bytes["all-gather"], model.timeline.bytes["reduce-scatter"])}


def attempt(check: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """check(*args), or {"error": its message}: a check that raises on every rank alike lets
    the other checks of the launch run."""
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(error).__name__}: {error}"}


def bf16_reference(name: str = "small") -> dict[str, dict[str, torch.Tensor]]:
    """One process, the same casts (a bfloat16 copy of the float32 weights, frozen ones too,
    runs forward and backward; the loss in float32), and plain float32: each one's gradient
    of the trainable parameters on step 0."""
    out = {}
    for precision, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        model = MODELS[name](0).to(dtype)
        x, y = batch(0)
        F.cross_entropy(model(x.to(dtype)).float(), y).backward()
        out[precision] = {k: p.grad.float() for k, p in model.named_parameters()
                          if p.requires_grad}
    return out


def clip_checks(max_norm: float) -> dict[str, Any]:
    """ScratchFSDP.clip_grad_norm_ after one backward: the norm it returns and the gradient
    (one SGD step of lr 1) it leaves."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ScratchFSDP(small_net(rank).double())
    before = model.full_state_dict()
    one_step_gradients(model, rank, world)
    norm = model.clip_grad_norm_(max_norm)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return {"norm": norm.item(), "gradient": sgd_update(model, before)}


def clip_reference(max_norm: float) -> dict[str, Any]:
    """torch.nn.utils.clip_grad_norm_ in one process on the global batch."""
    model = small_net(0).double()
    one_step_gradients(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return {"norm": norm.item(), "gradient": {k: p.grad for k, p in model.named_parameters()}}


def state_dict_checks() -> dict[str, Any]:
    """full_state_dict into the unwrapped module and into a fresh ScratchFSDP (from other
    random weights): the outputs on a batch, and the fresh one's own full_state_dict."""
    rank = dist.get_rank()
    model, _ = fsdp_trained("buffers", True, False)
    saved = model.full_state_dict()
    x, _ = batch(9)
    plain = buffered_net(5).double()
    plain.load_state_dict(saved)
    fresh = ScratchFSDP(buffered_net(rank + 7).double())
    fresh.load_full_state_dict(saved)
    with torch.no_grad():
        outputs = {"wrapped": model(x), "unwrapped": plain(x), "fresh": fresh(x)}
    return {"saved": saved, "keys": list(buffered_net(0).state_dict()),
            "fresh_saved": fresh.full_state_dict(), "outputs": outputs,
            "devices_dtypes": {(t.device.type, t.dtype) for t in saved.values()}}


def timeline_checks() -> dict[str, Any]:
    """Each of two steps' events with and without prefetch (the first step's backward is
    already its forward's reverse), and the bytes of one step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for prefetch in (True, False):
        model, steps = ScratchFSDP(small_net(rank).double(), prefetch=prefetch), []
        for step in range(2):
            sent = dict(model.timeline.bytes)
            x, y = batch(step, rank, world)
            F.cross_entropy(model(x), y).backward()
            steps.append(model.timeline.events)
        out[prefetch] = {"steps": steps, "order": [u.name for u in model._order],
                         "bytes": tuple(model.timeline.bytes[k] - sent[k] for k in sent),
                         "padded": [u.shard.numel() * world for u in model.units]}
    return out


def helper_threads() -> set[threading.Thread]:
    """The helper threads (chapter 07's HelperThread) alive in this process."""
    return {t for t in threading.enumerate() if t.name.startswith("dpcourse-hook")}


def close_checks() -> dict[str, Any]:
    """A ScratchFSDP with ring=True after a step, closed by close() and by a with block:
    helper threads and hooks left, whether the wrapper is freed once dropped (no cycle, no
    garbage collection), the error of a forward after close; the state it kept."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(0, rank, world)
    gc.collect()  # earlier checks' unclosed wrappers end their threads when collected
    before, out = helper_threads(), {}
    gc.disable()
    try:
        for way in ("close()", "with"):
            model = ScratchFSDP(small_net(rank).double(), ring=True)
            if way == "with":
                with model:
                    F.cross_entropy(model(x), y).backward()
            else:
                F.cross_entropy(model(x), y).backward()
                model.close()
            out[way] = {"threads": len(helper_threads() - before),
                        "hooks": sum(len(u.module._forward_pre_hooks) + len(u.module._forward_hooks)
                                     for u in model.units),
                        "state": model.full_state_dict()}
            try:
                model(x)
            except RuntimeError as error:
                out[way]["after close"] = str(error)
            try:
                model.load_full_state_dict(out[way]["state"])  # the shards are still there
                fresh = small_net(rank).double()
                fresh.load_state_dict(model.full_state_dict())
                out[way]["fresh copy"] = fresh.state_dict()
            except RuntimeError as error:
                out[way]["fresh copy"] = str(error)
            alive = weakref.ref(model)
            del model
            out[way]["freed"] = alive() is None
    finally:
        gc.enable()
    with ScratchFSDP(small_net(rank).double()) as model:
        loss = F.cross_entropy(model(x), y)
    try:
        loss.backward()  # the with block has ended
    except RuntimeError as error:
        out["backward after with"] = str(error)
    return out


def error_checks() -> dict[str, str]:
    """The message of each misuse's error, by misuse."""
    errors = {}
    net = small_net(0)
    cases = {"not a submodule": lambda: ScratchFSDP(small_net(0), units=[nn.Linear(2, 2)]),
             "listed twice": lambda: ScratchFSDP(net, units=[net[0], net[0]]),
             "no units for a ParameterList": lambda: ScratchFSDP(root_net(0))(
                 torch.zeros(2, 1, 28, 28)),
             "unit called alone": lambda: ScratchFSDP(small_net(0)).module[0](
                 torch.zeros(2, 1, 8, 8)),
             "missing key": lambda: ScratchFSDP(small_net(0)).load_full_state_dict(
                 {k: v for k, v in small_net(0).state_dict().items() if k != "0.bias"}),
             "wrong shape": lambda: ScratchFSDP(small_net(0)).load_full_state_dict(
                 {**small_net(0).state_dict(), "0.bias": torch.zeros(5)})}
    for name, misuse in cases.items():
        try:
            misuse()
        except (ValueError, RuntimeError, KeyError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


def accumulation_checks() -> dict[str, torch.Tensor]:
    """Two micro-batches' backwards (global batches 0 and 1), then one SGD step of lr 1: the
    update, which is the sum of the two averaged gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ScratchFSDP(small_net(rank).double())
    before, opt = model.full_state_dict(), torch.optim.SGD(model.parameters(), lr=1.0)
    for step in (0, 1):
        x, y = batch(step, rank, world)
        F.cross_entropy(model(x), y).backward()
    opt.step()
    return sgd_update(model, before)


def extra_checks() -> dict[str, Any]:
    """Everything but training, in one launch."""
    return {"accumulated": accumulation_checks(),
            "bf16": bf16_checks(), "bf16 ring": bf16_checks(ring=True),
            "bf16 frozen": attempt(bf16_checks, False, "frozen"),
            "bf16 frozen ring": attempt(bf16_checks, True, "frozen"),
            "clip": {m: clip_checks(m) for m in (0.05, 100.0)},
            "state_dict": state_dict_checks(), "timeline": timeline_checks(),
            "close": attempt(close_checks), "errors": error_checks()}
