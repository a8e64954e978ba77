"""Notebooks are product: what each chapter and solution notebook must look like when committed."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
MAX_BYTES = 250_000
MAX_WORDS = 150
ABSOLUTE_PATH = re.compile(r"(/work/|/home/|/root/|/Users/|/tmp/|[A-Z]:\\\\)")
HEADING = re.compile(r"^## (?:(\d+)\. \S.*|Exercises|Summary)$")
EXERCISE = re.compile(r"^### Exercise (\d+): \S", re.M)


def cells(path):
    return json.loads(path.read_text())["cells"]


def source(cell):
    return "".join(cell["source"])


def output_texts(cell):
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            yield "".join(out["text"])
        elif out["output_type"] == "error":
            yield "\n".join(out["traceback"])
        else:
            yield "".join(out.get("data", {}).get("text/plain", ""))


def exercises(path):
    return [int(n) for c in cells(path) if c["cell_type"] == "markdown"
            for n in EXERCISE.findall(source(c))]


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS, ids=lambda p: p.name)
def test_stored_outputs_are_clean_and_small(path):
    assert path.stat().st_size <= MAX_BYTES, f"{path.name} is {path.stat().st_size:,} bytes"
    code = [c for c in cells(path) if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), \
        "execute the notebook top to bottom (python3 course.py execute ...)"
    for i, cell in enumerate(code):
        for out in cell.get("outputs", []):
            assert out["output_type"] != "error", f"code cell {i} stored an error"
        for text in output_texts(cell):
            assert "\r" not in text, f"code cell {i}: progress-bar fragments (\\r) stored"
            assert not ABSOLUTE_PATH.search(text), f"code cell {i} prints an absolute path"


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS, ids=lambda p: p.name)
def test_every_cell_has_a_slide_type(path):
    for i, cell in enumerate(cells(path)):
        assert "slide_type" in cell["metadata"].get("slideshow", {}), f"cell {i} has no slide_type"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_opens_with_title_and_running_time(path):
    first = source(cells(path)[0])
    assert re.match(rf"# {path.name[:2]} · \S", first), "the first cell is '# NN · Title'"
    assert "**Running time:**" in first, "the first cell states the running time"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_headings_are_numbered_and_the_chapter_ends_with_a_summary(path):
    headings = [line for c in cells(path) if c["cell_type"] == "markdown"
                for line in source(c).splitlines() if line.startswith("## ")]
    for h in headings:
        assert HEADING.match(h), f"heading {h!r} is not '## N. Title', '## Exercises' or '## Summary'"
    numbers = [int(m.group(1)) for h in headings if (m := HEADING.match(h)).group(1)]
    assert numbers == list(range(1, len(numbers) + 1)), f"sections numbered {numbers}"
    assert source(cells(path)[-1]).startswith("## Summary"), "the last cell is '## Summary'"


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS, ids=lambda p: p.name)
def test_markdown_cells_are_short_enough_to_read_aloud(path):
    for i, cell in enumerate(cells(path)):
        words = len(source(cell).split())
        assert cell["cell_type"] != "markdown" or words <= MAX_WORDS, \
            f"markdown cell {i} has {words} words; split it"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_exercise_has_a_worked_solution(path):
    asked = exercises(path)
    if not asked:
        return
    assert asked == list(range(1, len(asked) + 1)), f"exercises numbered {asked}"
    solution = ROOT / "solutions" / path.name
    assert solution.exists(), f"no solutions/{path.name}"
    assert exercises(solution) == asked, f"solutions/{path.name} solves {exercises(solution)}"


@pytest.mark.parametrize("path", CHAPTERS + SOLUTIONS, ids=lambda p: p.name)
def test_figures_are_drawn_by_dpcourse_plots(path):
    for i, cell in enumerate(cells(path)):
        assert cell["cell_type"] != "code" or "plt." not in source(cell), \
            f"code cell {i} draws with matplotlib itself; put it in dpcourse/plots.py (show_*)"
