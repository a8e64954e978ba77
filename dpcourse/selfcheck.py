"""`python3 course.py check`: every chapter's device-dependent paths, at small sizes, on the
devices this machine has, as a table (chapter, what ran, on which devices, result, seconds).

With 2 GPUs or more: real devices, nn.DataParallel, nccl. With one: the simulated devices on it,
and the multi-process paths on gloo (NCCL does not put two ranks on one GPU). Without: the CPU
paths, and the GPU paths listed as not run. Exits non-zero only when a path that ran failed.
Each check compares with an independent reference (one device, one process, torch's own).
"""
from __future__ import annotations

import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import allreduce, broadcast, get_params
from .compression import powersgd_hook
from .data_parallel import ScratchDataParallel
from .ddp import ScratchDDP
from .experiments.comm_demos import TorchsFirstQs, torch_powersgd, torch_powersgd_on_cpu
from .fsdp import ScratchFSDP
from .hardware import accelerators, devices
from .launch import launch, rank_device
from .lenet import init_lenet_params, lenet, lenet_layers, loss, profile_steps
from .ring import ring_allreduce
from .shm import SharedMemoryAllreduce
from .split import split_batch
from .training import sgd, train_batch
from .zero import ShardedOptimizer

TOLERANCE = 1e-4  # float32, relative to the largest element: one step, several devices


@dataclass
class Check:
    chapter: str
    what: str
    run: Callable[[], str]  # returns the devices it ran on; raises when wrong
    needs_gpus: int = 0


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    gap = ((got.detach().cpu().double() - want.detach().cpu().double()).abs().max()
           / want.detach().cpu().double().abs().max().clamp_min(1e-12)).item()
    if not gap <= TOLERANCE:
        raise AssertionError(f"{what}: off by {gap:.1e} of the largest element")


def names(devs: list[torch.device]) -> str:
    return ", ".join(map(str, devs))


def check_tensors() -> str:
    devs = devices(2)
    x = torch.arange(6.0).reshape(2, 3)
    for d in devs:
        if not torch.equal(x.to(d).cpu(), x):
            raise AssertionError(f"a round trip through {d} changed the tensor")
    return names(devs)


@contextmanager
def without_tf32() -> Iterator[None]:
    """Inside: float32 on a GPU is float32 (no TF32 products), as on the CPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def lenet_steps(params: list[torch.Tensor]) -> list[tuple[str, Callable, list[torch.Tensor]]]:
    """LeNet's forward as chapter 01's steps: (name, function, parameters used)."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    return [("conv1", lambda h: F.relu(F.conv2d(h, W1, b1)), [W1, b1]),
            ("pool1", lambda h: F.avg_pool2d(h, kernel_size=2, stride=2), []),
            ("conv2", lambda h: F.relu(F.conv2d(h, W2, b2)), [W2, b2]),
            ("pool2", lambda h: F.avg_pool2d(h, kernel_size=2, stride=2), []),
            ("flatten", lambda h: h.reshape(h.shape[0], -1), []),
            ("dense1", lambda h: F.relu(h @ W3 + b3), [W3, b3]),
            ("dense2", lambda h: h @ W4 + b4, [W4, b4])]


@without_tf32()
def check_profile() -> str:
    """Chapter 01: profile_steps of LeNet on each device counts what it counts on the CPU,
    and LeNet's output there is the CPU's."""
    devs = devices(2)
    X = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    params = init_lenet_params(0, scale=0.1)
    want_rows, want = profile_steps(lenet_steps(params), X), lenet(X, params)
    for d in devs:
        on_d = [p.to(d) for p in params]
        if profile_steps(lenet_steps(on_d), X.to(d)) != want_rows:
            raise AssertionError(f"profile_steps counts differently on {d}")
        close(lenet(X.to(d), on_d), want, f"LeNet's output on {d}")
    return names(devs)


