"""Chapter 13: a long run driven from outside, watching what the lighthouse keeps.

``python -m dpcourse.lighthouse`` runs as a process of its own, as a user starts it, and three
replicas of train_ft (``ft_runs.Replicas``, forked) train a tiny global batch; r1 is killed
in its allreduce and started again every `every` steps. Every second: the store's key count
and the lighthouse's resident memory. At the end: r0's quorum round trip (ask to answer, from
its attempt events) per block of steps, and the keys left once the dead are forgotten.
Linux only (/proc).
"""
from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from .ft_runs import Replicas, environment, replica_with_faults
from .nodes import free_port

FLAGS = ("--global-batch-size", "2", "--train-size", "64", "--timeout", "2")
FORGET_AFTER_S = 5.0  # the lighthouse's --forget-after: the dead go within the run


def resident_mb(pid: int) -> float:
    """The resident memory of process pid, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


def watched_run(folder: Path, steps: int, every: int, block: int = 1000) -> dict:
    """Run it (above) in folder: the exit codes, seconds, restarts, samples (seconds, keys,
    the lighthouse's MiB), r0's median quorum round trip in ms per block of steps (by its
    first step), and the number of keys left at the end."""
    port = free_port()
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "dpcourse.lighthouse", "--port", str(port), "--heartbeat-timeout",
         "0.5", "--join-timeout", "0.1", "--forget-after", str(FORGET_AFTER_S)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment())
    samples, stop = [], threading.Event()
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)  # waits for it to listen
        started = time.monotonic()

        def watch() -> None:
            while not stop.wait(1.0):
                samples.append((time.monotonic() - started, store.num_keys(),
                                resident_mb(lighthouse.pid)))
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        kills = iter(range(every, steps, every))

        def kill_at(step: int | None) -> list[dict]:
            return [] if step is None else [
                {"phase": "allreduce", "step": step, "how": "kill", "restart": True}]
        with Replicas(folder, [*FLAGS, "--steps", str(steps)],
                      address=f"127.0.0.1:{port}") as replicas:
            replicas.start_together(["r0", "r1", "r2"], replica_with_faults,
                                    {"r0": ([],), "r1": (kill_at(next(kills, None)),),
                                     "r2": ([],)})
            codes = replicas.supervise(
                3600 + steps, restarts={"r1": steps // every},
                start=lambda name: replicas.start(name, replica_with_faults,
                                                  kill_at(next(kills, None))))
            restarts = len(replicas.procs["r1"]) - 1
        seconds = time.monotonic() - started
        stop.set()
        watcher.join()
        time.sleep(FORGET_AFTER_S + 1)
        left = store.num_keys()
    finally:
        lighthouse.send_signal(signal.SIGINT)
        lighthouse.wait(10)
    trips: dict[int, list[float]] = {}
    with open(folder / "r0.jsonl") as log:
        for line in log:
            if '"attempt"' in line and line.endswith("}\n"):
                e = json.loads(line)
                trips.setdefault(e["step"] // block * block, []).append(e["quorum_s"] * 1e3)
    return {"codes": codes, "seconds": seconds, "restarts": restarts, "samples": samples,
            "round_trip_ms": {b: statistics.median(t) for b, t in sorted(trips.items())},
            "left": left}
