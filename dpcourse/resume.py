"""Chapter 07: training that survives a dead worker - checkpoints that resume exactly, and
joining the process group again when torchrun restarts the workers.

``torchrun --max-restarts=N`` restarts every worker when one dies; the run then goes on only
from its last checkpoint, and exactly only if the checkpoint holds everything the next steps
depend on (the weights, every rank's optimizer state, the position in the data, any RNG or
communication-hook state). ``save`` writes a checkpoint atomically; ``load`` refuses, naming
the file, one that is truncated or corrupt or was written by a different command;
``load_if_found`` lets rank 0 decide whether there is one, so that every rank resumes or none.
``naming_lost_ranks`` turns a failed collective into an error naming the ranks that are gone.
"""
from __future__ import annotations

import copy
import io
import os
import socket
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

try:
    import fcntl  # POSIX only: elsewhere a checkpoint has no writer lock
except ImportError:
    fcntl = None

FORMAT = "dpcourse.train_ddp/2"  # 2: records --dropout, and each rank's device generator


def join_arguments(timeout: timedelta) -> dict[str, Any]:
    """init_process_group's arguments for a worker started by torchrun.

    torchrun's agents share a store (at MASTER_ADDR:MASTER_PORT, hosted by the agent the
    rendezvous numbered 0: on a single node, the agent itself) that outlives the workers, as
    long as that agent runs. A restarted round joining it with env:// can read the dead
    round's addresses, still there, and fail with "Gloo connectFullMesh failed ... Connection
    refused" (pytorch/pytorch#167288). So every round joins that store as a client under a
    prefix of its own, which round_name gives. Without the agents' store (launch, or
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), env://: rank 0 hosts a fresh store each round."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    name = round_name(store, rank, world_size, timeout)
    return {"store": dist.PrefixStore(f"dpcourse/round{name}", store),
            "rank": rank, "world_size": world_size}


def round_name(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A name every worker of this round gets and no earlier round had: rank 0 counts the
    rounds in the store, and answers each rank's question, asked under a fresh key of its own
    (an answer an earlier round left cannot be under it), until every rank has heard it."""
    if rank != 0:
        question = uuid.uuid4().hex
        store.set(f"dpcourse/ask/{rank}", question)
        name = store.get(f"dpcourse/answer/{question}").decode()  # waits up to timeout
        store.set(f"dpcourse/round{name}/heard/{rank}", "")
        return name
    name, waiting = str(store.add("dpcourse/rounds", 1)), set(range(1, world_size))
    deadline = time.monotonic() + timeout.total_seconds()
    while waiting:
        for r in sorted(waiting):
            if store.check([f"dpcourse/round{name}/heard/{r}"]):
                waiting.remove(r)
            elif store.check([f"dpcourse/ask/{r}"]):  # its latest question (maybe a dead one's)
                store.set(f"dpcourse/answer/{store.get(f'dpcourse/ask/{r}').decode()}", name)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"rank(s) {sorted(waiting)} did not join round {name} of the "
                               f"workers within {timeout} (their worker did not start?)")
        time.sleep(0.01)
    return name


BEAT_S, QUIET_S = 0.5, 3.0  # each rank beats every BEAT_S; one silent for QUIET_S is gone


@contextmanager
def naming_lost_ranks(store: dist.Store, rank: int, world_size: int) -> Iterator[None]:
    """Within it, rank writes who it is (node, host) in store, and a thread of its own beats
    there every BEAT_S seconds until it leaves. A RuntimeError raised within (a failed
    collective: gloo names its peer by address only) is raised again naming the ranks lost,
    chained to it; as it was if none is. At most QUIET_S seconds more; any backend."""
    if world_size == 1:
        yield
        return
    store.set(f"who/{rank}", f"node {os.environ.get('GROUP_RANK', '?')}, "
                             f"host {socket.gethostname()}")
    stop = threading.Event()

    def beat() -> None:
        try:
            while not stop.wait(BEAT_S):
                store.add(f"beat/{rank}", 1)
            store.set(f"left/{rank}", "")  # it ended, with an error of its own at worst
        except RuntimeError:
            pass  # the store is gone: lost_ranks says so

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        yield
    except RuntimeError as error:
        try:
            lost = lost_ranks(store, world_size)
        except RuntimeError as unreachable:
            raise RuntimeError(f"the store does not answer either ({unreachable}): "
                               f"{store_host()}, which hosts it, is gone? {error}") from error
        if lost:
            raise RuntimeError(f"{' and '.join(lost)} {'is' if len(lost) == 1 else 'are'} "
                               f"gone (no beat in the store for {QUIET_S:g} s): {error}"
                               ) from error
        raise
    finally:
        stop.set()
        beating.join(QUIET_S)


