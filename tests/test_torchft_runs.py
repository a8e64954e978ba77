"""Chapter 13 beside torchft 0.2.0: the same failure at the same step, under both (skipped,
saying why, where torchft cannot be installed), and the benchmark's table."""
import pytest
import torch

from dpcourse import bench
from dpcourse.experiments import torchft_runs
from dpcourse.experiments.ft_runs import memberships, one_process_run, replay
from dpcourse.experiments.torchft_runs import kill_and_restart, samples_skipped

AVAILABLE, WHY = torchft_runs.available()


def test_samples_skipped_counts_the_samples_of_each_batch_no_commit_used():
    def attempt(replica, step, batch, samples):
        return {"event": "attempt", "replica": replica, "qid": 0, "step": step,
                "batch": batch, "samples": samples}

    def decision(replica, step, batch, what):
        return {"event": "decision", "replica": replica, "qid": 0, "step": step,
                "batch": batch, "decision": what}
    events = [attempt("a", 0, 0, [0, 1]), attempt("b", 0, 0, [2, 3]),
              decision("a", 0, 0, "commit"), decision("b", 0, 0, "commit"),
              attempt("a", 1, 1, [4, 5]), attempt("b", 1, 1, [6, 7]),  # b dies: dropped
              decision("a", 1, 1, "abort"),
              attempt("a", 1, 2, [8, 9]), decision("a", 1, 2, "commit")]  # a alone
    assert samples_skipped(events, global_batch=4) == 4 + 2
    ours = [{**e, "batch": e["step"]} for e in events[:4]]  # train_ft logs no batch: its step
    assert samples_skipped([{k: v for k, v in e.items() if k != "batch"} for e in ours], 4) == 0


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
                        "samples_skipped": 0, "gap": 2e-15, "replay_gap": 0.0,
                        "failure_free_gap": 3e-15, "runs": 3},
                True: {"kill_to_next_commit_s": 1.0, "start_to_first_commit_s": 5.0,
                       "samples_skipped": 48, "gap": 0.5, "runs": 3}}
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
    assert "ours <= torchft's (met: x0.40)" in out and "ours 0 (met)" in out
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
