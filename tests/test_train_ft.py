"""Training that never stops (chapter 13): replicas of train_ft under failures drawn by
hypothesis keep every sample and end where one uninterrupted process ends.

A schedule draws 2-4 replicas and 1-2 failures: which replica, at which step, in which phase
(before its quorum request, in forward/backward, during the allreduce, between the allreduce
and the vote, while it serves a recovery), killed (SIGKILL; started again or not) or stopped
and continued after a pause shorter or longer than the heartbeat timeout; two failures may
strike at the same moment. The failures are injected inside the replica
(ft_runs.replica_with_faults). An explicit example adds a torn allreduce: it ends on the
others and fails on one member alone, whose vote must still abort the step for all.
The property, from what each replica logged before acting: no survivor's process restarts;
every step is committed exactly once (twice only if every member of its quorum died and a
checkpoint was used), by members whose samples are disjoint and make up global batch s, and
every member of an attempt acts on the same decision; the final parameters are within 1e-12
of one uninterrupted process; a recovered replica's state is its source's, bitwise; nothing
is left running, and the run ends within BOUND_S.

CI runs a few derandomized schedules (several failures each); DPCOURSE_HYPOTHESIS_EXAMPLES=N
runs N random ones (tests/test_differential.py's `examples`).
"""
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Callable

import psutil
import pytest
import torch
from hypothesis import assume, example, given, note
from hypothesis import strategies as st

from dpcourse import train_ft
from dpcourse.elastic import rank_indices
from dpcourse.experiments.ft_runs import (EXACT, Replicas, audit, one_process_run,
                                          read_events, replica_with_faults)
from dpcourse.experiments.nodes import free_port
from dpcourse.lighthouse import Lighthouse, Rules
from dpcourse.recovery import digest
from test_differential import examples

STEPS, G, N = 40, 22, 220  # 10 global batches per epoch, 4 epochs; 3 or 4 members: uneven
FLAGS = ["--steps", str(STEPS), "--global-batch-size", str(G), "--train-size", str(N),
         "--timeout", "2", "--checkpoint-every", "6", *EXACT]  # 40 % 6: the end writes alone
RULES = Rules(min_replicas=1, join_timeout=0.3, heartbeat_timeout=1.0)
PHASES = ("quorum", "forward", "allreduce", "vote", "serve")
BOUND_S = 90.0  # start-up, 16 steps, and per failure a heartbeat timeout, 2 collective
# timeouts and a restart, with room for a loaded CI machine
CLOSE = 1e-12


def flags(folder: Path) -> list[str]:
    return [*FLAGS, "--checkpoint", str(folder / "ckpt.pt"), "--digest-steps"]


