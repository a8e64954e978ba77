"""course.py's command line: arguments reach JupyterLab, root gets --allow-root, and a Python
that cannot set the course up gets one sentence saying what to install, not a traceback."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def course(monkeypatch, tmp_path):
    """course.py imported as a module (which must do nothing by itself), its .venv in tmp_path."""
    spec = importlib.util.spec_from_file_location("course_under_test", ROOT / "course.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "VENV", tmp_path / ".venv")
    monkeypatch.setattr(module, "LAB_OVERRIDES", tmp_path / "overrides.json")
    return module


def command_for(course, monkeypatch, *argv: str, root: bool = False) -> list[str]:
    """What `python3 course.py ARGV` would run in the venv (setup skipped)."""
    ran = []
    monkeypatch.setattr(sys, "argv", ["course.py", *argv])
    monkeypatch.setattr(course, "setup", lambda: None)
    monkeypatch.setattr(course, "is_root", lambda: root)
    monkeypatch.setattr(course, "run_in_venv", lambda command: ran.extend(map(str, command)))
    course.main()
    return ran


def test_lab_passes_extra_arguments_to_jupyterlab(course, monkeypatch) -> None:
    command = command_for(course, monkeypatch, "lab", "--no-browser", "--port", "8888")
    assert command[:3] == ["-m", "jupyter", "lab"]
    assert command[-3:] == ["--no-browser", "--port", "8888"]
    assert f"--ServerApp.root_dir={ROOT / 'notebooks'}" in command
    assert "--allow-root" not in command


def test_lab_as_root_adds_allow_root_and_says_so(course, monkeypatch, capsys) -> None:
    command = command_for(course, monkeypatch, "lab", "--no-browser", root=True)
    assert command.count("--allow-root") == 1
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and "--allow-root" in said[0]


def test_lab_does_not_repeat_allow_root(course) -> None:
    assert course.lab_args(["--allow-root"], root=True).count("--allow-root") == 1


def test_a_root_directory_given_by_the_user_wins(course) -> None:
    args = course.lab_args(["--notebook-dir=/data/course"], root=False)
    assert not any(a.startswith("--ServerApp.root_dir") for a in args)
    assert args[-1] == "--notebook-dir=/data/course"


def test_lab_switches_off_the_news_in_the_venv(course, monkeypatch) -> None:
    command_for(course, monkeypatch, "lab")
    settings = json.loads(course.LAB_OVERRIDES.read_text())
    assert settings["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"


@pytest.mark.parametrize(("euid", "root"), [(0, True), (1000, False)])
def test_is_root_reads_the_effective_user_id(course, monkeypatch, euid: int, root: bool) -> None:
    monkeypatch.setattr(course.os, "geteuid", lambda: euid, raising=False)
    assert course.is_root() is root


def test_is_root_is_false_where_there_are_no_user_ids(course, monkeypatch) -> None:
    monkeypatch.delattr(course.os, "geteuid", raising=False)
    assert course.is_root() is False


def test_lab_student_writes_the_student_versions_and_opens_them(course, monkeypatch) -> None:
    wrote = []
    monkeypatch.setattr(course.subprocess, "run", lambda cmd, **kw: wrote.append(cmd))
    command = command_for(course, monkeypatch, "lab", "--student", "--no-browser")
    assert wrote and wrote[0][-1].endswith("student.py")
    assert f"--ServerApp.root_dir={ROOT / 'build' / 'student'}" in command
    assert "--student" not in command and command[-1] == "--no-browser"


def test_student_runs_the_student_tool(course, monkeypatch) -> None:
    command = command_for(course, monkeypatch, "student")
    assert command[0].endswith(str(Path("tools") / "student.py"))


def test_other_commands_pass_their_arguments_on(course, monkeypatch) -> None:
    assert command_for(course, monkeypatch, "test", "-k", "03_") == ["-m", "pytest", "-k", "03_"]
    assert command_for(course, monkeypatch, "bench", "--quick")[-1] == "--quick"


def test_slides_builds_every_chapter_offline_into_build_slides(course, monkeypatch) -> None:
    command = command_for(course, monkeypatch, "slides")
    chapters = sorted(str(p) for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert command[-len(chapters):] == chapters
    assert "--SlidesExporter.reveal_transition=none" in command
    assert command[command.index("--output-dir") + 1] == str(ROOT / "build" / "slides")


def test_unknown_command_prints_usage(course, monkeypatch) -> None:
    with pytest.raises(SystemExit, match="usage: python3 course.py"):
        command_for(course, monkeypatch, "lab-book")


def test_old_python_gets_one_sentence(course, monkeypatch) -> None:
    monkeypatch.setattr(course.sys, "version_info", (3, 9, 18))
    with pytest.raises(SystemExit, match=r"needs Python >= 3\.10.*install a newer Python"):
        course.check_python()


def test_python_without_ensurepip_is_told_to_install_python3_venv(course, monkeypatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(course.importlib.util, "find_spec",
                        lambda name: None if name == "ensurepip" else find_spec(name))
    with pytest.raises(SystemExit, match="apt install python3-venv"):
        course.create_venv()
    assert not course.VENV.exists()


def test_pip_failing_without_network_gets_one_sentence(course, monkeypatch) -> None:
    monkeypatch.setattr(course, "PYTHON", Path(sys.executable))  # the venv "exists"

    def pip_fails(*cmd: object) -> None:
        raise subprocess.CalledProcessError(1, [str(c) for c in cmd])

    monkeypatch.setattr(course, "run", pip_fails)
    with pytest.raises(SystemExit, match="pip failed.*connect to the internet"):
        course.setup()
    assert not (course.VENV / "dpcourse-installed").exists()
