"""Chapter 13: a lighthouse and replicas of train_ft on this machine, failures, and what the
replicas logged, read back.

``Replicas`` hosts a lighthouse (threads of this process) and starts each replica as a process
of its own: forked from a server that imported torch once (a start in a fraction of a second),
or as a user would, ``python -m dpcourse.train_ft`` (imports included). Failures come from
outside (``signal``: SIGKILL, SIGSTOP, SIGCONT) or from inside a replica, at a named point of
a step (``replica_with_faults``); ``supervise`` restarts and continues replicas as torchrun's
``--max-restarts`` would, ``run`` does both for a set of faults, and ``close`` ends every
process started. ``audit`` sums up a run's events; ``one_process_run`` is the uninterrupted
reference, written without train_ft. Linux only (signals, /proc).
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
from collections import defaultdict
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


def environment(gpus: bool = False) -> dict[str, str]:
    """Chapter 12's (offline data, one thread, no GPU unless gpus), gloo over the loopback
    interface."""
    env = {**nodes_environment(), "GLOO_SOCKET_IFNAME": "lo"}
    if gpus:
        env.pop("CUDA_VISIBLE_DEVICES")
        env.update({k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ})
    return env


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


def replica_with_faults(argv: list[str], environ: dict[str, str], out: str,
                        together: Any, faults: list[dict]) -> None:
    """run_replica, failing on purpose at named points of a step. A fault: "phase" (one of
    train_ft's: quorum, serve, forward, allreduce, vote), "step" (the first attempt at or
    after it), "how": "kill" (SIGKILL itself), "stop" (SIGSTOP itself: Replicas.supervise
    continues it after a pause), "delay" ("seconds" of sleep at every attempt at exactly
    that step: a member slower than the others) or "fail" (once, after "seconds" of sleep,
    the step fails on this member alone: in "allreduce", a torn collective, finished on the
    others; only in the phases inside an attempt: serve, forward, allreduce)."""
    pending = list(faults)

    def at(phase: str, step: int) -> None:
        for fault in list(pending):
            if fault["phase"] != phase:
                continue
            if fault["how"] == "delay" and step == fault["step"]:
                time.sleep(fault["seconds"])
            elif fault["how"] == "fail" and step >= fault["step"]:
                pending.remove(fault)
                time.sleep(fault["seconds"])
                raise RuntimeError(f"injected: {phase} failed on this member alone")
            elif fault["how"] != "delay" and step >= fault["step"]:
                pending.remove(fault)
                os.kill(os.getpid(), signal.SIGKILL if fault["how"] == "kill" else
                        signal.SIGSTOP)
    run_replica(argv, environ, out, together, at)


class Replicas:
    """A lighthouse with rules (or the one at address), and replicas of train_ft with flags,
    named, hiding the GPUs unless gpus; each replica logs its events to folder/NAME.jsonl and
    prints to folder/NAME.out."""

    def __init__(self, folder: Path, flags: Sequence[str], rules: Rules = Rules(),
                 tick: float = 0.02, address: str | None = None, gpus: bool = False) -> None:
        self.folder, self.flags, self.environment = folder, list(flags), environment(gpus)
        self.lighthouse = None if address else Lighthouse(rules=rules, tick=tick).start()
        self.address = address or self.lighthouse.address
        self.procs: dict[str, list[Any]] = {}  # every process started, by name, in order
        self.signals: list[tuple[float, str, str]] = []  # (time, name, what) sent by us
        self._ctx, self._barriers = start_context(), []

    def argv(self, name: str) -> list[str]:
        return ["--lighthouse", self.address, "--name", name,
                "--events", str(self.folder / f"{name}.jsonl"), *self.flags]

    def start(self, name: str, target: Callable[..., None] = run_replica, *extra: Any,
              command: Sequence[str] = (), together: Any = None,
              environ: dict[str, str] | None = None) -> int:
        """Start replica name (again, if it ran before), forked to run target(argv,
        environment, output file, together, *extra); or, given a command (a prefix such as
        ``python -m dpcourse.train_ft``), as that command in a session of its own, with
        environ added to its environment. Its pid."""
        out = self.folder / f"{name}.out"
        if command:
            with open(out, "ab") as f:
                proc = subprocess.Popen([*command, *self.argv(name)], stdout=f,
                                        stderr=subprocess.STDOUT,
                                        env={**self.environment, **(environ or {})},
                                        start_new_session=True)
        else:
            proc = self._ctx.Process(target=target, args=(self.argv(name), self.environment,
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
                  pauses: dict[str, list[float | Callable[[], bool]]] | None = None,
                  start: Callable[[str], Any] | None = None) -> dict[str, int]:
        """Wait until every replica's current process has ended; return their exit codes by
        name. A replica that ends non-zero is started again (start(name), by default
        self.start, forked) while restarts[name] allows; one that stops is continued after
        the next of pauses[name]: seconds, or a function of no argument, called from the
        stop on, that says when. Each end and stop seen is noted in signals. TimeoutError,
        naming what still runs, after timeout seconds."""
        restarts, pauses = dict(restarts or {}), {k: list(v) for k, v in (pauses or {}).items()}
        deadline, resume_at, ended = time.monotonic() + timeout, {}, set()
        while True:  # each round on one reading of the exit codes: none ends unseen
            codes = {name: self.exit_code(self.current(name)) for name in self.procs}
            for name, code in codes.items():
                if code is not None and self.current(name).pid not in ended:
                    ended.add(self.current(name).pid)
                    self.signals.append((time.time(), name, f"exited {code}"))
                if code not in (None, 0) and restarts.get(name, 0) > 0:
                    restarts[name] -= 1
                    (start or self.start)(name)
                    codes[name] = None  # running again
                elif code is None and name not in resume_at and pauses.get(name) and \
                        self.status(name) == psutil.STATUS_STOPPED:
                    self.signals.append((time.time(), name, "stopped"))
                    pause = pauses[name].pop(0)
                    resume_at[name] = pause if callable(pause) else (
                        lambda until=time.monotonic() + pause: time.monotonic() >= until)
            for name, due in list(resume_at.items()):
                if due():
                    self.signal(name, signal.SIGCONT)
                    del resume_at[name]
            running = [name for name, code in codes.items() if code is None]
            if not running and not resume_at:
                return codes
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas {running} still running after {timeout:g} s\n"
                                   + self.outputs())
            time.sleep(0.01)

    def run(self, faults: dict[str, list[dict]], timeout: float = 300) -> dict[str, int]:
        """Start the replicas named in faults together, each failing as its faults say
        (replica_with_faults); one killed with "restart" is started again at once, with the
        faults listed after that kill (as torchrun --max-restarts would), one stopped is
        continued after "pause" seconds, or once the others have committed "resume_after"
        steps without it. Their exit codes."""
        self.start_together(list(faults), replica_with_faults, {n: (f,) for n, f in
                                                               faults.items()})
        later = {n: [fs[i + 1:] for i, f in enumerate(fs) if f.get("restart")]
                 for n, fs in faults.items()}
        return self.supervise(
            timeout, restarts={n: len(rest) for n, rest in later.items()},
            pauses={n: [f["pause"] if "pause" in f else self.others_committed(n, f["resume_after"])
                        for f in fs if f["how"] == "stop"] for n, fs in faults.items()},
            start=lambda name: self.start(name, replica_with_faults, later[name].pop(0)))

    def others_committed(self, name: str, steps: int) -> Callable[[], bool]:
        """A function that says, once called, whether the replicas other than name have
        committed steps steps since its first call."""
        since = None

        def due() -> bool:
            nonlocal since
            since = since or time.time()
            done = {e["step"] for e in self.events() if e["name"] != name and
                    e.get("decision") == "commit" and e["time"] > since}
            return len(done) >= steps
        return due

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
        """End every process started (continued first if stopped; a command's whole session:
        torchrun's workers too), then the lighthouse."""
        for procs in self.procs.values():
            for proc in procs:
                command = isinstance(proc, subprocess.Popen)
                if self.exit_code(proc) is None or command:
                    for sig in (signal.SIGKILL, signal.SIGCONT):
                        try:
                            (os.killpg if command else os.kill)(proc.pid, sig)
                        except ProcessLookupError:
                            pass
                proc.wait() if isinstance(proc, subprocess.Popen) else proc.join()
        self._barriers.clear()  # their named semaphores are unlinked as they are collected
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


def audit(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run's events say: the steps committed, in how many quorums each (more than one
    only if it was redone), the samples each committing attempt trained, whether every member
    of an attempt acted on the same decision, whether each recovered state is its source's,
    and how many distinct final states the replicas ended with."""
    decisions, samples = defaultdict(set), defaultdict(list)
    for e in events:
        if e["event"] == "decision" and e["decision"] != "unknown":  # unknown: no decision
            decisions[e["qid"], e["step"]].add(e["decision"])
        elif e["event"] == "attempt":
            samples[e["qid"], e["step"]] += e["samples"]
    committed = defaultdict(list)
    for (qid, step), decided in decisions.items():
        if "commit" in decided:
            committed[step].append(qid)
    served = {(e["qid"], e["to"]): e["digest"] for e in events if e["event"] == "serve"}
    heals = [e for e in events if e["event"] == "heal"]
    return {"steps committed": len(committed),
            "quorums per step": sorted({len(q) for q in committed.values()}),
            "samples per step": sorted({len(samples[q, s]) for s, qs in committed.items()
                                        for q in qs}),
            "distinct samples per step": sorted({len(set(samples[q, s]))
                                                 for s, qs in committed.items() for q in qs}),
            "one decision per attempt": all(len(d) == 1 for d in decisions.values()),
            "recoveries": len(heals),
            "recovered as the source": all(served.get((e["qid"], e["replica"])) == e["digest"]
                                           for e in heals),
            "final states": len({e["digest"] for e in events if e["event"] == "end"})}


def why_healed(signals: list[tuple[float, str, str]], name: str, until: float) -> str:
    """What the harness (its signals) had done to replica name before a recovery at until."""
    seen = [what for t, n, what in signals if n == name and t < until]
    if seen[-1] == "SIGCONT":
        return "a zombie, continued after its stop"
    if seen.count("started") > 1:
        return "a new process, started after its kill"
    return "live all along, but left out of a quorum"


def replay(flags: Sequence[str], members: dict[int, int]) -> dict[str, torch.Tensor]:
    """train_ft's run (its flags) replayed in this process on one thread, as the replicas
    train: step s cut among members[s] members (train_ft.members_mean_gradient), the sums
    added in order. A run's final weights equal it bitwise when its steps were committed with
    those memberships; one uninterrupted process differs by rounding only."""
    args = train_ft.parse_args(["--lighthouse", "unused:0", *flags])
    images, labels = fashion_mnist("train", args.train_size,
                                   environment()["DPCOURSE_DATA"]).tensors
    dtype, threads = getattr(torch, args.dtype), torch.get_num_threads()
    model = lenet_model(args.seed).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    params = list(model.parameters())
    torch.set_num_threads(1)  # the replicas': kernels add in the same order
    try:
        for step in range(args.steps):
            mean = train_ft.members_mean_gradient(model, images.to(dtype), labels,
                                                  args.global_batch_size, members[step], step,
                                                  args.seed)
            for p, g in zip(params, mean.split([p.numel() for p in params])):
                p.grad = g.view_as(p)
            for group in opt.param_groups:
                group["lr"] = train_ft.learning_rate(args, step)
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.state_dict()


def rounding_gaps(flags: Sequence[str], steps: Sequence[int],
                  members: Sequence[int]) -> dict[tuple[int, int], float]:
    """The largest parameter gap, after each number of steps n, between a run without
    failures of q members at every step (replay: the replicas' bits for q <= 2; with more,
    gloo adds the members' sums in another order) and one uninterrupted process
    (one_process_run, on this process's threads), by (n, q)."""
    gaps = {}
    for n in steps:
        run = [*flags, "--steps", str(n)]
        _, reference = one_process_run(run)
        for q in members:
            replayed = replay(run, dict.fromkeys(range(n), q))
            gaps[n, q] = max((replayed[k] - reference[k]).abs().max().item() for k in reference)
    return gaps


def memberships(events: list[dict[str, Any]]) -> dict[int, int]:
    """The number of members that committed each step."""
    return {e["step"]: e["size"] for e in events if e.get("decision") == "commit"}
