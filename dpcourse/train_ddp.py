"""Chapter 07: the training script torchrun starts, one process per device.

    torchrun --standalone --nproc_per_node=2 -m dpcourse.train_ddp --steps 5

Each process reads RANK, LOCAL_RANK and WORLD_SIZE from torchrun, joins the group (nccl with
one GPU per process, else gloo on the CPU), trains its share of every global batch
(``DistributedSampler``) under ``ScratchDDP``, torch's DDP or ``ScratchFSDP`` (chapter 10: each
rank keeps 1/k of the parameters), and checks at the end that every replica holds the same
parameters. Without torchrun (``python -m dpcourse.train_ddp``) it runs
as one process of a world of size 1: the same code path, handy for debugging and as a reference.
With ``--global-batch-size G`` the global batches are the same for every world size k (each
rank takes G/k), and a checkpoint resumes on another number of processes (elastic torchrun).
"""
from __future__ import annotations

import argparse
import gc
import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from .checkpoint import unwrap
from .concise import make_resnet18
from .data import SOURCES, Images, fashion_mnist, resolve_source
from .compression import PowerSGDState, bf16_hook, powersgd_hook
from .ddp import ScratchDDP
from .elastic import GlobalBatchSampler, state_at_world_size
from .fsdp import ScratchFSDP
from . import resume
from .launch import exit_without_shutdown
from .lenet import lenet_layers, lenet_model
from .local_sgd import DiLoCo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; every count is a total over the run, resumed steps included."""
    p = argparse.ArgumentParser(prog="python -m dpcourse.train_ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("lenet", "resnet18"), default="lenet",
                   help="default lenet")
    p.add_argument("--train-size", type=int, default=4096, help="training images (default 4096)")
    p.add_argument("--data", choices=SOURCES, default=None,
                   help="dataset (default: $DPCOURSE_DATA, else auto)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="images PER PROCESS in each step; the global batch is world size times "
                        "this (default 64)")
    p.add_argument("--global-batch-size", type=int, default=None, metavar="G",
                   help="images per step over ALL processes, whatever their number k (each "
                        "takes G/k; k must divide G): the same global batches for every k, so "
                        "a checkpoint resumes at another world size (elastic torchrun)")
    p.add_argument("--epochs", type=int, default=1,
                   help="epochs in total (default 1); training ends at --epochs or --steps, "
                        "whichever comes first")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many optimizer steps in total (default: no limit)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0: none)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="the parameters' and images' dtype (default float32)")
    p.add_argument("--seed", type=int, default=0,
                   help="initial weights and shuffling; rank r's dropout draws from (seed, r)")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="LeNet: dropout P before each dense layer (default 0: none)")
    wrapper = p.add_mutually_exclusive_group()
    wrapper.add_argument("--scratch", dest="ddp", action="store_const", const="scratch",
                         help="dpcourse.ddp.ScratchDDP (default)")
    wrapper.add_argument("--torch", dest="ddp", action="store_const", const="torch",
                         help="torch.nn.parallel.DistributedDataParallel")
    wrapper.add_argument("--fsdp", dest="ddp", action="store_const", const="fsdp",
                         help="dpcourse.fsdp.ScratchFSDP, one unit per layer (LeNet as "
                              "lenet_layers) or per child module (ResNet-18)")
    p.set_defaults(ddp="scratch")
    p.add_argument("--comm-hook", choices=("bf16", "powersgd"), default=None,
                   help="average the gradients in bfloat16, or by PowerSGD (chapter 11; with "
                        "--scratch or --torch)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD's rank (default 4)")
    p.add_argument("--diloco", type=int, default=None, metavar="H",
                   help="DiLoCo (chapter 11): H local SGD steps per rank between averaged "
                        "outer steps, no DDP; a checkpoint syncs nothing: it keeps each "
                        "rank's own parameters, and a resumed run goes on mid-round")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer lr (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="DiLoCo's outer Nesterov momentum (default 0.9; 0: none)")
    p.add_argument("--checkpoint", type=Path, default=None, metavar="PATH",
                   help="resume from PATH if it exists; rank 0 writes it each epoch and at the end")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="also write the checkpoint every N steps: a restarted run (torchrun "
                        "--max-restarts) redoes at most N steps")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a collective, or joining the group, may wait for the other "
                        "ranks (default 120; torch's own default is 30 minutes for gloo)")
    args = p.parse_args(argv)
    if args.ddp == "fsdp" and (args.comm_hook or args.diloco):
        p.error("--fsdp reduce-scatters its gradients itself: no --comm-hook or --diloco")
    if args.comm_hook and args.diloco:
        p.error("--diloco averages parameters, not gradients: no --comm-hook with it")
    if not 0 <= args.dropout < 1 or (args.dropout and args.model != "lenet"):
        p.error(f"--dropout P needs 0 <= P < 1 and --model lenet, got {args.dropout}")
    if args.checkpoint_every is not None and (args.checkpoint is None or args.checkpoint_every < 1):
        p.error("--checkpoint-every N needs N >= 1 and --checkpoint PATH")
    if args.global_batch_size is not None and args.batch_size is not None:
        p.error("--batch-size (per process) and --global-batch-size (over all processes) both "
                "given: give one")
    if (args.global_batch_size or 1) < 1 or (args.batch_size or 1) < 1 or args.momentum < 0:
        p.error("--batch-size and --global-batch-size need at least 1, --momentum at least 0")
    if args.global_batch_size is None and args.batch_size is None:
        args.batch_size = 64
    return args


def init_distributed(timeout_s: float) -> tuple[torch.device, dist.Store]:
    """Join the default group (torchrun's store, else a world of one); return our device and
    the store joined through."""
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        where = resume.join_arguments(timeout)  # torchrun's store, this round's own prefix
        if "init_method" in where:  # env://: rank 0 hosts a store; we keep it to name lost ranks
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            where = {"store": store, "rank": rank, "world_size": world_size}
    else:
        print("No RANK/WORLD_SIZE from torchrun: running as a single process (world size 1)")
        where = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= local_world:
        torch.cuda.set_device(local_rank)  # else every rank would allocate on GPU 0
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device, **where)
        say(f"Backend: nccl, one GPU per process (processes on this node: {local_world})")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout, **where)
        say(f"Backend: gloo on the CPU (processes on this node: {local_world}, GPUs: {gpus})")
    return device, where["store"]


def describe(args: argparse.Namespace) -> str:
    """The training's name in the progress bar."""
    if args.diloco is not None:
        return f"DiLoCo H={args.diloco}"
    name = "FSDP" if args.ddp == "fsdp" else f"{args.ddp} DDP"
    return f"{name}, {args.comm_hook}" if args.comm_hook else name


def say(message: str) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(message, flush=True)


def load_train_data(size: int, source: str | None) -> Images:
    """The training images; local rank 0 fetches first, so one process per node downloads."""
    chosen = [resolve_source(source) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0)  # every rank uses what rank 0 found
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    data = fashion_mnist("train", size, chosen[0]) if first else None
    dist.barrier()
    return data if first else fashion_mnist("train", size, chosen[0])


def build_model(name: str, seed: int, device: torch.device, layers: bool = False,
                dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """LeNet (scale 0.1, the course's CPU setting; as nn layers if layers; dropout before its
    dense layers) or the course's ResNet-18, on device, in dtype."""
    if name == "lenet":
        return (lenet_layers if layers else lenet_model)(seed, dropout).to(device, dtype)
    return make_resnet18(device, seed).to(dtype=dtype)


@dataclass
class Training:
    """The model, wrapped as the command says, its optimizer, its device and its comm hook's
    state."""
    model: nn.Module
    opt: Any
    device: torch.device
    hook_state: PowerSGDState | None = None


def build_training(args: argparse.Namespace, device: torch.device) -> Training:
    """The model, wrapped as args say (ScratchDDP, torch's DDP, ScratchFSDP, or none under
    DiLoCo), with its comm hook, and its optimizer (SGD, inside DiLoCo under --diloco); seeds
    this rank's generators (dropout's) from (seed, rank), so that ranks draw apart."""
    model = build_model(args.model, args.seed, device, layers=args.ddp == "fsdp",
                        dropout=args.dropout, dtype=getattr(torch, args.dtype))
    if args.ddp == "fsdp":
        model = ScratchFSDP(model)  # before the optimizer, which then holds the shards only
    elif args.diloco is None and args.ddp == "scratch":
        model = ScratchDDP(model)
    elif args.diloco is None:  # find_unused_parameters: torch then keeps its first bucket
        # layout (without it, it rebuilds it after one step, and a restarted wrapper would
        # reduce in another layout: with 3+ ranks, sums that round differently); it costs a
        # walk of the autograd graph per forward, and torch warns once that nothing was unused
        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=True)
    hook_state = PowerSGDState(args.powersgd_rank) if args.comm_hook == "powersgd" else None
    if args.comm_hook is not None:
        model.register_comm_hook(hook_state, powersgd_hook if hook_state else bf16_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if args.diloco is not None:
        opt = DiLoCo(model, opt, args.diloco, args.outer_lr, args.outer_momentum)
    torch.manual_seed(hash((args.seed, dist.get_rank())) % 2**63)  # every device's too
    return Training(model, opt, device, hook_state)


CHECKED = ("model", "train_size", "data", "batch_size", "global_batch_size", "lr", "momentum",
           "dtype", "seed", "dropout", "ddp", "comm_hook", "powersgd_rank", "diloco", "outer_lr",
           "outer_momentum")  # what shapes the run


# a format-2 checkpoint written before --momentum, --dtype and --global-batch-size existed
# (4667fef up to c4a3ae0) lacks them in its arguments: it trained with these
UNRECORDED = {"momentum": 0.0, "dtype": "float32", "global_batch_size": None}


def training_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments a checkpoint must have been written with to be resumed here: the world
    size too, unless --global-batch-size fixes the global batches whatever it is."""
    checked = {k: getattr(args, k) for k in CHECKED}
    if args.global_batch_size is None:
        checked["world_size"] = dist.get_world_size()
    return checked


def rank_state(run: Training) -> dict[str, Any]:
    """What this rank alone holds that the next steps depend on, on the CPU: its optimizer
    state (a shard under FSDP), its hook's state, its parameters under DiLoCo (they differ
    between syncs), and its random number generators (the CPU's and its device's)."""
    params = list(run.model.parameters())
    state = {"optimizer": run.opt.state_dict(),
             "hook": run.hook_state.state_dict(params) if run.hook_state else None,
             "model": run.model.state_dict() if isinstance(run.opt, DiLoCo) else None,
             "rng": resume.rng_state(run.device)}
    return resume.to_cpu(state)


def save_training_state(path: Path, args: argparse.Namespace, run: Training, epoch: int,
                        step: int) -> None:
    """Rank 0 writes path atomically, holding the weights (whole: rank 0's, or gathered under
    FSDP) and every rank's own state; every rank waits for it."""
    if isinstance(run.model, ScratchFSDP):  # a collective: every rank takes part
        weights = run.model.full_state_dict()
    else:
        weights = unwrap(run.model).state_dict()
    ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rank_state(run), ranks, dst=0)
    if dist.get_rank() == 0:
        resume.save(path, {"args": training_arguments(args), "model": weights, "ranks": ranks,
                           "epoch": epoch, "step": step})
        tqdm.write(f"Saved {path} (step {step}; a resumed run goes on in epoch {epoch})")
    dist.barrier()  # nobody reads or overwrites it before it is complete


