"""Chapter 08: an allreduce between the processes of one host, through shared memory.

Every rank of the default process group maps one shared segment per rank. A segment is a
small header (a counter and what this call reduces) and a buffer cut into ``world`` regions;
region q of every buffer holds slice q of the current piece of the tensor. One round:

1. copy in: each rank copies every slice but its own into its own buffer, then counts 1;
2. reduce-scatter: once every rank has counted, rank r sums slice r over the ranks, in rank
   order (its own slice read from its tensor), into region r of its own buffer; counts 1;
3. all-gather: once every rank has counted again, each rank copies every reduced slice
   into its tensor. Tensors larger than the buffer go through it in several rounds.

Each slice is summed once, in rank order, so every rank gets the same bits on every run.
The next round's copy-in writes only regions their readers are done with (the regions
of the other ranks' slices, read before they counted), so two counts per round suffice.

Ranks wait for each other on the counters (no gloo in the data path): a rank that must wait
sleeps in the kernel on the other's counter (a futex), and the rank that counts wakes it, so a
wait neither burns a core nor oversleeps; a timeout names the rank that did not arrive. The
segments are files in /dev/shm, removed as soon as every rank has mapped them: the mappings
stay valid, and nothing is left behind even if a rank is killed (launch removes the file of
a rank killed before that). The counters rely on x86-64 keeping stores in program order.
"""
import mmap
import os
import platform
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from .comm_hooks import HelperThread
from .futex import futex_wait, futex_wake
from .p2p import SUPPORTED_DTYPES, check_tensor, flat_view

SHM_DIR = Path("/dev/shm")
PREFIX = "dpcourse-shm-"
HEADER_BYTES = 64  # int64s: [0] counter, [1] numel, [2] dtype code; then the buffer
ALIGN = 64  # regions start on cache lines
DTYPE_CODES = {dtype: code for code, dtype in enumerate(SUPPORTED_DTYPES, 1)}


