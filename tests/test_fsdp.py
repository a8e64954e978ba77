"""ScratchFSDP (chapter 10) trains exactly like one process on the global batch, holds only
its shards between steps, and says clearly what it cannot follow.

One launch of training checks and one of the rest, on 1, 2 and 3 ranks. The training models
are float64, so after 4 AdamW steps any difference is rounding: 1e-9 relative (in practice
below 1e-15). bfloat16 keeps 8 significant bits, so each rounding errs by up to 2^-8
relative; forward and backward chain a few of them and the ranks' gradients are summed in
bfloat16, so a bfloat16 gradient is compared within 2^-6 of the largest gradient element
(measured: about 5e-3).
"""
import math
from collections import defaultdict

import pytest
import torch

import fsdp_workers
from dpcourse.fsdp import ScratchFSDP, flat_shard, padded_numel, unflatten
from dpcourse.launch import launch

WORLDS = (1, 2, 3)
CLOSE = {"rtol": 1e-9, "atol": 1e-12}
BF16_SHARE = 2.0**-6  # of the largest gradient element


@pytest.fixture(scope="module")
def trained() -> dict[int, dict]:
    """world size -> rank 0's training results (every rank returns the same full state)."""
    return {w: launch(fsdp_workers.training_checks, world_size=w, backend="gloo",
                      timeout=300) for w in WORLDS}


@pytest.fixture(scope="module")
def checked() -> dict[int, list[dict]]:
    """world size -> each rank's results of the other checks."""
    return {w: launch(fsdp_workers.extra_checks, world_size=w, backend="gloo", timeout=300)
            for w in WORLDS}


def assert_states_close(ours: dict, theirs: dict, **tolerance) -> None:
    assert list(ours) == list(theirs)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], **(tolerance or CLOSE), msg=key)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(fsdp_workers.MODELS))
@pytest.mark.parametrize("way", fsdp_workers.WAYS, ids=lambda w: f"prefetch={w[0]}-ring={w[1]}")
def test_k_ranks_train_like_one_process_on_the_global_batch(trained, world, name, way):
    expected = fsdp_workers.reference(name)
    for rank_result in trained[world]:
        assert_states_close(rank_result["trained"][(name, *way)], expected)


@pytest.mark.parametrize("world", WORLDS)
def test_gradients_are_averaged_not_summed_plain_sgd_shows_it(trained, world):
    expected = fsdp_workers.reference("small", fsdp_workers.sgd)
    assert_states_close(trained[world][0]["sgd"], expected)


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_trains_like_torchs_ddp(trained, world):
    ddp = trained[world][0]["torch_ddp"]
    assert_states_close(trained[world][0]["trained"][("small", True, False)], ddp)


@pytest.mark.parametrize("world", WORLDS)
def test_the_courses_lenet_trains_as_one_root_unit(trained, world):
    expected = fsdp_workers.reference("root", fsdp_workers.sgd)
    assert_states_close(trained[world][0]["root_unit"], expected)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(fsdp_workers.MODELS))
def test_between_steps_a_rank_holds_only_its_shard_of_each_unit(trained, world, name):
    for held in (r["held"][name] for r in trained[world]):
        assert all(shard == math.ceil(n / world) for n, shard in held["units"])
        assert not any(held["full_alive"]) and held["placeholders"]
        assert held["state_numels"] == sorted(2 * held["shard_numels"])  # Adam's two moments
    frozen = {"frozen": 4 * 9 + 4 + 16 + 16 * 10 + 10, "buffers": 2}  # whole on every rank
    assert trained[world][0]["held"][name]["stored_full"] == frozen.get(name, 0)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("way", ["bf16", "bf16 ring"])
def test_bfloat16_compute_matches_one_process_with_the_same_casts(checked, world, way):
    expected = fsdp_workers.bf16_reference()
    for r in checked[world]:
        assert all(dtype == torch.float32 for dtype in r[way]["master_dtypes"])
        for key, gradient in r[way]["gradient"].items():
            scale = expected["float32"][key].abs().max().item()
            torch.testing.assert_close(gradient, expected["bfloat16"][key], rtol=0,
                                       atol=BF16_SHARE * scale, msg=key)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("way", ["bf16 frozen", "bf16 frozen ring"])
def test_bfloat16_compute_casts_frozen_parameters_too_and_keeps_them_float32(checked, world,
                                                                              way):
    expected = fsdp_workers.bf16_reference("frozen")
    for r in checked[world]:
        assert "error" not in r[way], r[way].get("error")
        assert all(dtype == torch.float32 for dtype in r[way]["master_dtypes"])
        for key, update in r[way]["gradient"].items():
            if key not in expected["bfloat16"]:  # frozen: whole, float32, unchanged
                assert update.dtype == torch.float32 and not update.any(), key
                continue
            scale = expected["float32"][key].abs().max().item()
            torch.testing.assert_close(update, expected["bfloat16"][key], rtol=0,
                                       atol=BF16_SHARE * scale, msg=key)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clip_grad_norm_is_torchs_on_the_whole_model(checked, world, max_norm):
    expected = fsdp_workers.clip_reference(max_norm)
    for r in checked[world]:
        assert r["clip"][max_norm]["norm"] == pytest.approx(expected["norm"], rel=1e-12)
        assert_states_close(r["clip"][max_norm]["gradient"], expected["gradient"])


