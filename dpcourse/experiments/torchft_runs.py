"""Chapter 13: the same runs under torchft 0.2.0 (meta-pytorch/torchft), for comparison.

Each torchft replica trains LeNet on the same data with train_ft's flags, in torchft's own
loop (its ``train_ddp.py``): ``Manager`` (its lighthouse, a process group, live recovery),
the gradients averaged over the participants of the step with ``Manager.allreduce``, and the
optimizer stepped only if ``should_commit()``. (Its ``DistributedDataParallel`` cannot be
used here: in 0.2.0, on gloo, a peer lost during the allreduce fails its comm hook with an
AssertionError, as ``_ManagedWork.wait`` returns before it sets up the future the hook
returns; so each gradient goes through ``Manager.allreduce``, as its
``PureDistributedDataParallel`` does, in one flat tensor.) Its data follow torchft's
``DistributedSampler``: replica i of n fixed replica groups takes shard i of each global batch,
and its loader moves on after every step, committed or not (a restarted replica starts at the
step it healed to). So a step in flight when a replica fails, and the dead replica's shard
until it is back, are skipped: torchft's ``data.py`` calls its sampler "inherently lossy".
Where torchft cannot be installed (it has wheels for Linux x86_64, Python 3.10-3.13),
``available()`` says why and the comparisons are skipped.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
import uuid
from datetime import timedelta
from math import nan
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from .. import train_ft
from ..data import fashion_mnist, resolve_source
from ..elastic import rank_indices
from ..launch import exit_without_shutdown
from ..lenet import lenet_model
from ..lighthouse import Rules
from .ft_runs import (EXACT, Replicas, flag, memberships, one_process_run, replay,
                      rounding_gaps, run_replica)


def available() -> tuple[bool, str]:
    """Whether torchft can run here, and if not why."""
    if importlib.util.find_spec("torchft") is None:
        where = f"Python {platform.python_version()} on {sys.platform} {platform.machine()}"
        return False, (f"torchft is not installed ({where}; it has wheels for Linux x86_64, "
                       "Python 3.10-3.13): pip install -e '.[ft]'")
    return True, ""


class TorchftLighthouse:
    """torchft's lighthouse (Rust, gRPC) in this process, with heartbeat_timeout as ours."""

    def __init__(self, heartbeat_timeout: float = 1.0, join_timeout: float = 0.5,
                 min_replicas: int = 1) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # read once, when torchft is imported
        from torchft._torchft import LighthouseServer
        self.server = LighthouseServer(
            bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=int(join_timeout * 1e3),
            quorum_tick_ms=100, heartbeat_timeout_ms=int(heartbeat_timeout * 1e3))
        self.address = self.server.address()

    def close(self) -> None:
        self.server.shutdown()


def torchft_replica(argv: list[str], environ: dict[str, str], out: str, together: Any,
                    groups: int, index: int) -> None:
    """A forked torchft replica (replica group `index` of `groups`), train_ft's flags in argv
    (--lighthouse: torchft's), its events logged as train_ft's; an exit code at the end."""
    os.environ.clear()
    os.environ.update(environ, RUST_LOG="warn")  # torchft logs each quorum at "info"
    torch.set_num_threads(1)
    tqdm.set_lock(threading.RLock())
    with open(out, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    code = 0
    try:
        train_with_torchft(train_ft.parse_args(argv), groups, index, together)
    except BaseException:  # noqa: BLE001 - reported in its output, then a non-zero exit
        traceback.print_exc()
        code = 1
    exit_without_shutdown(code)


def train_with_torchft(args: Any, groups: int, index: int, together: Any = None) -> None:
    """torchft's training loop, as its train_ddp.py, over train_ft's global batches."""
    from torchft import Manager, ProcessGroupGloo
    dtype = getattr(torch, args.dtype)
    images, labels = fashion_mnist("train", args.train_size, resolve_source(args.data)).tensors
    model = lenet_model(args.seed).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)), min_replica_size=1,
        load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                   opt.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=args.name, store_addr="127.0.0.1", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=args.lighthouse, timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30))
    log = train_ft.EventLog(args.events, f"{args.name}-{uuid.uuid4().hex[:6]}")
    log("start", step=0, qid=0, checkpoint=False)
    if together is not None:
        together.wait(60)
    position = None  # the loader's: set at the first step to the step healed to
    while manager.current_step() < args.steps:
        manager.start_quorum()
        opt.zero_grad(set_to_none=True)
        if position is None:
            manager.wait_quorum()
            position = manager.current_step()
        samples = rank_indices(len(images), args.global_batch_size, groups, index, position,
                               args.seed)
        log("attempt", qid=0, step=manager.current_step(), batch=position, samples=samples)
        F.cross_entropy(model(images[samples].to(dtype)), labels[samples]).backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()  # averaged over the participants; False on an error
        for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(averaged.view_as(g))
        for group in opt.param_groups:
            group["lr"] = train_ft.learning_rate(args, manager.current_step())
        commit = manager.should_commit()
        log("decision", qid=0, step=manager.current_step() - commit, batch=position,
            size=manager.num_participants(), decision="commit" if commit else "abort")
        if commit:
            opt.step()
        position += 1  # torchft's loader moves on, committed or not
    log("end", step=manager.current_step(), qid=0, digest="")
    torch.save(model.state_dict(), f"{args.events}.pt")
    manager.shutdown(wait=False)


