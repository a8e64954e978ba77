"""What the shared-memory allreduce tests (test_shm, test_shm_steps, test_exercises_08) check."""
from __future__ import annotations

from pathlib import Path

import torch

import dpcourse.launch
from dpcourse.shm import PREFIX, SHM_DIR


def segment_files(pids: set[int]) -> set[str]:
    """The shared-memory files in /dev/shm that the processes pids created (a segment's name
    starts with its creator's pid: another test's, beside on the other xdist worker, is not
    counted)."""
    return {p.name for pid in pids for p in SHM_DIR.glob(f"{PREFIX}{pid}-*")}


class LaunchedSegments:
    """Within `with LaunchedSegments() as launched:`, the pids of every rank dpcourse.launch
    starts (launch hands each to remove_segments_of once the rank has ended), the segment
    files launch found and removed for them (a rank killed while building its buffers), and
    left(): their files still in /dev/shm."""

    def __enter__(self) -> LaunchedSegments:
        self.pids: set[int] = set()
        self.removed_by_launch: set[str] = set()
        self._remove = dpcourse.launch.remove_segments_of

        def recording(pid: int) -> None:
            self.pids.add(pid)
            self.removed_by_launch |= segment_files({pid})
            self._remove(pid)
        dpcourse.launch.remove_segments_of = recording
        return self

    def __exit__(self, *exc: object) -> None:
        dpcourse.launch.remove_segments_of = self._remove

    def left(self) -> set[str]:
        return segment_files(self.pids)


def a_segment_of_another_process(pid: int) -> Path:
    """A stand-in for a segment another test's rank holds now: a file under pid's name."""
    path = SHM_DIR / f"{PREFIX}{pid}-{'f' * 8}"
    path.touch()
    return path


def assert_equals_all_reduce(record: dict) -> None:
    """int64 exactly; floats within 1e-6 (float32) or 1e-12 (float64) of the largest sum."""
    result, expected = record["result"], record["expected"]
    assert result.shape == expected.shape and result.dtype == expected.dtype
    if result.dtype == torch.int64:
        assert torch.equal(result, expected), record["case"]
    else:  # gloo may add in another order: rounding of the partial sums differs
        rtol = 1e-6 if result.dtype == torch.float32 else 1e-12
        scale = expected.abs().max().item() if expected.numel() else 0.0
        torch.testing.assert_close(result, expected, rtol=rtol, atol=rtol * scale,
                                   msg=lambda m: f"{record['case']}: {m}")
