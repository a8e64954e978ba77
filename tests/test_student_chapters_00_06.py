"""Untouched student versions of chapters 00-06: each check stops at the stub, the rest runs."""
import pytest

from student_runs import WITH_PARTS, run_untouched


@pytest.mark.parametrize("chapter", [c for c in WITH_PARTS if c.name < "07"], ids=lambda c: c.stem)
def test_each_check_stops_at_the_stub_and_the_rest_runs(chapter, tmp_path):
    run_untouched(chapter, tmp_path)