def samples_skipped(events: list[dict[str, Any]], global_batch: int) -> int:
    """Samples of the global batches the replicas went through that no committed step used
    (an attempt's global batch: its "batch", torchft's loader position, else its step)."""
    def key(e: dict) -> tuple:
        return e["replica"], e["qid"], e["step"], e.get("batch", e["step"])
    committed = {key(e) for e in events if e.get("decision") == "commit"}
    attempts = [e for e in events if e["event"] == "attempt"]
    used = {(e.get("batch", e["step"]), i) for e in attempts if key(e) in committed
            for i in e["samples"]}
    batches = {e.get("batch", e["step"]) for e in attempts}
    return len(batches) * global_batch - len(used)


def failure_run(replicas: Replicas, names: Sequence[str], torchft: bool = False,
                kill: tuple[str, int] | None = None, stop: tuple[str, int, float] | None = None,
                command: bool = False, until_joined: bool = False) -> dict[str, Any]:
    """Replicas names (ours, or torchft's: replicas then has its lighthouse) train together.
    Once kill's replica starts its step, it is SIGKILLed, and started again (forked, or as a
    command: imports included) once another has committed without it; once stop's replica
    starts its step, it is stopped (SIGSTOP) for its pause in seconds. Returns the seconds
    from the kill to the next commit and from the restart to the first commit that replica
    takes part in (torchft's first, healing, sends zeros); unless until_joined (then the
    run is cut short there), the samples no commit used, the exit codes, every event, and
    the final weights."""
    def target(name: str) -> tuple:
        return (torchft_replica, len(names), names.index(name)) if torchft else (run_replica,)
    replicas.start_together(names, target(names[0])[0],
                            {name: target(name)[1:] for name in names})
    figures: dict[str, Any] = {}
    if kill:
        name, step = kill
        wait_for(lambda: first(replicas, {name}, "attempt", step), 120, f"{name}'s step {step}")
        replicas.signal(name, signal.SIGKILL)
        killed = replicas.signals[-1][0]
        others = set(names) - {name}
        survived = wait_for(lambda: first(replicas, others, "commit", step, after=killed), 120,
                            "a commit without it")
        if command:
            replicas.start(name, command=[sys.executable, "-m", __name__, str(len(names)),
                                          str(names.index(name))] if torchft
                           else [sys.executable, "-m", "dpcourse.train_ft"])
        else:
            replicas.start(name, *target(name))
        restarted = replicas.signals[-1][0]
        def joined() -> dict | bool | None:  # True: the run ended before it joined
            return first(replicas, {name}, "commit", after=restarted, size=2) or all(
                replicas.exit_code(replicas.current(n)) is not None for n in names)
        back = wait_for(joined, 120, f"{name}'s first commit with the others")
        figures.update(kill_to_next_commit_s=survived["time"] - killed,
                       start_to_first_commit_s=None if back is True else
                       back["time"] - restarted)
        if until_joined:
            return figures
    if stop:
        name, step, pause = stop
        wait_for(lambda: first(replicas, {name}, "attempt", step), 120, f"{name}'s step {step}")
        replicas.signal(name, signal.SIGSTOP)
        time.sleep(pause)
        replicas.signal(name, signal.SIGCONT)
    codes = replicas.supervise(300)
    events = replicas.events()
    assert set(codes.values()) == {0}, replicas.outputs()
    checkpoint = flag(replicas.flags, "--checkpoint", "")
    final = torch.load(replicas.folder / "r0.jsonl.pt" if torchft else checkpoint,
                       weights_only=True)
    global_batch = int(flag(replicas.flags, "--global-batch-size", "64"))
    return {**figures, "samples_skipped": samples_skipped(events, global_batch),
            "codes": codes, "events": events, "final": final if torchft else final["model"]}


def kill_and_restart(folder: Path, flags: list[str], torchft: bool, kill_at: int,
                     rules: Rules = Rules(), command: bool = False,
                     until_joined: bool = False) -> dict[str, Any]:
    """failure_run of two replicas, r1 killed at step kill_at and started again, under its
    own lighthouse (ours, or torchft's with the same rules)."""
    lighthouse = TorchftLighthouse(rules.heartbeat_timeout, rules.join_timeout) \
        if torchft else None
    try:
        with Replicas(folder, flags, rules, address=lighthouse and lighthouse.address) as r:
            return failure_run(r, ["r0", "r1"], torchft, kill=("r1", kill_at),
                               command=command, until_joined=until_joined)
    finally:
        if lighthouse:
            lighthouse.close()


