"""The checkers of chapter 10 pass the package's code and right answers, and reject known wrong
ones with the reason; their references agree with brute force and with torch."""
import itertools
import math

import pytest
import torch.nn.functional as F

from dpcourse.exercises.ch10 import (BUDGET_CASES, NORM_CASES, check_clip_grad_norm,
                                     check_clip_scale, check_finish, check_flat_shard,
                                     check_padded_numel, check_start_gather, check_unflatten,
                                     check_units_for_budget, clip_scale_reference, fewest_units,
                                     peak_gathered, torch_clip_scale)
from dpcourse.exercises.yours import on_ranks
from dpcourse.fsdp import flat_shard, padded_numel, unflatten


def said(capsys) -> str:
    return capsys.readouterr().out


@pytest.mark.parametrize("check", [check_units_for_budget, check_clip_scale])
def test_no_answer_is_not_answered_yet(capsys, check):
    check(None)
    assert said(capsys) == "not answered yet\n"


# --- the flat parameters, checked in the notebook's process ----------------------------------

def test_the_flat_checks_pass_the_packages_functions():
    assert check_padded_numel(padded_numel).startswith("padded_numel is right")
    assert check_flat_shard(flat_shard).startswith("flat_shard is right")
    assert check_unflatten(unflatten).startswith("unflatten is right")


