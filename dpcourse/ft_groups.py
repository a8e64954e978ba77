"""Chapter 14: fault-tolerant HSDP. Under ``torchrun --nproc_per_node=g``, ``train_ft`` runs a
replica group of g ranks as one member of chapter 13's quorum:

    torchrun --standalone --nproc_per_node=2 --max-restarts=3 -m dpcourse.train_ft \\
        --lighthouse HOST:29510 --global-batch-size 64 --steps 500

Inside the group, ScratchFSDP shards the model over its g ranks (chapter 10, over torchrun's
gloo group). Group rank 0 heartbeats and asks the lighthouse for the quorum of groups, and
tells its ranks. Across the quorum's groups, the ranks holding shard r form a gloo group of
their own per quorum id: each reduce-scattered gradient sum is allreduced there and divided
by G (``CrossGroups``). Each group votes once every one of its ranks is ready; the step commits on every
rank of every member group or on none. A group behind heals shard by shard: its rank r copies shard r's state from rank r of an
up-to-date group. A rank that dies or stalls breaks its group's collectives: the group's ranks
exit and torchrun starts the whole group again, as a scheduler restarts a group.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from . import resume
from .data import fashion_mnist, resolve_source
from .elastic import redivided_optimizer, reshard
from .fsdp import ScratchFSDP
from .launch import exit_without_shutdown
from .quorum import Membership, Quorum, RunEnded, connect, forget_vote, vote
from .recovery import RecoveryError, digest, receive_state, recovery_plan, send_state
from .train_ddp import build_model
from .train_ft import (EventLog, Phase, Watchdog, learning_rate, run_of, share,
                       training_device)

FORMAT = "dpcourse.train_ft/groups-1"
DECISIONS = ("commit", "abort", "unknown")
INSIDE = 3  # a collective inside the group waits INSIDE x --timeout: a rank may wait there
# while a collective across groups (--timeout) fails, or the vote (--timeout) is decided


def group_share(n: int, global_batch: int, groups: int, group: int, size: int, rank: int,
                step: int, seed: int) -> list[int]:
    """Rank `rank` of `size` in group `group` of `groups`: its group's cut of global batch
    `step` (train_ft.share, chapter 13's cut among members), cut again the same way among
    the group's ranks: positions floor(rank m / size) up to floor((rank + 1) m / size) of
    the group's m samples."""
    mine = share(n, global_batch, groups, group, step, seed)
    return mine[rank * len(mine) // size:(rank + 1) * len(mine) // size]


def shard_gradients(sums: list[list[torch.Tensor]], global_batch: int) -> list[list[torch.Tensor]]:
    """The gradient path, written out in one process: sums[i][r] is the flat gradient sum of
    rank r of group i over its samples (every one the same length, a multiple of the group
    size g). Each group's sums are reduce-scattered (rank r: the sum of shard r, the r-th of g
    chunks), shard r's sums allreduced across the groups, and divided by G: rank r of every
    group gets shard r of the global batch's mean gradient."""
    size = len(sums[0])
    scattered = [[sum(s.chunk(size)[r] for s in group) for r in range(size)] for group in sums]
    across = [sum(group[r] for group in scattered) for r in range(size)]
    return [[shard / global_batch for shard in across] for _ in sums]


def shard_sources(steps: list[int], qids: list[int], shard: int) -> dict[int, int]:
    """Shard-wise recovery of one shard: for each group behind (by place in the quorum, its
    version (steps[i], qids[i]) not the largest), the place of the up-to-date group whose rank
    `shard` sends it that shard. Chapter 13's plan (the up-to-date groups in turn), moved
    `shard` places along: the shards of one group come from several groups."""
    plan = recovery_plan(steps, qids)
    current = [i for i in range(len(steps)) if i not in plan]
    return {behind: current[(current.index(source) + shard) % len(current)]
            for behind, source in plan.items()}


class GroupBroken(RuntimeError):
    """A collective inside this group failed: a rank of it died or stalled. The group's ranks
    exit, and torchrun starts the group again."""


class CrossGroups:
    """ScratchFSDP's replicate step across the quorum's groups: a reduce-scattered shard sum
    allreduced with the ranks holding the same shard in the other groups, then scaled by
    g / G (the wrapper divides by g after: the sum over the global batch divided by G). A
    failure is kept in ``error`` (the step aborts), never raised inside backward; later
    units then skip the allreduce. started() is called once the first one is under way."""

    def __init__(self, group: dist.ProcessGroup, group_size: int, global_batch: int,
                 started: Callable[[], None] = lambda: None) -> None:
        self.group, self.group_size, self.global_batch = group, group_size, global_batch
        self.started, self.error, self.bytes_handed = started, None, 0

    def __call__(self, shard_sum: torch.Tensor) -> torch.Tensor:
        if self.error is None:
            try:
                on_cpu = shard_sum.cpu()  # gloo sums CPU copies (the same tensor on a CPU)
                work = self.group.allreduce([on_cpu])
                self.started, started = (lambda: None), self.started
                started()
                work.wait()
                shard_sum.copy_(on_cpu)
                self.bytes_handed += shard_sum.numel() * shard_sum.element_size()
            except RuntimeError as error:
                self.error = error
        return shard_sum.mul_(self.group_size).div_(self.global_batch)


class GroupRank:
    """One rank's training state: its shards of the model (ScratchFSDP over the group), their
    SGD state, and the version (step: steps committed; qid: the quorum of the last commit)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.step, self.qid = args, 0, 0
        model = build_model(args.model, args.seed, device, layers=True,
                            dtype=getattr(torch, args.dtype))
        self.fsdp = ScratchFSDP(model)
        self.opt = torch.optim.SGD(self.fsdp.shards, lr=args.lr, momentum=args.momentum)

    def state(self) -> dict[str, Any]:
        """This rank's shards, their optimizer state and the version, on the CPU."""
        return resume.to_cpu({"shards": list(self.fsdp.shards),
                              "optimizer": self.opt.state_dict(),
                              "step": self.step, "qid": self.qid})

    @torch.no_grad()
    def load(self, state: dict[str, Any]) -> None:
        for shard, saved in zip(self.fsdp.shards, state["shards"]):
            shard.copy_(saved)
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.qid = state["step"], state["qid"]

    def commit(self, qid: int) -> None:
        """The optimizer step on the shards' gradients at the step's learning rate, and the
        version moved on: together."""
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(self.args, self.step)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step, self.qid = self.step + 1, qid


def agree(*flags: bool) -> tuple[bool, ...]:
    """Whether each flag holds on every rank of this group (one allreduce); GroupBroken if
    the group's collective fails."""
    held = torch.tensor(flags, dtype=torch.int32)
    try:
        dist.all_reduce(held, op=dist.ReduceOp.MIN)
    except RuntimeError as error:
        raise GroupBroken(f"a collective inside the group failed: {error}") from None
    return tuple(bool(h) for h in held)


def shard_files(path: Path, step: int, size: int) -> list[Path]:
    """The files of a sharded checkpoint of step written by a group of size ranks."""
    return [path.with_name(f"{path.name}.step{step}.rank{r}-of-{size}") for r in range(size)]


def write_sharded(path: Path, args: argparse.Namespace, state: GroupRank) -> bool:
    """Each rank writes its shard file; once every one is on disk, rank 0 writes the manifest
    at path (the set committed as a whole), unless path holds this step or a later one, and
    deletes the shard files older than the manifest it replaced. Whether it was written."""
    rank, size, step = dist.get_rank(), dist.get_world_size(), state.step
    written = True
    try:
        resume.write_atomically(shard_files(path, step, size)[rank], {"format": FORMAT,
                                                                      **state.state()})
    except OSError as error:
        written = False
        tqdm.write(f"rank {rank}: checkpoint shard at step {step} failed ({error})")
    (written,) = agree(written)
    if rank != 0 or not written:
        return written
    with resume.writer_lock(path):
        held = read_manifest(path, args)
        if held is not None and held["step"] >= step:
            return False
        resume.write_atomically(path, {"format": FORMAT, "args": run_of(args), "step": step,
                                       "qid": state.qid, "group_size": size})
    keep = {*shard_files(path, step, size), *(shard_files(path, held["step"],
                                                          held["group_size"]) if held else [])}
    for old in path.parent.glob(f"{path.name}.step*.rank*-of-*"):
        if old not in keep:
            old.unlink(missing_ok=True)
    return True


def read_manifest(path: Path | None, args: argparse.Namespace) -> dict[str, Any] | None:
    """The manifest of the sharded checkpoint at path written by the same run, or None."""
    if path is None or not path.exists():
        return None
    manifest = torch.load(path, map_location="cpu", weights_only=True)
    if manifest.get("format") != FORMAT:
        raise RuntimeError(f"{path} is not a sharded checkpoint of python -m dpcourse.train_ft "
                           f"under torchrun (format {FORMAT}): nothing was loaded")
    resume.check_same_command(path, manifest["args"], run_of(args))
    return manifest


def read_sharded(path: Path | None, args: argparse.Namespace,
                 numels: list[int]) -> dict[str, Any] | None:
    """This rank's state from the sharded checkpoint at path, whatever group size wrote it
    (numels: each unit's elements; the shards and their optimizer state re-cut), or None."""
    manifest = read_manifest(path, args)
    if manifest is None:
        return None
    held = [torch.load(f, map_location="cpu", weights_only=True)
            for f in shard_files(path, manifest["step"], manifest["group_size"])]
    rank, size = dist.get_rank(), dist.get_world_size()
    return {"shards": [reshard([h["shards"][i] for h in held], numel, size)[rank]
                       for i, numel in enumerate(numels)],
            "optimizer": redivided_optimizer([h["optimizer"] for h in held], numels, rank, size),
            "step": manifest["step"], "qid": manifest["qid"]}


class GroupSteps:
    """The step loop of one rank of a group: the quorum (asked by rank 0, told to all), the
    cross-group gloo group of this rank's shard, shard-wise recovery, forward and backward
    (reduce-scatter inside, allreduce across), and the group's vote once all its ranks are
    ready, its decision told to every rank. at(phase, step) is called at each named point:
    "quorum", "serve", "forward", "reduce-scatter" (as backward starts), "allreduce" (the
    first across groups under way), "vote"."""

    def __init__(self, args: argparse.Namespace, state: GroupRank, group_id: str,
                 membership: Membership | None, data: tuple[torch.Tensor, torch.Tensor],
                 log: EventLog, at: Phase) -> None:
        self.args, self.state, self.group_id, self.membership = args, state, group_id, membership
        self.log, self.at, (self.images, self.labels) = log, at, data
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.store = connect(args.lighthouse, 30.0)  # the cross groups' and the votes'
        self.patient = dist.new_group(backend="gloo", timeout=timedelta(
            seconds=args.quorum_timeout + 4 * args.timeout))  # rank 0 may wait that long
        self.cross, self.cross_id, self.aborted, self.samples = None, 0, [], None
        self.quorum_s = 0.0
        self.watchdog = Watchdog(args.quorum_timeout + 6 * args.timeout + 30)

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.watchdog.stopped.set()

    def _run(self) -> None:
        state, args = self.state, self.args
        bar = tqdm(total=args.steps, initial=state.step, desc=self.group_id, mininterval=1.0,
                   disable=self.rank != 0)
        while state.step < args.steps:
            self.at("quorum", state.step)
            quorum = self.next_quorum()
            if quorum.max_step < quorum.seen and self.reload(quorum):
                continue
            silences = self.membership.silences if self.membership else 0
            ready = self.attempt(quorum) and self.still_ready(quorum)
            decision = self.decide(quorum, agree(ready)[0], silences)
            self.log("decision", qid=quorum.id, step=state.step, size=quorum.size,
                     samples=self.samples, decision=decision, ready=ready,
                     loss_sum=self.loss_sum, bytes_across=self.bytes_across)
            if decision == "commit":
                state.commit(quorum.id)
                self.committed(quorum)
                bar.update(state.step - bar.n)
            else:
                self.abort(quorum)
            self.watchdog.pet()
        bar.close()

    def still_ready(self, quorum: Quorum) -> bool:
        """Whether nothing failed on this rank between its allreduce and the vote (at
        "vote": a failure there is this rank's alone; the others' collectives have ended)."""
        try:
            self.at("vote", self.state.step)
        except RuntimeError as error:
            self.log("failed", qid=quorum.id, step=self.state.step,
                     error=str(error).splitlines()[0][:300])
            return False
        return True

    def decide(self, quorum: Quorum, ready: bool, silences: int) -> str:
        """The group's vote, rank 0's (ready: every rank of the group is), and the decision
        told to every rank: "commit", "abort", or "unknown" (rank 0 was silent long enough to
        be forgotten: the vote may be deleted; the step is not committed, the group heals)."""
        told = torch.zeros(1, dtype=torch.int32)
        if self.membership is not None:
            commit = self.membership.call("voting", lambda: vote(
                self.store, quorum.id, self.state.step, quorum.size, ready, self.args.timeout))
            silent = self.membership.silent_since(silences)
            if silent and not commit:
                forget_vote(self.store, quorum.id, self.state.step)
            told[0] = DECISIONS.index("commit" if commit else "unknown" if silent else "abort")
        try:
            dist.broadcast(told, src=0)
        except RuntimeError as error:
            raise GroupBroken(f"group rank 0 did not tell the decision: {error}") from None
        return DECISIONS[told.item()]

    def next_quorum(self) -> Quorum:
        """The next quorum: rank 0 asks the lighthouse for its group and tells its ranks
        (RunEnded, or rank 0's error, raised on every rank)."""
        asked, answer = time.perf_counter(), [None]
        if self.membership is not None:
            try:
                quorum = self.membership.ask(self.state.step, self.state.qid,
                                             bool(self.aborted), self.args.quorum_timeout,
                                             lambda why: tqdm.write(f"{self.group_id}: "
                                                                    f"waiting: {why}"),
                                             shards=self.size)
                answer = [{"quorum": vars(quorum)}]
            except RunEnded as ended:
                answer = [{"ended": ended.step}]
            except Exception as error:  # noqa: BLE001 - told to the group, then raised
                answer = [{"error": f"{type(error).__name__}: {error}"}]
        try:
            dist.broadcast_object_list(answer, src=0, group=self.patient)
        except RuntimeError as error:
            raise GroupBroken(f"group rank 0 did not tell the quorum: {error}") from None
        self.quorum_s = time.perf_counter() - asked
        if "error" in answer[0]:
            raise RuntimeError(f"group rank 0 got no quorum: {answer[0]['error']}")
        if "ended" in answer[0]:
            raise RunEnded(answer[0]["ended"])
        return Quorum(**answer[0]["quorum"])

    def attempt(self, quorum: Quorum) -> bool:
        """This rank's part of the step: whether it is ready to commit (a failure across
        groups is logged; one inside the group raises GroupBroken)."""
        state, args, step = self.state, self.args, self.state.step
        place, healed, ready = quorum.members.index(self.group_id), None, True
        self.samples, self.loss_sum, self.bytes_across = None, None, 0
        try:
            if self.cross_id != quorum.id:
                self.cross = None  # the old group's threads end with its last reference
                self.cross = dist.ProcessGroupGloo(dist.PrefixStore(
                    f"lh/group/{quorum.id}/shard/{self.rank}", self.store), place,
                    quorum.size, timedelta(seconds=args.timeout))
                self.cross_id = quorum.id
            healed = self.heal(quorum, place)
        except RuntimeError as error:
            ready = False
            self.log("failed", qid=quorum.id, step=step, error=str(error).splitlines()[0][:300])
        if not agree(ready)[0]:  # a shard that did not arrive is used by no rank
            return False
        if healed is not None:
            state.load(healed)
            self.log("heal", qid=quorum.id, step=state.step, source=healed["source"],
                     seconds=healed["seconds"], digest=digest(state.state()))
        self.samples = group_share(len(self.images), args.global_batch_size, quorum.size,
                                   place, self.size, self.rank, state.step, args.seed)
        self.log("attempt", qid=quorum.id, step=state.step, samples=self.samples,
                 quorum_s=self.quorum_s)
        self.at("forward", state.step)
        across = CrossGroups(self.cross, self.size, args.global_batch_size,
                             lambda: self.at("allreduce", state.step))
        state.fsdp.replicate = across
        try:
            out = state.fsdp(self.images[self.samples])
            loss = F.cross_entropy(out, self.labels[self.samples], reduction="sum")
            self.at("reduce-scatter", state.step)
            loss.backward()
        except RuntimeError as error:
            raise GroupBroken(f"a collective inside the group failed: {error}") from None
        self.loss_sum, self.bytes_across = loss.item(), across.bytes_handed
        if across.error is not None:
            self.log("failed", qid=quorum.id, step=state.step,
                     error=str(across.error).splitlines()[0][:300])
        return across.error is None

    def heal(self, quorum: Quorum, place: int) -> dict[str, Any] | None:
        """Shard-wise recovery: this rank's shard state from rank r of its source group if
        its group is behind (checked by its digest; loaded once every rank has its own), and
        sent to each group behind that copies from this one."""
        plan, step = shard_sources(quorum.steps, quorum.qids, self.rank), self.state.step
        received, started = None, time.perf_counter()
        if place in plan:
            received, _ = receive_state(self.cross, plan[place])
            if received["step"] != quorum.max_step or len(received["shards"]) != \
                    len(self.state.fsdp.shards):
                raise RecoveryError(f"shard {self.rank} from {quorum.members[plan[place]]} is "
                                    f"not the quorum's state: discarded")
            received["source"] = quorum.members[plan[place]]
            received["seconds"] = time.perf_counter() - started
        for member in [m for m, source in plan.items() if source == place]:
            sha = send_state(self.cross, self.state.state(), member,
                             lambda: self.at("serve", step))
            self.log("serve", qid=quorum.id, step=step, to=quorum.members[member], digest=sha)
        return received

    def committed(self, quorum: Quorum) -> None:
        """After a commit: the quorum's first group deletes an old vote and writes the
        sharded checkpoint when one is due."""
        state, args = self.state, self.args
        self.aborted = []
        if args.digest_steps:
            self.log("committed", qid=quorum.id, step=state.step, digest=digest(state.state()))
        if quorum.members[0] != self.group_id:
            return
        if self.rank == 0 and state.step >= 2:
            forget_vote(self.store, quorum.id, state.step - 2)
        if args.checkpoint and (state.step % args.checkpoint_every == 0
                                or state.step == args.steps):
            if write_sharded(args.checkpoint, args, state) and self.rank == 0:
                self.log("checkpoint", step=state.step, qid=state.qid)

    def abort(self, quorum: Quorum) -> None:
        """The step is redone under the next quorum; after --max-aborts attempts, give up."""
        self.aborted.append(quorum.id)
        self.cross = None  # a group whose collective failed is not used again
        self.state.opt.zero_grad(set_to_none=True)
        if self.rank == 0:
            tqdm.write(f"{self.group_id}: step {self.state.step} aborted in quorum {quorum.id} "
                       f"(attempt {len(self.aborted)} of {self.args.max_aborts})")
        if len(self.aborted) >= self.args.max_aborts:
            raise RuntimeError(f"step {self.state.step} aborted {len(self.aborted)} times, in "
                               f"quorums {self.aborted}: giving up")

    def reload(self, quorum: Quorum) -> bool:
        """Whether the sharded checkpoint, newer than this group's state, was loaded (the
        quorum is behind steps that groups now gone committed)."""
        saved = read_sharded(self.args.checkpoint, self.args,
                             [unit.numel for unit in self.state.fsdp.units])
        if saved is None or saved["step"] <= self.state.step:
            return False
        self.state.load(saved)
        self.log("reload", step=self.state.step, qid=self.state.qid, seen=quorum.seen)
        return True


def train_group(args: argparse.Namespace, at: Phase = lambda phase, step: None) -> GroupRank:
    """Train as one rank of a group of torchrun's WORLD_SIZE ranks until --steps are
    committed; return its state. A collective inside the group that fails ends the process
    (exit code 1): torchrun starts the whole group again."""
    args = argparse.Namespace(**{**vars(args), "data": resolve_source(args.data)})
    device, ranks = training_device(args.device), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device.type == "cuda" and torch.cuda.device_count() < ranks:  # a GPU each, or none
        if args.device == "cuda":
            raise ValueError(f"--device cuda: {ranks} ranks on this host and "
                             f"{torch.cuda.device_count()} GPU(s); each rank needs its own")
        print(f"{torch.cuda.device_count()} GPU(s) for {ranks} ranks here: training on the CPU",
              flush=True)
        device = torch.device("cpu")
    where = resume.join_arguments(timedelta(seconds=args.quorum_timeout))  # this round's own
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=INSIDE * args.timeout), **where)
    rank = dist.get_rank()
    images, labels = fashion_mnist("train", args.train_size, args.data).tensors
    state = GroupRank(args, device)
    named = [f"{args.name}-{uuid.uuid4().hex[:6]}"]  # rank 0's, fresh at each start
    dist.broadcast_object_list(named, src=0)
    group_id = named[0]
    log = EventLog(args.events, group_id, rank=rank)
    saved = read_sharded(args.checkpoint, args, [unit.numel for unit in state.fsdp.units])
    if saved is not None:
        state.load(saved)
    log("start", step=state.step, qid=state.qid, checkpoint=saved is not None)
    membership, finished = None, False
    try:
        if rank == 0:
            membership = Membership(args.lighthouse, group_id)
            membership.join_run({**run_of(args), "group_size": dist.get_world_size()})
        GroupSteps(args, state, group_id, membership,
                   (images.to(getattr(torch, args.dtype)).to(device), labels.to(device)),
                   log, at).run()
        finished = True
    except RunEnded as ended:
        log("late", step=state.step, ended=ended.step)
        finished = True
        return state
    except GroupBroken as broken:
        log("broken", step=state.step, error=str(broken).splitlines()[0][:300])
        tqdm.write(f"{group_id} rank {rank}: {broken}; torchrun starts the group again")
        exit_without_shutdown(1)
    finally:
        if membership is not None:
            membership.leave(state.step) if finished else membership.close()
    log("end", step=state.step, qid=state.qid, digest=digest(state.state()))
    return state