@without_tf32()
def check_sgd_step() -> str:
    """Chapter 02: one SGD step of LeNet (loss summed, sgd) on each device, against float64
    on the CPU."""
    devs = devices(2)
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
    start = init_lenet_params(0, scale=0.1)
    for d, dtype in [(torch.device("cpu"), torch.float64)] + [(d, torch.float32) for d in devs]:
        params = [p.to(d, dtype).requires_grad_() for p in start]
        loss(lenet(X.to(d, dtype), params), y.to(d)).sum().backward()
        sgd(params, 0.1, len(y))
        if dtype == torch.float64:
            want = [p.detach() for p in params]
        else:
            close(torch.cat([p.reshape(-1) for p in params]),
                  torch.cat([w.reshape(-1) for w in want]), f"one SGD step on {d}")
    return names(devs)


def check_collectives() -> str:
    devs = devices(3)
    parts = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    want = sum(parts)
    for name, reduce in (("allreduce", allreduce), ("ring_allreduce", ring_allreduce)):
        tensors = [p.to(d) for p, d in zip(parts, devs)]
        reduce(tensors)
        for t in tensors:
            close(t, want, name)
    copies = broadcast(want, devs)
    if not all(torch.equal(c.cpu(), want) for c in copies):
        raise AssertionError("broadcast made unequal copies")
    return names(devs)


def check_train_batch() -> str:
    devs = devices(2)
    X, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    params = init_lenet_params(0, scale=0.1)
    one = get_params(params, devs[0])
    loss(lenet(X.to(devs[0]), one), y.to(devs[0])).sum().backward()
    want = [(p - 0.1 * p.grad / 16).detach() for p in one]
    device_params = [get_params(params, d) for d in devs]
    shards = split_batch(X, y, devs)
    if sum(len(s) for s in shards[0]) != 16:
        raise AssertionError("split_batch lost examples")
    train_batch(X, y, device_params, devs, 0.1)
    for replica in device_params:
        for got, w in zip(replica, want):
            close(got, w, "train_batch")
    return names(devs)


def check_data_parallel() -> str:
    devs = devices(2)
    X, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    results = {}
    for name, wrap in (("one device", lambda m: m), ("ScratchDataParallel",
                                                     lambda m: ScratchDataParallel(m, devs))):
        model = lenet_layers(0).to(devs[0])
        F.cross_entropy(wrap(model)(X.to(devs[0])), y.to(devs[0])).backward()
        results[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    if all(d.type == "cuda" for d in devs):
        model = lenet_layers(0).to(devs[0])
        dp = nn.DataParallel(model, device_ids=[d.index for d in devs])
        F.cross_entropy(dp(X.to(devs[0])), y.to(devs[0])).backward()
        close(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), results["one device"],
              "nn.DataParallel")
    close(results["ScratchDataParallel"], results["one device"], "ScratchDataParallel")
    return names(devs)


def one_step(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor,
             y: torch.Tensor) -> None:
    opt.zero_grad()
    F.cross_entropy(model(X), y).backward()
    opt.step()


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1).cpu() for v in state.values()])


def batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's batch of 16 random images and labels, the same in every process."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)


def like_one_process(wrap: Callable[[nn.Module], nn.Module], sharded: bool = False) -> None:
    """One SGD step of LeNet under wrap (ShardedOptimizer if sharded) on this rank's share of
    a batch, against one process on the whole batch."""
    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    X, y = batch()
    reference = lenet_layers(0).to(device)
    one_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), X.to(device),
             y.to(device))
    model = wrap(lenet_layers(rank).to(device))
    opt = (ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1) if sharded
           else torch.optim.SGD(model.parameters(), lr=0.1))
    one_step(model, opt, X.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device))
    got = model.full_state_dict() if isinstance(model, ScratchFSDP) else model.module.state_dict()
    close(flat(got), flat(reference.state_dict()), "the parameters after one step")


def torch_ddp(model: nn.Module) -> nn.Module:
    """torch's DistributedDataParallel, on model's GPU if it has one."""
    weight = next(model.parameters())
    return nn.parallel.DistributedDataParallel(
        model, device_ids=[weight.device.index] if weight.is_cuda else None)


