"""Write the student versions of the chapters: `python3 course.py student [NOTEBOOK ...]`.

nbgrader's own preprocessors clear every region between `### BEGIN SOLUTION` and
`### END SOLUTION` (cells marked as solution cells in their nbgrader metadata) and every output.
A student notebook whose code was edited since it was written is never overwritten.
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

import nbformat
from nbgrader.preprocessors import ClearOutput, ClearSolutions

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "student"
RECORD = ".generated.json"  # notebook name -> hash of the code it was generated with
HEADER = """**Student version.** Every cell that says `# YOUR CODE HERE` is yours to write: replace
its `raise NotImplementedError()` with code that does what the text above it asks. The cell
right after it checks your code and says in one line what is wrong, until it is right.
Stuck? Move on: the cells after each check use the course's own version, so the rest of the
chapter runs whatever yours does. The complete chapter is `notebooks/{name}`."""


def student_version(path: Path) -> nbformat.NotebookNode:
    """The chapter at path with its solutions and outputs cleared and a header on top."""
    nb = nbformat.read(path, as_version=4)
    nb, _ = ClearSolutions().preprocess(nb, {})
    nb, _ = ClearOutput().preprocess(nb, {})
    header = nbformat.v4.new_markdown_cell(HEADER.format(name=path.name))
    header.metadata["slideshow"] = {"slide_type": "skip"}
    nb.cells.insert(0, header)
    return nb


def code_hash(nb: nbformat.NotebookNode) -> str:
    """A hash of the notebook's cell sources: running cells does not change it, editing does."""
    return hashlib.sha256(json.dumps([c.source for c in nb.cells]).encode()).hexdigest()


def write_all(chapters: list, out: Path = OUT) -> int:
    """Write each chapter's student version into out; return how many were kept as edited."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "yours").mkdir(exist_ok=True)  # where cells write the code that runs on ranks
    record_path = out / RECORD
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    kept = 0
    for chapter in chapters:
        target = out / chapter.name
        shown = target.relative_to(ROOT) if target.is_relative_to(ROOT) else target
        if target.exists() and code_hash(nbformat.read(target, 4)) != record.get(target.name):
            print(f"kept {shown}: "
                  "you edited it since it was generated, so it is not overwritten. To get a fresh "
                  "copy, rename or delete it and run `python3 course.py student` again.")
            kept += 1
            continue
        nb = student_version(chapter)
        nbformat.write(nb, target)
        record[target.name] = code_hash(nb)
        print(f"wrote {shown}")
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return kept


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python3 course.py student", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Writes into {OUT.relative_to(ROOT)}/; `python3 course.py lab --student` "
               "writes them, then opens JupyterLab there.")
    parser.add_argument("notebooks", nargs="*", type=Path, metavar="NOTEBOOK",
                        help="chapters to write (default: every notebooks/NN_*.ipynb)")
    named = [path.resolve() for path in parser.parse_args(argv).notebooks]
    missing = [str(path) for path in named if not path.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    write_all(named or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))


if __name__ == "__main__":
    main(sys.argv[1:])
