"""Chapter 14: replica groups of train_ft, each a torchrun job of g ranks, on this machine;
failures injected inside a rank; what the ranks logged, read back.

``start_group`` starts a group as its users do (``torchrun --nproc_per_node=g
--max-restarts=N``), its ranks running this module: train_ft's main with the faults of
$DPCOURSE_GROUP_FAULTS that name the rank and the group's start (torchrun's restart count).
``final_state`` reads the sharded checkpoint back as one model's state dict, and
``one_process_run`` is the uninterrupted reference (chapter 10's layers, without train_ft).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import train_ft
from ..data import fashion_mnist
from ..elastic import rank_indices
from ..ft_groups import read_manifest, shard_files
from ..fsdp import ScratchFSDP, unflatten
from ..hsdp import scratch_hsdp
from ..launch import exit_without_shutdown, launch
from ..lenet import lenet_layers
from ..lighthouse import Rules
from ..recovery import receive_state, send_state
from .ft_runs import Replicas, environment
from .torchft_runs import ours_sample_use

PHASES = ("quorum", "forward", "reduce-scatter", "allreduce", "vote", "serve")


def torchrun(size: int, restarts: int) -> list[str]:
    """The command prefix of a group of size ranks, started again up to restarts times."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={size}", f"--max-restarts={restarts}", "--monitor-interval=0.1",
            "-m", "dpcourse.experiments.group_runs"]


def start_group(replicas: Replicas, name: str, size: int, restarts: int = 0,
                faults: Sequence[dict] = (), pace: float = 0.0) -> int:
    """Start group name of size ranks under torchrun, each step taking pace seconds more; a
    fault: "rank", "start" (0: the first start, 1: torchrun's first restart...), "step",
    "phase" (PHASES), "how" ("kill", "stop" for "pause" seconds, or "fail"). The agent's
    pid."""
    return replicas.start(name, command=torchrun(size, restarts), environ={
        "DPCOURSE_GROUP_FAULTS": json.dumps(list(faults)), "DPCOURSE_GROUP_PACE": str(pace)})


def faulty(faults: list[dict], pace: float = 0.0) -> train_ft.Phase:
    """at(phase, step) that kills or stops this process at the first attempt at or after
    each fault's step in its phase (a stop continued by a sleeper after its pause), or fails
    it there on this rank alone ("fail"), and sleeps pace seconds before each quorum."""
    pending = list(faults)

    def at(phase: str, step: int) -> None:
        if phase == "quorum":
            time.sleep(pace)
        for fault in [f for f in pending if f["phase"] == phase and step >= f["step"]]:
            pending.remove(fault)
            if fault["how"] == "fail":  # "allreduce": torn, ended elsewhere; "vote": alone
                raise RuntimeError(f"injected: {phase} failed on this rank alone")
            if fault["how"] == "stop":
                subprocess.Popen(["sh", "-c", f"sleep {fault['pause']}; kill -CONT {os.getpid()}"],
                                 start_new_session=True)
            os.kill(os.getpid(), signal.SIGKILL if fault["how"] == "kill" else signal.SIGSTOP)
    return at


def final_state(path: Path, flags: Sequence[str]) -> dict[str, torch.Tensor]:
    """The model (chapter 10's LeNet layers) as the sharded checkpoint at path holds it."""
    args = train_ft.parse_args(["--lighthouse", "unused:0", *flags])
    manifest = read_manifest(path, args)
    held = [torch.load(f, weights_only=True)
            for f in shard_files(path, manifest["step"], manifest["group_size"])]
    model = lenet_layers(args.seed).to(getattr(torch, args.dtype))
    units = [layer for layer in model if list(layer.parameters())]  # ScratchFSDP's units
    with torch.no_grad():
        for i, layer in enumerate(units):
            params = list(layer.parameters())
            flat = torch.cat([h["shards"][i] for h in held])[:sum(p.numel() for p in params)]
            for param, view in zip(params, unflatten(flat, [p.shape for p in params])):
                param.copy_(view)
    return model.state_dict()


