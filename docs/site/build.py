"""Build the course website build/site/ from the stored notebooks: `python3 course.py site`.

Sphinx with MyST-NB renders copies of the chapters (never executed) in which the lines meant for
the tools (`# NBVAL_CHECK_OUTPUT`, nbgrader's solution markers) are gone and a cell of links
follows the introduction. Each chapter's notebook, student version, solutions and slide deck
are written next to the pages, so that they download from the site itself.
"""
from __future__ import annotations

import hashlib
import re
import shutil
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # course.py and tools/, whose functions build the downloads
import course  # noqa: E402
from tools.markers import reader_source  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = ROOT / "build" / "site"
# This course's public GitHub address ("https://github.com/OWNER/NAME"). Set, every chapter
# gets an "open in Colab" link to its copy with the install cell on top, in the published
# site's branch gh-pages (.github/workflows/site.yml). Empty: no Colab links.
REPOSITORY = ""
PAGES_BRANCH = "gh-pages"


def chapters() -> list[Path]:
    """The chapters' notebooks, in order."""
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def colab_url(name: str, repository: str) -> str:
    """Colab's address of the chapter's install-first copy in the published branch."""
    owner_name = repository.removeprefix("https://github.com/").strip("/")
    return (f"https://colab.research.google.com/github/{owner_name}/blob/{PAGES_BRANCH}/"
            f"colab/{name}.ipynb")


def links_cell(name: str, repository: str) -> nbformat.NotebookNode:
    """A markdown cell of links to the chapter's downloads (and Colab, where configured)."""
    links = [f'<a href="../notebooks/{name}.ipynb" download>notebook</a>',
             f'<a href="../student/{name}.ipynb" download>student version</a>',
             f'<a href="../solutions/{name}.ipynb" download>solutions</a>',
             f'<a href="../slides/{name}.html">slides</a>']
    if repository:
        links.append(f'<a href="{colab_url(name, repository)}">open in Colab</a>')
    html = '<p class="chapter-links">This chapter: ' + " · ".join(links) + "</p>"
    return nbformat.v4.new_markdown_cell(html)


def reader_copy(path: Path, repository: str) -> nbformat.NotebookNode:
    """The chapter as the site shows it: code without tool lines, links after the first cell."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = reader_source(cell.source)
    nb.cells.insert(1, links_cell(path.stem, repository))
    return nb


def colab_copy(path: Path, repository: str) -> nbformat.NotebookNode:
    """The chapter with the README's install cell on top: Colab lacks the course's package."""
    nb = nbformat.read(path, as_version=4)
    install = (f"# Install the course's package first (Colab has PyTorch, not dpcourse)\n"
               f"!git clone --depth 1 {repository} /tmp/dpcourse\n"
               f"!pip install -q /tmp/dpcourse\n"
               f"!pip install -q --no-deps {course.D2L}")
    nb.cells.insert(0, nbformat.v4.new_code_cell(install))
    return nb


def stage(sources: Path, repository: str) -> None:
    """Write the Sphinx sources: this folder's pages and settings, the chapters' reader copies
    and docs/gpu-runs.md (which every chapter cites as ../docs/gpu-runs.md)."""
    shutil.rmtree(sources, ignore_errors=True)
    shutil.copytree(HERE, sources, ignore=shutil.ignore_patterns("build.py", "__pycache__"))
    (sources / "notebooks").mkdir()
    for path in chapters():
        nbformat.write(reader_copy(path, repository), sources / "notebooks" / path.name)
    (sources / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "gpu-runs.md", sources / "docs" / "gpu-runs.md")


def write_downloads(out: Path, repository: str) -> None:
    """The notebooks, student versions, solutions (and Colab copies) under out/KIND/."""
    from tools.student import student_version

    for kind in ("notebooks", "student", "solutions", "colab"):
        (out / kind).mkdir(parents=True, exist_ok=True)
    for path in chapters():
        shutil.copy(path, out / "notebooks" / path.name)
        shutil.copy(ROOT / "solutions" / path.name, out / "solutions" / path.name)
        nbformat.write(student_version(path), out / "student" / path.name)
        if repository:
            nbformat.write(colab_copy(path, repository), out / "colab" / path.name)
    if not repository:
        (out / "colab").rmdir()


def write_slides(out: Path) -> None:
    """Every chapter's offline deck under out/slides/, as `course.py slides` builds them, its
    links to ../docs/NAME.md (the chapters' own) led to the site's page of that file."""
    from nbconvert.nbconvertapp import NbConvertApp

    app = NbConvertApp()
    app.initialize(course.slides_args([], out / "slides")[2:])
    app.start()
    for deck in (out / "slides").glob("*.html"):
        html = deck.read_text()
        deck.write_text(re.sub(r'href="\.\./docs/([^"#]+)\.md', r'href="../docs/\1.html', html))


def write_pages(sources: Path, out: Path, jobs: int = 2) -> None:
    """Run Sphinx on the staged sources; any warning (a broken link, a missing page) fails."""
    from sphinx.cmd.build import build_main

    doctrees = out.with_name(out.name + "-doctrees")
    shutil.rmtree(doctrees, ignore_errors=True)
    status = build_main(["-b", "html", "-q", "-W", "--keep-going", "-j", str(jobs),
                         "-d", str(doctrees), str(sources), str(out)])
    if status:
        sys.exit(f"Sphinx failed (status {status}): its warnings are above.")


INPUTS = ("notebooks/*.ipynb", "solutions/*.ipynb", "docs/**/*", "slides/**/*", "tools/*.py",
          "course.py")
STAMP = ".inputs"  # in the built site: inputs_hash() of what it was built from


def inputs() -> dict[str, str]:
    """Every file the build reads, by path: a hash of its bytes."""
    files = sorted({f for pattern in INPUTS for f in ROOT.glob(pattern)
                    if f.is_file() and "__pycache__" not in f.parts})
    return {str(f.relative_to(ROOT)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def inputs_hash() -> str:
    """A hash of every file the build reads (and of the repository address it links)."""
    return hashlib.sha256(repr((REPOSITORY, inputs())).encode()).hexdigest()


def build(out: Path = OUT, repository: str = REPOSITORY) -> dict[str, float]:
    """Build the whole site into out, which then records inputs_hash() (the build leaves its
    inputs as they were: checked); return the seconds each part took."""
    seconds, before = {}, inputs()
    start = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    sources = out.with_name(out.name + "-src")  # build/site-src: the staged Sphinx sources
    stage(sources, repository)
    write_pages(sources, out)
    seconds["pages"] = time.perf_counter() - start
    start = time.perf_counter()
    write_downloads(out, repository)
    seconds["notebooks and student versions"] = time.perf_counter() - start
    start = time.perf_counter()
    write_slides(out)
    seconds["slides"] = time.perf_counter() - start
    changed = sorted(path for path, digest in inputs().items() if before.get(path) != digest)
    if changed:
        raise RuntimeError(f"these files changed while the site was built from them: {changed}")
    (out / STAMP).write_text(inputs_hash())
    return seconds


if __name__ == "__main__":
    if sys.argv[1:]:
        sys.exit("usage: python3 course.py site (no arguments): builds build/site/")
    taken = build()
    print("Built build/site/ (open build/site/index.html): "
          + ", ".join(f"{part} {s:.1f} s" for part, s in taken.items()))
