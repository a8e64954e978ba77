#!/usr/bin/env python3
"""Plant one-line bugs in the hand-built parts, one at a time, and run that part's tests:
every bug must make them fail. A suite is as good as the bugs it catches.

    .venv/bin/python tools/plant_bugs.py            # every bug (about 20 minutes here)
    .venv/bin/python tools/plant_bugs.py --list     # the bugs and their tests
    .venv/bin/python tools/plant_bugs.py shm zero   # the bugs whose name starts so

Each bug is planted in a copy of the working tree (in a temporary folder, removed after), so
the checkout is never touched and others may keep working in it. Prints one row per bug:
caught (with the first failing test) or NOT CAUGHT; exits non-zero if any was not caught.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".venv", ".git", "build", "__pycache__", ".pytest_cache", "data")


@dataclass
class Bug:
    name: str
    file: str
    right: str  # a line of the file, exactly once in it
    wrong: str  # what it becomes
    tests: list[str]  # pytest arguments: the part's tests


BUGS = [
    Bug("ddp: buffers never broadcast after construction", "dpcourse/ddp.py",
        "        if self.broadcast_buffers and self._buffers_behind and self.world > 1:",
        "        if self.broadcast_buffers and False:",
        ["tests/test_ddp.py", "tests/test_differential.py", "-k",
         "frozen_parameter_and_buffer or scratch_ddp_trains"]),
    Bug("ddp: a no_grad forward cancels the pending sync", "dpcourse/ddp.py",
        "        if not torch.is_grad_enabled():  # as torch: no backward follows, nothing to prepare",
        "        if not torch.is_grad_enabled() and not setattr(self, '_syncing', False):",
        ["tests/test_ddp.py"]),
    Bug("ddp: buckets in registration order, not reversed", "dpcourse/ddp.py",
        "    for p in reversed(params):",
        "    for p in params:",
        ["tests/test_ddp.py"]),
    Bug("ddp: end of backward queued at the first gradient, not from the output",
        "dpcourse/ddp.py",
        "        return _through_end_of_backward(out, self) if self._syncing else out",
        "        return out",
        ["tests/test_ddp.py", "-k", "checkpointing"]),
    Bug("ddp: find_unused_parameters still averages zeros into an unused layer",
        "dpcourse/ddp.py",
        "            if users == 0:",
        "            if users < 0:",
        ["tests/test_ddp.py", "-k", "no_rank_uses"]),
    Bug("ddp: find_unused_parameters forgets the uses under no_sync", "dpcourse/ddp.py",
        "                for b in self.buckets for p in b.params if p not in self._used}",
        "                for b in self.buckets for p in b.params if p not in self._ready}",
        ["tests/test_ddp.py", "-k", "no_rank_uses"]),
    Bug("fsdp: a backward overwrites .grad instead of adding", "dpcourse/fsdp.py",
        "                unit.shard.grad += average",
        "                unit.shard.grad.copy_(average)",
        ["tests/test_fsdp.py"]),
    Bug("fsdp: gradients summed over the ranks, not averaged", "dpcourse/fsdp.py",
        "            average = future.wait().to(unit.shard.dtype) / self.world",
        "            average = future.wait().to(unit.shard.dtype)",
        ["tests/test_fsdp.py"]),
    Bug("zero: no rank takes the others' updated parameters", "dpcourse/zero.py",
        "                if rank != self.rank:",
        "                if rank == self.rank:",
        ["tests/test_zero.py"]),
    Bug("compression: PowerSGD's P not orthogonalised", "dpcourse/compression.py",
        "        ps = [torch.linalg.qr(p).Q for p in sums]  # the sum's: scale does not matter to QR",
        "        ps = list(sums)",
        ["tests/test_compression.py"]),
    Bug("local_sgd: pseudo-gradients summed, not averaged", "dpcourse/local_sgd.py",
        "        flat = torch.cat([deltas, *(b.reshape(-1) for b in floats)]).div_(world)",
        "        flat = torch.cat([deltas, *(b.reshape(-1) for b in floats)])",
        ["tests/test_local_sgd.py"]),
    Bug("p2p: the ring receives the chunk it sends", "dpcourse/p2p.py",
        "    return (rank - step - 1) % world, (rank - step - 2) % world",
        "    return (rank - step - 1) % world, (rank - step - 1) % world",
        ["tests/test_p2p.py"]),
    Bug("shm: the reduce skips a third rank's part", "dpcourse/shm.py",
        "        for part in parts[2:]:",
        "        for part in parts[3:]:",
        ["tests/test_shm.py"]),
    Bug("shm: the reduce adds its own part first, not in rank order", "dpcourse/shm.py",
        "                 for q, s in enumerate(slices)]",
        "                 for q, s in sorted(enumerate(slices), key=lambda p: p[0] != self.rank)]",
        ["tests/test_shm.py"]),
    Bug("shm: an arrival wakes nobody", "dpcourse/shm.py",
        "        futex_wake(self._counters[self.rank])",
        "        pass",
        ["tests/test_shm.py", "-k", "late_rank"]),
    Bug("futex: the wake is sent as another wait", "dpcourse/futex.py",
        "FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE_FLAG: the word is shared by processes",
        "FUTEX_WAIT, FUTEX_WAKE = 0, 0",
        ["tests/test_futex.py"]),
    Bug("train_ft: one replica commits a slightly different update", "dpcourse/train_ft.py",
        "                replica.commit(summed[:-1], quorum.id)",
        "                replica.commit(summed[:-1] * (1 + 1e-6 * self.membership.replica_id"
        ".startswith('r1')), quorum.id)",
        ["tests/test_train_ft.py", "-k", "whatever_fails"]),
    Bug("elastic: reshard pads for the old world size", "dpcourse/elastic.py",
        "    padded = torch.zeros(padded_numel(numel, world), dtype=whole.dtype)",
        "    padded = torch.zeros(padded_numel(numel, len(shards)), dtype=whole.dtype)",
        ["tests/test_exercises_12.py", "tests/test_elastic.py", "-k",
         "re_divided or reshard or rank_indices"]),
    Bug("elastic: every epoch shuffled from one generator (seed, not seed + epoch)",
        "dpcourse/elastic.py",
        "    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))",
        "    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))",
        ["tests/test_exercises_12.py", "tests/test_elastic.py", "-k",
         "same_global_batches or rank_indices"]),
    Bug("elastic: every rank takes rank 0's re-cut optimizer shard", "dpcourse/elastic.py",
        "        return reshard([state[\"state\"][i][key] for state in states], numels[i], world)[rank]",
        "        return reshard([state[\"state\"][i][key] for state in states], numels[i], world)[0]",
        ["tests/test_elastic.py", "-k", "re_divided"]),
    Bug("resume: each rank decides alone whether the checkpoint exists", "dpcourse/resume.py",
        "    dist.broadcast_object_list(found, src=0)  # one answer, not one per node",
        "    found = [path.exists()]",
        ["tests/test_restarts.py", "-k", "cannot_read"]),
    Bug("resume: a fixed temporary file name", "dpcourse/resume.py",
        "    tmp = path.with_name(f\".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp\")",
        "    tmp = path.with_name(path.name + \".tmp\")",
        ["tests/test_restarts.py", "-k", "writers"]),
    # chapter 13: tests/conftest.py runs test_train_ft (the property) first, whatever the order
    Bug("ft: the members' gradient sum divided by their number q, not by G",
        "dpcourse/train_ft.py",
        "                replica.commit(summed[:-1], quorum.id)",
        "                replica.commit(summed[:-1] * args.global_batch_size / quorum.size, "
        "quorum.id)",
        ["tests/test_train_ft.py", "-k", "replicas_keep"]),
    Bug("ft: the written-out global batch divided by the members, not by G",
        "dpcourse/train_ft.py",
        "    return total / global_batch",
        "    return total / members",
        ["tests/test_exercises_13.py", "-k", "package_parts"]),
    Bug("ft: a step commits once all but one member voted (a partial vote)",
        "dpcourse/quorum.py",
        "    if ready and store.add(f\"lh/vote/{quorum_id}/{step}/votes\", 1) == size:",
        "    if ready and store.add(f\"lh/vote/{quorum_id}/{step}/votes\", 1) >= size - 1:",
        ["tests/test_quorum.py", "tests/test_exercises_13.py", "tests/test_train_ft.py", "-k",
         "vote or package_parts or replicas_keep"]),
    Bug("ft: a member behind copies from the least up-to-date one (min, not max)",
        "dpcourse/recovery.py",
        "    current = [i for i, v in enumerate(versions) if v == max(versions)]",
        "    current = [i for i, v in enumerate(versions) if v == min(versions)]",
        ["tests/test_quorum.py", "tests/test_exercises_13.py", "tests/test_train_ft.py", "-k",
         "behind or package_parts or replicas_keep"]),
    Bug("ft: a checkpoint written over a later step (comparison reversed)",
        "dpcourse/train_ft.py",
        "        if held is not None and held[\"step\"] >= state[\"step\"]:",
        "        if held is not None and held[\"step\"] <= state[\"step\"]:",
        ["tests/test_train_ft.py", "-k", "never_written"]),
    Bug("ft: a fast quorum when any previous member asks again, not every one",
        "dpcourse/lighthouse.py",
        "    if previous and all(r in asking for r in previous):",
        "    if previous and any(r in asking for r in previous):",
        ["tests/test_lighthouse.py", "tests/test_exercises_13.py", "-k",
         "not service and not refused"]),
    Bug("ft: the lighthouse takes half of the healthy replicas as a majority",
        "dpcourse/lighthouse.py",
        "    if len(asking) <= len(healthy) // 2:",
        "    if len(asking) < len(healthy) // 2:",
        ["tests/test_lighthouse.py", "tests/test_exercises_13.py", "-k",
         "not service and not refused"]),
    # chapter 13 off the path (issue 40): a run that must not stop, a store that stays flat
    Bug("ft: the end of a run checkpointed only on a multiple of --checkpoint-every",
        "dpcourse/train_ft.py",
        "                                or replica.step == args.steps):",
        "                                or False):",
        ["tests/test_train_ft.py", "-k", "replicas_keep"]),
    Bug("ft: a checkpoint that fails to write ends its replica", "dpcourse/train_ft.py",
        "            except OSError as error:",
        "            except ValueError as error:",
        ["tests/test_train_ft.py", "-k", "fails_later"]),
    Bug("ft: the checkpoint checked and written without the writer lock", "dpcourse/resume.py",
        "            fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes",
        "            pass",
        ["tests/test_train_ft.py", "-k", "two_writers"]),
    Bug("ft: a step's vote never deleted after the next commit", "dpcourse/train_ft.py",
        "        if replica.step >= 2:",
        "        if replica.step < 0:",
        ["tests/test_train_ft.py", "-k", "long_run"]),
    Bug("ft: a quorum's group and last votes kept forever", "dpcourse/lighthouse.py",
        "            if not quorum[\"pending\"]:",
        "            if not quorum[\"pending\"] and False:",
        ["tests/test_lighthouse.py", "tests/test_train_ft.py", "-k",
         "no_member_can_read or long_run"]),
    Bug("ft: a silent replica never forgotten", "dpcourse/lighthouse.py",
        "            if now - beat >= self.rules.forget_after:",
        "            if False:",
        ["tests/test_lighthouse.py", "tests/test_train_ft.py", "-k",
         "forgotten or long_run"]),
    Bug("ft: a replica asking after the run ended trains it again", "dpcourse/lighthouse.py",
        "        if self.ended is not None:",
        "        if False:",
        ["tests/test_lighthouse.py", "tests/test_train_ft.py", "-k", "ended"]),
    Bug("ft: a dead heartbeat goes unnoticed", "dpcourse/quorum.py",
        "        if self.gone:",
        "        if False:",
        ["tests/test_lighthouse.py", "-k", "heartbeat_died"]),
    Bug("ft: an error in the lighthouse's loop leaves it deaf, its store open",
        "dpcourse/lighthouse.py",
        "            self.store = None  # the server goes with its last reference",
        "            pass",
        ["tests/test_lighthouse.py", "-k", "in_process_lighthouse"]),
    Bug("ft: a quorum of more members than G cut as if each had a sample",
        "dpcourse/train_ft.py",
        "    if member >= global_batch:",
        "    if member > global_batch:",
        ["tests/test_train_ft.py", "-k", "long_run"]),
    Bug("torchft: a sample trained twice counted once more than its repeats",
        "dpcourse/experiments/torchft_runs.py",
        '            "repeated": sum(n - 1 for n in trained.values() if n > 1),',
        '            "repeated": sum(n for n in trained.values() if n > 1),',
        ["tests/test_torchft_runs.py", "-k", "sample_use"]),
    Bug("torchft: a healing group's zeros counted as its batch trained",
        "dpcourse/experiments/torchft_runs.py",
        '        return d is not None and d["participating"] and (d["qid"], d["step"]) in committed',
        '        return d is not None and (d["qid"], d["step"]) in committed',
        ["tests/test_torchft_runs.py", "-k", "torn"]),
    Bug("torchft: a torn step's last decision taken for the first",
        "dpcourse/experiments/torchft_runs.py",
        '            decided.setdefault(e["name"], e["decision"])',
        '            decided[e["name"]] = e["decision"]',
        ["tests/test_torchft_runs.py", "-k", "torn_allreduce"]),
    Bug("torchft: every quorum after a kill credited to the join timeout",
        "dpcourse/experiments/torchft_runs.py",
        "    if asked < healthy:",
        "    if asked <= healthy:",
        ["tests/test_torchft_runs.py", "-k", "deciding_rule"]),
    Bug("exercises 13: the shards checked without the run's batches",
        "dpcourse/exercises/ch13.py",
        '        if e["samples"] != batches[e["batch"] % len(batches)]:',
        '        if False:',
        ["tests/test_exercises_13.py", "-k", "torchft_s_shard"]),
    Bug("hsdp: the gradient shards summed across groups, not averaged", "dpcourse/hsdp.py",
        "        return shard_sum.div_(self.size)",
        "        return shard_sum",
        ["tests/test_differential.py", "tests/test_hsdp.py", "-k", "hsdp"]),
    Bug("hsdp: every rank's shard allreduced with the first shard's holders",
        "dpcourse/hsdp.py",
        "    return shard_groups[rank // group_size], replicate_groups[rank % group_size]",
        "    return shard_groups[rank // group_size], replicate_groups[0]",
        ["tests/test_differential.py", "-k", "hsdp"]),
    Bug("ft_groups: shard r allreduced across groups with another index's holders",
        "dpcourse/ft_groups.py",
        '                    f"lh/group/{quorum.id}/shard/{self.rank}", self.store), place,',
        '                    f"lh/group/{quorum.id}/shard/{(self.rank + place) % self.size}", '
        'self.store), place,',
        ["tests/test_ft_groups.py", "-k", "under_torchrun"]),
    Bug("ft_groups: the gradient sums divided by q x g, not by G", "dpcourse/ft_groups.py",
        "        return shard_sum.mul_(self.group_size).div_(self.global_batch)",
        "        return shard_sum.mul_(self.group_size).div_(self.group.size() * self.group_size)",
        ["tests/test_ft_groups.py", "-k", "under_torchrun"]),
    Bug("ft_groups: a healing rank copies another shard", "dpcourse/ft_groups.py",
        '                    f"lh/group/{quorum.id}/shard/{self.rank}", self.store), place,',
        '                    f"lh/group/{quorum.id}/shard/{(self.rank + (place in recovery_plan('
        'quorum.steps, quorum.qids))) % self.size}", self.store), place,',
        ["tests/test_ft_groups.py", "-k", "whatever_fails"]),
    Bug("ft_groups: a group votes before all its ranks are ready (rank 0's readiness)",
        "dpcourse/ft_groups.py",
        "            decision = self.decide(quorum, agree(ready)[0], silences)",
        "            decision = self.decide(quorum, ready, silences)",
        ["tests/test_ft_groups.py", "-k", "whatever_fails"]),
    Bug("local_sgd: the outer step without Nesterov by default", "dpcourse/local_sgd.py",
        "                 nesterov: bool = True) -> None:",
        "                 nesterov: bool = False) -> None:",
        ["tests/test_local_sgd.py", "-k", "outer_step"]),
    Bug("shm: each futex wait gets the whole timeout, not what is left of it",
        "dpcourse/shm.py",
        "                futex_wait(self._counters[q], seen, left)  # returns at once if it moved",
        "                futex_wait(self._counters[q], seen, self.timeout)",
        ["tests/test_shm.py", "-k", "late_rank"]),
]


def plant(tree: Path, bug: Bug) -> None:
    """Replace bug.right by bug.wrong in tree's copy of bug.file (it must be there once)."""
    path = tree / bug.file
    text = path.read_text()
    if text.count(bug.right + "\n") != 1:
        raise SystemExit(f"{bug.name}: the line {bug.right.strip()!r} is not once in "
                         f"{bug.file} any more: update BUGS")
    path.write_text(text.replace(bug.right + "\n", bug.wrong + "\n"))


