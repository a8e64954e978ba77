"""Chapter 13: a lighthouse and replicas of train_ft on this machine, failures, and what the
replicas logged, read back.

``Replicas`` hosts a lighthouse (threads of this process) and starts each replica as a process
of its own: forked from a server that imported torch once (a start in a fraction of a second),
or as a user would, ``python -m dpcourse.train_ft`` (imports included). It kills (SIGKILL),
stops (SIGSTOP) and continues replicas, supervises them as torchrun's ``--max-restarts`` would
(``supervise``), and ``close`` ends every process it started. ``one_process_run`` is the
uninterrupted reference, written without train_ft. Linux only (signals, /proc).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import train_ft
from ..data import fashion_mnist
from ..elastic import rank_indices
from ..launch import exit_without_shutdown, start_context
from ..lenet import lenet_model
from ..lighthouse import Lighthouse, Rules
from .nodes import environment as nodes_environment

EXACT = ("--dtype", "float64", "--momentum", "0.9", "--warmup", "4", "--lr", "0.05")


def environment() -> dict[str, str]:
    """Chapter 12's (offline data, one thread, no GPU), gloo over the loopback interface."""
    return {**nodes_environment(), "GLOO_SOCKET_IFNAME": "lo"}


def run_replica(argv: list[str], environ: dict[str, str], out: str, together: Any = None,
                at: train_ft.Phase | None = None) -> None:
    """A forked replica: environ, its output to the file out, train_ft's main(argv), and an
    exit code (1 and the traceback printed if it raised). at(phase, step) is called at each
    named point; together, a barrier, holds the first step until every replica started with
    it has registered with the lighthouse (so that the first quorum holds them all)."""
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    tqdm.set_lock(threading.RLock())  # not tqdm's default, a semaphore a killed process leaks
    with open(out, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)

    def phase(name: str, step: int) -> None:
        nonlocal together
        if together is not None:
            together.wait(60)
            together = None
        if at is not None:
            at(name, step)
    code = 0
    try:
        train_ft.main(argv, phase)
    except BaseException:  # noqa: BLE001 - reported in its output, then a non-zero exit
        traceback.print_exc()
        code = 1
    exit_without_shutdown(code)


