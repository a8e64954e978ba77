"""p2p.allreduce and p2p.ring_allreduce against dist.all_reduce, and the ring's two halves
against dist.reduce_scatter_tensor and dist.all_gather_into_tensor, in real processes.

One launch of 4 ranks runs every allreduce case in groups of the first 1, 2, 3 and 4 ranks,
one launch of 3 ranks every case of the halves in groups of the first 1, 2 and 3: torch's
collective gives the expected result, then ours runs with every collective of
torch.distributed patched to raise.
"""
import pytest
import torch
import torch.distributed as dist

import workers
from dpcourse import p2p
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
    return launch(workers.p2p_cases_in_subgroups, CASES, WORLDS, world_size=4,
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
            # every chunk twice (once per half), but a rank's own chunk and its right-hand
            # neighbour's once: 2(w-1)/w N, exactly
            chunks = [len(c) for c in torch.arange(numel).tensor_split(world)]
            assert sent == [2 * numel - chunks[r] - chunks[(r + 1) % world]
                            for r in range(world)], (CASES[i], sent)


def test_forbidding_collectives_really_forbids_them():
    with workers.no_collectives():
        with pytest.raises(AssertionError, match="collective dist.all_reduce called"):
            dist.all_reduce(torch.zeros(1))
        with pytest.raises(AssertionError, match="collective dist.broadcast called"):
            dist.broadcast(torch.zeros(1), 0)
    assert dist.all_reduce is not None and "forbidden" not in repr(dist.all_reduce)


@pytest.mark.parametrize("fn", [p2p.allreduce, p2p.ring_allreduce, p2p.ring_reduce_scatter,
                                p2p.ring_all_gather])
def test_clear_errors_for_unsupported_input(fn):
    with pytest.raises(TypeError, match="torch.Tensor"):
        fn([1.0, 2.0])
    with pytest.raises(TypeError, match="supports float32, float64, int64, bfloat16, float16; got torch.int32"):
        fn(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="default process group"):
        fn(torch.zeros(3))
    if fn is not p2p.allreduce:
        with pytest.raises(ValueError, match="piece_numel"):
            fn(torch.zeros(3), piece_numel=0)


def test_ring_steps_are_chapter_03_schedule_with_chunks_renumbered_by_one():
    from dpcourse.ring import ring_schedule
    for world in (2, 3, 4):
        for step, (_, transfers) in enumerate(ring_schedule(world)):
            for src, dst, chunk in transfers:  # chapter 03's chunk c + 1 is chunk c here
                assert p2p.ring_chunks(src, world, step)[0] == (chunk - 1) % world
                assert p2p.ring_chunks(dst, world, step)[1] == (chunk - 1) % world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_r_receives_chunk_r_last_in_reduce_scatter_and_sends_it_first_in_all_gather(world):
    for rank in range(world):
        assert p2p.ring_chunks(rank, world, world - 2)[1] == rank
        assert p2p.ring_chunks(rank, world, world - 1)[0] == rank
        for step in range(2 * (world - 1) - 1):  # what comes in one step goes on in the next
            _, received = p2p.ring_chunks(rank, world, step)
            assert received == p2p.ring_chunks(rank, world, step + 1)[0]


# --- the ring's halves: ring_reduce_scatter and ring_all_gather ----------------------------

HALVES_WORLDS = [1, 2, 3]
HALVES_CASES = [(n, dt, t, {"piece_numel": piece, "streamed": streamed})
                for streamed in (True, False) for n, dt, t, piece in [
                    (10, torch.float32, False, None),  # over 3 ranks: chunks of 4, 3, 3
                    (12, torch.int64, False, None),
                    (2, torch.float64, False, None),  # fewer elements than ranks
                    (0, torch.float32, False, None),
                    (1000, torch.float32, False, 7),  # each chunk in many pieces
                    (10, torch.float64, False, 1),
                    (20, torch.int64, True, 3),  # non-contiguous
                    (100_003, torch.float64, False, 5000)]]


@pytest.fixture(scope="module")
def halves() -> list[list[dict]]:
    """For each of 3 ranks, its records of both halves, theirs and torch's (workers)."""
    return launch(workers.p2p_halves_against_collectives, HALVES_CASES, HALVES_WORLDS,
                  world_size=3, backend="gloo", timeout=120)


def half_records(halves: list[list[dict]], world: int) -> list[tuple[int, dict]]:
    """(rank, record) for every rank of the group of the first `world` ranks and every case."""
    found = [(rank, r) for rank in range(world) for r in halves[rank] if r["world"] == world]
    assert [r["case"] for rank, r in found] == HALVES_CASES * world
    return found


@pytest.mark.parametrize("world", HALVES_WORLDS)
def test_ring_reduce_scatter_leaves_rank_r_the_sum_of_chunk_r_as_reduce_scatter_tensor_does(
        halves, world):
    for rank, r in half_records(halves, world):
        got, want = r["own chunk"], r["expected own chunk"]
        assert got.shape == (r["sizes"][rank],) and got.dtype == want.dtype, r["case"]
        rtol = {torch.float32: 1e-6, torch.float64: 1e-12}.get(want.dtype, 0.0)
        scale = want.abs().max().item() if want.numel() else 0.0
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, r=r: f"{r['case']}: {m}")


@pytest.mark.parametrize("world", HALVES_WORLDS)
def test_ring_all_gather_gives_every_rank_every_chunk_as_all_gather_into_tensor_does(
        halves, world):
    for rank, r in half_records(halves, world):
        assert torch.equal(r["gathered"], r["expected gathered"]), (rank, r["case"])


@pytest.mark.parametrize("world", HALVES_WORLDS)
def test_ring_reduce_scatter_then_ring_all_gather_is_ring_allreduce(halves, world):
    for rank, r in half_records(halves, world):
        assert torch.equal(r["halves"], r["allreduced"]), (rank, r["case"])
        assert r["sent"]["halves"] == r["sent"]["allreduce"], (rank, r["case"])


@pytest.mark.parametrize("world", HALVES_WORLDS)
def test_each_half_sends_every_chunk_but_one(halves, world):
    """The reduce-scatter never sends the rank's own chunk (it receives its sum last), the
    all-gather never its right-hand neighbour's (it receives that chunk last)."""
    for rank, r in half_records(halves, world):
        numel, sizes = r["case"][0], r["sizes"]
        assert r["sent"]["reduce-scatter"] == numel - sizes[rank], (rank, r["case"])
        assert r["sent"]["all-gather"] == numel - sizes[(rank + 1) % world], (rank, r["case"])


def test_the_halves_non_contiguous_case_really_is_non_contiguous(halves):
    """The correctness tests above cover a non-contiguous tensor only if this case is one."""
    transposed = [r for r in halves[0] if r["case"][2]]
    assert transposed and all(r["contiguous"] == [False] * 3 for r in transposed)
