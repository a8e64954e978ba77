"""Chapter 07: chapter 03's allreduces again, one tensor per process, only send and receive.

Every rank calls the same function with a tensor of the same shape and dtype; the tensor is
summed in place across the ranks of the default process group, and the function returns the
number of elements this rank sent. Only point-to-point operations are used (``send``,
``recv``, ``isend``, ``irecv``): no collective of ``torch.distributed``. Like torch's
collectives, both take an optional ``group`` (default: every rank).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.int64)
# The ring streams its chunks in pieces of at most 2 MiB (gloo's own ring uses 1 MiB
# segments; on a 2-core CPU 2 MiB measured a little faster, 512 KiB slower).
PIECE_BYTES = 2 << 20


def check_tensor(tensor: torch.Tensor, what: str) -> None:
    """Raise a clear error unless tensor can be summed across the ranks of the default group."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what} needs a dense tensor, got layout {tensor.layout}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what} supports {names}; got {tensor.dtype}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs the default process group: call it in a function "
                           "run by dpcourse.launch.launch, or after dist.init_process_group")


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, int, Callable[[int], int]]:
    """This rank's number in group, the group's size, and group rank -> global rank."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the group it was given")
    if group is None:
        return rank, dist.get_world_size(), lambda r: r
    return rank, dist.get_world_size(group), lambda r: dist.get_global_rank(group, r)


@contextmanager
def flat_view(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """A 1-D contiguous tensor on tensor's memory, or a copy written back at the end."""
    if tensor.is_contiguous():
        yield tensor.view(-1)
        return
    flat = tensor.contiguous().view(-1)
    yield flat
    tensor.copy_(flat.view(tensor.shape))


@torch.no_grad()
def allreduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum tensor in place: every rank sends it to rank 0, which adds and sends the sum back.

    Rank 0 sends (world-1) * N elements and every other rank N: rank 0 is the bottleneck.
    """
    check_tensor(tensor, "allreduce")
    rank, world, peer = group_ranks(group)
    if world == 1 or tensor.numel() == 0:
        return 0
    with flat_view(tensor) as flat:
        if rank != 0:
            dist.send(flat, dst=peer(0), group=group)
            dist.recv(flat, src=peer(0), group=group)
            return flat.numel()
        incoming = torch.empty_like(flat)
        for src in range(1, world):  # in rank order, so the sum is the same on every run
            dist.recv(incoming, src=peer(src), group=group)
            flat += incoming
        for work in [dist.isend(flat, dst=peer(dst), group=group) for dst in range(1, world)]:
            work.wait()
        return (world - 1) * flat.numel()


@dataclass(frozen=True)
class Ring:
    """This rank's place in the ring: its number, the size, its neighbours' global ranks."""
    rank: int
    world: int
    left: int
    right: int
    group: dist.ProcessGroup | None


@torch.no_grad()
def ring_allreduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   piece_numel: int | None = None, streamed: bool = True) -> int:
    """Sum tensor in place with the ring: reduce-scatter, then all-gather, over world chunks.

    In each of the 2(world-1) steps every rank sends one chunk to its right-hand neighbour
    and receives one from its left, so each sends about 2(world-1)/world * N elements.
    Chunks travel in pieces of piece_numel elements (default: 2 MiB), so that a large chunk
    streams instead of going as one message. streamed=True (the default) passes each piece
    on as soon as it has arrived and been added: additions overlap transfers (as in gloo's
    own ring) and each step overlaps the next. streamed=False goes step by step, all the
    pieces of a step in flight at once, then the additions; nccl always goes by steps. The
    reduce-scatter receives into buffers kept between calls (see receive_buffers).
    """
    if piece_numel is not None and (not isinstance(piece_numel, int) or piece_numel < 1):
        raise ValueError(f"piece_numel must be a whole number >= 1, got {piece_numel!r}")
    check_tensor(tensor, "ring_allreduce")
    rank, world, peer = group_ranks(group)
    if world == 1 or tensor.numel() == 0:
        return 0
    piece = piece_numel or max(1, PIECE_BYTES // tensor.element_size())
    ring = Ring(rank, world, peer((rank - 1) % world), peer((rank + 1) % world), group)
    with flat_view(tensor) as flat:
        chunks = [[p for p in c.split(piece) if p.numel() > 0]
                  for c in flat.tensor_split(world)]
        if streamed and dist.get_backend(group) != "nccl":
            return ring_streamed(chunks, ring)
        return ring_by_steps(chunks, ring)


class _KeptBuffers(threading.local):
    """Each thread's receive buffers for the ring, by dtype and device, kept between calls."""

    def __init__(self) -> None:
        self.by_kind: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


