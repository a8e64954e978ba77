"""Every chapter's slide deck, opened in headless Chromium: offline, error-free, complete, and
every slide fits a 1280x800 screen.

The browser is Debian's /usr/bin/chromium driven by Playwright (no browser download). Without
them these tests skip, unless DPCOURSE_REQUIRE_BROWSER=1 (as in CI) turns the skip into a failure.
"""
from __future__ import annotations

import filecmp
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREEN = {"width": 1280, "height": 800}
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

spec = importlib.util.spec_from_file_location("course", ROOT / "course.py")
course = importlib.util.module_from_spec(spec)
spec.loader.exec_module(course)


def require_browser() -> None:
    """Skip (or fail, with DPCOURSE_REQUIRE_BROWSER=1) when Chromium or Playwright is missing."""
    missing = []
    if not CHROMIUM.exists():
        missing.append(f"{CHROMIUM} (Debian/Ubuntu: apt-get install chromium)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("the Python package playwright (pip install playwright)")
    if missing:
        message = "browser tests need " + " and ".join(missing)
        if os.environ.get("DPCOURSE_REQUIRE_BROWSER") == "1":
            pytest.fail(message + "; DPCOURSE_REQUIRE_BROWSER=1 makes this a failure")
        pytest.skip(message)


@pytest.fixture(scope="module")
def chromium():
    """A headless Chromium for this module's tests."""
    require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def build_deck(notebook: Path, out_dir: Path, *, new_process: bool = False) -> Path:
    """Build one deck with the nbconvert arguments of `course.py slides`, in this process
    (fast: nbconvert is imported once) or in a new one; return the HTML file."""
    command = course.slides_args([str(notebook)], out_dir)
    assert command[:2] == ["-m", "nbconvert"]
    if new_process:
        subprocess.run([sys.executable, *command], cwd=ROOT, check=True, capture_output=True)
    else:
        from nbconvert.nbconvertapp import NbConvertApp

        app = NbConvertApp()
        app.initialize(command[2:])
        app.start()
    return out_dir / f"{notebook.stem}.html"


class Deck:
    """A deck opened in a 1280x800 page, with every request and console error it caused."""

    def __init__(self, browser, html: Path) -> None:
        self.html, self.requests, self.failed, self.errors = html, [], [], []
        self.page = browser.new_page(viewport=SCREEN)
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("requestfailed", lambda r: self.failed.append(r.url))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(html.as_uri())
        self.page.wait_for_selector(".reveal.ready", timeout=15_000)


@pytest.fixture(scope="module", params=CHAPTERS, ids=[p.stem for p in CHAPTERS])
def deck(request, chromium, tmp_path_factory) -> Deck:
    """The chapter's deck, freshly built into a temporary directory and opened."""
    opened = Deck(chromium, build_deck(request.param, tmp_path_factory.mktemp("slides")))
    opened.notebook = request.param
    yield opened
    opened.page.close()


def expected_slide_count(notebook: Path) -> int:
    """Slides by the cell metadata: nbconvert starts one at the first visible cell and at every
    later `slide` or `subslide` cell; `skip` and `notes` cells are not shown."""
    types = [cell.metadata.get("slideshow", {}).get("slide_type", "-")
             for cell in nbformat.read(notebook, as_version=4).cells]
    visible = [t for t in types if t not in ("skip", "notes")]
    return 1 + sum(t in ("slide", "subslide") for t in visible[1:])


# For every slide: its position, its first words, how tall and wide its content is against the
# configured slide size, and the elements whose content is cut off (scrolls or is hidden).
MEASURE_SLIDES = """() => {
  const {width, height} = Reveal.getConfig();
  return Reveal.getSlides().map((slide, number) => {
    const {h, v} = Reveal.getIndices(slide);
    Reveal.slide(h, v);
    const clipped = [...slide.querySelectorAll('*')].filter(e => {
      const style = getComputedStyle(e);
      return (style.overflowX !== 'visible' && e.scrollWidth > e.clientWidth + 1)
          || (style.overflowY !== 'visible' && e.scrollHeight > e.clientHeight + 1);
    }).map(e => e.innerText.split('\\n').reduce((a, b) => b.length > a.length ? b : a).trim());
    const first = slide.querySelector('.jp-InputArea-editor, .jp-RenderedHTMLCommon, .jp-OutputArea');
    return {number: number + 1, h, v, width, height, clipped,
            contentWidth: slide.scrollWidth, contentHeight: slide.scrollHeight,
            start: first ? first.innerText.trim().split('\\n')[0].slice(0, 50) : ''};
  });
}"""


def test_deck_is_offline_and_error_free(deck: Deck) -> None:
    external = [u for u in deck.requests if not u.startswith(("file:", "data:"))]
    assert external == [], f"{deck.html.name} requested {external}"
    assert deck.failed == [], f"{deck.html.name}: failed requests {deck.failed}"
    assert deck.errors == [], f"{deck.html.name}: console errors {deck.errors}"


def test_slide_count_matches_metadata(deck: Deck) -> None:
    assert deck.page.evaluate("Reveal.getTotalSlides()") == expected_slide_count(deck.notebook)


def test_every_slide_fits_1280x800(deck: Deck) -> None:
    overflowing = [
        f"slide {s['number']} ({s['h']}/{s['v']}, '{s['start']}'): content "
        f"{s['contentWidth']}x{s['contentHeight']} px on a {s['width']}x{s['height']} slide"
        + "".join(f"; cut off: {line[:60]!r}..." for line in s["clipped"])
        for s in deck.page.evaluate(MEASURE_SLIDES)
        if s["contentHeight"] > s["height"] or s["contentWidth"] > s["width"] or s["clipped"]]
    assert not overflowing, f"{deck.html.name}: slides that do not fit:\n" + "\n".join(overflowing)


def test_title_slide_is_not_blank(deck: Deck) -> None:
    from PIL import Image

    deck.page.evaluate("Reveal.slide(0, 0)")
    image = Image.open(io.BytesIO(deck.page.screenshot())).convert("RGB")
    assert image.size == (SCREEN["width"], SCREEN["height"])
    assert image.getcolors(maxcolors=1) is None, f"{deck.html.name}: the screenshot is one colour"


def test_rebuilding_a_deck_gives_the_same_bytes(tmp_path: Path) -> None:
    notebook = CHAPTERS[0]  # two processes, so a hash-seed-dependent order would show
    first = build_deck(notebook, tmp_path / "first", new_process=True)
    second = build_deck(notebook, tmp_path / "second", new_process=True)
    assert filecmp.cmp(first, second, shallow=False)


@pytest.mark.parametrize(("required", "outcome"),
                         [("", pytest.skip.Exception), ("1", pytest.fail.Exception)])
def test_a_missing_browser_skips_unless_required(monkeypatch, required: str, outcome) -> None:
    monkeypatch.setitem(globals(), "CHROMIUM", Path("/nonexistent/chromium"))
    monkeypatch.setenv("DPCOURSE_REQUIRE_BROWSER", required)
    with pytest.raises(outcome, match="apt-get install chromium"):
        require_browser()


def test_slides_do_not_show_the_tools_lines(tmp_path: Path) -> None:
    """Neither nbgrader's solution markers nor nbval's check marker, as on the website."""
    notebook = ROOT / "notebooks" / "04_splitting_minibatches.ipynb"
    assert "### BEGIN SOLUTION" in notebook.read_text()
    assert "# NBVAL_CHECK_OUTPUT" in notebook.read_text()
    html = build_deck(notebook, tmp_path).read_text()
    assert "check_split_batch" in html
    assert "BEGIN SOLUTION" not in html and "NBVAL_CHECK_OUTPUT" not in html
