#!/usr/bin/env python3
"""Set up the course and run it:
`python3 course.py lab | student | test | bench | execute | slides | site`.

Each command creates or reuses the virtual environment .venv next to this file (Python >= 3.10).
Arguments after the command go to JupyterLab, pytest, the benchmark, the executor or the slides.
It runs with Python >= 3.6 far enough to say that the course needs 3.10 (hence the quoted hints).
"""
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
D2L = "d2l==1.0.3"  # its pinned 2023 dependencies break Python >= 3.12, so it goes in --no-deps
SLIDES_DIR = ROOT / "build" / "slides"
STUDENT_DIR = ROOT / "build" / "student"
# JupyterLab's app-wide defaults inside .venv: no "Jupyter news" pop-up, no update check.
LAB_OVERRIDES = VENV / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
NO_NEWS = {"@jupyterlab/apputils-extension:notification":
           {"fetchNews": "false", "checkForUpdates": False}}
ROOT_DIR_OPTIONS = ("--notebook-dir", "--ServerApp.root_dir", "--root-dir")


def run(*cmd: object) -> None:
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True)


def check_python() -> None:
    """Exit with one sentence when this Python is too old for the course."""
    if sys.version_info < (3, 10):
        sys.exit(f"dpcourse needs Python >= 3.10 and this is {sys.version.split()[0]}: "
                 "install a newer Python (python.org, your package manager or conda) and run "
                 "this command with it.")


def create_venv() -> None:
    """Create .venv with pip; remove a half-made one when that fails."""
    if importlib.util.find_spec("venv") is None or importlib.util.find_spec("ensurepip") is None:
        sys.exit("This Python lacks the venv/ensurepip modules: install them (Debian/Ubuntu: "
                 "`sudo apt install python3-venv`) and run this command again.")
    import venv

    print("Creating the virtual environment .venv")
    try:
        venv.create(VENV, with_pip=True)
    except (subprocess.CalledProcessError, OSError) as error:
        shutil.rmtree(VENV, ignore_errors=True)
        sys.exit(f"Creating .venv failed ({error}): install your Python's venv support "
                 "(Debian/Ubuntu: `sudo apt install python3-venv`) and run this command again.")


def setup() -> None:
    """Create .venv and install the course into it, unless pyproject.toml is unchanged."""
    check_python()
    stamp = VENV / "dpcourse-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + D2L.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == want:
        return
    if not PYTHON.exists():
        create_venv()
    try:
        run(PYTHON, "-m", "pip", "install", "--upgrade", "pip")
        run(PYTHON, "-m", "pip", "install", "-e", ".[test,student,site,ft]")
        run(PYTHON, "-m", "pip", "install", "--no-deps", D2L)
    except subprocess.CalledProcessError:
        sys.exit("Installing the course's packages with pip failed (its message is above): "
                 "connect to the internet or set pip's index (PIP_INDEX_URL) and run this "
                 "command again.")
    stamp.write_text(want)


def is_root() -> bool:
    """True when this process runs with the effective user id 0 (root, e.g. in a container)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_args(args: "list[str]", root: bool, folder: Path = ROOT / "notebooks") -> "list[str]":
    """JupyterLab's arguments: the user's, in folder unless they name a root directory,
    with --allow-root when running as root."""
    extra = []
    if not any(a.split("=")[0] in ROOT_DIR_OPTIONS for a in args):
        extra.append(f"--ServerApp.root_dir={folder}")
    if root and "--allow-root" not in args:
        extra.append("--allow-root")
    return ["-m", "jupyter", "lab", *extra, *args]


def write_lab_overrides() -> None:
    """Switch off JupyterLab's news pop-up for this .venv (not in the user's home)."""
    LAB_OVERRIDES.parent.mkdir(parents=True, exist_ok=True)
    LAB_OVERRIDES.write_text(json.dumps(NO_NEWS, indent=2) + "\n")


def lab(args: "list[str]") -> "list[str]":
    """Prepare and return the command line of `course.py lab` (`lab --student`: the student
    versions in build/student, written first where missing or unedited)."""
    write_lab_overrides()
    folder = ROOT / "notebooks"
    if "--student" in args:
        args = [a for a in args if a != "--student"]
        subprocess.run([str(PYTHON), str(ROOT / "tools" / "student.py")], cwd=ROOT, check=True)
        folder = STUDENT_DIR
    if is_root():
        print("Running as root (as in most containers): passing --allow-root to JupyterLab.")
    return lab_args(args, is_root(), folder)


def slides_args(args: "list[str]", out_dir: Path = SLIDES_DIR) -> "list[str]":
    """nbconvert's arguments to build one offline reveal.js deck per notebook (all chapters
    unless `args` names notebooks) into `out_dir`."""
    named = [str(Path(a).resolve()) for a in args]  # nbconvert runs in ROOT, not here
    notebooks = named or sorted(str(p) for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    return ["-m", "nbconvert", "--to", "slides",
            f"--TemplateExporter.extra_template_basedirs={ROOT / 'slides'}",
            "--template", "dpcourse",
            "--SlidesExporter.file_extension=.html",
            "--SlidesExporter.reveal_transition=none",
            "--SlidesExporter.reveal_width=1280",
            "--SlidesExporter.reveal_height=800",
            "--HTMLExporter.embed_images=True",
            "--SlidesExporter.preprocessors=tools.markers.StripToolLines",
            "--output-dir", str(out_dir), *notebooks]


def main() -> None:
    name, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    commands = {
        "setup": lambda: [],
        "lab": lambda: lab(args),
        "student": lambda: [ROOT / "tools" / "student.py", *args],
        "test": lambda: ["-m", "pytest", *args],
        "bench": lambda: ["-m", "dpcourse.bench", *args],
        "check": lambda: ["-m", "dpcourse.selfcheck", *args],
        "execute": lambda: [ROOT / "tools" / "execute_notebooks.py", *args],
        "slides": lambda: slides_args(args),
        "site": lambda: [ROOT / "docs" / "site" / "build.py", *args],
    }
    if name not in commands:
        sys.exit(f"usage: python3 course.py {{{'|'.join(commands)}}} [args]")
    setup()
    command = commands[name]()
    if command:
        run_in_venv(command)


def run_in_venv(command: "list[object]") -> None:
    """Replace this process by the venv's Python running `command` (so Ctrl-C and signals reach
    JupyterLab or pytest directly); on Windows, run it and exit with its status."""
    argv = [str(PYTHON), *map(str, command)]
    os.chdir(ROOT)
    sys.stdout.flush()
    if os.name == "nt":
        sys.exit(subprocess.run(argv).returncode)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
