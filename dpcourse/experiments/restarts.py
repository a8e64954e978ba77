"""Chapter 07: a worker killed mid-run, torchrun restarting the workers, the run resumed from
its last checkpoint, next to the same command uninterrupted.

``killed_run`` starts ``python -m dpcourse.train_ddp`` under ``torchrun --max-restarts``,
kills one worker with SIGKILL as soon as the first checkpoint exists, and returns the exit
code and output; ``restart_demo`` runs the same command uninterrupted beside it and compares.
Linux only (it finds the workers through /proc).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .. import resume

DEMO_FLAGS = ("--train-size", "1024", "--batch-size", "16", "--epochs", "1", "--lr", "0.05",
              "--timeout", "30", "--checkpoint-every", "8")


def torchrun_command(path: Path, *flags: str, nproc: int = 2, max_restarts: int = 3) -> list[str]:
    """torchrun (this Python's) running train_ddp with checkpoint path and flags."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
            "-m", "dpcourse.train_ddp", "--checkpoint", str(path), *flags]


def environment() -> dict[str, str]:
    """This environment, on the course's offline data unless another is chosen."""
    return {**os.environ, "DPCOURSE_DATA": os.environ.get("DPCOURSE_DATA", "synthetic")}


def workers_of(pid: int) -> list[int]:
    """The processes whose parent is pid (torchrun's workers), from Linux's /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return sorted(kids)


def killed_run(path: Path, *flags: str, nproc: int = 2, timeout: float = 240.0) -> dict[str, Any]:
    """The command on nproc workers, its last worker SIGKILLed as soon as the first checkpoint
    exists: {"exit_code", "output", "killed": the pid}."""
    path.unlink(missing_ok=True)
    proc = subprocess.Popen(torchrun_command(path, *flags, nproc=nproc), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=environment())
    try:
        deadline = time.monotonic() + timeout
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        victims = workers_of(proc.pid)
        if proc.poll() is not None or not victims:
            raise RuntimeError("the run ended before a worker could be killed: make it longer")
        os.kill(victims[-1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()  # (nothing left to kill when it ended)
        proc.wait()
    return {"exit_code": proc.returncode, "output": output, "killed": victims[-1]}


def resumed_steps(output: str) -> list[int]:
    """The steps a run's output says it resumed from (another rank's line may run into it)."""
    return [int(step) for step in re.findall(r"resuming from epoch \d+, step (\d+)", output)]


def restart_demo(folder: Path, *flags: str) -> dict[str, Any]:
    """The same train_ddp command (DEMO_FLAGS and flags) uninterrupted and with a worker
    killed, both at once: the killed run's exit code, its output lines that tell the story,
    the steps it resumed from, and whether the final parameters are bitwise the uninterrupted
    run's."""
    folder.mkdir(parents=True, exist_ok=True)
    whole = folder / "uninterrupted.pt"
    whole.unlink(missing_ok=True)
    uninterrupted = subprocess.Popen(torchrun_command(whole, *DEMO_FLAGS, *flags),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=environment())
    try:
        killed = killed_run(folder / "restarted.pt", *DEMO_FLAGS, *flags)
        output, _ = uninterrupted.communicate(timeout=240)
    finally:
        uninterrupted.kill()  # (nothing left to kill when it ended)
        uninterrupted.wait()
    if uninterrupted.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{output[-4000:]}")
    story = [line.split("] ")[-1].split(" of binary")[0] for line in killed["output"].splitlines()
             if "exitcode: -9" in line or "Loaded" in line or line.startswith("Done")]
    a, b = resume.load(whole), resume.load(folder / "restarted.pt")
    return {"exit_code": killed["exit_code"], "story": story, "killed": killed["killed"],
            "resumed_from": resumed_steps(killed["output"]),
            "steps": (a["step"], b["step"]),
            "identical": all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])}
