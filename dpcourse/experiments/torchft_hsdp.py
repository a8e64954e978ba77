"""Chapter 14: torchft 0.2.0's fault-tolerant HSDP on this machine, beside ours.

Each replica group is a torchrun job of g ranks running this module: a torchft ``Manager`` per
rank (the group's rank and size), ``fully_shard`` on the group's own 1-D mesh, and on every
FSDP module ``set_all_reduce_hook`` calling ``Manager.allreduce`` (torch 2.14.1 runs the hook on
the reduce-scattered shard, already the group's mean, before FSDP's post-divide: see
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``). The data
path is torchft's: its ``DistributedSampler`` over every rank of every group, a batch of
G / (q g) a rank, the loader moving on after every step. Two things differ from a plain
user's script, each said where it is: a restarted group joins torchrun's store under a prefix
of its own (``resume.join_arguments``: without it a restart can fail in
``init_process_group``, pytorch/pytorch#167288), and the Manager is built with
``init_sync=False`` (every rank builds the same seeded model). ``run_groups`` runs two
groups under torchft's lighthouse with one rank killed; ``figures`` reads what they logged.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from .. import resume, train_ft
from ..data import fashion_mnist, resolve_source
from ..launch import exit_without_shutdown
from ..train_ddp import build_model
from .ft_runs import Replicas
from .torchft_runs import RULES, TorchftLighthouse, sample_use


def loader(dataset: Any, groups: int, group: int, size: int, rank: int, batch: int,
           seed: int) -> DataLoader:
    """torchft's data path for rank `rank` of group `group`: its DistributedSampler over the
    groups x size ranks, shuffled, batch samples a step."""
    from torchft import DistributedSampler
    sampler = DistributedSampler(dataset, replica_rank=group, num_replica_groups=groups,
                                 group_rank=rank, num_replicas=size, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch, sampler=sampler)


def sharded_lenet(args: argparse.Namespace, size: int) -> torch.nn.Module:
    """Chapter 10's LeNet layers, each fully_shard-ed on this group's 1-D mesh, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("shard",))
    model = build_model("lenet", args.seed, torch.device("cpu"), layers=True,
                        dtype=getattr(torch, args.dtype))
    for layer in [m for m in model if list(m.parameters())] + [model]:
        fully_shard(layer, mesh=mesh)
    return model


def train(args: argparse.Namespace, groups: int, group: int) -> None:
    """One rank of group `group`: torchft's loop (start_quorum, forward, backward with the
    hook, should_commit, step) until --steps are committed; its events in --events."""
    from torch.distributed.fsdp import FSDPModule
    from torchft import Manager, ProcessGroupGloo
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", **resume.join_arguments(timedelta(seconds=60)))
    store, port = None, [0]
    if rank == 0:  # the Manager's store: a fresh one for each start of the group
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = [store.port]
    dist.broadcast_object_list(port, src=0)
    model = sharded_lenet(args, size)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    params = list(model.parameters())

    def state_dict() -> dict[str, list]:  # this rank's shards, as plain tensors
        return {"params": [p.to_local().detach().clone() for p in params],
                "momentum": [opt.state[p]["momentum_buffer"].to_local().clone()
                             if "momentum_buffer" in opt.state.get(p, {}) else None
                             for p in params]}

    @torch.no_grad()
    def load_state_dict(state: dict[str, list]) -> None:
        for p, value, momentum in zip(params, state["params"], state["momentum"]):
            p.to_local().copy_(value)
            if momentum is not None:
                opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                opt.state[p]["momentum_buffer"].to_local().copy_(momentum)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict, replica_id=args.name,
        store_addr="127.0.0.1", store_port=port[0], rank=rank, world_size=size,
        lighthouse_addr=args.lighthouse, timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30),
        init_sync=False)
    for module in (m for m in model.modules() if isinstance(m, FSDPModule)):
        module.set_all_reduce_hook(lambda shard: manager.allreduce(shard).wait())
    run_loop(args, manager, model, opt, (groups, group, size, rank))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # on every rank
    if rank == 0:
        torch.save(full, f"{args.events}.pt")
    manager.shutdown(wait=False)


def run_loop(args: argparse.Namespace, manager: Any, model: torch.nn.Module, opt: Any,
             where: tuple[int, int, int, int]) -> None:
    """torchft's loop, as its train_ddp.py, over torchft's loader for this rank."""
    groups, group, size, rank = where
    dtype = getattr(torch, args.dtype)
    images, labels = fashion_mnist("train", args.train_size, resolve_source(args.data)).tensors
    data = TensorDataset(images.to(dtype), labels, torch.arange(len(labels)))
    deal = loader(data, groups, group, size, rank, args.global_batch_size // (groups * size),
                  args.seed)
    log = train_ft.EventLog(args.events, f"{args.name}-{uuid.uuid4().hex[:6]}", rank=rank)
    log("start", step=0, qid=0, checkpoint=False)
    pace = float(os.environ.get("DPCOURSE_GROUP_PACE", 0))
    batch = 0  # this process's loader starts at its shard's first batch, restarted or not
    while manager.current_step() < args.steps:
        for inputs, targets, samples in deal:
            if manager.current_step() >= args.steps:
                break
            time.sleep(pace)  # as group_runs' pace: the same seconds more per step
            manager.start_quorum()
            opt.zero_grad(set_to_none=True)
            log("attempt", qid=0, step=manager.current_step(), batch=batch,
                samples=samples.tolist())
            F.cross_entropy(model(inputs), targets).backward()  # the hooks average across
            for param_group in opt.param_groups:
                param_group["lr"] = train_ft.learning_rate(args, manager.current_step())
            participating = manager.is_participating()  # False while it heals: sends zeros
            commit = manager.should_commit()
            log("decision", qid=manager._quorum_id,  # noqa: SLF001 - torchft has no getter
                step=manager.current_step() - commit, batch=batch,
                size=manager.num_participants(), participating=participating,
                decision="commit" if commit else "abort")
            if commit:
                opt.step()
            batch += 1  # torchft's loader moves on, committed or not
    log("end", step=manager.current_step(), qid=0, digest="")


