"""The checkers of chapter 14 pass the package's code and right answers, and reject known
wrong ones, naming the mistake."""
import math

import pytest

from dpcourse.elastic import rank_indices
from dpcourse.exercises.ch14 import (check_bytes_across, check_group_share, check_groups_needed,
                                     check_shard_gradients, check_shard_sources)
from dpcourse.ft_groups import group_share, shard_gradients, shard_sources
from dpcourse.recovery import recovery_plan
from dpcourse.train_ft import share


def test_the_package_parts_pass(capsys):
    check_group_share(group_share)
    check_shard_gradients(shard_gradients)
    check_shard_sources(shard_sources)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and all(line.startswith("correct: ") for line in out)
    assert "take [3, 4, 3, 4, 4, 4] samples (the flat cut among 6 ranks would take " \
           "[3, 4, 4, 3, 4, 4])" in out[0]
    assert "group 1's shards 0 to 3 come from groups [0, 2, 4, 0]" in out[2]


def test_a_stub_fails_with_not_implemented():
    def stub(*args):
        raise NotImplementedError()
    for check in (check_group_share, check_shard_gradients, check_shard_sources):
        with pytest.raises(NotImplementedError):
            check(stub)


def test_a_part_that_raises_fails_in_one_line():
    for check in (check_group_share, check_shard_gradients, check_shard_sources):
        with pytest.raises(AssertionError, match=r"failed: ZeroDivisionError: division by zero$"):
            check(lambda *args: 1 / 0)


# --- the global batch ---

def flat(n, global_batch, groups, group, size, rank, step, seed):
    return rank_indices(n, global_batch, groups * size, group * size + rank, step, seed)


