"""The checkers of chapter 09 say "correct" to right answers and reject known wrong ones; their
references agree with arithmetic done by hand, with chapter 03's ring and with LeNet's shapes."""
import pytest
import torch

from dpcourse.exercises.ch09 import (activation_crossover, check_activation_crossover,
                                     check_flat_shards, check_largest_models, check_owners,
                                     check_traffic, flat_loads, flat_shards_reference,
                                     largest_model, lenet_activation_bytes, traffic_reference)
from dpcourse.exercises.ch09 import check_reduce_scatter_hook, check_share_parameters, check_step
from dpcourse.exercises.yours import on_ranks
from dpcourse.lenet import lenet_model
from dpcourse.ring import ring_allreduce

GB = 10**9


def said(capsys) -> str:
    return capsys.readouterr().out


@pytest.mark.parametrize("check", [check_largest_models, check_owners, check_traffic,
                                   check_activation_crossover, check_flat_shards])
def test_no_answer_is_not_answered_yet(capsys, check):
    check(None)
    assert said(capsys) == "not answered yet\n"


# --- exercise 1: the largest model on 8 GPUs of 80 GB ----------------------------------------

BY_HAND = {"ddp": 80 * GB / 16, "zero1": 80 * GB / (2 + 2 + 12 / 8),
           "zero2": 80 * GB / (2 + (2 + 12) / 8), "zero3": 80 * GB / (16 / 8)}


def test_largest_model_reference_is_80_gb_over_the_bytes_per_parameter_on_one_gpu():
    for stage, want in BY_HAND.items():
        assert largest_model(stage) == pytest.approx(want, rel=1e-12), stage


@pytest.mark.parametrize("answer", [BY_HAND, {k: round(v, -8) for k, v in BY_HAND.items()},
                                    {k: int(v) for k, v in BY_HAND.items()}])
def test_largest_models_accepts_exact_and_rounded_counts(capsys, answer):
    check_largest_models(answer)
    assert said(capsys).startswith("correct")