class Replicas:
    """A lighthouse with rules (or the one at address), and replicas of train_ft with flags,
    named; each replica logs its events to folder/NAME.jsonl and prints to folder/NAME.out."""

    def __init__(self, folder: Path, flags: Sequence[str], rules: Rules = Rules(),
                 tick: float = 0.02, address: str | None = None) -> None:
        self.folder, self.flags = folder, list(flags)
        self.lighthouse = None if address else Lighthouse(rules=rules, tick=tick).start()
        self.address = address or self.lighthouse.address
        self.procs: dict[str, list[Any]] = {}  # every process started, by name, in order
        self.signals: list[tuple[float, str, str]] = []  # (time, name, what) sent by us
        self._ctx, self._barriers = start_context(), []

    def argv(self, name: str) -> list[str]:
        return ["--lighthouse", self.address, "--name", name,
                "--events", str(self.folder / f"{name}.jsonl"), *self.flags]

    def start(self, name: str, target: Callable[..., None] = run_replica, *extra: Any,
              command: Sequence[str] = (), together: Any = None) -> int:
        """Start replica name (again, if it ran before), forked to run target(argv,
        environment, output file, together, *extra); or, given a command (a prefix such as
        ``python -m dpcourse.train_ft``), as that command. Its pid."""
        out = self.folder / f"{name}.out"
        if command:
            with open(out, "ab") as f:
                proc = subprocess.Popen([*command, *self.argv(name)], stdout=f,
                                        stderr=subprocess.STDOUT, env=environment(),
                                        start_new_session=True)
        else:
            proc = self._ctx.Process(target=target, args=(self.argv(name), environment(),
                                                          str(out), together, *extra))
            proc.start()
        self.procs.setdefault(name, []).append(proc)
        self.signals.append((time.time(), name, "started"))
        return proc.pid

    def start_together(self, names: Sequence[str], target: Callable[..., None] = run_replica,
                       extras: dict[str, tuple] | None = None) -> None:
        """Start the replicas names, forked; their first step waits until all have
        registered with the lighthouse."""
        together = self._ctx.Barrier(len(names))
        self._barriers.append(together)  # a started Process drops its arguments
        for name in names:
            self.start(name, target, *(extras or {}).get(name, ()), together=together)

    def current(self, name: str) -> Any:
        return self.procs[name][-1]

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Send sig to replica name's current process (and note it)."""
        os.kill(self.current(name).pid, sig)
        self.signals.append((time.time(), name, sig.name))

    @staticmethod
    def exit_code(proc: Any) -> int | None:
        return proc.poll() if isinstance(proc, subprocess.Popen) else proc.exitcode

    def status(self, name: str) -> str:
        try:
            return psutil.Process(self.current(name).pid).status()
        except psutil.NoSuchProcess:
            return psutil.STATUS_DEAD

    def supervise(self, timeout: float, restarts: dict[str, int] | None = None,
                  pauses: dict[str, list[float]] | None = None,
                  start: Callable[[str], Any] | None = None) -> dict[str, int]:
        """Wait until every replica's current process has ended; return their exit codes by
        name. A replica that ends non-zero is started again (start(name), by default
        self.start, forked) while restarts[name] allows; one that stops is continued after the next
        of pauses[name]. TimeoutError, naming what still runs, after timeout seconds."""
        restarts, pauses = dict(restarts or {}), {k: list(v) for k, v in (pauses or {}).items()}
        deadline, resume_at = time.monotonic() + timeout, {}
        while True:
            for name in list(self.procs):
                code = self.exit_code(self.current(name))
                if code not in (None, 0) and restarts.get(name, 0) > 0:
                    restarts[name] -= 1
                    (start or self.start)(name)
                elif code is None and name not in resume_at and pauses.get(name) and \
                        self.status(name) == psutil.STATUS_STOPPED:
                    resume_at[name] = time.monotonic() + pauses[name].pop(0)
            for name, when in list(resume_at.items()):
                if time.monotonic() >= when:
                    self.signal(name, signal.SIGCONT)
                    del resume_at[name]
            running = [n for n in self.procs if self.exit_code(self.current(n)) is None]
            if not running and not resume_at:
                return {n: self.exit_code(self.current(n)) for n in self.procs}
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas {running} still running after {timeout:g} s\n"
                                   + self.outputs())
            time.sleep(0.01)

    def outputs(self) -> str:
        """What every replica printed, and the lighthouse's events."""
        texts = [f"--- {p.stem}:\n{p.read_text(errors='replace')[-3000:]}"
                 for p in sorted(self.folder.glob("*.out"))]
        events = "\n".join(f"{t:8.3f} s {what}" for t, what in
                           (self.lighthouse.events if self.lighthouse else []))
        return "\n".join(texts) + f"\n--- lighthouse:\n{events}"

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.folder)

    def close(self) -> None:
        """End every process started (continued first if stopped), then the lighthouse."""
        for procs in self.procs.values():
            for proc in procs:
                if self.exit_code(proc) is None:
                    for sig in (signal.SIGKILL, signal.SIGCONT):
                        try:
                            os.kill(proc.pid, sig)
                        except ProcessLookupError:
                            pass
                proc.wait() if isinstance(proc, subprocess.Popen) else proc.join()
        if self.lighthouse:
            self.lighthouse.close()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(folder: Path) -> list[dict[str, Any]]:
    """Every event the replicas logged in folder, in time order, each with its "name"."""
    events = []
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.endswith("}"):  # a line cut by a kill is not one
                events.append({"name": path.stem, **json.loads(line)})
    return sorted(events, key=lambda e: e["time"])


def flag(flags: Sequence[str], name: str, default: str) -> str:
    """The value of --name in flags, else default."""
    flags = list(flags)
    return flags[flags.index(name) + 1] if name in flags else default


def one_process_run(flags: Sequence[str]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """train_ft's run (LeNet, its flags) uninterrupted in this process, written out without
    train_ft: each global batch's mean loss, its plain backward, SGD; the losses before each
    step, and the final weights."""
    args = train_ft.parse_args(["--lighthouse", "unused:0", *flags])
    data = fashion_mnist("train", args.train_size, environment()["DPCOURSE_DATA"])
    dtype = getattr(torch, args.dtype)
    model = lenet_model(args.seed).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    losses = []
    for step in range(args.steps):
        X, y = data[rank_indices(len(data), args.global_batch_size, 1, 0, step, args.seed)]
        loss = F.cross_entropy(model(X.to(dtype)), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup) if args.warmup else args.lr
        opt.step()
    return losses, model.state_dict()