def one_process_run(flags: Sequence[str]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """train_ft's run (its flags) uninterrupted in this process on chapter 10's LeNet layers,
    written out without train_ft: each global batch's mean loss, backward, SGD; the losses
    before each step, and the final weights."""
    args = train_ft.parse_args(["--lighthouse", "unused:0", *flags])
    data = fashion_mnist("train", args.train_size, environment()["DPCOURSE_DATA"])
    dtype = getattr(torch, args.dtype)
    model = lenet_layers(args.seed).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    losses = []
    for step in range(args.steps):
        X, y = data[rank_indices(len(data), args.global_batch_size, 1, 0, step, args.seed)]
        opt.zero_grad()
        loss = F.cross_entropy(model(X.to(dtype)), y)
        losses.append(loss.item())
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = train_ft.learning_rate(args, step)
        opt.step()
    return losses, model.state_dict()


def per_rank(events: list[dict[str, Any]], global_batch: int) -> list[dict[str, Any]]:
    """The events as chapter 13's timeline reads them: one row per group and rank ("g1 r0"),
    each commit with the global batch's loss (its ranks' loss sums added, divided by G)."""
    sums = defaultdict(float)
    for e in events:
        if e.get("decision") == "commit":
            sums[e["qid"], e["step"]] += e["loss_sum"]
    return [{**e, "name": f"{e['name']} r{e['rank']}",
             **({"loss": sums[e["qid"], e["step"]] / global_batch}
                if e.get("decision") == "commit" else {})} for e in events]


def restarts(events: list[dict[str, Any]]) -> list[tuple[float, str, str]]:
    """(time, "gI rR", "started") for each rank's start after its first (torchrun's
    restarts), as Replicas notes signals."""
    firsts, noted = set(), []
    for e in (e for e in events if e["event"] == "start"):
        row = f"{e['name']} r{e['rank']}"
        if row in firsts:
            noted.append((e["time"], row, "started"))
        firsts.add(row)
    return noted


def _hsdp_pair(steps: int, global_batch: int) -> dict[str, Any]:
    """On each of 4 ranks: chapter 10's LeNet layers in float64 trained steps SGD steps on
    this rank's quarter of each global batch, as scratch_hsdp over groups of 2 and as torch's
    fully_shard on a (2, 2) mesh; the largest gap between the two, and our bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    data = fashion_mnist("train", 256)
    ours, theirs = scratch_hsdp(lenet_layers(0).double(), 2), lenet_layers(0).double()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in [m for m in theirs if list(m.parameters())] + [theirs]:
        fully_shard(layer, mesh=mesh)
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(steps):
            X, y = data[rank_indices(len(data), global_batch, world, rank, step, 0)]
            opt.zero_grad()
            F.cross_entropy(model(X.double()), y).backward()
            opt.step()
    full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    mine = ours.full_state_dict()
    return {"gap": max((mine[k] - full[k]).abs().max().item() for k in full),
            "across": ours.replicate.bytes_handed // steps,
            "whole": sum(u.numel for u in ours.units) * 8}


def hsdp_against_torch(steps: int = 3, global_batch: int = 32) -> dict[str, Any]:
    """scratch_hsdp (2 groups of 2) against torch's fully_shard on a 2-D mesh, on 4 processes
    (_hsdp_pair): the largest parameter gap on any rank, the bytes a rank hands across
    groups per step and DDP's (the whole gradient)."""
    results = launch(_hsdp_pair, steps, global_batch, world_size=4, backend="gloo",
                     timeout=300)
    return {"gap": max(r["gap"] for r in results), "across": results[0]["across"],
            "whole": results[0]["whole"]}



def attempts(events: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict]]:
    """Each attempt's decisions, by (quorum id, step): one per rank that decided."""
    by_attempt = defaultdict(list)
    for e in events:
        if e["event"] == "decision":
            by_attempt[e["qid"], e["step"]].append(e)
    return by_attempt


def main() -> None:
    """A rank of a group: train_ft's main with this rank's faults for this start."""
    rank, start = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    faults = [f for f in json.loads(os.environ.get("DPCOURSE_GROUP_FAULTS", "[]"))
              if f["rank"] == rank and f.get("start", 0) == start]
    train_ft.main(sys.argv[1:], faulty(faults, float(os.environ.get("DPCOURSE_GROUP_PACE", 0))))


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - reported here, then a plain non-zero exit
        traceback.print_exc()
        exit_without_shutdown(1)
    exit_without_shutdown(0)


