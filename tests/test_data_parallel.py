import pytest
import torch
from torch import nn

from dpcourse import devices
from dpcourse.checkpoint import load_checkpoint, save_checkpoint, unwrap
from dpcourse.data_parallel import ScratchDataParallel
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
