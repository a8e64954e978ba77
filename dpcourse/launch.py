"""Chapter 07: run a function in several fresh processes, each a rank of one process group.

``launch(fn, *args, world_size=2)`` starts ``world_size`` fresh processes, initialises the
default process group in each (rendezvous through a file in a temporary directory: no port to
choose), runs ``fn(*args)`` there and returns the values in rank order. What the ranks print is
replayed afterwards, rank by rank. A rank that raises, or ranks that are still running at the
deadline, end in a clear error; every child is stopped and joined in every case, Ctrl-C
included. The ranks are forked by a forkserver that imported torch once (so a launch after the
first starts in milliseconds, not seconds) on Linux, and spawned elsewhere.

``fn`` must live in an importable module: a new process shares no memory with the notebook;
it finds ``fn`` by importing its module, and a notebook's ``__main__`` cannot be imported.
The arguments travel by value: each rank gets its own copy of them, and of a slice of a tensor
only the slice's elements.
"""
from __future__ import annotations

import ctypes
import gc
import io
import json
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.distributed as dist

from .resume import to_cpu, write_atomically
from .shm import remove_segments_of

GRACE_S = 1.0  # after a failure, how long the other ranks get to report theirs
_ENV_LOCK = threading.Lock()  # launches from several threads set OMP_NUM_THREADS one at a time


