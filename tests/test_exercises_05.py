"""The checkers of chapter 05 say "correct" to right answers and reject known wrong ones."""
import pytest

from dpcourse import Settings, devices, load_fashion_mnist
from dpcourse.exercises.ch05 import (check_cpu_example_weight, check_lr_for_k, check_steps,
                                     check_warmup)


def verdict(capsys) -> str:
    """The first word of what the checker printed: "correct", "not" (quite) or "different"."""
    return capsys.readouterr().out.split()[0].rstrip(":")


def last_line(capsys) -> str:
    """What the checker concluded (devices() announces the simulated devices before it)."""
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_steps_are_the_loaders_batches_times_the_epochs(capsys):
    s = Settings.for_devices(devices(4))
    train_iter, _ = load_fashion_mnist(1024, s.train_size, s.test_size, "synthetic")
    capsys.readouterr()
    check_steps(s.num_epochs * len(train_iter))
    assert last_line(capsys).startswith("correct")
    check_steps(len(train_iter))
    assert "that is one epoch" in last_line(capsys)
    check_steps(s.num_epochs * len(train_iter) + 1)
    assert last_line(capsys).startswith("not quite")


def test_lr_for_k_accepts_the_linear_scaling_rule(capsys):
    check_lr_for_k(lambda k: 0.025 * k)
    assert last_line(capsys).startswith("correct")


@pytest.mark.parametrize("wrong, where", [
    (lambda k: -0.1, "on 1 device (batch 64)"),  # steps up the gradient
    (lambda k: 0.025, "on 2 devices (batch 128)"),  # the rate of one device: 1/k of the step
    (lambda k: 0.1, "on 1 device (batch 64)"),  # the textbook's fixed global batch answer
    (lambda k: 0.025 * k * 1.01, "on 1 device (batch 64)"),  # 1% off: every element compared
    (lambda k: 0.025 * k ** 2, "on 2 devices (batch 128)"),
])
def test_lr_for_k_rejects_other_rates_at_the_first_k_they_miss(capsys, wrong, where):
    check_lr_for_k(wrong)
    line = last_line(capsys)
    assert line.startswith("not quite") and where in line


def test_lr_for_k_says_how_far_a_constant_rate_moves(capsys):
    check_lr_for_k(lambda k: 0.025)
    assert "0.50x as far" in last_line(capsys)


def test_warmup_accepts_the_linear_ramp_and_rejects_others(capsys):
    check_warmup(lambda step: 0.025 + 0.075 * min(step, 32) / 32)
    assert verdict(capsys) == "correct"
    check_warmup(lambda step: 0.025 + 0.075 * min(step, 8) / 8)  # the old 8-step ramp
    assert "at step 1 you give 0.034375" in capsys.readouterr().out
    check_warmup(lambda step: 0.1 * min(step, 32) / 32)  # starts at 0
    assert "at step 0" in capsys.readouterr().out


def test_cpu_example_weight_is_the_ratio_of_the_shard_sizes(capsys):
    check_cpu_example_weight(40 / 10)
    assert verdict(capsys) == "correct"
    check_cpu_example_weight(0.25)
    assert "inverted" in capsys.readouterr().out
    check_cpu_example_weight(1)
    assert "what train_batch gives" in capsys.readouterr().out
    check_cpu_example_weight(2)
    assert verdict(capsys) == "not"


def test_unanswered_exercises_say_so(capsys):
    for check in (check_steps, check_lr_for_k, check_warmup, check_cpu_example_weight):
        check(None)
        assert capsys.readouterr().out == "not answered yet\n"
