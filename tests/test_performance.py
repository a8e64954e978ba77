"""performance: each chapter-08 driver on a tiny configuration, and the benchmark's JSON.

Only shapes and invariants are checked (keys, positive finite numbers, overlap within
[0, 1]): speeds depend on the machine and its load, and are printed, never asserted. Each
driver starts processes (seconds each), so every one runs once, on the smallest case.
"""
import csv
import json
import math

import pytest

from dpcourse import bench
from dpcourse.experiments import nodes, performance, throughput, zero_memory

ALLREDUCE_NAMES = ["dist.all_reduce", "p2p.allreduce", "p2p.ring_allreduce", "shm", "memcpy"]
NUMELS = [10, 16384, 65536]  # the last two: 64 KiB and 256 KiB, the fitted range's start
CAPS_MB = [1 / 1024, 64.0]


def assert_positive(values: dict, keys) -> None:
    assert list(values) == list(keys)
    for key, value in values.items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)


@pytest.fixture(scope="module")
def sweep() -> dict:
    return performance.allreduce_sweep(NUMELS, world_size=2, repeats=1, timeout=60)


@pytest.fixture(scope="module")
def anatomy() -> dict:
    return performance.step_anatomy(steps=1, batch_size=8, bucket_cap_mb=0.1, timeout=60)


@pytest.fixture(scope="module")
def buckets() -> dict:
    return performance.bucket_sweep(CAPS_MB, steps=1, batch_size=2, repeats=1, timeout=60)


@pytest.fixture(scope="module")
def scaled() -> dict:
    return performance.scaling(worlds=(1, 2), steps=1, batch_size=8, repeats=1, timeout=60)


def test_allreduce_sweep_times_every_call_of_every_allreduce_and_the_copy_at_every_size(sweep):
    assert list(sweep) == ALLREDUCE_NAMES
    for by_numel in sweep.values():
        assert list(by_numel) == NUMELS
        for calls in by_numel.values():
            assert len(calls) == 1  # repeats=1
            assert_positive(dict(enumerate(calls)), [0])


def test_allreduce_sweep_rejects_an_unknown_allreduce_before_starting_processes():
    with pytest.raises(ValueError, match="unknown allreduce.*'tree'"):
        performance.allreduce_sweep(names=["tree"])


def test_per_size_takes_the_fastest_or_the_median_call():
    samples = {"gloo": {1024: [0.004, 0.0003, 0.0035], 4096: [0.001, 0.002]}}
    assert performance.per_size(samples) == {"gloo": {1024: 0.0003, 4096: 0.001}}
    assert performance.per_size(samples, "median") == {"gloo": {1024: 0.0035, 4096: 0.0015}}
    with pytest.raises(ValueError, match="statistic must be one of"):
        performance.per_size(samples, "mean")


def test_sweep_busbw_uses_nccl_tests_for_allreduces_and_bytes_per_second_for_the_copy(sweep):
    seconds = performance.per_size(sweep)
    busbw = performance.sweep_busbw(seconds, 4)  # 4 ranks: 2(w-1)/w = 1.5, not 1
    n = NUMELS[-1]
    assert busbw["shm"][n] == 1.5 * (4 * n) / seconds["shm"][n]
    assert busbw["memcpy"][n] == 4 * n / seconds["memcpy"][n]


def test_copy_bound_is_bytes_over_seconds():
    assert performance.copy_bound_busbw(64 * 2**20, 0.5) == 134_217_728.0


def test_memcpy_bound_is_a_bandwidth():
    bound = performance.memcpy_bound(2**16, world_size=2, repeats=1, timeout=60)
    assert isinstance(bound, float) and math.isfinite(bound) and bound > 0


def test_busy_seconds_counts_overlapping_intervals_once():
    assert performance.busy_seconds([]) == 0.0
    assert performance.busy_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert performance.busy_seconds([(4.0, 5.0), (0.0, 10.0), (2.0, 3.0)]) == 10.0


def test_step_anatomy_gives_every_phase_and_an_overlap_within_0_and_1(anatomy):
    times = {k: v for k, v in anatomy.items() if k.endswith("_s")}
    assert set(times) == {"forward_s", "backward_no_sync_s", "backward_sync_s", "optimizer_s",
                          "comm_s", "exposed_comm_s", "hidden_comm_s"}
    assert_positive({k: times[k] for k in times if k not in ("exposed_comm_s", "hidden_comm_s")},
                    [k for k in times if k not in ("exposed_comm_s", "hidden_comm_s")])
    assert anatomy["exposed_comm_s"] == max(0.0, anatomy["backward_sync_s"]
                                            - anatomy["backward_no_sync_s"])
    assert anatomy["hidden_comm_s"] == max(0.0, anatomy["comm_s"] - anatomy["exposed_comm_s"])
    assert 0.0 <= anatomy["overlap"] <= 1.0


def test_step_anatomy_timeline_has_each_bucket_launched_before_it_finished(anatomy):
    assert anatomy["gradient_bytes"] == 516_272  # LeNet's 129,068 float32 parameters
    assert anatomy["buckets"] > 1  # a 0.1 MiB cap splits LeNet's 0.49 MiB
    timeline = anatomy["timeline"]
    assert [b for b, _, _ in timeline] == list(range(anatomy["buckets"]))
    assert all(0 <= launched <= finished for _, launched, finished in timeline)
    sizes = anatomy["bucket_bytes"]  # in launch order: the last layers' bucket first
    assert len(sizes) == anatomy["buckets"] and sum(sizes) == anatomy["gradient_bytes"]
    assert all(size > 0 for size in sizes)


