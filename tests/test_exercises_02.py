"""The checkers of chapter 02 say "correct" to right answers and reject known wrong ones."""
import math
from dataclasses import replace

import torch

from dpcourse import Settings, init_lenet_params, lenet, load_fashion_mnist, loss, sgd, train
from dpcourse.exercises.ch02 import (check_best_lr, check_flat_size, check_param_count,
                                     check_plateau_scale, check_same_as_baseline)
from dpcourse.training import TrainResult

CPU = [torch.device("cpu")]


def verdict(capsys) -> str:
    """The first word of what the checker printed: "correct", "not" (quite) or "different"."""
    return capsys.readouterr().out.split()[0].rstrip(":")


def run(lr: float, test_acc: float) -> TrainResult:
    """A finished run with the given learning rate and final test accuracy (no training)."""
    return TrainResult(["cpu"], replace(Settings(), lr=lr), "test", [2.0], [test_acc])


def test_best_lr_is_the_one_with_the_highest_accuracy(capsys):
    results = {0.05: run(0.05, 0.5), 0.1: run(0.1, 0.7), 0.2: run(0.2, 0.6), 0.8: run(0.8, 0.3)}
    check_best_lr(0.1, results)
    assert verdict(capsys) == "correct"
    check_best_lr(0.2, results)
    assert verdict(capsys) == "not"
    check_best_lr(0.4, results)
    assert "you did not train with lr 0.4" in capsys.readouterr().out


def test_best_lr_rejects_runs_filed_under_the_wrong_rate(capsys):
    same = run(0.1, 0.7)  # train(1) called without lr=, filed under every key
    check_best_lr(0.1, {0.05: same, 0.1: same, 0.2: same})
    out = capsys.readouterr().out
    assert out.startswith("not quite") and "results[0.05] was trained with lr 0.1" in out


def plateau_curves(steps: int = 48) -> dict[float, list[float]]:
    """0.02 stays on ln 10; 0.03 falls 0.2 below it at the last step; 0.05 falls at once."""
    return {0.02: [math.log(10)] * steps,
            0.03: [math.log(10)] * (steps - 1) + [math.log(10) - 0.2],
            0.05: [1.5] * steps}


def test_plateau_scale_is_the_smallest_that_falls_below_ln10(capsys):
    check_plateau_scale(0.03, plateau_curves())
    assert verdict(capsys) == "correct"
    check_plateau_scale(0.05, plateau_curves())
    assert "scale 0.03 also left the plateau" in capsys.readouterr().out
    check_plateau_scale(0.02, plateau_curves())
    assert "never fell" in capsys.readouterr().out


def test_plateau_scale_never_tried_or_curves_too_short_get_a_message(capsys):
    check_plateau_scale(0.04, plateau_curves())
    assert "you did not try 0.04" in capsys.readouterr().out
    check_plateau_scale(0.03, {0.02: [], 0.03: [], 0.05: []})  # no ValueError from min([])
    assert "curves[0.02] has 0 losses" in capsys.readouterr().out
    check_plateau_scale(0.03, plateau_curves(steps=10))
    assert "append the loss of each of the 48 steps" in capsys.readouterr().out


def test_param_count_accepts_the_count_as_int_or_string(capsys):
    by_hand = 32 * 9 + 32 + 50 * 32 * 25 + 50 + 800 * 128 + 128 + 128 * 10 + 10
    check_param_count(by_hand)
    check_param_count(str(by_hand))
    assert capsys.readouterr().out.splitlines() == ["correct", "correct"]
    check_param_count("144,188")
    assert "give a whole number" in capsys.readouterr().out


def test_param_count_hints_name_the_forgotten_tensor(capsys):
    check_param_count(129_068 - 20 * 9 + 32 * 9 - 20 * 50 * 25 + 32 * 50 * 25)  # b1 kept at 20
    assert "b1 grows too" in capsys.readouterr().out
    check_param_count(129_068 - 180 + 32 * 9 - 20 + 32)  # W2 kept at 20 input channels
    assert "W2 changes too" in capsys.readouterr().out
    check_param_count(129_068)
    assert verdict(capsys) == "not"


def test_param_count_names_w1_when_only_w1_was_left_at_20_filters(capsys):
    check_param_count(20 * 9 + 32 + 50 * 32 * 25 + 50 + 800 * 128 + 128 + 128 * 10 + 10)
    assert capsys.readouterr().out == ("not quite (144,080): W1 grows too: 32 filters of "
                                       "1 x 3 x 3\n")
    check_param_count(129_068 + 12)  # only b1 grown: W1 and W2 left as they were
    assert capsys.readouterr().out == ("not quite (129,080): W1 grows too: 32 filters of "
                                       "1 x 3 x 3; W2 changes too: it has one 5x5 slice per "
                                       "input channel, 32 now\n")


def test_flat_size_for_32x32_images(capsys):
    check_flat_size(50 * 5 * 5)
    assert verdict(capsys) == "correct"
    check_flat_size(800)
    assert verdict(capsys) == "not"


def baseline_loop(lr: float = 0.1, size: int = 1_024) -> tuple[list[float], list[float]]:
    """One epoch of the chapter's baseline loop with the CPU settings: epoch loss, test acc."""
    train_iter, test_iter = load_fashion_mnist(256, size, 512, source="synthetic")
    params = [p.requires_grad_() for p in init_lenet_params(seed=0, scale=0.1)]
    total = 0.0
    for X, y in train_iter:
        l = loss(lenet(X, params), y).sum()
        l.backward()
        sgd(params, lr, X.shape[0])
        total += l.item()
    with torch.no_grad():
        correct = sum(int((lenet(X, params).argmax(1) == y).sum()) for X, y in test_iter)
    return [total / size], [correct / len(test_iter.dataset)]


