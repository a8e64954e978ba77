"""The checkers of chapter 11 pass the package's code and right answers, and reject known wrong
ones with the reason; their references agree with brute force."""
import math
import re

import pytest
import torch

from dpcourse.cost_model import ring_allreduce_cost
from dpcourse.exercises import ch11
from dpcourse.exercises.ch11 import (SYNC_CASES, check_bf16_hook, check_low_rank_average,
                                     check_rank_like_bf16, check_sync, check_sync_every,
                                     rank_like_bf16, sync_every_reference)
from dpcourse.exercises.yours import load
from dpcourse.launch import launch


def said(capsys) -> str:
    return capsys.readouterr().out


@pytest.mark.parametrize("check", [check_rank_like_bf16, check_sync_every])
def test_no_answer_is_not_answered_yet(capsys, check):
    check(None)
    assert said(capsys) == "not answered yet\n"


# --- the parts a student writes (run on 2 ranks) ---------------------------------------------

PACKAGE = """
from dpcourse.compression import bf16_hook, low_rank_averages
from dpcourse.local_sgd import DiLoCo
"""

MISTAKES = """
import torch
import torch.distributed as dist

from dpcourse.compression import _done, approximations, chain, low_rank_averages as right_low_rank
from dpcourse.compression import summed
from dpcourse.local_sgd import DiLoCo


def summing_bf16(group, bucket):
    half = bucket.buffer().to(torch.bfloat16)
    work = dist.all_reduce(half, async_op=True)
    return work.get_future().then(lambda fut: bucket.buffer().copy_(fut.value()[0]))


def float32_bf16(group, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: buffer)


def uncopied_bf16(group, bucket):  # sends the average, but never writes it back
    buffer = bucket.buffer()
    half = buffer.div(dist.get_world_size(group)).to(torch.bfloat16)
    work = dist.all_reduce(half, group=group, async_op=True)
    return work.get_future().then(lambda fut: buffer)


def divided_in_place_bf16(group, bucket):  # the buffer holds this rank's share only
    buffer = bucket.buffer()
    half = buffer.div_(dist.get_world_size(group)).to(torch.bfloat16)
    work = dist.all_reduce(half, group=group, async_op=True)
    return work.get_future().then(lambda fut: buffer)


def blocking_bf16(group, bucket):  # right, but backward waits for the allreduce
    buffer = bucket.buffer()
    half = buffer.div(dist.get_world_size(group)).to(torch.bfloat16)
    dist.all_reduce(half, group=group)
    return _done(buffer.copy_(half))


def summing_low_rank(state, params, grads):
    return right_low_rank(state, params, grads).then(
        lambda fut: [a * dist.get_world_size() for a in fut.value()])


def blocking_low_rank(state, params, grads):  # right, but returns what the future holds
    return right_low_rank(state, params, grads).wait()


def low_rank_qr(orthonormalise_sum, orthonormalise_each):
    def low_rank(state, params, grads):  # the package's, with the QR where the flags say
        world = dist.get_world_size()
        Ms = [g + state.errors[p] if p in state.errors else g.clone()
              for p, g in zip(params, grads)]
        qs = [state.qs[p] if p in state.qs else state.initial_q(g, min(state.matrix_rank, *g.shape))
              for p, g in zip(params, grads)]

        def send_qs(sums):
            ps = [torch.linalg.qr(p).Q if orthonormalise_sum else p for p in sums]
            return summed([M.T @ p / world for M, p in zip(Ms, ps)]).then(
                lambda arrived: approximations(state, params, Ms, ps, arrived.value()))
        each = [M @ q for M, q in zip(Ms, qs)]
        return chain(summed([torch.linalg.qr(p).Q for p in each] if orthonormalise_each
                            else each), send_qs)
    return low_rank


no_qr_low_rank = low_rank_qr(False, False)
qr_before_sum_low_rank = low_rank_qr(False, True)


def forgetful_low_rank(state, params, grads):
    for param in params:
        state.errors.pop(param, None)
    return right_low_rank(state, params, grads)


class SummingDiLoCo(DiLoCo):
    @torch.no_grad()
    def sync(self):
        for p, s in zip(self.params, self.start):  # pseudo-gradients world times too large
            p.sub_((dist.get_world_size() - 1) * (s - p))
        super().sync()


class FromCurrentDiLoCo(DiLoCo):
    @torch.no_grad()
    def sync(self):  # the outer step from the current parameters, not the round's start
        deltas = torch.cat([(s - p).reshape(-1) for s, p in zip(self.start, self.params)])
        flat = deltas.div_(dist.get_world_size())
        self.bytes_sent += flat.nbytes
        dist.all_reduce(flat)
        for p, delta in zip(self.params, flat.split([p.numel() for p in self.params])):
            p.grad = delta.view_as(p).clone()
        self.outer.step()
        for p, s in zip(self.params, self.start):
            s.copy_(p)
        self.inner.zero_grad()
        self.syncs += 1
"""


