"""Chapter 07: chapter 03's allreduces again, one tensor per process, only send and receive.

Every rank calls the same function with a tensor of the same shape and dtype; the tensor is
summed in place across the ranks of the default process group, and the function returns the
number of elements this rank sent. The ring's two halves are functions of their own:
``ring_reduce_scatter`` leaves rank r the sum of chunk r, ``ring_all_gather`` gives every rank
every rank's chunk. Only point-to-point operations are used (``send``, ``recv``, ``isend``,
``irecv``): no collective of ``torch.distributed``. Like torch's collectives, all take an
optional ``group`` (default: every rank).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.float16)
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
def ring_reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                        piece_numel: int | None = None, streamed: bool = True) -> int:
    """The ring's first half, in place: afterwards chunk r holds on rank r the sum of every
    rank's chunk r, as with dist.reduce_scatter_tensor.

    The chunks are those of the flat tensor's tensor_split(world); the other chunks are left
    holding partial sums. In each of the world-1 steps every rank sends one chunk to its
    right-hand neighbour, which adds it to its own: each rank sends every chunk but its own,
    about (world-1)/world * N elements. piece_numel and streamed as in ring_allreduce.
    """
    return _ring(tensor, group, piece_numel, streamed, "ring_reduce_scatter",
                 lambda world: range(world - 1))


@torch.no_grad()
def ring_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    piece_numel: int | None = None, streamed: bool = True) -> int:
    """The ring's second half, in place: rank r contributes its chunk r, and afterwards every
    rank holds every rank's chunk, as with dist.all_gather_into_tensor.

    The chunks are those of the flat tensor's tensor_split(world); what a rank held in the
    chunks of the others is overwritten. In each of the world-1 steps every rank passes one
    chunk on to its right-hand neighbour: each rank sends every chunk but its right-hand
    neighbour's, about (world-1)/world * N elements. piece_numel and streamed as in
    ring_allreduce.
    """
    return _ring(tensor, group, piece_numel, streamed, "ring_all_gather",
                 lambda world: range(world - 1, 2 * (world - 1)))


@torch.no_grad()
def ring_allreduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   piece_numel: int | None = None, streamed: bool = True) -> int:
    """Sum tensor in place with the ring: ring_reduce_scatter, then ring_all_gather.

    In each of the 2(world-1) steps every rank sends one chunk to its right-hand neighbour
    and receives one from its left, so each sends about 2(world-1)/world * N elements.
    Chunks travel in pieces of piece_numel elements (default: 2 MiB), so that a large chunk
    streams instead of going as one message. streamed=True (the default) passes each piece
    on as soon as it has arrived and been added: additions overlap transfers (as in gloo's
    own ring) and each step overlaps the next, the all-gather's first step the
    reduce-scatter's last too, as both halves' steps run as one stream. streamed=False goes
    step by step, all the pieces of a step in flight at once, then the additions; nccl
    always goes by steps. The reduce-scatter receives into buffers kept between calls (see
    receive_buffers).
    """
    return _ring(tensor, group, piece_numel, streamed, "ring_allreduce",
                 lambda world: range(2 * (world - 1)))  # the two halves' steps, in order


def _ring(tensor: torch.Tensor, group: dist.ProcessGroup | None, piece_numel: int | None,
          streamed: bool, what: str, steps: Callable[[int], range]) -> int:
    """Check the arguments, cut tensor into world chunks of pieces, run steps(world) of the
    ring on them (streamed, or step by step); the elements sent."""
    if piece_numel is not None and (not isinstance(piece_numel, int) or piece_numel < 1):
        raise ValueError(f"piece_numel must be a whole number >= 1, got {piece_numel!r}")
    check_tensor(tensor, what)
    rank, world, peer = group_ranks(group)
    if world == 1 or tensor.numel() == 0:
        return 0
    piece = piece_numel or max(1, PIECE_BYTES // tensor.element_size())
    ring = Ring(rank, world, peer((rank - 1) % world), peer((rank + 1) % world), group)
    with flat_view(tensor) as flat:
        chunks = [[p for p in c.split(piece) if p.numel() > 0]
                  for c in flat.tensor_split(world)]
        if streamed and dist.get_backend(group) != "nccl":
            return ring_streamed(chunks, ring, steps(world))
        return ring_by_steps(chunks, ring, steps(world))


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
    is the chunk sent in the next. Rank r receives its own chunk r last in the
    reduce-scatter, fully summed, and sends it first in the all-gather.
    """
    return (rank - step - 1) % world, (rank - step - 2) % world


def adds(step: int, world: int) -> bool:
    """Whether a step adds the chunk it receives (reduce-scatter) or overwrites (all-gather)."""
    return step < world - 1


