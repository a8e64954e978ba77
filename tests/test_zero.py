"""ShardedOptimizer (ZeRO-1) trains exactly like the plain optimizer, and ScratchDDP's
reduce_scatter_hook (ZeRO-2) exactly like ZeRO-1.

Two launches, 2 and 3 ranks, each running its checks in one go (1 rank: a process group
in the test's own process). The models are mostly float64
(TiedNet: a tied weight, a frozen layer, a layer without gradient in one step; and a
one-parameter net, fewer parameters than ranks), so after 10 steps any difference is
rounding: 1e-9 relative (in practice the results are bitwise equal); TiedNet in float32
once, within the issue's 1e-6 relative (the shards run the very same arithmetic, so in
practice bitwise too, but no float32 equality is asserted after 10 steps).
"""
import math

import pytest
import torch

import zero_workers
from dpcourse.launch import launch
from dpcourse.zero import ShardedOptimizer, partition

CASES = [("tied", "SGD"), ("tied", "Adam"), ("tied", "AdamW"), ("tiny", "AdamW"),
         ("tied32", "AdamW")]
WORLDS = (2, 3)
RUNS = [(w, case) for w in WORLDS for case in CASES]
CAPS = (25.0, 0.0)  # one bucket; one bucket per parameter
CLOSE = {"rtol": 1e-9, "atol": 1e-12}
CLOSE32 = {"rtol": 1e-6, "atol": 1e-7}  # float32 after 10 steps
ACCUMULATIONS = list(zero_workers.ACCUMULATIONS)
CLIPPINGS = [(w, stage, norm) for w in WORLDS for stage in ("zero1", "zero2")
             for norm in (2.0, math.inf)]


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    """world size -> each rank's results; the rank-count independent checks run on 2."""
    return {w: launch(zero_workers.zero_checks, CASES, w == 2, world_size=w,
                      backend="gloo", timeout=300) for w in WORLDS}


def records(runs, world, case):
    """Each rank's record of case on world ranks."""
    i = CASES.index(case)
    return [runs[world][rank]["sharded"][i] for rank in range(world)]


def run_id(run):
    world, case = run
    return f"{'-'.join(case)}-{world}ranks"


@pytest.mark.parametrize("world, case", RUNS, ids=list(map(run_id, RUNS)))
def test_sharded_optimizer_equals_the_plain_one_after_every_step(runs, world, case):
    for record in records(runs, world, case):
        assert len(record["ours"]) == zero_workers.STEPS
        for ours, plain in zip(record["ours"], record["plain"]):
            assert ours.dtype == (torch.float32 if case[0] == "tied32" else torch.float64)
            torch.testing.assert_close(ours, plain, **(CLOSE32 if case[0] == "tied32"
                                                       else CLOSE))
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


@pytest.mark.parametrize("world", WORLDS)
def test_frozen_parameters_weigh_nothing_in_the_split(runs, world):
    """A 1000-element frozen parameter among trainable ones of 600, 400, 300, 200."""
    for rank_result in runs[world]:
        loads = rank_result["frozen"]["trainable_loads"]
        assert sum(loads) == 1500 and min(loads) > 0
        assert max(loads) - min(loads) <= 600  # the largest trainable parameter


def test_partition_is_greedy_largest_first_and_continues_from_given_loads():
    assert partition([5, 3, 3, 1], 2) == [0, 1, 1, 0]  # loads 6 and 6
    assert partition([1, 1, 1], 2) == [0, 1, 0]
    assert partition([4], 3, loads=[5, 2, 3]) == [1]
    assert partition([], 2) == []


