"""Chapter 10's measurements: the ZeRO-3 formulas by hand, the peak measure on known
allocations, and on real ranks (five launches of 2): the bytes between steps are the shards',
every free is placed, fully_shard trains like one process, and the bytes per step are the
formula's."""
import threading
import time

import pytest
import torch

from dpcourse.experiments import fsdp_demos
from dpcourse.experiments.fsdp_demos import PeakMemory
from dpcourse.experiments.zero_demos import activation_bytes
from dpcourse.fsdp import padded_numel
from dpcourse.lenet import lenet_layers
from dpcourse.memory import bytes_per_rank, largest_model, zero3_peak_bytes

MIB = 2**20
LENET_UNITS = [sum(p.numel() for p in m.parameters()) for m in lenet_layers(0).children()
               if any(True for _ in m.parameters())]


def test_lenet_has_one_unit_per_layer():
    assert LENET_UNITS == [200, 25050, 102528, 1290]


def test_zero3_peak_by_hand():
    """Units of 3, 5 and 2 numbers on 2 ranks, padded to 4, 6 and 2: the middle unit costs
    most: gathered itself and the first (prefetch, 6 + 4), its gradient twice and the last
    unit's in flight (2 x 6 + 2)."""
    out = zero3_peak_bytes(10, [3, 5, 2], 2)
    assert out == {"parameters": 20, "gradients": 20, "optimizer_state": 40,
                   "gathered": 40, "full_gradient": 56, "activations": 0,
                   "total": 80 + 40 + 56}
    assert zero3_peak_bytes(10, [3, 5, 2], 2, prefetch=False)["gathered"] == 24
    bf16 = zero3_peak_bytes(10, [3, 5, 2], 2, compute_bytes=2, activation_bytes=7)
    assert (bf16["gathered"], bf16["full_gradient"], bf16["total"]) == (20, 28, 80 + 48 + 7)


def test_zero3_peak_without_units_is_the_model_states():
    assert zero3_peak_bytes(8, [], 4)["total"] == bytes_per_rank(8, 4, "zero3")["total"]


