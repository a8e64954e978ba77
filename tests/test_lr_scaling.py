"""lr_scaling: the warm-up schedule, the runs' shared sample order, and the linear scaling rule
itself where it must hold (small steps), against runs of the plain batch size."""
import pytest
import torch

from dpcourse.data import synthetic_fashion
from dpcourse.lr_scaling import loss_curve, scaling_rule_runs, warmup_lr

SAMPLES, LOG_EVERY = 1024, 256


@pytest.fixture(scope="module")
def data():
    return synthetic_fashion("train", 2048).tensors


def curve(data, batch_size, lr, warmup=0, **kwargs):
    X, y = data
    return loss_curve(X, y, batch_size, lr, SAMPLES, warmup, log_every=LOG_EVERY, **kwargs)


def test_warmup_rises_linearly_to_lr_then_stays():
    assert [warmup_lr(0.4, s, 400) for s in (100, 200, 300)] == pytest.approx([0.1, 0.2, 0.3])
    assert warmup_lr(0.4, 400, 400) == 0.4 and warmup_lr(0.4, 10_000, 400) == 0.4
    assert warmup_lr(0.4, 1, 0) == 0.4  # no warm-up


def test_the_curve_has_one_point_per_interval(data):
    c = curve(data, 32, 0.05)
    assert c["samples"] == [256, 512, 768, 1024]
    assert len(c["loss"]) == 4 and all(torch.isfinite(torch.tensor(c["loss"])))


def test_every_batch_size_sees_the_same_samples_in_the_same_order(data):
    """With lr 0 nothing trains: each interval's mean loss is then the mean over the same
    samples, whatever their grouping into batches."""
    small, large = curve(data, 32, 0.0), curve(data, 128, 0.0)
    assert small["loss"] == pytest.approx(large["loss"], rel=1e-6)
    assert len(set(small["loss"])) == 4  # and the intervals differ: samples are not repeated


def test_the_linear_scaling_rule_holds_for_small_steps(data):
    """k steps of lr on B samples ~ one step of k lr on kB samples while the gradient hardly
    changes between them: at lr 1e-3 the rule's run tracks the small batch's curve several
    times more closely than the large batch with the unchanged rate (measured: 11 times)."""
    small = torch.tensor(curve(data, 32, 1e-3)["loss"])
    rule = torch.tensor(curve(data, 128, 4e-3)["loss"])
    same_lr = torch.tensor(curve(data, 128, 1e-3)["loss"])
    initial = curve(data, 32, 0.0)["loss"][-1]
    rule_gap = (rule - small).abs().max()
    assert rule_gap < 0.25 * (same_lr - small).abs().max()
    assert small[-1] < initial  # and the small batch did learn


def test_a_warm_up_of_one_step_or_none_changes_nothing(data):
    # the step's own samples count: a 64-sample warm-up already gives a 64-batch the full lr
    assert curve(data, 64, 0.05, warmup=64)["loss"] == curve(data, 64, 0.05)["loss"]
    assert curve(data, 64, 0.05, warmup=512)["loss"] != curve(data, 64, 0.05)["loss"]


def test_init_scale_sets_the_starting_weights(data):
    assert curve(data, 32, 0.0, init_scale=0.2)["loss"] != curve(data, 32, 0.0)["loss"]


def test_batch_sizes_must_divide_the_intervals(data):
    X, y = data
    with pytest.raises(ValueError, match="must divide"):
        loss_curve(X, y, 48, 0.1, SAMPLES, log_every=LOG_EVERY)


def test_scaling_rule_runs_are_the_four_runs_of_the_rule(data):
    X, y = data
    runs = scaling_rule_runs(X, y, 32, 0.01, 4, 1024, 256)
    assert list(runs) == ["B=32, lr 0.01", "B=128, lr 0.01", "B=128, lr 0.04",
                          "B=128, lr 0.04, warm-up"]
    assert runs["B=32, lr 0.01"]["loss"] == loss_curve(X, y, 32, 0.01, 1024)["loss"]
    assert runs["B=128, lr 0.01"]["loss"] == loss_curve(X, y, 128, 0.01, 1024)["loss"]
    assert runs["B=128, lr 0.04"]["loss"] == loss_curve(X, y, 128, 0.04, 1024)["loss"]
    assert runs["B=128, lr 0.04, warm-up"]["loss"] == loss_curve(X, y, 128, 0.04, 1024,
                                                                 256)["loss"]