def rank_messages(path: str, cases: list[tuple]) -> list[str]:
    """On a rank: the line each (check, name) prints for name in path, or its AssertionError."""
    out = []
    for check, name in cases:
        try:
            out.append(check(load(path, name)))
        except AssertionError as error:
            out.append(f"AssertionError: {error}")
    return out


def test_the_rank_checks_pass_the_packages_code(tmp_path):
    path = tmp_path / "package.py"
    path.write_text(PACKAGE)
    cases = [(check_bf16_hook, "bf16_hook"), (check_low_rank_average, "low_rank_averages"),
             (check_sync, "DiLoCo")]
    for lines in launch(rank_messages, str(path), cases, backend="gloo", timeout=180):
        assert [line.split(" is right: on 2 ranks")[0] for line in lines] == [
            "bf16_hook", "low_rank_averages", "sync"], lines


def test_the_rank_checks_say_what_is_wrong(tmp_path):
    path = tmp_path / "mistakes.py"
    path.write_text(MISTAKES)
    cases = {(check_bf16_hook, "summing_bf16"): "divide by the world size",
             (check_bf16_hook, "float32_bf16"): "cast to bfloat16 before sending",
             (check_bf16_hook, "uncopied_bf16"): "write the sum .* back into the bucket's buffer",
             (check_bf16_hook, "divided_in_place_bf16"): "this rank's own gradients, not the "
             "average: write the sum",
             (check_bf16_hook, "blocking_bf16"): "waited for its all_reduce: pass async_op=True",
             (check_low_rank_average, "summing_low_rank"): "the ranks' sum",
             (check_low_rank_average, "blocking_low_rank"): "return a future of the approx",
             (check_low_rank_average, "forgetful_low_rank"): r"step 1: .*state.errors",
             (check_low_rank_average, "no_qr_low_rank"): "full rank .*: P was not "
             r"orthonormalised: .* torch.linalg.qr\(p\).Q of each sum",
             (check_low_rank_average, "qr_before_sum_low_rank"): "each rank orthonormalised "
             "its own P before the all_reduce",
             (check_sync, "SummingDiLoCo"): "sum of the pseudo-gradients",
             (check_sync, "FromCurrentDiLoCo"): "copy the round's start"}
    lines = launch(rank_messages, str(path), list(cases), backend="gloo", timeout=180)[0]
    for line, reason in zip(lines, cases.values()):
        assert line.startswith("AssertionError") and re.search(reason, line), (reason, line)


def test_bfloat16_rounds_within_the_stated_tolerance():
    """The 2^-7 bound: bfloat16 keeps 8 significant bits, so one rounding errs by at most
    2^-8 relative; the average rounds twice (the halves, then their sum)."""
    assert ch11.BF16_TOLERANCE == 2.0 ** -7
    x = torch.randn(10_000, dtype=torch.float64)
    rounded = x.to(torch.bfloat16).double()
    assert ((rounded - x).abs() <= 2.0 ** -8 * x.abs()).all()
    assert ((rounded - x).abs() > 2.0 ** -9 * x.abs()).any()  # the bound is not loose by 2


# --- exercise 1: the rank that sends as many bytes as bfloat16 --------------------------------

def test_rank_like_bf16_is_the_largest_rank_not_sending_more():
    n, m = ch11.DENSE
    r = rank_like_bf16()
    assert 4 * r * (n + m) <= 2 * n * m < 4 * (r + 1) * (n + m)


@pytest.mark.parametrize("answer, reason", [(None, "not answered yet"), (55, "correct"),
                                            (110, "float32 here"), (27, "2 bytes, not 1"),
                                            (56, "round down"), (128, "full rank"),
                                            (55.2, "whole number"), (40, "largest whole r")])
def test_the_rank_checker_explains(capsys, answer, reason):
    check_rank_like_bf16(answer)
    assert reason in said(capsys)


# --- exercise 2: sync_every for a link --------------------------------------------------------

@pytest.mark.parametrize("case", SYNC_CASES)
def test_sync_every_reference_is_the_smallest_h_by_brute_force(case):
    model_bytes, step, link, world = case
    t = ring_allreduce_cost(link, world).time(model_bytes)
    ok = [h for h in range(1, 2000) if t <= 0.1 * (h * step + t)]
    assert sync_every_reference(*case) == ok[0]


def test_the_sync_every_checker_passes_the_reference_and_explains(capsys):
    check_sync_every(sync_every_reference)
    assert said(capsys).startswith("correct: a 1B-parameter model")

    def of_compute(model_bytes, step, link, world):
        t = ring_allreduce_cost(link, world).time(model_bytes)
        return max(1, math.ceil(t / (0.1 * step)))

    def one_message(model_bytes, step, link, world):
        return max(1, math.ceil(9 * link.time(model_bytes) / step))
    for wrong, reason in ((of_compute, "not t / (H step)"), (one_message, "not an allreduce"),
                          (lambda *case: 0, "smallest whole H"),
                          (lambda *case: 2.5, "whole number")):
        check_sync_every(wrong)
        assert reason in said(capsys)