@pytest.mark.parametrize("world", WORLDS)
def test_full_state_dict_round_trips_into_the_module_and_a_fresh_fsdp(checked, world):
    for r in checked[world]:
        sd = r["state_dict"]
        assert list(sd["saved"]) == sd["keys"]
        assert sd["devices_dtypes"] == {("cpu", torch.float64)}
        assert_states_close(sd["fresh_saved"], sd["saved"], rtol=0, atol=0)
        for copy in ("unwrapped", "fresh"):
            torch.testing.assert_close(sd["outputs"][copy], sd["outputs"]["wrapped"], rtol=0,
                                       atol=0)


@pytest.mark.parametrize("world", WORLDS)
def test_a_step_gathers_every_unit_twice_and_reduce_scatters_it_once(checked, world):
    for timeline in checked[world][0]["timeline"].values():
        padded = sum(timeline["padded"]) * 8  # float64
        assert timeline["bytes"] == (2 * padded, padded)
    bf16 = sum(padded_numel(n, world) for n in (40, 1040, 170))
    assert checked[world][0]["bf16"]["bytes"] == (2 * 2 * bf16, 2 * bf16)  # half of float32


def gathers_and_ends(events: list, phase: str) -> tuple[dict, dict]:
    """Each unit's all-gather start in phase (of its two in a step, the first for "forward",
    the second for "backward"), and the end of its compute in that phase."""
    starts, ended = defaultdict(list), {}
    for kind, unit, start, end in events:
        if kind == "all-gather":
            starts[unit].append(start)
        if kind == phase:
            ended[unit] = end
    return {unit: sorted(s)[phase == "backward"] for unit, s in starts.items()}, ended


@pytest.mark.parametrize("phase, step", [("forward", 1), ("backward", 0), ("backward", 1)])
def test_prefetch_starts_the_next_units_gather_before_the_current_unit_ends(checked, phase,
                                                                            step):
    """Forward prefetches by the last forward's order (so not in the first step); backward by
    this forward's, reversed: from the first step on, as torch's FSDP2."""
    for prefetch, timeline in checked[2][0]["timeline"].items():
        started, ended = gathers_and_ends(timeline["steps"][step], phase)
        order = timeline["order"] if phase == "forward" else timeline["order"][::-1]
        early = [started[after] < ended[unit] for unit, after in zip(order, order[1:])]
        assert all(early) if prefetch else not any(early), (phase, step, prefetch, early)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("way", ["close()", "with"])
def test_close_and_a_with_block_end_the_helper_thread_and_remove_the_hooks(checked, world,
                                                                          way):
    expected = fsdp_workers.small_net(0).double().state_dict()
    for r in checked[world]:
        assert "error" not in r["close"], r["close"].get("error")
        closed = r["close"][way]
        assert closed["threads"] == 0 and closed["hooks"] == 0
        assert closed["freed"]  # no hook left holding the wrapper in a cycle
        assert closed["after close"].startswith("ScratchFSDP: a forward after the wrapper is "
                                                "closed")
        assert "load full_state_dict() (on every rank" in closed["after close"]
        assert_states_close(closed["state"], expected, rtol=0, atol=0)
        assert_states_close(closed["fresh copy"], expected, rtol=0, atol=0)  # as it says
        if way == "with":
            assert r["close"]["backward after with"].startswith(
                "ScratchFSDP: a backward after the wrapper is closed")


def test_misuse_gives_clear_errors(checked):
    errors = checked[2][0]["errors"]
    assert "ValueError: units must be submodules" in errors["not a submodule"]
    assert "listed twice" in errors["listed twice"]
    assert "params.0 is used while its unit is not gathered" in errors[
        "no units for a ParameterList"]
    assert "units=[] puts everything in one root unit" in errors["no units for a ParameterList"]
    assert "called outside the wrapper's forward" in errors["unit called alone"]
    assert "missing keys ['0.bias']" in errors["missing key"]
    assert "0.bias has shape (5,), the module's (4,)" in errors["wrong shape"]


def test_without_a_process_group_the_error_says_how_to_get_one():
    with pytest.raises(RuntimeError, match="needs the default process group"):
        ScratchFSDP(fsdp_workers.small_net(0))


@pytest.mark.parametrize("numel, world", [(10, 3), (9, 3), (1, 4), (7, 1)])
def test_flat_shards_are_equal_padded_slices_that_concatenate_to_the_flat_vector(numel, world):
    flat = torch.arange(1.0, numel + 1)
    shards = [flat_shard(flat, r, world) for r in range(world)]
    assert all(len(s) == math.ceil(numel / world) for s in shards)
    assert padded_numel(numel, world) == len(torch.cat(shards))
    torch.testing.assert_close(torch.cat(shards)[:numel], flat, rtol=0, atol=0)
    assert torch.cat(shards)[numel:].eq(0).all()


def test_unflatten_gives_views_shaped_like_the_parameters_in_order():
    full = torch.arange(12.0)
    views = unflatten(full, [torch.Size([2, 2]), torch.Size([3]), torch.Size([1, 2])])
    assert [v.shape for v in views] == [(2, 2), (3,), (1, 2)]
    assert all(v.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() for v in views)
    assert views[2].flatten().tolist() == [7.0, 8.0]


@pytest.mark.parametrize("world", WORLDS)
def test_two_backwards_before_a_step_add_their_gradients(checked, world):
    """Gradient accumulation: each backward adds its averaged gradient to the shard's .grad
    (one that overwrote it would keep the second micro-batch's only)."""
    model = fsdp_workers.small_net(0).double()
    for step in (0, 1):
        x, y = fsdp_workers.batch(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    for r in checked[world]:
        assert_states_close(r["accumulated"], expected)