@st.composite
def schedules(draw) -> dict:
    """Replicas, and 1-2 failures; the second may strike with the first (two at once)."""
    replicas = draw(st.integers(2, 4))
    failures = []
    for i in range(draw(st.integers(1, 2))):
        at_once = i == 1 and draw(st.booleans())
        how = draw(st.sampled_from(["kill", "stop"]))
        failures.append({
            "replica": draw(st.integers(0, replicas - 1)),
            "step": failures[0]["step"] if at_once else draw(st.integers(1, STEPS // 2)),
            "phase": failures[0]["phase"] if at_once else draw(st.sampled_from(PHASES)),
            "how": how,
            "pause": draw(st.sampled_from([0.4, 2.5])) if how == "stop" else None,
            "restart": draw(st.booleans()) if how == "kill" else False})
    killed = {f["replica"] for f in failures if f["how"] == "kill" and not f["restart"]}
    assume(len(killed) < replicas)  # someone must be left to finish
    return {"replicas": replicas, "failures": failures}


def run_schedule(folder: Path, schedule: dict,
                 report: Callable[[str], None] = note) -> tuple[dict, list[dict], float]:
    """Run it: the exit codes by name, every event logged, the seconds it took; the
    replicas' outputs reported (to hypothesis, by default)."""
    names = [f"r{i}" for i in range(schedule["replicas"])]
    faults = {name: [f for f in schedule["failures"] if f["replica"] == i]
              for i, name in enumerate(names)}
    started = time.monotonic()
    with Replicas(folder, flags(folder), RULES) as replicas:
        codes = replicas.run(faults, BOUND_S)
        report(replicas.outputs())
        processes = {n: [p.pid for p in replicas.procs[n]] for n in names}
    running = [pid for pids in processes.values() for pid in pids if psutil.pid_exists(pid)
               and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not running, f"processes {running} of the run are still running"
    return {"codes": codes, "processes": processes}, replicas.events(), \
        time.monotonic() - started


def assert_every_sample_kept(events: list[dict], schedule: dict) -> None:
    """Every step committed exactly once (or redone from a checkpoint after its whole quorum
    died), by members whose samples are disjoint and make up the global batch, all members
    acting on one decision."""
    decisions, attempts = defaultdict(set), defaultdict(list)
    for e in events:
        if e["event"] == "decision" and e["decision"] != "unknown":  # unknown: no decision
            decisions[e["qid"], e["step"]].add(e["decision"])
        elif e["event"] == "attempt":
            attempts[e["qid"], e["step"]].append(e)
    assert all(len(d) == 1 for d in decisions.values()), (
        f"members of one attempt acted on different decisions: "
        f"{ {k: d for k, d in decisions.items() if len(d) > 1} }")
    ended = {e["replica"] for e in events if e["event"] == "end"}
    for step in range(STEPS):
        commits = sorted(qid for (qid, s), d in decisions.items() if s == step and "commit" in d)
        assert commits, f"step {step} was never committed"
        for earlier in commits[:-1]:  # a redo: only if every member that committed it died
            members = {e["replica"] for e in attempts[earlier, step]}
            assert not members & ended, (
                f"step {step} committed in quorums {commits}, though {members & ended} of "
                f"quorum {earlier} lived on")
        for qid in commits:
            tried = attempts[qid, step]
            samples = [i for e in tried for i in e["samples"]]
            assert len(samples) == len(set(samples)), f"step {step}: a sample taken twice"
            assert sorted(samples) == sorted(rank_indices(N, G, 1, 0, step, 0)), (
                f"step {step}, quorum {qid}: the members' samples are not global batch {step}")


def failure(replica: int, step: int, phase: str, how: str, pause: float | None = None,
            restart: bool = False, seconds: float | None = None) -> dict:
    return {"replica": replica, "step": step, "phase": phase, "how": how, "pause": pause,
            "restart": restart, "seconds": seconds}


def assert_members_agree_after_every_commit(events: list[dict]) -> None:
    """After each step a quorum committed, every member that committed it holds the same
    state, bitwise (a step redone in a later quorum may differ: another cut of the batch)."""
    states = defaultdict(dict)
    for e in events:
        if e["event"] == "committed":
            states[e["qid"], e["step"]][e["replica"]] = e["digest"]
    assert states, "no committed step logged its digest (--digest-steps)"
    for (qid, step), by_replica in states.items():
        assert len(set(by_replica.values())) == 1, (
            f"quorum {qid}, step {step}: the members hold different states "
            f"{ {name: d[:12] for name, d in by_replica.items()} }")


@examples(in_ci=1)
@given(schedule=schedules())
@example(schedule={"replicas": 3, "failures": [  # two killed at once, two started at once
    failure(0, 5, "allreduce", "kill", restart=True),
    failure(2, 5, "allreduce", "kill", restart=True)]})
@example(schedule={"replicas": 3, "failures": [  # a zombie; its source killed mid-recovery
    failure(1, 4, "forward", "stop", pause=2.5), failure(0, 4, "serve", "kill", restart=True)]})
@example(schedule={"replicas": 2, "failures": [  # every member of a quorum killed
    failure(0, 9, "vote", "kill", restart=True), failure(1, 9, "vote", "kill", restart=True)]})
@example(schedule={"replicas": 3, "failures": [  # a torn allreduce: r1's fails 1 s after the
    failure(1, 6, "allreduce", "fail", seconds=1.0)]})  # others' ended (a partial vote commits)
def test_replicas_keep_every_sample_and_end_as_one_process_whatever_fails(schedule):
    note(f"schedule: {schedule}")
    with tempfile.TemporaryDirectory(prefix="ft-") as folder:
        run, events, seconds = run_schedule(Path(folder), schedule)
        checkpoint = torch.load(Path(folder) / "ckpt.pt", weights_only=True)
    lost = {f"r{f['replica']}" for f in schedule["failures"]
            if f["how"] == "kill" and not f["restart"]}
    for name, code in run["codes"].items():  # survivors end cleanly, in their first process
        assert code == 0 or (code == -signal.SIGKILL and name in lost), f"{name} exited {code}"
        if len(run["processes"][name]) == 1 and code == 0:
            pids = {e["pid"] for e in events if e["name"] == name}
            assert pids == {run["processes"][name][0]}, f"{name} restarted: pids {pids}"
    assert any(code == 0 for code in run["codes"].values())
    assert seconds < BOUND_S
    assert_every_sample_kept(events, schedule)
    assert_members_agree_after_every_commit(events)
    served = {(e["qid"], e["to"]): e["digest"] for e in events if e["event"] == "serve"}
    for heal in (e for e in events if e["event"] == "heal"):
        assert served[heal["qid"], heal["replica"]] == heal["digest"], (
            f"{heal['replica']} does not hold its source's state after healing")
    ends = {e["digest"] for e in events if e["event"] == "end"}
    assert ends == {digest({k: checkpoint[k] for k in ("model", "optimizer", "step", "qid")})}
    assert checkpoint["step"] == STEPS
    _, reference = one_process_run(FLAGS)
    gap = max((checkpoint["model"][k] - reference[k]).abs().max().item() for k in reference)
    aborts = {(e["qid"], e["step"]) for e in events if e.get("decision") == "abort"}
    print(f"\n{schedule}: {len(aborts)} attempt(s) aborted, "
          f"{sum(e['event'] == 'heal' for e in events)} recovery(ies), exit codes "
          f"{run['codes']}, {seconds:.1f} s, gap {gap:.1e}")
    assert gap <= CLOSE, f"the parameters end {gap:.1e} from one uninterrupted process"


def test_a_live_member_descheduled_past_the_heartbeat_timeout_is_left_out_and_heals_back(
        tmp_path):
    """A loaded machine: r0, about to ask for its quorum, gets no CPU (a stop stands in)
    until the others have committed 3 steps. The lighthouse leaves it out (its join timeout,
    then its heartbeat timeout); once r0 runs again it is behind and heals from a member, in
    its first process; every step is still committed once, with the whole global batch."""
    schedule = {"replicas": 3, "failures": [{"replica": 0, "step": 8, "phase": "quorum",
                                             "how": "stop", "resume_after": 3}]}
    run, events, _ = run_schedule(tmp_path, schedule, report=print)  # shown if it fails
    assert run["codes"] == {"r0": 0, "r1": 0, "r2": 0}
    assert len(run["processes"]["r0"]) == 1, "r0 was started again"
    left_out = [e for e in events if e["event"] == "attempt" and e["name"] != "r0"
                and len(e["samples"]) == G // 2]
    assert left_out, "no quorum formed without r0"
    assert any(e["event"] == "heal" and e["name"] == "r0" for e in events), "r0 never healed"
    assert_every_sample_kept(events, schedule)
    assert_members_agree_after_every_commit(events)


# --- timeouts, the lighthouse lost, torchrun ---

def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.02)
    return found


@pytest.mark.parametrize("delay", [0.3, 2.5])  # --timeout 1.5: a second's margin either way
def test_a_member_slower_than_the_timeout_stops_the_run_naming_the_step(delay, tmp_path):
    slow = [{"phase": "forward", "step": 3, "how": "delay", "seconds": delay}]
    with Replicas(tmp_path, [*flags(tmp_path), "--timeout", "1.5"], RULES) as replicas:
        replicas.start_together(["r0", "r1"], replica_with_faults, {"r0": ([],), "r1": (slow,)})
        codes = replicas.supervise(60)
        out = replicas.outputs()
    if delay < 1:  # below --timeout: the others wait for it in the allreduce
        assert codes == {"r0": 0, "r1": 0}, out
        assert not [e for e in replicas.events() if e.get("decision") == "abort"]
    else:  # above: every attempt at step 3 aborts, and after 3 every replica gives up
        assert codes == {"r0": 1, "r1": 1}, out
        assert out.count("step 3 aborted 3 times, in quorums [") == 2, out


def test_a_lost_lighthouse_ends_every_replica_naming_it_and_the_checkpoint_resumes(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    lighthouse = [sys.executable, "-m", "dpcourse.lighthouse", "--port", address.split(":")[1],
                  "--join-timeout", "0.3", "--heartbeat-timeout", "1"]
    checkpoint = tmp_path / "ckpt.pt"
    first = subprocess.Popen(lighthouse, stdout=subprocess.DEVNULL)
    try:
        with Replicas(tmp_path, flags(tmp_path), address=address) as replicas:
            replicas.start_together(["r0", "r1"])
            wait_for(checkpoint.exists, 60, "the first checkpoint")
            first.kill()
            killed = time.monotonic()
            codes = replicas.supervise(30)
            seconds = time.monotonic() - killed
            out = replicas.outputs()
        assert codes == {"r0": 1, "r1": 1}, out
        assert out.count(f"the lighthouse at {address} is gone") == 2, out
        print(f"\nthe replicas ended {seconds:.2f} s after the lighthouse")
        assert seconds < 2 + 3, f"the replicas took {seconds:.1f} s to end"  # --timeout 2
        saved = torch.load(checkpoint, weights_only=True)["step"]
        with Replicas(tmp_path, flags(tmp_path), RULES) as replicas:  # a new lighthouse
            replicas.start_together(["r0", "r1"])
            assert replicas.supervise(60) == {"r0": 0, "r1": 0}, replicas.outputs()
    finally:
        first.kill()
        first.wait()
    starts = [e for e in read_events(tmp_path) if e["event"] == "start"]
    assert [e["step"] for e in starts[2:]] == [saved, saved]
    _, reference = one_process_run(FLAGS)
    final = torch.load(checkpoint, weights_only=True)["model"]
    assert max((final[k] - reference[k]).abs().max().item() for k in reference) <= CLOSE


def test_under_torchrun_a_dead_replica_is_started_again_and_heals_from_a_live_peer(tmp_path):
    """README's commands: the lighthouse apart, each replica under torchrun --max-restarts
    (--min-replicas 2: the survivor waits for the replica torchrun starts again). No durable
    checkpoint after step 0: a restart that found one at the survivor's very step (every 6)
    would be up to date, with nothing to heal."""
    port = free_port()
    lighthouse = subprocess.Popen([sys.executable, "-m", "dpcourse.lighthouse", "--port",
                                   str(port), "--min-replicas", "2"], stdout=subprocess.DEVNULL)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=1", "--max-restarts=1", "-m", "dpcourse.train_ft"]
    try:
        with Replicas(tmp_path, [*flags(tmp_path), "--timeout", "5", "--checkpoint-every",
                                 str(STEPS + 1)],
                      address=f"127.0.0.1:{port}") as replicas:
            for name in ("r0", "r1"):
                replicas.start(name, command=torchrun)

            def worker_of_r1_at_step_10():
                steps = [e for e in replicas.events() if e["name"] == "r1" and e["event"] ==
                         "decision" and e["step"] >= 10]
                return steps and steps[0]["pid"]
            worker = wait_for(worker_of_r1_at_step_10, 120, "r1's worker at step 10")
            os.kill(worker, signal.SIGKILL)
            codes = replicas.supervise(120)
            events = replicas.events()
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert codes == {"r0": 0, "r1": 0}, replicas.outputs()
    r1 = [e for e in events if e["name"] == "r1"]
    assert len({e["pid"] for e in r1}) == 2  # torchrun started it again
    assert len({e["pid"] for e in events if e["name"] == "r0"}) == 1  # r0 went on
    healed = [e for e in r1 if e["event"] == "heal" and e["pid"] != worker]
    assert healed and healed[0]["source"].startswith("r0-")
    assert len({e["digest"] for e in events if e["event"] == "end"}) == 1  # both end equal


def test_timeouts_must_nest(tmp_path):
    with Lighthouse(rules=RULES) as lighthouse:
        args = train_ft.parse_args(["--lighthouse", lighthouse.address, "--timeout", "2",
                                    "--quorum-timeout", "5", *FLAGS[:6], "--data", "synthetic"])
        with pytest.raises(ValueError, match=r"--quorum-timeout 5 must exceed .* \(5.3 s\)"):
            train_ft.train(args)


def test_a_checkpoint_is_never_written_over_a_later_step(tmp_path):
    """Two quorums' first members may write at once (one back from a pause): the later step
    stays; another run's arguments are refused."""
    args = train_ft.parse_args(["--lighthouse", "unused:0", *FLAGS])
    path = tmp_path / "ckpt.pt"

    def state(step: int) -> dict:
        return {"model": {"w": torch.full((2,), float(step))}, "optimizer": {}, "step": step,
                "qid": step}
    assert train_ft.write_checkpoint(path, args, state(8))
    assert not train_ft.write_checkpoint(path, args, state(4))
    assert not train_ft.write_checkpoint(path, args, state(8))
    assert train_ft.read_checkpoint(path, args)["model"]["w"][0] == 8
    assert train_ft.write_checkpoint(path, args, state(12))
    assert train_ft.read_checkpoint(path, args)["step"] == 12
    other = train_ft.parse_args(["--lighthouse", "unused:0", *FLAGS, "--lr", "0.1"])
    with pytest.raises(RuntimeError, match="lr 0.05 there, 0.1 here"):
        train_ft.read_checkpoint(path, other)


def test_a_replica_stuck_past_its_watchdog_exits_saying_so():
    stuck = subprocess.run([sys.executable, "-c", "import time\nfrom dpcourse.train_ft import "
                            "Watchdog\nWatchdog(0.5)\ntime.sleep(30)"], capture_output=True,
                           text=True, timeout=60)
    assert stuck.returncode == 3 and "watchdog: no step attempt ended in 0.5 s" in stuck.stdout


def test_closed_replicas_leave_no_semaphore_behind(tmp_path, monkeypatch):
    """start_together's barrier holds named semaphores (/dev/shm/sem.mp-*): close() must let
    them go, or a notebook's kernel, ended by its process group, leaves them behind."""
    names, register = [], resource_tracker.register
    monkeypatch.setattr(resource_tracker, "register",
                        lambda name, kind: (names.append(name), register(name, kind)))
    with Replicas(tmp_path, [], RULES) as replicas:
        replicas.start_together(["r0", "r1"], target=print)  # prints its arguments, returns
    assert names, "no semaphore was made: the test checks nothing"
    left = [n for n in names if os.path.exists(f"/dev/shm/sem.{n.lstrip('/')}")]
    assert not left, f"left behind: {left}"


# --- checkpoints that cannot end the run ---

def test_a_checkpoint_that_cannot_be_written_is_refused_at_start_naming_it(tmp_path):
    for path, why in [(tmp_path / "missing" / "ckpt.pt", "No such file or directory"),
                      (tmp_path, "is a folder: name a file in it")]:
        args = train_ft.parse_args(["--lighthouse", "unused:0", *FLAGS, "--checkpoint",
                                    str(path)])
        with pytest.raises(ValueError, match=f"checkpoint {path} .*{why}"):
            train_ft.train(args)  # before any lighthouse is asked


def test_a_full_disk_names_the_checkpoint_and_the_cause(tmp_path):
    """A file size limit stands in for a full disk: torch.save writing to the file itself
    said only "[enforce fail at inline_container.cc:...] unexpected pos"."""
    path = tmp_path / "ckpt.pt"
    script = ("import resource, sys, torch\nfrom pathlib import Path\n"
              "from dpcourse.resume import write_atomically\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))\n"
              "try:\n    write_atomically(Path(sys.argv[1]), {'w': torch.zeros(1 << 16)})\n"
              "except OSError as error:\n    print(error)\n")
    run = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.stdout.strip() == f"[Errno 27] {path} not written: File too large", run.stderr
    assert list(tmp_path.iterdir()) == []  # no file, and no temporary one


def test_a_checkpoint_that_fails_later_ends_no_replica(tmp_path):
    """Its folder removed mid-run: every later write fails, is logged naming the path, and
    the run commits every step (before, the quorum's first member died at each write)."""
    path = tmp_path / "shared" / "ckpt.pt"
    path.parent.mkdir()
    slow = [{"phase": "forward", "step": 4, "how": "delay", "seconds": 1.0}]
    run_flags = [*FLAGS, "--steps", "12", "--checkpoint", str(path), "--checkpoint-every", "2"]
    with Replicas(tmp_path, run_flags, RULES) as replicas:
        replicas.start_together(["r0", "r1"], replica_with_faults, {"r0": ([],), "r1": (slow,)})
        wait_for(path.exists, 60, "the first checkpoint")
        shutil.rmtree(path.parent)  # while r1 sleeps in step 4: no checkpoint after 2
        codes = replicas.supervise(60)
        events, out = replicas.events(), replicas.outputs()
    assert codes == {"r0": 0, "r1": 0}, out
    failed = [e for e in events if e["event"] == "checkpoint failed"]
    assert [e["step"] for e in failed] == [4, 6, 8, 10, 12], out  # from r1's pause on
    assert all(e["path"] == str(path) and "No such file or directory" in e["error"]
               for e in failed)
    assert audit(events)["steps committed"] == 12


def test_a_replica_started_after_the_run_ended_trains_nothing(tmp_path):
    """It is told the run ended, says so and exits 0, instead of training the run again
    alone (the lighthouse logged a "redone" line per step of it)."""
    run_flags = [*FLAGS, "--steps", "6"]
    with Replicas(tmp_path, run_flags, RULES) as replicas:
        replicas.start_together(["r0", "r1"])
        assert replicas.supervise(60) == {"r0": 0, "r1": 0}, replicas.outputs()
        replicas.start("r2")
        assert replicas.supervise(60)["r2"] == 0, replicas.outputs()
        said = replicas.outputs()
        told = [what for _, what in replicas.lighthouse.events if "ended" in what]
    late = [e["event"] for e in replicas.events() if e["name"] == "r2"]
    assert late == ["start", "late"]
    assert ("the run ended at step 6: its replicas committed every step and left, before "
            "this replica took part: nothing to train") in said
    assert len(told) == 1 and "r2-" in told[0] and "redone" not in said


def test_two_writers_never_put_an_earlier_step_over_a_later_one(tmp_path, monkeypatch):
    """Two quorums' first members (one back from a pause) write at once: the one with step 8
    checked the file first, then the one with step 12 wrote; 12 stays."""
    args = train_ft.parse_args(["--lighthouse", "unused:0", *FLAGS])
    path, checked, go = tmp_path / "ckpt.pt", threading.Event(), threading.Event()
    write = train_ft.resume.write_atomically

    def slow_write(to: Path, value: dict) -> None:
        if value["step"] == 8:  # it has checked the file; it writes once told to go
            checked.set()
            go.wait(10)
        write(to, value)
    monkeypatch.setattr(train_ft.resume, "write_atomically", slow_write)
    state = lambda step: {"model": {}, "optimizer": {}, "step": step, "qid": 1}  # noqa: E731
    earlier = threading.Thread(target=train_ft.write_checkpoint, args=(path, args, state(8)))
    earlier.start()
    checked.wait(10)
    later = threading.Thread(target=train_ft.write_checkpoint, args=(path, args, state(12)))
    later.start()
    later.join(0.5)  # it waits for the lock (without it, it writes 12 now)
    go.set()
    for thread in (earlier, later):
        thread.join(10)
    assert train_ft.read_checkpoint(path, args)["step"] == 12


def test_temporary_files_of_killed_writers_do_not_pile_up(tmp_path):
    args = train_ft.parse_args(["--lighthouse", "unused:0", *FLAGS])
    path = tmp_path / "ckpt.pt"
    for pid in (101, 102, 103):  # what three writers SIGKILLed mid-write left
        (tmp_path / f".ckpt.pt.{pid}-0123abcd.tmp").write_bytes(b"cut short")
    train_ft.write_checkpoint(path, args, {"model": {}, "optimizer": {}, "step": 2, "qid": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.pt.lock", "ckpt.pt"]


def test_the_same_data_named_by_env_or_flag_is_one_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DPCOURSE_DATA", "synthetic")
    by_flag = train_ft.parse_args(["--lighthouse", "unused:0", *FLAGS, "--data", "synthetic"])
    by_env = train_ft.parse_args(["--lighthouse", "unused:0", *FLAGS])
    assert train_ft.run_of(by_flag) == train_ft.run_of(by_env)
    path = tmp_path / "ckpt.pt"
    train_ft.write_checkpoint(path, by_flag, {"model": {}, "optimizer": {}, "step": 2, "qid": 1})
    assert train_ft.read_checkpoint(path, by_env)["step"] == 2  # was refused: None vs synthetic


# --- a long run: what the lighthouse keeps stays flat ---

def test_a_long_run_with_restarts_keeps_the_lighthouse_s_store_and_polling_flat(tmp_path):
    """300 steps of 3 replicas with a global batch of 2 (the third takes no sample), r1
    killed and started again every 50, r2 stopped for longer than forget_after (forgotten,
    then back): the store's keys stay under a bound all along, the lighthouse polls only the
    replicas alive lately, and once every replica has left and the dead are forgotten the
    store holds only the lighthouse's own keys. (Before: two vote keys per step, every id
    ever started polled at every look, and a quorum larger than G ended every replica.) The
    quorum round trip is printed, not checked."""
    rules = Rules(join_timeout=0.1, heartbeat_timeout=0.5, forget_after=1.5)
    run_flags = ["--steps", "300", "--global-batch-size", "2", "--train-size", "64",
                 "--timeout", "2", "--digest-steps"]
    kills = [{"phase": "allreduce", "step": s, "how": "kill", "restart": True}
             for s in (50, 100, 150, 200, 250)]
    stop = [{"phase": "forward", "step": 120, "how": "stop", "pause": 3.0}]
    seen, running = [], threading.Event()
    with Replicas(tmp_path, run_flags, rules) as replicas:
        store, tracker = replicas.lighthouse.store, replicas.lighthouse.tracker

        def watch() -> None:
            while not running.wait(0.05):
                seen.append((time.time(), store.num_keys(), len(tracker.last_beat)))
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            codes = replicas.run({"r0": [], "r1": kills, "r2": stop}, timeout=120)
        finally:
            running.set()
            watcher.join()
        out, events = replicas.outputs(), replicas.events()
        wait_for(lambda: store.num_keys() <= 5, 10, "the dead replicas to be forgotten")
        left = set(store.list_keys()) - {"lh/wake"}
        forgotten = [what for _, what in replicas.lighthouse.events if "forgot" in what]
        killed = [t for t, _, what in replicas.signals if what == "exited -9"]
    assert codes == {"r0": 0, "r1": 0, "r2": 0}, out
    summary = audit(events)
    assert summary["steps committed"] == 300 and summary["samples per step"] == [2], summary
    assert summary["one decision per attempt"] and summary["final states"] == 1, summary
    assert any("forgot r2-" in what for what in forgotten), forgotten  # and it came back
    keys, polled = max(n for _, n, _ in seen), max(n for _, _, n in seen)
    assert keys <= 60, f"the store held up to {keys} keys"
    for t, _, n in seen:  # the 3 replicas, and those killed less than forget_after ago
        recent = sum(t - rules.forget_after - 0.5 < k <= t for k in killed)
        assert n <= 3 + recent, f"{t - killed[0]:.2f} s: {n} replicas polled, {recent} dead"
    assert left == {"lh/joins", "lh/settings", "lh/status", "lh/run"}, left
    r0 = [e["quorum_s"] * 1e3 for e in events if e["event"] == "attempt" and
          e["name"] == "r0"]
    print(f"\nup to {keys} keys and {polled} replicas polled; r0's quorum round trip, median "
          f"of its first 50 steps {statistics.median(r0[:50]):.2f} ms, last 50 "
          f"{statistics.median(r0[-50:]):.2f} ms")
