import pytest
import torch
from torch import nn

from dpcourse import devices, get_params, init_lenet_params, train_batch
from dpcourse.checkpoint import load_checkpoint, save_checkpoint, unwrap
from dpcourse.concise import make_resnet18, warm_up
from dpcourse.data_parallel import (ScratchDataParallel, bytes_through_device0,
                                    max_relative_difference, sgd_steps)
from dpcourse.lenet import LeNet
from dpcourse.resnet import resnet18

TUTORIAL = {1: ([30], [10]), 2: ([15, 15], [5, 5]), 3: ([10, 10, 10], [4, 4, 2]),
            8: ([4] * 7 + [2], [2] * 5)}


def small_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def forward_backward(model, X, y):
    for p in model.parameters():
        p.grad = None
    out = model(X)
    nn.functional.cross_entropy(out, y).backward()
    return out.detach(), [p.grad.clone() for p in unwrap(model).parameters()]


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("n", [1, 3, 7, 16])
def test_wrapper_gives_the_plain_modules_outputs_and_gradients(k, n):
    net = small_net(k)
    X, y = torch.randn(n, 1, 8, 8), torch.randint(0, 5, (n,))
    want_out, want_grads = forward_backward(net, X, y)
    got_out, got_grads = forward_backward(ScratchDataParallel(net, devices(k, simulate=True)), X, y)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_resnet_in_eval_mode_is_the_same_on_three_devices():
    net = resnet18().eval()
    X, y = torch.randn(5, 1, 28, 28), torch.randint(0, 10, (5,))
    want_out, want_grads = forward_backward(net, X, y)
    got_out, got_grads = forward_backward(ScratchDataParallel(net, devices(3, simulate=True)), X, y)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_batch_norm_normalises_each_shard_on_its_own():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    X = torch.randn(8, 3) * torch.arange(1.0, 9.0)[:, None]  # shards with different statistics
    one = ScratchDataParallel(bn, devices(1, simulate=True))(X)
    two = ScratchDataParallel(bn, devices(2, simulate=True))(X)
    torch.testing.assert_close(one, nn.functional.batch_norm(X, None, None, training=True))
    torch.testing.assert_close(two, torch.cat([nn.functional.batch_norm(s, None, None, training=True)
                                               for s in X.chunk(2)]))
    assert (one - two).abs().max() > 0.1


def test_running_statistics_come_from_the_first_devices_shard_as_in_data_parallel():
    bn, ref = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    X = torch.randn(10, 3)
    ScratchDataParallel(bn, devices(2, simulate=True))(X)
    ref(X[:5])
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    assert int(bn.num_batches_tracked) == 1


class SizeRecorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.sizes = nn.Linear(5, 2), []

    def forward(self, X):
        self.sizes.append(X.shape[0])
        return self.fc(X)


@pytest.mark.parametrize("k", TUTORIAL)
def test_the_pytorch_tutorials_input_sizes_are_reproduced(k):
    model = SizeRecorder()
    wrapped = ScratchDataParallel(model, devices(k, simulate=True))
    for X in torch.randn(100, 5).split(30):
        model.sizes.clear()
        assert wrapped(X).shape == (X.shape[0], 2)
        assert model.sizes == TUTORIAL[k][X.shape[0] == 10]


@pytest.mark.parametrize("save_wrapped", [False, True])
@pytest.mark.parametrize("load_wrapped", [False, True])
def test_checkpoints_round_trip_with_and_without_the_wrapper(tmp_path, save_wrapped, load_wrapped):
    devs = devices(2, simulate=True)
    source, target = small_net(1), small_net(2)
    save_checkpoint(ScratchDataParallel(source, devs) if save_wrapped else source, tmp_path / "c.pt")
    load_checkpoint(ScratchDataParallel(target, devs) if load_wrapped else target, tmp_path / "c.pt")
    for a, b in zip(source.state_dict().values(), target.state_dict().values()):
        assert torch.equal(a, b)
    assert all(not k.startswith("module.") for k in torch.load(tmp_path / "c.pt"))


def test_a_data_parallel_style_checkpoint_with_module_prefix_loads_into_a_plain_module(tmp_path):
    source, target = small_net(1), small_net(2)
    wrapped = ScratchDataParallel(source, devices(2, simulate=True))
    assert next(iter(wrapped.state_dict())).startswith("module.")  # the pitfall
    torch.save(wrapped.state_dict(), tmp_path / "dp.pt")
    load_checkpoint(target, tmp_path / "dp.pt")
    assert torch.equal(target[0].weight, source[0].weight)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="empty device list"):
        ScratchDataParallel(small_net(), [])
    with pytest.raises(ValueError, match="empty batch"):
        ScratchDataParallel(small_net(), devices(2, simulate=True))(torch.randn(0, 1, 8, 8))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for nn.DataParallel")
