"""`course.py check`: a path that ran and failed makes a FAILED row and a non-zero exit; paths
that cannot run here are listed as not run, which is no failure."""
import pytest

from dpcourse import selfcheck


def wrong() -> str:
    raise AssertionError("train_batch: off by 3.0e-01 of the largest element")


def test_a_failing_path_is_a_failed_row_and_a_nonzero_exit(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "LOCAL", [selfcheck.Check("05", "train_batch", wrong),
                                             selfcheck.Check("00", "tensors", lambda: "cpu")])
    monkeypatch.setattr(selfcheck, "rank_rows", lambda: [])
    assert selfcheck.main() == 1
    out = capsys.readouterr().out
    assert "FAILED: AssertionError: train_batch: off by 3.0e-01" in out
    assert "rows without failure; 1 FAILED" in out


def test_paths_this_machine_cannot_run_are_listed_not_failed(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "LOCAL", [selfcheck.Check("00", "tensors", lambda: "cpu")])
    monkeypatch.setattr(selfcheck, "accelerators", lambda: [])
    monkeypatch.setattr(selfcheck, "rank_rows", lambda: [])
    assert selfcheck.main() == 0
    assert "not run: needs 2 GPUs" in capsys.readouterr().out


def test_close_fails_beyond_the_tolerance_and_passes_within():
    import torch
    selfcheck.close(torch.ones(3) * (1 + 1e-6), torch.ones(3), "within")
    with pytest.raises(AssertionError, match="beyond: off by 1.0e-03"):
        selfcheck.close(torch.ones(3) * 1.001, torch.ones(3), "beyond")
