"""Chapter 13: training that never stops. One process per replica, on any machine:

    python -m dpcourse.lighthouse --port 29510                       # once, anywhere
    python -m dpcourse.train_ft --lighthouse HOST:29510 --global-batch-size 64 --steps 500

Before each step every replica asks the lighthouse for a quorum; the members build a gloo group
for it, heal any member behind (live recovery, from an up-to-date member), train global batch
s (the same G samples whatever the membership: member i of q takes positions floor(iG/q) up to
floor((i+1)G/q), ``elastic.rank_indices``), allreduce their gradient sums, divide by G and
vote. The step commits on every member or on none: a failure costs one step's compute, never a
sample. Timeouts nest: a collective's (--timeout) < the quorum's < the watchdog's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from . import resume
from .data import SOURCES, fashion_mnist, resolve_source
from .elastic import rank_indices
from .launch import exit_without_shutdown
from .lighthouse import REPLICA_ID
from .quorum import Membership, Quorum, RunEnded, forget_vote, quorum_group, vote
from .recovery import digest, receive_state, recovery_plan, send_state
from .train_ddp import build_model

FORMAT = "dpcourse.train_ft/1"
CHECKED = ("model", "train_size", "data", "global_batch_size", "steps", "lr", "warmup",
           "momentum", "dtype", "seed")  # what shapes the run: the same on every replica
Phase = Callable[[str, int], None]  # called at each named point of a step: (phase, step)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dpcourse.train_ft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lighthouse", required=True, metavar="HOST:PORT",
                   help="the lighthouse (python -m dpcourse.lighthouse)")
    p.add_argument("--name", default=f"{socket.gethostname()}-{os.getpid()}",
                   help="this replica's name: letters, digits, '.', '_', '-' (default "
                        "host-pid); each start adds a fresh id")
    p.add_argument("--model", choices=("lenet", "resnet18"), default="lenet",
                   help="default lenet (exact across memberships; ResNet-18's BatchNorm "
                        "statistics depend on the cut)")
    p.add_argument("--train-size", type=int, default=4096, help="training images (default 4096)")
    p.add_argument("--data", choices=SOURCES, default=None,
                   help="dataset (default: $DPCOURSE_DATA, else auto)")
    p.add_argument("--global-batch-size", type=int, default=64, metavar="G",
                   help="images per step over all replicas, whatever their number (default 64)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (default 200)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="the learning rate grows linearly over the first N committed steps")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="the parameters' and images' dtype (default float32)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and shuffling")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where this replica trains (default auto: its GPU, cuda:LOCAL_RANK, if "
                        "it has one); gloo sums CPU copies across replicas either way")
    p.add_argument("--checkpoint", type=Path, default=None, metavar="PATH",
                   help="load PATH at start if it exists; the quorum's first member writes it "
                        "every --checkpoint-every steps and at the end, never over a later step")
    p.add_argument("--checkpoint-every", type=int, default=50, metavar="N",
                   help="steps between checkpoints (default 50)")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds a collective (building a group, a recovery, the allreduce, "
                        "the vote) may wait for the others (default 5)")
    p.add_argument("--quorum-timeout", type=float, default=60.0,
                   help="seconds to wait for a quorum (default 60; more than twice --timeout "
                        "plus the lighthouse's heartbeat and join timeouts): a replica waits "
                        "that long for the others, one started again included")
    p.add_argument("--max-aborts", type=int, default=3,
                   help="aborted attempts at one step before this replica gives up (default 3)")
    p.add_argument("--events", type=Path, default=None, metavar="PATH",
                   help="append each event (start, quorum, heal, serve, attempt, decision, "
                        "checkpoint, end) to PATH as a line of JSON")
    p.add_argument("--digest-steps", action="store_true",
                   help="with --events, also log each committed step's state digest "
                        "(committed), so that the replicas can be compared step by step")
    args = p.parse_args(argv)
    if min(args.global_batch_size, args.steps, args.checkpoint_every, args.max_aborts) < 1:
        p.error("--global-batch-size, --steps, --checkpoint-every and --max-aborts need >= 1")
    if args.global_batch_size > args.train_size:
        p.error(f"--global-batch-size {args.global_batch_size} is more than --train-size "
                f"{args.train_size}")
    if args.timeout <= 0 or args.momentum < 0 or args.warmup < 0:
        p.error("--timeout needs more than 0; --momentum and --warmup at least 0")
    if not REPLICA_ID.fullmatch(f"{args.name}-000000"):
        p.error(f"--name {args.name!r}: use letters, digits, '.', '_' and '-', starting with a "
                "letter or digit (it is a key in the lighthouse's store)")
    return args


def run_of(args: argparse.Namespace) -> dict[str, Any]:
    """What shapes the run, the same on every replica and in its checkpoint: the arguments
    CHECKED, with the data as it resolves ($DPCOURSE_DATA or --data alike)."""
    return {**{k: getattr(args, k) for k in CHECKED}, "data": resolve_source(args.data)}


class Replica:
    """The training state: the model, its SGD optimizer, and the version (step: steps
    committed; qid: the quorum id of the last commit)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device, self.step, self.qid = args, device, 0, 0
        self.model: nn.Module = build_model(args.model, args.seed, device,
                                            dtype=getattr(torch, args.dtype))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr,
                                   momentum=args.momentum)

    def state(self) -> dict[str, Any]:
        """The whole state, on the CPU: all the next steps depend on (the learning rate
        follows the step)."""
        return resume.to_cpu({"model": self.model.state_dict(),
                              "optimizer": self.opt.state_dict(),
                              "step": self.step, "qid": self.qid})

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.qid = state["step"], state["qid"]

    def commit(self, summed: torch.Tensor, qid: int) -> None:
        """The optimizer step with the global batch's mean gradient (summed: the members'
        gradient sums added, divided by G) at the step's learning rate, and the version moved
        on: together."""
        mean = (summed / self.args.global_batch_size).to(self.device)
        for p, g in zip(self.model.parameters(), mean.split([p.numel() for p in
                                                             self.model.parameters()])):
            p.grad = g.view_as(p)
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(self.args, self.step)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step, self.qid = self.step + 1, qid