def test_same_as_nn_data_parallel_on_real_gpus():
    net = small_net().cuda()
    X, y = torch.randn(7, 1, 8, 8).cuda(), torch.randint(0, 5, (7,)).cuda()
    devs = devices(2)
    want_out, want_grads = forward_backward(nn.DataParallel(net, device_ids=[0, 1]), X, y)
    got_out, got_grads = forward_backward(ScratchDataParallel(net, devs), X, y)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def lenet_batches(n_batches, dtype):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 1, 28, 28, generator=g, dtype=dtype),
             torch.randint(0, 10, (16,), generator=g)) for _ in range(n_batches)]


@pytest.mark.parametrize("k", [2, 3, 5])
def test_several_float64_steps_on_k_devices_are_one_devices_steps_to_rounding(k):
    params0 = [p.double() for p in init_lenet_params(seed=0, scale=0.1)]
    batches, devs = lenet_batches(5, torch.float64), devices(k, simulate=True)
    one_device = sgd_steps(LeNet(params0), batches, 0.1, torch.device("cpu"))
    wrapper = sgd_steps(ScratchDataParallel(LeNet(params0), devs), batches, 0.1, devs[0])
    by_hand = [get_params(params0, d) for d in devs]
    for X, y in batches:
        train_batch(X, y, by_hand, devs, 0.1)
    assert max_relative_difference(wrapper, one_device) < 1e-12
    assert max_relative_difference(by_hand[0], one_device) < 1e-12
    moved = max_relative_difference(params0, one_device)
    assert moved > 1e-3  # the steps changed the parameters, so the comparison means something


def test_sgd_steps_is_plain_sgd_on_the_mean_cross_entropy():
    torch.manual_seed(0)
    net = nn.Linear(4, 3).double()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    W, b = net.weight.detach().clone(), net.bias.detach().clone()
    p = torch.softmax(X @ W.T + b, dim=1) - nn.functional.one_hot(y, 3)  # d(mean CE)/d(logits) * n
    got = sgd_steps(net, [(X, y)], 0.5, torch.device("cpu"))
    torch.testing.assert_close(got[0], W - 0.5 * p.T @ X / 6)
    torch.testing.assert_close(got[1], b - 0.5 * p.sum(0) / 6)


def test_max_relative_difference_is_relative_to_each_tensors_scale():
    want = [torch.tensor([1.0, -4.0]), torch.tensor([0.01])]
    assert max_relative_difference([w.clone() for w in want], want) == 0
    assert max_relative_difference([torch.tensor([1.0, -3.0]), torch.tensor([0.01])], want) == 0.25
    assert max_relative_difference([want[0], torch.tensor([0.011])], want) == pytest.approx(0.1)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_bytes_through_device0_count_what_data_parallel_moves(k):
    net = resnet18()
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    got = bytes_through_device0(sum(p.numel() for p in net.parameters()), 28 * 28, 10, k)
    batch = torch.zeros(256 * k, 1, 28, 28)
    sent_shards = sum(s.numel() * s.element_size() for s in batch.chunk(k)[1:])
    assert got["replicate"] == got["reduce grads"] == (k - 1) * param_bytes
    assert got["scatter"] == sent_shards
    assert got["gather"] == sent_shards * 10 / (28 * 28)


def test_make_resnet18_initialises_every_layer_and_repeats_with_the_seed():
    net, again = make_resnet18(torch.device("cpu")), make_resnet18(torch.device("cpu"))
    layers = [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(layers) == 21
    for m in layers:
        assert 0.008 < float(m.weight.detach().std()) < 0.012, m  # N(0, 0.01), not PyTorch's default
    for a, b in zip(net.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_warm_up_leaves_parameters_batch_norm_statistics_and_gradients_as_they_were():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 6 * 6, 5))
    X, y = torch.randn(6, 1, 8, 8) + 3, torch.randint(0, 5, (6,))
    before = {name: t.clone() for name, t in net.state_dict().items()}
    warm_up(ScratchDataParallel(net, devices(2, simulate=True)), X, y)
    for name, t in net.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert all(p.grad is None for p in net.parameters())
    net(X)  # the same pass without warm_up's restore moves the running statistics
    assert not torch.equal(net[1].running_mean, before["1.running_mean"])
