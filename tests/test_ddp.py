"""ScratchDDP trains like one process on the global batch and like torch's DDP.

One launch of 2 ranks trains a TiedNet (a tied weight, a frozen layer, a buffer, a layer
unused in one step), initialised differently on each rank, under every configuration;
the single-process reference is trained here, from rank 0's initial weights. On 2 and 3 ranks,
a forward that trains nothing between a forward and its backward changes nothing, as in torch's.
"""
import pytest
import torch
from torch import nn

import workers
from dpcourse.experiments import rank_demos
from dpcourse.ddp import make_buckets
from dpcourse.launch import launch

WORLD = 2
ONE_BUCKET, TWO_BUCKETS, PER_PARAMETER = 25.0, 1000 / 2**20, 0.0  # TiedNet holds 1664 bytes
CONFIGS = (
    [{"ddp": "scratch", "cap": cap, "hook": hook, "micro": 1}
     for hook in (None, "ring") for cap in (ONE_BUCKET, TWO_BUCKETS, PER_PARAMETER)]
    + [{"ddp": "scratch", "cap": PER_PARAMETER, "hook": hook, "micro": 2}
       for hook in (None, "ring")]
    + [{"ddp": "scratch", "cap": cap, "hook": "shm", "micro": micro}
       for cap, micro in ((TWO_BUCKETS, 1), (PER_PARAMETER, 2))]
    + [{"ddp": "scratch", "cap": TWO_BUCKETS, "hook": "allreduce", "micro": 1}]
    # the same hook functions registered on torch's DDP
    + [{"ddp": "torch", "hook": hook, "micro": 1} for hook in ("allreduce", "ring", "shm")]
    + [{"ddp": "torch", "hook": None, "micro": 1}, {"ddp": "torch", "hook": None, "micro": 2}])


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    """For each rank, one record per config: the final state_dict and bucket statistics."""
    return launch(workers.ddp_runs, CONFIGS, world_size=WORLD, backend="gloo", timeout=120)


def single_process(micro_batches: int) -> dict:
    """The reference: rank 0's initial weights, trained on the whole of every batch."""
    return workers.train_steps(workers.tied_net(seed=0), 0, 1, micro_batches)


def unprefixed(state: dict) -> dict:
    assert all(k.startswith("module.") for k in state)  # as torch's DDP and DataParallel
    return {k.removeprefix("module."): v for k, v in state.items()}


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=lambda i: str(CONFIGS[i]))
def test_training_equals_one_process_on_the_global_batch(runs, i):
    reference = single_process(CONFIGS[i]["micro"])
    for rank in range(WORLD):
        state = unprefixed(runs[rank][i]["state"])
        assert state.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("i", range(len(CONFIGS) - 2), ids=lambda i: str(CONFIGS[i]))
def test_scratch_equals_torch_ddp(runs, i):
    torch_run = CONFIGS.index({"ddp": "torch", "hook": None, "micro": CONFIGS[i]["micro"]})
    for rank in range(WORLD):
        ours, theirs = runs[rank][i]["state"], runs[rank][torch_run]["state"]
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-9, atol=1e-12)


def test_bucket_counts_and_overlap(runs):
    expected = {ONE_BUCKET: 1, TWO_BUCKETS: 2, PER_PARAMETER: 7}  # 7 trainable, tied once
    for record in runs[0]:
        cfg = record["config"]
        if cfg["ddp"] == "scratch":
            assert record["buckets"] == expected[cfg["cap"]]
            # in the last step every layer is used: each bucket launched during backward
            assert record["launched_in_backward"] == record["buckets"]
            assert [b for b, _, _ in record["timeline"]] == list(range(record["buckets"]))
            # one allreduce per bucket and step: none under no_sync, none for the frozen layer
            assert record["hook_calls"] == workers.STEPS * record["buckets"]


def test_buckets_go_through_the_collective_each_config_names(runs):
    """gloo's all_reduce, our ring (isend, no all_reduce) or shared memory (neither)."""
    for record in runs[0]:
        cfg, calls = record["config"], record["calls"]
        if cfg["ddp"] != "scratch":
            continue
        if cfg["hook"] == "shm":
            assert calls == {"all_reduce": 0, "isend": 0}
        elif cfg["hook"] == "ring":
            assert calls["all_reduce"] == 0 and calls["isend"] >= record["hook_calls"]
        else:
            assert calls == {"all_reduce": record["hook_calls"], "isend": 0}


def test_a_parameter_unused_on_one_rank_only_trains_like_torch_ddp():
    """Rank 1 alone skips a layer in one step: no hang, and the same training as torch's DDP
    with find_unused_parameters=True (rank 1 adds a zero gradient for that layer)."""
    for ranks_runs in launch(workers.unused_on_rank_1, world_size=WORLD, backend="gloo",
                             timeout=60):
        theirs = ranks_runs.pop("torch")
        assert not torch.equal(theirs["module.sometimes.weight"],
                               workers.tied_net(seed=0).sometimes.weight)  # it trained
        used = ranks_runs.pop("torch, used everywhere")["module.sometimes.weight"]
        assert not torch.allclose(theirs["module.sometimes.weight"], used)  # the skip mattered
        for name, ours in ranks_runs.items():
            for key, value in theirs.items():
                torch.testing.assert_close(ours[key], value, rtol=1e-9, atol=1e-12,
                                           msg=f"{name}: {key}")


