"""Checkers for chapter 13's parts and exercises (training that never stops: the quorum rule,
the vote, the global batch under a changing membership, live recovery)."""
from __future__ import annotations

import math
import os
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from ..data import fashion_mnist
from ..elastic import rank_indices
from ..lenet import lenet_model
from ..lighthouse import Rules
from . import answered, is_number, one_line_failure

# --- part 1: the quorum rule ---

FAST, WAIT = Rules(min_replicas=3, join_timeout=0.5, heartbeat_timeout=1.0), Rules()
# (what the case shows, now, last beats, requests, previous members, rules, the quorum,
#  what a wrong answer has missed)
QUORUM_CASES = [
    ("every healthy replica asked", 1.0, {"a": 0.9, "b": 0.9}, {"b": 0.95, "a": 0.96}, None,
     WAIT, ["a", "b"], "the members are the healthy replicas that asked, sorted by id (every "
     "replica must see them in one order)"),
    ("every previous member asked again", 0.6, {r: 0.5 for r in "abcd"}, {"a": 0.55}, ["a"],
     FAST, ["a"], "a fast quorum: when every member of the last quorum asked again, they "
     "form the next one at once, skipping min_replicas, the majority and the join wait"),
    ("the previous members, and a newcomer", 0.6, {r: 0.5 for r in "abc"},
     {"a": 0.55, "c": 0.56}, ["a"], FAST, ["a", "c"], "a fast quorum takes every healthy "
     "replica that asked, not only the previous members"),
    ("a replica silent for the heartbeat timeout", 2.0, {"a": 1.9, "b": 0.5},
     {"a": 1.95, "b": 0.4}, ["a", "b"], WAIT, ["a"], "a replica whose last beat is "
     "heartbeat_timeout or more ago is dead: it neither counts as healthy nor joins, even if "
     "it asked before it died"),
    ("fewer than min_replicas", 1.0, {"a": 0.9}, {"a": 0.9}, None,
     Rules(min_replicas=2, join_timeout=0.0), None, "without a fast quorum, at least "
     "min_replicas must have asked"),
    ("2 of 4 healthy replicas asked", 5.0, {r: 4.9 for r in "abcd"}, {"a": 0.0, "b": 0.0},
     None, Rules(join_timeout=0.0, heartbeat_timeout=10.0), None, "more than half of the "
     "healthy replicas must ask (len(asking) > len(healthy) // 2): the other 2 could form a "
     "quorum of their own"),
    ("3 of 4 asked, within the join timeout", 0.3, {r: 0.25 for r in "abcd"},
     {"a": 0.0, "b": 0.0, "c": 0.1}, None, WAIT, None, "while a healthy replica has not "
     "asked, wait up to join_timeout from the first request"),
    ("3 of 4 asked, the join timeout over", 0.5, {r: 0.45 for r in "abcd"},
     {"a": 0.0, "b": 0.0, "c": 0.1}, None, WAIT, ["a", "b", "c"], "after join_timeout since "
     "the first request, the replicas that asked form the quorum"),
]


def check_quorum_members(quorum_members: Callable[..., tuple[list[str] | None, str]]) -> None:
    """Part 1: quorum_members(now, last_beat, asked, previous, rules) applies torchft's rules
    in order, on scripted heartbeats and requests."""
    one_line_failure("quorum_members", lambda: quorum_members(*QUORUM_CASES[0][1:6]))
    for what, now, beats, asked, previous, rules, want, hint in QUORUM_CASES:
        got = one_line_failure(what, lambda: quorum_members(
            now, dict(beats), dict(asked), previous and list(previous), rules))
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], str)):
            raise AssertionError(f"return (members or None, why) with why a string; got {got!r}")
        members = list(got[0]) if got[0] is not None else None
        if members != want:
            raise AssertionError(f"{what} (beats {beats}, requests {asked}, previous "
                                 f"{previous}, {rules}): got {members}, expected {want}: {hint}")
    print(f"correct: {len(QUORUM_CASES)} scripted cases, the rules in torchft's order")


# --- part 2: the vote ---

