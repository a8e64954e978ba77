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
from ..fsdp import unflatten
from ..launch import exit_without_shutdown, launch
from ..lenet import lenet_layers
from ..lighthouse import Rules
from ..recovery import receive_state, send_state
from .ft_runs import Replicas, environment

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
            if fault["how"] == "fail":  # in "allreduce": a torn collective, ended elsewhere
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


def one_process_run(flags: Sequence[str]) -> dict[str, torch.Tensor]:
    """train_ft's run (its flags) uninterrupted in this process on chapter 10's LeNet layers,
    written out without train_ft: each global batch's mean loss, backward, SGD; the final
    weights."""
    args = train_ft.parse_args(["--lighthouse", "unused:0", *flags])
    data = fashion_mnist("train", args.train_size, environment()["DPCOURSE_DATA"])
    dtype = getattr(torch, args.dtype)
    model = lenet_layers(args.seed).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    for step in range(args.steps):
        X, y = data[rank_indices(len(data), args.global_batch_size, 1, 0, step, args.seed)]
        opt.zero_grad()
        F.cross_entropy(model(X.to(dtype)), y).backward()
        for group in opt.param_groups:
            group["lr"] = train_ft.learning_rate(args, step)
        opt.step()
    return model.state_dict()


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
    seconds = launch(_copy_seconds, numel, size, repeats, world_size=2 * size, timeout=600)[0]
    return {name: statistics.median(s) for name, s in seconds.items()}


BENCH_FLAGS = ("--steps", "150", "--global-batch-size", "32", "--dtype", "float64",
               "--timeout", "5", "--checkpoint-every", "1000")
KILL_AT, BENCH_PACE = 20, 0.04  # g1's rank 1 killed at step 20; g0 still training when
# torchrun has started g1 again (150 steps at 40 ms more each)


def failure_figures(folder: Path, rules: Rules, repeats: int) -> dict[str, float]:
    """2 groups of 2 ranks (BENCH_FLAGS, LeNet): g1's rank 1 SIGKILLed from outside at step
    KILL_AT, g1 started again by torchrun; medians over repeats runs of the seconds from the
    kill to g0's next commit (both its ranks decided), to the restarted g1's first commit,
    and of its ranks' shard-wise recovery, and the bytes a rank hands across groups a step."""
    runs = defaultdict(list)
    for i in range(repeats):
        run = folder / f"groups-{i}"
        run.mkdir()
        with Replicas(run, BENCH_FLAGS, rules) as replicas:
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
        later = [e for e in events if e["time"] > killed]
        runs["kill_to_next_commit_s"].append(_commit_time(later, lambda e: e["name"] == "g0")
                                             - killed)
        restarted = {e["pid"] for e in later if e["name"] == "g1" and e["event"] == "start"}
        runs["kill_to_restarted_commit_s"].append(
            _commit_time(later, lambda e: e["pid"] in restarted) - killed)
        runs["shard_recovery_s"].append(max(e["seconds"] for e in later if e["event"] == "heal"))
        runs["bytes_across"].append(max(e["bytes_across"] for e in events
                                        if e.get("decision") == "commit"))
    return {key: statistics.median(values) for key, values in runs.items()}


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