def powersgd_like_torchs(steps: int = 6, matrix_rank: int = 2) -> None:
    """Our powersgd_hook on ScratchDDP against torch's powerSGD_hook on torch's DDP, from the
    same first Qs: steps SGD steps of LeNet, compressed at matrix_rank from step 2 on, with
    warm start and error feedback."""
    device, rank, world = rank_device(), dist.get_rank(), dist.get_world_size()
    trained = []
    for ours in (True, False):
        model = lenet_layers(0).to(device)
        ddp = ScratchDDP(model) if ours else torch_ddp(model)
        ddp.register_comm_hook(*((TorchsFirstQs(matrix_rank), powersgd_hook) if ours
                                 else torch_powersgd(matrix_rank)))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with torch_powersgd_on_cpu():
            for step in range(steps):
                X, y = batch(step)
                one_step(ddp, opt, X.chunk(world)[rank].to(device),
                         y.chunk(world)[rank].to(device))
        trained.append(flat(model.state_dict()))
    close(*trained, f"after {steps} steps at rank {matrix_rank}")


def shared_memory_on_rank() -> None:
    """Chapter 08's shared-memory allreduce against dist.all_reduce."""
    t = torch.randn(10_000, generator=torch.Generator().manual_seed(dist.get_rank()))
    want = t.clone()
    dist.all_reduce(want)
    with SharedMemoryAllreduce() as shm:
        shm.allreduce(t)
    close(t, want, "SharedMemoryAllreduce")


@dataclass
class RankCheck:
    chapter: str
    what: str
    run: Callable[[], None]  # on every rank, picklable; raises when wrong
    cpu_only: bool = False


RANK_CHECKS = [
    RankCheck("07", "ScratchDDP", partial(like_one_process, ScratchDDP)),
    RankCheck("07", "torch's DistributedDataParallel", partial(like_one_process, torch_ddp)),
    RankCheck("08", "SharedMemoryAllreduce", shared_memory_on_rank, cpu_only=True),
    RankCheck("09", "ZeRO-1: ShardedOptimizer under ScratchDDP",
              partial(like_one_process, ScratchDDP, sharded=True)),
    RankCheck("10", "ScratchFSDP", partial(like_one_process, ScratchFSDP)),
    RankCheck("11", "PowerSGD rank 2, 6 steps, ScratchDDP: as torch's", powersgd_like_torchs)]


def on_rank(checks: list[RankCheck]) -> list[tuple[str, float]]:
    """Each check on this rank: "ok" or what was wrong, and its seconds."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out = []
    for check in checks:
        start = time.perf_counter()
        try:
            if check.cpu_only and rank_device().type != "cpu":
                verdict = "not run: CPU tensors only"
            else:
                check.run()
                verdict = "ok"
        except Exception as error:  # noqa: BLE001 - reported in the table
            verdict = f"FAILED: {type(error).__name__}: {error}"
        out.append((verdict, time.perf_counter() - start))
    return out


ELASTIC_ARGS = ["--data", "synthetic", "--train-size", "48", "--global-batch-size", "12",
                "--epochs", "3", "--dtype", "float64", "--momentum", "0.9", "--lr", "0.05"]


def elastic_part(folder: str, part: str) -> None:
    """On every rank: chapter 12's run with ELASTIC_ARGS, "whole" (9 steps) and "stopped" at
    step 5, or the stopped one "resumed" to 9 steps, from its checkpoint."""
    from . import train_ddp
    runs = {"whole": [("whole", 9), ("stopped", 5)], "resumed": [("stopped", 9)]}[part]
    for name, steps in runs:
        args = [*ELASTIC_ARGS, "--steps", str(steps), "--checkpoint", f"{folder}/{name}.pt"]
        train_ddp.train(train_ddp.parse_args(args), rank_device())


def check_elastic() -> str:
    """Chapter 12: a run on 2 processes stopped at step 5 and resumed on 1 (the global batch
    re-cut, the momentum re-divided) ends within 1e-12 of the 2 processes' run (float64)."""
    backend = "nccl" if len([d for d in accelerators() if d.type == "cuda"]) >= 2 else "gloo"
    with tempfile.TemporaryDirectory(prefix="dpcourse-check-") as folder:
        launch(elastic_part, folder, "whole", world_size=2, backend=backend, timeout=180)
        launch(elastic_part, folder, "resumed", world_size=1, backend=backend, timeout=180)
        whole, resumed = (torch.load(f"{folder}/{name}.pt", weights_only=True)["model"]
                          for name in ("whole", "stopped"))
    gap = max((whole[k] - resumed[k]).abs().max().item() for k in whole)
    if not gap <= 1e-12:
        raise AssertionError(f"resumed on 1 process, off by {gap:.1e} from 2 processes' run")
    return f"2 then 1 processes, {backend}"


