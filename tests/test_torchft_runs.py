"""Chapter 13 beside torchft 0.2.0: the same failure at the same step, under both (skipped,
saying why, where torchft cannot be installed), and the benchmark's table."""
from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler

from dpcourse import bench, train_ft
from dpcourse.experiments import torchft_runs
from dpcourse.experiments.ft_runs import memberships, one_process_run, replay
from dpcourse.experiments.torchft_runs import kill_and_restart, sample_use

AVAILABLE, WHY = torchft_runs.available()


def test_sample_use_counts_the_places_no_commit_trained_and_those_trained_again():
    expected = Counter({("a", 0, 1): 1, ("a", 0, 2): 1, ("a", 1, 3): 1, ("b", 0, 4): 1})
    trained = Counter({("a", 0, 1): 2, ("a", 0, 2): 2, ("b", 0, 4): 1, ("b", 1, 5): 1})
    assert sample_use(trained, expected) == {"trained": 6, "skipped": 1, "repeated": 2,
                                             "expected": 4}
    assert sample_use(expected, expected) == {"trained": 4, "skipped": 0, "repeated": 0,
                                              "expected": 4}


def scripted_torchft_run():
    """Two groups of 4 samples a step over 3 steps; group b's allreduce at step 1 fails after
    a's finished (a commits, b does not), b heals at step 2 (sends zeros); its loader moved on."""
    batches = {g: torchft_runs.dealt_batches(40, 2, i, 4, 0, 4) for i, g in enumerate("ab")}
    events = []
    for name, plan in (("a", [(0, "commit", True, 1), (1, "commit", True, 1),
                              (2, "commit", True, 2)]),
                       ("b", [(0, "commit", True, 1), (1, "abort", True, 1),
                              (2, "commit", False, 2)])):
        for batch, (step, what, participating, qid) in enumerate(plan):
            events += [{"event": "attempt", "name": name, "replica": name, "batch": batch,
                        "samples": batches[name][batch]},
                       {"event": "decision", "name": name, "replica": name, "batch": batch,
                        "step": step, "qid": qid, "decision": what,
                        "participating": participating}]
    return events, batches


@pytest.mark.skipif(not AVAILABLE, reason=f"torchft is not installed: {WHY}")
def test_a_torn_step_trains_every_participant_s_samples_and_a_healing_group_s_are_skipped():
    events, _ = scripted_torchft_run()
    args = train_ft.parse_args(["--lighthouse", "x:0", "--steps", "3", "--train-size", "40",
                                "--global-batch-size", "8"])
    # b's batch 2 went nowhere (it healed); its batch 1 is in a's committed step
    assert torchft_runs.torchft_sample_use(events, ["a", "b"], args) == {
        "trained": 20, "skipped": 4, "repeated": 0, "expected": 24}


