"""The checkers of chapter 13 pass the package's code and right answers, and reject known
wrong ones, naming the mistake."""
import math

import pytest
import torch
import torch.distributed as dist

from dpcourse.elastic import rank_indices
from dpcourse.exercises.ch13 import (check_committed_fraction, check_members_mean_gradient,
                                     check_quorum_members, check_recovery_plan,
                                     check_torchft_shard, check_vote, shuffled)
from dpcourse.lighthouse import quorum_members
from dpcourse.quorum import vote
from dpcourse.recovery import recovery_plan
from dpcourse.train_ft import gradient_sum, members_mean_gradient


def test_the_package_parts_pass(capsys):
    check_quorum_members(quorum_members)
    check_vote(vote)
    check_members_mean_gradient(members_mean_gradient)
    check_recovery_plan(recovery_plan)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all(line.startswith("correct: ") for line in out)


def test_a_stub_fails_with_not_implemented():
    def stub(*args):
        raise NotImplementedError()
    for check in (check_quorum_members, check_vote, check_members_mean_gradient,
                  check_recovery_plan):
        with pytest.raises(NotImplementedError):
            check(stub)


# --- the quorum rule ---

def without_fast_quorum(now, last_beat, asked, previous, rules):
    return quorum_members(now, last_beat, asked, None, rules)


def half_is_enough(now, last_beat, asked, previous, rules):
    healthy = [r for r, t in last_beat.items() if now - t < rules.heartbeat_timeout]
    asking = sorted(r for r in asked if r in healthy)
    if previous and all(r in asking for r in previous):
        return asking, ""
    if len(asking) < rules.min_replicas or 2 * len(asking) < len(healthy):  # the slip: half
        return None, ""
    if len(asking) < len(healthy) and now - min(asked[r] for r in asking) < rules.join_timeout:
        return None, ""
    return asking, ""


def unsorted(now, last_beat, asked, previous, rules):
    members, why = quorum_members(now, last_beat, asked, previous, rules)
    return (members and sorted(members, key=asked.get)), why


@pytest.mark.parametrize("wrong, named", [
    (without_fast_quorum, "fast quorum"), (half_is_enough, "more than half"),
    (unsorted, "sorted by id")])
def test_wrong_quorum_rules_are_named(wrong, named):
    with pytest.raises(AssertionError, match=named):
        check_quorum_members(wrong)


# --- the vote ---

def on_own_vote(store, quorum_id, step, size, ready, timeout):
    if ready:
        store.add(f"votes/{quorum_id}/{step}", 1)
    return ready


def last_but_one_commits(store, quorum_id, step, size, ready, timeout):
    decision = f"lh/vote/{quorum_id}/{step}/decision"
    if ready and store.add(f"lh/vote/{quorum_id}/{step}/votes", 1) >= size - 1:
        return store.compare_set(decision, "", "commit") == b"commit"
    if ready:
        try:
            store.wait([decision], __import__("datetime").timedelta(seconds=timeout))
        except dist.DistStoreError:
            pass
    return store.compare_set(decision, "", "abort") == b"commit"


@pytest.mark.parametrize("wrong, named", [(on_own_vote, "not ready sets the decision"),
                                          (last_but_one_commits, "act on the decision")])
def test_wrong_votes_are_named(wrong, named):
    with pytest.raises(AssertionError, match=named):
        check_vote(wrong)


# --- the global batch ---

def divided_by_members(model, images, labels, global_batch, members, step, seed):
    return members_mean_gradient(model, images, labels, global_batch, members, step,
                                 seed) * global_batch / members


def mean_of_means(model, images, labels, global_batch, members, step, seed):
    total = 0
    for i in range(members):
        samples = rank_indices(len(images), global_batch, members, i, step, seed)
        summed, _ = gradient_sum(model, images[samples], labels[samples])
        total = total + summed / len(samples)
    return total / members


def strided(model, images, labels, global_batch, members, step, seed):
    whole = rank_indices(len(images), global_batch, 1, 0, step, seed)
    total = sum(gradient_sum(model, images[whole[i::members + 1]],
                             labels[whole[i::members + 1]])[0] for i in range(members))
    return total / global_batch


@pytest.mark.parametrize("wrong, named", [
    (divided_by_members, "not by the number of members"), (mean_of_means, "equally"),
    (strided, "rank_indices")])
def test_wrong_averages_are_named(wrong, named):
    with pytest.raises(AssertionError, match=named):
        check_members_mean_gradient(wrong)


