"""Checkers for chapter 00's exercises (devices and tensors)."""
from __future__ import annotations

import contextlib
import io
import itertools
from typing import Callable, Iterable
from unittest import mock

import numpy as np
import torch

from . import answered as _answered, is_int as _is_int

LETTERS = "abcdef"  # the expressions of exercises 2 and 7


def _letters(answer: Iterable[str] | None) -> set[str] | None:
    """The set of letters a to f in answer, or None after saying what is wrong with it."""
    if not _answered(answer):
        return None
    if isinstance(answer, str) or not isinstance(answer, (set, frozenset, list, tuple)):
        print(f'not quite: give a set of letters such as {{"a", "f"}}, not the '
              f"{type(answer).__name__} {answer!r}")
        return None
    letters = {str(letter).strip().lower() for letter in answer}
    unknown = sorted(letters - set(LETTERS))
    if unknown:
        print(f"not quite: give a set of letters from a to f; {unknown} is not one of them")
        return None
    return letters


def check_batch_bytes(answer: int | None) -> None:
    """Says whether answer is the size in bytes of a float32 batch of shape (256, 1, 28, 28)."""
    if not _answered(answer):
        return
    if not _is_int(answer):
        print(f"not quite: give an int, a whole number of bytes, not the "
              f"{type(answer).__name__} {answer!r}")
        return
    truth = torch.zeros(256, 1, 28, 28).nbytes
    if answer == truth:
        print("correct")
    elif answer == truth // 4:
        print("not quite: that is the number of elements; each float32 takes 4 bytes")
    else:
        print(f"not quite: {answer:,} is {answer / truth:.3g} times the size; "
              "multiply the four dimensions, then the 4 bytes of a float32")


def check_shares(answer: Iterable[str] | None) -> None:
    """Says whether answer is the set of letters whose expression shares memory with x."""
    letters = _letters(answer)
    if letters is None:
        return
    x = torch.arange(3.0)
    candidates = {"a": x.numpy(), "b": torch.from_numpy(x.numpy()),
                  "c": torch.tensor(x.numpy()), "d": x.to("cpu"),
                  "e": x.to(torch.device("cpu", 1)), "f": x.clone()}
    truth = {k for k, v in candidates.items() if np.shares_memory(np.asarray(v), x.numpy())}
    if letters == truth:
        print("correct")
        return
    for letter in sorted(letters - truth):
        print(f"not quite: ({letter}) makes a copy")
    for letter in sorted(truth - letters):
        print(f"not quite: ({letter}) shares x's memory (compare data_ptr() to see it)")


def check_round_robin(answer: list[str] | None) -> None:
    """Says whether answer is what devices(3) returns on a machine with two CUDA GPUs."""
    if not _answered(answer):
        return
    if not isinstance(answer, (list, tuple)):
        print(f'not quite: give a list of device names such as ["cuda:0", "cpu"], not the '
              f"{type(answer).__name__} {answer!r}")
        return
    real = [torch.device("cuda", i) for i in range(2)]
    truth = [str(real[i % len(real)]) for i in range(3)]
    answer = [str(d) for d in answer]
    if answer == truth:
        print("correct")
    elif len(answer) != 3:
        print(f"not quite: devices(3) always returns 3 devices, you gave {len(answer)}")
    else:
        print("not quite: with fewer GPUs than asked for, devices() reuses the real ones, "
              "round-robin: look at `return [real[i % len(real)] for i in range(n)]`")


def _call_recording_to(make_replica: Callable[[torch.Tensor], torch.Tensor],
                       x: torch.Tensor) -> tuple[object, list[torch.Tensor]]:
    """make_replica(x), and every tensor that Tensor.to returned during the call."""
    returned: list[torch.Tensor] = []
    original = torch.Tensor.to

    def recording_to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        returned.append(original(self, *args, **kwargs))
        return returned[-1]

    with mock.patch.object(torch.Tensor, "to", recording_to):
        replica = make_replica(x)
    return replica, returned