@pytest.mark.skipif(not AVAILABLE, reason=f"torchft is not installed: {WHY}")
@pytest.mark.parametrize("size,groups", [(40, 2), (641, 3), (10, 4)])
def test_torchft_s_loader_deals_every_nth_index_of_torch_s_shuffled_sampler(size, groups):
    """torchft's DistributedSampler for group i of n is torch's with rank i of n (a group of
    one rank): every n-th index of one shuffle, padded from its start; epochs repeat it."""
    for i in range(groups):
        shard = list(DistributedSampler(range(size), num_replicas=groups, rank=i, seed=5))
        dealt = torchft_runs.dealt_batches(size, groups, i, 3, 5, 2 * -(-len(shard) // 3))
        assert sum(dealt, []) == shard + shard
        order = torch.randperm(size, generator=torch.Generator().manual_seed(5)).tolist()
        padded = (order * groups)[:-(-size // groups) * groups]
        assert shard == padded[i::groups]


@pytest.mark.skipif(not AVAILABLE, reason=f"the comparison with torchft is skipped: {WHY}")
def test_the_same_failure_under_torchft_beside_ours(tmp_path):
    """r1 killed at step 10 of 30 and started again, under both: ours keeps every sample and is
    one process replaying its memberships, bitwise; torchft's figures are printed beside."""
    flags = [*torchft_runs.FAILURE_FLAGS, "--steps", "30"]
    _, reference = one_process_run(flags)
    runs = {}
    for name, torchft in (("ours", False), ("torchft 0.2.0", True)):
        folder = tmp_path / name
        folder.mkdir()
        runs[name] = kill_and_restart(folder, [*flags, "--checkpoint", str(folder / "ckpt.pt")],
                                      torchft, 10, torchft_runs.RULES)
        gap = max((runs[name]["final"][k] - reference[k]).abs().max().item() for k in reference)
        print(f"\n{name}: r1 killed at step 10: {runs[name]['samples_skipped']} samples skipped,"
              f" the parameters end {gap:.1e} from one uninterrupted process")
        if not torchft:
            assert runs[name]["samples_skipped"] == 0 and gap <= 1e-12
    replayed = replay(flags, memberships(runs["ours"]["events"]))
    assert all(torch.equal(replayed[k], runs["ours"]["final"][k]) for k in replayed)


def test_the_benchmark_prints_the_issue_s_table_with_each_goal(monkeypatch, capsys):
    measured = {False: {"kill_to_next_commit_s": 1.1, "start_to_first_commit_s": 2.0,
                        "samples_skipped": 0, "samples_repeated": 0, "gap": 2e-15,
                        "replay_gap": 0.0,
                        "failure_free_gap": 3e-15, "runs": 3},
                True: {"kill_to_next_commit_s": 1.0, "start_to_first_commit_s": 5.0,
                       "samples_skipped": 48, "samples_repeated": 20, "gap": 0.5,
                       "runs": 3}}
    monkeypatch.setattr(torchft_runs, "available", lambda: (True, ""))
    monkeypatch.setattr(torchft_runs, "failure_figures",
                        lambda folder, torchft, repeats, command: measured[torchft])
    monkeypatch.setattr(torchft_runs, "steady_step_seconds",
                        lambda folder, torchft: 0.012 if torchft else 0.011)
    monkeypatch.setattr(bench, "compare_ddp", lambda **k: {"ScratchDDP": 64 / 0.010})
    figures = {bench.CHAPTER_12: 9.7}
    bench.bench_never_stops(False, figures)
    out = capsys.readouterr().out
    assert "medians of 3 run(s)" in out and "started as a command (imports included)" in out
    assert "ours <= 1.2x torchft's (met: x1.10), >= 5x faster than chapter 12's (met: x8.8)" \
        in out
    assert "ours <= torchft's (met: x0.40)" in out and out.count("ours 0 (met)") == 2
    assert "torchft with its own sampler" in out
    assert "x1.10" in out and "<= 1.15x (met)" in out
    assert "0.0e+00 from one process replaying its memberships; 2 members, no failure: 3.0e-15" \
        in out
    assert figures["steady_step_s"] == {"ScratchDDP": 0.010, "ours": 0.011,
                                        "torchft 0.2.0": 0.012}
    monkeypatch.setattr(torchft_runs, "available", lambda: (False, "not installed"))
    bench.bench_never_stops(False, {})
    out = capsys.readouterr().out
    assert "torchft: not measured (not installed)" in out and "9.7 s (README)" in out


class ScriptedReplicas:
    """Replicas that start nothing: its events are a script, each seen once its time has
    come (the clock moves on at each reading); signals as Replicas notes them."""

    def __init__(self, script: list[dict]) -> None:
        self.script, self.now, self.signals = script, 0.0, []

    def start_together(self, names, target, extras) -> None:
        pass

    def start(self, name, *target, command=()) -> None:
        self.signals.append((self.now, name, "started"))

    def signal(self, name, sig) -> None:
        self.signals.append((self.now, name, sig.name))

    def current(self, name) -> str:
        return name

    def exit_code(self, proc) -> None:
        return None  # every replica runs on

    def events(self) -> list[dict]:
        self.now += 0.5
        return [e for e in self.script if e["time"] <= self.now]


def test_the_survivors_next_commit_is_of_the_killed_step_or_later():
    """torchft starts its next quorum without waiting: r1 may begin step 12 (and be killed)
    before r0 has logged its commit of step 11, which is no recovery."""
    def commit(name, step, time, size):
        return {"name": name, "event": "decision", "decision": "commit", "step": step,
                "time": time, "size": size}
    replicas = ScriptedReplicas([
        {"name": "r1", "event": "attempt", "step": 12, "time": 0.5},
        commit("r0", 11, 1.2, 2), commit("r0", 12, 2.2, 1), commit("r1", 13, 4.2, 2)])
    figures = torchft_runs.failure_run(replicas, ["r0", "r1"], kill=("r1", 12),
                                       until_joined=True)
    assert figures == {"kill_to_next_commit_s": pytest.approx(2.2 - 0.5),  # not 1.2 - 0.5
                       "start_to_first_commit_s": pytest.approx(4.2 - 2.5)}


def test_a_torn_allreduce_is_redone_by_all_here_and_committed_by_some_groups_under_torchft(
        tmp_path):
    """r1's allreduce fails at step 5 after the others' finished: ours aborts step 5 on every
    member and nobody heals; torchft's r0 and r2 commit it (with r1's gradient), r1 does not
    and heals at the next quorum; each lighthouse's log says why each quorum formed."""
    flags = [*torchft_runs.FAILURE_FLAGS, "--steps", "8"]
    runs = torchft_runs.side_by_side(tmp_path, flags, torchft_runs.RULES, ["r0", "r1", "r2"],
                                     tear=("r1", 5))
    assert torchft_runs.after_torn_step(runs["ours"]["events"], 5) == (
        {"r0": "abort", "r1": "abort", "r2": "abort"}, [])
    assert runs["ours"]["samples_skipped"] == runs["ours"]["samples_repeated"] == 0
    assert any("quorum" in what for _, what in runs["ours"]["lighthouse"])
    if not AVAILABLE:
        pytest.skip(f"torchft's side is skipped: {WHY}")
    assert torchft_runs.after_torn_step(runs["torchft"]["events"], 5) == (
        {"r0": "commit", "r1": "abort", "r2": "commit"}, ["r1"])
    # skipped: r1's and r2's batches at step 0 (init_sync) and r1's at step 6 (it healed)
    assert runs["torchft"]["samples_skipped"] == 3 * (32 // 3)
    assert any("quorum found" in why for _, why in runs["torchft"]["lighthouse"])


@pytest.mark.parametrize("log,rule", [
    ([(1, "no quorum yet: 2 of 3 healthy replicas asked: waiting up to 0.5 s for the others"),
      (2, "quorum 17: ['r0', 'r2'] (2 of 3 healthy replicas asked; members changed)")],
     "the join timeout"),
    ([(1, "no quorum yet: 1 of 2 healthy replicas asked: not a majority"),
      (2, "quorum 18: ['r0'] (1 of 1 healthy replicas asked; members changed)")],
     "the heartbeat timeout"),
    ([(1, "New quorum not ready, only have 1 participants, need at least half of 2 healthy "
          "workers [1/1 participants healthy][2 heartbeating][shrink_only=false]"),
      (2, "Valid quorum found [2/2 participants healthy][2 heartbeating][shrink_only=false]")],
     "a request"),
    ([(1, "Valid quorum with 2 participants, waiting for 1 healthy but not participating "
          "stragglers due to join timeout [2/2 participants healthy][3 heartbeating]"),
      (2, "Valid quorum found [2/2 participants healthy][3 heartbeating][shrink_only=false]")],
     "the join timeout"),
    ([(0.5, "quorum 16: ['r0', 'r1', 'r2'] (3 of 3 healthy replicas asked)")],
     "no quorum formed after it")])
def test_the_deciding_rule_is_read_from_either_lighthouse_s_log(log, rule):
    """Ours and torchft's: asked of healthy at the quorum, against the line before it."""
    assert torchft_runs.deciding_rule(log, after=0.9).startswith(rule)