class RankError(RuntimeError):
    """A rank raised: ``rank`` is its number, ``error_type`` the name of its exception's class,
    ``error_message`` that exception's message and ``rank_traceback`` its traceback as text."""

    def __init__(self, message: str, rank: int, rank_traceback: str, error_type: str = "",
                 error_message: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.rank_traceback = rank_traceback
        self.error_type = error_type
        self.error_message = error_message


class LaunchTimeoutError(TimeoutError):
    """Ranks were still running at the deadline; ``ranks`` lists them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass(frozen=True)
class _Rank:
    """What one child needs to know to join the group."""
    rank: int
    world_size: int
    backend: str
    workdir: str
    timeout: float
    environ: dict[str, str]  # the launcher's, at launch: a forked rank would get the server's


def launch(fn: Callable[..., Any], *args: Any, world_size: int = 2, backend: str | None = None,
           timeout: float = 60.0, threads: int | None = 1) -> list:
    """Run ``fn(*args)`` on ``world_size`` fresh processes; return the values in rank order.

    backend: None picks nccl when every rank gets its own GPU, else gloo (on the CPU, said in
    one printed line). timeout (seconds) covers start-up, ``fn`` and shutdown; it is also the
    process group's timeout. threads: intra-op threads per rank (``OMP_NUM_THREADS`` and
    ``torch.set_num_threads``); None leaves the default, which oversubscribes the cores.
    """
    check_picklable(fn)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch needs a whole number world_size >= 1, got {world_size!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a whole number >= 1 or None, got {threads!r}")
    backend = choose_backend(world_size, backend)
    task = by_value(fn, args)  # unpickled on the rank, in its environment
    deadline = time.monotonic() + timeout
    workdir = tempfile.mkdtemp(prefix="dpcourse-launch-")
    procs: list[mp.process.BaseProcess] = []
    try:
        ctx = start_context()
        with _child_environment(threads):
            for rank in range(world_size):
                spec = _Rank(rank, world_size, backend, workdir, timeout, dict(os.environ))
                proc = ctx.Process(target=_run_rank, args=(task, spec),  # not daemonic:
                                   name=f"dpcourse-rank-{rank}")  # a rank may start workers
                procs.append(proc)  # before start: an interrupted start is still cleaned up
                proc.start()
        _wait(procs, deadline, timeout, workdir)
        return [_load_result(workdir, rank) for rank in range(world_size)]
    finally:
        pids = [p.pid for p in procs if p.pid is not None]  # unreadable once _stop closes them
        _stop(procs)
        _replay_output(workdir, len(procs))
        for pid in pids:
            remove_segments_of(pid)  # a rank killed while building a SharedMemoryAllreduce
        shutil.rmtree(workdir, ignore_errors=True)


def check_picklable(fn: Callable[..., Any]) -> None:
    """Raise a clear error if a new process could not find fn by importing its module."""
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    if module == "__main__" and getattr(main, "__file__", None) is None:
        raise ValueError(
            f"launch cannot run {getattr(fn, '__qualname__', fn)!r}: it is defined in a "
            "notebook (or an interactive session), whose module __main__ a new process cannot "
            "import. A new process receives a function as its module and name only and "
            "imports it again, so here it would fail with \"Can't get attribute ... on "
            "<module '__main__'>\". Put the function in a .py file (a module) and import it "
            "from there.")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"launch cannot send {fn!r} to another process ({exc}): use a function defined at "
            "the top level of an importable module (not a lambda, nor one defined inside "
            "another function)") from exc


class _ByValuePickler(pickle.Pickler):
    """pickle that sends a tensor which views part of a larger storage (a slice) as a copy
    of its own elements: pickle would send the whole storage."""

    def reducer_override(self, obj: Any) -> Any:
        if (type(obj) is torch.Tensor and obj.layout == torch.strided
                and obj.untyped_storage().nbytes() > obj.numel() * obj.element_size()):
            own = obj.detach().clone().requires_grad_(obj.requires_grad)
            return own.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def by_value(fn: Callable[..., Any], args: tuple) -> bytes:
    """(fn, args) pickled by value: every rank unpickles its own copy of the tensors.
    (multiprocessing's pickler, as torch extends it, would move them into shared memory.)"""
    buffer = io.BytesIO()
    try:
        _ByValuePickler(buffer, pickle.HIGHEST_PROTOCOL).dump((fn, args))
    except Exception as exc:
        raise ValueError(f"launch cannot send the arguments of {fn!r} to another process "
                         f"({type(exc).__name__}: {exc})") from exc
    return buffer.getvalue()


def start_context() -> mp.context.BaseContext:
    """On Linux the forkserver context, its server started with this process's environment and
    torch imported; elsewhere spawn, as Python 3.14 chooses (on macOS, system libraries may
    start threads that make fork unsafe, Python's documentation says; Windows has no fork)."""
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # torch's own modules only, never the course's (stale code); torch._dynamo is what an
    # optimizer's first step imports: 1.1 s a rank, here, if each rank imported it again
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    mp.forkserver.ensure_running()  # outside _child_environment: OMP_NUM_THREADS as it is here
    return ctx


def choose_backend(world_size: int, backend: str | None = None) -> str:
    """nccl when every rank gets its own CUDA device, else gloo (on the CPU, announced)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        if gpus >= world_size:
            return "nccl"
        print(f"launch: {world_size} rank{'s' if world_size > 1 else ''}, {gpus} GPU"
              f"{'' if gpus == 1 else 's'}: gloo backend, every rank on the CPU")
        return "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"nccl needs one GPU per rank: {world_size} ranks, {gpus} GPUs "
                         "(use backend='gloo')")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    return backend


def rank_device() -> torch.device:
    """The device this rank's tensors belong on: its own GPU under nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def _child_environment(threads: int | None) -> Iterator[None]:
    """Set OMP_NUM_THREADS while children start: spawned, they read it before any torch work;
    forked, they apply it (launch passes them this environment)."""
    with _ENV_LOCK:
        old = os.environ.get("OMP_NUM_THREADS")
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old


# --- in the child ---------------------------------------------------------------------------

def _run_rank(task: bytes, spec: _Rank) -> None:
    """Body of one child: join the group, run fn, save its value or its error."""
    os.environ.clear()
    os.environ.update(spec.environ)
    work = Path(spec.workdir)
    _redirect_output(work, spec.rank)
    _exit_with_launcher()
    threads = _whole_number(spec.environ.get("OMP_NUM_THREADS"))  # launch's threads, if given
    if threads:  # a forked rank's OpenMP read OMP_NUM_THREADS when the forkserver started
        torch.set_num_threads(threads)
    os.environ.update(RANK=str(spec.rank), LOCAL_RANK=str(spec.rank),
                      WORLD_SIZE=str(spec.world_size))
    if sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: talk over loopback
    failed = False
    try:
        fn, args = pickle.loads(task)  # imports fn's module: an error there is the rank's
        if spec.backend == "nccl":
            torch.cuda.set_device(spec.rank)
        dist.init_process_group(spec.backend, init_method=(work / "store").as_uri(),
                                rank=spec.rank, world_size=spec.world_size,
                                timeout=timedelta(seconds=spec.timeout))
        (work / f"ready{spec.rank}").touch()
        value = fn(*args)
        write_atomically(work / f"result{spec.rank}.pt", to_cpu(value))
    except BaseException as exc:  # noqa: BLE001 - every error goes back to the parent
        failed = True
        _save_error(work, spec.rank, exc)
    finally:
        if dist.is_initialized():
            gc.collect()  # free fn's DDP wrappers (cycles through their hooks) while we can
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the first error is the one that matters
                pass
    exit_without_shutdown(1 if failed else 0)  # result or error already saved


def exit_without_shutdown(code: int) -> NoReturn:
    """End this process now, skipping Python's shutdown, after flushing Python's and C's
    output and ending the processes it started (shutdown would end the daemonic ones and
    wait for the others; a rank is done, so none is left running).

    Once an optimizer has been built, torch keeps even a destroyed gloo group and its threads
    alive until shutdown, and tearing them down while the interpreter finalises can abort the
    process ("terminate called without an active exception").
    """
    for child in mp.active_children():
        child.terminate()
        child.join(timeout=5)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        ctypes.CDLL(None).fflush(None)  # C's buffers: full, not line, buffered into a file
    os._exit(code)


def _exit_with_launcher() -> None:
    """End this process when the process that launched it ends (a killed kernel leaves no rank
    behind). That is multiprocessing's parent_process(), whatever the start method; a forked
    rank's parent is the forkserver, which lives on while its ranks run."""
    launcher = mp.parent_process()

    def watch() -> None:
        launcher.join()
        os._exit(1)
    threading.Thread(target=watch, name="dpcourse-watch-launcher", daemon=True).start()


def _whole_number(text: str | None) -> int | None:
    """text as a whole number >= 1, else None."""
    return int(text) if text and text.isdigit() and int(text) > 0 else None


def _redirect_output(work: Path, rank: int) -> None:
    """Send this process's stdout and stderr (Python's and C++'s) to files in work."""
    for fd, name in ((1, "out"), (2, "err")):
        with open(work / f"rank{rank}.{name}", "wb") as f:
            os.dup2(f.fileno(), fd)


def _save_error(work: Path, rank: int, exc: BaseException) -> None:
    """Write what the parent needs to report exc: when, what, and the traceback."""
    report = {"time": time.time(), "type": type(exc).__name__, "message": str(exc),
              "traceback": "".join(traceback.format_exception(type(exc), exc,
                                                              exc.__traceback__))}
    tmp = work / f"error{rank}.tmp"
    tmp.write_text(json.dumps(report))
    os.replace(tmp, work / f"error{rank}.json")


# --- in the parent --------------------------------------------------------------------------

def _wait(procs: list, deadline: float, timeout: float, workdir: str) -> None:
    """Return when every rank has finished; raise on the first failure or at the deadline."""
    while True:
        running = [p for p in procs if p.exitcode is None]
        if any(p.exitcode not in (None, 0) for p in procs):
            _wait_briefly(procs, GRACE_S)  # let the others report what they saw
            raise _failure(procs, workdir)
        if not running:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timeout_error(procs, timeout, workdir)
        mp.connection.wait([p.sentinel for p in running], timeout=remaining)


def _wait_briefly(procs: list, seconds: float) -> None:
    """Wait up to seconds for every rank to end."""
    end = time.monotonic() + seconds
    while (running := [p.sentinel for p in procs if p.exitcode is None]):
        remaining = end - time.monotonic()
        if remaining <= 0:
            return
        mp.connection.wait(running, timeout=remaining)


def _failure(procs: list, workdir: str) -> RankError:
    """The error of the rank that failed first, naming the others that failed too."""
    failed = [(rank, _read_error(workdir, rank, p.exitcode)) for rank, p in enumerate(procs)
              if p.exitcode not in (None, 0)]
    failed.sort(key=lambda item: item[1]["time"])
    rank, report = failed[0]
    message = f"rank {rank} of {len(procs)} raised {report['type']}: {report['message']}"
    if len(failed) > 1:
        others = "; ".join(f"rank {r} ({e['type']}: {_first_line(e['message'])})"
                           for r, e in failed[1:])
        message += f"\n(then also failed: {others})"
    message += f"\n\nTraceback of rank {rank}, in its own process:\n{report['traceback']}"
    return RankError(message, rank, report["traceback"], report["type"], report["message"])


def _read_error(workdir: str, rank: int, exitcode: int) -> dict:
    """The error report of a rank, or a description of how it died without one."""
    path = Path(workdir) / f"error{rank}.json"
    if path.exists():
        return json.loads(path.read_text())
    how = (f"killed by signal {signal.Signals(-exitcode).name}" if exitcode < 0
           else f"exit code {exitcode}")
    return {"time": float("inf"), "type": "ProcessExited",
            "message": f"the process ended ({how}) without a Python error: killed, out of "
                       "memory, or a crash in C++; see its output above", "traceback": ""}


def _timeout_error(procs: list, timeout: float, workdir: str) -> LaunchTimeoutError:
    """The error for ranks still running at the deadline, saying what each was doing."""
    running = [rank for rank, p in enumerate(procs) if p.exitcode is None]
    work = Path(workdir)
    states = ", ".join(f"{rank} ({'in fn' if (work / f'ready{rank}').exists() else 'starting'})"
                       for rank in running)
    return LaunchTimeoutError(
        f"launch timed out after {timeout:g} s: rank{'s' if len(running) > 1 else ''} "
        f"{states} still running, now terminated. A rank that waits for a collective "
        "another rank skipped hangs like this; so does one that needs more time "
        "(raise timeout).", running)


def _stop(procs: list) -> None:
    """Terminate the children still running (then kill them) and join them all."""
    procs = [p for p in procs if p.pid is not None]  # those that were started
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    end = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
        p.close()  # release its file descriptors now, not at garbage collection


def _load_result(workdir: str, rank: int) -> Any:
    """The value rank returned."""
    path = Path(workdir) / f"result{rank}.pt"
    if not path.exists():
        raise RuntimeError(f"rank {rank} ended without an error but left no result")
    return torch.load(path, weights_only=False)  # written by our own child just now


def _replay_output(workdir: str, n: int) -> None:
    """Print what each rank printed, rank by rank (stdout, then stderr)."""
    for rank in range(n):
        for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
            path = Path(workdir) / f"rank{rank}.{name}"
            text = path.read_text(errors="replace") if path.exists() else ""
            if text:
                stream.write(text)
                stream.flush()


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
