"""Chapter 13: the same runs under torchft 0.2.0 (meta-pytorch/torchft), for comparison.

Each torchft replica group is one process that trains LeNet on the same data with train_ft's
flags, in torchft's own loop and data path (its repository's ``train_ddp.py``): ``Manager``
(its lighthouse, a process group, live recovery), the gradients averaged over the
participants of the step with ``Manager.allreduce``, the optimizer stepped only if
``should_commit()``; its ``DistributedSampler`` (group i of n fixed groups takes every n-th
index of the shuffled data), batched per group (G // n samples here: torchft has no global
batch). Its loader moves on after every step, committed or not, and a restarted group's
loader starts again at its shard's first batch (``train_ddp.py`` keeps no loader state;
torchft issue #58). (Its ``DistributedDataParallel`` cannot be used here: in 0.2.0, on gloo,
a peer lost during the allreduce fails its comm hook with an AssertionError, as
``_ManagedWork.wait`` returns before it sets up the future the hook returns; so each gradient
goes through ``Manager.allreduce``, as its ``PureDistributedDataParallel`` does, in one flat
tensor.) The lighthouse runs as its users run it, the ``torchft_lighthouse`` command, and its
log says why each quorum formed. Where torchft cannot be installed (it has wheels for Linux
x86_64, Python 3.10-3.13), ``available()`` says why and the comparisons are skipped.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timedelta
from math import nan
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from .. import train_ft
from ..data import fashion_mnist, resolve_source
from ..elastic import rank_indices
from ..launch import exit_without_shutdown
from ..lenet import lenet_model
from ..lighthouse import Rules
from .ft_runs import (EXACT, Replicas, memberships, one_process_run, replay,
                      replica_with_faults, rounding_gaps)


def available() -> tuple[bool, str]:
    """Whether torchft can run here, and if not why."""
    if importlib.util.find_spec("torchft") is None:
        where = f"Python {platform.python_version()} on {sys.platform} {platform.machine()}"
        return False, (f"torchft is not installed ({where}; it has wheels for Linux x86_64, "
                       "Python 3.10-3.13): pip install -e '.[ft]'")
    return True, ""


LIGHTHOUSE = ("import sys; from torchft._torchft import lighthouse_main; "
              "sys.argv[0] = 'torchft_lighthouse'; sys.exit(lighthouse_main())")


class TorchftLighthouse:
    """torchft's lighthouse as its users run it, the torchft_lighthouse command, with rules as
    ours; it logs (RUST_LOG=info) to folder/torchft_lighthouse.log why each quorum formed."""

    def __init__(self, folder: Path, rules: Rules = Rules(), timeout: float = 60) -> None:
        command = Path(sys.executable).with_name("torchft_lighthouse")
        self.log = folder / "torchft_lighthouse.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [*([str(command)] if command.exists() else [sys.executable, "-c", LIGHTHOUSE]),
                 "--bind", "[::]:0", "--min_replicas", str(rules.min_replicas),
                 "--join_timeout_ms", str(int(rules.join_timeout * 1e3)), "--quorum_tick_ms",
                 "100", "--heartbeat_timeout_ms", str(int(rules.heartbeat_timeout * 1e3))],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "RUST_LOG": "info"})
        deadline = time.monotonic() + timeout
        while "listening on: " not in (text := self.log.read_text(errors="replace")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"torchft_lighthouse did not start in {timeout:g} s "
                                   f"(exit code {self.proc.poll()}): {text[-2000:]}")
            time.sleep(0.05)
        self.address = text.split("listening on: ", 1)[1].split()[0]

    def statuses(self) -> list[tuple[float, str]]:
        """(time, why) of each change of its quorum status, as it logged them."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            if " - Quorum status: " in line:
                stamp, why = line.split(" ", 1)[0], line.split(" - Quorum status: ", 1)[1]
                found.append((datetime.fromisoformat(stamp).timestamp(), why))
        return found

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def torchft_replica(argv: list[str], environ: dict[str, str], out: str, together: Any,
                    groups: int, index: int, tear_at: int | None = None) -> None:
    """A forked torchft replica group (group `index` of `groups`, one process), train_ft's
    flags in argv (--lighthouse: torchft's), its events logged as train_ft's; an exit code at
    the end."""
    os.environ.clear()
    os.environ.update(environ, RUST_LOG="warn")  # torchft logs each quorum at "info"
    torch.set_num_threads(1)
    tqdm.set_lock(threading.RLock())
    with open(out, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    code = 0
    try:
        train_with_torchft(train_ft.parse_args(argv), groups, index, together, tear_at)
    except BaseException:  # noqa: BLE001 - reported in its output, then a non-zero exit
        traceback.print_exc()
        code = 1
    exit_without_shutdown(code)


def torchft_loader(dataset: Any, groups: int, index: int, batch_size: int,
                   seed: int) -> DataLoader:
    """torchft's data path, as its train_ddp.py: its DistributedSampler for replica group index
    of groups (a group of one rank), shuffled, batched per group."""
    from torchft import DistributedSampler
    sampler = DistributedSampler(dataset, replica_rank=index, num_replica_groups=groups,
                                 group_rank=0, num_replicas=1, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def dealt_batches(size: int, groups: int, index: int, batch_size: int, seed: int,
                  count: int) -> list[list[int]]:
    """The sample indices of the first count batches group index's loader deals, epoch after
    epoch (each in the same order: train_ddp.py never calls set_epoch)."""
    loader, batches = torchft_loader(TensorDataset(torch.arange(size)), groups, index,
                                     batch_size, seed), []
    while len(batches) < count:
        batches += [b.tolist() for (b,) in loader][:count - len(batches)]
    return batches


def train_with_torchft(args: Any, groups: int, index: int, together: Any = None,
                       tear_at: int | None = None) -> None:
    """torchft's training loop and data path, as its train_ddp.py, with train_ft's model and
    flags; each group batches G // groups samples. At step tear_at, this group's allreduce
    fails after the others' finished (a torn collective: Manager.report_error)."""
    from torchft import Manager, ProcessGroupGloo
    dtype = getattr(torch, args.dtype)
    images, labels = fashion_mnist("train", args.train_size, resolve_source(args.data)).tensors
    data = TensorDataset(images.to(dtype), labels, torch.arange(len(labels)))
    loader = torchft_loader(data, groups, index, args.global_batch_size // groups, args.seed)
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
    batch = 0  # this process's loader starts at its shard's first batch, restarted or not
    while manager.current_step() < args.steps:
        for inputs, targets, samples in loader:
            if manager.current_step() >= args.steps:
                break
            manager.start_quorum()
            opt.zero_grad(set_to_none=True)
            log("attempt", qid=0, step=manager.current_step(), batch=batch,
                samples=samples.tolist())
            F.cross_entropy(model(inputs), targets).backward()
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()  # averaged over the participants
            for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(averaged.view_as(g))
            for group in opt.param_groups:
                group["lr"] = train_ft.learning_rate(args, manager.current_step())
            if manager.current_step() == tear_at:
                tear_at = None
                manager.report_error(RuntimeError("injected: the allreduce failed here alone"))
            participating = manager.is_participating()  # False while it heals: sends zeros
            commit = manager.should_commit()
            log("decision", qid=manager._quorum_id,  # noqa: SLF001 - torchft has no getter
                step=manager.current_step() - commit, batch=batch,
                size=manager.num_participants(), participating=participating,
                decision="commit" if commit else "abort")
            if commit:
                opt.step()
            batch += 1  # torchft's loader moves on, committed or not
    log("end", step=manager.current_step(), qid=0, digest="")
    torch.save(model.state_dict(), f"{args.events}.pt")
    manager.shutdown(wait=False)


def sample_use(trained: Counter, expected: Counter) -> dict[str, int]:
    """Of the samples a run without failures trains (expected: each sample by its place in
    the data), those no committed step trained ("skipped"), the trainings of a place already
    trained ("repeated"), and every training by a committed step ("trained")."""
    return {"trained": sum(trained.values()), "skipped": sum((expected - trained).values()),
            "repeated": sum(n - 1 for n in trained.values() if n > 1),
            "expected": sum(expected.values())}


def ours_sample_use(events: list[dict[str, Any]], args: Any) -> dict[str, int]:
    """sample_use of a train_ft run: a sample's place is (step, index) in global batch step."""
    committed = {(e["replica"], e["qid"], e["step"]) for e in events
                 if e.get("decision") == "commit"}
    trained = Counter((e["step"], i) for e in events if e["event"] == "attempt"
                      and (e["replica"], e["qid"], e["step"]) in committed
                      for i in e["samples"])
    expected = Counter((s, i) for s in range(args.steps) for i in
                       rank_indices(args.train_size, args.global_batch_size, 1, 0, s, args.seed))
    return sample_use(trained, expected)


def torchft_sample_use(events: list[dict[str, Any]], names: Sequence[str],
                       args: Any) -> dict[str, int]:
    """sample_use of a torchft run: a sample's place is (group, batch, index) in what its
    loader deals. A group's batch is trained if the group took part in the allreduce (it was
    not healing) of a step that some group committed: a torn step commits on some groups
    only, with every participant's gradient."""
    decided = {(e["replica"], e["batch"]): e for e in events if e["event"] == "decision"}
    committed = {(e["qid"], e["step"]) for e in decided.values() if e["decision"] == "commit"}

    def trained(attempt: dict) -> bool:
        d = decided.get((attempt["replica"], attempt["batch"]))
        return d is not None and d["participating"] and (d["qid"], d["step"]) in committed
    used = Counter((e["name"], e["batch"], i) for e in events
                   if e["event"] == "attempt" and trained(e) for i in e["samples"])
    batch_size = args.global_batch_size // len(names)
    expected = Counter((name, k, i) for g, name in enumerate(names) for k, batch in enumerate(
        dealt_batches(args.train_size, len(names), g, batch_size, args.seed, args.steps))
        for i in batch)
    return sample_use(used, expected)


def failure_run(replicas: Replicas, names: Sequence[str], torchft: bool = False,
                kill: tuple[str, int] | None = None, stop: tuple[str, int, float] | None = None,
                tear: tuple[str, int] | None = None, command: bool = False,
                until_joined: bool = False) -> dict[str, Any]:
    """Replicas names (ours, or torchft's: replicas then has its lighthouse) train together.
    Once kill's replica starts its step, it is SIGKILLed, and started again (forked, or as a
    command: imports included) once another has committed without it; once stop's replica
    starts its step, it is stopped (SIGSTOP) for its pause in seconds; at tear's step, its
    replica's allreduce fails after the others' finished. Returns the seconds from the kill
    to the next commit and from the restart to the first commit that replica takes part in
    (torchft's healing commit, which sends zeros, does not count); unless until_joined
    (then the run is cut short there), the samples used (sample_use), the exit codes, every
    event, and the final weights."""
    def target(name: str) -> tuple:
        torn = tear[1] if tear and tear[0] == name else None
        if torchft:
            return torchft_replica, len(names), names.index(name), torn
        return replica_with_faults, [] if torn is None else [
            {"phase": "allreduce", "step": torn, "how": "fail", "seconds": 0.5}]
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
    args = train_ft.parse_args(["--lighthouse", "unused:0", *replicas.flags])
    use = torchft_sample_use(events, names, args) if torchft else ours_sample_use(events, args)
    final = torch.load(replicas.folder / "r0.jsonl.pt" if torchft else args.checkpoint,
                       weights_only=True)
    return {**figures, "samples_skipped": use["skipped"], "samples_repeated": use["repeated"],
            "samples_trained": use["trained"], "samples_expected": use["expected"],
            "codes": codes, "events": events,
            "final": final if torchft else final["model"]}


@contextmanager
def under_lighthouse(folder: Path, flags: Sequence[str], rules: Rules,
                     torchft: bool) -> Iterator[tuple[Replicas, Callable[[], list]]]:
    """Replicas (folder, flags) under a lighthouse of their own with rules: ours, or
    torchft's command; and a function that reads that lighthouse's log as (time, what)."""
    lighthouse = TorchftLighthouse(folder, rules) if torchft else None
    try:
        with Replicas(folder, flags, rules, address=lighthouse and lighthouse.address) as r:
            def log() -> list[tuple[float, str]]:
                if lighthouse:
                    return lighthouse.statuses()
                started = time.time() - time.monotonic() + r.lighthouse.start_time
                return [(started + t, what) for t, what in r.lighthouse.events]
            yield r, log
    finally:
        if lighthouse:
            lighthouse.close()


def kill_and_restart(folder: Path, flags: list[str], torchft: bool, kill_at: int,
                     rules: Rules = Rules(), command: bool = False,
                     until_joined: bool = False) -> dict[str, Any]:
    """failure_run of two replicas, r1 killed at step kill_at and started again, under its
    own lighthouse (ours, or torchft's with the same rules)."""
    with under_lighthouse(folder, flags, rules, torchft) as (replicas, _):
        return failure_run(replicas, ["r0", "r1"], torchft, kill=("r1", kill_at),
                           command=command, until_joined=until_joined)


def side_by_side(folder: Path, flags: Sequence[str], rules: Rules, names: Sequence[str],
                 **failures: Any) -> dict[str, dict[str, Any]]:
    """failure_run of ours and, where it can run, of torchft, started alike: each under a
    lighthouse of its own with rules, flags (a --checkpoint in its own folder) and failures.
    Each run also holds the harness's signals and its lighthouse's log: (time, what)."""
    runs = {}
    for name in ("ours", "torchft") if available()[0] else ("ours",):
        where = folder / name
        where.mkdir(parents=True)
        with under_lighthouse(where, [*flags, "--checkpoint", str(where / "ckpt.pt")], rules,
                              name == "torchft") as (replicas, log):
            runs[name] = failure_run(replicas, names, name == "torchft", **failures)
            runs[name].update(signals=replicas.signals, lighthouse=log())
    return runs


def deciding_rule(statuses: list[tuple[float, str]], after: float) -> str:
    """Which rule let a lighthouse form its first quorum after the time `after`, read from its
    log (ours, or torchft's Quorum status lines): each line's replicas that asked, of the
    healthy ones, against the line before the quorum."""
    counts = []
    for t, what in statuses:
        found = re.search(r"(\d+) of (\d+) healthy|\[(\d+)/\d+ participants healthy\]\[(\d+) "
                          r"heartbeating\]", what)
        if t > after and found:
            asked, healthy = (int(g) for g in found.groups() if g is not None)
            counts.append((asked, healthy))
            if what.startswith("quorum ") or "quorum found" in what:
                break
    else:
        return "no quorum formed after it"
    (asked, healthy), before = counts[-1], counts[-2] if len(counts) > 1 else counts[-1]
    if asked < healthy:
        return f"the join timeout: {asked} of {healthy} healthy asked, a majority"
    if before[1] > healthy:
        return f"the heartbeat timeout: the dead one stopped counting, {asked} of {healthy}"
    return f"a request: the last of {healthy} healthy asked (its collective had failed)"


def after_torn_step(events: list[dict[str, Any]], step: int) -> tuple[dict[str, str], list]:
    """Each replica's first decision on step, and the replicas that healed after it (ours log
    a heal; torchft's heal in a step they commit without taking part)."""
    decided: dict[str, str] = {}
    for e in events:
        if e["event"] == "decision" and e["step"] == step:
            decided.setdefault(e["name"], e["decision"])
    healed = sorted({e["name"] for e in events if e["step"] > step and (
        e["event"] == "heal" or e["event"] == "decision" and e.get("participating") is False)})
    return dict(sorted(decided.items())), healed


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
    step KILL_AT and started again, forked, once r0 committed alone) of the seconds to the
    survivor's next commit and the samples skipped and repeated (sample_use); of the
    seconds from the restart to the restarted replica's first commit in these runs, or,
    with command, in as many runs where it starts as a command (imports included;
    LONG_STEPS, cut short there, so that r0 is still training when it comes); and the parameter gap to one uninterrupted process of the first
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
                           "samples_skipped", "samples_repeated")}
    if not torchft:  # the gap is rounding: the run is one process replaying its memberships
        replayed = replay(flags, memberships(runs[0]["events"]))
        figures["replay_gap"] = max((runs[0]["final"][k] - replayed[k]).abs().max().item()
                                    for k in replayed)
        figures["failure_free_gap"] = rounding_gaps(flags, [STEPS], [2])[STEPS, 2]
    return {**figures, "gap": gap, "runs": repeats}


