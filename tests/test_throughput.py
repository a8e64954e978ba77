"""throughput: the bus-bandwidth formula, and each driver's figures on a tiny configuration.

Only the shape of the results is checked (keys, positive finite numbers): speeds depend on
the machine and its load, and are printed by the benchmark, never asserted.
"""
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def has_ended(pid: int) -> bool:
    """The process is gone, or a zombie (ended, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until_ended(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not all(map(has_ended, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(map(has_ended, pids))


def test_busy_processes_run_inside_and_are_ended_on_the_way_out_even_on_an_error():
    with pytest.raises(KeyError), throughput.busy_processes(2) as pids:
        assert len(set(pids)) == 2 and not any(map(has_ended, pids))
        raise KeyError("the measurement failed")
    assert all(map(has_ended, pids))  # ended and waited for: nothing left behind
    with throughput.busy_processes(0) as none:
        assert none == []
    with pytest.raises(ValueError, match="whole number n >= 0"):
        throughput.busy_processes(-1).__enter__()


def test_a_busy_process_ends_by_itself_when_its_parent_is_killed():
    """The bench's busy processes outlive no bench, even one killed with SIGKILL."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, os, time\n"
         "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid())])\n"
         "print(child.pid, flush=True)\ntime.sleep(60)", throughput.BUSY_LOOP],
        stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert not has_ended(child)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
    assert wait_until_ended([child])


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 0,
                    reason="this host has a GPU")
def test_gpu_scaling_says_it_needs_a_gpu():
    with pytest.raises(RuntimeError, match="at least one GPU"):
        throughput.gpu_scaling()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_scaling_measures_one_gpu_and_all_of_them():
    k = torch.cuda.device_count()
    assert_rates(throughput.gpu_scaling(steps=3), ["1 GPU"] + ([f"{k} GPUs"] if k > 1 else []))
