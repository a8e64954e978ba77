"""The checkers of chapter 08 say "correct" to right answers and explain known wrong ones; their
references agree with cost_model's formulas and with its bucket simulation."""
import re
from itertools import permutations

import pytest
import torch

from dpcourse import cost_model
from dpcourse.experiments import performance
from dpcourse.cost_model import AlphaBeta
from dpcourse.exercises.ch08 import (BUCKET_BACKWARD_S, BUCKET_COST, BUCKET_MODEL_BYTES,
                                     CHECK_BYTES, CROSSOVER_LINK, CROSSOVER_RANKS, PREDICT_BYTES,
                                     best_bucket_reference, bf16_overhead_reference,
                                     check_best_bucket, check_bf16_overhead, check_copy_in,
                                     check_gather, check_predicted_seconds, check_reduce,
                                     check_ring_tree_crossover, check_round,
                                     check_shm_broadcast, rank_order_sum,
                                     ring_tree_crossover_reference, spread_inputs)
from dpcourse.exercises.yours import on_ranks
from dpcourse.shm import ALIGN
from shm_checks import LaunchedSegments

FIT = AlphaBeta(alpha=300e-6, beta=1 / 1.5e9)  # a fit like gloo's on 2 processes


def said(capsys) -> str:
    return capsys.readouterr().out


@pytest.mark.parametrize("check", [lambda a: check_predicted_seconds(a, FIT),
                                   check_ring_tree_crossover, check_best_bucket,
                                   check_bf16_overhead])
def test_no_answer_is_not_answered_yet(capsys, check):
    check(None)
    assert said(capsys) == "not answered yet\n"


# --- exercise 1: predict an allreduce's time from the fit ----------------------------------

def test_prediction_is_alpha_plus_bytes_times_beta(capsys):
    check_predicted_seconds(300e-6 + 3 * 2**20 / 1.5e9, FIT)
    assert said(capsys).startswith("correct")


@pytest.mark.parametrize("answer, reason", [
    (300e-6 + 3 * 2**18 / 1.5e9, "per *byte*"),  # numel instead of bytes
    (3 * 2**20 / 1.5e9, "add alpha"),
    (1e3 * (300e-6 + 3 * 2**20 / 1.5e9), "not milliseconds"),
    (300e-6 + 3e6 / 1.5e9, "2**20"),
    (1.0, "evaluate alpha + n * beta"),
    ("0.002", "number of seconds"),
])
def test_prediction_explains_bytes_alpha_units_and_mib(capsys, answer, reason):
    check_predicted_seconds(answer, FIT)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


def test_the_size_to_predict_is_not_one_the_sweep_measures():
    assert PREDICT_BYTES % 4 == 0
    numel = PREDICT_BYTES // 4
    assert numel not in performance.SWEEP_NUMELS


# --- exercise 2: where the ring overtakes NCCL's double binary tree -------------------------

def test_crossover_is_where_the_ring_and_double_tree_formulas_take_equally_long():
    n = ring_tree_crossover_reference()
    ring = cost_model.allreduce_cost(CROSSOVER_LINK, CROSSOVER_RANKS, "ring")
    tree = cost_model.allreduce_cost(CROSSOVER_LINK, CROSSOVER_RANKS, "double tree")
    assert ring.time(n) == pytest.approx(tree.time(n), rel=1e-12)
    assert ring.time(0.5 * n) > tree.time(0.5 * n) and ring.time(2 * n) < tree.time(2 * n)


def test_crossover_by_hand_for_8_ranks():
    # ring 14 a + 14/8 n b = double tree 6 a + 2 n b  =>  8 a = n b / 4  =>  n = 32 a / b = 4 MB
    a, b = CROSSOVER_LINK.alpha, CROSSOVER_LINK.beta
    assert ring_tree_crossover_reference() == pytest.approx(32 * a / b, rel=1e-12)
    assert ring_tree_crossover_reference() == pytest.approx(4e6, rel=1e-12)
    # the binomial tree (6 a + 6 n b) crosses at 8 a / (4.25 b), 17x smaller
    assert ring_tree_crossover_reference(tree="tree") == pytest.approx(8 * a / (4.25 * b))


def test_crossover_accepts_the_answer_and_explains_the_binomial_tree(capsys):
    a, b = CROSSOVER_LINK.alpha, CROSSOVER_LINK.beta
    check_ring_tree_crossover(32 * a / b)
    assert said(capsys).startswith("correct")
    check_ring_tree_crossover(8 * a / (4.25 * b))
    out = said(capsys)
    assert out.startswith("not quite") and "binomial" in out, out
    check_ring_tree_crossover(1.0)
    assert "set them equal" in said(capsys)