def gradient_sum(model: nn.Module, images: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of the per-sample gradients of these samples (flat, on the CPU), and of their
    losses: sums, so that members' shares of any size (none too) add up to the global
    batch's."""
    if len(labels) == 0:
        return torch.zeros(sum(p.numel() for p in model.parameters()), dtype=images.dtype), \
            torch.zeros((), dtype=images.dtype)
    loss = F.cross_entropy(model(images), labels, reduction="sum")
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads]).cpu(), loss.detach().cpu()


def members_mean_gradient(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                          global_batch: int, members: int, step: int,
                          seed: int) -> torch.Tensor:
    """Global batch `step`'s mean gradient (flat) as `members` replicas make it, written out in
    one process: member i takes its cut of the batch (elastic.rank_indices), sums its
    per-sample gradients (gradient_sum), the sums are added (the allreduce) and divided by
    the global batch size, whatever the cut."""
    total = 0
    for member in range(members):
        samples = rank_indices(len(images), global_batch, members, member, step, seed)
        summed, _ = gradient_sum(model, images[samples], labels[samples])
        total = total + summed
    return total / global_batch


def share(n: int, global_batch: int, members: int, member: int, step: int,
          seed: int) -> list[int]:
    """Member `member`'s samples of global batch `step` among `members`: its cut
    (elastic.rank_indices); in a quorum of more members than samples, the first
    global_batch members take one each and the others none."""
    if member >= global_batch:
        return []
    return rank_indices(n, global_batch, min(members, global_batch), member, step, seed)


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """The learning rate of step (from 0): --lr, grown linearly over the --warmup first."""
    return args.lr * min(1.0, (step + 1) / args.warmup) if args.warmup else args.lr


