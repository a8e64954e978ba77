"""Several torchrun agents on this machine, each standing in for a node: the tests' helper.

``Cluster`` starts one agent per node, each in a session of its own, meeting at a free port of
127.0.0.1 (torchrun's c10d rendezvous, or its static one numbered by ``--node_rank``; or one
node, ``--standalone``), and ``close`` ends every process it started, the workers included. torchrun starts each worker in
a session of its own, so ending an agent's process group would leave them running: every
process carries a mark in its environment (torchrun passes the agent's on to its workers),
and ``close`` kills whatever carries it, the workers of an agent that was killed too.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence

import psutil

MARK = "DPCOURSE_TEST_CLUSTER"


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict[str, str]:
    """This environment, on the course's offline data, one thread per process."""
    return {**os.environ, "DPCOURSE_DATA": os.environ.get("DPCOURSE_DATA", "synthetic"),
            "OMP_NUM_THREADS": "1"}


class Cluster:
    """nnodes torchrun agents of nproc workers each, running train_ddp with train_flags;
    each agent's output (its workers' included) goes to folder/node{i}.log. rendezvous is
    "c10d", "static" (numbered by --node_rank) or "standalone" (one node)."""

    def __init__(self, folder: Path, nnodes: int, nproc: int, train_flags: Sequence[str], *,
                 max_restarts: int = 0, rdzv_conf: str = "join_timeout=60",
                 rendezvous: str = "c10d") -> None:
        if rendezvous not in ("c10d", "static", "standalone") or (
                rendezvous == "standalone" and nnodes != 1):
            raise ValueError(f"no rendezvous {rendezvous!r} for {nnodes} nodes")
        self.folder, self.nnodes, self.nproc = folder, nnodes, nproc
        self.train_flags, self.max_restarts = list(train_flags), max_restarts
        self.rdzv_conf, self.rendezvous = rdzv_conf, rendezvous
        self.port, self.mark = free_port(), uuid.uuid4().hex
        self.agents: list[subprocess.Popen] = []

    def command(self, node: int) -> list[str]:
        """Node's torchrun command line, as README gives it."""
        where = [f"--rdzv_endpoint=127.0.0.1:{self.port}"]
        if self.rendezvous == "standalone":
            where = ["--standalone"]
        elif self.rendezvous == "static":
            where.append(f"--node_rank={node}")
        else:
            where += ["--rdzv_backend=c10d", f"--rdzv_id={self.mark}",
                      f"--rdzv-conf={self.rdzv_conf}"]
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}",
                f"--nproc_per_node={self.nproc}", f"--max-restarts={self.max_restarts}",
                *where, "-m", "dpcourse.train_ddp", *self.train_flags]

    def log_path(self, node: int) -> Path:
        return self.folder / f"node{node}.log"

    def log(self, node: int) -> str:
        """Everything node's agent and workers printed so far."""
        return self.log_path(node).read_text(errors="replace")

    def start(self) -> Cluster:
        """Start node 0, wait until it hosts the rendezvous' store, then start the others."""
        for node in range(self.nnodes):
            with open(self.log_path(node), "w") as log:
                self.agents.append(subprocess.Popen(
                    self.command(node), stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, env={**environment(), MARK: self.mark, "LOGLEVEL": "INFO"}))
            if node == 0 and self.nnodes > 1:
                self.wait_until(self.hosts_the_store, 120, "node 0 to host the store")
        return self

    def hosts_the_store(self) -> bool:
        """Whether node 0's agent listens on the rendezvous port."""
        try:
            return any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                       for c in psutil.Process(self.agents[0].pid).net_connections("tcp"))
        except psutil.NoSuchProcess:
            return False

    def workers(self, node: int) -> list[psutil.Process]:
        """Node's workers running now (its agent's children)."""
        try:
            return psutil.Process(self.agents[node].pid).children()
        except psutil.NoSuchProcess:
            return []

    def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll condition until it holds; raise, with every node's log, if an agent ends first
        or timeout seconds pass."""
        deadline = time.monotonic() + timeout
        while not condition():
            ended = [n for n, a in enumerate(self.agents) if a.poll() is not None]
            if ended or time.monotonic() > deadline:
                why = f"node {ended[0]} ended" if ended else f"{timeout:g} s passed"
                raise AssertionError(f"waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.02)

    def wait(self, timeout: float) -> list[int]:
        """Every agent's exit code, once all have ended (an AssertionError with the logs if
        one runs past timeout seconds)."""
        deadline = time.monotonic() + timeout
        try:
            return [a.wait(max(0.0, deadline - time.monotonic())) for a in self.agents]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"an agent ran past {timeout:g} s\n{self.logs()}") from None

    def logs(self) -> str:
        """Every node's log, the last 4,000 characters of each."""
        return "\n".join(f"--- node {n} ---\n{self.log(n)[-4000:]}" for n in range(self.nnodes))

    def kill_node(self, node: int) -> None:
        """SIGKILL node's agent and its workers, as a machine that vanishes."""
        doomed = [psutil.Process(self.agents[node].pid), *self.workers(node)]
        for process in doomed:
            process.kill()
        psutil.wait_procs(doomed, timeout=30)

    def marked(self) -> list[psutil.Process]:
        """This machine's processes carrying this cluster's mark."""
        found = []
        for process in psutil.process_iter():
            try:
                if process.environ().get(MARK) == self.mark:
                    found.append(process)
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue  # another user's, or it ended meanwhile
        return found

    def close(self) -> None:
        """Kill every process this cluster started, agents first (else they restart workers),
        and wait for them all to end."""
        for agent in self.agents:
            agent.kill()
            agent.wait()
        for _ in range(10):
            left = self.marked()
            if not left:
                return
            for process in left:
                process.kill()
            psutil.wait_procs(left, timeout=10)
        raise AssertionError(f"processes of the cluster outlived it: {self.marked()}")

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()
