import pytest
import torch
import torch.nn.functional as F

import dpcourse.training
from dpcourse import (allreduce, devices, get_params, init_lenet_params, lenet, ring_allreduce,
                      train, train_batch)
from dpcourse.experiments.simulated import forward_backward_seconds
from dpcourse.training import divergence, largest_difference, sgd_displacement, train_steps

LR = 0.2


def one_device_step(params, X, y, lr=LR):
    """Reference: mean cross entropy on the whole batch and torch.optim.SGD on one device."""
    ps = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.SGD(ps, lr=lr)
    F.cross_entropy(lenet(X, ps), y).backward()
    opt.step()
    return [p.detach() for p in ps]


def assert_step_matches_one_device(k, n, seed=0, reduce=allreduce):
    params = init_lenet_params(seed, scale=0.1)
    g = torch.Generator().manual_seed(seed)
    X, y = torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    devs = devices(k, simulate=True)
    device_params = [get_params(params, d) for d in devs]
    train_batch(X, y, device_params, devs, LR, allreduce=reduce)
    want = one_device_step(params, X, y)
    for replica in device_params:
        for got, ref, before in zip(replica, want, params):
            # float32, summed in a different order: compare the updates to 1e-4 of the largest
            # (measured worst over these cases: 1.6e-5, on 1 and 2 threads)
            torch.testing.assert_close(got.detach() - before, ref - before, rtol=1e-5,
                                       atol=1e-4 * float((ref - before).abs().max()))
        for got, first in zip(replica, device_params[0]):
            assert torch.equal(got, first)  # the replicas agree bitwise


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("n", [1, 3, 7, 16, 50])
def test_one_step_on_k_devices_equals_one_step_on_one_device(k, n):
    assert_step_matches_one_device(k, n, seed=k + n)


@pytest.mark.parametrize("k", [2, 3, 8])
def test_one_step_with_the_ring_allreduce_equals_one_step_on_one_device(k):
    assert_step_matches_one_device(k, 50, seed=k, reduce=ring_allreduce)


def rebinding_allreduce(data):  # d2l's allreduce for 11 months: data[i] = ... rebinds
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i] = data[0].to(data[i].device)


def test_the_textbooks_rebinding_allreduce_bug_is_caught():
    with pytest.raises(AssertionError):
        assert_step_matches_one_device(2, 16, reduce=rebinding_allreduce)


def random_batches(steps, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
            for _ in range(steps)]


def test_many_float64_steps_on_k_devices_follow_plain_sgd_on_one_device():
    batches = random_batches(8)
    ps = [p.double().requires_grad_() for p in init_lenet_params(0, scale=0.1)]
    opt = torch.optim.SGD(ps, lr=LR)  # the reference: torch's SGD on the mean loss
    for replicas, (X, y) in zip(train_steps(batches, devices(3, simulate=True), LR,
                                            dtype=torch.float64), batches):
        opt.zero_grad()
        F.cross_entropy(lenet(X.double(), ps), y).backward()
        opt.step()
        assert replicas[0][0].dtype == torch.float64
        assert largest_difference(replicas, [ps]) < 1e-12


def test_the_rebinding_bug_makes_device_0_drift_from_the_second_step_on():
    batches, devs = random_batches(3), devices(2, simulate=True)
    reference = train_steps(batches, devs[:1], LR, dtype=torch.float64)
    buggy = train_steps(batches, devs, LR, dtype=torch.float64, allreduce=rebinding_allreduce)
    device0 = [largest_difference(b[:1], r) for r, b in zip(reference, buggy)]
    assert device0[0] < 1e-12 and device0[1] > 1e-9


def test_divergence_compares_every_k_and_another_seed_step_by_step():
    curves = divergence(random_batches(3), devices(4, simulate=True), LR, ks=(2, 4),
                        dtype=torch.float64)
    assert list(curves) == ["2 devices", "4 devices", "seed 1, 1 device"]
    assert all(len(c) == 3 for c in curves.values())
    assert max(curves["2 devices"] + curves["4 devices"]) < 1e-12
    assert min(curves["seed 1, 1 device"]) > 0.01  # other initial weights


def test_largest_difference_looks_at_every_replica():
    a = [[torch.zeros(3)], [torch.zeros(3)]]
    b = [[torch.zeros(3)], [torch.tensor([0.0, -2.0, 0.0])]]
    assert largest_difference(a, b) == 2.0 and largest_difference(a, a) == 0.0