def _copy_seconds(numel: int, size: int, repeats: int) -> dict[str, list[float]]:
    """On 2 x size ranks (launch): ranks 0..size-1 hold an up-to-date group's state (numel
    float32 parameters and as much momentum); the whole state sent by rank 0 to rank size
    (chapter 13's copy), and each rank r's shard sent to rank size + r at once (chapter
    14's). The seconds of each, repeats times, as the slowest receiver sees them."""
    rank, group = dist.get_rank(), dist.distributed_c10d._get_default_group()
    whole = {"model": torch.randn(numel), "momentum": torch.randn(numel)}
    shard = {k: v.chunk(size)[rank % size].clone() for k, v in whole.items()}
    seconds: dict[str, list[float]] = {"whole state from one peer": [], "shard by shard": []}
    for _ in range(repeats):
        for name in seconds:
            dist.barrier()
            start = time.perf_counter()
            if name == "whole state from one peer" and rank in (0, size):
                send_state(group, whole, size) if rank == 0 else receive_state(group, 0)
            elif name == "shard by shard":
                send_state(group, shard, rank + size) if rank < size else \
                    receive_state(group, rank - size)
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            seconds[name].append(took.item())
    return seconds


def recovery_seconds(numel: int, size: int = 2, repeats: int = 3) -> dict[str, float]:
    """Medians of _copy_seconds, the two copies alternated: a group of size ranks healing from
    one peer's whole state, or shard by shard from the ranks of an up-to-date group."""
    seconds = launch(_copy_seconds, numel, size, repeats, world_size=2 * size, backend="gloo",
                     timeout=600)[0]
    return {name: statistics.median(s) for name, s in seconds.items()}


BENCH_FLAGS = ("--steps", "150", "--global-batch-size", "32", "--dtype", "float64",
               "--timeout", "5", "--checkpoint-every", "1000")
LENET_NUMEL = sum(p.numel() for p in lenet_layers(0).parameters())  # 129,068
KILL_AT, BENCH_PACE = 20, 0.04  # g1's rank 1 killed at step 20; g0 still training when
# torchrun has started g1 again (150 steps at 40 ms more each)


def failure_figures(folder: Path, rules: Rules, repeats: int) -> dict[str, float]:
    """2 groups of 2 ranks (BENCH_FLAGS, LeNet): g1's rank 1 SIGKILLed from outside at step
    KILL_AT, g1 started again by torchrun; medians over repeats runs of the seconds from the
    kill to g0's next commit (of a step after the killed rank's last commit, decided by both
    its ranks), to the restarted g1's first commit, the samples skipped and trained twice,
    the gap to one uninterrupted process,
    and of its ranks' shard-wise recovery, and the bytes a rank hands across groups a step."""
    runs = defaultdict(list)
    for i in range(repeats):
        run = folder / f"groups-{i}"
        run.mkdir()
        flags = [*BENCH_FLAGS, "--checkpoint", str(run / "ckpt.pt")]
        with Replicas(run, flags, rules) as replicas:
            for name in ("g0", "g1"):
                start_group(replicas, name, 2, restarts=1, pace=BENCH_PACE)
            worker = _waited_for(lambda: next((e["pid"] for e in replicas.events() if
                                               e["name"] == "g1" and e["rank"] == 1 and
                                               e.get("step", -1) >= KILL_AT), None), 120)
            killed = time.time()
            os.kill(worker, signal.SIGKILL)
            codes = replicas.supervise(300)
            events = replicas.events()
        if codes != {"g0": 0, "g1": 0}:
            raise RuntimeError(f"the groups exited {codes}:\n{replicas.outputs()}")
        last = max(e["step"] for e in events if e["pid"] == worker
                   and e.get("decision") == "commit")  # the killed rank's last commit
        later = [e for e in events if e["time"] > killed and e.get("step", -1) > last]
        runs["kill_to_next_commit_s"].append(_commit_time(later, lambda e: e["name"] == "g0")
                                             - killed)
        after = [e for e in events if e["time"] > killed]
        restarted = {e["pid"] for e in after if e["name"] == "g1" and e["event"] == "start"}
        runs["kill_to_restarted_commit_s"].append(
            _commit_time(after, lambda e: e["pid"] in restarted) - killed)
        runs["shard_recovery_s"].append(max(e["seconds"] for e in after if e["event"] == "heal"))
        runs["bytes_across"].append(max(e["bytes_across"] for e in events
                                        if e.get("decision") == "commit"))
        use = ours_sample_use(events, train_ft.parse_args(["--lighthouse", "x:0", *flags]))
        runs["samples_skipped"].append(use["skipped"])
        runs["samples_repeated"].append(use["repeated"])
        final, (_, reference) = final_state(run / "ckpt.pt", flags), one_process_run(flags)
        runs["gap"].append(max((final[k] - reference[k]).abs().max().item() for k in reference))
    return {key: statistics.median(values) for key, values in runs.items()}


