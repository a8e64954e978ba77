"""What tests/test_differential.py launches: each drawn case builds its model, runs its sequence
of events under our wrapper and under the reference on the same ranks, and returns what each
left (every step's gradients, the final state) or the error it raised. Ranks import it from
tests/ (pytest's sys.path, which a rank inherits).

A case is plain data: {"pair", "model", "batches", "steps", "seed", ...}; see
test_differential.py for how each part is drawn.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from dpcourse.compression import PowerSGDState, bf16_hook, powersgd_hook
from dpcourse.ddp import ScratchDDP
from dpcourse.fsdp import ScratchFSDP, unflatten
from dpcourse.hsdp import scratch_hsdp
from dpcourse.local_sgd import DiLoCo

LR = 0.1
CLASSES = 3
WIDTH = 8


class Net(nn.Module):
    """A drawn model: a Linear or Conv body (BatchNorm and dropout optional), a layer called
    once or twice, a layer a step may skip (no gradient there), and a head; one of them
    (checkpointed) may run under activation checkpointing (reentrant or not)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        bias, self.twice = spec["bias"], spec["twice"]
        self.checkpoint_mode, self.checkpointed = spec["checkpoint"], spec["checkpointed"]
        if spec["conv"]:
            norm = [nn.BatchNorm2d(3)] if spec["batchnorm"] else []
            body = [nn.Conv2d(2, 3, 3, padding=1, bias=bias), *norm, nn.Tanh(), nn.Flatten(),
                    nn.Linear(48, WIDTH, bias=bias)]
        else:
            body = [nn.Linear(6, WIDTH, bias=bias)]
        self.body = nn.Sequential(*body, nn.Tanh(), nn.Dropout(spec["dropout"]))
        self.shared = nn.Linear(WIDTH, WIDTH, bias=bias)
        self.sometimes = nn.Linear(WIDTH, WIDTH, bias=bias)
        self.head = nn.Linear(WIDTH, CLASSES, bias=bias)
        if spec["frozen"] is not None:
            params = list(self.parameters())
            params[spec["frozen"] % len(params)].requires_grad_(False)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h = torch.tanh(self.block("shared", self.block("body", x)))
        if self.twice:
            h = torch.tanh(self.block("shared", h))
        if not skip:
            h = h + torch.tanh(self.block("sometimes", h))
        return self.block("head", h)

    def trains_before_checkpoint(self) -> bool:
        """Whether a block before the checkpointed one trains, so that the checkpoint's input
        requires grad (a reentrant checkpoint of an input that does not gives no gradients)."""
        before = {"body": [], "shared": ["body"], "sometimes": ["body", "shared"],
                  "head": ["body", "shared"]}[self.checkpointed]
        return any(p.requires_grad for name in before for p in getattr(self, name).parameters())

    def block(self, name: str, h: torch.Tensor) -> torch.Tensor:
        """The child name on h; under activation checkpointing if it is the drawn one."""
        if name != self.checkpointed or self.checkpoint_mode is None:
            return getattr(self, name)(h)
        return checkpoint(getattr(self, name), h, use_reentrant=self.checkpoint_mode == "reentrant")


def build_net(spec: dict[str, Any], seed: int, dtype: torch.dtype) -> Net:
    """Net(spec) initialised from seed, leaving the global random stream as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net(spec).to(dtype)


def batch(case: dict, step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """This rank's micro-batch of the step: batches[rank] inputs and labels."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(case["seed"] * 10_007 + step * 101 + micro * 11 + rank)
    shape = (2, 4, 4) if case["model"]["conv"] else (6,)
    x = torch.randn(case["batches"][rank], *shape, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.randint(0, CLASSES, (case["batches"][rank],), generator=g)


# --- the wrappers under test, behind one interface ---

class Side:
    """One wrapper and its optimizer: how to train it, read it and restart it."""
    accumulates_with_no_sync = False

    def __init__(self, case: dict, seed: int) -> None:
        self.case = case
        self.dtype = torch.float32 if case.get("bf16") else torch.float64
        self.model = self.wrap(build_net(case["model"], seed, self.dtype))
        self.opt = self.optimizer()

    def wrap(self, net: Net) -> nn.Module:
        raise NotImplementedError

    def optimizer(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=LR)

    def accumulating(self) -> ContextManager:
        """Where a micro-batch's backward only accumulates (all but the step's last)."""
        return self.model.no_sync() if self.accumulates_with_no_sync else nullcontext()

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        return {name: None if p.grad is None else p.grad.detach().clone()
                for name, p in self.net().named_parameters() if p.requires_grad}

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.net().state_dict().items()}

    def buffers(self) -> dict[str, torch.Tensor]:
        return {name: b.detach().clone() for name, b in self.net().named_buffers()}

    def net(self) -> nn.Module:
        return self.model.module

    def checkpoint(self) -> dict[str, Any]:
        return {"model": self.state(), "opt": copy.deepcopy(self.opt.state_dict())}

    def restore(self, saved: dict[str, Any]) -> None:
        self.net().load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["opt"])


