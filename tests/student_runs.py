"""Run a chapter's student version as a student who has written nothing yet would."""
import importlib.util
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WITH_PARTS = [c for c in CHAPTERS if "BEGIN SOLUTION" in c.read_text()]
_spec = importlib.util.spec_from_file_location("student_tool", ROOT / "tools" / "student.py")
student = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(student)


# one intra-op thread per kernel: beside pytest's other worker, two threads each on 2 cores made
# chapter 05's student version 7 times slower (652 s against 92 s, two runs side by side)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def is_solution(cell) -> bool:
    return cell.metadata.get("nbgrader", {}).get("solution", False)


def errors(cell) -> list:
    return [o.ename for o in cell.get("outputs", []) if o.output_type == "error"]


def run_untouched(chapter: Path, folder: Path) -> None:
    """Execute chapter's student version in folder; every check after a cleared region fails
    with NotImplementedError, and every other cell runs (it uses the package's version)."""
    student.write_all([chapter], folder)
    nb = nbformat.read(folder / chapter.name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(folder)}}).execute(env=ONE_THREAD)
    code = [c for c in nb.cells if c.cell_type == "code"]
    checks = {i + 1 for i, c in enumerate(code) if is_solution(c)}
    assert checks, f"{chapter.name} clears nothing: mark its core with ### BEGIN SOLUTION"
    for i, cell in enumerate(code):
        where = f"{chapter.name}, code cell {i + 1}:\n{cell.source[:300]}"
        if i in checks:
            assert "check" in cell.source and not is_solution(cell), (
                f"{where}\nfollows a cleared region but is not its check")
            assert errors(cell) == ["NotImplementedError"], (
                f"{where}\nshould fail with the stub's NotImplementedError, got {errors(cell)}")
        else:
            assert not errors(cell), f"{where}\nfailed with {errors(cell)} in the student version"