def kill_figures(events: list[dict[str, Any]], killed: float, worker: int) -> dict[str, float]:
    """Seconds from a rank's kill (at time killed, its pid worker, in g1) to g0's next commit
    of a step after the killed rank's last, and to the first commit that g1, started again,
    takes part in (not while it heals: torchft's healing commit sends zeros)."""
    last = max(e["step"] for e in events if e["pid"] == worker and e.get("decision") == "commit")
    after = [e for e in events if e["time"] > killed and e.get("decision") == "commit"]
    started = {e["pid"] for e in events if e["event"] == "start" and e["time"] > killed}
    return {"kill_to_next_commit_s": min(e["time"] for e in after if e["name"] == "g0"
                                         and e["step"] > last) - killed,
            "kill_to_restarted_commit_s": min(e["time"] for e in after if e["pid"] in started
                                              and e.get("participating", True)) - killed}


def _commit_time(events: list[dict[str, Any]], chosen: Any) -> float:
    """When the first step committed by the ranks chosen (a function of an event) was
    decided on all of them."""
    commits = defaultdict(list)
    for e in events:
        if e.get("decision") == "commit" and chosen(e):
            commits[e["qid"], e["step"]].append(e["time"])
    times = [max(t) for t in commits.values() if len(t) == 2]
    return min(times)


def _waited_for(found: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while (value := found()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing found within {timeout:g} s")
        time.sleep(0.02)
    return value


def _steady_step(kind: str, steps: int, per_rank: int) -> float:
    """On each rank: chapter 10's LeNet layers in float64, per_rank samples a step, wrapped as
    kind ("scratch_hsdp": groups of 2; "torch HSDP": fully_shard on a (world // 2, 2) mesh;
    "ScratchFSDP": one group); the median seconds of a step over the last 3/4."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    data, model = fashion_mnist("train", 640), lenet_layers(0).double()
    if kind == "scratch_hsdp":
        model = scratch_hsdp(model, 2)
    elif kind == "ScratchFSDP":
        model = ScratchFSDP(model)
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in [m for m in model if list(m.parameters())] + [model]:
            fully_shard(layer, mesh=mesh)
    opt, seconds = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), []
    for step in range(steps):
        X, y = data[rank_indices(len(data), per_rank * world, world, rank, step, 0)]
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(X.double()), y, reduction="sum").backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[steps // 4:])


def steady_steps(steps: int = 60, per_rank: int = 8) -> dict[str, float]:
    """Seconds of a steady step (medians), per_rank samples on each rank: train_ft's groups (2
    of 2, no failure), scratch_hsdp and torch's HSDP on the same 4 processes, and plain
    ScratchFSDP on one group of 2."""
    flags = ["--steps", str(steps), "--global-batch-size", str(4 * per_rank), "--dtype",
             "float64", "--timeout", "5", "--momentum", "0.9"]
    with tempfile.TemporaryDirectory() as folder:
        with Replicas(Path(folder), flags, Rules(min_replicas=2)) as replicas:
            for name in ("g0", "g1"):
                start_group(replicas, name, 2)
            codes = replicas.supervise(300)
            events = replicas.events()
    if codes != {"g0": 0, "g1": 0}:
        raise RuntimeError(f"the groups exited {codes}")
    commits = sorted(e["time"] for e in events if e["name"] == "g0" and e["rank"] == 0
                     and e.get("decision") == "commit")
    gaps = [b - a for a, b in zip(commits, commits[1:])]
    found = {"train_ft, 2 groups of 2": statistics.median(gaps[len(gaps) // 4:])}
    for kind, world in (("scratch_hsdp", 4), ("torch HSDP", 4), ("ScratchFSDP", 2)):
        found[kind] = launch(_steady_step, kind, steps, per_rank, world_size=world,
                             backend="gloo", timeout=300)[0]
    return found
