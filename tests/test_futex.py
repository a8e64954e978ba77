"""futex_wait sleeps while a word holds what the caller saw, and futex_wake ends the sleep."""
import ctypes
import importlib
import platform
import threading
import time

import pytest

from dpcourse import futex
from dpcourse.futex import futex_usable, futex_wait, futex_wake

on_linux = pytest.mark.skipif(not futex_usable(), reason="the futex syscall of x86-64 Linux")


def a_word(value: int) -> tuple[ctypes.c_int64, int]:
    """A 64-bit counter, as SharedBuffers' headers hold, and its address."""
    word = ctypes.c_int64(value)
    return word, ctypes.addressof(word)


@on_linux
def test_a_word_that_no_longer_holds_what_was_seen_returns_at_once():
    word, address = a_word(5)
    start = time.monotonic()
    futex_wait(address, 4, 10.0)
    assert time.monotonic() - start < 5  # not the 10 s it would sleep


@on_linux
def test_a_word_that_holds_what_was_seen_sleeps_until_the_timeout():
    word, address = a_word(5)
    start, cpu = time.monotonic(), time.thread_time()
    futex_wait(address, 5, 0.2)
    assert time.monotonic() - start >= 0.19
    assert time.thread_time() - cpu < 0.05  # asleep, not spinning


@on_linux
def test_only_the_low_32_bits_are_compared():
    """The kernel compares 32 bits: a counter past 2**32 is compared by its low half."""
    word, address = a_word(2**32 + 7)
    start = time.monotonic()
    futex_wait(address, 2**32 + 7, 0.2)
    assert time.monotonic() - start >= 0.19
    futex_wait(address, 8, 10.0)  # returns at once


@on_linux
def test_a_wake_ends_the_sleep_of_another_thread():
    word, address = a_word(5)

    def count_and_wake() -> None:
        time.sleep(0.2)
        word.value = 6
        futex_wake(address)
    threading.Thread(target=count_and_wake).start()
    start = time.monotonic()
    futex_wait(address, 5, 20.0)
    assert word.value == 6 and time.monotonic() - start < 10  # woken, not timed out


@on_linux
def test_a_timeout_of_none_left_or_of_forever_is_accepted():
    word, address = a_word(5)
    futex_wait(address, 5, -1.0)  # returns at once
    futex_wait(address, 4, float("inf"))  # returns at once: the word moved


@on_linux
def test_a_wake_with_no_sleeper_is_harmless():
    word, address = a_word(5)
    futex_wake(address)
    assert word.value == 5


@on_linux
def test_an_address_the_kernel_refuses_raises_naming_the_futex():
    with pytest.raises(OSError, match="futex: Invalid argument"):
        futex_wait(1, 0, 1.0)  # not 4-byte aligned


def test_elsewhere_the_module_imports_and_a_call_says_what_it_needs(monkeypatch):
    """dpcourse.shm imports it, and chapters import dpcourse.shm on macOS and Windows too."""
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    try:
        elsewhere = importlib.reload(futex)
        assert not elsewhere.futex_usable()
        with pytest.raises(RuntimeError, match="futex needs x86-64 Linux, not Windows"):
            elsewhere.futex_wake(0)
    finally:
        monkeypatch.undo()
        importlib.reload(futex)