_kept = _KeptBuffers()


def receive_buffers(count: int, numel: int, like: torch.Tensor) -> list[torch.Tensor]:
    """count buffers of numel elements of like's dtype and device, reused by this thread's
    next calls. A fresh CPU buffer of tens of MiB goes back to the system when freed, so
    every call would page-fault it in again: a good part of the transfer time."""
    kept = _kept.by_kind
    key = (like.dtype, like.device)
    if key not in kept or kept[key].numel() < count * numel:
        kept[key] = torch.empty(count * numel, dtype=like.dtype, device=like.device)
    return list(kept[key][:count * numel].view(count, numel))


def ring_chunks(rank: int, world: int, step: int) -> tuple[int, int]:
    """The chunk rank sends and the chunk it receives in a step of the ring.

    Steps 0..world-2 are the reduce-scatter (the received chunk is added), steps
    world-1..2(world-1)-1 the all-gather (it overwrites): the chunk received in one step
    is the chunk sent in the next.
    """
    return (rank - step) % world, (rank - step - 1) % world


def ring_streamed(chunks: list[list[torch.Tensor]], ring: Ring) -> int:
    """The ring with isend/irecv, each piece passed on as soon as it is ready; elements sent.

    The receives of a step are posted one step ahead, so that pieces flow without waiting
    for the step boundary. Receiving in place into a chunk whose send may still be pending
    is safe: what arrives there is the same piece after a full trip round the ring, so it
    cannot arrive before it has left.
    """
    steps = 2 * (ring.world - 1)
    largest = max(sum(p.numel() for p in c) for c in chunks)
    buffers = receive_buffers(min(2, ring.world - 1), largest, chunks[0][0])  # steps alternate

    def post_receives(step: int) -> list:
        _, into = ring_chunks(ring.rank, ring.world, step)
        pieces = chunks[into]
        if step < ring.world - 1:  # reduce-scatter: into a buffer, added afterwards
            buffer = buffers[step % len(buffers)]
            targets = buffer[:sum(p.numel() for p in pieces)].split([p.numel() for p in pieces])
        else:  # all-gather: in place
            targets = pieces
        return [(piece, target, dist.irecv(target, src=ring.left, group=ring.group,
                                           tag=_tag(step, j, len(pieces))))
                for j, (piece, target) in enumerate(zip(pieces, targets))]

    first, _ = ring_chunks(ring.rank, ring.world, 0)
    sending = [dist.isend(p, dst=ring.right, group=ring.group,
                          tag=_tag(0, j, len(chunks[first])))
               for j, p in enumerate(chunks[first])]
    sent = sum(p.numel() for p in chunks[first])
    receiving = post_receives(0)
    for step in range(steps):
        following = post_receives(step + 1) if step + 1 < steps else []
        for j, (piece, target, work) in enumerate(receiving):
            work.wait()
            if step < ring.world - 1:
                piece += target
            if step + 1 < steps:  # pass it on: it is what the right neighbour needs next
                sending.append(dist.isend(piece, dst=ring.right, group=ring.group,
                                          tag=_tag(step + 1, j, len(receiving))))
                sent += piece.numel()
        receiving = following
    _wait_all(sending)
    return sent


def ring_by_steps(chunks: list[list[torch.Tensor]], ring: Ring) -> int:
    """The ring one step at a time, each step's sends and receives issued together (in one
    batch: nccl needs it so that two ranks sending to each other cannot deadlock)."""
    largest = max(sum(p.numel() for p in c) for c in chunks)
    [incoming] = receive_buffers(1, largest, chunks[0][0])  # for every reduce-scatter step
    sent = 0
    for step in range(2 * (ring.world - 1)):
        out, into = ring_chunks(ring.rank, ring.world, step)
        reducing = step < ring.world - 1
        sizes = [p.numel() for p in chunks[into]]
        targets = incoming[:sum(sizes)].split(sizes) if reducing else chunks[into]
        ops = ([dist.P2POp(dist.isend, p, ring.right, ring.group) for p in chunks[out]]
               + [dist.P2POp(dist.irecv, t, ring.left, ring.group) for t in targets])
        if ops:
            _wait_all(dist.batch_isend_irecv(ops))
        if reducing:
            for piece, target in zip(chunks[into], targets):
                piece += target
        sent += sum(p.numel() for p in chunks[out])
    return sent


def _tag(step: int, piece: int, pieces: int) -> int:
    """A distinct message tag for each piece of each step (kept below 2**30)."""
    return (step * pieces + piece) % (1 << 30)


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()
    works.clear()
