"""The steps towards SharedMemoryAllreduce (dpcourse.shm_steps) against dist.all_reduce.

One launch per world size (2 and 3): every step class sums every case twice on one object
with a buffer smaller than the largest case, then every SHM_STEPS factory sums a few cases.
"""
import pytest
import torch

import shm_workers
from dpcourse.launch import launch
from dpcourse.shm_steps import SHM_STEPS, WHOLE_TENSOR_BYTES
from shm_checks import LaunchedSegments, assert_equals_all_reduce
from workers import shm_input

WORLDS = [2, 3]
MAX_BYTES = 1 << 14  # 16 KiB in all: 4099 elements take 2-3 rounds, 50_000 take dozens
SIZES = [0, 1, 5, 13, 4099, 50_000]
DTYPES = [torch.float32, torch.float64, torch.int64]
CASES = [(n, dt, False) for n in SIZES for dt in DTYPES] + [(4100, torch.float32, True)]
PASSES = 2  # every case again on the same object
FACTORY_CASES = [(0, torch.float32, False), (5, torch.int64, False),
                 (4099, torch.float32, False), (4100, torch.int64, True)]
STEP_TYPES = ["PlainBarriers", "SharedCounters", "SharedMemoryAllreduce", "SharedMemoryAllreduce"]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def run(request) -> tuple[int, list[dict], LaunchedSegments]:
    """The world size, each rank's report, and the launch's ranks' segment files."""
    with LaunchedSegments() as launched:
        reports = launch(shm_workers.steps_against_all_reduce, CASES, MAX_BYTES, PASSES,
                         FACTORY_CASES, world_size=request.param, backend="gloo", timeout=120)
    return request.param, reports, launched


def rank_order_sum(world: int, call: int, numel: int, dtype: torch.dtype,
                   transposed: bool) -> torch.Tensor:
    """The inputs of that call summed one rank after another, as every step sums a slice."""
    inputs = [shm_input(shm_workers.seed_rank(r, call), numel, dtype, transposed)
              for r in range(world)]
    total = inputs[0].clone()
    for x in inputs[1:]:
        total += x
    return total


def test_every_step_sums_like_dist_all_reduce_on_repeated_calls(run):
    _, reports, _ = run
    for report in reports:
        assert list(report["records"]) == ["PlainBarriers", "SharedCounters",
                                           "SharedMemoryAllreduce"]
        for records in report["records"].values():
            assert [(r["call"], r["case"]) for r in records] == [
                (call, case) for call in range(PASSES) for case in CASES]
            for record in records:
                assert_equals_all_reduce(record)


def test_every_step_gives_the_same_bits_on_every_rank(run):
    world, reports, _ = run
    for name in reports[0]["records"]:
        for i, record in enumerate(reports[0]["records"][name]):
            expected = rank_order_sum(world, record["call"], *record["case"])
            for report in reports:
                assert torch.equal(report["records"][name][i]["result"], expected), \
                    (name, record["case"])


def test_every_step_sums_in_place_and_returns_the_input(run):
    _, reports, _ = run
    for report in reports:
        for records in report["records"].values():
            assert all(r["returned_input"] for r in records)


def test_shm_steps_lists_the_four_steps_in_order(run):
    world, reports, _ = run
    for report in reports:
        built = report["factories"]
        assert list(built) == list(SHM_STEPS)
        assert [b["type"] for b in built.values()] == STEP_TYPES
        buffers = [b["buffer_bytes"] for b in built.values()]  # regions start on cache lines
        assert WHOLE_TENSOR_BYTES - 64 * world <= buffers[0] == buffers[1] == buffers[2]
        assert (2 << 20) - 64 * world <= buffers[3] <= 2 << 20


def test_every_factory_builds_a_working_allreduce(run):
    _, reports, _ = run
    for report in reports:
        for label, built in report["factories"].items():
            assert [r["case"] for r in built["records"]] == FACTORY_CASES, label
            for record in built["records"]:
                assert_equals_all_reduce(record)
                assert record["returned_input"]


def test_no_segment_outlives_its_mapping(run):
    _, reports, launched = run
    assert launched.removed_by_launch == set()  # each rank removed its own file
    assert launched.left() == set()
    for report in reports:
        assert report["files_while_open"] == []  # removed as soon as every rank mapped it
        assert report["mapped_after_close"] == 0