@pytest.mark.parametrize("check, wrong, reason", [
    (check_padded_numel, lambda n, k: n // k * k, "smallest multiple"),
    (check_padded_numel, lambda n, k: n + k - n % k, "smallest multiple"),
    (check_flat_shard, lambda flat, r, k: flat.tensor_split(k)[r].clone(), "pad with zeros"),
    (check_flat_shard, lambda flat, r, k: flat_shard(flat, r, k).float(), "dtype"),
    (check_flat_shard, lambda flat, r, k: flat.chunk(k)[r] if flat.numel() % k == 0
     else flat_shard(flat, r, k), "shares flat's storage"),
    (check_unflatten, lambda full, shapes: [t.clone() for t in unflatten(full, shapes)], "copy"),
    (check_unflatten, lambda full, shapes: [full[:s.numel()].view(s) for s in shapes],
     "in order"),
])
def test_the_flat_checks_say_what_is_wrong(check, wrong, reason):
    with pytest.raises(AssertionError, match=reason):
        check(wrong)


def padded_in_front(flat, rank, world):
    return F.pad(flat, (padded_numel(flat.numel(), world) - flat.numel(), 0)).chunk(world)[
        rank].clone()


def test_the_flat_shard_check_says_the_zeros_go_at_the_end():
    """Before, only "differs from torch.chunk of the zero-padded vector"."""
    with pytest.raises(AssertionError, match=r"^flat_shard\(flat, 0, 2\) with flat\.numel\(\) "
                                             r"== \d+ has the padding's zeros at the front: they "
                                             r"go at the end"):
        check_flat_shard(padded_in_front)


def unpadded_chunk(flat, rank, world):
    return flat.chunk(world)[rank].clone()


def no_clone(flat, rank, world):  # F.pad copies flat, but the piece is a view of that copy
    return F.pad(flat, (0, padded_numel(flat.numel(), world) - flat.numel())).chunk(world)[rank]


@pytest.mark.parametrize("check, wrong, message", [
    (check_padded_numel, lambda n, k: float(padded_numel(n, k)),
     "padded_numel(0, 1) returns 0.0, a float: return an int, a count of numbers "
     "(// divides whole numbers, / makes floats)"),
    (check_flat_shard, unpadded_chunk,
     "flat_shard(flat, 1, 2) with flat.numel() == 1 raised IndexError (tuple index out of range): "
     ".chunk(world_size) gives fewer than world_size pieces when they do not divide numel: "
     "pad flat with zeros to padded_numel first (F.pad)"),
    (check_flat_shard, no_clone,
     "flat_shard(flat, 0, 2) with flat.numel() == 1 is a view into a storage of 2 numbers, "
     "which it keeps alive: return a copy of the piece (.clone()), whose storage holds the "
     "piece only"),
])
def test_the_flat_checks_answer_a_float_no_padding_and_no_copy_in_one_line(check, wrong,
                                                                           message):
    with pytest.raises(AssertionError) as error:
        check(wrong)
    assert str(error.value) == message


# --- the methods a student writes (run on 2 ranks) -------------------------------------------

def test_the_rank_checks_pass_the_packages_code(tmp_path):
    path = tmp_path / "package.py"
    path.write_text("from dpcourse.fsdp import ScratchFSDP\n")
    for check in (check_start_gather, check_finish, check_clip_grad_norm):
        lines = on_ranks(check, path, "ScratchFSDP")
        assert lines[0] == lines[1] and " is right: on 2 ranks" in lines[0], lines


MISTAKES = """
import torch
import torch.distributed as dist

from dpcourse.fsdp import ScratchFSDP


class ScratchFSDP(ScratchFSDP):
    @torch.no_grad()
    def _finish(self):
        super()._finish()
        for unit in self.units:  # the sums, not the averages
            unit.shard.grad *= self.world

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.stack([g.square().sum() for g in grads]).sum().sqrt()
        for grad in grads:
            grad.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm
"""


def test_the_rank_checks_catch_a_sum_and_the_local_norm(tmp_path):
    path = tmp_path / "mistakes.py"
    path.write_text(MISTAKES)
    with pytest.raises(AssertionError, match="sums over the ranks"):
        on_ranks(check_finish, path, "ScratchFSDP")
    with pytest.raises(AssertionError, match="shard's norm"):
        on_ranks(check_clip_grad_norm, path, "ScratchFSDP")


# --- exercise 1: units for a memory budget -----------------------------------------------------

def splits(n: int):
    """Every split of n layers into units of consecutive layers."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        units, unit = [], [0]
        for i, cut in enumerate(cuts, 1):
            if cut:
                units.append(unit)
                unit = []
            unit.append(i)
        yield units + [unit]


@pytest.mark.parametrize("numels, world, budget", BUDGET_CASES)
def test_fewest_units_is_the_fewest_of_every_split_within_budget(numels, world, budget):
    fitting = [len(u) for u in splits(len(numels)) if peak_gathered(u, numels, world) <= budget]
    assert fewest_units(numels, world, budget) == min(fitting)


def test_the_lenet_budgets_need_one_three_and_four_units():
    assert [fewest_units(*case) for case in BUDGET_CASES[:3]] == [3, 4, 1]


def by_brute_force(numels, world, budget):
    fitting = [u for u in splits(len(numels)) if peak_gathered(u, numels, world) <= budget]
    return min(fitting, key=len)


def test_units_for_budget_accepts_any_fewest_split(capsys):
    check_units_for_budget(by_brute_force)
    assert said(capsys).startswith("correct: LeNet's layers")


@pytest.mark.parametrize("wrong, reason", [
    (lambda numels, world, budget: [[i] for i in range(len(numels))], "another split"),
    (lambda numels, world, budget: [list(range(len(numels)))], "two neighbouring units"),
    (lambda numels, world, budget: [[i for i in range(len(numels)) if i % 2],
                                    [i for i in range(len(numels)) if not i % 2]], "in order"),
    (lambda numels, world, budget: list(range(len(numels))), "list of units"),
])
def test_units_for_budget_explains_order_budget_and_count(capsys, wrong, reason):
    check_units_for_budget(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- exercise 2: clipping by the norm of all the shards ----------------------------------------

@pytest.mark.parametrize("norms, max_norm", NORM_CASES)
def test_clip_scale_reference_is_what_torch_does(norms, max_norm):
    assert clip_scale_reference(norms, max_norm) == pytest.approx(
        torch_clip_scale(norms, max_norm), rel=1e-12)


def test_clip_scale_accepts_the_global_norm_and_shows_the_local_mistake(capsys):
    check_clip_scale(lambda norms, max_norm: min(1.0, max_norm / (math.hypot(*norms) + 1e-6)))
    out = said(capsys)
    assert out.startswith("correct") and "scales by 0.200" in out and "[0.333, 0.25]" in out


@pytest.mark.parametrize("wrong, reason", [
    (lambda norms, m: [min(1.0, m / n) if n else 1.0 for n in norms], "one factor"),
    (lambda norms, m: min(1.0, m / sum(norms)), "add as squares"),
    (lambda norms, m: m / math.hypot(*norms), "never scale a gradient up"),
    (lambda norms, m: "0.2", "one number"),
])
def test_clip_scale_explains_local_norms_sums_and_scaling_up(capsys, wrong, reason):
    check_clip_scale(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out