def dealt(size: int, groups: int, group: int, ranks: int, rank: int, batch: int, seed: int,
          count: int) -> list[list[int]]:
    """The first count batches rank's loader deals (each epoch in the same order:
    train_ddp.py never calls set_epoch)."""
    deal, batches = loader(TensorDataset(torch.arange(size)), groups, group, ranks, rank, batch,
                           seed), []
    while len(batches) < count:
        batches += [b.tolist() for (b,) in deal][:count - len(batches)]
    return batches


def use_of_samples(events: list[dict[str, Any]], args: Any, names: Sequence[str],
                   ranks: int) -> dict[str, int]:
    """sample_use of a torchft groups run: a sample's place is (group, rank, loader batch,
    index); a rank's batch is trained if its group took part in a step some group committed."""
    decided = {(e["name"], e["rank"], e["pid"], e["batch"]): e for e in events
               if e["event"] == "decision"}
    committed = {(e["qid"], e["step"]) for e in decided.values() if e["decision"] == "commit"}
    used = Counter((e["name"], e["rank"], e["batch"], i) for e in events
                   if e["event"] == "attempt" and (d := decided.get(
                       (e["name"], e["rank"], e["pid"], e["batch"]))) is not None
                   and d["participating"] and (d["qid"], d["step"]) in committed
                   for i in e["samples"])
    batch = args.global_batch_size // (len(names) * ranks)
    expected = Counter((name, r, k, i) for g, name in enumerate(names) for r in range(ranks)
                       for k, b in enumerate(dealt(args.train_size, len(names), g, ranks, r,
                                                   batch, args.seed, args.steps)) for i in b)
    return sample_use(used, expected)


def run_groups(folder: Path, flags: Sequence[str], kill_at: int, pace: float = 0.0,
               size: int = 2) -> dict[str, Any]:
    """Two torchft groups of size ranks (torchrun, --max-restarts=1) under torchft's
    lighthouse command, each step pace seconds more; g1's rank 1 SIGKILLed once it has
    decided step kill_at, torchrun starting g1 again. Exit codes, events, the kill's time and
    pid, the final state."""
    folder.mkdir(parents=True, exist_ok=True)
    lighthouse = TorchftLighthouse(folder, RULES)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={size}", "--max-restarts=1", "--monitor-interval=0.1",
               "-m", "dpcourse.experiments.torchft_hsdp", "--groups", "2"]
    try:
        with Replicas(folder, flags, address=lighthouse.address) as replicas:
            for i, name in enumerate(("g0", "g1")):
                replicas.start(name, command=[*command, "--group", str(i)],
                               environ={"RUST_LOG": "warn", "DPCOURSE_GROUP_PACE": str(pace)})
            deadline, worker = time.monotonic() + 180, None
            while worker is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"g1 never reached step {kill_at}\n{replicas.outputs()}")
                time.sleep(0.02)
                worker = next((e["pid"] for e in replicas.events() if e["name"] == "g1" and
                               e["rank"] == 1 and e["event"] == "decision" and
                               e["step"] >= kill_at), None)
            os.kill(worker, signal.SIGKILL)
            killed = time.time()
            codes = replicas.supervise(300)
            events = replicas.events()
    finally:
        lighthouse.close()
    if codes != {"g0": 0, "g1": 0}:
        raise RuntimeError(f"the torchft groups exited {codes}:\n{replicas.outputs()}")
    final = torch.load(folder / "g0.jsonl.pt", weights_only=True)
    return {"codes": codes, "events": events, "killed": killed, "worker": worker,
            "final": final}


def figures(run: dict[str, Any], flags: Sequence[str]) -> dict[str, Any]:
    """What run_groups' run says: group_runs.kill_figures, the use of the samples, and the
    final parameters' gap to one uninterrupted process."""
    from .group_runs import kill_figures, one_process_run
    args = train_ft.parse_args(["--lighthouse", "unused:0", *flags])
    _, reference = one_process_run(flags)
    return {**kill_figures(run["events"], run["killed"], run["worker"]),
            "samples": use_of_samples(run["events"], args, ["g0", "g1"], 2),
            "gap": max((run["final"][k] - reference[k]).abs().max().item() for k in reference)}


def main() -> None:
    """A rank of a torchft group: --groups Q --group I, then train_ft's flags."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--group", type=int, required=True)
    known, rest = parser.parse_known_args()
    train(train_ft.parse_args(rest), known.groups, known.group)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - reported here, then a plain non-zero exit
        traceback.print_exc()
        exit_without_shutdown(1)
    exit_without_shutdown(0)