def test_a_layer_no_rank_uses_is_left_alone_with_find_unused_parameters_as_in_torch_ddp():
    """With momentum, a gradient of zeros still moves a parameter: torch's DDP leaves the
    gradient of a parameter no rank used as it was (None after zero_grad), and so must
    ScratchDDP(find_unused_parameters=True); without the flag it averages zeros. A parameter
    a rank used under no_sync() since the last synchronised backward counts as used."""
    for states in launch(workers.unused_with_momentum, world_size=WORLD, backend="gloo",
                         timeout=120):
        for run in ("", ", 2 micro"):
            for key, value in states["torch" + run].items():
                torch.testing.assert_close(states["scratch" + run][key], value, rtol=0,
                                           atol=1e-12, msg=f"{key}{run}")
        moved = states["scratch without the flag"]["module.sometimes.weight"]
        assert not torch.allclose(moved, states["torch"]["module.sometimes.weight"])


def test_frozen_parameter_and_buffer_are_rank_0s_on_every_rank(runs):
    start = workers.tied_net(seed=0)
    for rank in range(WORLD):
        for record in runs[rank]:
            state = unprefixed(record["state"])
            assert torch.equal(state["frozen.weight"], start.frozen.weight.detach())
            assert torch.equal(state["offset"], start.offset)  # broadcast, never changed


def test_buckets_are_reverse_order_and_capped():
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # 64, 16, 32, 8 bytes (float32)
    params = list(layers.parameters())
    names = {id(p): n for n, p in layers.named_parameters()}

    def named(cap):
        return [[names[id(p)] for p in b] for b in make_buckets(params, cap)]
    assert named(1.0) == [["1.bias", "1.weight", "0.bias", "0.weight"]]
    assert named(56 / 2**20) == [["1.bias", "1.weight", "0.bias"], ["0.weight"]]
    assert named(0) == [["1.bias"], ["1.weight"], ["0.bias"], ["0.weight"]]
    assert named(10 / 2**20) == [["1.bias"], ["1.weight"], ["0.bias"], ["0.weight"]]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        make_buckets(params, -1)


def test_a_parameter_without_elements_gets_its_own_bucket_at_cap_0():
    params = [nn.Parameter(torch.empty(3)), nn.Parameter(torch.empty(0))]
    assert [len(b) for b in make_buckets(params, 0)] == [1, 1]


def test_broadcast_then_averaged_gradients_equal_one_process_on_the_global_batch():
    g = torch.Generator().manual_seed(0)
    X = torch.rand(16, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (16,), generator=g)
    for result in launch(rank_demos.steps_one_and_two, X, y, world_size=WORLD, backend="gloo",
                         timeout=120):
        assert result["same start"]  # ranks began from different seeds
        assert result["gradient difference"] < 1e-12  # float64: rounding only


@pytest.fixture(scope="module")
def evaluation_and_broken_hook() -> list[dict]:
    return launch(workers.evaluate_on_rank_0_only, world_size=WORLD, backend="gloo", timeout=30)


def test_evaluation_under_no_grad_on_rank_0_alone_runs_no_collective(evaluation_and_broken_hook):
    ranks = evaluation_and_broken_hook
    assert ranks[0]["grad"] == ranks[1]["grad"] != 0  # the training step after it synchronised


def test_a_comm_hook_returning_the_wrong_size_gives_a_clear_error(evaluation_and_broken_hook):
    for rank in evaluation_and_broken_hook:
        assert rank["wrong size"] == ("ValueError: comm hook wrong_size_hook returned 21 "
                                      "elements for bucket 0, which holds 20")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"{world} ranks")
def evaluated(request) -> list[dict[str, dict]]:
    """Per rank: training with a forward that trains nothing between forward and backward."""
    return launch(workers.evaluations_between_forward_and_backward, list(workers.EVALUATIONS),
                  world_size=request.param, backend="gloo", timeout=180)


@pytest.mark.parametrize("name", workers.EVALUATIONS)
def test_a_forward_between_forward_and_backward_changes_no_training_as_in_torch_ddp(
        evaluated, name):
    """A forward for logging (under no_grad, inference_mode, in eval mode, inside no_sync)
    before backward: torch's DDP still averages; ScratchDDP must too (within 1e-12, float64),
    its buckets still launched while backward runs (not all left for its end)."""
    for rank_runs in evaluated:
        launched, buckets = rank_runs[f"launched in backward, {name}"]
        assert launched == buckets, f"{name}: {launched} of {buckets} buckets during backward"
        reference = rank_runs["torch, none"]
        for ddp in ("torch", "scratch"):
            state = rank_runs[f"{ddp}, {name}"]
            for key, value in reference.items():
                torch.testing.assert_close(state[key], value, rtol=0, atol=1e-12,
                                           msg=f"{ddp}, {name}: {key}")


@pytest.mark.parametrize("world", [2, 3])
def test_activation_checkpointing_of_any_block_trains_like_one_process(world):
    """A reentrant checkpoint backpropagates its block in a backward of its own, nested in
    the loss's: on the last block, the gradients of the layers before it arrive after that
    one ends (issue 34: ScratchDDP ended its backward there, averaging zeros for them, and
    the ranks kept their own). Float64, within 1e-12."""
    modes, blocks = ["reentrant", "non_reentrant"], ["first", "middle", "head"]
    reference = workers.train_checkpointed(workers.CheckpointedNet(None, "", seed=0), 0, 1)
    runs = launch(workers.scratch_ddp_under_checkpointing, modes, blocks, world_size=world,
                  backend="gloo", timeout=60)
    for rank, states in enumerate(runs):
        for name, state in states.items():
            for key, value in reference.items():
                torch.testing.assert_close(state[key], value, rtol=0, atol=1e-12,
                                           msg=f"rank {rank}, {name}: {key}")
