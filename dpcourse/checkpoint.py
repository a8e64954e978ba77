"""Chapter 06: checkpoints that load with and without a data-parallel wrapper."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside nn.DataParallel, DistributedDataParallel or ScratchDataParallel."""
    return getattr(model, "module", model)


def save_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Save the plain module's state_dict, so its keys carry no "module." prefix."""
    torch.save(unwrap(model).state_dict(), path)


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load a checkpoint into model, wrapped or not, whichever way the checkpoint was saved."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    unwrap(model).load_state_dict(state)