def test_consolidated_state_dict_is_the_plain_optimizers_on_rank_0_only(runs):
    """Two groups, and two layers of two tensors without state: frozen, and not used yet."""
    assert [r["round_trip"]["state_dict_returned_none"] for r in runs[2]] == [False, True]
    for rank_result in runs[2]:
        ours = rank_result["round_trip"]["consolidated"]
        plain = rank_result["round_trip"]["plain_state"]
        assert len(ours["param_groups"]) == 2
        assert ours["param_groups"] == plain["param_groups"]
        assert len(plain["state"]) == sum(len(g["params"]) for g in plain["param_groups"]) - 4
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
        assert r["lrs_after_load"] == [0.05, zero_workers.OPTIMIZERS["AdamW"][1]["lr"]]


@pytest.mark.parametrize("opt_name", ["Adam", "AdamW"])
def test_a_scheduler_and_two_groups_train_like_the_plain_optimizer(runs, opt_name):
    """StepLR divides each group's lr by 10 every 2 steps; the groups differ in lr and
    weight decay."""
    for rank_result in runs[2]:
        r = rank_result["scheduled"][opt_name]
        for ours, plain in zip(r["sharded"], r["plain"]):
            torch.testing.assert_close(ours, plain, **CLOSE)
        lr = zero_workers.OPTIMIZERS[opt_name][1]["lr"]
        decays = (zero_workers.STEPS - 1) // 2  # the lr of the last step: copied at step()
        assert r["local_lrs"] == pytest.approx([0.05 * 0.1**decays, lr * 0.1**decays])


@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
def test_add_param_group_shares_out_the_new_parameters_only(runs, opt_name):
    for rank_result in runs[2]:
        r = rank_result["add_group"][opt_name]
        torch.testing.assert_close(r["sharded"], r["plain"], **CLOSE)
        assert r["owners_after"] == r["owners_before"]
        assert r["local_lrs"] == [zero_workers.OPTIMIZERS[opt_name][1]["lr"], 0.05]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cap", CAPS)
def test_zero2_trains_like_zero1_and_like_plain_ddp(runs, world, cap):
    for rank_result in runs[world]:
        z = rank_result["zero2"][cap]
        torch.testing.assert_close(z["zero1"]["params"], z["ddp"]["params"], **CLOSE)
        torch.testing.assert_close(z["zero2"]["params"], z["zero1"]["params"], **CLOSE)
        torch.testing.assert_close(z["zero2 on torch's DDP"]["params"],
                                   z["zero1 on torch's DDP"]["params"], **CLOSE)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("ddp", ["ours", "torch's"])
def test_zero2_leaves_averaged_gradients_on_owned_parameters_only(runs, world, cap, ddp):
    for rank, rank_result in enumerate(runs[world]):
        z = rank_result["zero2"][cap]
        zero2 = z["zero2" if ddp == "ours" else "zero2 on torch's DDP"]
        owned = [o == rank and t for o, t in zip(zero2["owners"], z["trainable"])]
        assert [g is not None for g in zero2["grads"]] == owned
        assert any(owned) and not all(owned)
        zero1 = z["zero1" if ddp == "ours" else "zero1 on torch's DDP"]
        for mine, ours, full in zip(owned, zero2["grads"], zero1["grads"]):
            if mine:
                torch.testing.assert_close(ours, full, **CLOSE)


@pytest.mark.parametrize("world", WORLDS)
def test_zero2_with_fewer_parameters_than_ranks(runs, world):
    for rank, rank_result in enumerate(runs[world]):
        z = rank_result["zero2_tiny"]
        torch.testing.assert_close(z["zero2"]["params"], z["ddp"]["params"], **CLOSE)
        assert z["zero2"]["owners"] == [0]
        assert [g is not None for g in z["zero2"]["grads"]] == [rank == 0]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("accumulation", ACCUMULATIONS)
