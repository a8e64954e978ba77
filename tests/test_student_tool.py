"""`course.py student`: nbgrader clears every marked region, and a student's edits are kept."""
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from student_runs import CHAPTERS, is_solution, student

STUB = "raise NotImplementedError()"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.stem)
def test_every_marked_region_is_cleared(chapter):
    complete = nbformat.read(chapter, as_version=4)
    nb = student.student_version(chapter)
    solutions = [c for c in complete.cells if is_solution(c)]
    assert sum(c.source.count(STUB) for c in nb.cells if is_solution(c)) >= len(solutions)
    assert not any("BEGIN SOLUTION" in c.source or c.outputs for c in nb.cells
                   if c.cell_type == "code")
    for cell in solutions:  # a cleared region is small enough to write
        lines = cell.source.split("\n")
        begin = [i for i, line in enumerate(lines) if "### BEGIN SOLUTION" in line]
        end = [i for i, line in enumerate(lines) if "### END SOLUTION" in line]
        assert begin and all(e - b - 1 <= 22 for b, e in zip(begin, end)), (
            f"{chapter.name}: a cleared region of more than 22 lines in\n{cell.source[:200]}")


def test_an_edited_student_notebook_is_never_overwritten(tmp_path, capsys):
    chapter = CHAPTERS[4]
    assert student.write_all([chapter], tmp_path) == 0
    target = tmp_path / chapter.name
    nb = nbformat.read(target, as_version=4)
    nb.cells[-1].source += "\n# my notes"
    nbformat.write(nb, target)
    edited = target.read_bytes()
    assert student.write_all([chapter], tmp_path) == 1
    assert target.read_bytes() == edited
    assert "you edited it" in capsys.readouterr().out
    target.unlink()
    assert student.write_all([chapter], tmp_path) == 0
    assert "# my notes" not in target.read_text()


def test_running_cells_is_not_editing(tmp_path):
    chapter = CHAPTERS[4]
    student.write_all([chapter], tmp_path)
    nb = nbformat.read(tmp_path / chapter.name, as_version=4)
    next(c for c in nb.cells if c.cell_type == "code").execution_count = 1
    nbformat.write(nb, tmp_path / chapter.name)
    assert student.write_all([chapter], tmp_path) == 0


def test_a_later_cell_that_uses_a_students_stub_is_named():
    """The student runs stop after the last check; what follows is read, not run: a cell
    there that needs the student's code (no import of the package's version) is named."""
    import nbformat
    from student_runs import stubs_used

    def cell(source, solution=False):
        c = nbformat.v4.new_code_cell(source)
        if solution:
            c.metadata["nbgrader"] = {"solution": True}
        return c

    code = [cell("def devices(k):\n    raise NotImplementedError()", solution=True),
            cell("check_devices(devices)"),  # the check itself uses it: fine
            cell("print(devices(2))"),
            cell("from dpcourse.hardware import devices\nprint(devices(2))"),
            cell("print(devices(3))")]
    assert stubs_used(code) == [(3, "devices")]


def test_the_tool_has_a_help_and_names_a_missing_notebook():
    """--help was read as a notebook's path (nbformat's AttributeError)."""
    tool = [sys.executable, str(ROOT / "tools" / "student.py")]
    helped = subprocess.run([*tool, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python3 course.py "
                                                               "student [-h] [NOTEBOOK ...]")
    missing = subprocess.run([*tool, "no-such.ipynb"], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "no such notebook: " in missing.stderr