def check_two_nodes() -> str:
    """Chapter 12: two torchrun agents on this machine; node 1's worker killed while node 0's
    is stopped: both restart once, resume and end cleanly (the course's restart rule)."""
    from .experiments import nodes
    with tempfile.TemporaryDirectory(prefix="dpcourse-check-") as folder:
        run = nodes.restart_across_nodes(Path(folder) / "restart")
    if run["exit_codes"] != [0, 0] or run["resumed"] != 1 or run["rounds"] != 2:
        raise AssertionError(f"exit codes {run['exit_codes']}, {run['resumed']} resumed, "
                             f"{run['rounds']} rounds named (want [0, 0], 1, 2)")
    return "2 torchrun agents, gloo"


def check_never_stops() -> str:
    """Chapter 13: two train_ft replicas and a lighthouse on this machine, in float64; one is
    killed during its allreduce at step 3 and started again: it heals from the other, and
    the run ends within 1e-12 of one process (1e-10 on a GPU: other kernels)."""
    from .experiments.ft_runs import EXACT, Replicas, one_process_run
    gpu = torch.cuda.is_available()
    kill = [{"phase": "allreduce", "step": 3, "how": "kill", "restart": True}]
    with tempfile.TemporaryDirectory(prefix="dpcourse-check-") as folder:
        flags = ["--steps", "8", "--global-batch-size", "16", "--train-size", "160",
                 "--checkpoint", f"{folder}/ckpt.pt", *EXACT]
        with Replicas(Path(folder), flags, gpus=gpu) as replicas:
            codes = replicas.run({"r0": [], "r1": kill}, timeout=180)
            healed = any(e["event"] == "heal" for e in replicas.events())
        final = torch.load(f"{folder}/ckpt.pt", weights_only=True)["model"]
    _, reference = one_process_run(flags)
    gap = max((final[k] - reference[k]).abs().max().item() for k in reference)
    if codes != {"r0": 0, "r1": 0} or not healed or not gap <= (1e-10 if gpu else 1e-12):
        raise AssertionError(f"exit codes {codes}, healed {healed}, off by {gap:.1e} from one "
                             "process")
    return "2 replicas, gloo" + (", cuda:0 (gloo sums CPU copies)" if gpu else ", cpu")


def check_fault_tolerant_hsdp() -> str:
    """Chapter 14: two groups of 2 ranks, each under torchrun, and a lighthouse on this
    machine, in float64; rank 1 of g1 is killed in its forward at step 3, torchrun starts g1
    again, it heals shard by shard, and the run ends within 1e-12 of one process."""
    from .experiments.ft_runs import EXACT, Replicas
    from .experiments.group_runs import final_state, one_process_run, start_group
    from .lighthouse import Rules
    with tempfile.TemporaryDirectory(prefix="dpcourse-check-") as folder:
        flags = ["--steps", "8", "--global-batch-size", "16", "--train-size", "160",
                 "--checkpoint", f"{folder}/ckpt.pt", "--device", "cpu", *EXACT]
        with Replicas(Path(folder), flags, Rules(min_replicas=2)) as replicas:
            start_group(replicas, "g0", 2)
            start_group(replicas, "g1", 2, restarts=1, faults=[
                {"rank": 1, "step": 3, "phase": "forward", "how": "kill"}])
            codes = replicas.supervise(180)
            healed = any(e["event"] == "heal" for e in replicas.events())
        final = final_state(Path(folder) / "ckpt.pt", flags)
    _, reference = one_process_run(flags)
    gap = max((final[k] - reference[k]).abs().max().item() for k in reference)
    if codes != {"g0": 0, "g1": 0} or not healed or not gap <= 1e-12:
        raise AssertionError(f"exit codes {codes}, healed {healed}, off by {gap:.1e} from one "
                             "process")
    return "2 groups of 2 ranks under torchrun, gloo, cpu"


