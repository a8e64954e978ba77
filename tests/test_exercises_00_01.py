"""The checkers of chapters 00 and 01: a right answer, worked out here independently, is
`correct`; typical wrong answers are rejected with a reason, never a crash."""
from __future__ import annotations

import math

import pytest
import torch

from dpcourse.exercises import ch00, ch01
from dpcourse.hardware import accelerators, devices
from dpcourse.resnet import resnet18

RESNET_PARAMETERS = sum(p.numel() for p in resnet18().parameters())


def said(capsys: pytest.CaptureFixture[str], check, *answer: object) -> str:
    """What check(*answer) prints."""
    check(*answer)
    return capsys.readouterr().out


# ---- chapter 00 ----

def test_batch_bytes_accepts_the_product_of_the_shape_and_four_bytes(capsys) -> None:
    assert said(capsys, ch00.check_batch_bytes, 256 * 1 * 28 * 28 * 4) == "correct\n"


@pytest.mark.parametrize("answer", ["802816", 802816.0, True])
def test_batch_bytes_asks_for_an_int(capsys, answer: object) -> None:
    assert "give an int" in said(capsys, ch00.check_batch_bytes, answer)


def test_batch_bytes_rejects_the_element_count(capsys) -> None:
    assert "number of elements" in said(capsys, ch00.check_batch_bytes, 256 * 28 * 28)


def test_shares_accepts_the_views_and_the_to_that_does_not_move(capsys) -> None:
    assert said(capsys, ch00.check_shares, {"a", "b", "d"}) == "correct\n"


@pytest.mark.parametrize("answer", ["a, b, d", 3])
def test_shares_asks_for_a_set_of_letters(capsys, answer: object) -> None:
    assert "give a set of letters" in said(capsys, ch00.check_shares, answer)


def test_shares_names_the_copy_that_was_taken_for_a_view(capsys) -> None:
    assert "(e) makes a copy" in said(capsys, ch00.check_shares, {"a", "b", "d", "e"})


def test_round_robin_accepts_the_two_gpus_reused_in_turn(capsys) -> None:
    assert said(capsys, ch00.check_round_robin, ["cuda:0", "cuda:1", "cuda:0"]) == "correct\n"


def test_round_robin_rejects_a_string(capsys) -> None:
    assert "give a list" in said(capsys, ch00.check_round_robin, "cuda:0, cuda:1, cuda:0")


def replica_on_cpu(x: torch.Tensor) -> torch.Tensor:
    replica = x.to("cpu")  # x is already there: .to returns x itself
    replica += 1
    return replica


def replica_on_cpu1(x: torch.Tensor) -> torch.Tensor:
    replica = x.to("cpu:1")  # another device name: .to copies
    replica += 1
    return replica


def test_replica_aliases_accepts_a_to_that_returns_x(capsys) -> None:
    assert said(capsys, ch00.check_replica_aliases, replica_on_cpu).startswith("correct")


def test_replica_aliases_rejects_an_update_without_to(capsys) -> None:
    out = said(capsys, ch00.check_replica_aliases, lambda x: x.add_(1))
    assert out.startswith("not quite") and "never called .to" in out


def test_replica_aliases_rejects_a_real_copy(capsys) -> None:
    assert "x did not change" in said(capsys, ch00.check_replica_aliases, replica_on_cpu1)


def test_replica_aliases_leaves_tensor_to_as_it_was(capsys) -> None:
    original = torch.Tensor.to
    said(capsys, ch00.check_replica_aliases, replica_on_cpu)
    assert torch.Tensor.to is original and "to" not in vars(torch.Tensor)


# ---- chapter 01 ----

STAGES_3_ON = 2100480 + 8395264 + 5130  # resnet_block3, resnet_block4, fc: counted by hand


@pytest.mark.parametrize("answer, said_first", [
    ((RESNET_PARAMETERS * 16, STAGES_3_ON * 16), "correct: the cut balances the arithmetic"),
    ((RESNET_PARAMETERS * 4, STAGES_3_ON * 4), "not quite: that counts the weights only"),
    ((RESNET_PARAMETERS * 16, RESNET_PARAMETERS * 8), "not quite: that assumes the cut halves"),
    ((RESNET_PARAMETERS * 16, (RESNET_PARAMETERS - STAGES_3_ON) * 16),
     "not quite: that is the device with fewer parameters"),
    (RESNET_PARAMETERS * 16, "not quite: give a pair of numbers")])