def overlapping(n, global_batch, groups, group, size, rank, step, seed):
    mine = share(n, global_batch, groups, group, step, seed)
    return mine[rank * len(mine) // size:(rank + 1) * len(mine) // size + 1]


def remainder_dropped(n, global_batch, groups, group, size, rank, step, seed):
    mine = share(n, global_batch, groups, group, step, seed)
    return mine[rank * (len(mine) // size):(rank + 1) * (len(mine) // size)]


def every_epoch_the_same_order(n, global_batch, groups, group, size, rank, step, seed):
    return group_share(n, global_batch, groups, group, size, rank, step % (n // global_batch),
                       seed)


def strided(n, global_batch, groups, group, size, rank, step, seed):
    return share(n, global_batch, groups, group, step, seed)[rank::size]


@pytest.mark.parametrize("wrong, named", [
    (flat, "must not depend on its size g"), (overlapping, "overlap or miss samples"),
    (remainder_dropped, "overlap or miss samples"),
    (every_epoch_the_same_order, "outside global batch 4"), (strided, "floor(r m / g)")])
def test_wrong_shares_are_named(wrong, named):
    with pytest.raises(AssertionError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_group_share(wrong)


# --- the gradient path ---

def divided_by_ranks(sums, global_batch):
    ranks = len(sums) * len(sums[0])
    return [[s * global_batch / ranks for s in group]
            for group in shard_gradients(sums, global_batch)]


def without_the_allreduce(sums, global_batch):
    return [[c / global_batch for c in sum(group).chunk(len(group))] for group in sums]


def strided_chunks(sums, global_batch):
    size = len(sums[0])
    total = sum(s for group in sums for s in group)
    return [[total[r::size] / global_batch for r in range(size)] for _ in sums]


def reversed_positions(sums, global_batch):
    return [group[::-1] for group in shard_gradients(sums, global_batch)]


def one_list_for_all(sums, global_batch):
    return shard_gradients(sums, global_batch)[0]


@pytest.mark.parametrize("wrong, named", [
    (divided_by_ranks, "not by G"), (without_the_allreduce, "allreduced across the groups"),
    (strided_chunks, "contiguous chunk"), (reversed_positions, "shard r in position r"),
    (one_list_for_all, "return one list per group")])
def test_wrong_gradient_paths_are_named(wrong, named):
    with pytest.raises(AssertionError, match=named):
        check_shard_gradients(wrong)


# --- shard-wise recovery ---

def all_from_one_group(steps, qids, shard):
    return recovery_plan(steps, qids)


def from_one_behind(steps, qids, shard):
    plan = shard_sources(steps, qids, shard)
    return {member: min(plan) if len(plan) > 1 else source for member, source in plan.items()}


def up_to_date_too(steps, qids, shard):
    versions = list(zip(steps, qids))
    current = [i for i, v in enumerate(versions) if v == max(versions)]
    return {**shard_sources(steps, qids, shard), **{i: i for i in current}}


def by_step_alone(steps, qids, shard):
    return shard_sources(steps, [0] * len(steps), shard)


@pytest.mark.parametrize("wrong, named", [
    (all_from_one_group, "every shard from the same group"),
    (from_one_behind, "a source that is itself behind"),
    (up_to_date_too, "an up-to-date group in the plan"), (by_step_alone, "whole versions")])
def test_wrong_shard_sources_are_named(wrong, named):
    with pytest.raises(AssertionError, match=named):
        check_shard_sources(wrong)


# --- exercises ---

def bytes_across(params, bytes_per_param, group_size, groups):
    handed = params * bytes_per_param / group_size
    return handed, 2 * (groups - 1) / groups * handed


def groups_needed(failures_per_s, step_s, out_s, budget):
    spare = budget - failures_per_s * step_s  # what the failed group's time out may take
    if spare <= 0:
        raise ValueError(f"each failure costs every group its step in flight: "
                         f"{failures_per_s * step_s:.2%} of the time whatever q, not below "
                         f"the budget {budget:.2%}")
    return max(2, math.floor(failures_per_s * out_s / spare) + 1)  # q > r out_s / spare


def groups_needed_by_search(failures_per_s, step_s, out_s, budget):
    if failures_per_s * step_s >= budget:
        raise ValueError("the step in flight alone loses the budget")
    q = 2
    while failures_per_s * (step_s + out_s / q) >= budget:
        q += 1
    return q


@pytest.mark.parametrize("check", [check_bytes_across, check_groups_needed])
def test_no_answer_is_not_answered_yet(capsys, check):
    check(None)
    assert capsys.readouterr().out == "not answered yet\n"


def test_the_worked_answers_are_correct_and_print_the_figures(capsys):
    check_bytes_across(bytes_across)
    check_bytes_across(lambda *args: list(bytes_across(*args)))
    check_groups_needed(groups_needed)
    check_groups_needed(groups_needed_by_search)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all(line.startswith("correct: ") for line in out)
    assert "hands 2.19 GB to the allreduce across groups and sends 4.1 GB, 0.082 s" in out[0]
    assert "DDP over the 1,024 ranks hands 140 GB and sends 280 GB, 5.59 s: 64x the bytes " \
           "handed, 68.2x the bytes sent" in out[0]
    assert "fail 0.555 times an hour" in out[2] and "q = 1: 2.94%, 2: 1.55%, 4: 0.86%" in out[2]
    assert "below 1%: q = 4 (512 nodes a group)" in out[2]


@pytest.mark.parametrize("wrong, named", [
    (lambda p, b, g, q: bytes_across(p, b, 1, q), "divide by the group size"),
    (lambda p, b, g, q: (p * b / g, (q - 1) / q * p * b / g), "2 (q-1)/q in all"),
    (lambda p, b, g, q: (p * b / g, 2 * p * b / g), "a ring of q sends 2 (q-1)/q"),
    (lambda p, b, g, q: p * b / g, "return two numbers of bytes"),
    (lambda p, b, g, q: 1 / 0, "bytes_across(1000000000.0, 2, 8, 4) failed: ZeroDivisionError")])
def test_wrong_byte_counts_are_named(wrong, named, capsys):
    check_bytes_across(wrong)
    out = capsys.readouterr().out
    assert out.startswith("not quite: ") and named in out and out.count("\n") == 1


def out_time_fully(failures_per_s, step_s, out_s, budget):
    if failures_per_s * (step_s + out_s) >= budget:
        raise ValueError("no q is enough")
    return 2


def fraction_at_most_the_budget(failures_per_s, step_s, out_s, budget):
    q = 2
    while failures_per_s * (step_s + out_s / q) > budget:
        q += 1
    return q


def from_one(failures_per_s, step_s, out_s, budget):
    q = 1
    while failures_per_s * (step_s + out_s / q) >= budget:
        q += 1
    return q


def never_raises(failures_per_s, step_s, out_s, budget):
    return groups_needed(failures_per_s, step_s, out_s, budget) \
        if failures_per_s * step_s < budget else 2


@pytest.mark.parametrize("wrong, named", [
    (out_time_fully, "out_s / q of the job's time"),
    (fraction_at_most_the_budget, "equals the budget exactly"),
    (from_one, "q >= 2: a single group"), (never_raises, "raise ValueError saying so"),
    (lambda *args: groups_needed(*args) + 1, "not the least: q = 9"),
    (lambda *args: float(groups_needed(*args)), "return a whole number of groups"),
    (lambda *args: 1 / 0, "failed: ZeroDivisionError")])
def test_wrong_group_counts_are_named(wrong, named, capsys):
    check_groups_needed(wrong)
    out = capsys.readouterr().out
    assert out.startswith("not quite: ") and named in out and out.count("\n") == 1
