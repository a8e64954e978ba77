"""Functions the tests launch on every rank; ranks import them from tests/ (pytest's
sys.path, which a rank inherits)."""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import signal
import time
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from dpcourse import p2p
from dpcourse.comm_hooks import HelperThread, allreduce_hook, ring_hook
from dpcourse.ddp import ScratchDDP
from dpcourse.launch import rank_device
from dpcourse.shm import PREFIX, SHM_DIR, SharedMemoryAllreduce, ShmHookState, shm_hook

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier",
               "broadcast_object_list")


def whoami(tag: str) -> dict:
    """This rank's view of the group and of its threads; prints one line."""
    rank = dist.get_rank()
    print(f"rank {rank} says {tag}")
    return {"rank": rank, "world": dist.get_world_size(), "tag": tag,
            "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
            "device": str(rank_device()),
            "tensor": torch.full((2,), float(rank), requires_grad=True) * 2}


def surroundings(name: str) -> dict:
    """What this rank sees of the launcher's state: environment variable name, OMP_NUM_THREADS
    and torch's threads, the working directory; and its parent process."""
    return {"value": os.environ.get(name), "omp": os.environ.get("OMP_NUM_THREADS"),
            "threads": torch.get_num_threads(), "cwd": os.getcwd(), "parent": os.getppid()}


def optimizer_and_atexit(path: str) -> int:
    """Build an optimizer (after which torch keeps the gloo group's threads alive until
    shutdown) and ask Python's shutdown to create the file path + rank."""
    rank = dist.get_rank()
    torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    atexit.register(lambda: open(f"{path}{rank}", "w").close())
    return rank


def print_from_c(text: str) -> int:
    """Print text through C's stdio (as a C++ extension would); return the rank."""
    ctypes.CDLL(None).printf(b"%s\n", text.encode())
    return dist.get_rank()


def start_a_sleeper() -> int:
    """Start a daemonic child process that sleeps for a minute; return its pid."""
    child = mp.get_context("spawn").Process(target=time.sleep, args=(60,), daemon=True)
    child.start()
    return child.pid


