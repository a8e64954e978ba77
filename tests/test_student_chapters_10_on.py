"""Untouched student versions of chapters 10 on (their checks run on ranks): each check stops
at the stub with NotImplementedError, and the rest of the chapter runs. (A file of their own:
pytest-xdist's loadfile runs each file on one worker, so the slow student runs are spread.)"""
import pytest

from student_runs import WITH_PARTS, run_untouched


@pytest.mark.parametrize("chapter", [c for c in WITH_PARTS if c.name >= "10"], ids=lambda c: c.stem)
def test_each_check_stops_at_the_stub_and_the_rest_runs(chapter, tmp_path):
    run_untouched(chapter, tmp_path)