def load_training_state(path: Path, state: dict[str, Any], args: argparse.Namespace,
                        run: Training) -> tuple[int, int]:
    """Every rank takes, from the checkpoint state it read from path (on the CPU), its own part
    to its device (the weights, or its shard under FSDP; its optimizer's and hook's state);
    returns (epoch, step) to resume from."""
    resume.check_same_command(path, {**UNRECORDED, **state["args"]}, training_arguments(args))
    if len(state["ranks"]) == dist.get_world_size():
        mine = state["ranks"][dist.get_rank()]
    else:
        numels = ([unit.numel for unit in run.model.units]
                  if isinstance(run.model, ScratchFSDP) else None)
        mine = state_at_world_size(path, state, dist.get_rank(), dist.get_world_size(), numels)
    if isinstance(run.model, ScratchFSDP):
        run.model.load_full_state_dict(state["model"])
    else:
        unwrap(run.model).load_state_dict(mine["model"] or state["model"])
    run.opt.load_state_dict(mine["optimizer"])
    if run.hook_state is not None:
        run.hook_state.load_state_dict(mine["hook"], list(run.model.parameters()))
    if mine["rng"] is not None:
        resume.set_rng_state(mine["rng"], run.device)
    else:  # a new world: nothing to restore, a seed of this rank's own, the same on a rerun
        torch.manual_seed(hash((args.seed, dist.get_rank(), state["step"])) % 2**63)
    say(f"Loaded {path}: resuming from epoch {state['epoch']}, step {state['step']}"
        + (f" (written by {len(state['ranks'])} processes)" if mine["rng"] is None else ""))
    return state["epoch"], state["step"]


