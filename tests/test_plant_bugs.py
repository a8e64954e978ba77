"""tools/plant_bugs.py stays runnable: every bug it plants is still one line of its file (the
bugs are run by hand, `python tools/plant_bugs.py`: about 20 minutes)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plant_bugs", ROOT / "tools" / "plant_bugs.py")
plant_bugs = sys.modules["plant_bugs"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plant_bugs)


@pytest.mark.parametrize("bug", plant_bugs.BUGS, ids=lambda b: b.name)
def test_each_planted_bug_is_still_one_line_of_its_part(bug):
    assert (ROOT / bug.file).read_text().count(bug.right + "\n") == 1
    assert bug.wrong != bug.right and all((ROOT / t).exists() for t in bug.tests
                                          if t.startswith("tests/"))


def test_the_copy_imports_its_own_dpcourse_not_the_checkouts(tmp_path):
    (tmp_path / "dpcourse").mkdir()
    (tmp_path / "dpcourse" / "__init__.py").write_text("")
    found = subprocess.run([sys.executable, "-c", "import dpcourse; print(dpcourse.__file__)"],
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                           capture_output=True, text=True, check=True).stdout
    assert found.startswith(str(tmp_path))
