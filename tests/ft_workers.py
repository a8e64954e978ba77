"""Test-only: a train_ft replica that fails on purpose, at a named point of a step.

A fault is a dict: "phase" (one of train_ft's: quorum, serve, forward, allreduce, vote),
"step" (the first attempt at or after that step, in that phase), "how": "kill" (SIGKILL
itself), "stop" (SIGSTOP itself; the test's supervisor continues it after a pause) or "delay"
("seconds" of sleep at every attempt at exactly that step: a member slower than others).
"""
import os
import signal
import time

from dpcourse.experiments.ft_runs import run_replica


def replica_with_faults(argv: list[str], environ: dict[str, str], out: str, together,
                        faults: list[dict]) -> None:
    pending = list(faults)

    def at(phase: str, step: int) -> None:
        for fault in list(pending):
            if fault["phase"] != phase:
                continue
            if fault["how"] == "delay" and step == fault["step"]:
                time.sleep(fault["seconds"])
            elif fault["how"] != "delay" and step >= fault["step"]:
                pending.remove(fault)
                os.kill(os.getpid(), signal.SIGKILL if fault["how"] == "kill" else signal.SIGSTOP)

    run_replica(argv, environ, out, together, at)
