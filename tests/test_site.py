"""The course website (`course.py site`), built once and opened in headless Chromium: every page
offline, error-free, with working links and images, fitting 1280 px; search works from file://
and served; each chapter links to its downloads, which exist; tool lines are off the pages.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import nbformat
import pytest

from test_slides import SCREEN, chromium  # noqa: F401 (chromium: a fixture)

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PAGES = ["index.html", "search.html", "genindex.html", "docs/gpu-runs.html",
         *(f"notebooks/{p.stem}.html" for p in CHAPTERS)]
TOOL_LINES = ("NBVAL_CHECK_OUTPUT", "BEGIN SOLUTION", "END SOLUTION")

spec = importlib.util.spec_from_file_location("site_build", ROOT / "docs" / "site" / "build.py")
site_build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(site_build)


def sources_hash() -> str:
    """A hash of every chapter and solution notebook: the build must leave them as they are."""
    files = sorted([*(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb")])
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The whole site as `course.py site` builds it: build/site/ if it was built from the
    files here as they are now (CI builds it first), else built into a temporary directory."""
    built = ROOT / "build" / "site"
    stamp = built / site_build.STAMP
    if stamp.exists() and stamp.read_text() == site_build.inputs_hash():
        return built
    before = sources_hash()
    out = tmp_path_factory.mktemp("build") / "site"
    site_build.build(out)
    assert sources_hash() == before, "building the site changed a notebook"
    return out


class Page:
    """A page opened at 1280x800, with every request, failed request and console error."""

    def __init__(self, browser, url: str) -> None:
        self.requests, self.failed, self.errors = [], [], []
        self.page = browser.new_page(viewport=SCREEN)
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("requestfailed", lambda r: self.failed.append(r.url))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url, wait_until="load")
        self.page.wait_for_load_state("networkidle")


# Elements that stick out of the window on the right, unless a scrolling (or clipping)
# ancestor holds them, as a wide code cell is held by its own scrollbar.
OVERFLOW = """() => {
  const width = document.documentElement.clientWidth;
  const held = e => { for (let a = e.parentElement; a && a !== document.body; a = a.parentElement)
                        if (getComputedStyle(a).overflowX !== 'visible') return true;
                      return false; };
  const out = [...document.body.querySelectorAll('*')].filter(e => {
    const r = e.getBoundingClientRect();
    return r.width > 0 && r.right > width + 1 && !held(e);
  }).map(e => `${e.tagName}.${e.className}: ${(e.innerText || '').trim().slice(0, 50)}`);
  return {page: document.documentElement.scrollWidth, width, out: out.slice(0, 5)};
}"""
LINKS = """() => [...document.querySelectorAll('a[href], img[src], link[href], script[src]')]
  .map(e => e.href || e.src)"""
BROKEN_IMAGES = """() => [...document.images].filter(i => !i.complete || i.naturalWidth === 0)
  .map(i => i.getAttribute('src'))"""


def page_problems(browser, site: Path, name: str) -> list[str]:
    """Everything wrong with one page of the site opened from file://, one line each."""
    opened = Page(browser, (site / name).as_uri())
    inside = site.as_uri() + "/"
    problems = [f"requested {u}" for u in opened.requests
                if not (u.startswith(inside) or u.startswith("data:"))]
    problems += [f"failed request {u}" for u in opened.failed]
    problems += [f"console error {e}" for e in opened.errors]
    for url in opened.page.evaluate(LINKS):
        problems += link_problems(url, inside)
    problems += [f"image does not load: {src}" for src in opened.page.evaluate(BROKEN_IMAGES)]
    fit = opened.page.evaluate(OVERFLOW)
    if fit["page"] > fit["width"] or fit["out"]:
        problems.append(f"{fit['page']} px wide at {fit['width']} px: {fit['out']}")
    opened.page.close()
    return [f"{name}: {p}" for p in problems]


def link_problems(url: str, inside: str) -> list[str]:
    """A link inside the site must name an existing file (and an existing id for #fragment)."""
    if not url.startswith("file:"):
        return []  # links out of the site (arXiv, PyTorch's docs) are for the reader to follow
    if not url.startswith(inside):
        return [f"link outside the site: {url}"]
    target = Path(unquote(urlparse(url).path))
    if not target.is_file():
        return [f"broken link: {url}"]
    fragment = unquote(urlparse(url).fragment)
    if fragment and target.suffix == ".html" and f'id="{fragment}"' not in target.read_text():
        return [f"link to a missing anchor: {url}"]
    return []


@pytest.mark.parametrize("name", PAGES)
def test_page_is_offline_error_free_linked_and_fits_1280_px(site: Path, chromium,  # noqa: F811
                                                            name: str) -> None:
    problems = page_problems(chromium, site, name)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.stem[:2])
def test_every_link_of_a_slide_deck_resolves_in_the_site(site: Path, chromium,  # noqa: F811
                                                         chapter: Path) -> None:
    """The decks linked ../docs/gpu-runs.md, which the site holds as docs/gpu-runs.html.
    (Links within a deck are reveal.js's: its slides are not elements with those ids.)"""
    deck = (site / "slides" / f"{chapter.stem}.html").as_uri()
    opened = Page(chromium, deck)
    problems = [p for url in opened.page.evaluate(LINKS) if url.split("#")[0] != deck
                for p in link_problems(url, site.as_uri() + "/")]
    opened.page.close()
    assert not problems, "\n".join(problems)


