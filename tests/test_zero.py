"""ShardedOptimizer (ZeRO-1) trains exactly like the plain optimizer, and ScratchDDP's
shard_gradients (ZeRO-2) exactly like ZeRO-1.

Two launches, 2 and 3 ranks, each running its checks in one go (1 rank: a process group
in the test's own process). The models are float64
(TiedNet: a tied weight, a frozen layer, a layer without gradient in one step; and a
one-parameter net, fewer parameters than ranks), so after 10 steps any difference is
rounding: 1e-9 relative (in practice the results are bitwise equal).
"""
import tempfile
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from dpcourse import _zero_workers
from dpcourse.launch import launch
from dpcourse.zero import ShardedOptimizer, partition

CASES = [("tied", "SGD"), ("tied", "Adam"), ("tied", "AdamW"), ("tiny", "AdamW")]
WORLDS = (2, 3)
CASES_ON = {2: CASES, 3: [("tied", "AdamW"), ("tiny", "AdamW")]}  # 3 ranks: a shorter run
RUNS = [(w, case) for w in WORLDS for case in CASES_ON[w]]
CAPS = (25.0, 0.0)  # one bucket; one bucket per parameter
CLOSE = {"rtol": 1e-9, "atol": 1e-12}


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """world size -> each rank's results; the rank-count independent checks run on 2."""
    return {w: launch(_zero_workers.zero_checks, CASES_ON[w], w == 2, world_size=w,
                      backend="gloo", timeout=300) for w in WORLDS}


def records(runs, world, case):
    """Each rank's record of case on world ranks."""
    i = CASES_ON[world].index(case)
    return [runs[world][rank]["sharded"][i] for rank in range(world)]


def run_id(run):
    world, case = run
    return f"{'-'.join(case)}-{world}ranks"


@pytest.mark.parametrize("world, case", RUNS, ids=list(map(run_id, RUNS)))
def test_sharded_optimizer_equals_the_plain_one_after_every_step(runs, world, case):
    for record in records(runs, world, case):
        assert len(record["ours"]) == _zero_workers.STEPS
        for ours, plain in zip(record["ours"], record["plain"]):
            torch.testing.assert_close(ours, plain, **CLOSE)
        assert not torch.equal(record["plain"][-1], record["plain"][0])  # it did train


@pytest.mark.parametrize("world, case", RUNS, ids=list(map(run_id, RUNS)))
def test_every_rank_ends_every_step_with_the_same_parameters(runs, world, case):
    first, *others = records(runs, world, case)
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first["ours"], other["ours"]))


@pytest.mark.parametrize("world, case", RUNS, ids=list(map(run_id, RUNS)))
def test_each_rank_holds_the_state_of_its_own_shard_only(runs, world, case):
    all_ranks = records(runs, world, case)
    owners = all_ranks[0]["owners"]
    assert all(r["owners"] == owners for r in all_ranks)  # the same split everywhere
    assert set(owners) <= set(range(world))  # each parameter owned by exactly one rank
    for rank, record in enumerate(all_ranks):
        mine = [o == rank for o in owners]
        assert record["local_params"] == sum(mine)
        # state for each owned parameter that trains (the frozen one has none), no other
        assert record["with_state"] == [m and t for m, t in zip(mine, record["trainable"])]


@pytest.mark.parametrize("world, case", RUNS, ids=list(map(run_id, RUNS)))
def test_shards_have_balanced_sizes(runs, world, case):
    record = records(runs, world, case)[0]
    loads = [sum(n for n, o in zip(record["numels"], record["owners"]) if o == r)
             for r in range(world)]
    assert max(loads) - min(loads) <= max(record["numels"])
    if len(record["numels"]) >= world:
        assert min(loads) > 0


def test_fewer_parameters_than_ranks_leaves_ranks_empty_but_working(runs):
    record = records(runs, 3, ("tiny", "AdamW"))
    assert record[0]["owners"] == [0] and [r["local_params"] for r in record] == [1, 0, 0]


def test_partition_is_greedy_largest_first_and_continues_from_given_loads():
    assert partition([5, 3, 3, 1], 2) == [0, 1, 1, 0]  # loads 6 and 6
    assert partition([1, 1, 1], 2) == [0, 1, 0]
    assert partition([4], 3, loads=[5, 2, 3]) == [1]
    assert partition([], 2) == []


