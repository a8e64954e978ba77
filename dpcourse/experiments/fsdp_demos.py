"""Chapter 10: FSDP (ZeRO-3) measured: bytes per rank and the peak, time and bytes per step,
against torch's fully_shard, gloo's reduce-scatter, and one step's timeline.

The drivers (``measure_sharding``, ``compare_fsdp``, ``against_fully_shard``,
``gloo_reduce_scatter``, ``fsdp_timelines``) run in the parent and start the ranks with
``launch``; the ``*_on_rank`` functions are what every rank runs.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from .. import p2p
from ..ddp import ScratchDDP
from ..fsdp import ScratchFSDP, _reduce_scatter, padded_numel
from ..launch import launch
from ..lenet import lenet_layers
from ..memory import bytes_per_rank, measured_bytes, zero3_peak_bytes
from .throughput import WARMUP_STEPS, random_batch
from .timing import alternate, median_seconds, repeat
from .zero_demos import activation_bytes, optimizer_for
from .zero_memory import ADAMW_LR, train_step

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when a profiler first starts (ranks
# inherit it); else the CPU profiler logs "gpuGetDeviceCount failed" and each start and stop
MLP_WIDTH, MLP_DEPTH = 1024, 8  # mlp: 8.4M parameters, 34 MB in float32


def linear_stack(seed: int = 0) -> nn.Sequential:
    """MLP_DEPTH Linear(MLP_WIDTH, MLP_WIDTH) + ReLU layers and a Linear to 10 classes: a model
    whose parameters outweigh its activations at a small batch (what FSDP is for)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(MLP_DEPTH):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, 10))


MODELS: dict[str, Callable[[int], nn.Module]] = {"lenet": lenet_layers, "mlp": linear_stack}


def model_batch(model: str, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random inputs of model (28 x 28 images, or MLP_WIDTH numbers) and labels 0-9."""
    if model == "lenet":
        return random_batch(batch_size, seed)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, MLP_WIDTH, generator=g), torch.randint(0, 10, (batch_size,),
                                                                            generator=g)


def _check_model(model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"model must be one of {tuple(MODELS)}, got {model!r}")


# --- the peak: every allocation during forward and backward ----------------------------------

MARK_BYTES = 12_345  # a marker allocation: where the trace's clock stands against perf_counter


class PeakMemory:
    """Context manager: the bytes allocated on this rank while inside, at their highest, above
    what existed on entry (peak()), and in all on exit (net()). On a GPU
    torch.cuda.max_memory_allocated; on the CPU torch.profiler's memory events (+ bytes
    allocated, - bytes freed, each with its address), summed in time order.

    The CPU profiler sees this thread only: a tensor that another thread frees last (the
    input of an asynchronous collective, released by gloo's thread or a helper thread) has
    no free in the trace. peak() and net() take such a tensor to be freed when the first
    collective started after its allocation finished (collectives: (started, finished) in
    time.perf_counter seconds), unless its storage is among those alive on exit (the
    data_ptr() of every storage kept)."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        before = time.perf_counter()
        torch.empty(MARK_BYTES, dtype=torch.uint8)  # the marker, freed at once
        self._mark = (before + time.perf_counter()) / 2
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._peak = torch.cuda.max_memory_allocated(self.device) - self._start
            self._net = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._profile.__exit__(*exc)
        with tempfile.TemporaryDirectory() as folder:  # the addresses are in its trace only
            path = os.path.join(folder, "trace.json")
            self._profile.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)["traceEvents"]
        events = sorted((e["ts"] * 1e-6, e["args"]["Bytes"], e["args"]["Addr"])
                        for e in trace if e.get("name") == "[memory]")
        mark = [next(i for i, e in enumerate(events) if e[1] == n)
                for n in (MARK_BYTES, -MARK_BYTES)]
        offset = self._mark - events[mark[0]][0]  # trace seconds -> perf_counter seconds
        self._events = [(t + offset, n, a) for i, (t, n, a) in enumerate(events)
                        if i not in mark]

    def _running(self, collectives: list[tuple[float, float]], alive: set[int]) -> list[int]:
        """The bytes added since entry after each event, frees by other threads included."""
        unfreed, live = [], {}  # allocations the trace never frees: (time, bytes, reused at)
        for t, nbytes, addr in self._events:
            if nbytes > 0 and addr in live:  # the block came back: freed elsewhere before
                unfreed.append((*live.pop(addr), t))
            if nbytes > 0:
                live[addr] = (t, nbytes)
            else:
                live.pop(addr, None)
        unfreed += [(t, nbytes, math.inf) for addr, (t, nbytes) in live.items()
                    if addr not in alive]
        frees = [(min([end for start, end in collectives if start >= t] + [reused]), -nbytes)
                 for t, nbytes, reused in unfreed]  # inf: when, the trace cannot tell
        total, running = 0, [0]
        for _, nbytes in sorted([(t, n) for t, n, _ in self._events]
                                + [f for f in frees if f[0] < math.inf]):
            total += nbytes
            running.append(total)
        return running

    def peak(self, collectives: list[tuple[float, float]] = (),
             alive: set[int] = frozenset()) -> int:
        """The most bytes allocated at once while inside, above what existed on entry."""
        if self.device.type == "cuda":
            return self._peak
        return max(self._running(list(collectives), alive))

    def net(self, collectives: list[tuple[float, float]] = (),
             alive: set[int] = frozenset()) -> int:
        """The bytes allocated while inside and, by the trace, still there on exit."""
        if self.device.type == "cuda":
            return self._net
        return self._running(list(collectives), alive)[-1]


