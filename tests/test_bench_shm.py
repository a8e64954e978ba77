"""bench's section on shm against gloo in training: its rows, settings, goals and busy
processes, with compare_ddp replaced by a stand-in (the real one trains for a minute)."""
import os
from pathlib import Path

import pytest

from dpcourse import bench
from dpcourse.experiments.throughput import BUSY_LOOP, NO_ALLREDUCE


def busy_children() -> int:
    """How many processes this one has started that run the busy loop now."""
    count = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue
        count += ppid == os.getpid() and BUSY_LOOP in cmdline
    return count


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """compare_ddp replaced: each call noted with the busy processes running during it; shm
    1.5x as fast as gloo, beside busy processes 0.8x."""
    seen = []

    def compare_ddp(**kwargs):
        busy = busy_children()
        seen.append({**kwargs, "busy": busy})
        rates = {"ScratchDDP": 1000.0, "ScratchDDP, shm": 800.0 if busy else 1500.0,
                 NO_ALLREDUCE: 2000.0}
        return {v: rates[v] for v in kwargs["variants"]}
    monkeypatch.setattr(bench, "compare_ddp", compare_ddp)
    return seen


def test_quiet_rows_then_a_row_beside_busy_processes_that_the_bench_ends(calls, capsys):
    figures = {}
    bench.bench_shm_ddp(bench.Sizes(), figures)
    assert [(c["batch_size"], c["busy"]) for c in calls] == [(16, 0), (128, 0), (16, 2)]
    assert all((c["steps"], c["repeats"]) == (30, 5) for c in calls)  # the goal's settings
    assert [NO_ALLREDUCE in c["variants"] for c in calls] == [True, True, False]
    assert busy_children() == 0  # none left behind
    assert list(figures) == ["16 images, 0 busy", "128 images, 0 busy", "16 images, 2 busy"]
    assert figures["16 images, 2 busy"]["images_per_s"] == {"ScratchDDP": 1000.0,
                                                             "ScratchDDP, shm": 800.0}
    assert all(isinstance(f["load_average"], float) for f in figures.values())
    out = capsys.readouterr().out
    assert "30 steps a round, median of 5 rounds)" in out and "smoke test" not in out
    assert out.count("shm/gloo x1.50 (goal >= 1.0x: goal met)") == 1  # 16 images
    assert "shm/gloo x1.50 (no goal: the step is mostly computation)" in out  # 128 images
    assert "beside 2 busy processes (load average" in out
    assert "shm/gloo x0.80 (goal >= 1.0x: below the goal)" in out
    assert "shm's waits both sleep in the kernel until the other rank's data is there" in out


def test_quick_says_its_verdicts_are_a_smoke_test(calls, capsys):
    bench.bench_shm_ddp(bench.QUICK, {})
    assert [(c["steps"], c["repeats"]) for c in calls] == [(5, 3)] * 3
    assert ("5 steps a round, median of 3 rounds; the goals are set for 5 rounds of 30 steps: "
            "with fewer, a verdict is a smoke test" in capsys.readouterr().out)


def test_busy_processes_are_ended_when_the_measurement_fails(monkeypatch):
    def failing(**kwargs):
        if busy_children():
            raise RuntimeError("a rank failed")
        return dict.fromkeys(kwargs["variants"], 1.0)
    monkeypatch.setattr(bench, "compare_ddp", failing)
    with pytest.raises(RuntimeError, match="a rank failed"):
        bench.bench_shm_ddp(bench.QUICK, {})
    assert busy_children() == 0
