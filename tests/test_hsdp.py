"""HSDP built by hand (chapter 14) against torch's fully_shard on a 2-D mesh and one process
on the global batch, in float64; groups of one rank are DDP, one group is chapter 10's FSDP."""
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import hsdp_workers
from dpcourse.cost_model import AlphaBeta, ring_allreduce_cost
from dpcourse.launch import launch
from test_differential import examples

CLOSE = {"rtol": 1e-12, "atol": 1e-12}  # float64: rounding only


def ring_sent(handed: float, ranks: int) -> float:
    """The bytes a rank sends in a ring allreduce of handed bytes (chapter 08's model, at one
    second per byte and none per message)."""
    return ring_allreduce_cost(AlphaBeta(alpha=0.0, beta=1.0), ranks).time(handed)


@st.composite
def cases(draw) -> dict:
    groups, size = draw(st.sampled_from([(2, 2), (1, 4), (4, 1), (1, 2), (2, 1), (3, 1)]))
    return {"q": groups, "g": size, "width": draw(st.integers(3, 9)),
            "batch": groups * size * draw(st.integers(1, 3))}


@examples(in_ci=1)
@given(case=cases())
@example(case={"q": 2, "g": 2, "width": 7, "batch": 8})  # each unit padded: 7 x 12 + 7 odd
@example(case={"q": 1, "g": 4, "width": 5, "batch": 4})
@example(case={"q": 4, "g": 1, "width": 5, "batch": 8})
def test_hsdp_by_hand_trains_like_torch_s_2d_fully_shard_and_one_process(case):
    world = case["q"] * case["g"]
    ranks = launch(hsdp_workers.runs, case, world_size=world, backend="gloo", timeout=180)
    expected = hsdp_workers.one_process(case)
    for rank, got in enumerate(ranks):
        for key, value in expected.items():
            torch.testing.assert_close(got["ours"]["state"][key], value, **CLOSE,
                                       msg=lambda m: f"rank {rank}, {key}, ours: {m}")
            torch.testing.assert_close(got["ours"]["state"][key], got["torch"][key], **CLOSE,
                                       msg=lambda m: f"rank {rank}, {key}, against torch: {m}")
            if got["fsdp"] is not None:  # one group: chapter 10's FSDP, bitwise
                assert torch.equal(got["ours"]["state"][key], got["fsdp"][key]), key


@pytest.mark.parametrize("groups,size", [(2, 2), (4, 1), (1, 4)])
def test_a_rank_hands_the_allreduce_across_groups_a_gth_of_what_ddp_hands_its_own(groups,
                                                                                  size):
    """Per step a rank hands the allreduce across groups its shard of every unit's gradient:
    the padded parameters over g, where DDP's allreduce over all q x g ranks takes every
    parameter; on the wire of a ring that is (q - 1) / (qg - 1) of DDP's, padding aside."""
    case = {"q": groups, "g": size, "width": 7, "batch": 8}
    ranks = launch(hsdp_workers.runs, case, world_size=groups * size, backend="gloo",
                   timeout=180)
    numel = sum(v.numel() for v in hsdp_workers.net(0, 7).state_dict().values())
    for got in ranks:
        shards = got["ours"]["shards"]  # each unit's shard: its padded numel over g
        assert 0 <= sum(shards) * size - numel < size * len(shards)
        handed, ddp = got["ours"]["across"] / hsdp_workers.STEPS, 8 * numel  # float64
        assert handed == 8 * sum(shards)
        padding = sum(shards) * size / numel
        assert handed / ddp == pytest.approx(padding / size, rel=1e-12)
        on_wire = ring_sent(handed, groups) / ring_sent(ddp, groups * size)
        assert on_wire == pytest.approx((groups - 1) / (groups * size - 1) * padding, abs=1e-12)


def test_a_group_size_that_does_not_divide_the_world_and_a_ring_with_groups_are_refused():
    said = launch(hsdp_workers.errors, world_size=2, backend="gloo", timeout=60)[0]
    assert said[0] == ("hsdp_groups: group_size must divide the world size 2 into replica "
                       "groups, got 3")
    assert said[1].endswith("got 0")
    assert said[2] == "ScratchFSDP: the ring runs over every rank, in one group"
