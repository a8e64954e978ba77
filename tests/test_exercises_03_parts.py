"""Chapter 03's cleared parts are checked against independent references, and exercise 6's
tree allreduce is checked; right code passes, the textbook's versions are rejected."""
import pytest
import torch

from dpcourse.collectives import allreduce, broadcast, check_devices, get_params
from dpcourse.exercises.ch03 import (check_allreduce, check_broadcast, check_get_params,
                                     check_ring_allreduce, check_tree_allreduce, tree_sent)
from dpcourse.ring import ring_allreduce


def textbook_get_params(params, device):
    new_params = [p.to(device) for p in params]
    for p in new_params:
        p.requires_grad_()
    return new_params


def textbook_allreduce(data):
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i] = data[0].to(data[i].device)
    return [0] * len(data)


@torch.no_grad()
def tree_allreduce(tensors):
    k, n = len(tensors), tensors[0].numel()
    sent = [0] * k
    for i in range(k - 1, 0, -1):
        tensors[(i - 1) // 2].add_(tensors[i])
        sent[i] += n
    for i in range(1, k):
        tensors[i].copy_(tensors[(i - 1) // 2])
        sent[(i - 1) // 2] += n
    return sent


def test_the_package_passes_every_check(capsys) -> None:
    check_get_params(get_params)
    check_broadcast(broadcast)
    check_allreduce(allreduce)
    check_ring_allreduce(ring_allreduce)
    assert capsys.readouterr().out.count(" is right") == 4


def test_the_textbooks_get_params_aliases_on_the_cpu() -> None:
    with pytest.raises(AssertionError, match="in the source's memory"):
        check_get_params(textbook_get_params)


def test_a_copy_without_detach_is_no_leaf_when_the_source_requires_grad() -> None:
    def undetached(params, device):
        return [p.clone().to(device).requires_grad_() for p in params]
    with pytest.raises(AssertionError, match="of sources that require grad: the copy is no "
                                             "leaf, autograd links it to the source: detach"):
        check_get_params(undetached)


def test_requires_grad_before_the_copy_is_told_to_come_after_it() -> None:
    def grad_then_copy(params, device):  # detached, but the copy is recorded by autograd
        return [p.detach().requires_grad_().to(device, copy=True) for p in params]
    with pytest.raises(AssertionError, match=r"^on cpu, parameter 0: the copy is no leaf: .to "
                                             r"recorded the copy for autograd because its input "
                                             r"already required grad; call requires_grad_\(\) "
                                             r"on the copy, after .to$"):
        check_get_params(grad_then_copy)


def test_a_single_device_is_named_in_the_singular() -> None:
    with pytest.raises(AssertionError, match=r"^1 device: tensor 0 does not hold the sum"):
        check_allreduce(lambda tensors: [t.zero_() for t in tensors])
    with pytest.raises(AssertionError, match=r"^1 device should give a list of 1 copy, got"):
        check_broadcast(lambda tensor, devs: [])


def test_the_textbooks_allreduce_leaves_the_other_devices_without_the_sum() -> None:
    with pytest.raises(AssertionError, match="does not hold the sum"):
        check_allreduce(textbook_allreduce)


def test_a_broadcast_without_copies_is_rejected() -> None:
    with pytest.raises(AssertionError, match="share memory"):
        check_broadcast(lambda tensor, devs: [tensor.detach().to(d) for d in devs])


def test_one_clone_sent_to_every_device_is_rejected_on_two_of_the_same() -> None:
    """On [cpu, cpu], .to returns the one clone twice: the two copies are one tensor."""
    def one_clone(tensor, devs):
        check_devices(devs, "broadcast")
        copy = tensor.detach().clone()
        return [copy.to(d) for d in devs]
    with pytest.raises(AssertionError, match=r"^on \[cpu, cpu\] some copies share memory with "
                                             r"each other or with the tensor: \.to returns"):
        check_broadcast(one_clone)


def test_a_ring_that_ignores_non_contiguous_tensors_is_rejected() -> None:
    def contiguous_only(tensors):
        copies = [t.contiguous() for t in tensors]
        return ring_allreduce(copies) if all(t.is_contiguous() for t in tensors) else [0]
    with pytest.raises(AssertionError):
        check_ring_allreduce(contiguous_only)


def test_tree_counts_and_checker(capsys) -> None:
    assert tree_sent(8, 1) == [2, 3, 3, 2, 1, 1, 1, 1]
    check_tree_allreduce(tree_allreduce)
    assert capsys.readouterr().out.startswith("correct")
    check_tree_allreduce(allreduce)
    assert capsys.readouterr().out.startswith("not quite")


@pytest.mark.parametrize("check", [check_get_params, check_broadcast, check_allreduce,
                                   check_ring_allreduce])
def test_a_stub_fails_with_not_implemented_error(check) -> None:
    def stub(*args):
        raise NotImplementedError()
    with pytest.raises(NotImplementedError):
        check(stub)
