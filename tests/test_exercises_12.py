"""The checkers of chapter 12 pass the package's code and right answers, and reject known wrong
ones with the reason; the package's cut and re-division are the ones train_ddp uses."""
import math

import pytest
import torch

from dpcourse import elastic
from dpcourse.elastic import rank_indices, reshard
from dpcourse.exercises.ch12 import (INTERVAL_CASES, best_interval_reference,
                                     check_best_interval, check_rank_indices, check_reshard,
                                     check_resume_point, check_samples_per_epoch, failure_gaps,
                                     samples_per_epoch_reference, simulated_loss)
from dpcourse.fsdp import flat_shard, padded_numel


def said(capsys) -> str:
    return capsys.readouterr().out


# --- the parts a student writes ---

def test_the_package_parts_pass(capsys):
    check_rank_indices(rank_indices)
    check_reshard(reshard)
    out = said(capsys).splitlines()
    assert len(out) == 2 and all(line.startswith("correct: ") for line in out)


def test_a_stub_fails_with_not_implemented():
    def stub(*args):
        raise NotImplementedError()
    for check in (check_rank_indices, check_reshard):
        with pytest.raises(NotImplementedError):
            check(stub)


def every_epoch_the_same_order(n, global_batch, world, rank, step, seed):
    share = global_batch // world
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    first = (step % (n // global_batch)) * global_batch + rank * share
    return order[first:first + share].tolist()


def ranks_interleaved(n, global_batch, world, rank, step, seed):
    indices = rank_indices(n, global_batch, 1, 0, step, seed)
    return indices[rank::world]


def test_wrong_sample_indices_are_rejected_with_the_reason():
    with pytest.raises(AssertionError, match=r"epoch 1\).*seed \+ epoch"):
        check_rank_indices(every_epoch_the_same_order)
    with pytest.raises(AssertionError, match=r"rank 0 of 2.*one contiguous slice of the global "
                                             r"batch, not a strided one"):
        check_rank_indices(ranks_interleaved)


def without_new_padding(shards, numel, world):
    whole = torch.cat(shards)[:numel]
    return list(whole.tensor_split(world))


def old_padding_kept(shards, numel, world):
    whole = torch.cat(shards)
    return [flat_shard(whole, r, world) for r in range(world)]


def float32_padding(shards, numel, world):
    whole = torch.cat(shards)[:numel]
    padded = torch.zeros(padded_numel(numel, world))  # float32, whatever the shards are
    padded[:numel] = whole
    return list(padded.chunk(world))


@pytest.mark.parametrize("wrong, reason", [
    (without_new_padding, "elements?, expected padded"),
    (old_padding_kept, "elements?, expected padded|strip"),
    (float32_padding, "shard 0 is torch.float32, the shards are torch.float64: pad with zeros "
                      "of the shards' dtype")])
def test_wrong_reshards_are_rejected_with_the_reason(wrong, reason):
    with pytest.raises(AssertionError, match=reason):
        check_reshard(wrong)


def unpadded_chunks(shards, numel, world):
    return list(torch.cat(shards)[:numel].chunk(world))


def test_a_short_shard_is_counted_in_words_that_agree():
    with pytest.raises(AssertionError) as error:
        check_reshard(unpadded_chunks)
    assert str(error.value) == ("10 elements, from 2 ranks to 4: shard 3 has 1 element, expected "
                                "padded_numel(10, 4) // 4 = 3")


def tail_not_dropped(n, global_batch, world, rank, step, seed):
    epoch, start = divmod(step * global_batch, n)  # runs past the end of the permutation
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return order[start + rank * global_batch // world:
                 start + (rank + 1) * global_batch // world].tolist()


def test_long_index_lists_are_cut_saying_how_many_they_hold_and_a_kept_tail_is_named():
    with pytest.raises(AssertionError) as error:
        check_rank_indices(tail_not_dropped)
    assert str(error.value) == (
        "n=100, G=12, rank 0 of 1, step 8 (epoch 1): got [76, 26, 63, 33], expected "
        "[30, 13, 49, 91, 37, 71, ...] (12 in all): an epoch has n // G = 8 global batches: "
        "its last 4 samples are dropped (as DataLoader's drop_last), and the next epoch "
        "starts afresh")


def ceil_batches_an_epoch(n, global_batch, world, rank, step, seed):
    per_epoch = -(-n // global_batch)  # the last batch of an epoch short
    epoch, batch = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    start = batch * global_batch
    return order[start + rank * global_batch // world:
                 start + (rank + 1) * global_batch // world].tolist()


def test_an_epoch_with_a_short_last_batch_is_named_too():
    with pytest.raises(AssertionError, match="an epoch has n // G = 8 global batches"):
        check_rank_indices(ceil_batches_an_epoch)


def equal_shares_only(n, global_batch, world, rank, step, seed):
    share = global_batch // world  # right when world divides G, short by the remainder else
    whole = rank_indices(n, global_batch, 1, 0, step, seed)
    return whole[rank * share:(rank + 1) * share]


def test_a_cut_in_equal_shares_is_told_the_uneven_rule():
    with pytest.raises(AssertionError, match=r"do not divide G = 12: .*floor\(r G / k\)"):
        check_rank_indices(equal_shares_only)


@pytest.mark.parametrize("n, global_batch", [(100, 12), (96, 12), (50, 10), (23, 7)])
def test_any_world_cuts_each_global_batch_into_contiguous_floor_slices(n, global_batch):
    for step in range(3 * (n // global_batch)):
        whole = rank_indices(n, global_batch, 1, 0, step, 7)
        for world in range(1, global_batch + 1):
            shares = [rank_indices(n, global_batch, world, r, step, 7) for r in range(world)]
            assert sum(shares, []) == whole  # in rank order: the same global batch
            sizes = [len(share) for share in shares]
            assert sizes == [(r + 1) * global_batch // world - r * global_batch // world
                             for r in range(world)]
            assert max(sizes) - min(sizes) <= 1
    epochs = [sorted(sum((rank_indices(n, global_batch, 1, 0, e * (n // global_batch) + b, 7)
                          for b in range(n // global_batch)), [])) for e in range(2)]
    assert all(len(set(e)) == len(e) == n // global_batch * global_batch for e in epochs)


@pytest.mark.parametrize("n, global_batch", [(100, 12), (50, 10)])
def test_train_ddps_sampler_gives_each_rank_its_rank_indices_epoch_after_epoch(n, global_batch):
    for world in (1, 2, 5):
        if global_batch % world:
            continue
        for rank in range(world):
            sampler, steps = elastic.GlobalBatchSampler(n, global_batch, rank, world, 7), []
            for epoch in range(3):
                sampler.set_epoch(epoch)
                steps += list(sampler)
            assert steps == [rank_indices(n, global_batch, world, rank, s, 7)
                             for s in range(3 * (n // global_batch))]


@pytest.mark.parametrize("world, global_batch, n, rank", [(0, 12, 100, 0), (13, 12, 100, 0),
                                                          (3, 120, 100, 0), (3, 12, 100, 3)])
def test_rank_indices_refuses_an_impossible_cut_naming_it(world, global_batch, n, rank):
    with pytest.raises(ValueError, match=f"got {world} ranks, global batch {global_batch}, "
                                         f"{n} samples, rank {rank}"):
        rank_indices(n, global_batch, world, rank, 0, 0)


@pytest.mark.parametrize("numel, before, after", [(10, 3, 2), (10, 2, 4), (7, 1, 3), (9, 4, 1)])
def test_reshard_is_train_ddps_re_division(numel, before, after):
    whole = torch.randn(numel, dtype=torch.float64)
    saved = [{"state": {0: {"momentum_buffer": flat_shard(whole, r, before)}},
              "param_groups": []} for r in range(before)]
    mine = reshard([s["state"][0]["momentum_buffer"] for s in saved], numel, after)
    for r in range(after):
        theirs = elastic.redivided_optimizer(saved, [numel], r, after)
        assert torch.equal(mine[r], theirs["state"][0]["momentum_buffer"])


def test_reshard_refuses_shards_shorter_than_the_tensor():
    with pytest.raises(ValueError, match="2 shards hold 4 elements, fewer than the tensor's 5"):
        reshard([torch.zeros(2), torch.zeros(2)], 5, 2)


# --- exercises ---

@pytest.mark.parametrize("check", [check_samples_per_epoch, check_resume_point,
                                   check_best_interval])
def test_no_answer_is_not_answered_yet(capsys, check):
    check(None)
    assert said(capsys) == "not answered yet\n"


def test_the_worked_answers_are_correct(capsys):
    check_samples_per_epoch(lambda n, g, k: (math.ceil(n / k) * k, n // g * g))
    check_resume_point(lambda s, n, g: (*divmod(s, n // g), s * g))
    out = said(capsys).splitlines()
    assert len(out) == 2 and all(line.startswith("correct: ") for line in out)


def test_the_distributed_sampler_reference_pads_as_the_issue_measured():
    assert samples_per_epoch_reference(4096, 96, 3) == (4098, 4032)


def test_wrong_exercise_answers_are_told_why(capsys):
    check_samples_per_epoch(lambda n, g, k: (n, n // g * g))  # forgets the padding
    assert "DistributedSampler pads each rank" in said(capsys)
    check_resume_point(lambda s, n, g: (s // (n // g), s % (n // g), s))  # samples per rank?
    assert "each step draws G samples" in said(capsys)


def test_the_worked_answers_may_be_lists(capsys):
    check_samples_per_epoch(lambda n, g, k: [math.ceil(n / k) * k, n // g * g])
    check_resume_point(lambda s, n, g: [*divmod(s, n // g), s * g])
    out = said(capsys).splitlines()
    assert len(out) == 2 and all(line.startswith("correct: ") for line in out)


def test_an_answer_of_the_wrong_shape_is_told_the_shape(capsys):
    check_samples_per_epoch(lambda n, g, k: n // g * g)
    assert "return two whole numbers, (DistributedSampler's, the global sampler's)" in said(capsys)
    check_resume_point(lambda s, n, g: (s // (n // g), s % (n // g)))
    assert "return three whole numbers, (epoch, batches, samples)" in said(capsys)


# --- exercise 3: the checkpoint interval ---

def expected_loss(interval, checkpoint_seconds, mtbf_seconds):
    """The share of time lost under exponential failures, exactly: a run between two failures
    keeps k intervals with probability q^k (1 - q), q = exp(-(interval + C) / M)."""
    q = math.exp(-(interval + checkpoint_seconds) / mtbf_seconds)
    return 1 - interval * q / (mtbf_seconds * (1 - q))


@pytest.mark.parametrize("checkpoint_seconds, mtbf_seconds", INTERVAL_CASES)
def test_the_simulation_is_the_exact_expectation_and_youngs_interval_its_optimum(
        checkpoint_seconds, mtbf_seconds):
    gaps = failure_gaps(mtbf_seconds)
    young = best_interval_reference(checkpoint_seconds, mtbf_seconds)
    for interval in (young / 2, young, 2 * young):
        assert simulated_loss(interval, checkpoint_seconds, gaps) == pytest.approx(
            expected_loss(interval, checkpoint_seconds, mtbf_seconds), rel=5e-3)
    exact_best = min(expected_loss(young * 2 ** (k / 100), checkpoint_seconds, mtbf_seconds)
                     for k in range(-100, 101))
    assert expected_loss(young, checkpoint_seconds, mtbf_seconds) <= 1.005 * exact_best


def test_the_interval_checker_accepts_youngs_and_explains_the_usual_slips(capsys):
    check_best_interval(lambda c, m: math.sqrt(2 * c * m))
    assert said(capsys).startswith("correct: a 60 s checkpoint, a failure a day: every 54 min")
    for wrong, reason in [(lambda c, m: math.sqrt(c * m), "costs half an interval of work"),
                          (lambda c, m: math.sqrt(2 * c * m) / 60, "in seconds"),
                          (lambda c, m: math.sqrt(2 * c / m), "the interval is M times that"),
                          (lambda c, m: 2 * c * m, "C / t writing checkpoints"),
                          (lambda c, m: -1.0, "a number of seconds > 0")]:
        check_best_interval(wrong)
        out = said(capsys)
        assert out.startswith("not quite") and reason in out, out