def test_largest_model_divides_the_device_by_the_bytes_per_parameter():
    """Mixed-precision Adam: 16 bytes per parameter under DDP, (2 + 2 + 12/k) under ZeRO-1,
    16/k under ZeRO-3."""
    assert largest_model(80e9, 8, "ddp") == 5_000_000_000
    assert largest_model(80e9, 8, "zero1") == int(80e9 // 5.5)
    assert largest_model(80e9, 64, "zero3") == 320_000_000_000
    assert largest_model(16, 1, "ddp") == 1 and largest_model(15, 1, "ddp") == 0


def test_peak_memory_catches_known_allocations():
    """4 MiB, 4 MiB, one freed, then 8 MiB: 12 MiB at most, nothing left."""
    with PeakMemory() as memory:
        a, b = torch.empty(MIB), torch.empty(MIB)
        del a
        c = torch.empty(2 * MIB)
        del b, c
    assert (memory.peak(), memory.net()) == (12 * MIB, 0)


def test_peak_memory_places_a_free_by_another_thread_at_its_collective():
    """A tensor another thread frees is missing from the trace; given the collective (started
    after the tensor was made) that held it, it is freed when that ended, before the next
    4 MiB came; without, only if the next takes the same block."""
    held = []
    with PeakMemory() as memory:
        held.append(torch.empty(MIB))
        start = time.perf_counter()
        thread = threading.Thread(target=held.clear)
        thread.start()
        thread.join()
        end = time.perf_counter()
        time.sleep(0.002)
        y = torch.empty(MIB)
    kept = {y.data_ptr()}
    assert (memory.peak([(start, end)], kept), memory.net([(start, end)], kept)) == (
        4 * MIB, 4 * MIB)
    assert memory.net([], kept) in (4 * MIB, 8 * MIB)  # 4: the block came back at once


def test_drivers_reject_unknown_names():
    with pytest.raises(ValueError, match="model must be one of"):
        fsdp_demos.measure_sharding(2, "resnet")
    with pytest.raises(ValueError, match="unknown way"):
        fsdp_demos.compare_fsdp(2, ways=("zero4",))
    with pytest.raises(ValueError, match="optimizers must be among"):
        fsdp_demos.against_fully_shard(2, ("adam",))
    with pytest.raises(ValueError, match="divisible"):
        fsdp_demos.gloo_reduce_scatter(2, numels=(3,))


def test_zero3_holds_the_shards_between_steps_and_every_free_is_placed():
    """LeNet on 2 ranks: parameters and gradients are the padded shards, AdamW's state two
    moments of them and a 4-byte step counter per unit; the trace of forward and backward
    accounts for every byte (frees by gloo's threads included)."""
    r = fsdp_demos.measure_sharding(2, "lenet", 8, ways=("zero3", "zero3 bf16"))
    shard_bytes = 4 * sum(padded_numel(n, 2) for n in LENET_UNITS) // 2
    for way in ("zero3", "zero3 bf16"):
        assert r[way]["unit_numels"] == LENET_UNITS
        for between in r[way]["between_steps"]:
            assert between == {"parameters": shard_bytes, "gradients": shard_bytes,
                               "optimizer_state": 2 * shard_bytes + 4 * len(LENET_UNITS),
                               "total": 4 * shard_bytes + 4 * len(LENET_UNITS)}
        assert r[way]["unaccounted"] == [0, 0]
        assert all(peak > between["total"] for peak, between
                   in zip(r[way]["peak"], r[way]["between_steps"]))


def test_ddp_and_zero2_peaks_are_their_formulas_less_the_activations():
    """linear_stack on 2 ranks, 8 examples each: what backward adds to the bytes a rank holds
    is at its peak (the last bucket's hook, the activations gone) the formula's: DDP every
    gradient twice, ZeRO-2 three times (gloo's list reduce_scatter keeps a copy of each
    bucket in flight) and its last bucket once more (the hook's per-rank pieces)."""
    r = fsdp_demos.measure_sharding(2, "mlp", 8, ways=("ddp", "zero2"))
    model = fsdp_demos.linear_stack()
    activations = activation_bytes(model, *fsdp_demos.model_batch("mlp", 8, seed=0))
    for way in ("ddp", "zero2"):
        formula = r[way]["formula"]  # what backward adds: the peak less what a rank holds
        added = r[way]["formula_peak"] - formula["total"] + formula["gradients"]
        for peak, held in zip(r[way]["peak"], r[way]["between_steps"]):  # (uneven shards)
            measured = peak - held["total"] + held["gradients"]
            assert added - activations <= measured <= added, (way, measured, added)


def test_bytes_per_step_are_the_formulas():
    """One step on 2 ranks: FSDP gathers LeNet's padded units twice and reduce-scatters them
    once, ours and torch's alike (half the bytes in bfloat16); DDP allreduces it once. On a
    ring that is 1.5x DDP's traffic (LeNet's units divide evenly by 2)."""
    ways = ("ddp", "fsdp", "fsdp bf16", "fsdp no prefetch", "torch fully_shard")
    r = fsdp_demos.compare_fsdp(2, steps=1, batch_size=8, repeats=1, ways=ways)
    formula = r["formula"]
    sent = {key: formula[key] for key in ("bytes_gathered", "bytes_reduced")}
    for way in ("fsdp", "fsdp no prefetch", "torch fully_shard"):
        assert {key: r[way][key] for key in sent} == sent, way
    assert {key: r["fsdp bf16"][key] for key in sent} == {k: v // 2 for k, v in sent.items()}
    assert (r["ddp"]["bytes_gathered"], r["ddp"]["bytes_reduced"]) == (0, 4 * sum(LENET_UNITS))
    assert formula["sent_per_rank"] == 1.5 * formula["ddp_sent_per_rank"]


def test_fully_shard_and_scratch_fsdp_train_like_one_process():
    """Five SGD steps (lr 0.01) of LeNet on 2 ranks: both within 1e-6 of one process on the
    whole batches (float32 rounding measured at 4e-8; gradients summed instead of averaged,
    pytorch/pytorch#162338, would differ by about 1e-3), and of each other."""
    r = fsdp_demos.against_fully_shard(2, ("sgd",), steps=5, batch_size=16)["sgd"]
    assert max(r.values()) < 1e-6, r


def test_ring_reduce_scatter_sends_half_of_gloos():
    """On 2 ranks the ring sends (k-1)/k = half the tensor, counted; gloo's reduce-scatter, an
    allreduce (pytorch/pytorch#118911), twice that by the ring's law: derived, not counted."""
    r = fsdp_demos.gloo_reduce_scatter(2, numels=(1024,), repeats=1)
    assert r["p2p.ring_reduce_scatter"][1024]["bytes_sent"] == 2048
    assert r["gloo reduce_scatter"][1024]["bytes_sent"] == 4096
    assert [r[name][1024]["bytes_counted"] for name in fsdp_demos.REDUCE_SCATTERS] == [
        False, False, True]
    assert all(r[name][1024]["seconds"] > 0 for name in fsdp_demos.REDUCE_SCATTERS)


def test_counting_collectives_works_on_a_torch_without_the_single_names(monkeypatch):
    """torch 2.8-2.13 have no all_gather_single / reduce_scatter_single (found on a GPU host
    with torch 2.11): the counter counts what exists and puts back what it replaced."""
    import torch.distributed as dist
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    before = dist.all_reduce
    assert fsdp_demos.collective_bytes(lambda: None) == {"bytes_gathered": 0, "bytes_reduced": 0}
    assert dist.all_reduce is before and not hasattr(dist, "all_gather_single")