def test_model_state_counts_adams_16_bytes_on_the_fuller_device(capsys, answer,
                                                                said_first) -> None:
    assert said(capsys, ch01.check_model_state, answer).startswith(said_first)


def test_break_even_accepts_the_first_batch_past_the_allreduce(capsys) -> None:
    per_example = 128 * 14 * 14  # resnet_block2.1's output: 128 channels of 14 x 14
    answer = math.floor(RESNET_PARAMETERS / per_example) + 1
    assert said(capsys, ch01.check_break_even, answer) == "correct\n"
    assert "give an int" in said(capsys, ch01.check_break_even, float(answer))


def test_lenet_memory_cut_accepts_dense1s_input_for_a_batch(capsys) -> None:
    assert said(capsys, ch01.check_lenet_memory_cut, 256 * 800 * 4) == "correct\n"


def test_lenet_memory_cut_explains_the_tie_break_for_a_cut_after_conv2(capsys) -> None:
    conv2_outputs = 50 * 9 * 9  # 50 channels of (13 - 5 + 1) x (13 - 5 + 1)
    out = said(capsys, ch01.check_lenet_memory_cut, 256 * conv2_outputs * 4)
    assert out.startswith("not quite") and "smallest activation" in out


@pytest.mark.parametrize("in_megabytes", [0.8192, 0.82, 256 * 800 * 4 / 2**20])
def test_lenet_memory_cut_asks_for_bytes_not_megabytes(capsys, in_megabytes: float) -> None:
    assert "in bytes" in said(capsys, ch01.check_lenet_memory_cut, in_megabytes)


def test_owner_bytes_accepts_twice_the_share_of_the_others(capsys) -> None:
    out = said(capsys, ch01.check_owner_bytes, lambda k, S: 2 * (k - 1) / k * S)
    assert out.startswith("correct")
    assert "not quite" in said(capsys, ch01.check_owner_bytes, lambda k, S: (k - 1) / k * S)


def test_idle_fraction_accepts_gpipes_bubble_and_names_the_usual_slips(capsys) -> None:
    bubble = said(capsys, ch01.check_idle_fraction, lambda k, m: (k - 1) / (m + k - 1))
    assert bubble.startswith("correct")
    over_busy = said(capsys, ch01.check_idle_fraction, lambda k, m: (k - 1) / m)
    assert over_busy == ("not quite: for 2 stages, 1 micro-batch you give 1.0, the schedule "
                         "idles 0.5000 of the time: that is the waiting over the working time; "
                         "divide the waiting by the whole span instead\n")
    unpipelined = said(capsys, ch01.check_idle_fraction, lambda k, m: (k - 1) / k)
    assert "for 2 stages, 2 micro-batches" in unpipelined and "holds for one micro-batch" in unpipelined


def test_micro_batches_accepts_the_fewest_for_a_tenth_on_four_stages(capsys) -> None:
    fewest = next(m for m in range(1, 100) if 3 * 10 <= m + 3)  # 3 / (m + 3) <= 1/10
    assert said(capsys, ch01.check_micro_batches, fewest).startswith(f"correct: {fewest} ")
    assert "fewer do too" in said(capsys, ch01.check_micro_batches, fewest + 1)
    assert "wait 10.3% of the time" in said(capsys, ch01.check_micro_batches, fewest - 1)
    assert "give an int" in said(capsys, ch01.check_micro_batches, float(fewest))


def test_k4_costs_accept_three_halves_of_the_two_device_costs(capsys) -> None:
    data_parallel = 3 / 2 * RESNET_PARAMETERS * 4
    layer_wise = 3 / 2 * 256 * 426_496 * 4  # gathered elements per example, chapter 01's table
    assert said(capsys, ch01.check_k4_costs, data_parallel, layer_wise) == "correct\n"
    assert "give a number" in said(capsys, ch01.check_k4_costs, "67 MB", layer_wise)


# ---- the cleared parts of chapters 00 and 01, and their new exercises ----

def test_device_choice_accepts_the_package_and_stops_at_a_stub() -> None:
    from dpcourse.hardware import devices
    ch00.check_device_choice(devices)

    def stub(n=None, *, simulate=False):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError):
        ch00.check_device_choice(stub)


