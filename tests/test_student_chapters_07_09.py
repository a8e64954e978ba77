"""Untouched student versions of chapters 07-09 (their checks run on ranks): each check stops
at the stub with NotImplementedError, raised on a rank, and the rest of the chapter runs."""
import pytest

from student_runs import WITH_PARTS, run_untouched


@pytest.mark.parametrize("chapter", [c for c in WITH_PARTS if "07" <= c.name < "10"], ids=lambda c: c.stem)
def test_each_check_stops_at_the_stub_and_the_rest_runs(chapter, tmp_path):
    run_untouched(chapter, tmp_path)