@torch.no_grad()
def plain_ring_allreduce(tensor: torch.Tensor) -> int:
    """Sum a 1-D contiguous tensor in place over the default group with the ring, one step at
    a time, each chunk one message; the number of elements this rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(world)  # views: adding into a chunk adds into tensor
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming, sent = torch.empty_like(chunks[0]), 0  # chunk 0 is the largest
    for step in range(2 * (world - 1)):
        out, into = ring_chunks(rank, world, step)
        landing = incoming[:chunks[into].numel()] if adds(step, world) else chunks[into]
        ops = [dist.P2POp(dist.isend, chunks[out], right), dist.P2POp(dist.irecv, landing, left)]
        for work in dist.batch_isend_irecv(ops):  # both at once: no rank waits for ever
            work.wait()
        if adds(step, world):
            chunks[into].add_(landing)
        sent += chunks[out].numel()
    return sent


# A piece on its way in: this rank's piece, where the incoming part lands, the receive.
Arrival = tuple[torch.Tensor, torch.Tensor, "dist.Work"]


def ring_streamed(chunks: list[list[torch.Tensor]], ring: Ring, steps: range) -> int:
    """The steps with isend/irecv, pipelined piece by piece; elements sent.

    Only the first step sends from this rank's chunk as it is: in every later step the rank
    sends on the chunk it received (and added) in the step before, so each piece is passed on
    as soon as it has arrived and been added. Additions overlap transfers, and the next
    step's pieces leave while this step's are still arriving; for them not to wait, each
    step's receives are posted one step ahead. Receiving in place (all-gather) into a chunk
    whose send (reduce-scatter) may still be pending is safe: what arrives there is the same
    chunk after a full trip round the ring, so it cannot arrive before it has left.
    """
    buffers = _step_buffers(chunks, ring, steps, 2)  # two adding steps are in flight at once
    first = chunks[ring_chunks(ring.rank, ring.world, steps[0])[0]]
    sending = [_send(piece, ring, steps[0], j, len(first)) for j, piece in enumerate(first)]
    arriving = _post_receives(chunks, ring, steps[0], buffers)
    for step in steps:
        passing_on = step + 1 in steps
        ahead = _post_receives(chunks, ring, step + 1, buffers) if passing_on else []
        for j, piece in enumerate(_arrived(arriving, adds(step, ring.world))):
            if passing_on:  # what arrived is what the right-hand neighbour receives next
                sending.append(_send(piece, ring, step + 1, j, len(arriving)))
        arriving = ahead
    _wait_all(sending)
    return _elements_sent(chunks, ring, steps)


def _post_receives(chunks: list[list[torch.Tensor]], ring: Ring, step: int,
                   buffers: list[torch.Tensor]) -> list[Arrival]:
    """Post a step's receives: (this rank's piece, where its part lands, the receive) each."""
    pieces = chunks[ring_chunks(ring.rank, ring.world, step)[1]]
    landings = _landings(pieces, step, ring.world, buffers)
    return [(piece, landing, dist.irecv(landing, src=ring.left, group=ring.group,
                                        tag=_tag(step, j, len(pieces))))
            for j, (piece, landing) in enumerate(zip(pieces, landings))]


def _arrived(arriving: list[Arrival], adding: bool) -> Iterator[torch.Tensor]:
    """This rank's pieces in order, each once its part has arrived (and has been added)."""
    for piece, landing, work in arriving:
        work.wait()
        if adding:
            piece += landing
        yield piece


def _send(piece: torch.Tensor, ring: Ring, step: int, j: int, pieces: int) -> dist.Work:
    """Start sending piece j (of pieces) of a step's chunk to the right-hand neighbour."""
    return dist.isend(piece, dst=ring.right, group=ring.group, tag=_tag(step, j, pieces))


def ring_by_steps(chunks: list[list[torch.Tensor]], ring: Ring, steps: range) -> int:
    """The steps one at a time, each step's sends and receives issued together (in one
    batch: nccl needs it so that two ranks sending to each other cannot deadlock)."""
    buffers = _step_buffers(chunks, ring, steps, 1)  # one step at a time
    for step in steps:
        out, into = ring_chunks(ring.rank, ring.world, step)
        landings = _landings(chunks[into], step, ring.world, buffers)
        ops = ([dist.P2POp(dist.isend, p, ring.right, ring.group) for p in chunks[out]]
               + [dist.P2POp(dist.irecv, t, ring.left, ring.group) for t in landings])
        if ops:
            _wait_all(dist.batch_isend_irecv(ops))
        if adds(step, ring.world):
            for piece, landing in zip(chunks[into], landings):
                piece += landing
    return _elements_sent(chunks, ring, steps)


def _step_buffers(chunks: list[list[torch.Tensor]], ring: Ring, steps: range,
                  most: int) -> list[torch.Tensor]:
    """Receive buffers the size of the largest chunk: one per adding step, at most most."""
    largest = max(sum(p.numel() for p in c) for c in chunks)
    count = min(most, sum(adds(step, ring.world) for step in steps))
    return receive_buffers(count, largest, chunks[0][0])


def _landings(pieces: list[torch.Tensor], step: int, world: int,
              buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Where a step's incoming parts land: a buffer, to be added (reduce-scatter), or the
    pieces themselves (all-gather); adding steps use the buffers in turn."""
    if not adds(step, world):
        return pieces
    sizes = [p.numel() for p in pieces]
    return list(buffers[step % len(buffers)][:sum(sizes)].split(sizes))


def _elements_sent(chunks: list[list[torch.Tensor]], ring: Ring, steps: range) -> int:
    """Elements this rank sends in the steps: the chunk it sends in each."""
    return sum(p.numel() for step in steps
               for p in chunks[ring_chunks(ring.rank, ring.world, step)[0]])


def _tag(step: int, piece: int, pieces: int) -> int:
    """A distinct message tag for each piece of each step (kept below 2**30)."""
    return (step * pieces + piece) % (1 << 30)


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()
    works.clear()
