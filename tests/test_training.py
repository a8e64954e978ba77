import pytest
import torch
import torch.nn.functional as F

import dpcourse.training
from dpcourse import devices, get_params, init_lenet_params, lenet, train, train_batch

LR = 0.2


def one_device_step(params, X, y, lr=LR):
    """Reference: mean cross entropy on the whole batch and torch.optim.SGD on one device."""
    ps = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.SGD(ps, lr=lr)
    F.cross_entropy(lenet(X, ps), y).backward()
    opt.step()
    return [p.detach() for p in ps]


def assert_step_matches_one_device(k, n, seed=0):
    params = init_lenet_params(seed, scale=0.1)
    g = torch.Generator().manual_seed(seed)
    X, y = torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    devs = devices(k, simulate=True)
    device_params = [get_params(params, d) for d in devs]
    train_batch(X, y, device_params, devs, LR)
    want = one_device_step(params, X, y)
    for replica in device_params:
        for got, ref, before in zip(replica, want, params):
            # float32, summed in a different order: compare the updates, 1e-5 relative
            torch.testing.assert_close(got.detach() - before, ref - before, rtol=1e-5,
                                       atol=1e-5 * float((ref - before).abs().max()))
        for got, first in zip(replica, device_params[0]):
            assert torch.equal(got, first)  # the replicas agree bitwise


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("n", [1, 3, 7, 16, 50])
def test_one_step_on_k_devices_equals_one_step_on_one_device(k, n):
    assert_step_matches_one_device(k, n, seed=k + n)


def test_the_textbooks_rebinding_allreduce_bug_is_caught(monkeypatch):
    def rebinding_allreduce(data):  # d2l's allreduce for 11 months: data[i] = ... rebinds
        for i in range(1, len(data)):
            data[0][:] += data[i].to(data[0].device)
        for i in range(1, len(data)):
            data[i] = data[0].to(data[i].device)

    monkeypatch.setattr(dpcourse.training, "allreduce", rebinding_allreduce)
    with pytest.raises(AssertionError):
        assert_step_matches_one_device(2, 16)


def test_train_batch_returns_the_summed_loss():
    params = init_lenet_params(0, scale=0.1)
    X, y = torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))
    want = F.cross_entropy(lenet(X, params), y, reduction="sum")
    devs = devices(3, simulate=True)
    got = train_batch(X, y, [get_params(params, d) for d in devs], devs, LR)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_train_batch_needs_one_set_of_parameters_per_device():
    devs = devices(2, simulate=True)
    with pytest.raises(ValueError, match="got 1 parameter replicas for 2 devices"):
        train_batch(torch.rand(4, 1, 28, 28), torch.zeros(4, dtype=torch.long),
                    [get_params(init_lenet_params(), devs[0])], devs, LR)
    with pytest.raises(ValueError, match="X has 4 examples but y has 3"):
        train_batch(torch.rand(4, 1, 28, 28), torch.zeros(3, dtype=torch.long),
                    [get_params(init_lenet_params(), d) for d in devs], devs, LR)


def test_evaluation_needs_one_replica_per_device():
    devs = devices(3, simulate=True)
    batch = [(torch.rand(6, 1, 28, 28), torch.zeros(6, dtype=torch.long))]
    with pytest.raises(ValueError, match="got 2 parameter replicas for 3 devices"):
        dpcourse.training.evaluate_accuracy(batch, [get_params(init_lenet_params(), d)
                                                    for d in devs[:2]], devs)


def test_train_keeps_replicas_identical_and_reports_each_epoch():
    r = train(devs=devices(3, simulate=True), batch_size=64, num_epochs=2, train_size=320,
              test_size=100, source="synthetic", progress=False)
    assert r.devices == ["cpu:0", "cpu:1", "cpu:2"] and r.data.startswith("synthetic")
    assert len(r.train_loss) == len(r.test_acc) == len(r.epoch_seconds) == 2
    assert r.replica_spread == 0.0
    assert all(0 <= a <= 1 for a in r.test_acc) and r.train_loss[1] < r.train_loss[0]
