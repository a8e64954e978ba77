"""What the shared-memory allreduce tests (test_shm, test_shm_steps) both check."""
import torch

from dpcourse.shm import PREFIX, SHM_DIR


def segment_files() -> set[str]:
    """The shared-memory files of any SharedMemoryAllreduce now in /dev/shm."""
    return {p.name for p in SHM_DIR.glob(f"{PREFIX}*")}


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
