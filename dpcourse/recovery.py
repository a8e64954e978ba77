"""Chapter 13: live recovery. A member whose version (committed steps, quorum id of its last
commit) differs from the quorum's copies the whole training state from an up-to-date member
over the quorum's group: the state is serialized at one instant (between two commits nothing
changes it), sent in chunks after its length and digest, and used only once complete and its
digest matches (``receive_state`` raises otherwise, and the member heals at a later quorum).
"""
from __future__ import annotations

import hashlib
import io
from typing import Any, Callable

import torch
import torch.distributed as dist

CHUNK = 1 << 18  # bytes per message: a transfer of LeNet's state takes several


class RecoveryError(RuntimeError):
    """A transfer that cannot be used: cut short, or not the state its digest names."""


def recovery_plan(steps: list[int], qids: list[int]) -> dict[int, int]:
    """For each member (by place in the quorum) whose version (steps[i], qids[i]) is not the
    quorum's, the largest, the place of the up-to-date member it copies from: the up-to-date
    members in turn, so that several joining at once spread over them."""
    versions = list(zip(steps, qids))
    current = [i for i, v in enumerate(versions) if v == max(versions)]
    behind = [i for i, v in enumerate(versions) if v != max(versions)]
    return {member: current[n % len(current)] for n, member in enumerate(behind)}


def digest(state: Any) -> str:
    """A hash of state (tensors in dicts, lists, tuples, and plain values): equal digests,
    bitwise equal states."""
    h = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            for key, item in value.items():
                feed(key)
                feed(item)
        elif isinstance(value, (list, tuple)):
            h.update(f"[{len(value)}".encode())
            for item in value:
                feed(item)
        else:
            h.update(repr(value).encode())
    feed(state)
    return h.hexdigest()


def send_state(group: dist.ProcessGroup, state: dict[str, Any], to: int,
               between_chunks: Callable[[], None] = lambda: None) -> str:
    """Send state (on the CPU) to member `to` of group: its length and digest, then its bytes
    in chunks, calling between_chunks after the first; return the digest."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sha = digest(state)
    header = torch.tensor([len(payload), *bytes.fromhex(sha)], dtype=torch.int64)
    group.send([header], to, 0).wait()
    for n, chunk in enumerate(payload.split(CHUNK)):
        group.send([chunk], to, 0).wait()
        if n == 0:
            between_chunks()
    return sha


def receive_state(group: dist.ProcessGroup, source: int) -> tuple[dict[str, Any], str]:
    """The state member `source` of group sends, and its digest; RecoveryError if what
    arrived is not the state the digest names."""
    header = torch.empty(33, dtype=torch.int64)
    group.recv([header], source, 0).wait()
    payload = torch.empty(int(header[0]), dtype=torch.uint8)
    for chunk in payload.split(CHUNK):
        group.recv([chunk], source, 0).wait()
    sha = bytes(header[1:].tolist()).hex()
    try:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable payload is one answer
        raise RecoveryError(f"the state from member {source} is unreadable ({error}): "
                            "discarded") from None
    if digest(state) != sha:
        raise RecoveryError(f"the state from member {source} does not match its digest: "
                            "discarded")
    return state, sha