RULES = Rules(min_replicas=1, join_timeout=0.5, heartbeat_timeout=1.0)  # both lighthouses'
FAILURE_FLAGS = ("--global-batch-size", "32", "--train-size", "1024", "--timeout", "5",
                 "--checkpoint-every", "10", *EXACT)
KILL_AT = 20
STEPS, LONG_STEPS = 150, 3000  # a whole run; one cut short once r1 has joined again
STEADY_FLAGS = ("--steps", "100", "--global-batch-size", "64", "--train-size", "6400",
                "--timeout", "5")  # LeNet in float32, as chapter 07's ScratchDDP step
WARMUP = 30  # steady steps: from here on


def failure_figures(folder: Path, torchft: bool, repeats: int, command: bool) -> dict:
    """Medians over repeats kill_and_restart runs (FAILURE_FLAGS, STEPS steps, r1 killed at
    step KILL_AT and started again at once, forked) of the seconds to the survivor's next
    commit and the samples skipped; of the seconds from the restart to the restarted
    replica's first commit in these runs, or, with command, in as many runs where it starts
    as a command (imports included; LONG_STEPS, cut short there, so that r0 is still
    training when it comes); and the parameter gap to one uninterrupted process of the first
    run (ours: also to one process replaying its memberships, and the gap of a run of 2
    members without failures)."""
    runs, flags = [], [*FAILURE_FLAGS, "--steps", str(STEPS)]
    name = "torchft" if torchft else "ours"
    for i in range(repeats):
        run = folder / f"{name}{i}"
        run.mkdir()
        runs.append(kill_and_restart(run, [*flags, "--checkpoint", str(run / "ckpt.pt")],
                                     torchft, KILL_AT, RULES))
        if command:
            run = folder / f"{name}-command{i}"
            run.mkdir()
            runs[-1]["start_to_first_commit_s"] = kill_and_restart(
                run, [*FAILURE_FLAGS, "--steps", str(LONG_STEPS)], torchft, KILL_AT, RULES,
                command=True, until_joined=True)["start_to_first_commit_s"]
    _, reference = one_process_run(flags)
    gap = max((runs[0]["final"][k] - reference[k]).abs().max().item() for k in reference)
    figures = {key: statistics.median([r[key] for r in runs if r[key] is not None] or [nan])
               for key in ("kill_to_next_commit_s", "start_to_first_commit_s",
                           "samples_skipped")}
    if not torchft:  # the gap is rounding: the run is one process replaying its memberships
        replayed = replay(flags, memberships(runs[0]["events"]))
        figures["replay_gap"] = max((runs[0]["final"][k] - replayed[k]).abs().max().item()
                                    for k in replayed)
        figures["failure_free_gap"] = rounding_gaps(flags, [STEPS], [2])[STEPS, 2]
    return {**figures, "gap": gap, "runs": repeats}


def steady_step_seconds(folder: Path, torchft: bool) -> float:
    """The median seconds between r0's commits after WARMUP steps, two replicas and no
    failure (STEADY_FLAGS)."""
    lighthouse = TorchftLighthouse(RULES.heartbeat_timeout, RULES.join_timeout) \
        if torchft else None
    try:
        with Replicas(folder, STEADY_FLAGS, RULES,
                      address=lighthouse and lighthouse.address) as replicas:
            if torchft:
                replicas.start_together(["r0", "r1"], torchft_replica,
                                        {f"r{i}": (2, i) for i in (0, 1)})
            else:
                replicas.start_together(["r0", "r1"])
            assert replicas.supervise(300) == {"r0": 0, "r1": 0}, replicas.outputs()
            events = replicas.events()
    finally:
        if lighthouse:
            lighthouse.close()
    times = [e["time"] for e in events if e["name"] == "r0" and
             e.get("decision") == "commit" and e["step"] >= WARMUP]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def first(replicas: Replicas, names: set[str], what: str, step: int = 0,
          after: float = 0.0, size: int = 1) -> dict | None:
    """The first event `what` ("attempt", or "commit": a decision of a quorum of at least size
    participants) of one of names at step or later, logged after the time `after`."""
    for e in replicas.events():
        if e["name"] in names and e["time"] > after and e.get("step", 0) >= step and (
                e["event"] == what or e.get("decision") == what and e["size"] >= size):
            return e
    return None


def wait_for(condition: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.01)
    return found


if __name__ == "__main__":  # a torchft replica as a command: GROUPS INDEX train_ft's flags
    tqdm.set_lock(threading.RLock())
    try:
        train_with_torchft(train_ft.parse_args(sys.argv[3:]), int(sys.argv[1]),
                           int(sys.argv[2]))
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        exit_without_shutdown(1)
    exit_without_shutdown(0)