LOCAL = [Check("00", "tensors to each device and back", check_tensors),
         Check("01", "profile_steps and LeNet's output on 2 devices", check_profile),
         Check("02", "one SGD step of LeNet on each of 2 devices", check_sgd_step),
         Check("03", "broadcast, allreduce, ring_allreduce on 3 devices", check_collectives),
         Check("04-05", "split_batch and train_batch on 2 devices", check_train_batch),
         Check("06", "ScratchDataParallel (and nn.DataParallel on real GPUs)",
               check_data_parallel)]
LATER = [Check("12", "2 processes resumed on 1: within 1e-12 in float64", check_elastic),
         Check("12", "2 nodes: a worker killed, both restart and resume", check_two_nodes),
         Check("13", "2 replicas, one killed and healed: as one process", check_never_stops),
         Check("14", "2 groups of 2, a rank killed, its group healed: as one process",
               check_fault_tolerant_hsdp)]


def rank_rows(world_size: int = 2, checks: list[RankCheck] | None = None
              ) -> list[tuple[str, str, str, str, float]]:
    """The multi-process checks (RANK_CHECKS), run in one launch: nccl with a GPU per rank,
    else gloo. A row's seconds: its check's on the slowest rank (start-up is in none)."""
    checks = RANK_CHECKS if checks is None else checks
    gpus = len([d for d in accelerators() if d.type == "cuda"])
    backend = "nccl" if gpus >= world_size else "gloo"
    where = f"{world_size} processes, {backend}" + ("" if backend == "nccl" else " on the CPU")
    try:
        results = launch(on_rank, checks, world_size=world_size, backend=backend, timeout=180)
    except Exception as error:  # noqa: BLE001 - a crashed or hung rank fails every row
        results = [[(f"FAILED: {error}", 0.0)] * len(checks)]
    rows = []
    for i, check in enumerate(checks):
        verdicts = sorted({r[i][0] for r in results}, key=lambda v: not v.startswith("FAILED"))
        rows.append((check.chapter, check.what, where, verdicts[0],
                     max(r[i][1] for r in results)))
    if backend == "gloo":
        rows.append(("07-11", "the same on nccl, one GPU per process", "-",
                     f"not run: needs {world_size} GPUs", 0.0))
    return rows


def run_checks(checks: list[Check]) -> list[tuple[str, str, str, str, float]]:
    """One row per check: (chapter, what, devices, result, seconds)."""
    rows = []
    for check in checks:
        start = time.perf_counter()
        try:
            where, result = check.run(), "ok"
        except Exception as error:  # noqa: BLE001 - reported in the table
            where, result = "-", f"FAILED: {type(error).__name__}: {error}"
        rows.append((check.chapter, check.what, where, result, time.perf_counter() - start))
    return rows


def print_table(rows: list[tuple[str, str, str, str, float]]) -> None:
    print(f"\n{'chapter':7s}  {'what ran':55s}  {'devices':28s}  {'seconds':>7s}  result")
    for chapter, what, where, result, seconds in rows:
        print(f"{chapter:7s}  {what:55s}  {where:28s}  {seconds:7.1f}  {result}")


def main() -> int:
    gpus = accelerators()
    print(f"Self-check on {len(gpus)} GPU{'s' if len(gpus) != 1 else ''}"
          + (f" ({torch.cuda.get_device_name(0)})" if gpus and gpus[0].type == "cuda" else "")
          + f", torch {torch.__version__}")
    rows = run_checks(LOCAL)
    if len(gpus) < 2:
        rows.append(("06", "nn.DataParallel on 2 real GPUs", "-", "not run: needs 2 GPUs", 0.0))
    rows += rank_rows()
    rows += run_checks(LATER)
    print_table(rows)
    failed = [r for r in rows if r[3].startswith("FAILED")]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} rows without failure"
          + (f"; {len(failed)} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