def steady_step_seconds(folder: Path, torchft: bool) -> float:
    """The median seconds between r0's commits after WARMUP steps, two replicas and no
    failure (STEADY_FLAGS)."""
    with under_lighthouse(folder, STEADY_FLAGS, RULES, torchft) as (replicas, _):
        if torchft:
            replicas.start_together(["r0", "r1"], torchft_replica,
                                    {f"r{i}": (2, i) for i in (0, 1)})
        else:
            replicas.start_together(["r0", "r1"])
        assert replicas.supervise(300) == {"r0": 0, "r1": 0}, replicas.outputs()
        events = replicas.events()
    times = [e["time"] for e in events if e["name"] == "r0" and
             e.get("decision") == "commit" and e["step"] >= WARMUP]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def first(replicas: Replicas, names: set[str], what: str, step: int = 0,
          after: float = 0.0, size: int = 1) -> dict | None:
    """The first event `what` ("attempt", or "commit": a decision of a quorum of at least size
    participants, in which the replica took part: a torchft replica that heals sends zeros)
    of one of names at step or later, logged after the time `after`."""
    for e in replicas.events():
        if e["name"] in names and e["time"] > after and e.get("step", 0) >= step and (
                e["event"] == what or e.get("decision") == what and e["size"] >= size
                and e.get("participating", True)):
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
