#!/usr/bin/env python3
"""Set up the course and run it: `python3 course.py lab | test | bench | execute` (Python >= 3.10).

Each command creates or reuses the virtual environment .venv next to this file.
"""
import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
D2L = "d2l==1.0.3"  # its pinned 2023 dependencies break Python >= 3.12, so it goes in --no-deps


def run(*cmd: object) -> None:
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True)


def setup() -> None:
    """Create .venv and install the course into it, unless pyproject.toml is unchanged."""
    if sys.version_info < (3, 10):
        sys.exit(f"dpcourse needs Python >= 3.10, this is {sys.version.split()[0]}")
    stamp = VENV / "dpcourse-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + D2L.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == want:
        return
    if not PYTHON.exists():
        print("Creating the virtual environment .venv")
        venv.create(VENV, with_pip=True)
    run(PYTHON, "-m", "pip", "install", "--upgrade", "pip")
    run(PYTHON, "-m", "pip", "install", "-e", ".[test]")
    run(PYTHON, "-m", "pip", "install", "--no-deps", D2L)
    stamp.write_text(want)


def main() -> None:
    commands = {
        "setup": [],
        "lab": ["-m", "jupyter", "lab", "notebooks"],
        "test": ["-m", "pytest", *sys.argv[2:]],
        "bench": ["-m", "dpcourse.bench", *sys.argv[2:]],
        "execute": [ROOT / "tools" / "execute_notebooks.py", *sys.argv[2:]],
    }
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python3 course.py {{{'|'.join(commands)}}} [args]")
    setup()
    if commands[sys.argv[1]]:
        sys.exit(subprocess.run([str(PYTHON), *commands[sys.argv[1]]], cwd=ROOT).returncode)


if __name__ == "__main__":
    main()