@pytest.mark.parametrize("wrong, reason", [
    ({k: v / GB for k, v in BY_HAND.items()}, "not billions"),
    ({k: v * 2**30 / GB for k, v in BY_HAND.items()}, "not 80 x 2^30"),
    ({**BY_HAND, "zero1": 80 * GB / (4 + 4 + 8 / 8)}, "float32 training"),
    ({**BY_HAND, "zero1": 8 * BY_HAND["zero1"]}, "80 GB per GPU"),
    ({**BY_HAND, "ddp": 8 * 80 * GB / 16}, "only ZeRO-3 divides all 16 bytes"),
    ({**BY_HAND, "zero2": BY_HAND["zero1"]}, "what fits with zero1; with zero2 the gradients"),
    ({**BY_HAND, "zero2": 80 * GB / 15}, "the gradients (2 bytes)"),
    ({k: v for k, v in BY_HAND.items() if k != "zero3"}, "the keys"),
    ({**BY_HAND, "ddp": "5e9"}, "give a number"),
])
def test_largest_models_explains_units_precision_totals_and_stages(capsys, wrong, reason):
    check_largest_models(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- exercise 2: who owns what ------------------------------------------------------------

def owners(numels, world, tie=min, largest_first=True):
    """Exercise 2 written independently; the keywords make the typical mistakes."""
    order = sorted(range(len(numels)), key=lambda i: -numels[i]) if largest_first \
        else range(len(numels))
    loads, result = [0] * world, [0] * len(numels)
    for i in order:
        least = min(loads)
        result[i] = tie(r for r in range(world) if loads[r] == least)
        loads[result[i]] += numels[i]
    return result


def test_owners_accepts_largest_first_to_the_least_loaded_lowest_rank(capsys):
    check_owners(owners)
    out = said(capsys)
    assert out.startswith("correct") and "[102400, 26668]" in out, out


@pytest.mark.parametrize("wrong, reason", [
    (lambda numels, world: [i % world for i in range(len(numels))], "taking turns"),
    (lambda numels, world: owners(numels, world, largest_first=False), "largest first"),
    (lambda numels, world: owners(numels, world, tie=max), "the lowest rank"),
    (lambda numels, world: owners(numels, world)[:-1], "one owner per parameter"),
    (lambda numels, world: [world] * len(numels), "whole numbers from 0"),
])
def test_owners_explains_turns_order_ties_and_lengths(capsys, wrong, reason):
    check_owners(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- exercise 3: traffic per stage --------------------------------------------------------

@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_traffic_of_ddp_is_what_each_device_of_chapter_03s_ring_sends(k):
    n = 840  # divisible by every k here: equal chunks
    sent = ring_allreduce([torch.ones(n) for _ in range(k)])
    assert sent == [traffic_reference("ddp", n, k)] * k
    assert traffic_reference("zero3", n, k) == pytest.approx(1.5 * sent[0], rel=1e-12)


def traffic(stage, n, k):
    """Exercise 3 written independently: halves of an allreduce, (k-1)/k n each."""
    halves = {"ddp": 2, "zero1": 3, "zero2": 2, "zero3": 3}[stage]
    return halves * (k - 1) * n / k


def test_traffic_accepts_the_ring_law(capsys):
    check_traffic(traffic)
    assert said(capsys).startswith("correct")


@pytest.mark.parametrize("wrong, reason", [
    (lambda s, n, k: traffic("ddp", n, k), "all-gathers the parameters: three halves"),
    (lambda s, n, k: traffic("zero1" if s == "zero2" else s, n, k), "two halves"),
    (lambda s, n, k: 2 * (k - 1) * n / k if s == "zero3" else traffic(s, n, k),
     "all-gathers the parameters twice"),
    (lambda s, n, k: {"ddp": 2, "zero1": 3, "zero2": 2, "zero3": 3}[s] * n, "nothing"),
    (lambda s, n, k: traffic(s, n, k) if k == 1 else
     {"ddp": 2, "zero1": 3, "zero2": 2, "zero3": 3}[s] * n, "not all"),
    (lambda s, n, k: (k - 1) * n / k, "a reduce-scatter plus an all-gather"),
    (lambda s, n, k: "840", "the ring sends"),
    (lambda s, n, k: 0 if k == 1 else None, "return a number"),
])
def test_traffic_explains_stage_by_stage(capsys, wrong, reason):
    check_traffic(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- exercise 4: when activations win -----------------------------------------------------

def lenet_saved_bytes_by_hand(batch: int) -> int:
    """What LeNet's forward saves for backward, from its shapes: per image the input (784),
    conv1's relu (20x26x26), pool 1 (20x13x13), conv2's relu (50x9x9), pool 2 (800), the
    hidden relu (128) and log-softmax (10) in float32, plus the int64 label; per batch the
    loss's 4-byte total weight."""
    floats = 784 + 20 * 26 * 26 + 20 * 13 * 13 + 50 * 9 * 9 + 800 + 128 + 10
    return batch * (4 * floats + 8) + 4


@pytest.mark.parametrize("batch", [1, 22, 23, 64])
def test_activation_bytes_of_lenet_match_a_count_by_hand(batch):
    assert lenet_activation_bytes(batch) == lenet_saved_bytes_by_hand(batch)


def test_activation_crossover_is_the_first_batch_above_16_bytes_per_parameter():
    states = 16 * 129_068
    assert lenet_saved_bytes_by_hand(activation_crossover()) > states
    assert lenet_saved_bytes_by_hand(activation_crossover() - 1) <= states


def test_activation_crossover_accepts_23(capsys):
    check_activation_crossover(23)
    assert said(capsys).startswith("correct")


@pytest.mark.parametrize("wrong, reason", [(22, "one more"), (22.8, "whole number"),
                                           (256, "bytes per image")])
def test_activation_crossover_explains_off_by_one_fractions_and_guesses(capsys, wrong, reason):
    check_activation_crossover(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- exercise 5: shard by numbers, not by whole parameters -----------------------------------

def flat_shards(numels, world, size=None, keep_empty=False, from_zero=False):
    """Exercise 5 written number by number; the keywords make the typical mistakes."""
    size = size or -(-sum(numels) // world)
    shards = [[] for _ in range(world)]
    flat = [(i, j) for i, n in enumerate(numels) for j in range(n)]  # (parameter, index)
    for rank in range(world):
        mine = flat[rank * size:(rank + 1) * size]
        for i in range(len(numels)):
            inside = [j for p, j in mine if p == i]
            if inside or keep_empty:
                start = inside[0] if inside else 0
                stop = inside[-1] + 1 if inside else 0
                offset = sum(numels[:i]) if from_zero else 0
                shards[rank].append((i, start + offset, stop + offset))
    return shards


def test_flat_shards_reference_covers_every_number_once_in_equal_runs():
    lenet = [p.numel() for p in lenet_model().parameters()]
    for world in (1, 2, 3, 4, 5, 7):
        shards = flat_shards_reference(lenet, world)
        assert shards == flat_shards(lenet, world)
        assert sum(flat_loads(shards)) == sum(lenet)
        assert max(flat_loads(shards)) == -(-sum(lenet) // world)
    assert flat_loads(flat_shards_reference(lenet, 4)) == [32267] * 4


def test_flat_shards_accepts_a_solution_written_independently(capsys):
    check_flat_shards(flat_shards)
    out = said(capsys)
    assert out.startswith("correct") and "1.000 x" in out and "1.587 x" in out, out


@pytest.mark.parametrize("wrong, reason", [
    (lambda numels, world: flat_shards(numels, world, size=max(1, sum(numels) // world)),
     "cover"),
    (lambda numels, world: flat_shards(numels, world, keep_empty=True), "empty pieces"),
    (lambda numels, world: flat_shards(numels, world, from_zero=True), "count from the start"),
    (lambda numels, world: [0] * len(numels), "one list of pieces per rank"),
    (lambda numels, world: [[i for i, _, _ in s] for s in flat_shards(numels, world)], "triples"),
])
def test_flat_shards_explains_floor_empty_pieces_offsets_and_shapes(capsys, wrong, reason):
    check_flat_shards(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- the parts a student writes (run on 2 ranks) -----------------------------------------------

def test_the_rank_checks_pass_the_packages_code(tmp_path):
    path = tmp_path / "package.py"
    path.write_text("from dpcourse.zero import ShardedOptimizer, reduce_scatter_hook\n")
    for check, name in ((check_share_parameters, "ShardedOptimizer"),
                        (check_step, "ShardedOptimizer"),
                        (check_reduce_scatter_hook, "reduce_scatter_hook")):
        lines = on_ranks(check, path, name)
        assert lines[0] == lines[1] and " is right: on 2 ranks" in lines[0], lines


STEP_WITHOUT_SHARING = """
import torch
from dpcourse.zero import ShardedOptimizer


class ShardedOptimizer(ShardedOptimizer):
    @torch.no_grad()
    def step(self, closure=None):
        self.optim.step()
"""


def test_the_step_check_says_what_is_missing(tmp_path):
    path = tmp_path / "step.py"
    path.write_text(STEP_WITHOUT_SHARING)
    with pytest.raises(AssertionError, match="closure"):
        on_ranks(check_step, path, "ShardedOptimizer")
    fixed = ("with torch.enable_grad():\n            closure()\n"
             "        self.optim.step()\n        return 1.5")
    path.write_text(STEP_WITHOUT_SHARING.replace("self.optim.step()", fixed))
    with pytest.raises(AssertionError, match=r"call self\._share_parameters\(\)"):
        on_ranks(check_step, path, "ShardedOptimizer")


ONE_BUFFER_PER_OWNER = """
import torch
import torch.distributed as dist
from dpcourse.zero import ShardedOptimizer


class ShardedOptimizer(ShardedOptimizer):
    def _share_parameters(self):
        for rank in range(self.world):
            shard = self.shard(rank)
            sizes = [p.numel() for p in shard]
            if rank == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in shard])
            else:
                flat = torch.empty(sum(sizes), dtype=torch.float64)
            dist.broadcast(flat, src=rank)
            if rank != self.rank:
                for p, piece in zip(shard, flat.split(sizes)):
                    p.copy_(piece.view_as(p))
"""


def test_the_sharing_check_names_one_buffer_per_owner_whatever_the_dtype(tmp_path):
    """Its values arrive (float32 to float64 and back is exact), in fewer broadcasts than
    (owner, dtype) pairs: before, it passed as "one broadcast per owner and dtype"."""
    path = tmp_path / "share.py"
    path.write_text(ONE_BUFFER_PER_OWNER)
    with pytest.raises(AssertionError, match=r"a shard of float32 and float64 parameters in "
                                             r"one torch\.cat goes as float64"):
        on_ranks(check_share_parameters, path, "ShardedOptimizer")