# --- exercise 3: the best bucket size ------------------------------------------------------

def test_best_bucket_formula_is_the_best_of_the_bucket_simulation():
    """Among bucket sizes that divide the model (the formula's assumption), cost_model's
    simulation of backward and the allreduces finds the formula's size, within one bucket."""
    sizes = [BUCKET_MODEL_BYTES / k for k in range(1, 2000)]
    best = cost_model.best_bucket_size(BUCKET_MODEL_BYTES, BUCKET_BACKWARD_S, BUCKET_COST, sizes)
    formula = best_bucket_reference()
    assert BUCKET_MODEL_BYTES / best == pytest.approx(BUCKET_MODEL_BYTES / formula, abs=1)


def test_best_bucket_by_hand():
    # 0.5 ms x 44,703,272 B / (0.2 s - 44,703,272 B / 1 GB/s)
    assert best_bucket_reference() == pytest.approx(5e-4 * 44_703_272 / (0.2 - 0.044703272),
                                                    rel=1e-12)


@pytest.mark.parametrize("answer, reason", [
    (5e-4 * BUCKET_MODEL_BYTES / BUCKET_BACKWARD_S, "beta per byte"),
    (best_bucket_reference() / 4, "in bytes"),
    (1e6, "set them equal"),
    ([1], "number of bytes"),
])
def test_best_bucket_explains_missing_beta_and_bytes(capsys, answer, reason):
    check_best_bucket(answer)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


def test_best_bucket_accepts_the_formula(capsys):
    check_best_bucket(best_bucket_reference())
    assert said(capsys).startswith("correct")


def test_exercise_3s_model_is_the_chapters_resnet18():
    assert performance.gradient_bytes(performance.resnet18_model()) == BUCKET_MODEL_BYTES


# --- exercise 4: a billion parameters in bfloat16 ------------------------------------------

def test_bf16_overhead_by_hand():
    """2e9 bytes in 25 MiB buckets: 76 full buckets and one of the rest, each a ring
    allreduce over 8 ranks of 14 steps of 3.4 us + n/8 bytes at 450 GB/s."""
    bucket, full = 25 * 2**20, 2 * 10**9 // (25 * 2**20)
    rest = 2 * 10**9 - full * bucket

    def ring(n):
        return 14 * (3.4e-6 + n / 8 / 450e9)
    assert full == 76 and rest > 0
    assert bf16_overhead_reference() == pytest.approx(full * ring(bucket) + ring(rest),
                                                      rel=1e-12)


def test_bf16_overhead_accepts_the_prediction(capsys):
    check_bf16_overhead(bf16_overhead_reference())
    out = said(capsys)
    assert out.startswith("correct") and "x2.00" in out, out


@pytest.mark.parametrize("answer, reason", [
    (bf16_overhead_reference(4 * 10**9), "bfloat16 has 2"),
    (bf16_overhead_reference(bandwidth=900e9), "both directions"),
    (1e3 * bf16_overhead_reference(), "not milliseconds"),
    (14 * (3.4e-6 + 2e9 / 8 / 450e9), "25 MiB buckets"),
    (1.0, "predict_ddp_overhead("),
    ("0.01", "number of seconds"),
])
def test_bf16_overhead_explains_bytes_bandwidth_units_and_buckets(capsys, answer, reason):
    check_bf16_overhead(answer)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- the parts a student writes (on ranks): each check accepts the package's code and says
# what is wrong with a typical mistake; exercise 5's broadcast ------------------------------

WRITTEN = {  # file name -> (method source, the check)
    "copy_in_own_region": ('''
    def _copy_in(self, regions, slices):
        for q, s in enumerate(slices):  # own slice copied in too: its region is the sum's
            regions[self.rank][q][:s.numel()].copy_(s)
''', check_copy_in, "own slice stays in its tensor"),
    "reduce_own_part_from_buffer": ('''
    def _reduce(self, regions, slices):
        n = slices[self.rank].numel()
        out = regions[self.rank][self.rank][:n]
        torch.add(regions[0][self.rank][:n], regions[1][self.rank][:n], out=out)
''', check_reduce, "own part in slices"),
    "reduce_into_scratch": ('''
    def _reduce(self, regions, slices):
        n = slices[self.rank].numel()
        parts = [s if q == self.rank else regions[q][self.rank][:n] for q, s in enumerate(slices)]
        regions[self.rank][self.rank][:n].copy_(torch.stack(parts).sum(0))  # the right sums
''', check_reduce, "made a scratch tensor as large as the slice (with stack)"),
    "gather_own_buffer": ('''
    def _gather(self, regions, slices):
        for q, s in enumerate(slices):
            s.copy_(regions[self.rank][q][:s.numel()])
''', check_gather, "is not dist.all_reduce's sum: copy region"),
    "round_one_wait": ('''
    def _round(self, piece, first):
        regions, slices = self._regions(piece.dtype), piece.tensor_split(self.world)
        self._copy_in(regions, slices)
        self._arrive()
        if first:
            self._check_same_call()
        self._reduce(regions, slices)
        self._gather(regions, slices)
''', check_round, "each round must call _copy_in, _arrive, _reduce, _arrive, _gather"),
}


