"""The memory account: the ZeRO paper's formulas, and the bytes measured on real ranks.

One launch of 3 ranks measures LeNet under plain DDP, ZeRO-1 and ZeRO-2 (3 ranks: the shards
are uneven), one of 2 ranks runs the benchmark driver briefly.
"""
import math

import pytest
import torch
from torch import nn

import zero_workers
from dpcourse.launch import launch
from dpcourse.lenet import LENET_SHAPES
from dpcourse.experiments.zero_memory import compare_zero, measure_stages, staged
from dpcourse.memory import STAGES, bytes_per_rank, measured_bytes

LENET_NUMEL = sum(math.prod(s) for s in LENET_SHAPES)
WORLD = 3


def test_the_papers_figure_1_7_5b_parameters_on_64_gpus():
    """Rajbhandari et al. 2020, figure 1: mixed-precision Adam, 7.5B parameters, 64 GPUs:
    120 GB, 31.4 GB, 16.6 GB and 1.9 GB per GPU."""
    mixed = {"param_bytes": 2, "grad_bytes": 2, "state_bytes": 12}
    totals = [bytes_per_rank(7_500_000_000, 64, s, **mixed)["total"] / 1e9 for s in STAGES]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_float32_adam_keeps_16_bytes_per_parameter_and_each_stage_splits_one_more_part():
    n, w = 1000, 4
    assert bytes_per_rank(n, w, "ddp") == {"parameters": 4000, "gradients": 4000,
                                          "optimizer_state": 8000, "total": 16000}
    assert bytes_per_rank(n, w, "zero1")["optimizer_state"] == 2000
    assert bytes_per_rank(n, w, "zero2") == {"parameters": 4000, "gradients": 1000,
                                            "optimizer_state": 2000, "total": 7000}
    assert bytes_per_rank(n, w, "zero3")["total"] == 4000
    assert all(bytes_per_rank(n, 1, s) == bytes_per_rank(n, 1, "ddp") for s in STAGES)


def test_bytes_per_rank_errors():
    with pytest.raises(ValueError, match="stage must be one of"):
        bytes_per_rank(10, 2, "zero4")
    with pytest.raises(ValueError, match="world_size >= 1"):
        bytes_per_rank(10, 0, "ddp")


def test_measured_bytes_counts_each_storage_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    model[1].weight = model[0].weight  # tied: 25 + 5 + 5 elements
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert measured_bytes(model, opt) == {"parameters": 140, "gradients": 0,
                                          "optimizer_state": 0, "total": 140}
    model(torch.randn(3, 5)).sum().backward()
    opt.step()
    # two moments per element, and a float32 step counter per tensor
    assert measured_bytes(model, opt) == {"parameters": 140, "gradients": 140,
                                          "optimizer_state": 280 + 3 * 4, "total": 572}
    flat = torch.zeros(35)  # gradients as views of one buffer count as that buffer
    for p, piece in zip(model.parameters(), flat.split([25, 5, 5])):
        p.grad = piece.view_as(p)
    assert measured_bytes(model, opt)["gradients"] == 140


def test_measured_bytes_finds_the_state_of_torchs_zero_redundancy_optimizer():
    """Its state lives in its local optimizer, .optim (one rank: all of it)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.manual_seed(0)
    model = nn.Linear(5, 5)
    with zero_workers.one_rank_group():
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
        model(torch.randn(3, 5)).sum().backward()
        opt.step()
        assert measured_bytes(model, opt)["optimizer_state"] == 2 * 4 * 30 + 2 * 4


def test_staged_rejects_an_unknown_stage():
    with pytest.raises(ValueError, match="stage must be one of"):
        staged("zero3", "lenet")


@pytest.fixture(scope="module")
def stages():
    return measure_stages(world_size=WORLD, model="lenet", timeout=120)


@pytest.mark.parametrize("stage", STAGES[:3])
def test_measured_bytes_per_rank_are_the_formulas_given_the_shard_sizes(stages, stage):
    r = stages[stage]
    assert r["formula"] == bytes_per_rank(LENET_NUMEL, WORLD, stage)
    shards, tensors = r["shard_numel"], r["shard_tensors"]
    if stage == "ddp":
        assert shards == [LENET_NUMEL] * WORLD and tensors == [len(LENET_SHAPES)] * WORLD
    else:  # the shards partition the parameters
        assert sum(shards) == LENET_NUMEL and sum(tensors) == len(LENET_SHAPES)
    for measured, shard, count in zip(r["measured"], shards, tensors):
        assert measured["parameters"] == 4 * LENET_NUMEL
        assert measured["gradients"] == 4 * (shard if stage == "zero2" else LENET_NUMEL)
        assert measured["optimizer_state"] == 8 * shard + 4 * count  # moments, step counters
        assert measured["total"] == sum(measured[k] for k in
                                        ("parameters", "gradients", "optimizer_state"))
    # summed over the ranks, the measured state (without step counters) is the formula's;
    # on each rank it exceeds the formula's even split by less than the largest tensor's
    moments = [m["optimizer_state"] - 4 * c for m, c in zip(r["measured"], tensors)]
    assert sum(moments) == WORLD * r["formula"]["optimizer_state"]
    largest = max(math.prod(s) for s in LENET_SHAPES)
    assert all(m < r["formula"]["optimizer_state"] + 8 * largest for m in moments)


def test_compare_zero_reports_time_and_per_rank_state():
    r = compare_zero(world_size=2, steps=1, batch_size=8, repeats=1, timeout=120)
    assert list(r) == ["ddp", "zero1", "zero2"]
    assert all(v["seconds_per_step"] > 0 for v in r.values())
    state = 8 * LENET_NUMEL + 4 * len(LENET_SHAPES)  # moments, step counters
    assert r["ddp"]["optimizer_state_bytes"] == [state] * 2
    assert sum(r["zero1"]["optimizer_state_bytes"]) == state
    assert r["zero2"]["optimizer_state_bytes"] == r["zero1"]["optimizer_state_bytes"]
    assert sum(r["zero2"]["gradient_bytes"]) == 4 * LENET_NUMEL
    assert r["zero1"]["gradient_bytes"] == [4 * LENET_NUMEL] * 2


def test_ring_bytes_counts_what_a_ring_sends_and_restores_torch_distributed():
    sent, restored = launch(zero_workers.counted_ring_bytes, world_size=2)[0]
    # 400 bytes each; on 2 ranks a ring sends half of them per half-ring, an allreduce both
    assert sent == {"all_reduce": 400.0, "reduce_scatter": 200.0, "broadcast": 200.0}
    assert restored