def test_a_broken_page_is_caught(site: Path, chromium, tmp_path: Path) -> None:  # noqa: F811
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    page = broken / "notebooks" / "07_distributed_data_parallel.html"
    page.write_text(page.read_text().replace(
        "</article>", '<img src="missing.png"><a href="gone.html">gone</a>'
        '<pre style="width: 3000px">wide</pre><script>undefined_call()</script>'
        '<img src="https://cdn.example.com/x.png"></article>', 1))
    problems = "\n".join(page_problems(chromium, broken, page.relative_to(broken).as_posix()))
    for expected in ("image does not load: missing.png", "broken link:", "px wide at 1280 px",
                     "undefined_call", "requested https://cdn.example.com/x.png"):
        assert expected in problems


@pytest.fixture(scope="module")
def served(site: Path) -> str:
    """The site served as `python -m http.server` serves it; its address."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(site))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever)
        thread.start()
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
        httpd.shutdown()
        thread.join()


@pytest.mark.parametrize("opened", ["file", "served"])
def test_search_for_allreduce_lists_chapters_03_and_07(site: Path, chromium, opened,  # noqa: F811
                                                       request) -> None:
    base = site.as_uri() + "/" if opened == "file" else request.getfixturevalue("served")
    search = Page(chromium, base + "search.html?q=allreduce")
    search.page.wait_for_selector("#search-results ul.search li a", timeout=30_000)
    found = search.page.eval_on_selector_all("#search-results ul.search li a",
                                             "links => links.map(a => a.getAttribute('href'))")
    assert search.errors == []
    assert {"notebooks/03_data_synchronisation.html",
            "notebooks/07_distributed_data_parallel.html"} <= {f.split("#")[0] for f in found}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_links_to_its_downloads_which_exist(site: Path, chapter: Path) -> None:
    html = (site / "notebooks" / f"{chapter.stem}.html").read_text()
    links = re.search(r'<p class="chapter-links">(.*?)</p>', html, re.S).group(1)
    targets = {text: href for href, text in re.findall(r'href="([^"]+)"[^>]*>([^<]+)<', links)}
    assert sorted(targets) == ["notebook", "slides", "solutions", "student version"]
    files = {k: (site / "notebooks" / v).resolve() for k, v in targets.items()}
    assert files["notebook"].read_bytes() == chapter.read_bytes()
    assert files["solutions"].read_bytes() == (ROOT / "solutions" / chapter.name).read_bytes()
    student = nbformat.read(files["student version"], as_version=4)
    assert "BEGIN SOLUTION" not in str(student) and not any(c.get("outputs") for c in student.cells)
    assert 'class="reveal' in files["slides"].read_text()


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_page_shows_code_without_tool_lines(site: Path, chapter: Path) -> None:
    html = (site / "notebooks" / f"{chapter.stem}.html").read_text()
    assert not [line for line in TOOL_LINES if line in html]
    assert "colab" not in html  # no repository configured, no "open in Colab" link
    assert html.count('class="cell_input') >= 5 and "toc-tree" in html


def test_chapter_07_shows_every_figure(site: Path, chromium) -> None:  # noqa: F811
    chapter = ROOT / "notebooks" / "07_distributed_data_parallel.ipynb"
    figures = sum("image/png" in out.get("data", {})
                  for cell in nbformat.read(chapter, 4).cells for out in cell.get("outputs", []))
    page = Page(chromium, (site / "notebooks" / f"{chapter.stem}.html").as_uri()).page
    shown = page.evaluate("""() => [...document.querySelectorAll('.cell_output img')]
        .map(i => (i.scrollIntoView(), [i.naturalWidth, i.getBoundingClientRect().height]))""")
    assert figures >= 1 and len(shown) == figures
    assert all(width > 100 and height > 100 for width, height in shown)


def test_landing_page_says_what_for_whom_and_how_to_run(site: Path) -> None:
    html = (site / "index.html").read_text()
    for chapter in CHAPTERS:
        assert f'href="notebooks/{chapter.stem}.html"' in html
    text = re.sub(r"<[^>]+>", "", html)
    for needed in ("For whom", "python3 course.py lab", "python3 course.py test",
                   "On a GPU host", "In a hosted notebook", "As a student version"):
        assert needed in text, needed


def test_prev_and_next_links_walk_the_chapters_in_order(site: Path) -> None:
    order = ["index", *(f"notebooks/{p.stem}" for p in CHAPTERS)]
    for before, after in zip(order, order[1:]):
        html = (site / f"{after}.html").read_text()
        back = re.search(r'<a class="prev-page" href="([^"]+)"', html).group(1)
        assert (site / after).parent.joinpath(back).resolve() == (site / f"{before}.html").resolve()


def test_with_a_repository_colab_opens_a_copy_that_installs_the_course_first(tmp_path) -> None:
    repository = "https://github.com/someone/dpcourse"
    cell = site_build.links_cell("03_data_synchronisation", repository)
    assert ("https://colab.research.google.com/github/someone/dpcourse/blob/gh-pages/"
            "colab/03_data_synchronisation.ipynb") in cell.source
    site_build.write_downloads(tmp_path, repository)
    first = nbformat.read(tmp_path / "colab" / "03_data_synchronisation.ipynb", 4).cells[0]
    assert first.cell_type == "code"
    assert f"!git clone --depth 1 {repository} /tmp/dpcourse" in first.source
    assert "!pip install -q /tmp/dpcourse" in first.source


def test_reader_source_drops_the_tool_lines_only() -> None:
    source = ("# NBVAL_CHECK_OUTPUT\n\ndef f(x):\n    ### BEGIN SOLUTION\n    return x\n"
              "    ### END SOLUTION\n# a comment stays")
    assert site_build.reader_source(source) == "def f(x):\n    return x\n# a comment stays"