@pytest.mark.parametrize("name", list(WRITTEN))
def test_each_check_of_a_written_part_names_a_typical_mistake(tmp_path, name):
    method, check, reason = WRITTEN[name]
    path = tmp_path / f"{name}.py"
    path.write_text("import torch\nfrom dpcourse.shm import SharedMemoryAllreduce\n\n\n"
                    f"class SharedMemoryAllreduce(SharedMemoryAllreduce):{method}")
    with LaunchedSegments() as launched, pytest.raises(AssertionError, match=re.escape(reason)):
        on_ranks(check, path, "SharedMemoryAllreduce")
    assert not launched.left(), "a check left a shared-memory segment behind"


def test_the_checks_accept_the_package_code_on_3_ranks(tmp_path):
    path = tmp_path / "package.py"
    path.write_text("from dpcourse.shm import SharedMemoryAllreduce\n")
    for check in (check_reduce, check_round):  # the two that read the other ranks' regions
        said_by_ranks = on_ranks(check, path, "SharedMemoryAllreduce", world_size=3)
        assert len(set(said_by_ranks)) == 1 and "is right" in said_by_ranks[0]


OWN_PART_FIRST = '''
    def _reduce(self, regions, slices):
        n = slices[self.rank].numel()
        out = regions[self.rank][self.rank][:n]
        out.copy_(slices[self.rank])  # the right parts, own one first: not rank order
        for q in range(self.world):
            if q != self.rank:
                out += regions[q][self.rank][:n]
'''


@pytest.mark.parametrize("world", [3, 4])
def test_the_order_check_tells_every_other_order_of_the_parts(world):
    """With its inputs, every order of the ranks' parts but rank order (and its twin, the
    first two swapped: a + b is b + a) rounds some sum differently, on every rank's slice:
    so the check cannot pass a wrong order."""
    numel = world * (CHECK_BYTES // world // ALIGN * ALIGN // 4)  # a full round of the check
    for rank in range(world):
        parts = [spread_inputs(q, numel).tensor_split(world)[rank] for q in range(world)]
        want = rank_order_sum(parts)
        for order in permutations(range(world)):
            if order[2:] == tuple(range(2, world)):
                continue  # rank order, or its twin
            assert not torch.equal(rank_order_sum([parts[q] for q in order]), want), order


def test_the_reduce_check_names_a_sum_out_of_rank_order_on_3_ranks(tmp_path):
    path = tmp_path / "own_part_first.py"
    path.write_text("import torch\nfrom dpcourse.shm import SharedMemoryAllreduce\n\n\n"
                    f"class SharedMemoryAllreduce(SharedMemoryAllreduce):{OWN_PART_FIRST}")
    on_ranks(check_reduce, path, "SharedMemoryAllreduce")  # 2 ranks: any order is exact
    with pytest.raises(AssertionError, match="not added in rank order"):
        on_ranks(check_reduce, path, "SharedMemoryAllreduce", world_size=3)


BROADCAST = '''import torch
from dpcourse.p2p import flat_view
from dpcourse.shm import SharedBuffers


class SharedMemoryBroadcast(SharedBuffers):
    @torch.no_grad()
    def broadcast(self, tensor, src):
        buffer = self._buffers[{owner}].view(tensor.dtype)
        with flat_view(tensor) as flat:
            for start in range(0, flat.numel(), buffer.numel()):
                piece = flat[start:start + buffer.numel()]
                if self.rank == src:
                    buffer[:piece.numel()].copy_(piece)
                self._arrive()
                if self.rank != src:
                    piece.copy_(buffer[:piece.numel()])
                self._arrive()
        return tensor
'''


@pytest.mark.parametrize("owner, verdict", [("src", "correct"), ("self.rank", "not quite"),
                                            (None, "not answered yet")])
def test_shm_broadcast_checker(tmp_path, capsys, owner, verdict):
    path = tmp_path / "shm_broadcast.py"
    if owner:
        path.write_text(BROADCAST.format(owner=owner))
    with LaunchedSegments() as launched:
        check_shm_broadcast(path)
    assert said(capsys).splitlines()[-1].startswith(verdict)
    assert not launched.left()