class EventLog:
    """Each event as a line of JSON in path (appended, flushed at once: a process killed
    later keeps it), with the time, the pid, the replica id and any fields given."""

    def __init__(self, path: Path | None, replica_id: str, **fields: Any) -> None:
        self.file = open(path, "a") if path else None
        self.fields = {"pid": os.getpid(), "replica": replica_id, **fields}

    def __call__(self, event: str, **fields: Any) -> None:
        if self.file:
            self.file.write(json.dumps({"event": event, "time": time.time(), **self.fields,
                                        **fields}) + "\n")
            self.file.flush()


def read_checkpoint(path: Path | None, args: argparse.Namespace) -> dict[str, Any] | None:
    """The checkpoint at path written by the same run, or None if there is none."""
    if path is None or not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT:
        raise RuntimeError(f"{path} was not written by python -m dpcourse.train_ft "
                           f"(format {FORMAT}): nothing was loaded")
    resume.check_same_command(path, state["args"], run_of(args))
    return state


def write_checkpoint(path: Path, args: argparse.Namespace, state: dict[str, Any]) -> bool:
    """Write state to path atomically, unless path holds this step or a later one: checked
    and written under the path's writer lock, so that two writers cannot cross."""
    with resume.writer_lock(path):
        held = read_checkpoint(path, args)
        if held is not None and held["step"] >= state["step"]:
            return False
        resume.write_atomically(path, {"format": FORMAT, "args": run_of(args), **state})
    return True