def run_tests(tree: Path, bug: Bug) -> tuple[bool, str]:
    """(whether the part's tests failed, the first failing test or the summary line)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy's dpcourse, not the checkout's
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0",
                           "-p", "no:cacheprovider", *bug.tests], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = done.stdout.splitlines()
    failed = [line.split()[1] for line in lines if line.startswith("FAILED")]
    return done.returncode != 0, (failed[0] if failed else (lines[-1] if lines else ""))


def main(argv: list[str]) -> int:
    chosen = [b for b in BUGS if not argv or any(b.name.startswith(a) for a in argv)]
    if "--list" in argv:
        for bug in BUGS:
            print(f"{bug.name}\n    {bug.file}: {bug.right.strip()}\n"
                  f"    -> {bug.wrong.strip()}\n    tests: {' '.join(bug.tests)}")
        return 0
    missed = 0
    print(f"{'bug':72s} {'seconds':>7s}  result")
    for bug in chosen:
        with tempfile.TemporaryDirectory(prefix="dpcourse-planted-") as folder:
            tree = Path(folder) / "tree"
            shutil.copytree(ROOT, tree, ignore=SKIP)
            plant(tree, bug)
            start = time.perf_counter()
            caught, said = run_tests(tree, bug)
        missed += not caught
        print(f"{bug.name:72s} {time.perf_counter() - start:7.0f}  "
              f"{'caught: ' + said if caught else 'NOT CAUGHT: ' + said}", flush=True)
    print(f"\n{len(chosen) - missed} of {len(chosen)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