def test_consolidated_state_dict_is_the_plain_optimizers(runs):
    for rank_result in runs[2]:
        ours = rank_result["round_trip"]["consolidated"]
        plain = rank_result["round_trip"]["plain_state"]
        assert ours["param_groups"] == plain["param_groups"]
        assert ours["state"].keys() == plain["state"].keys()
        for i, state in plain["state"].items():
            assert ours["state"][i].keys() == state.keys()
            for key, value in state.items():
                torch.testing.assert_close(ours["state"][i][key], value, **CLOSE)


def test_state_dict_round_trips_between_sharded_and_plain(runs):
    for rank_result in runs[2]:
        r = rank_result["round_trip"]
        torch.testing.assert_close(r["sharded"], r["plain"], **CLOSE)
        torch.testing.assert_close(r["plain_from_sharded"], r["plain"], **CLOSE)
        torch.testing.assert_close(r["sharded_from_plain"], r["plain"], **CLOSE)
        assert r["lr_after_load"] == _zero_workers.OPTIMIZERS["AdamW"][1]["lr"]


def test_add_param_group_shares_out_the_new_parameters_only(runs):
    for rank_result in runs[2]:
        r = rank_result["add_group"]
        torch.testing.assert_close(r["sharded"], r["plain"], **CLOSE)
        assert r["owners_after"] == r["owners_before"]
        assert r["local_lrs"] == [0.1, 0.05]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cap", CAPS)
def test_zero2_trains_like_zero1_and_like_plain_ddp(runs, world, cap):
    for rank_result in runs[world]:
        z = rank_result["zero2"][cap]
        torch.testing.assert_close(z["zero1"]["params"], z["ddp"]["params"], **CLOSE)
        torch.testing.assert_close(z["zero2"]["params"], z["zero1"]["params"], **CLOSE)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cap", CAPS)
def test_zero2_leaves_averaged_gradients_on_owned_parameters_only(runs, world, cap):
    for rank, rank_result in enumerate(runs[world]):
        z = rank_result["zero2"][cap]
        owned = [o == rank and t for o, t in zip(z["zero2"]["owners"], rank_result["zero2"][cap]
                                                 ["trainable"])]
        assert [g is not None for g in z["zero2"]["grads"]] == owned
        assert any(owned) and not all(owned)
        for mine, ours, full in zip(owned, z["zero2"]["grads"], z["zero1"]["grads"]):
            if mine:
                torch.testing.assert_close(ours, full, **CLOSE)


def test_same_parameters_as_torchs_zero_redundancy_optimizer(runs):
    for rank_result in runs[2]:
        torch.testing.assert_close(rank_result["torch_zero"]["ours"],
                                   rank_result["torch_zero"]["torch"], **CLOSE)


def test_clear_errors(runs):
    errors = runs[2][0]["errors"]
    assert errors["class name"].startswith("TypeError: optimizer_cls must be a torch.optim")
    assert errors["not an optimizer"].startswith("TypeError: optimizer_cls must be")
    assert errors["no parameters"] == "ValueError: optimizer got an empty parameter list"
    assert "parameter groups do not match" in errors["wrong state"]
    assert "without ring=True or shm=True" in errors["ring"]
    assert "is not one of this optimizer's parameters" in errors["other parameters"]


def test_without_a_process_group_the_error_says_how_to_get_one():
    with pytest.raises(RuntimeError, match="dpcourse.launch.launch"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=0.1)


@contextmanager
def one_rank_group():
    """A default process group of this process alone, destroyed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_one_rank_owns_everything_and_trains_like_the_plain_optimizer():
    with one_rank_group():
        record = _zero_workers.sharded_against_plain("tied", "AdamW")
        z = _zero_workers.zero2_against_zero1(0.0)
    for ours, plain in zip(record["ours"], record["plain"]):
        torch.testing.assert_close(ours, plain, **CLOSE)
    assert set(record["owners"]) == {0} and record["with_state"] == record["trainable"]
    torch.testing.assert_close(z["zero2"]["params"], z["ddp"]["params"], **CLOSE)
    assert [g is not None for g in z["zero2"]["grads"]] == z["trainable"]
