"""SharedMemoryAllreduce against dist.all_reduce, in real processes.

The collective works on the default process group, so each world size (1 to 4) gets one
launch, which runs every case in turn on one object, then its error cases.
"""
import os

import pytest
import torch

import shm_workers
import workers
from dpcourse.launch import RankError, launch
from dpcourse.shm import SharedMemoryAllreduce
from shm_checks import LaunchedSegments, a_segment_of_another_process, assert_equals_all_reduce

WORLDS = [1, 2, 3, 4]
MAX_BYTES = 1 << 16  # 64 KiB in all: 50_000 elements take several rounds
SIZES = [0, 1, 5, 13, 4099, 50_000]
DTYPES = [torch.float32, torch.float64, torch.int64]
CASES = ([(n, dt, False) for n in SIZES for dt in DTYPES]
         + [(4100, torch.float32, True), (50_000, torch.int64, True), (20, torch.float64, True)])


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def run(request) -> tuple[int, list[dict], LaunchedSegments]:
    """The world size, each rank's report, and the launch's ranks' segment files."""
    with LaunchedSegments() as launched:
        reports = launch(workers.shm_against_all_reduce, CASES, MAX_BYTES,
                         world_size=request.param, backend="gloo", timeout=60)
    return request.param, reports, launched


def test_sums_equal_dist_all_reduce(run):
    world, reports, _ = run
    for report in reports:
        assert [r["case"] for r in report["records"]] == CASES
        for r in report["records"]:
            assert_equals_all_reduce(r)


def test_every_slice_is_summed_in_rank_order(run):
    world, reports, _ = run
    for i, (numel, dtype, transposed) in enumerate(CASES):
        expected = workers.shm_input(0, numel, dtype, transposed).clone()
        for rank in range(1, world):
            expected += workers.shm_input(rank, numel, dtype, transposed)
        for report in reports:  # the same bits on every rank
            assert torch.equal(report["records"][i]["result"], expected), CASES[i]


def test_sums_in_place_and_returns_the_input(run):
    _, reports, _ = run
    for report in reports:
        assert all(r["returned_input"] for r in report["records"])
        assert [not r["contiguous"] for r in report["records"]] == [t for *_, t in CASES]


def test_no_segment_outlives_its_mapping(run):
    _, reports, launched = run
    assert launched.removed_by_launch == set()  # each rank removed its own file
    assert launched.left() == set()
    for report in reports:
        assert report["files_while_open"] == []  # removed as soon as every rank mapped it
        assert report["mapped_after_close"] == 0


def test_wrong_calls_raise_the_same_clear_error_on_every_rank(run):
    world, reports, _ = run
    if world == 1:
        pytest.skip("mismatches need two ranks")
    for rank, report in enumerate(reports):
        e = report["errors"]
        assert e["numel"].startswith("ValueError") and "rank 1: 6 x float32" in e["numel"]
        assert e["dtype"].startswith("ValueError") and "rank 1: 5 x float64" in e["dtype"]
        assert e["int32"].startswith("TypeError") and "int32" in e["int32"]
        assert e["meta"].startswith("ValueError") and "CPU tensors" in e["meta"]
        assert e["max_bytes"].startswith("ValueError") and "max_bytes" in e["max_bytes"]
        for bad in ("negative max_bytes", "float max_bytes"):
            assert e[bad].startswith("ValueError: max_bytes must be a whole number of bytes")
        assert e["works_after"] == [float(world)] * 7
        if rank != 1:
            assert e["timeout"].startswith("TimeoutError")
            assert "rank 1 did not arrive" in e["timeout"]
            assert e["after_timeout"] == "RuntimeError: this SharedMemoryAllreduce is closed"


def test_no_segment_left_when_a_rank_is_killed():
    with LaunchedSegments() as launched, pytest.raises(RankError, match="killed by signal"):
        launch(workers.shm_crash, 1, world_size=2, backend="gloo", timeout=30)
    assert launched.removed_by_launch == set() and launched.left() == set()


def test_no_segment_left_when_a_rank_is_killed_while_building_it():
    with LaunchedSegments() as launched, pytest.raises(RankError, match="killed by signal"):
        launch(workers.shm_crash_while_building, 1, world_size=2, backend="gloo", timeout=30)
    assert len(launched.removed_by_launch) == 1  # the killed rank's, which launch removed
    assert launched.left() == set()


def test_a_segment_another_test_holds_meanwhile_is_not_counted_as_this_launchs():
    """Under xdist another worker's ranks hold segments while this launch runs (issue 34:
    diffing all of /dev/shm counted them as leaks)."""
    theirs = a_segment_of_another_process(os.getpid())
    try:
        with LaunchedSegments() as launched:
            launch(workers.shm_against_all_reduce, CASES[:1], MAX_BYTES, world_size=2,
                   backend="gloo", timeout=60)
        assert launched.removed_by_launch == set() and launched.left() == set()
        assert len(launched.pids) == 2 and theirs.exists()
    finally:
        theirs.unlink()


def test_a_long_wait_sleeps_until_the_late_rank_arrives():
    """Waiting half a second for a late rank, the thread sleeps in the kernel and uses at most
    a twentieth of that in CPU time (issue 34: spinning on sched_yield used 98% of a free
    core, and beside busy programs kept the waiter runnable), and the late rank's arrival
    wakes it: it does not sleep on until its 20 s timeout."""
    wait, _ = launch(shm_workers.wait_for_a_late_rank, 0.5, 20.0, world_size=2,
                     backend="gloo", timeout=60)
    assert 0.25 < wait["wall"] < 10, wait  # it waited for rank 1, and woke when it came
    assert wait["cpu"] < wait["wall"] / 20, wait
    assert wait["sleeps"] >= 1, wait


def test_a_late_rank_does_not_extend_the_wait_for_a_missing_one():
    """Rank 1 comes 1.5 s late, rank 2 never: rank 0 gives up on rank 2 when its own 2 s
    timeout is up, not 2 s after rank 1 came (a deadline per peer, or a futex wait of the
    whole timeout each time, would wait 3.5 s); rank 1 too, 2 s after it began to wait."""
    late_s, timeout = 1.5, 2.0
    with LaunchedSegments() as launched:
        reports = launch(shm_workers.wait_past_a_late_rank_for_a_missing_one, late_s, timeout,
                         world_size=3, backend="gloo", timeout=30)
    for wait in reports[:2]:
        assert wait["error"].startswith("TimeoutError"), wait
        assert "rank 2 did not arrive within 2 s" in wait["error"], wait  # rank 1 came
        assert timeout <= wait["wall"] < timeout + 1.0, wait  # the 1.5 s not added
    assert reports[2] is None
    assert launched.removed_by_launch == set() and launched.left() == set()


def test_needs_the_default_process_group():
    with pytest.raises(RuntimeError, match="default process group"):
        SharedMemoryAllreduce(1 << 12)