class ScratchDDPSide(Side):
    accumulates_with_no_sync = True

    def wrap(self, net: Net) -> nn.Module:
        model = ScratchDDP(net, find_unused_parameters=self.case["unused"])  # as torch's side
        register_hook(model, self)
        return model

    def checkpoint(self) -> dict[str, Any]:
        return {**super().checkpoint(), "hook": hook_state_dict(self)}

    def restore(self, saved: dict[str, Any]) -> None:
        super().restore(saved)
        load_hook_state(self, saved["hook"])


class TorchDDPSide(ScratchDDPSide):
    def wrap(self, net: Net) -> nn.Module:
        twice = net.checkpointed == "shared" and net.twice and self.case["pair"] == "diloco"
        if ((self.case["unused"] or twice) and net.checkpoint_mode == "reentrant"
                and net.trains_before_checkpoint()):
            # find_unused_parameters walks the forward's graph, where a reentrant checkpoint
            # leaves none of its parameters (its forward ran without grad), and a block it
            # runs twice backpropagates twice: torch refuses both (marked ready twice; so
            # does ScratchDDP the second, but DiLoCo has no buckets). The same gradients,
            # recomputed otherwise:
            net.checkpoint_mode = "non_reentrant"
        model = DistributedDataParallel(net, find_unused_parameters=self.case["unused"])
        register_hook(model, self)
        return model


def register_hook(model: nn.Module, side: Side) -> None:
    """The case's comm hook ("bf16", "powersgd" with its rank and start step, or none)."""
    hook = side.case.get("hook")
    side.hook_state = None
    if hook == "bf16":
        model.register_comm_hook(None, bf16_hook)
    elif hook == "powersgd":
        side.hook_state = PowerSGDState(side.case["powersgd_rank"], side.case["start_step"])
        model.register_comm_hook(side.hook_state, powersgd_hook)


def hook_state_dict(side: Side) -> dict | None:
    return side.hook_state.state_dict(list(side.model.parameters())) if side.hook_state else None


def load_hook_state(side: Side, saved: dict | None) -> None:
    if side.hook_state is not None:
        side.hook_state.load_state_dict(copy.deepcopy(saved), list(side.model.parameters()))


class ScratchFSDPSide(Side):
    def wrap(self, net: Net) -> nn.Module:
        return ScratchFSDP(net, compute_dtype=torch.bfloat16 if self.case["bf16"] else None)

    def optimizer(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        """Every unit's gradient, all-gathered from the shards and unflattened."""
        grads: dict[str, torch.Tensor | None] = {}
        for unit in self.model.units:
            names = [owners[0][2] for owners in unit.owners]
            if unit.shard.grad is None:
                grads.update(dict.fromkeys(names, None))
                continue
            shards = [torch.empty_like(unit.shard.grad) for _ in range(self.model.world)]
            dist.all_gather(shards, unit.shard.grad.contiguous(), group=self.model.group)
            full = unflatten(torch.cat(shards), unit.shapes)
            grads.update({n: g.clone() for n, g in zip(names, full)})
        return grads

    def state(self) -> dict[str, torch.Tensor]:
        return self.model.full_state_dict()

    def net(self) -> nn.Module:
        return self.model.module

    def restore(self, saved: dict[str, Any]) -> None:
        self.model.load_full_state_dict(saved["model"])
        self.opt.load_state_dict(saved["opt"])


class ScratchHSDPSide(ScratchFSDPSide):
    """Chapter 14's HSDP: ScratchFSDP inside groups of case["group_size"] ranks."""

    def wrap(self, net: Net) -> nn.Module:
        return scratch_hsdp(net, self.case["group_size"],
                            compute_dtype=torch.bfloat16 if self.case["bf16"] else None)


class FullyShardSide(ScratchFSDPSide):
    """torch's FSDP2: fully_shard on the units ScratchFSDP makes by default, then the root."""

    def mesh(self) -> Any:
        return cpu_mesh((dist.get_world_size(),))

    def wrap(self, net: Net) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if (net.checkpoint_mode == "reentrant" and net.checkpointed == "shared" and net.twice
                and net.trains_before_checkpoint()):
            # fully_shard leaves the gradient of a module that a reentrant checkpoint runs
            # twice a plain tensor, not its sharded DTensor (torch 2.14). The same gradients,
            # recomputed otherwise:
            net.checkpoint_mode = "non_reentrant"
        bf16 = (torch.bfloat16, torch.bfloat16) if self.case["bf16"] else (None, None)
        for child in net.children():  # bfloat16 from unit to unit; float32 out of the root
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=self.mesh(), mp_policy=MixedPrecisionPolicy(*bf16))
        root = MixedPrecisionPolicy(*bf16, torch.float32 if self.case["bf16"] else None)
        return fully_shard(net, mesh=self.mesh(), mp_policy=root)

    def net(self) -> nn.Module:
        return self.model

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        return {name: None if p.grad is None else p.grad.full_tensor().clone()
                for name, p in self.model.named_parameters() if p.requires_grad}

    def state(self) -> dict[str, torch.Tensor]:
        return {k: _full(v).clone() for k, v in self.model.state_dict().items()}

    def checkpoint(self) -> dict[str, Any]:  # the sharded state dicts (DTensors)
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "opt": copy.deepcopy(self.opt.state_dict())}

    def restore(self, saved: dict[str, Any]) -> None:
        self.model.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["opt"])


