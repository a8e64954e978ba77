"""p2p.allreduce and p2p.ring_allreduce against dist.all_reduce, in real processes.

One launch of 4 ranks runs every case in groups of the first 1, 2, 3 and 4 ranks:
dist.all_reduce gives the expected sum, then ours runs with every collective of
torch.distributed patched to raise.
"""
import pytest
import torch
import torch.distributed as dist

from dpcourse import _workers, p2p
from dpcourse.launch import launch

WORLDS = [1, 2, 3, 4]
ALGORITHMS = ("allreduce", "ring_allreduce")
NO_KWARGS: dict = {}
SMALL_PIECES = [(1000, torch.float32, False, 64), (100_003, torch.float64, False, 5000),
                (1000, torch.int64, True, 7), (2, torch.int64, False, 1)]
CASES = (
    [(a, n, torch.float32, False, NO_KWARGS) for a in ALGORITHMS
     for n in (0, 1, 3, 1000, 100_003)]
    + [(a, n, dt, False, NO_KWARGS) for a in ALGORITHMS for n in (3, 1000)
       for dt in (torch.float64, torch.int64)]
    + [(a, 1000, dt, True, NO_KWARGS) for a in ALGORITHMS
       for dt in (torch.float32, torch.int64)]
    # small pieces: each chunk travels in several pieces, step by step or streamed
    + [("ring_allreduce", n, dt, t, {"piece_numel": piece, "streamed": streamed})
       for streamed in (False, True) for n, dt, t, piece in SMALL_PIECES]
    + [("ring_allreduce", 100_003, torch.float32, False, {"streamed": True})])


@pytest.fixture(scope="module")
def runs() -> list[list[dict]]:
    """For each of 4 ranks, its records: our result, dist.all_reduce's, elements sent."""
    return launch(_workers.p2p_against_all_reduce, CASES, WORLDS, world_size=4,
                  backend="gloo", timeout=120)


def records(runs: list[list[dict]], world: int) -> list[list[dict]]:
    """For each rank of the group of the first `world` ranks, its record for every case."""
    return [[r for r in runs[rank] if r["world"] == world] for rank in range(world)]


@pytest.mark.parametrize("world", WORLDS)
def test_sums_equal_dist_all_reduce(runs, world):
    for per_case in records(runs, world):
        assert [r["case"] for r in per_case] == CASES
        for r in per_case:
            assert r["result"].shape == r["expected"].shape
            assert r["result"].dtype == r["expected"].dtype
            # only the order of 1 to 4 additions differs: rounding of the largest value
            rtol = {torch.float32: 1e-6, torch.float64: 1e-12}.get(r["expected"].dtype, 0.0)
            scale = r["expected"].abs().max().item() if r["expected"].numel() else 0.0
            torch.testing.assert_close(r["result"], r["expected"], rtol=rtol, atol=rtol * scale,
                                       msg=lambda m, r=r: f"{r['case']}: {m}")


def test_non_contiguous_input_is_summed_in_place(runs):
    transposed = [r for r in runs[0] if r["case"][3]]
    assert transposed and all(not r["contiguous"] for r in transposed)


@pytest.mark.parametrize("world", WORLDS)
def test_naive_traffic_goes_through_rank_0(runs, world):
    for i, (name, numel, *_) in enumerate(CASES):
        if name == "allreduce":
            sent = [per_case[i]["sent"] for per_case in records(runs, world)]
            assert sent == [(world - 1) * numel] + [numel] * (world - 1)


@pytest.mark.parametrize("world", WORLDS)
def test_ring_traffic_is_2_world_minus_1_over_world(runs, world):
    for i, (name, numel, *_) in enumerate(CASES):
        if name == "ring_allreduce":
            sent = [per_case[i]["sent"] for per_case in records(runs, world)]
            assert sum(sent) == 2 * (world - 1) * numel  # every chunk makes 2(w-1) hops
            chunks = [len(c) for c in torch.arange(numel).tensor_split(world)]
            assert sent == [sum(chunks[(r - s) % world] for s in range(2 * (world - 1)))
                            for r in range(world)], (CASES[i], sent)  # 2(w-1)/w N, exactly


def test_forbidding_collectives_really_forbids_them():
    with _workers.no_collectives():
        with pytest.raises(AssertionError, match="collective dist.all_reduce called"):
            dist.all_reduce(torch.zeros(1))
        with pytest.raises(AssertionError, match="collective dist.broadcast called"):
            dist.broadcast(torch.zeros(1), 0)
    assert dist.all_reduce is not None and "forbidden" not in repr(dist.all_reduce)


@pytest.mark.parametrize("fn", [p2p.allreduce, p2p.ring_allreduce])
def test_clear_errors_for_unsupported_input(fn):
    with pytest.raises(TypeError, match="torch.Tensor"):
        fn([1.0, 2.0])
    with pytest.raises(TypeError, match="supports float32, float64, int64; got torch.int32"):
        fn(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="default process group"):
        fn(torch.zeros(3))
    if fn is p2p.ring_allreduce:
        with pytest.raises(ValueError, match="piece_numel"):
            fn(torch.zeros(3), piece_numel=0)


def test_ring_steps_match_chapter_03_schedule():
    from dpcourse.ring import ring_schedule
    for world in (2, 3, 4):
        for step, (_, transfers) in enumerate(ring_schedule(world)):
            for src, dst, chunk in transfers:
                assert p2p.ring_chunks(src, world, step)[0] == chunk
                assert p2p.ring_chunks(dst, world, step)[1] == chunk