def note_pid_and_sleep(folder: str) -> None:
    """Write this rank's pid to a file in folder, then sleep for two minutes."""
    (Path(folder) / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(120)


def fail_on(bad_rank: int) -> int:
    """bad_rank raises; the others wait for it in a barrier."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()
    return dist.get_rank()


def hang_on(slow_rank: int) -> int:
    """slow_rank sleeps instead of joining the collective the others wait in."""
    if dist.get_rank() == slow_rank:
        time.sleep(3600)
    dist.all_reduce(torch.zeros(1))
    return dist.get_rank()


@contextmanager
def replaced(modules: tuple, names: tuple[str, ...], wrap) -> Iterator[None]:
    """While inside, each named function of each module (where it has one) is wrap(name, fn)."""
    saved = [(m, name, getattr(m, name)) for m in modules for name in names if hasattr(m, name)]
    for module, name, fn in saved:
        setattr(module, name, wrap(name, fn))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


@contextmanager
def no_collectives() -> Iterator[None]:
    """Make every collective of torch.distributed raise while inside (in both the public
    namespace and the module torch's own helpers call)."""
    def forbidden(name: str, _fn):
        def call(*args, **kwargs):
            raise AssertionError(f"collective dist.{name} called")
        return call
    with replaced((dist, dist.distributed_c10d), COLLECTIVES, forbidden):
        yield


@contextmanager
def counted_calls(names: tuple[str, ...]) -> Iterator[dict[str, int]]:
    """Count the calls of the named torch.distributed functions while inside."""
    counts = dict.fromkeys(names, 0)

    def counting(name: str, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call
    with replaced((dist,), names, counting):
        yield counts


def p2p_cases_in_subgroups(cases: list[tuple], worlds: list[int]) -> list[dict]:
    """For each group of the first w ranks (w in worlds) and each case (algorithm, numel,
    dtype, transposed, keyword arguments): our sum, dist.all_reduce's sum and the elements
    sent, with every collective forbidden while ours runs."""
    groups = {w: dist.new_group(list(range(w))) for w in worlds}  # every rank, same order
    out = []
    for w in worlds:
        if dist.get_rank() >= w:
            continue
        for name, numel, dtype, transposed, kwargs in cases:
            x = shm_input(dist.get_rank(), numel, dtype, transposed)
            expected = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(expected, group=groups[w])
            with no_collectives():
                sent = getattr(p2p, name)(x, groups[w], **kwargs)
            out.append({"world": w, "case": (name, numel, dtype, transposed, kwargs),
                        "result": x, "expected": expected, "sent": sent,
                        "contiguous": x.is_contiguous()})
    return out


# torch 2.14 renamed reduce_scatter_tensor and all_gather_into_tensor (the old names warn)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def padded_chunks(flat: torch.Tensor, world: int) -> torch.Tensor:
    """flat's chunks of tensor_split(world) as the rows of a zero-padded (world, largest)
    tensor: the equal sizes dist.reduce_scatter_tensor and all_gather_into_tensor need."""
    chunks = flat.tensor_split(world)
    rows = flat.new_zeros(world, len(chunks[0]))
    for row, chunk in zip(rows, chunks):
        row[:len(chunk)] = chunk
    return rows


def p2p_halves_against_collectives(cases: list[tuple], worlds: list[int]) -> list[dict]:
    """For each group of the first w ranks (w in worlds) and each case (numel, dtype,
    transposed, keyword arguments): this rank's chunk after p2p.ring_reduce_scatter and
    dist.reduce_scatter_tensor's, the tensor after p2p.ring_all_gather and
    dist.all_gather_into_tensor's, the tensor after both halves in turn and after
    p2p.ring_allreduce, and the elements each sent; every collective forbidden while ours run."""
    groups = {w: dist.new_group(list(range(w))) for w in worlds}  # every rank, same order
    rank, out = dist.get_rank(), []
    for w in worlds:
        if rank >= w:
            continue
        for numel, dtype, transposed, kwargs in cases:
            x = shm_input(rank, numel, dtype, transposed)
            rows = padded_chunks(x.reshape(-1), w)
            own_sum, everyone = torch.empty_like(rows[rank]), torch.empty_like(rows)
            _REDUCE_SCATTER(own_sum, rows.view(-1), group=groups[w])
            _ALL_GATHER(everyone.view(-1), rows[rank].clone(), group=groups[w])
            sizes = [len(c) for c in x.reshape(-1).tensor_split(w)]
            reduced, gathered, halves, allreduced = (x.clone() for _ in range(4))
            with no_collectives():
                sent = {"reduce-scatter": p2p.ring_reduce_scatter(reduced, groups[w], **kwargs),
                        "all-gather": p2p.ring_all_gather(gathered, groups[w], **kwargs),
                        "halves": p2p.ring_reduce_scatter(halves, groups[w], **kwargs)
                        + p2p.ring_all_gather(halves, groups[w], **kwargs),
                        "allreduce": p2p.ring_allreduce(allreduced, groups[w], **kwargs)}
            out.append({"world": w, "case": (numel, dtype, transposed, kwargs), "sent": sent,
                        "own chunk": reduced.reshape(-1).tensor_split(w)[rank],
                        "expected own chunk": own_sum[:sizes[rank]],
                        "gathered": gathered, "expected gathered": torch.cat(
                            [row[:n] for row, n in zip(everyone, sizes)]).view(x.shape),
                        "halves": halves, "allreduced": allreduced, "sizes": sizes,
                        "contiguous": [t.is_contiguous() for t in (reduced, gathered, halves)]})
    return out


# --- ScratchDDP against torch's DistributedDataParallel ----------------------------------

STEPS = 3
SOMETIMES_STEP = 1  # the step in which TiedNet.sometimes is left unused


class TiedNet(nn.Module):
    """A small net with a tied weight, a frozen layer, a buffer and a sometimes-unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.hidden = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.sometimes = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.head.weight = self.hidden.weight  # tied: one parameter used by two layers
        self.register_buffer("offset", torch.randn(8))

    def forward(self, x: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        h = torch.tanh(self.hidden(torch.tanh(self.embed(x))))
        h = self.frozen(h) + self.offset
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


def tied_net(seed: int) -> TiedNet:
    """TiedNet in float64, its initial weights drawn from seed."""
    torch.manual_seed(seed)
    return TiedNet().double()


def train_steps(model: nn.Module, rank: int, world: int, micro_batches: int,
                unused_on: tuple[int, ...] | None = None,
                between: Callable[[torch.Tensor], None] | None = None,
                momentum: float = 0.0, used_unsynced_on: tuple[int, ...] = ()) -> dict:
    """STEPS steps of SGD (with momentum) on this rank's share of each global batch; the
    final state.

    With micro_batches=2 each step accumulates two micro-batches (all but the last under
    no_sync, when the model has it). In step SOMETIMES_STEP the ranks in unused_on (None:
    every rank) leave TiedNet.sometimes unused, except that the ranks in used_unsynced_on use
    it in the micro-batches under no_sync. between(x), if given, runs after each forward,
    before its backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(micro_batches):
            g = torch.Generator().manual_seed(100 * step + micro)
            x = torch.randn(8, 6, generator=g, dtype=torch.float64).chunk(world)[rank]
            y = torch.randn(8, 8, generator=g, dtype=torch.float64).chunk(world)[rank]
            last = micro == micro_batches - 1
            with (nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()):
                skips = (step == SOMETIMES_STEP and (unused_on is None or rank in unused_on)
                         and (last or rank not in used_unsynced_on))
                out = model(x, use_sometimes=not skips)
                if between:
                    between(x)
                nn.functional.mse_loss(out, y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# name -> (state, hook) to register on a DDP, ours or torch's (the states live as long as
# the rank's process)
HOOKS = {"allreduce": lambda: (None, allreduce_hook), "ring": lambda: (HelperThread(), ring_hook),
         "shm": lambda: (ShmHookState(), shm_hook),
         "wrong size": lambda: (None, wrong_size_hook)}


def wrong_size_hook(state: None, bucket) -> torch.futures.Future:
    """A broken comm hook: its future holds one element too many."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(torch.zeros(bucket.buffer().numel() + 1, dtype=bucket.buffer().dtype))
    return future


def scratch_ddp(net: nn.Module, cap: float, hook: str | None = None) -> nn.Module:
    """ScratchDDP around net, averaging with the plain allreduce or the named HOOKS."""
    ddp = ScratchDDP(net, cap)
    if hook:
        ddp.register_comm_hook(*HOOKS[hook]())
    return ddp


def unused_on_rank_1() -> dict[str, dict]:
    """TiedNet trained while rank 1 alone leaves TiedNet.sometimes unused in one step: with
    ScratchDDP (one bucket, one per parameter, the ring) and with torch's DDP
    (find_unused_parameters=True, the reference); the final states, and torch's with the
    layer used on every rank ("torch, used everywhere": shows the skip mattered)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrappers = {"scratch, one bucket": lambda net: scratch_ddp(net, 25.0),
                "scratch, per parameter": lambda net: scratch_ddp(net, 0.0),
                "scratch, ring": lambda net: scratch_ddp(net, 0.0, "ring"),
                "torch": lambda net: nn.parallel.DistributedDataParallel(
                    net, find_unused_parameters=True)}
    runs = {name: train_steps(wrap(tied_net(seed=rank)), rank, world, 1, unused_on=(1,))
            for name, wrap in wrappers.items()}
    runs["torch, used everywhere"] = train_steps(wrappers["torch"](tied_net(seed=rank)), rank,
                                                 world, 1, unused_on=())
    return runs


def unused_with_momentum() -> dict[str, dict]:
    """TiedNet, SGD with momentum 0.9, under ScratchDDP and torch's DDP, each with
    find_unused_parameters=True: in step SOMETIMES_STEP no rank uses TiedNet.sometimes. The
    final states, and what ScratchDDP without the flag did to the unused layer; then ", 2
    micro" runs, where rank 1 uses it under no_sync in that step (so it counts as used)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, wrap in {"scratch": lambda net: ScratchDDP(net, find_unused_parameters=True),
                       "torch": lambda net: nn.parallel.DistributedDataParallel(
                           net, find_unused_parameters=True),
                       "scratch without the flag": ScratchDDP}.items():
        out[name] = train_steps(wrap(tied_net(seed=rank)), rank, world, 1, None, momentum=0.9)
        out[name + ", 2 micro"] = train_steps(wrap(tied_net(seed=rank)), rank, world, 2, None,
                                              momentum=0.9, used_unsynced_on=(1,))
    return out


def ddp_runs(configs: list[dict]) -> list[dict]:
    """Train a TiedNet, initialised differently on every rank, under each config:
    {"ddp": "scratch" or "torch", "cap": bucket_cap_mb (scratch), "hook": None or a name of
    HOOKS, "micro": 1 or 2}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for cfg in configs:
        net = tied_net(seed=rank)
        if cfg["ddp"] == "scratch":
            model = ScratchDDP(net, cfg["cap"])
        else:
            model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
        if cfg.get("hook"):
            model.register_comm_hook(*HOOKS[cfg["hook"]]())
        with counted_calls(("all_reduce", "isend")) as calls:
            state = train_steps(model, rank, world, cfg["micro"])
        out.append({"config": cfg, "state": state, "calls": calls,
                    "buckets": len(getattr(model, "buckets", [])),
                    "launched_in_backward": getattr(model, "launched_in_backward", None),
                    "hook_calls": getattr(model, "hook_calls", None),
                    "timeline": model.timeline() if hasattr(model, "timeline") else []})
    return out


@contextmanager
def in_eval_mode(model: nn.Module) -> Iterator[None]:
    """model.eval() inside, model.train() after."""
    model.eval()
    try:
        yield
    finally:
        model.train()


# name -> the contexts of a forward that trains nothing, run between a forward and its backward
EVALUATIONS = {"no_grad": lambda model: [torch.no_grad()],
               "inference_mode": lambda model: [torch.inference_mode()],
               "eval, no_grad": lambda model: [in_eval_mode(model), torch.no_grad()],
               "eval, grad enabled": lambda model: [in_eval_mode(model)],
               "no_sync, no_grad": lambda model: [model.no_sync(), torch.no_grad()]}


def evaluations_between_forward_and_backward(names: list[str]) -> dict[str, dict]:
    """TiedNet, initialised differently on every rank, trained by ScratchDDP and by torch's DDP
    (STEPS steps of two micro-batches, the first under no_sync) with a forward in the context
    EVALUATIONS[name] between every forward and its backward; the final states by name, and
    torch's without any evaluation ("torch, none"); how many of ScratchDDP's buckets the last
    backward launched while it ran, of how many."""
    rank, world = dist.get_rank(), dist.get_world_size()
    wrappers = {"scratch": lambda net: ScratchDDP(net, 0.0),
                "torch": lambda net: nn.parallel.DistributedDataParallel(net)}
    every_layer = ()  # no rank leaves TiedNet.sometimes unused
    out = {"torch, none": train_steps(wrappers["torch"](tied_net(seed=rank)), rank, world, 2,
                                      every_layer)}
    for name in names:
        for ddp, wrap in wrappers.items():
            model = wrap(tied_net(seed=rank))
            evaluate = lambda x, model=model: _evaluate(model, EVALUATIONS[name](model), x)
            out[f"{ddp}, {name}"] = train_steps(model, rank, world, 2, every_layer, evaluate)
            if ddp == "scratch":
                out[f"launched in backward, {name}"] = (model.launched_in_backward,
                                                        len(model.buckets))
    return out


def _evaluate(model: nn.Module, contexts: list, x: torch.Tensor) -> None:
    """A forward inside contexts whose output is only logged."""
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        model(x).sum().item()


class CheckpointedNet(nn.Module):
    """first -> middle -> head (float64), block (one of them) under activation checkpointing
    (mode: "reentrant", "non_reentrant" or None), its weights drawn from seed."""

    def __init__(self, mode: str | None, block: str, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.middle, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.mode, self.block = mode, block
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.run("first", x))
        return self.run("head", torch.tanh(self.run("middle", h)))

    def run(self, name: str, h: torch.Tensor) -> torch.Tensor:
        if name != self.block or self.mode is None:
            return getattr(self, name)(h)
        return torch.utils.checkpoint.checkpoint(getattr(self, name), h,
                                                 use_reentrant=self.mode == "reentrant")


def checkpoint_batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (12 samples) of the checkpointing tests."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(12, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (12,), generator=g)) for _ in range(steps)]


def train_checkpointed(model: nn.Module, rank: int, world: int) -> dict:
    """SGD over checkpoint_batches, this rank taking its chunk of each; the final state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for X, y in checkpoint_batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(X.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    return {k.removeprefix("module."): v.clone() for k, v in model.state_dict().items()}


def scratch_ddp_under_checkpointing(modes: list[str], blocks: list[str]) -> dict[str, dict]:
    """ScratchDDP (one bucket; one per parameter) on CheckpointedNet, each mode on each block
    (a reentrant one not on the first: its input, the data, needs no grad), each rank
    starting from its own weights: the final states."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return {f"{mode} on {block}, cap {cap}": train_checkpointed(
                ScratchDDP(CheckpointedNet(mode, block, seed=rank), cap), rank, world)
            for mode in modes for block in blocks for cap in (25.0, 0.0)
            if not (mode == "reentrant" and block == "first")}


def train_ddp_in_own_folder(folders: list[str], argv: list[str]) -> None:
    """train_ddp's training with argv, each rank in folders[rank] (a relative --checkpoint is
    then a file of that rank's own, as on nodes without a shared filesystem)."""
    from dpcourse import train_ddp
    os.chdir(folders[dist.get_rank()])
    train_ddp.train(train_ddp.parse_args(argv), torch.device("cpu"))


# --- SharedMemoryAllreduce against dist.all_reduce -----------------------------------------

def evaluate_on_rank_0_only() -> dict:
    """Rank 0 alone evaluates a ScratchDDP model with a buffer (batch norm) under no_grad,
    then every rank trains one step: no collective may run during the evaluation. Then one
    backward with a comm hook that returns a buffer of the wrong size: the error."""
    torch.manual_seed(0)
    model = ScratchDDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    if dist.get_rank() == 0:
        with torch.no_grad():
            model(torch.randn(8, 4))
    model(torch.randn(8, 4))[0].sum().backward()  # one sample: batch norm's sum has no gradient
    broken = scratch_ddp(nn.Linear(4, 4), 25.0, "wrong size")
    return {"grad": model.module[0].weight.grad.sum().item(),
            "wrong size": _error_of(lambda: broken(torch.randn(2, 4)).sum().backward())}


def shm_input(rank: int, numel: int, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """Rank's own input for the shared-memory tests (the test process can rebuild it)."""
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype == torch.int64:
        x = torch.randint(-1000, 1000, (numel,), generator=g)
    else:
        x = torch.randn(numel, generator=g, dtype=dtype)
    return x.view(-1, 10).t() if transposed else x  # transposed: numel = rows * 10


def own_segments() -> list[str]:
    """The shared-memory files this process has in /dev/shm."""
    return sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}{os.getpid()}-*"))


def shm_against_all_reduce(cases: list[tuple], max_bytes: int) -> dict:
    """Each case (numel, dtype, transposed) summed by one SharedMemoryAllreduce, in turn, with
    every collective forbidden, next to dist.all_reduce's sum; then the errors it raises."""
    rank = dist.get_rank()
    records = []
    with SharedMemoryAllreduce(max_bytes) as shm:
        files_while_open = own_segments()
        for numel, dtype, transposed in cases:
            x = shm_input(rank, numel, dtype, transposed)
            expected = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(expected)
            with no_collectives():
                returned = shm.allreduce(x)
            records.append({"case": (numel, dtype, transposed), "result": x,
                            "expected": expected, "returned_input": returned is x,
                            "contiguous": x.is_contiguous()})
        errors = shm_errors(shm) if dist.get_world_size() > 1 else {}
    return {"records": records, "errors": errors, "files_while_open": files_while_open,
            "mapped_after_close": mapped_segments()}


def mapped_segments() -> int:
    """How many shared-memory segments this process still has mapped."""
    with open("/proc/self/maps") as maps:
        return sum(PREFIX in line for line in maps)


def _error_of(fn, *args) -> str | None:
    """'TypeName: message' of what fn(*args) raised, or None."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
        return f"{type(exc).__name__}: {exc}"
    return None


def shm_errors(shm) -> dict:
    """What shm raises for wrong calls, and whether it still works afterwards."""
    rank = dist.get_rank()
    errors = {
        "numel": _error_of(shm.allreduce, torch.ones(5 + (rank == 1))),
        "dtype": _error_of(shm.allreduce, torch.ones(5, dtype=torch.float64 if rank == 1
                                                     else torch.float32)),
        "int32": _error_of(shm.allreduce, torch.ones(5, dtype=torch.int32)),
        "meta": _error_of(shm.allreduce, torch.ones(5, device="meta")),
        "max_bytes": _error_of(SharedMemoryAllreduce, 1 << (12 + (rank == 1))),
        "negative max_bytes": _error_of(SharedMemoryAllreduce, -1),
        "float max_bytes": _error_of(SharedMemoryAllreduce, 2.5e6),
    }
    errors["works_after"] = shm.allreduce(torch.ones(7)).tolist()
    with SharedMemoryAllreduce(1 << 12, timeout=0.5) as late:
        if rank != 1:  # rank 1 skips this call; the others wait for it, then give up
            errors["timeout"] = _error_of(late.allreduce, torch.ones(3))
            errors["after_timeout"] = _error_of(late.allreduce, torch.ones(3))
        dist.barrier()
    return errors


def shm_crash_while_building(bad_rank: int) -> None:
    """bad_rank is killed inside SharedMemoryAllreduce(), its segment created but not yet
    mapped by the others (so not yet removed); the others wait for it."""

    if dist.get_rank() == bad_rank:
        dist.all_gather_object = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
    SharedMemoryAllreduce(1 << 16)


def shm_crash(bad_rank: int) -> None:
    """Every rank sums once; then bad_rank is killed while the others wait in the next sum."""

    shm = SharedMemoryAllreduce(1 << 16)
    shm.allreduce(torch.ones(1000))
    if dist.get_rank() == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    shm.allreduce(torch.ones(1000))


def add_own_rank(tensors: list[torch.Tensor]) -> list[dict]:
    """Add rank + 1 to each tensor in place; return each with the bytes of the storage it
    arrived in and whether that storage is shared memory."""
    rank = dist.get_rank()
    with torch.no_grad():
        for t in tensors:
            t.add_(rank + 1)
    return [{"value": t, "storage_bytes": t.untyped_storage().nbytes(), "shared": t.is_shared()}
            for t in tensors]