def test_device_choice_says_when_round_robin_is_missing() -> None:
    def no_round_robin(n=None, *, simulate=False):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError("n >= 1")
        if n is None:
            return [torch.device("cpu")]
        if n > 1 or simulate:
            print("simulating")
            return [torch.device("cpu", i) for i in range(n)]
        return [torch.device("cpu")]
    with pytest.raises(AssertionError, match="two CUDA GPUs|one MPS GPU"):
        ch00.check_device_choice(no_round_robin)


def chapter_devices(n=None, *, simulate=False, check_type=True, one_is_the_cpu=True):
    """The chapter's devices, rule by rule, with its type check or its n == 1 rule left out."""
    real = [] if simulate else accelerators()  # the checker's pretend machine
    if n is None:
        return real or [torch.device("cpu")]
    if (check_type and not isinstance(n, int)) or n < 1:
        raise ValueError(f"devices(n) needs a whole number n >= 1, got {n!r}")
    if len(real) >= n:
        return real[:n]
    if one_is_the_cpu and n == 1 and not simulate:
        return [torch.device("cpu")]
    print(f"simulating {n} devices")
    if real:
        return [real[i % len(real)] for i in range(n)]
    return [torch.device("cpu", i) for i in range(n)]


def test_device_choice_says_a_float_count_should_raise_value_error() -> None:
    def no_type_check(n=None, *, simulate=False):
        return chapter_devices(n, simulate=simulate, check_type=False)  # range(2.5) fails
    with pytest.raises(AssertionError, match=r"devices\(2.5\) raised TypeError .*; it should "
                                             "raise ValueError"):
        ch00.check_device_choice(no_type_check)


def test_device_choice_says_a_bool_is_no_count() -> None:
    """devices(True) was accepted as a count of 1, by the checker and the chapter alike."""
    with pytest.raises(AssertionError, match=r"^devices\(True\) did not raise a ValueError: a "
                                             r"bool is an int in Python \(True == 1\)"):
        ch00.check_device_choice(chapter_devices)
    with pytest.raises(ValueError, match="got True"):
        devices(True)


def test_device_choice_says_to_handle_none_before_checking_the_count() -> None:
    def count_checked_first(n=None, *, simulate=False):
        if not isinstance(n, int) or n < 1:  # None is refused before step 2 can return
            raise ValueError(f"devices(n) needs a whole number n >= 1, got {n!r}")
        return chapter_devices(n, simulate=simulate)
    with pytest.raises(AssertionError, match=r"^on a machine with no accelerator, devices\(None\) "
                                             r"raised ValueError \(devices\(n\) needs a whole "
                                             r"number n >= 1, got None\); want \['cpu'\] .*; "
                                             r"handle None before checking the count\)$"):
        ch00.check_device_choice(count_checked_first)


def test_device_choice_points_to_the_one_device_rule_when_it_is_missing() -> None:
    def simulates_one(n=None, *, simulate=False):
        return chapter_devices(n, simulate=simulate, one_is_the_cpu=False)
    with pytest.raises(AssertionError, match=r"devices\(1\) gave \[device\(type='cpu', index=0\)\]"
                                             r".*one device is no simulation: return "
                                             r"\[torch.device\('cpu'\)\]"):
        ch00.check_device_choice(simulates_one)


def test_no_copy_accepts_the_no_op_conversions_and_views(capsys) -> None:
    assert said(capsys, ch00.check_no_copy, {"a", "c", "e"}) == "correct\n"
    out = said(capsys, ch00.check_no_copy, {"a", "c", "e", "f"})
    assert "(f) x.t().reshape(6) makes a copy" in out


def test_profile_steps_accepts_the_package_and_names_a_wrong_column() -> None:
    from dpcourse.lenet import profile_steps
    ch01.check_profile_steps(profile_steps)

    def no_views(steps, X):
        return [{**row, "acts": row["out"]} for row in profile_steps(steps, X)]
    with pytest.raises(AssertionError, match="step flatten, acts: got 144, want 0"):
        ch01.check_profile_steps(no_views)


def test_node_bytes_accepts_S_against_seven_quarters_of_S(capsys) -> None:
    S = RESNET_PARAMETERS * 4
    assert said(capsys, ch01.check_node_bytes, (S, 1.75 * S)).startswith("correct")
    assert "one GPU's part" in said(capsys, ch01.check_node_bytes, (S / 4, 1.75 * S))
    assert "give a pair" in said(capsys, ch01.check_node_bytes, S)