def test_step_anatomy_rejects_an_unknown_model():
    with pytest.raises(ValueError, match="model must be one of"):
        performance.step_anatomy(model="vgg")


def test_bucket_sweep_gives_a_step_time_per_cap_and_what_the_model_needs(buckets):
    assert_positive(buckets["step_seconds"], CAPS_MB)
    assert buckets["backward_seconds"] > 0
    assert buckets["buckets"][64.0] == 1  # 43 MiB of gradients fit one 64 MiB bucket
    assert buckets["buckets"][1 / 1024] > 1
    assert buckets["gradient_bytes"] == 4 * sum(
        p.numel() for p in performance.resnet18_model().parameters())
    for cap, sizes in buckets["bucket_bytes"].items():
        assert len(sizes) == buckets["buckets"][cap]
        assert sum(sizes) == buckets["gradient_bytes"]
    assert buckets["bucket_bytes"][64.0] == [buckets["gradient_bytes"]]
    # backward fills the buckets from the last parameter: a 1 KiB cap gives it one of its own
    last = list(performance.resnet18_model().parameters())[-1]
    assert buckets["bucket_bytes"][1 / 1024][0] == 4 * last.numel()


def test_scaling_gives_images_per_second_and_efficiency_per_world(scaled):
    assert list(scaled) == ["strong", "weak"]
    for result in scaled.values():
        assert_positive(result["images_per_s"], [1, 2])
        rate = result["images_per_s"]
        assert result["efficiency"] == {1: 1.0, 2: rate[2] / rate[1] / 2}


def test_scaling_rejects_a_batch_that_does_not_split_and_unknown_modes():
    with pytest.raises(ValueError, match="evenly"):
        performance.scaling(worlds=(1, 3), batch_size=8)
    with pytest.raises(ValueError, match="modes"):
        performance.scaling(modes=("sideways",))


def test_bench_json_has_every_section(tmp_path, monkeypatch, sweep, anatomy, buckets, scaled):
    """bench --quick --json in-process, with the drivers' launches replaced by the tiny
    results above (the real quick run starts processes for a minute or more)."""
    monkeypatch.setattr(performance, "allreduce_sweep", lambda *a, **k: sweep)
    monkeypatch.setattr(performance, "step_anatomy", lambda *a, **k: anatomy)
    monkeypatch.setattr(performance, "bucket_sweep", lambda *a, **k: buckets)
    monkeypatch.setattr(performance, "scaling", lambda *a, **k: scaled)
    monkeypatch.setattr(bench, "compare_ddp", lambda **k: dict.fromkeys(
        k.get("variants", throughput.DDP_VARIANTS), 1.0))
    monkeypatch.setattr(bench, "compare_processes_and_threads", lambda **k: dict.fromkeys(
        ["1 process x 1 thread", "1 process x 2 threads", "2 processes x 1 thread, no allreduce",
         "2 processes x 1 thread", "2 processes x 1 thread, shm"], 1.0))
    zero = {stage: {"seconds_per_step": 0.01, "optimizer_state_bytes": [8, 4],
                    "gradient_bytes": [4, 2]} for stage in ("ddp", "zero1", "zero2")}
    monkeypatch.setattr(zero_memory, "compare_zero", lambda *a, **k: zero)
    for section in ("bench_fsdp", "bench_comm", "bench_never_stops", "bench_rounding",
                    "bench_long_run", "bench_fault_tolerant_hsdp"):  # chapters 10-14: CI's
        monkeypatch.setattr(bench, section,  # bench --quick runs them
                            lambda _, figures, *chapter_13: figures.update(ran=True))
    path, table = tmp_path / "bench.json", tmp_path / "sweep.csv"
    bench.main(["--quick", "--repeats", "1", "--batch-size", "8", "--json", str(path),
                "--csv", str(table)])
    figures = json.loads(path.read_text())
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 2 * len(ALLREDUCE_NAMES) * len(NUMELS)  # 2 and 4 processes
    row = rows[-1]
    assert (row["processes"], row["implementation"], row["bytes"]) == ("4", "memcpy",
                                                                      str(4 * NUMELS[-1]))
    assert float(row["fastest_s"]) == sweep["memcpy"][NUMELS[-1]][0]
    assert figures["quick"] is True
    for section in ("forward_backward_s", "train_batch_s", "simulated_allreduce", "allreduce_s",
                    "chapter_07", "chapter_08", "chapter_09", "chapter_10", "chapter_11",
                    "chapter_13", "chapter_14"):
        assert figures[section], section
    assert figures["chapter_09"] == zero
    assert set(figures["allreduce_s"]) == {"2", "4"}
    ch08 = figures["chapter_08"]
    assert set(ch08) >= {"alpha_beta", "anatomy", "buckets", "scaling"}
    assert set(ch08["alpha_beta"]["2"]) == set(ALLREDUCE_NAMES[:-1])
    assert ch08["buckets"]["predicted_best_bytes"] in [c * 2**20 for c in CAPS_MB]


def test_bench_recovery_times_both_settings_and_says_whether_the_goal_is_met(monkeypatch,
                                                                             capsys):
    monkeypatch.setattr(nodes, "recovery_seconds",
                        lambda folder, conf, shared: 46.5 if shared else 21.0)
    figures: dict = {}
    bench.bench_recovery(False, figures)
    assert figures == {"torchrun's defaults": 46.5, "README's settings": 21.0}
    out = capsys.readouterr().out
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in out and "at most 20 s (not met)" in out
    bench.bench_recovery(True, figures := {})
    assert figures == {} and "not measured with --quick" in capsys.readouterr().out