def check_replicas_agree(model: nn.Module) -> None:
    """Raise unless every rank holds exactly rank 0's parameters."""
    mine = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    gap = (mine - rank0).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    if gap.item() != 0:
        raise RuntimeError(f"replicas disagree: a parameter differs from rank 0's by up to "
                           f"{gap.item():g}; gradients were not synchronised")


def train(args: argparse.Namespace, device: torch.device) -> None:
    """Train, checkpoint, print one summary line and check the replicas."""
    data, world = load_train_data(args.train_size, args.data), dist.get_world_size()
    # a generator of its own: each iterator draws its base seed from it, not from the global
    # generator, whose stream (dropout's) a resume restores and must not shift
    loading = {"pin_memory": device.type == "cuda", "generator": torch.Generator()}
    if args.global_batch_size is None:
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
        loader = DataLoader(data, args.batch_size, sampler=sampler, **loading)
    else:
        sampler = GlobalBatchSampler(len(data), args.global_batch_size, dist.get_rank(), world,
                                     args.seed)
        loader = DataLoader(data, batch_sampler=sampler, **loading)
    share = args.batch_size or args.global_batch_size // world
    say(f"Data: {data.source}, {len(data):,} images; {share} per process and step, "
        f"{share * world} per global batch")
    dtype = getattr(torch, args.dtype)
    run = build_training(args, device)
    model, opt = run.model, run.opt
    epoch = step = 0
    state = resume.load_if_found(args.checkpoint) if args.checkpoint is not None else None
    if state is not None:  # rank 0 decided: every rank resumes, or none
        epoch, step = load_training_state(args.checkpoint, state, args, run)
    limit = args.steps if args.steps is not None else float("inf")
    total = min(limit, args.epochs * len(loader))
    bar = tqdm(total=max(total, step), initial=step,
               desc=describe(args),
               disable=dist.get_rank() != 0)
    images, loss, start = 0, torch.full((), float("nan"), device=device), time.perf_counter()
    for epoch in range(epoch, args.epochs):
        if step >= limit:
            break
        sampler.set_epoch(epoch)  # else every epoch shuffles the same way
        for X, y in islice(loader, max(0, step - epoch * len(loader)), None):  # skip done ones
            if step >= limit:
                break
            X, y = X.to(device, dtype, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(X), y)  # this rank's mean; averaging the gradients
            # over ranks then gives the step of the global batch's mean loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step, images = step + 1, images + len(X)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            bar.update(1)
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                save_training_state(args.checkpoint, args, run, step // len(loader), step)
        if args.checkpoint is not None and not (args.checkpoint_every
                                                and step % args.checkpoint_every == 0):
            save_training_state(args.checkpoint, args, run, step // len(loader), step)
    bar.close()
    if isinstance(opt, DiLoCo) and opt.inner_steps % opt.sync_every:
        opt.sync()  # the last round, cut short, ends with a sync as every round does
    seconds = time.perf_counter() - start
    summary = torch.tensor([float(images), loss.item()], device=device)
    dist.all_reduce(summary)
    if args.ddp == "fsdp":
        held = f"each rank holds 1/{world} of the parameters"
    else:
        check_replicas_agree(model)
        held = "replicas identical"
    say(f"Done: {step} steps, {summary[0].item() / seconds:,.0f} images/s (all {world} processes), "
        f"final loss {summary[1].item() / world:.4f} (mean over ranks); {held}")


def main(argv: list[str] | None = None) -> None:
    """Parse argv (default: sys.argv), join the group, train (a failed collective names the
    ranks that are gone); the group is always destroyed."""
    args = parse_args(argv)
    device, store = init_distributed(args.timeout)
    try:
        with resume.naming_lost_ranks(store, dist.get_rank(), dist.get_world_size()):
            train(args, device)
    finally:
        gc.collect()  # free the DDP wrapper (a reference cycle through its hooks) and with it
        dist.destroy_process_group()  # gloo's last work, before the interpreter shuts down


if __name__ == "__main__":
    try:
        main()
    except SystemExit:  # argparse's --help or a usage error: no group yet, exit as usual
        raise
    except BaseException:  # noqa: BLE001 - reported here, then the same exit as success
        traceback.print_exc()
        exit_without_shutdown(1)
    exit_without_shutdown(0)
