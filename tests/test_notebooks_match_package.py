"""One truth: every function or class a notebook defines is the same code as dpcourse's.

A class may be built over several cells (each a `class X(...)` holding some of X's methods):
it is compared method by method, and the cells together must hold every method. The markers
around a student's part (`### BEGIN SOLUTION` / `### END SOLUTION`) are not code and are
stripped, as is the `%%writefile` line of a cell whose code runs on ranks.
"""
import ast
import importlib
import inspect
import json
import pkgutil
import textwrap
from collections import defaultdict
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
MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


def segment(lines, node):
    """The source of node (decorators included), dedented."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return textwrap.dedent("\n".join(lines[first - 1:node.end_lineno])).rstrip()


def class_parts(source):
    """(method name -> source, [other statements' sources]) of the class in source."""
    lines = source.splitlines()
    node = ast.parse(source).body[0]
    methods, others = {}, []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            methods[item.name] = segment(lines, item)
        else:
            others.append(textwrap.dedent("\n".join(
                lines[item.lineno - 1:item.end_lineno])).rstrip())
    return methods, others


def package_sources():
    """name -> the sources of every dpcourse function or class of that name (allreduce is
    chapter 03's in collectives and chapter 07's in p2p)."""
    found = defaultdict(list)
    for module in MODULES:
        for name, obj in vars(module).items():
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__:
                found[name].append(textwrap.dedent(inspect.getsource(obj)).rstrip())
    return found


def code_cells(path):
    """The notebook's code cells as Python: markers stripped, a %%writefile line dropped."""
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code":
            continue
        if source.startswith("%%writefile"):
            source = source.split("\n", 1)[1]
        elif source.lstrip().startswith(("%", "!")):
            continue
        yield "\n".join(line for line in source.splitlines() if line.strip() not in MARKERS)


def notebook_definitions(path):
    """(name, source, is_class) of every top-level function and class the notebook defines."""
    for source in code_cells(path):
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                yield node.name, segment(lines, node), isinstance(node, ast.ClassDef)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_is_the_package_code(path):
    sources = package_sources()
    shown = defaultdict(set)  # class name -> the methods the notebook's cells define
    for name, code, is_class in notebook_definitions(path):
        if name not in sources and name.startswith(TEACHING_ONLY):
            continue
        assert name in sources, f"{path.name} defines {name}, which dpcourse does not have"
        if not is_class:
            assert code in sources[name], f"{path.name}: {name} differs from dpcourse's"
            continue
        methods, others = class_parts(code)
        packaged = [class_parts(s) for s in sources[name]]
        for method, method_code in methods.items():
            assert any(method_code == p.get(method) for p, _ in packaged), (
                f"{path.name}: {name}.{method} differs from dpcourse's")
        for statement in others:
            assert any(statement in o for _, o in packaged), (
                f"{path.name}: a line of class {name} differs from dpcourse's: {statement[:60]}")
        shown[name] |= set(methods)
    for name, methods in shown.items():
        assert any(methods == set(p) for p, _ in map(class_parts, sources[name])), (
            f"{path.name} shows {name} without "
            f"{sorted(set(class_parts(sources[name][0])[0]) - methods)}: show all of it")


def test_split_classes_are_compared_method_by_method(tmp_path):
    """The test above fails for a changed method in a class built over two cells."""
    cells = ["class ShardedOptimizer(Reference):\n    def step(self):\n        return 1\n"]
    nb = {"cells": [{"cell_type": "code", "source": c} for c in cells]}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    with pytest.raises(AssertionError, match="ShardedOptimizer.step differs"):
        test_notebook_code_is_the_package_code(path)
