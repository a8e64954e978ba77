"""`course.py check`: a path that ran and failed makes a FAILED row and a non-zero exit; paths
that cannot run here are listed as not run, which is no failure. Every chapter has a row of
its own; a row's seconds are its own check's; the PowerSGD row compresses for several steps,
so that it fails without warm start or without error feedback."""
import time
from functools import partial
from pathlib import Path

import pytest

import comm_workers
from dpcourse import selfcheck
from dpcourse.selfcheck import RankCheck

ROOT = Path(__file__).resolve().parents[1]


def wrong() -> str:
    raise AssertionError("train_batch: off by 3.0e-01 of the largest element")


def test_a_failing_path_is_a_failed_row_and_a_nonzero_exit(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "LOCAL", [selfcheck.Check("05", "train_batch", wrong),
                                             selfcheck.Check("00", "tensors", lambda: "cpu")])
    monkeypatch.setattr(selfcheck, "rank_rows", lambda: [])
    monkeypatch.setattr(selfcheck, "LATER", [])
    assert selfcheck.main() == 1
    out = capsys.readouterr().out
    assert "FAILED: AssertionError: train_batch: off by 3.0e-01" in out
    assert "rows without failure; 1 FAILED" in out


def test_paths_this_machine_cannot_run_are_listed_not_failed(monkeypatch, capsys):
    monkeypatch.setattr(selfcheck, "LOCAL", [selfcheck.Check("00", "tensors", lambda: "cpu")])
    monkeypatch.setattr(selfcheck, "accelerators", lambda: [])
    monkeypatch.setattr(selfcheck, "rank_rows", lambda: [])
    monkeypatch.setattr(selfcheck, "LATER", [])
    assert selfcheck.main() == 0
    assert "not run: needs 2 GPUs" in capsys.readouterr().out


def test_close_fails_beyond_the_tolerance_and_passes_within():
    import torch
    selfcheck.close(torch.ones(3) * (1 + 1e-6), torch.ones(3), "within")
    with pytest.raises(AssertionError, match="beyond: off by 1.0e-03"):
        selfcheck.close(torch.ones(3) * 1.001, torch.ones(3), "beyond")


def test_every_chapter_has_a_row_under_a_key_of_its_own():
    keys = [(c.chapter, c.what)
            for c in [*selfcheck.LOCAL, *selfcheck.RANK_CHECKS, *selfcheck.LATER]]
    covered = set()
    for chapter, _ in keys:
        first, _, last = chapter.partition("-")
        covered |= {f"{n:02d}" for n in range(int(first), int(last or first) + 1)}
    chapters = sorted(p.name[:2] for p in ROOT.joinpath("notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(covered) == chapters
    assert len(set(keys)) == len(keys)
    assert all(chapter == chapter.strip() for chapter, _ in keys)


def test_the_local_checks_of_chapters_01_and_02_pass_here():
    rows = selfcheck.run_checks([c for c in selfcheck.LOCAL if c.chapter in ("01", "02")])
    assert [(r[0], r[3]) for r in rows] == [("01", "ok"), ("02", "ok")]


EXTRA = [RankCheck("11", "without error feedback",
                   partial(comm_workers.selfchecks_powersgd_without, "error feedback")),
         RankCheck("11", "without warm start",
                   partial(comm_workers.selfchecks_powersgd_without, "warm start")),
         RankCheck("xx", "sleeps half a second", partial(time.sleep, 0.5)),
         RankCheck("xx", "returns at once", partial(time.sleep, 0))]


@pytest.fixture(scope="module")
def rows() -> dict[str, tuple]:
    """Every rank check of course.py check, then EXTRA, in one launch of 2 ranks."""
    return {r[1]: r for r in selfcheck.rank_rows(2, [*selfcheck.RANK_CHECKS, *EXTRA])}


def test_every_rank_check_passes_here(rows):
    for check in selfcheck.RANK_CHECKS:
        assert rows[check.what][3] == "ok", rows[check.what]


def test_the_powersgd_row_fails_without_error_feedback_or_warm_start(rows):
    for what in ("without error feedback", "without warm start"):
        assert rows[what][3].startswith("FAILED: AssertionError: after 6 steps at rank 2: off by")


def test_each_row_reports_its_own_checks_seconds(rows):
    assert rows["sleeps half a second"][4] >= 0.5 > rows["returns at once"][4]
