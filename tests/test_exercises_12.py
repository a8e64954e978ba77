"""The checkers of chapter 12 pass the package's code and right answers, and reject known wrong
ones with the reason; the package's code agrees with train_ddp's sampler and re-division."""
import math

import pytest
import torch

from dpcourse import train_ddp
from dpcourse.elastic import rank_indices, reshard
from dpcourse.exercises.ch12 import (check_rank_indices, check_reshard, check_resume_point,
                                     check_samples_per_epoch, samples_per_epoch_reference)
from dpcourse.fsdp import flat_shard


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
    with pytest.raises(AssertionError, match=r"rank 1 of 2.*contiguous|rank r's slice"):
        check_rank_indices(ranks_interleaved)


def without_new_padding(shards, numel, world):
    whole = torch.cat(shards)[:numel]
    return list(whole.tensor_split(world))


def old_padding_kept(shards, numel, world):
    whole = torch.cat(shards)
    return [flat_shard(whole, r, world) for r in range(world)]


@pytest.mark.parametrize("wrong, reason", [(without_new_padding, "elements, expected padded"),
                                           (old_padding_kept, "elements, expected padded|strip")])
def test_wrong_reshards_are_rejected_with_the_reason(wrong, reason):
    with pytest.raises(AssertionError, match=reason):
        check_reshard(wrong)


@pytest.mark.parametrize("n, global_batch", [(100, 12), (96, 12), (50, 10)])
def test_rank_indices_are_what_train_ddps_sampler_gives(n, global_batch):
    for world in (1, 2, 3, 4, 6):
        if global_batch % world:
            continue
        for rank in range(world):
            sampler, steps = train_ddp.GlobalBatchSampler(n, global_batch, rank, world, 7), []
            for epoch in range(3):
                sampler.set_epoch(epoch)
                steps += list(sampler)
            assert [rank_indices(n, global_batch, world, rank, s, 7)
                    for s in range(len(steps))] == steps


def test_rank_indices_refuses_a_world_that_does_not_divide_the_batch():
    with pytest.raises(ValueError, match="5 ranks must divide the global batch 12"):
        rank_indices(100, 12, 5, 0, 0, 0)


@pytest.mark.parametrize("numel, before, after", [(10, 3, 2), (10, 2, 4), (7, 1, 3), (9, 4, 1)])
def test_reshard_is_train_ddps_re_division(numel, before, after):
    whole = torch.randn(numel, dtype=torch.float64)
    saved = [{"state": {0: {"momentum_buffer": flat_shard(whole, r, before)}},
              "param_groups": []} for r in range(before)]
    mine = reshard([s["state"][0]["momentum_buffer"] for s in saved], numel, after)
    for r in range(after):
        theirs = train_ddp.redivided_optimizer(saved, [numel], r, after)
        assert torch.equal(mine[r], theirs["state"][0]["momentum_buffer"])


def test_reshard_refuses_shards_shorter_than_the_tensor():
    with pytest.raises(ValueError, match="2 shards hold 4 elements, fewer than the tensor's 5"):
        reshard([torch.zeros(2), torch.zeros(2)], 5, 2)


# --- exercises ---

@pytest.mark.parametrize("check", [check_samples_per_epoch, check_resume_point])
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
