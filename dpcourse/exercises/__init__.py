"""Checkers for the chapters' exercises: `from dpcourse.exercises.ch03 import check_traffic`.

Each `check_*` prints whether an answer is right and, if not, why; the chapter notebooks and
their worked solutions (solutions/) call the same functions.
"""
from contextlib import contextmanager
from numbers import Integral, Real
from typing import Callable, Iterable, Iterator, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def answered(answer: object) -> bool:
    """False (and says so) while an exercise's answer is still None."""
    if answer is None:
        print("not answered yet")
    return answer is not None


def count(n: int, noun: str, plural: str | None = None) -> str:
    """"1 device", "3 devices": n with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def is_int(answer: object) -> bool:
    """Whether answer is a whole number (numpy integers too, but not True/False)."""
    return isinstance(answer, Integral) and not isinstance(answer, bool)


def is_number(answer: object) -> bool:
    """Whether answer is a real number (not True/False)."""
    return isinstance(answer, Real) and not isinstance(answer, bool)


@contextmanager
def forbidden(names: Iterable[str], message: str) -> Iterator[None]:
    """Inside: each named torch.distributed function raises AssertionError(message)."""
    saved = {name: getattr(dist, name) for name in names}

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(message)
    try:
        for name in saved:
            setattr(dist, name, refuse)
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextmanager
def recorded(name: str) -> Iterator[list]:
    """Inside: the torch.distributed function name notes the tensor each call is handed (its
    first argument) in the list yielded, then runs as usual."""
    handed, fn = [], getattr(dist, name)

    def noting(tensor: object, *args: object, **kwargs: object) -> object:
        handed.append(tensor)
        return fn(tensor, *args, **kwargs)
    setattr(dist, name, noting)
    try:
        yield handed
    finally:
        setattr(dist, name, fn)


def one_line_failure(what: str, fn: Callable[[], T]) -> T:
    """fn(), a failure other than NotImplementedError or AssertionError told as one line."""
    try:
        return fn()
    except (NotImplementedError, AssertionError):
        raise
    except Exception as error:
        raise AssertionError(f"{what} failed: {type(error).__name__}: "
                             f"{str(error).splitlines()[0][:200]}") from None