class Watchdog:
    """Ends the process (exit code 3, saying why) if pet() is not called for seconds."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.last, self.stopped = seconds, time.monotonic(), threading.Event()
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def pet(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while not self.stopped.wait(1.0):
            if time.monotonic() - self.last > self.seconds:
                print(f"watchdog: no step attempt ended in {self.seconds:g} s: giving up",
                      flush=True)
                exit_without_shutdown(3)


class Steps:
    """The step loop of one replica: quorum, group, recovery, gradients, allreduce, vote,
    commit or abort. at(phase, step) is called at each named point (tests inject failures
    there): "quorum", "serve" (between two chunks of a recovery it serves), "forward",
    "allreduce" (once it is under way), "vote"."""

    def __init__(self, args: argparse.Namespace, replica: Replica, membership: Membership,
                 data: tuple[torch.Tensor, torch.Tensor], log: EventLog, at: Phase) -> None:
        self.args, self.replica, self.membership = args, replica, membership
        self.log, self.at, (self.images, self.labels) = log, at, data
        self.group, self.group_id, self.aborted, self.samples = None, 0, [], None
        self.quorum_s = 0.0  # how long the last quorum took to come
        rules = membership.rules  # the lighthouse's: a quorum may wait for all of these
        least = 2 * args.timeout + rules.heartbeat_timeout + rules.join_timeout
        if args.quorum_timeout <= least:
            raise ValueError(f"--quorum-timeout {args.quorum_timeout:g} must exceed twice "
                             f"--timeout plus the lighthouse's heartbeat and join timeouts "
                             f"({least:g} s): a quorum may wait for all of them")
        self.watchdog = Watchdog(args.quorum_timeout + 6 * args.timeout + 30)

    def run(self) -> None:
        """Step until --steps are committed (the watchdog stops with the loop)."""
        try:
            self._run()
        finally:
            self.watchdog.stopped.set()

    def _run(self) -> None:
        replica, args = self.replica, self.args
        bar = tqdm(total=args.steps, initial=replica.step, desc=self.membership.replica_id,
                   mininterval=1.0)
        while replica.step < args.steps:
            step, asked = replica.step, time.perf_counter()
            self.at("quorum", step)
            quorum = self.membership.ask(step, replica.qid, bool(self.aborted),
                                         args.quorum_timeout, self.waiting)
            self.quorum_s = time.perf_counter() - asked
            if quorum.max_step < quorum.seen and self.reload(quorum):
                continue
            silences = self.membership.silences
            summed = self.attempt(quorum)
            self.at("vote", replica.step)
            commit = self.membership.call("voting", lambda: vote(
                self.membership.store, quorum.id, replica.step, quorum.size, summed is not None,
                args.timeout))
            self.log("decision", qid=quorum.id, step=replica.step, size=quorum.size,
                     samples=self.samples, decision=self.decision(commit, quorum, silences),
                     loss=summed[-1].item() / args.global_batch_size if commit else None)
            if commit:
                replica.commit(summed[:-1], quorum.id)
                self.committed(quorum)
                bar.update(replica.step - bar.n)
                bar.set_postfix(quorum=str(quorum.id), members=quorum.size, refresh=False)
            else:
                self.abort(quorum)
            self.watchdog.pet()
        bar.close()

    def waiting(self, why: str) -> None:
        tqdm.write(f"{self.membership.replica_id}: waiting for a quorum: {why}")

    def decision(self, commit: bool, quorum: Quorum, silences: int) -> str:
        """What the vote decided: "commit" or "abort"; "unknown" for an abort read after a
        silence long enough for the lighthouse to forget this replica (a process stopped):
        it may have deleted the vote, which the others committed. The step is not committed
        here either way, and the replica heals at its next quorum."""
        if commit:
            return "commit"
        if self.membership.silent_since(silences):
            self.membership.call("forgetting a lost vote", lambda: forget_vote(
                self.membership.store, quorum.id, self.replica.step))
            return "unknown"
        return "abort"

    def attempt(self, quorum: Quorum) -> torch.Tensor | None:
        """This member's part of the step in quorum: the members' gradient sums (and loss sum,
        last) after the allreduce, or None if anything failed (the gloo error is logged)."""
        replica, args = self.replica, self.args
        rank, self.samples = quorum.members.index(self.membership.replica_id), None
        try:
            if self.group_id != quorum.id:
                self.group = None  # the old group's threads end with its last reference
                self.group = quorum_group(self.membership.store, quorum, rank, args.timeout)
                self.group_id = quorum.id
            self.recover(quorum, rank)
            samples = share(len(self.images), args.global_batch_size, quorum.size, rank,
                            replica.step, args.seed)
            self.log("attempt", qid=quorum.id, step=replica.step, samples=samples,
                     quorum_s=self.quorum_s)
            self.samples = samples  # the decision's log line names them too
            self.at("forward", replica.step)
            grads, loss = gradient_sum(replica.model, self.images[samples].to(replica.device),
                                       self.labels[samples].to(replica.device))
            summed = torch.cat([grads, loss.reshape(1)])  # the loss rides along, for the log
            work = self.group.allreduce([summed])
            self.at("allreduce", replica.step)
            work.wait()
            return summed
        except RuntimeError as error:
            self.log("failed", qid=quorum.id, step=replica.step,
                     error=str(error).splitlines()[0][:300])
            return None

    def recover(self, quorum: Quorum, rank: int) -> None:
        """Copy the state from this member's source if it is behind; send it to each member
        behind that copies from this one."""
        replica, step = self.replica, self.replica.step
        plan = recovery_plan(quorum.steps, quorum.qids)
        if rank in plan:
            source = quorum.members[plan[rank]]
            tqdm.write(f"{self.membership.replica_id}: healing from {source} (step {step} -> "
                       f"{quorum.max_step})")
            state, _ = receive_state(self.group, plan[rank])
            replica.load(state)
            self.log("heal", qid=quorum.id, step=replica.step, source=source,
                     digest=digest(replica.state()))
        for member in [m for m, source in plan.items() if source == rank]:
            sha = send_state(self.group, replica.state(), member, lambda: self.at("serve", step))
            self.log("serve", qid=quorum.id, step=step, to=quorum.members[member], digest=sha)

    def committed(self, quorum: Quorum) -> None:
        """After a commit: the quorum's first member deletes the vote before this one, and
        writes the checkpoint when one is due; a write that fails is logged, and training
        goes on (the live replicas hold the state)."""
        replica, args = self.replica, self.args
        self.aborted = []
        if args.digest_steps:
            self.log("committed", qid=quorum.id, step=replica.step, digest=digest(replica.state()))
        if quorum.members[0] != self.membership.replica_id:
            return
        if replica.step >= 2:
            self.membership.call("deleting a vote", lambda: forget_vote(
                self.membership.store, quorum.id, replica.step - 2))
        if args.checkpoint and (replica.step % args.checkpoint_every == 0
                                or replica.step == args.steps):
            try:
                if write_checkpoint(args.checkpoint, args, replica.state()):
                    self.log("checkpoint", step=replica.step, qid=replica.qid)
            except OSError as error:
                self.log("checkpoint failed", step=replica.step, path=str(args.checkpoint),
                         error=str(error))
                tqdm.write(f"{self.membership.replica_id}: checkpoint at step {replica.step} "
                           f"failed ({error}); training goes on")

    def abort(self, quorum: Quorum) -> None:
        """The step is redone under the next quorum; after --max-aborts attempts, give up."""
        self.aborted.append(quorum.id)
        self.group = None  # a group whose collective failed is not used again
        tqdm.write(f"{self.membership.replica_id}: step {self.replica.step} aborted in quorum "
                   f"{quorum.id} (attempt {len(self.aborted)} of {self.args.max_aborts})")
        if len(self.aborted) >= self.args.max_aborts:
            raise RuntimeError(
                f"step {self.replica.step} aborted {len(self.aborted)} times, in quorums "
                f"{self.aborted}: a member slower than --timeout {self.args.timeout:g} s (or "
                "failing each time) would stall the run forever; giving up")

    def reload(self, quorum: Quorum) -> bool:
        """Whether the checkpoint, newer than this replica's state, was loaded: the quorum is
        behind steps that replicas now gone committed (a replica back from a long pause)."""
        saved = read_checkpoint(self.args.checkpoint, self.args)
        if saved is None or saved["step"] <= self.replica.step:
            return False
        self.replica.load(saved)
        self.log("reload", step=self.replica.step, qid=self.replica.qid, seen=quorum.seen)
        return True


def training_device(choice: str) -> torch.device:
    """cpu, or cuda:LOCAL_RANK (torchrun's, else 0); auto: cuda if this host has a GPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no GPU here")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if choice == "cuda" \
        else torch.device("cpu")


def train(args: argparse.Namespace, at: Phase = lambda phase, step: None) -> Replica:
    """Train as one replica until --steps are committed; return the replica. A replica that
    asks after the run has ended (every step committed) stops at once, with what it has.
    Under torchrun with several processes, they train as one replica group (chapter 14)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from .ft_groups import train_group  # noqa: PLC0415 - ft_groups builds on this module
        return train_group(args, at)
    args = argparse.Namespace(**{**vars(args), "data": resolve_source(args.data)})  # once
    if args.checkpoint:
        resume.check_writable(args.checkpoint)
    device = training_device(args.device)
    images, labels = fashion_mnist("train", args.train_size, args.data).tensors
    replica = Replica(args, device)
    replica_id = f"{args.name}-{uuid.uuid4().hex[:6]}"  # fresh at each start
    log = EventLog(args.events, replica_id)
    saved = read_checkpoint(args.checkpoint, args)
    if saved is not None:
        replica.load(saved)
    log("start", step=replica.step, qid=replica.qid, checkpoint=saved is not None)
    if replica.step < args.steps:
        membership = Membership(args.lighthouse, replica_id)
        try:
            membership.join_run(run_of(args))
            Steps(args, replica, membership, (images.to(getattr(torch, args.dtype)), labels),
                  log, at).run()
        except RunEnded as ended:
            print(f"{replica_id}: {ended}, before this replica took part: nothing to train",
                  flush=True)
            log("late", step=replica.step, ended=ended.step)
            membership.leave(replica.step)
            return replica
        else:
            membership.leave(replica.step)
        finally:
            membership.close()
    log("end", step=replica.step, qid=replica.qid, digest=digest(replica.state()))
    return replica


def main(argv: list[str] | None = None, at: Phase = lambda phase, step: None) -> None:
    args = parse_args(argv)
    replica = train(args, at)
    if replica.step == args.steps:
        print(f"Done: {replica.step} steps committed; state digest "
              f"{digest(replica.state())[:16]}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - reported here, then a plain non-zero exit
        traceback.print_exc()
        exit_without_shutdown(1)
    exit_without_shutdown(0)