# --- recovery ---

def from_the_one_behind(steps, qids):
    versions = list(zip(steps, qids))
    behind = [i for i, v in enumerate(versions) if v != max(versions)]
    return {i: versions.index(min(versions)) for i in behind}


def by_step_alone(steps, qids):
    return recovery_plan(steps, [0] * len(steps))


def all_from_the_first(steps, qids):
    plan = recovery_plan(steps, qids)
    return {m: min(plan.values()) for m in plan}


@pytest.mark.parametrize("wrong, named", [
    (from_the_one_behind, "never from one behind"), (by_step_alone, "whole versions"),
    (all_from_the_first, "in turn")])
def test_wrong_plans_are_named(wrong, named):
    with pytest.raises(AssertionError, match=named):
        check_recovery_plan(wrong)


# --- exercises ---

def test_the_committed_fraction_is_checked_against_a_simulation(capsys):
    check_committed_fraction(None)
    check_committed_fraction(lambda t, m: math.exp(-t / m))
    check_committed_fraction(lambda t, m: 1 - t / m)
    check_committed_fraction(lambda t, m: (2 * m - t) / (2 * m + t))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "not answered yet" and out[1].startswith("correct: ")
    assert "t = 20 s, M = 60 s: 0.7165" in out[1] and "would say 0.6667" in out[1]
    assert all(line.startswith("not quite") and "exp(-t / M)" in line for line in out[2:])


def padded_shard(order, replica_rank, groups, group_rank=0, group_size=1):
    world, rank = group_size * groups, group_rank + group_size * replica_rank
    per = -(-len(order) // world)
    return (order * world)[:per * world][rank::world]


def test_torchft_s_shard_is_checked_against_torch_s_sampler_and_its_run(capsys):
    order = shuffled(40, 0)
    events = [{"event": "attempt", "name": name, "batch": k,
               "samples": padded_shard(order, g, 2)[k % 4 * 5:k % 4 * 5 + 5]}
              for g, name in enumerate(["r0", "r1"]) for k in range(6)]  # 4 batches an epoch
    check_torchft_shard(padded_shard, events, ["r0", "r1"], 40, 5)
    check_torchft_shard(padded_shard, [{**events[7], "batch": 3}], ["r0", "r1"], 40, 5)
    out = capsys.readouterr().out.splitlines()
    assert out == ["correct: 7 cases against torch's DistributedSampler and all 12 batches "
                   "torchft's groups trained in the run",
                   f"not quite: r1's batch 3 in the run trained {events[7]['samples']}, your "
                   f"shard gives {padded_shard(order, 1, 2)[15:20]}"]


def contiguous(order, replica_rank, groups, group_rank=0, group_size=1):
    world, rank = group_size * groups, group_rank + group_size * replica_rank
    per = -(-len(order) // world)
    return (order * world)[:per * world][rank * per:(rank + 1) * per]


def interleaved(order, replica_rank, groups, group_rank=0, group_size=1):
    return padded_shard(order, 0, group_size * groups, replica_rank + groups * group_rank)


def unpadded(order, replica_rank, groups, group_rank=0, group_size=1):
    return order[group_rank + group_size * replica_rank::group_size * groups]


def groups_only(order, replica_rank, groups, group_rank=0, group_size=1):
    return padded_shard(order, replica_rank, groups)


def sorted_shard(order, replica_rank, groups, group_rank=0, group_size=1):
    return sorted(padded_shard(order, replica_rank, groups, group_rank, group_size))


@pytest.mark.parametrize("attempt,missed", [
    (unpadded, "padded with its own first indices"), (contiguous, "a contiguous block"),
    (interleaved, "the ranks interleave the groups"), (groups_only, "the world is every rank"),
    (sorted_shard, "torch's DistributedSampler over group_size * num_replica_groups ranks")])
def test_a_wrong_shard_gets_what_it_missed(attempt, missed, capsys):
    check_torchft_shard(attempt)
    out = capsys.readouterr().out
    assert out.startswith("not quite: ") and missed in out and out.count("\n") == 1


def test_a_shard_of_another_type_is_taken_and_one_that_raises_is_told_in_one_line(capsys):
    check_torchft_shard(lambda *args: torch.tensor(padded_shard(*args)))
    check_torchft_shard(lambda order, *rest: order[len(order)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("correct: ")
    assert out[1].startswith("not quite: torchft_shard(0, 2, 0, 1) raised IndexError: ")
    assert out[1].endswith("(return a list of ints)") and len(out) == 2