@contextmanager
def _quiet_c10d() -> Iterator[None]:
    """c10d's own warnings (a store's wait that timed out, on purpose) out of the notebook:
    file descriptor 2 points to /dev/null meanwhile."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _votes(vote: Callable[..., bool], ready: list[bool], wait: list[float],
           late: int | None = None) -> list[Any]:
    """Each member's vote (quorum 1, step 0) on a fresh store, one thread each; a `late`
    member votes only after the others have decided."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", master.port, is_master=False,
                             timeout=timedelta(seconds=20)) for _ in ready]
    results: list[Any] = [None] * len(ready)
    decided = threading.Event()

    def member(m: int) -> None:
        if m == late:
            decided.wait(20)
        try:
            results[m] = vote(clients[m], 1, 0, len(ready), ready[m], wait[m])
        except Exception as error:  # noqa: BLE001 - returned to the checker
            results[m] = error
        if m != late and sum(r is not None for r in results) == len(ready) - 1:
            decided.set()
    threads = [threading.Thread(target=member, args=(m,), daemon=True) for m in range(len(ready))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


VOTE_CASES = [  # (what, ready, wait, late member, the decision, what a wrong answer missed)
    ("all 3 members ready", [True] * 3, [5.0] * 3, None, True, "the member whose vote "
     "brings the count to size sets the decision \"commit\" (compare_set), and every member "
     "returns the decision it reads"),
    ("member 1 not ready (its allreduce failed)", [True, False, True], [5.0] * 3, None, False,
     "a member that is not ready sets the decision \"abort\" at once, and nobody commits"),
    ("member 2 votes after the others gave up waiting", [True] * 3, [0.3, 0.3, 5.0], 2, False,
     "act on the decision, never on your own count: the late vote completes the count, but "
     "the others already decided \"abort\" when their wait timed out (compare_set keeps the "
     "first decision)"),
]


def check_vote(vote: Callable[..., bool]) -> None:
    """Part 2: vote(store, quorum_id, step, size, ready, timeout) decides once for all."""
    alone = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    one_line_failure("vote (a quorum of one)", lambda: vote(alone, 1, 0, 1, True, 1.0))
    for what, ready, wait, late, want, hint in VOTE_CASES:
        with _quiet_c10d():
            got = _votes(vote, ready, wait, late)
        for result in got:
            if isinstance(result, (NotImplementedError, AssertionError)):
                raise result
            if isinstance(result, Exception) or result is None:
                raise AssertionError(f"{what}: a member's vote failed or did not return "
                                     f"({result!r}); wait for the decision with the timeout")
        if got != [want] * len(ready):
            raise AssertionError(f"{what}: the members returned {got}, expected all {want}: "
                                 f"{hint}")
    print("correct: one decision per (quorum, step); a member not ready or a late vote "
          "aborts the step on every member")


# --- part 3: the global batch under a changing membership ---

def _one_process_mean_gradient(model: torch.nn.Module, images: torch.Tensor,
                               labels: torch.Tensor, global_batch: int, step: int,
                               seed: int) -> torch.Tensor:
    """An independent reference: the global batch's mean loss, one backward."""
    batch = rank_indices(len(images), global_batch, 1, 0, step, seed)
    loss = F.cross_entropy(model(images[batch]), labels[batch])
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])


def _members_means(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                   global_batch: int, members: int, step: int, seed: int) -> torch.Tensor:
    """The slip: each member's mean gradient, averaged over the members (equal weights)."""
    means = [_one_process_mean_gradient(model, images[s], labels[s], len(s), 0, 0)
             for s in (rank_indices(len(images), global_batch, members, i, step, seed)
                       for i in range(members))]
    return sum(means) / members


def check_members_mean_gradient(members_mean_gradient: Callable[..., torch.Tensor]) -> None:
    """Part 3: members_mean_gradient(model, images, labels, G, q, step, seed) is the global
    batch's mean gradient for every q from 1 to 7, in float64 (rounding only)."""
    images, labels = fashion_mnist("train", 120, "synthetic").tensors
    images, model = images.double(), lenet_model(0).double()
    first = one_line_failure("members_mean_gradient", lambda: members_mean_gradient(
        model, images, labels, 30, 4, 5, 1))
    for members in range(1, 8):
        want = _one_process_mean_gradient(model, images, labels, 30, 5, 1)
        got = one_line_failure(f"{members} members", lambda: members_mean_gradient(
            model, images, labels, 30, members, 5, 1))
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise AssertionError(f"return one flat tensor of {want.numel()} gradients, got "
                                 f"{getattr(got, 'shape', type(got))}")
        gap = (got - want).abs().max().item()
        if gap > 1e-14:
            raise AssertionError(f"{members} members of G=30 (step 5): off by {gap:.1e}: "
                                 + _gradient_hint(got, want, members, 30, model, images,
                                                  labels))
    print(f"correct: the same mean gradient for 1 to 7 members of G=30, to 1e-14 "
          f"(4 members: |g| = {first.norm().item():.6f})")