def collectives(model: nn.Module) -> list[tuple[float, float]]:
    """(started, finished) of each collective of model's last step (ScratchFSDP's all-gathers
    and reduce-scatters, ScratchDDP's buckets), in time.perf_counter seconds."""
    if isinstance(model, ScratchFSDP):
        return [(start, end) for kind, _, start, end in model.timeline.events
                if kind in ("all-gather", "reduce-scatter")]
    return [(start, end) for _, start, end in model.timeline()]


def kept_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors that stay from one step to the next: parameters (shards), gradients and
    optimizer state (the local optimizer's, for chapter 09's ShardedOptimizer)."""
    params = list(model.parameters())
    state = getattr(opt, "optim", opt).state
    return [*params, *(p.grad for p in params if p.grad is not None),
            *(v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))]


# --- bytes per rank: between steps and at the peak --------------------------------------------

SHARDING_WAYS = ("ddp", "zero1", "zero2", "zero3", "zero3 bf16")
_DDP_OPTIMIZERS = {"ddp": "AdamW", "zero1": "ZeRO-1", "zero2": "ZeRO-2"}  # zero_demos' names


def built(way: str, model: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """model (seed's weights) wrapped for way, with AdamW: ScratchDDP ("ddp"), + chapter 09's
    ShardedOptimizer ("zero1"), + its reduce-scatter hook ("zero2"), or ScratchFSDP ("zero3",
    "zero3 bf16": compute_dtype bfloat16), one unit per layer."""
    module = MODELS[model](seed)
    if way in _DDP_OPTIMIZERS:
        ddp = ScratchDDP(module)
        return ddp, optimizer_for(_DDP_OPTIMIZERS[way], ddp, **OPTIMIZERS["adamw"][1])
    if way not in SHARDING_WAYS:
        raise ValueError(f"way must be one of {SHARDING_WAYS}, got {way!r}")
    fsdp = ScratchFSDP(module, compute_dtype=torch.bfloat16 if way == "zero3 bf16" else None)
    return fsdp, make_optimizer(fsdp.parameters(), "adamw")


def measure_sharding_on_rank(model: str, batch_size: int,
                             ways: list[str]) -> dict[str, dict[str, Any]]:
    """For each of ways (SHARDING_WAYS), after one step (it creates the optimizer state; the
    bytes between steps stay the same after): this rank's measured_bytes
    between steps, and the peak of one more forward and backward (PeakMemory, above the
    bytes between steps less the gradients, which zero_grad drops first)."""
    X, y = model_batch(model, batch_size, seed=dist.get_rank())
    out = {}
    for way in ways:
        wrapped, opt = built(way, model)
        train_step(wrapped, opt, X, y)
        between = measured_bytes(wrapped, opt)
        opt.zero_grad()
        start = measured_bytes(wrapped, opt)["total"]
        with PeakMemory() as memory:
            nn.functional.cross_entropy(wrapped(X), y).backward()
        kept = {t.untyped_storage().data_ptr() for t in kept_tensors(wrapped, opt)}
        comms = collectives(wrapped)
        after = measured_bytes(wrapped, opt)["total"]
        out[way] = {"between_steps": between, "peak": start + memory.peak(comms, kept),
                    "unaccounted": start + memory.net(comms, kept) - after}
        if isinstance(wrapped, ScratchFSDP):
            out[way]["unit_numels"] = [unit.numel for unit in wrapped.units]
        else:  # the bucket ZeRO-2's hook cuts last, while the others are still in flight
            out[way]["last_bucket_numel"] = sum(p.numel() for p in wrapped.buckets[-1].params)
        del wrapped, opt
    out["activations"] = activation_bytes(MODELS[model](0), X, y)
    out["num_params"] = sum(p.numel() for p in MODELS[model](0).parameters())
    return out


def measure_sharding(world_size: int = 2, model: str = "mlp", batch_size: int = 64,
                     ways: tuple[str, ...] = SHARDING_WAYS,
                     timeout: float = 180.0) -> dict[str, dict[str, Any]]:
    """Bytes per rank of model trained with AdamW in float32, batch_size examples per rank, for
    each of ways (SHARDING_WAYS): {way: {"between_steps": [each rank's measured_bytes],
    "peak": [each rank's bytes at the peak of forward and backward], "unaccounted": [bytes
    the trace could not place: 0 if every free was seen], "formula": bytes_per_rank(...),
    "formula_peak": the formula's peak, and for ZeRO-3 "unit_numels"}}.

    The peak formula: ZeRO-3, memory.zero3_peak_bytes with the activations (halved in
    bfloat16); DDP and ZeRO-1/2, bytes_per_rank with every gradient in full (during backward
    they all exist, ZeRO-2's too) twice (the parameters' .grad and the bucket averaged), plus
    the activations. ZeRO-2 holds them three times (gloo's list reduce_scatter keeps its own
    copy of each bucket, the other ranks' pieces and this rank's result, until it ends) and
    the last bucket once more (the hook's per-rank pieces, a copy freed when
    dist.reduce_scatter returns). "mlp" (linear_stack) is the chapter's model: its
    parameters outweigh the activations, as in the models FSDP is for; in "lenet" the
    activations (and the convolutions' scratch buffers) dominate at any useful batch.
    """
    _check_model(model)
    unknown = [w for w in ways if w not in SHARDING_WAYS]
    if unknown:
        raise ValueError(f"unknown way(s) {unknown}: choose from {SHARDING_WAYS}")
    ranks = launch(measure_sharding_on_rank, model, batch_size, list(ways),
                   world_size=world_size, backend="gloo", timeout=timeout)
    activations, num_params = ranks[0]["activations"], ranks[0]["num_params"]
    out = {}
    for way in ways:
        stage = way.split()[0]
        r = {key: [rank[way][key] for rank in ranks]
             for key in ("between_steps", "peak", "unaccounted")}
        r["formula"] = bytes_per_rank(num_params, world_size, stage)
        if stage == "zero3":
            compute = 2 if way.endswith("bf16") else 4
            r["unit_numels"] = ranks[0][way]["unit_numels"]
            r["formula_peak"] = zero3_peak_bytes(
                num_params, ranks[0][way]["unit_numels"], world_size, compute_bytes=compute,
                activation_bytes=activations * compute // 4)["total"]
        else:
            full = bytes_per_rank(num_params, world_size, "ddp")["gradients"]
            held = (3 * full + 4 * ranks[0][way]["last_bucket_numel"] if stage == "zero2"
                    else 2 * full)
            r["formula_peak"] = (r["formula"]["total"] - r["formula"]["gradients"] + held
                                 + activations)
        out[way] = r
    return out


# --- time and bytes per step: DDP, ZeRO-1/2, ours and torch's FSDP -----------------------------

FSDP_WAYS = ("ddp", "zero1", "zero2", "fsdp", "fsdp no prefetch", "fsdp bf16", "fsdp ring",
             "torch fully_shard")
_SCRATCH_FSDP = {"fsdp": {}, "fsdp no prefetch": {"prefetch": False},
                 "fsdp bf16": {"compute_dtype": torch.bfloat16}, "fsdp ring": {"ring": True}}


def torch_fully_shard(module: nn.Module) -> nn.Module:
    """module sharded by torch's FSDP2 over the default group as a CPU mesh: each layer with
    parameters a unit (as ScratchFSDP's default), then the rest."""
    from torch.distributed.device_mesh import init_device_mesh  # FSDP: imported when used
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for child in module.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def fsdp_built(way: str, model: str = "lenet", optimizer: str = "adamw",
               seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """model (seed's weights) wrapped for one of FSDP_WAYS, with AdamW or SGD."""
    if way in ("ddp", "zero1", "zero2"):
        return built(way, model, seed)
    module = MODELS[model](seed)
    if way == "torch fully_shard":
        wrapped = torch_fully_shard(module)
    elif way in _SCRATCH_FSDP:
        wrapped = ScratchFSDP(module, **_SCRATCH_FSDP[way])
    else:
        raise ValueError(f"way must be one of {FSDP_WAYS}, got {way!r}")
    return wrapped, make_optimizer(wrapped.parameters(), optimizer)


# SGD at lr 0.1 lets float32 rounding grow to 1e-4 in 5 LeNet steps (ScratchDDP's too): too
# loose a check for gradients k times too large; at 0.01 it stays near 1e-7
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, float]]] = {
    "adamw": (torch.optim.AdamW, {"lr": ADAMW_LR, "weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 0.01})}


def make_optimizer(params: Any, optimizer: str) -> torch.optim.Optimizer:
    """One of OPTIMIZERS over params."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZERS)}, got {optimizer!r}")
    cls, hyper = OPTIMIZERS[optimizer]
    return cls(params, **hyper)


GATHERS = {"all_gather_single": (0, "output_tensor"), "all_gather_into_tensor":
           (0, "output_tensor"), "broadcast": (0, "tensor")}
REDUCES = {"all_reduce": (0, "tensor"), "reduce_scatter_single": (1, "input"),
           "reduce_scatter_tensor": (1, "input"), "reduce_scatter": (1, "input_list")}
# where the full tensor(s) are: (position, keyword)


def collective_bytes(fn: Callable[[], object]) -> dict[str, int]:
    """Run fn; the bytes of the full tensors it handed to torch.distributed's gathers
    (all-gather outputs, broadcasts: the owners' together make an all-gather) and reductions
    (allreduce tensors, reduce-scatter inputs)."""
    counted = {"bytes_gathered": 0, "bytes_reduced": 0}
    originals = {name: getattr(dist, name) for name in (*GATHERS, *REDUCES)
                 if hasattr(dist, name)}  # the *_single names are new in torch 2.14

    def counting(name: str, key: str, where: tuple[int, str]) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            full = args[where[0]] if len(args) > where[0] else kwargs[where[1]]
            counted[key] += sum(t.nbytes for t in (full if isinstance(full, list) else [full]))
            return originals[name](*args, **kwargs)
        return call

    try:
        for name in originals:
            key = "bytes_gathered" if name in GATHERS else "bytes_reduced"
            setattr(dist, name, counting(name, key, {**GATHERS, **REDUCES}[name]))
        fn()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counted


def bytes_per_step(way: str, wrapped: nn.Module, step: Callable[[], None]) -> dict[str, int]:
    """The bytes way gathers and reduces in one call of step (ScratchFSDP counts its own)."""
    if isinstance(wrapped, ScratchFSDP):
        sent = wrapped.timeline.bytes
        before = dict(sent)
        step()
        return {"bytes_gathered": sent["all-gather"] - before["all-gather"],
                "bytes_reduced": sent["reduce-scatter"] - before["reduce-scatter"]}
    return collective_bytes(step)


def compare_fsdp_on_rank(steps: int, batch_size: int, repeats: int,
                         ways: list[str]) -> dict[str, dict[str, Any]]:
    """LeNet (lenet_layers) with AdamW under each way, alternated in repeats rounds of steps
    steps after a warm-up: median seconds per step (slowest rank), and the bytes of one more
    step."""
    X, y = model_batch("lenet", batch_size, seed=dist.get_rank())
    built_ways = {way: fsdp_built(way) for way in ways}
    steps_of = {way: partial(train_step, *built_ways[way], X, y) for way in ways}
    median = median_seconds(alternate({w: repeat(steps_of[w], steps) for w in ways}, repeats,
                                      warmup=WARMUP_STEPS))
    return {way: {"seconds_per_step": median[way] / steps,
                  **bytes_per_step(way, built_ways[way][0], steps_of[way])} for way in ways}


def fsdp_bytes_formula(unit_numels: list[int], world_size: int, dtype_bytes: int = 4) -> dict:
    """ZeRO-3's bytes per step: each unit's padded parameters all-gathered twice (forward,
    backward) and its gradient reduce-scattered once: 3 x (k-1)/k x the padded model sent per
    rank on a ring, against DDP's allreduce 2 x (k-1)/k x the model: 1.5x."""
    padded = sum(padded_numel(n, world_size) for n in unit_numels) * dtype_bytes
    share = (world_size - 1) / world_size
    return {"bytes_gathered": 2 * padded, "bytes_reduced": padded,
            "sent_per_rank": 3 * share * padded,
            "ddp_sent_per_rank": 2 * share * sum(unit_numels) * dtype_bytes}


def compare_fsdp(world_size: int = 2, steps: int = 10, batch_size: int = 64, repeats: int = 3,
                 ways: tuple[str, ...] = FSDP_WAYS, timeout: float = 300.0) -> dict[str, Any]:
    """LeNet (lenet_layers, one unit per layer) training with AdamW under each of ways,
    alternated in one launch of world_size processes of batch_size images each: {way:
    {"seconds_per_step": median of the slowest rank, "bytes_gathered", "bytes_reduced": the
    full tensors' bytes one step gathers and reduces (rank 0's)}}, and "formula":
    fsdp_bytes_formula for LeNet's units in float32."""
    unknown = [w for w in ways if w not in FSDP_WAYS]
    if unknown:
        raise ValueError(f"unknown way(s) {unknown}: choose from {FSDP_WAYS}")
    ranks = launch(compare_fsdp_on_rank, steps, batch_size, repeats, list(ways),
                   world_size=world_size, backend="gloo", timeout=timeout)
    units = [sum(p.numel() for p in m.parameters())
             for m in lenet_layers(0).children() if any(True for _ in m.parameters())]
    return {**ranks[0], "formula": fsdp_bytes_formula(units, world_size)}


# --- against torch: the same training ----------------------------------------------------------

def full_parameters(wrapped: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's parameters by name, on every rank: ScratchFSDP's full_state_dict,
    torch FSDP's DTensors gathered (full_tensor), or a plain module's own."""
    if isinstance(wrapped, ScratchFSDP):
        return wrapped.full_state_dict()
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in wrapped.named_parameters()}


def against_fully_shard_on_rank(optimizers: list[str], steps: int,
                                batch_size: int) -> dict[str, dict[str, float]]:
    """LeNet (lenet_layers(0) on every rank) trained steps steps with each of optimizers on
    global batches of batch_size (each rank its share, mean loss) by ScratchFSDP, by torch's
    fully_shard, and in this process alone on the whole batches: the largest absolute
    differences after, by optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for optimizer in optimizers:
        trained = {}
        for way in ("fsdp", "torch fully_shard", "one process"):
            if way == "one process":
                wrapped = lenet_layers(0)
                opt = make_optimizer(wrapped.parameters(), optimizer)
            else:
                wrapped, opt = fsdp_built(way, optimizer=optimizer)
            for step in range(steps):
                X, y = random_batch(batch_size, seed=100 + step)
                if way != "one process":
                    X, y = X.chunk(world)[rank], y.chunk(world)[rank]
                train_step(wrapped, opt, X, y)
            trained[way] = full_parameters(wrapped)

        def largest(a: str, b: str) -> float:
            return max((trained[a][k] - trained[b][k]).abs().max().item() for k in trained[a])

        out[optimizer] = {"fsdp vs one process": largest("fsdp", "one process"),
                          "fully_shard vs one process": largest("torch fully_shard",
                                                                "one process"),
                          "fsdp vs fully_shard": largest("fsdp", "torch fully_shard")}
    return out


def against_fully_shard(world_size: int = 2, optimizers: tuple[str, ...] = ("sgd", "adamw"),
                        steps: int = 5, batch_size: int = 64,
                        timeout: float = 180.0) -> dict[str, dict[str, float]]:
    """{optimizer: the largest absolute differences between LeNet's parameters after steps
    steps trained by ScratchFSDP, by torch's fully_shard (gloo, CPU mesh) and in one process
    on the whole batches} for each of optimizers ("sgd", "adamw": OPTIMIZERS), in one launch
    (rank 0's figures; float32, so expect about 1e-7, not 0). pytorch/pytorch#162338 reported
    fully_shard on gloo summing gradients instead of averaging them: SGD would show a
    difference of the order of the update."""
    unknown = [o for o in optimizers if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"optimizers must be among {tuple(OPTIMIZERS)}, got {unknown}")
    return launch(against_fully_shard_on_rank, list(optimizers), steps, batch_size,
                  world_size=world_size, backend="gloo", timeout=timeout)[0]


# --- what gloo's reduce-scatter really does ----------------------------------------------------

REDUCE_SCATTERS = ("gloo reduce_scatter", "gloo all_reduce", "p2p.ring_reduce_scatter")
RS_NUMELS = (2**14, 2**18, 2**22)  # float32: 64 KiB, 1 MiB, 16 MiB


def gloo_reduce_scatter_on_rank(numels: list[int], repeats: int) -> dict[str, dict[int, Any]]:
    """Median seconds (slowest rank) of each of REDUCE_SCATTERS on float32 tensors of each
    numel, alternated, and the bytes this rank sends in each: the ring counts them, gloo's
    are derived (the ring's law for an allreduce)."""
    world, out = dist.get_world_size(), {name: {} for name in REDUCE_SCATTERS}
    share = (world - 1) / world
    for numel in numels:
        x = torch.ones(numel)
        shard = torch.empty(numel // world)
        ring_sent = []
        cases = {"gloo reduce_scatter": lambda: _reduce_scatter(shard, x),
                 "gloo all_reduce": lambda: dist.all_reduce(x),
                 "p2p.ring_reduce_scatter": lambda: ring_sent.append(p2p.ring_reduce_scatter(x))}
        median = median_seconds(alternate(cases, repeats))
        sent = {"gloo reduce_scatter": 2 * share * x.nbytes,  # pytorch/pytorch#118911
                "gloo all_reduce": 2 * share * x.nbytes,
                "p2p.ring_reduce_scatter": ring_sent[-1] * x.element_size()}
        for name in REDUCE_SCATTERS:
            out[name][numel] = {"seconds": median[name], "bytes_sent": sent[name],
                                "bytes_counted": name == "p2p.ring_reduce_scatter"}
    return out


def gloo_reduce_scatter(world_size: int = 2, numels: tuple[int, ...] = RS_NUMELS,
                        repeats: int = 5, timeout: float = 180.0) -> dict[str, dict[int, Any]]:
    """{name: {numel: {"seconds", "bytes_sent", "bytes_counted"}}} for gloo's reduce-scatter
    (what ScratchFSDP calls: reduce_scatter_single, formerly reduce_scatter_tensor), gloo's
    allreduce and chapter 07's ring reduce-scatter (send/recv; it counts the elements it
    sends: (k-1)/k of the tensor, "bytes_counted" True). gloo's bytes are derived, not
    counted: the ring's law for an allreduce, 2(k-1)/k of the tensor, since
    pytorch/pytorch#118911 says its reduce-scatter is an allreduce and a slice, which the
    times show; numels divisible by world_size."""
    if any(n % world_size for n in numels):
        raise ValueError(f"every numel must be divisible by world_size {world_size}")
    return launch(gloo_reduce_scatter_on_rank, list(numels), repeats, world_size=world_size,
                  backend="gloo", timeout=timeout)[0]


# --- one step's timeline -------------------------------------------------------------------------

def fsdp_timelines_on_rank(batch_size: int) -> dict[str, list[tuple[str, str, float, float]]]:
    """ScratchFSDP.timeline.events of one LeNet step after WARMUP_STEPS, in seconds after its
    start, with prefetch and without."""
    X, y = model_batch("lenet", batch_size, seed=dist.get_rank())
    out = {}
    for prefetch in (True, False):
        wrapped, opt = fsdp_built("fsdp" if prefetch else "fsdp no prefetch")
        for _ in range(WARMUP_STEPS):
            train_step(wrapped, opt, X, y)
        dist.barrier()
        start = time.perf_counter()
        train_step(wrapped, opt, X, y)
        out[f"prefetch={prefetch}"] = [(kind, unit, begin - start, end - start)
                                       for kind, unit, begin, end in wrapped.timeline.events]
    return out


def fsdp_timelines(world_size: int = 2, batch_size: int = 64,
                   timeout: float = 120.0) -> dict[str, list[tuple[str, str, float, float]]]:
    """Rank 0's timelines of one ScratchFSDP step of LeNet (lenet_layers, AdamW), under
    "prefetch=True" and "prefetch=False": (kind, unit, start, end) in seconds after the step
    began; kind is "all-gather" or "reduce-scatter" (communication), "forward" or "backward"
    (a unit's compute), or "wait" (blocked on a gather)."""
    return launch(fsdp_timelines_on_rank, batch_size, world_size=world_size, backend="gloo",
                  timeout=timeout)[0]