def test_train_reproduces_the_baseline_loop_exactly_on_the_cpu(capsys):
    epoch_loss, test_acc = baseline_loop()
    result = train(devs=CPU, num_epochs=1, train_size=1_024, test_size=512, source="synthetic",
                   progress=False)
    capsys.readouterr()
    assert result.train_loss == epoch_loss and result.test_acc == test_acc
    check_same_as_baseline(result, epoch_loss, test_acc)
    assert verdict(capsys) == "correct"


def test_cpu_needs_identity_and_gpu_gets_a_tolerance_below_another_lr(capsys):
    epoch_loss, test_acc = baseline_loop()
    other_lr = TrainResult(["cuda:0"], Settings(), "test", *baseline_loop(lr=0.2))
    capsys.readouterr()
    rounded = TrainResult(["cpu"], Settings(), "test", [epoch_loss[0] * (1 + 1e-7)], test_acc)
    check_same_as_baseline(rounded, epoch_loss, test_acc)
    assert verdict(capsys) == "different"
    rounded.devices = ["cuda:0"]
    check_same_as_baseline(rounded, epoch_loss, test_acc)
    assert capsys.readouterr().out.startswith("correct on a GPU")
    check_same_as_baseline(other_lr, epoch_loss, test_acc)
    out = capsys.readouterr().out
    assert out.startswith("different") and "CUBLAS_WORKSPACE_CONFIG=:4096:8" in out


# ---- the cleared parts (lenet, sgd) and exercise 6 ----

def test_lenet_check_accepts_the_package_and_rejects_max_pooling() -> None:
    import pytest
    from dpcourse.exercises.ch02 import check_lenet
    check_lenet(lenet)

    def max_pooled(X, params):
        W1, b1, W2, b2, W3, b3, W4, b4 = params
        h = torch.nn.functional.max_pool2d(torch.relu(torch.conv2d(X, W1, b1)), 2)
        h = torch.nn.functional.max_pool2d(torch.relu(torch.conv2d(h, W2, b2)), 2)
        return torch.relu(h.reshape(h.shape[0], -1) @ W3 + b3) @ W4 + b4
    with pytest.raises(AssertionError, match="logits differ"):
        check_lenet(max_pooled)


def test_sgd_check_accepts_the_package_and_rejects_an_update_out_of_place() -> None:
    import pytest
    from dpcourse.exercises.ch02 import check_sgd
    check_sgd(sgd)

    def out_of_place(params, lr, batch_size):
        for i, p in enumerate(params):
            params[i] = (p - lr * p.grad / batch_size).detach().requires_grad_()
    with pytest.raises(AssertionError, match="in place"):
        check_sgd(out_of_place)


def test_sgd_check_says_a_rebinding_update_was_not_in_place() -> None:
    import pytest
    from dpcourse.exercises.ch02 import check_sgd

    def rebinding(params, lr, batch_size):
        with torch.no_grad():
            for p in params:
                p = p - lr * p.grad / batch_size  # a new tensor named p; params[i] unchanged
                p.grad = None
    with pytest.raises(AssertionError, match="parameter 0 did not change: the update was not "
                                             "in place"):
        check_sgd(rebinding)


def test_sgd_check_names_an_update_outside_no_grad_in_one_line() -> None:
    """torch refuses it inside the student's sgd: the checker's line, not torch's error."""
    import pytest
    from dpcourse.exercises.ch02 import check_sgd

    def recorded(params, lr, batch_size):
        for p in params:
            p -= lr * p.grad / batch_size
            p.grad = None
    with pytest.raises(AssertionError, match=r"^sgd changed a parameter in place while "
                                             r"autograd records.*under torch\.no_grad\(\)$"):
        check_sgd(recorded)


def test_lenet_check_names_a_batch_flattened_whole_in_one_line() -> None:
    import pytest
    from dpcourse.exercises.ch02 import check_lenet

    def flattened_whole(X, params):
        W1, b1, W2, b2, W3, b3, W4, b4 = params
        h = torch.nn.functional.avg_pool2d(torch.relu(torch.conv2d(X, W1, b1)), 2)
        h = torch.nn.functional.avg_pool2d(torch.relu(torch.conv2d(h, W2, b2)), 2)
        return torch.relu(h.reshape(1, -1) @ W3 + b3) @ W4 + b4
    with pytest.raises(AssertionError, match=r"^a dense layer got the wrong shape \(mat1 and "
                                             r"mat2 shapes cannot be multiplied .*\): flatten "
                                             r"each image, not the whole batch"):
        check_lenet(flattened_whole)


def momentum_sgd(params, buffers, lr, batch_size, momentum=0.9):
    with torch.no_grad():
        for i, p in enumerate(params):
            g = p.grad / batch_size
            buffers[i] = g.clone() if buffers[i] is None else momentum * buffers[i] + g
            p -= lr * buffers[i]
            p.grad = None


def test_momentum_accepts_torchs_rule_and_rejects_plain_sgd(capsys) -> None:
    from dpcourse.exercises.ch02 import check_sgd_momentum
    check_sgd_momentum(momentum_sgd)
    assert verdict(capsys) == "correct"
    check_sgd_momentum(lambda params, buffers, lr, batch_size, momentum=0.9: sgd(params, lr,
                                                                              batch_size))
    assert "after step 2" in capsys.readouterr().out