def store_host() -> str:
    """Who hosts the store a torchrun worker joins through (join_arguments): node 0's agent,
    or, with a store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or env://), the worker
    of rank 0, at MASTER_ADDR:MASTER_PORT."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "node 0 (its torchrun agent)"
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (f"rank 0's worker (at {where}; with a store per round, a worker killed alone "
            "takes it along while its agent restarts the workers)")


def lost_ranks(store: dist.Store, world_size: int) -> list[str]:
    """The ranks lost: their beat counts in store do not move for QUIET_S seconds, and they
    have not left (killed, stopped, or on a node gone); each as "rank r (node n, host h)"."""
    def beats() -> list[int]:
        return [store.add(f"beat/{r}", 0) for r in range(world_size)]

    first, silent = beats(), set(range(world_size))
    deadline = time.monotonic() + QUIET_S
    while silent and time.monotonic() < deadline:
        time.sleep(BEAT_S / 2)
        now = beats()
        silent = {r for r in silent if now[r] == first[r] and not store.check([f"left/{r}"])}
    return [f"rank {r} ({store.get(f'who/{r}').decode()})" if store.check([f"who/{r}"])
            else f"rank {r}" for r in sorted(silent)]  # (get would wait for a missing key)


def save(path: Path, state: dict[str, Any]) -> None:
    """Write state to path atomically, as a checkpoint of this format."""
    with writer_lock(path):
        write_atomically(path, {"format": FORMAT, **state})


def write_atomically(path: Path, value: Any) -> None:
    """torch.save value to path: a complete file or none (serialized first, then written to a
    temporary file of this call's own, flushed to disk, and renamed over path, the rename
    flushed to the directory too). An OSError names path and the cause (a full disk, say)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename survives a crash of the machine too
        finally:
            os.close(folder)
    except OSError as error:
        raise OSError(error.errno, f"{path} not written: {error.strerror}") from error
    finally:
        tmp.unlink(missing_ok=True)  # only if the rename did not happen


@contextmanager
def writer_lock(path: Path) -> Iterator[None]:
    """Hold path's writer lock (flock on a file beside it, where the platform has one): one
    writer at a time, whether processes or threads. Temporary files that killed writers left
    are removed."""
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        for name in os.listdir(path.parent):
            if name.startswith(f".{path.name}.") and name.endswith(".tmp"):
                (path.parent / name).unlink(missing_ok=True)
        yield


def check_writable(path: Path) -> None:
    """Raise ValueError naming path unless it names a file that can be created beside it."""
    if path.is_dir():
        raise ValueError(f"checkpoint {path} is a folder: name a file in it")
    try:
        handle, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe",
                                         dir=path.parent)
    except OSError as error:
        raise ValueError(f"checkpoint {path} cannot be written: {error.strerror} (in "
                         f"{path.parent})") from None
    os.close(handle)
    os.unlink(probe)


def load(path: Path) -> dict[str, Any]:
    """The checkpoint at path, on the CPU (every rank's state is there: each rank moves only its
    own part to its device); a clear error naming path if it is unreadable."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise  # not there, or not readable: said as it is
    except Exception as error:  # noqa: BLE001 - truncated zip, bad pickle, ...: all one answer
        raise RuntimeError(
            f"checkpoint {path} is truncated or corrupt ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Nothing was loaded: restore "
            "a good copy, or delete it to start from step 0") from error
    found = state.get("format") if isinstance(state, dict) else None
    if found != FORMAT and str(found).startswith("dpcourse.train_ddp/"):
        raise RuntimeError(f"checkpoint {path} has format {found}, written by another version of "
                           f"train_ddp; this one reads {FORMAT} (it records --dropout and each "
                           "rank's device generator): nothing was loaded. Resume it with the "
                           "version that wrote it, or delete it to start from step 0")
    if found != FORMAT:
        raise RuntimeError(f"checkpoint {path} was not written by python -m dpcourse.train_ddp "
                           f"(format {FORMAT}): nothing was loaded")
    return state


def load_if_found(path: Path) -> dict[str, Any] | None:
    """The checkpoint at path, read by every rank of the default group, if rank 0 finds it;
    None if not. Every rank raises, naming path, if some cannot read what rank 0 found (each
    node must see the same file: a filesystem they share)."""
    found = [path.exists() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)  # one answer, not one per node
    if not found[0]:
        return None
    try:
        state, problem = load(path), None
    except Exception as error:  # noqa: BLE001 - told to every rank below
        state, problem = None, error
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, None if problem is None else
                           f"{type(problem).__name__}: {str(problem)[:300]}")
    failed = [r for r, p in enumerate(problems) if p is not None]
    if problem is not None and 0 in failed:
        raise problem  # the file itself: rank 0 could not read it either
    if failed:
        raise RuntimeError(f"checkpoint {path}: rank 0 found it, but rank(s) {failed} cannot "
                           f"read it ({problems[failed[0]]}): every node must see the same "
                           "file, on a filesystem they share")
    return state


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The states of the generators a rank training on device draws from: the CPU's, and the
    device's own (CUDA's, ...) unless it is the CPU."""
    states = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        states[device.type] = torch.get_device_module(device).get_rng_state(device)
    return states


def set_rng_state(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what rng_state(device) returned (a device's state only where it holds one: a
    checkpoint from the CPU leaves a GPU's generator as seeded)."""
    torch.set_rng_state(states["cpu"])
    if device.type != "cpu" and device.type in states:
        torch.get_device_module(device).set_rng_state(states[device.type], device)


def check_same_command(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise, naming path and every difference, unless saved and current training arguments
    are equal."""
    differ = [f"{k} {saved.get(k)!r} there, {current.get(k)!r} here"
              for k in sorted(saved.keys() | current.keys()) if saved.get(k) != current.get(k)]
    if differ:
        raise RuntimeError(f"checkpoint {path} was written by a different command ("
                           + "; ".join(differ) + "): resuming would not continue that run. "
                           "Use its arguments, or another --checkpoint path")


def to_cpu(value: Any) -> Any:
    """value with every tensor inside (dicts, lists, tuples) copied to the CPU: detached, and
    owning its memory (a slice saves its own elements only); containers keep their types."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = copy.copy(value)  # its type and attributes: a defaultdict's, state_dict's
        copied.update((k, to_cpu(v)) for k, v in value.items())
        return copied
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