def test_train_batch_returns_the_summed_loss():
    params = init_lenet_params(0, scale=0.1)
    X, y = torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))
    want = F.cross_entropy(lenet(X, params), y, reduction="sum")
    devs = devices(3, simulate=True)
    got = train_batch(X, y, [get_params(params, d) for d in devs], devs, LR)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_train_batch_needs_one_set_of_parameters_per_device():
    devs = devices(2, simulate=True)
    with pytest.raises(ValueError, match=r"one parameter replica per device is needed: 2 device\(s\), 1 replica\(s\)"):
        train_batch(torch.rand(4, 1, 28, 28), torch.zeros(4, dtype=torch.long),
                    [get_params(init_lenet_params(), devs[0])], devs, LR)
    with pytest.raises(ValueError, match="X has 4 examples but y has 3"):
        train_batch(torch.rand(4, 1, 28, 28), torch.zeros(3, dtype=torch.long),
                    [get_params(init_lenet_params(), d) for d in devs], devs, LR)


def test_evaluation_needs_one_replica_per_device():
    devs = devices(3, simulate=True)
    batch = [(torch.rand(6, 1, 28, 28), torch.zeros(6, dtype=torch.long))]
    with pytest.raises(ValueError, match=r"one parameter replica per device is needed: 3 device\(s\), 2 replica\(s\)"):
        dpcourse.training.evaluate_accuracy(batch, [get_params(init_lenet_params(), d)
                                                    for d in devs[:2]], devs)


def test_train_keeps_replicas_identical_and_reports_each_epoch():
    r = train(devs=devices(3, simulate=True), batch_size=64, num_epochs=2, train_size=320,
              test_size=100, source="synthetic", progress=False)
    assert r.devices == ["cpu:0", "cpu:1", "cpu:2"] and r.data.startswith("synthetic")
    assert len(r.train_loss) == len(r.test_acc) == len(r.epoch_seconds) == 2
    assert r.replica_spread == 0.0
    assert all(0 <= a <= 1 for a in r.test_acc) and r.train_loss[1] < r.train_loss[0]


def test_train_records_every_step_and_follows_the_learning_rate_schedule():
    kw = dict(devs=devices(2, simulate=True), batch_size=64, num_epochs=2, train_size=192,
              test_size=64, source="synthetic", progress=False)
    asked = []
    scheduled = train(lr_schedule=lambda step: asked.append(step) or 0.1, **kw)
    constant = train(lr=0.1, **kw)
    assert asked == list(range(6)) and len(scheduled.step_loss) == 6
    assert scheduled.step_loss == constant.step_loss
    assert scheduled.train_loss[0] == pytest.approx(sum(scheduled.step_loss[:3]) / 3, rel=1e-6)
    frozen = train(lr_schedule=lambda step: 0.0, **kw)  # no update: the loss of fixed weights
    assert frozen.step_loss[:3] != constant.step_loss[:3] and frozen.step_loss[0] == constant.step_loss[0]


def test_sgd_displacement_follows_torch_sgd_step_by_step_and_leaves_params_alone():
    batches = random_batches(3)
    params = [p.double() for p in init_lenet_params(0, scale=0.1)]
    before = [p.clone() for p in params]
    ps = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.SGD(ps, lr=LR)  # the reference: torch's SGD on the mean loss
    for X, y in batches:
        opt.zero_grad()
        F.cross_entropy(lenet(X.double(), ps), y).backward()
        opt.step()
    want = torch.cat([(p - p0).detach().flatten() for p, p0 in zip(ps, params)])
    got = sgd_displacement(params, batches, LR)
    assert got.dtype == torch.float64 and got.shape == (sum(p.numel() for p in params),)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_one_step_at_k_times_the_rate_is_k_times_the_step_at_the_rate():
    params = [p.double() for p in init_lenet_params(0, scale=0.1)]
    batch = random_batches(1, n=32)
    torch.testing.assert_close(sgd_displacement(params, batch, 4 * LR),
                               4 * sgd_displacement(params, batch, LR), rtol=1e-12, atol=1e-15)


def test_forward_backward_timing_per_thread_count_restores_the_thread_count():
    before = torch.get_num_threads()
    times = forward_backward_seconds([1, 2], batch_size=8, repeats=2)
    assert list(times) == [1, 2] and all(t > 0 for t in times.values())
    assert torch.get_num_threads() == before