def check_replica_aliases(make_replica: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Says whether make_replica(x) returns a 'replica' made with .to whose update changes x."""
    if not _answered(make_replica):
        return
    x = torch.zeros(3)
    replica, returned = _call_recording_to(make_replica, x)
    if not isinstance(replica, torch.Tensor):
        print(f"not quite: make_replica must return the replica, a tensor, not {replica!r}")
    elif not returned:
        print("not quite: make_replica never called .to; the exercise is about what "
              "x.to(device) returns, so make the replica with it")
    elif x.abs().sum() == 0:
        print("not quite: x did not change. Either the replica is a real copy (a device name "
              "such as 'cpu:1' makes .to copy) or you did not update it in place (+=, add_)")
    elif not any(replica is t for t in returned):
        print("not quite: x changed, but the tensor you returned is not the one .to gave you: "
              "did you change x directly?")
    elif replica.data_ptr() != x.data_ptr():
        print("not quite: x changed, but the replica is not x: did you change x directly?")
    else:
        print("correct: .to returned x itself, so updating the 'replica' updated x")


def _cycled(real: list[torch.device], n: int) -> list[torch.device]:
    return list(itertools.islice(itertools.cycle(real), n))


def _expected_devices(real: list[torch.device], n: int | None,
                      simulate: bool) -> tuple[list[torch.device], bool]:
    """What devices(n, simulate=simulate) returns on a machine with these accelerators, and
    whether it is a simulation (then it must say so)."""
    cpu = torch.device("cpu")
    have = [] if simulate else real
    if n is None:
        return (have if have else [cpu]), False
    if len(have) >= n:
        return have[:n], False
    if n == 1 and not simulate:
        return [cpu], False
    if have:
        return _cycled(have, n), True
    return [torch.device("cpu", i) for i in range(n)], True


def _device_hint(real: list[torch.device], n: int | None, simulate: bool) -> str:
    """Which rule of the chapter's list decides devices(n, simulate=simulate) on this machine."""
    if simulate:
        return "simulate=True ignores the accelerators: real = []"
    if n is None:
        return "n=None: every real accelerator, or the CPU when there is none"
    if len(real) >= n:
        return "with enough real accelerators, return real[:n]"
    if n == 1:
        return "one device is no simulation: return [torch.device('cpu')], announce nothing"
    return ("simulate: the real ones round-robin, real[i % len(real)]" if real
            else "simulate: torch.device('cpu', i) for i = 0, ..., n-1")


def check_device_choice(devices: Callable[..., list[torch.device]]) -> None:
    """Your devices(n, simulate=...) on three pretend machines: the right list, a printed
    announcement exactly when it simulates, and a ValueError for a count that is not >= 1."""
    machines = {"no accelerator": [], "one MPS GPU": [torch.device("mps")],
                "two CUDA GPUs": [torch.device("cuda", i) for i in range(2)]}
    for machine, real in machines.items():
        with mock.patch.dict(devices.__globals__, {"accelerators": lambda real=real: list(real)}):
            for n, simulate in itertools.product((None, 1, 2, 3, 4), (False, True)):
                call = f"devices({n}{', simulate=True' if simulate else ''})"
                want, simulated = _expected_devices(real, n, simulate)
                printed = io.StringIO()
                try:
                    with contextlib.redirect_stdout(printed):
                        got = devices(n, simulate=simulate)
                except NotImplementedError:
                    raise
                except Exception as error:
                    raise AssertionError(
                        f"on a machine with {machine}, {call} raised {type(error).__name__} "
                        f"({error}); want {[str(d) for d in want]} "
                        f"({_device_hint(real, n, simulate)}"
                        + ("; handle None before checking the count" if n is None else "")
                        + ")") from None
                assert isinstance(got, list) and [str(d) for d in got] == [str(d) for d in want], (
                    f"on a machine with {machine}, {call} gave {got}, want "
                    f"{[str(d) for d in want]} ({_device_hint(real, n, simulate)})")
                assert bool(printed.getvalue().strip()) == simulated, (
                    f"on a machine with {machine}, {call} " + ("simulates but printed nothing: "
                    "announce it" if simulated else "is no simulation but printed something"))
            for bad in (0, -2, 2.5, True):
                try:
                    devices(bad)
                except ValueError:
                    continue
                except Exception as error:
                    raise AssertionError(
                        f"devices({bad!r}) raised {type(error).__name__} ({error}); it should "
                        "raise ValueError: after handling None, check that n is an int >= 1"
                    ) from None
                raise AssertionError(f"devices({bad!r}) did not raise a ValueError: " + (
                    "a bool is an int in Python (True == 1): refuse it before the int check"
                    if isinstance(bad, bool) else "n must be a whole number >= 1"))
    print("devices is right: real, round-robin or CPU devices on three machines, announced "
          "when simulated, and a clear error for a bad count")


CONVERSIONS = {"a": "x.to(torch.float32)", "b": "x.double()", "c": "x.contiguous()",
               "d": "x.t().contiguous()", "e": "x.reshape(3, 2)", "f": "x.t().reshape(6)"}


def check_no_copy(answer: Iterable[str] | None) -> None:
    """Exercise 7: the letters of CONVERSIONS that return x's own memory for the float32,
    contiguous x = torch.arange(6.0).reshape(2, 3); each expression is tested for real."""
    letters = _letters(answer)
    if letters is None:
        return
    x = torch.arange(6.0).reshape(2, 3)
    memory = x.untyped_storage().data_ptr()
    truth = {k for k, expr in CONVERSIONS.items()
             if eval(expr, {"torch": torch, "x": x}).untyped_storage().data_ptr() == memory}
    if letters == truth:
        print("correct")
        return
    for letter in sorted(letters - truth):
        print(f"not quite: ({letter}) {CONVERSIONS[letter]} makes a copy")
    for letter in sorted(truth - letters):
        print(f"not quite: ({letter}) {CONVERSIONS[letter]} returns x's own memory "
              "(compare untyped_storage().data_ptr() to see it)")