class SharedBuffers:
    """What every step of chapter 08's allreduce shares: one buffer per rank of the default
    process group, mapped by all, cut into one region per rank, and a header whose counter the
    ranks wait on (``_arrive``). ``allreduce`` streams a tensor through the buffers in rounds;
    a subclass says what one round does (``_round``). Create it on every rank with the same
    max_bytes (each rank's buffer); timeout: seconds to wait for the others (TimeoutError).
    """

    def __init__(self, max_bytes: int = 2 << 20, *, timeout: float = 60.0) -> None:
        check_shm_usable(type(self).__name__)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout = timeout
        if not isinstance(max_bytes, int) or max_bytes < ALIGN * self.world:
            raise ValueError(f"max_bytes must be a whole number of bytes, at least {ALIGN} per "
                             f"rank ({ALIGN * self.world} for {self.world}), got {max_bytes!r}")
        self.region_bytes = max_bytes // self.world // ALIGN * ALIGN
        self._maps = _map_all_segments(HEADER_BYTES + self.world * self.region_bytes,
                                       max_bytes)
        self._headers = [memoryview(m)[:HEADER_BYTES].cast("q") for m in self._maps]
        self._buffers = [torch.frombuffer(m, dtype=torch.uint8)[HEADER_BYTES:]
                         for m in self._maps]
        self._counters = [b.data_ptr() - HEADER_BYTES for b in self._buffers]  # addresses
        self._views: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._count = 0  # what this rank's counter says now

    def _regions(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """For each rank, the world regions of its buffer as tensors of dtype (cached):
        regions[q][r] is region r of rank q's buffer."""
        if dtype not in self._views:
            per = self.region_bytes // dtype.itemsize
            self._views[dtype] = [list(b.view(dtype)[:self.world * per].view(self.world, per))
                                  for b in self._buffers]
        return self._views[dtype]

    def __enter__(self) -> "SharedBuffers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the segments (their files are already gone); the object is unusable after."""
        for header in self._headers:
            header.release()
        self._headers, self._buffers, self._views, self._counters = [], [], {}, []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor still views it: unmapped when that is freed
                pass
        self._maps = []

    @torch.no_grad()
    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum tensor in place across the ranks (every slice in rank order); return it."""
        check_tensor(tensor, f"{type(self).__name__}.allreduce")
        if tensor.device.type != "cpu":
            raise ValueError(f"{type(self).__name__} needs CPU tensors, got {tensor.device}")
        if not self._maps:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        if self.world == 1:
            return tensor
        header = self._headers[self.rank]
        header[1], header[2] = tensor.numel(), DTYPE_CODES[tensor.dtype]
        per_round = self.world * (self.region_bytes // tensor.element_size())
        with flat_view(tensor) as flat:
            for start in range(0, max(flat.numel(), 1), per_round):  # 1 round if empty
                self._round(flat[start:start + per_round], first=start == 0)
        return tensor

    def _round(self, piece: torch.Tensor, first: bool) -> None:
        """Allreduce one piece that fits in the buffers (first: the call's first round)."""
        raise NotImplementedError

    def _arrive(self) -> None:
        """Count one more step done and wake the ranks that sleep on this counter; then wait
        until every rank has counted as far, asleep in the kernel until a counter moves."""
        self._count += 1
        self._headers[self.rank][0] = self._count
        futex_wake(self._counters[self.rank])
        deadline = time.monotonic() + self.timeout
        for q, header in enumerate(self._headers):
            while (seen := header[0]) < self._count:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._timed_out()
                futex_wait(self._counters[q], seen, left)  # returns at once if it moved

    def _timed_out(self) -> None:
        """Close (the ranks are out of step now) and raise TimeoutError naming the late."""
        late = [q for q, h in enumerate(self._headers) if h[0] < self._count]
        self.close()
        raise TimeoutError(
            f"{type(self).__name__} on rank {self.rank}: rank{'s' if len(late) > 1 else ''} "
            f"{', '.join(map(str, late))} did not arrive within {self.timeout:g} s (crashed, "
            "or skipped an allreduce the others called); this object is now closed")

    def _check_same_call(self) -> None:
        """Raise on every rank if the headers say the ranks passed different tensors."""
        seen = [tuple(h[1:3]) for h in self._headers]
        if len(set(seen)) > 1:
            self._arrive()  # nobody writes a header before every rank has read them all
            names = {code: str(dt).removeprefix("torch.") for dt, code in DTYPE_CODES.items()}
            calls = ", ".join(f"rank {r}: {n} x {names[c]}" for r, (n, c) in enumerate(seen))
            raise ValueError(f"{type(self).__name__}: the ranks passed different tensors "
                             f"({calls}); every rank must pass the same numel and dtype")


class SharedMemoryAllreduce(SharedBuffers):
    """An allreduce (sum) through shared buffers: each rank sums its own slice straight into its
    own region, where the others gather it (two waits per round; chapter 08 sizes the buffer)."""

    def _round(self, piece: torch.Tensor, first: bool) -> None:
        """Allreduce one piece that fits in the buffers: copy in, wait, (check the call),
        reduce, wait, gather."""
        regions = self._regions(piece.dtype)
        slices = piece.tensor_split(self.world)
        self._copy_in(regions, slices)
        self._arrive()  # every rank's slices are in its buffer
        if first:
            self._check_same_call()
        self._reduce(regions, slices)
        self._arrive()  # every sum is in its owner's region
        self._gather(regions, slices)

    def _copy_in(self, regions: list[list[torch.Tensor]], slices: tuple[torch.Tensor, ...]) -> None:
        """Copy every slice q but this rank's own into region q of this rank's buffer."""
        mine = regions[self.rank]
        for q, s in enumerate(slices):
            if q != self.rank:
                mine[q][:s.numel()].copy_(s)

    def _reduce(self, regions: list[list[torch.Tensor]], slices: tuple[torch.Tensor, ...]) -> None:
        """Sum this rank's slice over the ranks, in rank order, into region rank of its own
        buffer: rank q's part is in region rank of q's buffer, its own part in its tensor."""
        n = slices[self.rank].numel()
        parts = [s if q == self.rank else regions[q][self.rank][:n]  # own part: no copy
                 for q, s in enumerate(slices)]
        out = regions[self.rank][self.rank][:n]  # the sum goes where the others gather it
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out += part

    def _gather(self, regions: list[list[torch.Tensor]], slices: tuple[torch.Tensor, ...]) -> None:
        """Copy each rank's summed slice, region q of rank q's buffer, into slice q."""
        for q, s in enumerate(slices):
            s.copy_(regions[q][q][:s.numel()])


class ShmHookState(HelperThread):
    """State of shm_hook: a SharedMemoryAllreduce (built collectively, on every rank) and the
    helper thread that runs it while backward goes on. Close it when training is done."""

    def __init__(self, max_bytes: int = 2 << 20, *, timeout: float = 60.0) -> None:
        super().__init__()
        self.shm = SharedMemoryAllreduce(max_bytes, timeout=timeout)

    def close(self) -> None:
        super().close()
        self.shm.close()


def shm_hook(state: ShmHookState,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A communication hook: average the bucket through shared memory (CPU, one host)."""
    buffer = bucket.buffer().div_(state.shm.world)
    return state.submit(state.shm.allreduce, buffer)


def check_shm_usable(name: str) -> None:
    """Raise a clear error unless this process can build shared buffers: a default process
    group, Linux's /dev/shm, and an x86-64 CPU (the counters rely on its store order)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{name} needs the default process group")
    if not SHM_DIR.is_dir():
        raise RuntimeError(f"{name} needs Linux's {SHM_DIR}")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"{name} needs an x86-64 CPU: its counters rely on x86-64 keeping "
                           "stores in order (ARM may reorder them); use dist.all_reduce on "
                           f"this {platform.machine()} machine")


def remove_segments_of(pid: int) -> None:
    """Remove the segment files a process created and could not remove (it was killed
    before every rank had mapped them); launch calls it for each rank once it has ended."""
    for path in SHM_DIR.glob(f"{PREFIX}{pid}-*"):
        path.unlink(missing_ok=True)


def _map_all_segments(size: int, max_bytes: int) -> list[mmap.mmap]:
    """Create this rank's segment, map every rank's, then remove this rank's file."""
    path = SHM_DIR / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        own = _map(path, size, create=True)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (str(path), max_bytes))
        if len({m for _, m in everyone}) > 1:
            raise ValueError("SharedMemoryAllreduce: the ranks passed different max_bytes "
                             f"({[m for _, m in everyone]})")
        maps = [own if p == str(path) else _map(Path(p), size) for p, _ in everyone]
        dist.barrier()  # every rank has mapped every segment: the files can go
        return maps
    finally:
        path.unlink(missing_ok=True)


def _map(path: Path, size: int, create: bool = False) -> mmap.mmap:
    """Map the shared file at path (created with size bytes), its pages populated."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
