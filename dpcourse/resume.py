"""Chapter 07: training that survives a dead worker - checkpoints that resume exactly, and
joining the process group again when torchrun restarts the workers.

``torchrun --max-restarts=N`` restarts every worker when one dies; the run then goes on only
from its last checkpoint, and exactly only if the checkpoint holds everything the next steps
depend on (the weights, every rank's optimizer state, the position in the data, any RNG or
communication-hook state). ``save`` writes a checkpoint atomically; ``load`` refuses, naming
the file, one that is truncated or corrupt or was written by a different command.
"""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FORMAT = "dpcourse.train_ddp/1"


def join_arguments(timeout: timedelta) -> dict[str, Any]:
    """init_process_group's arguments for a worker started by torchrun.

    torchrun's agent hosts a store (at MASTER_ADDR:MASTER_PORT: on a single node the agent
    itself, on several nodes the store of the rendezvous' host, which lives as long as the
    run) that outlives the workers. A restarted round joining it with env:// can read the dead
    round's addresses, still there, and fail with "Gloo connectFullMesh failed ... Connection
    refused" (pytorch/pytorch#167288). So every round joins that store as a client under a
    prefix of its own: TORCHELASTIC_RESTART_COUNT, which all workers of a round share as long
    as the set of nodes is fixed (--nnodes=N, not a range). Without torchrun's agent store,
    env:// as before (rank 0 hosts a fresh store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"dpcourse/restart{restart}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def save(path: Path, state: dict[str, Any]) -> None:
    """Write state to path atomically: a complete file or none (a temporary file, flushed to
    disk, then renamed over path)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path, device: torch.device) -> dict[str, Any]:
    """The checkpoint at path, onto device; a clear error naming path if it is unreadable."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated zip, bad pickle, ...: all one answer
        raise RuntimeError(
            f"checkpoint {path} is truncated or corrupt ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Nothing was loaded: restore "
            "a good copy, or delete it to start from step 0") from error
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise RuntimeError(f"checkpoint {path} was not written by python -m dpcourse.train_ddp "
                           f"(format {FORMAT}): nothing was loaded")
    return state


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
    """value with every tensor inside (dicts, lists, tuples) copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value
