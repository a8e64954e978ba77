"""throughput: the bus-bandwidth formula, and each driver's figures on a tiny configuration.

Only the shape of the results is checked (keys, positive finite numbers): speeds depend on
the machine and its load, and are printed by the benchmark, never asserted.
"""
import math

import pytest
import torch

from dpcourse.experiments import throughput

NUMELS = [10, 3000]


def assert_rates(values: dict, keys) -> None:
    assert list(values) == list(keys)
    for key, value in values.items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)


def test_bus_bandwidth_is_the_nccl_tests_convention():
    # 64 MiB in half a second: 2 * 3/4 * 67,108,864 / 0.5 bytes/s on 4 ranks
    assert throughput.bus_bandwidth(64 * 2**20, 0.5, 4) == 201_326_592.0
    assert throughput.bus_bandwidth(1000, 2.0, 2) == 500.0  # 2 ranks: bytes / seconds
    assert throughput.bus_bandwidth(1000, 2.0, 1) == 0.0  # one rank moves nothing


@pytest.fixture(scope="module")
def allreduce_seconds() -> dict:
    return throughput.compare_allreduce(NUMELS, world_size=2, repeats=1, timeout=60)


def test_compare_allreduce_times_each_algorithm_at_each_size(allreduce_seconds):
    assert list(allreduce_seconds) == ["dist.all_reduce", "p2p.allreduce", "p2p.ring_allreduce"]
    for by_numel in allreduce_seconds.values():
        assert_rates(by_numel, NUMELS)


def test_compare_ddp_gives_images_per_second_of_each_variant():
    rates = throughput.compare_ddp(steps=2, batch_size=8, repeats=1, timeout=60)
    assert_rates(rates, ["ScratchDDP", "ScratchDDP, ring", "ScratchDDP, shm", "torch DDP"])


def test_compare_ddp_measures_the_variants_asked_for_and_rejects_unknown_ones():
    rates = throughput.compare_ddp(steps=2, batch_size=8, repeats=1, timeout=60,
                                   variants=("ScratchDDP, shm", throughput.NO_ALLREDUCE))
    assert_rates(rates, ["ScratchDDP, shm", "no allreduce"])
    with pytest.raises(ValueError, match="variants must be some of"):
        throughput.compare_ddp(variants=("ScratchDDP", "Horovod"))


def test_compare_processes_and_threads_gives_images_per_second_of_every_configuration():
    rates = throughput.compare_processes_and_threads(steps=2, global_batch=16, repeats=1,
                                                     timeout=60)
    assert_rates(rates, ["1 process x 1 thread", "1 process x 2 threads",
                         "2 processes x 1 thread, no allreduce", "2 processes x 1 thread",
                         "2 processes x 1 thread, shm"])


def test_processes_and_threads_needs_an_even_global_batch():
    with pytest.raises(ValueError, match="even"):
        throughput.compare_processes_and_threads(global_batch=15)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 0,
                    reason="this host has a GPU")
def test_gpu_scaling_says_it_needs_a_gpu():
    with pytest.raises(RuntimeError, match="at least one GPU"):
        throughput.gpu_scaling()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_scaling_measures_one_gpu_and_all_of_them():
    k = torch.cuda.device_count()
    assert_rates(throughput.gpu_scaling(steps=3), ["1 GPU"] + ([f"{k} GPUs"] if k > 1 else []))