def test_accumulating_micro_batches_zero2_trains_like_zero1_and_plain_ddp(runs, world,
                                                                          accumulation):
    """Two or three backwards per step, synchronised or under no_sync: ZeRO-2 must add the
    synchronised gradient it already holds, not average it again."""
    for rank, rank_result in enumerate(runs[world]):
        a = rank_result["accumulation"][accumulation]
        for stage in ("zero1", "zero2"):
            for ours, plain in zip(a[stage]["params"], a["ddp"]["params"]):
                torch.testing.assert_close(ours, plain, **CLOSE)
        for owner, ours, full in zip(a["zero2"]["owners"], a["zero2"]["grads"],
                                     a["ddp"]["grads"]):
            if owner == rank and full is not None:
                torch.testing.assert_close(ours, full, **CLOSE)


@pytest.mark.parametrize("world, stage, norm", CLIPPINGS)
def test_clip_grad_norm_is_torchs_on_the_unsharded_gradients(runs, world, stage, norm):
    for rank_result in runs[world]:
        c = rank_result["clipping"][stage, norm]
        torch.testing.assert_close(c["ours"], c["torch"], **CLOSE)
        assert c["torch"] > 0.05  # it did clip
        for owned, ours, theirs in zip(c["owned"], c["grads"], c["torch_grads"]):
            if (owned or stage == "zero1") and theirs is not None:  # frozen: no gradient
                torch.testing.assert_close(ours, theirs, **CLOSE)


def test_same_parameters_as_torchs_zero_redundancy_optimizer(runs):
    for rank_result in runs[2]:
        torch.testing.assert_close(rank_result["torch_zero"]["ours"],
                                   rank_result["torch_zero"]["torch"], **CLOSE)


def test_same_optimizer_state_bytes_in_all_as_torchs_zero_redundancy_optimizer(runs):
    """In all, not rank by rank: torch's split weighs TiedNet's frozen layer by its size,
    ours gives it no weight (it has no state), so the shards may differ here (on LeNet, with no
    frozen layer, chapter 09 shows the same bytes on each rank)."""
    ours = [r["torch_zero"]["ours_bytes"]["optimizer_state"] for r in runs[2]]
    theirs = [r["torch_zero"]["torch_bytes"]["optimizer_state"] for r in runs[2]]
    assert all(theirs) and sum(ours) == sum(theirs)


def test_clear_errors(runs):
    errors = runs[2][0]["errors"]
    assert errors["class name"].startswith("TypeError: optimizer_cls must be a torch.optim")
    assert errors["not an optimizer"].startswith("TypeError: optimizer_cls must be")
    assert errors["no parameters"] == "ValueError: optimizer got an empty parameter list"
    assert "parameter groups do not match" in errors["wrong state"]
    assert "parameters per group [1] loaded, [9] here" in errors["wrong state"]
    assert errors["hook twice"] == ("RuntimeError: register_comm_hook: a communication hook "
                                    "is already registered (it can be registered only once)")
    assert errors["other parameters"].startswith("ValueError: a parameter of shape (")
    assert errors["other parameters"].endswith("is not one of this optimizer's parameters")
    assert errors["plain optimizer"] == (
        "TypeError: GradientSharding needs a zero.ShardedOptimizer over the module's "
        "parameters, got SGD")
    assert errors["no_sync last"].startswith("RuntimeError: ZeRO-2: a backward under no_sync "
                                             "came after the last synchronised one")


def test_without_a_process_group_the_error_says_how_to_get_one():
    with pytest.raises(RuntimeError, match="dpcourse.launch.launch"):
        ShardedOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=0.1)


def test_one_rank_owns_everything_and_trains_like_the_plain_optimizer():
    with zero_workers.one_rank_group():
        record = zero_workers.sharded_against_plain("tied", "AdamW")
        z = zero_workers.zero2_against_zero1(0.0)
    for ours, plain in zip(record["ours"], record["plain"]):
        torch.testing.assert_close(ours, plain, **CLOSE)
    assert set(record["owners"]) == {0} and record["with_state"] == record["trainable"]
    torch.testing.assert_close(z["zero2"]["params"], z["ddp"]["params"], **CLOSE)
    assert [g is not None for g in z["zero2"]["grads"]] == z["trainable"]
