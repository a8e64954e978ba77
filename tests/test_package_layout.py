"""The package by role: the README's map names every module, and nothing test-only ships."""
import pkgutil
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
FACE = {"__init__", "bench", "plots", "selfcheck"}  # the face, benchmark, figures, self-check


def modules(package: str) -> set[str]:
    return {m.name for m in pkgutil.iter_modules([str(ROOT / package)]) if not m.ispkg}


def readme_map() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## The package"):text.index("## Changing a chapter")]


def mapped_modules(column: int) -> set[str]:
    """The modules a column of the README's map names: the backticked names outside
    parentheses (inside them: what the module offers)."""
    rows = [line.split("|") for line in readme_map().splitlines() if re.match(r"\| \d\d ", line)]
    cells = [re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", row[column]) for row in rows]
    return {name for cell in cells for name in re.findall(r"`(\w+)`", cell)}


def test_the_readme_map_names_every_lesson_and_experiment_module_and_no_other():
    assert mapped_modules(2) == modules("dpcourse") - FACE
    assert mapped_modules(3) == modules("dpcourse/experiments") - {"__init__", "timing"}
    assert "experiments/timing.py" in readme_map()


def test_the_wheel_ships_the_package_and_no_test_only_module():
    line = re.search(r"^packages = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    packages = re.findall(r'"([\w.]+)"', line.group(1))
    on_disk = {str(p.parent.relative_to(ROOT)).replace("/", ".")
               for p in (ROOT / "dpcourse").rglob("__init__.py")}
    assert set(packages) == on_disk
    shipped = {m for package in packages for m in modules(package.replace(".", "/"))}
    assert not {m for m in shipped if "worker" in m or m.startswith("test")}
