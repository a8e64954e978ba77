"""Your code on the ranks: a cell writes it to a file under yours/ (`%%writefile`), and the
chapter's check runs it there, because a rank can import a file but not a notebook.

``on_ranks(check, "yours/ring.py", "ring_allreduce")`` runs ``check(your_function)`` on every
rank; a ``NotImplementedError`` or a failed check on a rank reaches the notebook as itself.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from ..launch import RankError, launch


def load(path: str | Path, name: str) -> Any:
    """The object called `name` in the Python file at `path`, read afresh from the file."""
    path = Path(path).resolve()
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the cell that writes it first")
    module_name = f"yours_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so a class defined there can be pickled on the rank
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise AttributeError(f"{path.name} defines no {name}: keep the name the cell gives")
    return getattr(module, name)


def on_ranks(check: Callable[..., Any], path: str | Path, name: str, *args: Any,
             world_size: int = 2, timeout: float = 60.0) -> list:
    """Run ``check(yours, *args)`` on `world_size` ranks (gloo on the CPU on every machine, so
    a check prints the same everywhere), `yours` being `name` from the file at `path`; return
    the values in rank order. A rank's NotImplementedError or AssertionError is
    raised here as the same type, with the rank's one-line message."""
    try:
        return launch(_run_check, check, str(Path(path).resolve()), name, *args,
                      world_size=world_size, backend="gloo", timeout=timeout)
    except RankError as error:
        kinds = {"NotImplementedError": NotImplementedError, "AssertionError": AssertionError}
        if error.error_type in kinds:
            message = f"rank {error.rank}: {error.error_message or 'not written yet'}"
            raise kinds[error.error_type](message) from None
        raise


def _run_check(check: Callable[..., Any], path: str, name: str, *args: Any) -> Any:
    """On a rank: load your code from its file and check it."""
    return check(load(path, name), *args)
