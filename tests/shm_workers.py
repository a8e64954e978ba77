"""What test_shm_steps.py and test_shm.py launch on every rank; ranks import it from tests/
(pytest's sys.path, which a rank inherits)."""
from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from dpcourse.shm import SharedBuffers, SharedMemoryAllreduce
from dpcourse.shm_steps import SHM_STEPS, PlainBarriers, SharedCounters
from workers import _error_of, mapped_segments, no_collectives, own_segments, shm_input

STEP_CLASSES = (PlainBarriers, SharedCounters, SharedMemoryAllreduce)


def seed_rank(rank: int, call: int) -> int:
    """The rank shm_input is seeded with on a repeated call (the test rebuilds the inputs)."""
    return rank + 100 * call


def sum_cases(allreduce, cases: list[tuple], passes: int, gloo_free: bool) -> list[dict]:
    """Each case (numel, dtype, transposed) summed by allreduce, passes times in turn (new
    inputs each pass), next to dist.all_reduce's sum; gloo_free: every collective forbidden."""
    rank, records = dist.get_rank(), []
    for call in range(passes):
        for numel, dtype, transposed in cases:
            x = shm_input(seed_rank(rank, call), numel, dtype, transposed)
            expected = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(expected)
            with no_collectives() if gloo_free else nullcontext():
                returned = allreduce(x)
            records.append({"case": (numel, dtype, transposed), "call": call, "result": x,
                            "expected": expected, "returned_input": returned is x})
    return records


def steps_against_all_reduce(cases: list[tuple], max_bytes: int, passes: int,
                             factory_cases: list[tuple]) -> dict:
    """Every step class built with max_bytes sums the cases (sum_cases, one object each);
    then every SHM_STEPS factory sums factory_cases. Also the segment files and mappings."""
    records, files_while_open, built = {}, [], {}
    for cls in STEP_CLASSES:
        with cls(max_bytes) as step:
            files_while_open += own_segments()
            records[cls.__name__] = sum_cases(step.allreduce, cases, passes,
                                              gloo_free=cls is not PlainBarriers)
    for label, factory in SHM_STEPS.items():
        with factory() as step:
            built[label] = {"type": type(step).__name__,
                            "buffer_bytes": step.world * step.region_bytes,
                            "records": sum_cases(step.allreduce, factory_cases, 1, False)}
    return {"records": records, "factories": built, "files_while_open": files_while_open,
            "mapped_after_close": mapped_segments()}


def voluntary_switches() -> int:
    """How many times this thread has given up the CPU of its own accord (slept, blocked)."""
    status = Path("/proc/thread-self/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def wait_for_a_late_rank(late_s: float, timeout: float) -> dict | None:
    """Rank 1 arrives late_s seconds late at a wait (_arrive) and returns None; rank 0, waiting
    for it (timeout: the SharedBuffers'), returns the wait's wall and CPU seconds and how
    often its thread slept meanwhile."""
    with SharedBuffers(1 << 12, timeout=timeout) as shm:
        shm._arrive()  # the ranks in step
        if dist.get_rank() == 1:
            time.sleep(late_s)
            shm._arrive()
            return None
        switches, wall, cpu = voluntary_switches(), time.monotonic(), time.thread_time()
        shm._arrive()
        return {"wall": time.monotonic() - wall, "cpu": time.thread_time() - cpu,
                "sleeps": voluntary_switches() - switches}


def wait_past_a_late_rank_for_a_missing_one(late_s: float, timeout: float) -> dict | None:
    """Rank 1 arrives late_s seconds late at a wait (_arrive), rank 2 never does; ranks 0 and 1
    return their wait's wall seconds and what it raised (timeout: the SharedBuffers')."""
    rank, report = dist.get_rank(), None
    with SharedBuffers(1 << 12, timeout=timeout) as shm:
        shm._arrive()  # the ranks in step
        if rank == 1:
            time.sleep(late_s)
        if rank != 2:
            wall = time.monotonic()
            error = _error_of(shm._arrive)
            report = {"wall": time.monotonic() - wall, "error": error}
    dist.barrier()  # rank 2 stays until the others have given up
    return report
