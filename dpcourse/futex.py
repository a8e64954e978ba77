"""Chapter 08: Linux's futex, a wait in the kernel on a 32-bit word of shared memory.

``futex_wait(address, seen, seconds)`` sleeps while the word at address still holds seen:
the kernel compares and queues the thread atomically, so a change made before the call is
never missed. ``futex_wake(address)`` wakes every thread, of any process, that sleeps on that
word. The caller re-reads the word after any return: a wait also ends on a signal or the
timeout.
"""
import ctypes
import errno
import os
import platform

SYS_FUTEX = 202  # the syscall's number on x86-64
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE_FLAG: the word is shared by processes
WAKE_ALL = 2**31 - 1


def futex_usable() -> bool:
    """Whether this machine has the futex syscall as this module calls it (x86-64 Linux)."""
    return platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")


# the C library (a foreign call releases the GIL while it sleeps); None where futex_usable is not
_libc = ctypes.CDLL(None, use_errno=True) if futex_usable() else None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(address: int, seen: int, seconds: float) -> None:
    """Sleep while the 32-bit word at address holds the low 32 bits of seen, for at most
    seconds (an hour if more); return at once if it holds something else."""
    seconds = min(max(seconds, 0.0), 3600.0)  # the caller re-reads the word and may wait again
    timeout = _Timespec(int(seconds), int(seconds % 1 * 1e9))
    _futex(address, FUTEX_WAIT, ctypes.c_uint32(seen).value, ctypes.byref(timeout))


def futex_wake(address: int) -> None:
    """Wake every thread that sleeps on the 32-bit word at address (none: a cheap no-op)."""
    _futex(address, FUTEX_WAKE, WAKE_ALL, None)


def _futex(address: int, op: int, value: int, timeout: object) -> None:
    """The raw syscall; raise OSError for anything but a wake-up, EAGAIN (the word had
    changed), EINTR (a signal) or ETIMEDOUT."""
    if _libc is None:
        raise RuntimeError(f"futex needs x86-64 Linux, not {platform.system()} on "
                           f"{platform.machine()}")
    done = _libc.syscall(ctypes.c_long(SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(op),
                         ctypes.c_uint32(value), timeout, None, ctypes.c_int(0))
    code = ctypes.get_errno() if done == -1 else 0
    if code not in (0, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
        raise OSError(code, f"futex: {os.strerror(code)}")
