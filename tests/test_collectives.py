import pytest
import torch

from dpcourse import allreduce, broadcast, devices, get_params, ring_allreduce, ring_schedule
from dpcourse.exercises.ch03 import check_spread_allreduce
from dpcourse.ring import send_chunk

COLLECTIVES = [allreduce, ring_allreduce]
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64]


def random_tensors(k, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(k)]
    return [torch.randint(-1000, 1000, shape, generator=g, dtype=dtype) for _ in range(k)]


def expected_sum(tensors):  # float64 reference, independent of any summation order
    return torch.stack([t.double() for t in tensors]).sum(0)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (5,), (7, 3), (2, 3, 4), (1031,)])
def test_every_tensor_ends_equal_to_the_sum(collective, k, dtype, shape):
    tensors = random_tensors(k, shape, dtype, seed=k * 100 + len(shape))
    want = expected_sum(tensors)
    collective(tensors)
    for t in tensors:
        assert t.dtype == dtype and t.shape == torch.Size(shape)
        torch.testing.assert_close(t.double(), want, rtol=1e-5, atol=1e-5 * k)
        assert torch.equal(t, tensors[0])  # bitwise: every device holds the same values


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_non_contiguous_tensors_are_reduced_in_place(collective):
    tensors = [torch.randn(6, 4).t() for _ in range(3)]
    want = expected_sum(tensors)
    collective(tensors)
    for t in tensors:
        torch.testing.assert_close(t.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 3, 8, 10, 1000, 1001])
def test_ring_traffic_is_2_k_minus_1_over_k_n_per_device(k, n):
    sent = ring_allreduce([torch.zeros(n) for _ in range(k)])
    # chunks differ by at most one element, and each device skips two of them
    for s in sent:
        assert abs(s - 2 * (k - 1) * n / k) <= 2
    assert sum(sent) == 2 * (k - 1) * n  # every chunk travels k-1 times per phase


@pytest.mark.parametrize("k", range(1, 9))
def test_naive_allreduce_sends_everything_through_the_first_device(k):
    assert allreduce([torch.zeros(10) for _ in range(k)]) == [(k - 1) * 10] + [10] * (k - 1)


@pytest.mark.parametrize("k", range(2, 9))
def test_ring_schedule_sends_each_chunk_once_per_step_around_the_ring(k):
    steps = ring_schedule(k)
    assert [p for p, _ in steps] == ["reduce-scatter"] * (k - 1) + ["all-gather"] * (k - 1)
    for _, transfers in steps:
        assert sorted(src for src, _, _ in transfers) == list(range(k))
        assert all(dst == (src + 1) % k for src, dst, _ in transfers)
        assert sorted(c for _, _, c in transfers) == list(range(k))


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_shape_and_dtype_mismatches_are_named(collective):
    name = collective.__name__
    with pytest.raises(ValueError, match=rf"{name}: tensor 1 has shape \(3,\) but tensor 0 has shape \(2,\)"):
        collective([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match=f"{name}: tensor 2 has dtype torch.int64"):
        collective([torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(ValueError, match="empty list"):
        collective([])


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_aliased_tensors_are_refused(collective):
    t = torch.ones(3)
    with pytest.raises(ValueError, match="tensors 0 and 1 share memory"):
        collective([t, t])


def test_get_params_copies_are_independent_even_on_the_same_device():
    source = [torch.randn(3, 2), torch.zeros(4)]
    saved = [p.clone() for p in source]
    copies = [get_params(source, d) for d in [torch.device("cpu"), *devices(2, simulate=True)]]
    copies[0][0].data.add_(1.0)
    for p, s in zip(source, saved):
        assert torch.equal(p, s)
    for other in copies[1:]:
        assert torch.equal(other[0], saved[0]) and other[0].requires_grad


def test_broadcast_gives_one_independent_copy_per_device():
    t = torch.arange(6.0)
    copies = broadcast(t, devices(3, simulate=True))
    copies[1].zero_()
    assert torch.equal(t, torch.arange(6.0)) and torch.equal(copies[2], t)
    assert [str(c.device) for c in copies] == ["cpu"] * 3 and len({c.data_ptr() for c in copies}) == 3
    with pytest.raises(ValueError, match="empty device list"):
        broadcast(t, [])


def test_send_chunk_adds_during_reduce_scatter_and_overwrites_during_all_gather():
    tensors = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])]
    chunks = [t.tensor_split(2) for t in tensors]  # chunk 0: 2 elements, chunk 1: 1
    assert send_chunk(chunks, "reduce-scatter", 0, 1, 0) == 2
    assert tensors[1].tolist() == [11.0, 22.0, 30.0] and tensors[0].tolist() == [1.0, 2.0, 3.0]
    assert send_chunk(chunks, "all-gather", 1, 0, 1) == 1
    assert tensors[0].tolist() == [1.0, 2.0, 30.0]


def reference_spread_allreduce(grads):
    """Exercise 1 of chapter 03, written independently: parameter j summed on device j mod k."""
    k, sent = len(grads), [0] * len(grads)
    for j, tensors in enumerate(zip(*grads)):
        total = sum(t.clone() for t in tensors)
        for d, t in enumerate(tensors):
            t.copy_(total)
            sent[d] += t.numel() * (k - 1 if d == j % k else 1)
    return sent


def test_spread_allreduce_checker_accepts_the_right_counts_and_rejects_wrong_ones(capsys):
    check_spread_allreduce(reference_spread_allreduce)
    assert capsys.readouterr().out.startswith("correct")
    check_spread_allreduce(lambda grads: reference_spread_allreduce(grads)[::-1])
    assert "the elements sent should be" in capsys.readouterr().out
    check_spread_allreduce(lambda grads: None)  # sums left undone
    assert "does not hold the sum" in capsys.readouterr().out