def _gradient_hint(got: torch.Tensor, want: torch.Tensor, members: int, global_batch: int,
                   model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> str:
    if torch.allclose(got * members / global_batch, want, rtol=1e-10, atol=1e-14):
        return "divide the sum by G, the global batch size, not by the number of members q"
    means = _members_means(model, images, labels, global_batch, members, 5, 1)
    if torch.allclose(got, means, rtol=1e-10, atol=1e-14):
        return (f"the mean of the members' means weighs shares of different sizes equally "
                f"({global_batch} samples do not split evenly among {members}): add the "
                "members' sums, then divide by G")
    return ("member i sums the per-sample gradients of its cut (rank_indices(len(images), G, "
            "q, i, step, seed), gradient_sum); the sums are added, then divided by G")


# --- part 4: live recovery ---

PLAN_CASES = [  # (steps, qids, the plan, what a wrong answer missed)
    ([5, 5, 5], [2, 2, 2], {}, "members at the quorum's version copy nothing"),
    ([5, 0, 5], [2, 0, 2], {1: 0}, "a member behind copies from an up-to-date member (the "
     "largest version), never from one behind"),
    ([0, 5, 0, 0], [0, 2, 0, 0], {0: 1, 2: 1, 3: 1}, "every member behind copies, here from "
     "the only up-to-date member"),
    ([5, 0, 5, 3], [2, 0, 2, 1], {1: 0, 3: 2}, "several members behind spread over the "
     "up-to-date ones in turn: the j-th member behind copies from the (j mod n)-th"),
    ([5, 5], [2, 3], {0: 1}, "compare whole versions (step, then quorum id): the same step "
     "committed in another quorum is another history"),
]


def check_recovery_plan(recovery_plan: Callable[[list[int], list[int]], dict[int, int]]) -> None:
    """Part 4: recovery_plan(steps, qids) maps each member behind to its source."""
    one_line_failure("recovery_plan", lambda: recovery_plan([5, 0], [2, 0]))
    for steps, qids, want, hint in PLAN_CASES:
        got = one_line_failure(f"recovery_plan({steps}, {qids})",
                               lambda: recovery_plan(list(steps), list(qids)))
        if dict(got) != want:
            raise AssertionError(f"steps {steps}, quorum ids {qids}: got {dict(got)}, expected "
                                 f"{want}: {hint}")
    print("correct: the members behind copy from the up-to-date ones, spread in turn")


# --- exercises ---

FRACTION_CASES = [(1.0, 60.0), (11.7, 60.0), (0.5, 3_600.0), (30.0, 60.0)]  # (t, M) seconds


def simulated_fraction(step_s: float, mtbf_s: float, failures: int = 100_000,
                       seed: int = 0) -> float:
    """The fraction of attempts that commit when failures strike at random (exponential gaps of
    mean mtbf_s of training time), each aborting the attempt in flight."""
    gaps = np.random.default_rng(seed).exponential(mtbf_s, failures)
    committed = np.floor_divide(gaps, step_s).sum()
    return float(committed / (committed + failures))


def check_committed_fraction(committed_fraction: Callable[[float, float], float] | None) -> None:
    """Exercise 1: the fraction of step attempts that commit, exp(-t / M)."""
    if not answered(committed_fraction):
        return
    for step_s, mtbf_s in FRACTION_CASES:
        got, want = committed_fraction(step_s, mtbf_s), math.exp(-step_s / mtbf_s)
        if not is_number(got) or not math.isclose(got, want, rel_tol=1e-9):
            print(f"not quite: t = {step_s:g} s, M = {mtbf_s:g} s: {got!r}, a simulation of "
                  f"100,000 failures gives {simulated_fraction(step_s, mtbf_s):.4f}: an attempt "
                  "commits if no failure strikes during its t seconds; with failures at "
                  "random, M apart on average, that has probability exp(-t / M) (1 - t / M is "
                  "its first order only)")
            return
    separated = 20.0, 60.0  # where the first order, 1 - t / M, is off by 0.05
    print(f"correct: t = 20 s, M = 60 s: {math.exp(-1 / 3):.4f} of the attempts commit "
          f"(simulated: {simulated_fraction(*separated):.4f}; the first order 1 - t / M "
          f"would say {1 - 1 / 3:.4f})")


SHARD_CASES = [(10, 0, 2, 0, 1), (10, 1, 2, 0, 1), (11, 2, 3, 0, 1), (5, 3, 4, 0, 1),
               (7, 1, 2, 1, 2), (13, 1, 3, 1, 2), (12, 0, 2, 2, 3)]
# (dataset size, replica_rank, num_replica_groups, group_rank, group_size)


def shuffled(size: int, seed: int = 0) -> list[int]:
    """The order torch's DistributedSampler shuffles range(size) into, at epoch 0."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()


def torch_shard(order: list[int], rank: int, world: int) -> list[int]:
    """Rank's indices of order as torch's DistributedSampler (not shuffling again) takes them."""
    return [order[i] for i in DistributedSampler(range(len(order)), num_replicas=world,
                                                 rank=rank, shuffle=False)]


def shard_mistake(got: Any, order: list[int], case: tuple) -> str:
    """What a wrong shard most likely missed."""
    _, replica_rank, groups, group_rank, group_size = case
    world, rank = group_size * groups, group_rank + group_size * replica_rank
    per = -(-len(order) // world)
    padded = (order * world)[:per * world]
    if got == padded[rank * per:(rank + 1) * per]:
        return ("a contiguous block: torch's sampler deals the order round-robin, every "
                "world-th index from the rank's own")
    if got == torch_shard(order, replica_rank + groups * group_rank, world):
        return ("the ranks interleave the groups: rank = group_rank + group_size * "
                "replica_rank, so the ranks of one group are consecutive")
    if got == torch_shard(order, replica_rank, groups):
        return ("the world is every rank of every group, group_size * num_replica_groups "
                "(torchft's num_replicas is the size of one group)")
    if got == order[rank::world]:
        return ("the order is padded with its own first indices to a multiple of the world "
                "(drop_last=False), so that every rank takes as many")
    return ("torch's DistributedSampler over group_size * num_replica_groups ranks, rank "
            "group_rank + group_size * replica_rank")


def _shard_of(torchft_shard: Callable[..., Any], *args: Any) -> list[int] | str:
    """torchft_shard(*args) as a list of ints, or one line saying why it is none."""
    try:
        return [int(i) for i in torchft_shard(*args)]
    except Exception as error:  # noqa: BLE001 - the student's code: told in one line
        return (f"torchft_shard{args[1:]} raised {type(error).__name__}: "
                f"{str(error).splitlines()[0][:150] if str(error) else ''} (return a list "
                "of ints)")


def check_torchft_shard(torchft_shard: Callable[..., list[int]] | None,
                        events: list[dict] | None = None, names: list[str] | None = None,
                        train_size: int = 0, batch_size: int = 0, seed: int = 0) -> None:
    """Exercise 2: the indices a rank of a replica group takes under torchft's
    DistributedSampler, against torch's sampler; with a torchft run's events, against every
    batch its groups (one rank each) trained, in order, from their loaders' start."""
    if not answered(torchft_shard):
        return
    for case in SHARD_CASES:
        size, replica_rank, groups, group_rank, group_size = case
        order = shuffled(size, sum(case))
        want = torch_shard(order, group_rank + group_size * replica_rank, group_size * groups)
        got = _shard_of(torchft_shard, list(order), replica_rank, groups, group_rank,
                        group_size)
        if isinstance(got, str):
            print(f"not quite: {got}")
            return
        if got != want:
            print(f"not quite: {size} samples, replica_rank={replica_rank} of "
                  f"{groups} groups, group_rank={group_rank} of {group_size}: {got!r}, want "
                  f"{want}: {shard_mistake(got, order, case)}")
            return
    attempts = [e for e in events or [] if e["event"] == "attempt"]
    for e in attempts:
        shard = _shard_of(torchft_shard, shuffled(train_size, seed), names.index(e["name"]),
                          len(names), 0, 1)
        batches = [shard[i:i + batch_size] for i in range(0, len(shard), batch_size)]
        if e["samples"] != batches[e["batch"] % len(batches)]:
            print(f"not quite: {e['name']}'s batch {e['batch']} in the run trained "
                  f"{e['samples']}, your shard gives {batches[e['batch'] % len(batches)]}")
            return
    run = f" and all {len(attempts)} batches torchft's groups trained in the run" \
        if attempts else ""
    print(f"correct: {len(SHARD_CASES)} cases against torch's DistributedSampler{run}")
