"""One truth: every function or class a notebook defines is the same code as dpcourse's."""
import ast
import importlib
import inspect
import json
import pkgutil
from pathlib import Path

import pytest

import dpcourse

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
MODULES = [importlib.import_module(m.name)
           for m in pkgutil.walk_packages(dpcourse.__path__, "dpcourse.")]
# Notebook-only code, for names dpcourse does not define: a textbook's version shown to
# expose its bug, an exercise checker, a figure, or a tutorial's model. A name dpcourse
# defines is dpcourse's code, whatever its prefix.
TEACHING_ONLY = ("textbook_", "check_", "show_", "Tutorial")


def package_sources():
    """name -> the sources of every dpcourse function or class of that name (allreduce is
    chapter 03's in collectives and chapter 07's in p2p)."""
    found = {}
    for module in MODULES:
        for name, obj in vars(module).items():
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__:
                found.setdefault(name, []).append(inspect.getsource(obj).rstrip())
    return found


def notebook_definitions(path):
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.lstrip().startswith(("%", "!")):
            continue
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                yield node.name, "\n".join(lines[first - 1:node.end_lineno])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_is_the_package_code(path):
    sources = package_sources()
    for name, code in notebook_definitions(path):
        if name not in sources and name.startswith(TEACHING_ONLY):
            continue
        assert name in sources, f"{path.name} defines {name}, which dpcourse does not have"
        assert code.rstrip() in sources[name], f"{path.name}: {name} differs from dpcourse's"
