"""Run a chapter's student version as a student who has written nothing yet would.

A student version differs from the chapter only in its cleared regions. So it is executed up
to the cell after its last check (where the package's versions are imported), and the rest,
the same cells the complete chapter runs under nbval, is read instead: none of it may use a
name whose only definition here is a cleared cell (the student's stub).
"""
import ast
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


def python_of(cell) -> ast.Module:
    """A code cell's Python (its IPython magics and shell lines left out)."""
    lines = [line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    return ast.parse("\n".join(lines))


def defined(tree: ast.Module) -> set[str]:
    """The names a cell binds at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def stubs_used(code: list) -> list[tuple[int, str]]:
    """(code cell, name) wherever a cell other than a check uses a name that a cleared cell
    defined last (a cleared cell that writes a file for the ranks defines none)."""
    stubs, used, checks = set(), [], set()
    for i, cell in enumerate(code):
        if cell.source.startswith("%%writefile"):
            checks.add(i + 1) if is_solution(cell) else None
            continue
        tree = python_of(cell)
        if is_solution(cell):
            stubs |= defined(tree)
            checks.add(i + 1)
            continue
        stubs -= defined(tree)  # the package's version imported (then used) in this cell
        if i not in checks:
            used += [(i + 1, n.id) for n in ast.walk(tree) if isinstance(n, ast.Name)
                     and isinstance(n.ctx, ast.Load) and n.id in stubs]
    return used


def run_untouched(chapter: Path, folder: Path) -> None:
    """Execute chapter's student version in folder up to the cell after its last check; every
    check after a cleared region fails with NotImplementedError, and every other cell runs
    (it uses the package's version); no later cell uses a student's stub."""
    student.write_all([chapter], folder)
    nb = nbformat.read(folder / chapter.name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    checks = {i + 1 for i, c in enumerate(code) if is_solution(c)}
    assert checks, f"{chapter.name} clears nothing: mark its core with ### BEGIN SOLUTION"
    assert not stubs_used(code), (
        f"{chapter.name}: code cell, name {stubs_used(code)}: the student's stub is all that "
        "defines it there; import the package's version after the check first")
    last = code[min(max(checks) + 1, len(code) - 1)]  # the package's imports, after the check
    nb.cells = nb.cells[:nb.cells.index(last) + 1]
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(folder)}}).execute(env=ONE_THREAD)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        where = f"{chapter.name}, code cell {i + 1}:\n{cell.source[:300]}"
        if i in checks:
            assert "check" in cell.source and not is_solution(cell), (
                f"{where}\nfollows a cleared region but is not its check")
            assert errors(cell) == ["NotImplementedError"], (
                f"{where}\nshould fail with the stub's NotImplementedError, got {errors(cell)}")
        else:
            assert not errors(cell), f"{where}\nfailed with {errors(cell)} in the student version"