class FullyShardHSDPSide(FullyShardSide):
    """torch's HSDP: the same fully_shard calls on a (replicate, shard) mesh."""

    def mesh(self) -> Any:
        size = self.case["group_size"]
        return cpu_mesh((dist.get_world_size() // size, size), ("replicate", "shard"))


_MESHES: dict = {}


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    """A device mesh of shape over every rank, made once per process and shape."""
    if shape not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value.detach()


class DiLoCoSide(Side):
    """DiLoCo at sync_every=1, outer lr 1, no momentum: every step averages the parameters."""

    def wrap(self, net: Net) -> nn.Module:
        return net

    def optimizer(self) -> Any:
        inner = torch.optim.SGD(self.model.parameters(), lr=LR)
        return DiLoCo(self.model, inner, sync_every=1, outer_lr=1.0, outer_momentum=0.0)

    def net(self) -> nn.Module:
        return self.model

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        return {}  # each rank's own: nothing to compare with DDP's averages


SIDES = {"scratch_ddp": ScratchDDPSide, "torch_ddp": TorchDDPSide,
         "scratch_fsdp": ScratchFSDPSide, "fully_shard": FullyShardSide,
         "scratch_hsdp": ScratchHSDPSide, "fully_shard_hsdp": FullyShardHSDPSide,
         "diloco": DiLoCoSide}
PAIRS = {"ddp": ("scratch_ddp", "torch_ddp"), "hooks": ("scratch_ddp", "torch_ddp"),
         "fsdp": ("scratch_fsdp", "fully_shard"), "hsdp": ("scratch_hsdp", "fully_shard_hsdp"),
         "diloco": ("diloco", "torch_ddp")}


# --- running a case ---

def run_events(kind: str, case: dict) -> dict[str, Any]:
    """The case's steps under SIDES[kind]: each step's gradients before the optimizer step
    (under bfloat16 with the scale of their terms) and buffers after it, and the final state;
    {"error": ...} if it raised."""
    try:
        side = SIDES[kind](case, seed=case["seed"] + _init_offset(case))
        grads, buffers, scales = [], [], []
        bf16 = case.get("bf16") or case.get("hook") == "bf16"
        for step, events in enumerate(case["steps"]):
            if bf16:
                scales.append(rounded_terms(side, case, step, events))
            torch.manual_seed(case["seed"] * 7_919 + dist.get_rank() * 101 + step)  # dropout
            run_step(side, case, step, events)
            grads.append(side.named_grads())
            side.opt.step()
            buffers.append(side.buffers())
            if step == case.get("resume_after"):
                saved = side.checkpoint()
                side = SIDES[kind](case, seed=case["seed"] + 1 + _init_offset(case))
                side.restore(saved)
        return {"grads": grads, "buffers": buffers, "scales": scales,
                "state": side.state(), "buffer_names": list(side.buffers())}
    except Exception as error:  # noqa: BLE001 - compared with the other side's refusal
        return {"error": f"{type(error).__name__}: {error}"}


def _init_offset(case: dict) -> int:
    """DDP-like pairs start each rank from its own weights (the wrapper broadcasts rank 0's);
    fully_shard needs the same weights on every rank."""
    return 0 if case["pair"] in ("fsdp", "hsdp") else 1_000 * dist.get_rank()


def run_step(side: Side, case: dict, step: int, events: dict) -> None:
    """zero_grad as drawn, then the micro-batches: forward, an optional extra forward (under
    no_grad, or in eval mode), backward; all but the last accumulate (no_sync)."""
    if events["zero_grad"] != "keep":
        side.opt.zero_grad(set_to_none=events["zero_grad"] == "none")
    last = len(events["micro"]) - 1
    for i, micro in enumerate(events["micro"]):
        x, y = batch(case, step, i, side.dtype)
        with side.accumulating() if i < last else nullcontext():
            loss = F.cross_entropy(side.model(x, skip=micro["skip"][dist.get_rank()]), y)
            if micro["extra"] is not None:
                extra_forward(side.model, x, micro["extra"])
            loss.backward()


def rounded_terms(side: Side, case: dict, step: int, events: dict) -> dict[str, float]:
    """Under bfloat16, the scale of what step's averaged gradients sum: for each parameter,
    the largest element of each rank's gradient of each micro-batch, summed, over the world
    size (each is rounded to bfloat16 before or while it is summed; terms that cancel leave a
    sum smaller than their roundings). Computed in float64 on a plain copy of the weights,
    its random draws apart."""
    plain = build_net(case["model"], 0, torch.float64)
    plain.load_state_dict(side.state())
    names = [name for name, p in plain.named_parameters() if p.requires_grad]
    scales = torch.zeros(len(names), dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        for i, micro in enumerate(events["micro"]):
            x, y = batch(case, step, i, torch.float64)
            plain.zero_grad(set_to_none=True)
            F.cross_entropy(plain(x, skip=micro["skip"][dist.get_rank()]), y).backward()
            scales += torch.tensor([0.0 if p.grad is None else p.grad.abs().max().item()
                                    for p in (plain.get_parameter(n) for n in names)],
                                   dtype=torch.float64)
    dist.all_reduce(scales)
    return dict(zip(names, (scales / dist.get_world_size()).tolist()))


def extra_forward(model: nn.Module, x: torch.Tensor, kind: str) -> None:
    """A forward whose output nobody differentiates: under no_grad, or in eval mode too."""
    with torch.no_grad():
        if kind == "eval":
            model.eval()
        model(x)
        model.train()


def run_cases(cases: list[dict]) -> list[dict[str, Any]]:
    """Each case under our wrapper, then under the reference: {"ours": ..., "theirs": ...}."""
    out = []
    for case in cases:
        ours, theirs = PAIRS[case["pair"]]
        out.append({"ours": run_events(ours, case), "theirs": run_events(theirs, case)})
    return out


# --- resume through train_ddp's own save and load ---

def train_and_resume(cases: list[dict], folder: str) -> list[dict] | None:
    """For each case, train_ddp's training run uninterrupted, and the same run stopped after
    case["stop"] steps, then resumed from its checkpoint into fresh wrappers: rank 0 returns
    both final checkpoints."""
    out = []
    for i, case in enumerate(cases):
        whole, parted = (Path(folder) / f"{i}-{name}.pt" for name in ("whole", "parted"))
        train_run(case, case["steps"], whole, process_seed=0)
        train_run(case, case["stop"], parted, process_seed=0)
        train_run(case, case["steps"], parted, process_seed=1)  # another process's generator
        dist.barrier()
        out.append({name: torch.load(path, weights_only=True) for name, path in
                    (("whole", whole), ("resumed", parted))} if dist.get_rank() == 0 else None)
    return out


def train_elastic(case: dict, folder: str, part: str) -> None:
    """The elastic case's runs on this world: "whole and stopped" trains it uninterrupted and
    to its stop; "resumed" goes on from the stop's checkpoint (written on another world)."""
    whole, parted = Path(folder) / "whole.pt", Path(folder) / "parted.pt"
    runs = ([(case["steps"], whole), (case["stop"], parted)] if part == "whole and stopped"
            else [(case["steps"], parted)])
    for steps, path in runs:
        case_ = {**case, "batch_size": None, "dropout": 0.0,
                 "mode": [*case["mode"], "--global-batch-size", str(case["global_batch_size"]),
                          "--dtype", "float64", "--momentum", "0.9"]}
        train_run(case_, steps, path, process_seed=0)
        dist.barrier()


def train_run(case: dict, steps: int, checkpoint: Path, process_seed: int) -> None:
    """python -m dpcourse.train_ddp as case says, in this rank, for steps steps in total,
    resuming from checkpoint if it exists, as a fresh process would (its generator seeded)."""
    from dpcourse import train_ddp
    batch = [] if case["batch_size"] is None else ["--batch-size", str(case["batch_size"])]
    argv = ["--data", "synthetic", "--train-size", str(case["train_size"]), *batch,
            "--epochs", str(case["steps"]), "--steps", str(steps),
            "--seed", str(case["seed"]), "--checkpoint", str(checkpoint), *case["mode"]]
    torch.manual_seed(process_seed)
    if hasattr(train_ddp.parse_args([]), "dropout"):
        argv += ["--dropout", str(case["dropout"])]
        train_ddp.train(train_ddp.parse_args(argv), torch.device("cpu"))
        return
    # 49ebf37's train_ddp has no --dropout: the model gets dropout on its input instead
    build = train_ddp.build_model
    train_ddp.build_model = lambda *a, **k: nn.Sequential(nn.Dropout(case["dropout"]),
                                                          build(*a, **k))
    try:
        train_ddp.train(train_ddp.parse_args(argv), torch.device("cpu"))
    finally:
        train_ddp.build_model = build
