"""Chapter 12: several torchrun agents on this machine, each standing in for a node.

``Cluster`` starts one agent per node, each in a session of its own, meeting at a free port of
127.0.0.1 (torchrun's c10d rendezvous, or its static one numbered by ``--node_rank``; or one
node, ``--standalone``), and ``close`` ends every process it started, the workers included.
torchrun starts each worker in a session of its own, so ending an agent's process group would
leave them running: every process carries a mark in its environment (torchrun passes the
agent's on to its workers), and ``close`` kills whatever carries it. The tests drive it too
(tests/multinode.py).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import resume
from ..data import fashion_mnist
from ..lenet import lenet_model
from ..elastic import GlobalBatchSampler
from .restarts import resumed_steps

MARK = "DPCOURSE_TEST_CLUSTER"


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment() -> dict[str, str]:
    """This environment, on the course's offline data, one thread per process, and no GPU:
    nodes on one machine would share its GPUs (two nccl ranks on one GPU fail), and the
    chapter compares them with runs on the CPU."""
    return {**os.environ, "DPCOURSE_DATA": os.environ.get("DPCOURSE_DATA", "synthetic"),
            "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


class Cluster:
    """nnodes torchrun agents of nproc workers each, running train_ddp with train_flags;
    each agent's output (its workers' included) goes to folder/node{i}.log. rendezvous is
    "c10d", "static" (numbered by --node_rank) or "standalone" (one node); min_nodes makes
    the c10d world elastic (--nnodes=min_nodes:nnodes). share_store=False sets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a store per round hosted by its rank 0 worker: a node
    started again can join a running elastic world only so (torch 2.14 hangs otherwise: a
    survivor's agent publishes the shared store's address in the first round only)."""

    def __init__(self, folder: Path, nnodes: int, nproc: int, train_flags: Sequence[str], *,
                 max_restarts: int = 0, rdzv_conf: str = "join_timeout=60",
                 rendezvous: str = "c10d", min_nodes: int | None = None,
                 share_store: bool = True) -> None:
        if rendezvous not in ("c10d", "static", "standalone") or (
                rendezvous == "standalone" and nnodes != 1) or (
                min_nodes is not None and (rendezvous != "c10d" or not 1 <= min_nodes <= nnodes)):
            raise ValueError(f"no rendezvous {rendezvous!r} for {min_nodes or nnodes} to "
                             f"{nnodes} nodes")
        self.folder, self.nnodes, self.nproc = folder, nnodes, nproc
        self.train_flags, self.max_restarts = list(train_flags), max_restarts
        self.rdzv_conf, self.rendezvous, self.min_nodes = rdzv_conf, rendezvous, min_nodes
        self.share_store = share_store
        self.port, self.mark = free_port(), uuid.uuid4().hex
        self.agents: list[subprocess.Popen] = []
        self.replaced: list[subprocess.Popen] = []  # agents of nodes started again
        self.killed: set[int] = set()  # nodes killed on purpose, not started again

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
        nnodes = f"{self.min_nodes}:{self.nnodes}" if self.min_nodes else self.nnodes
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                f"--nproc_per_node={self.nproc}", f"--max-restarts={self.max_restarts}",
                *where, "-m", "dpcourse.train_ddp", *self.train_flags]

    def log_path(self, node: int) -> Path:
        return self.folder / f"node{node}.log"

    def log(self, node: int) -> str:
        """Everything node's agent and workers printed so far."""
        return self.log_path(node).read_text(errors="replace")

    def start_node(self, node: int, mode: str = "w") -> subprocess.Popen:
        """Start node's agent, its output going to its log (appended with mode "a")."""
        with open(self.log_path(node), mode) as log:
            return subprocess.Popen(
                self.command(node), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**environment(), MARK: self.mark, "LOGLEVEL": "INFO",
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0" if self.share_store else "1"})

    def start(self) -> Cluster:
        """Start node 0, wait until it hosts the rendezvous' store, then start the others."""
        for node in range(self.nnodes):
            self.agents.append(self.start_node(node))
            if node == 0 and self.nnodes > 1:
                self.wait_until(self.hosts_the_store, 120, "node 0 to host the store")
        return self

    def restart_node(self, node: int) -> None:
        """Start node's agent again (after kill_node), appending to its log."""
        self.replaced.append(self.agents[node])
        self.agents[node] = self.start_node(node, "a")
        self.killed.discard(node)

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

    def wait_until(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll condition until it returns something true, and return that; raise, with every
        node's log, if an agent not killed on purpose ends first or timeout seconds pass."""
        deadline = time.monotonic() + timeout
        while not (found := condition()):
            ended = [n for n, a in enumerate(self.agents)
                     if a.poll() is not None and n not in self.killed]
            if ended or time.monotonic() > deadline:
                why = f"node {ended[0]} ended" if ended else f"{timeout:g} s passed"
                raise AssertionError(f"waiting for {what}: {why}\n{self.logs()}")
            time.sleep(0.02)
        return found

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
        self.killed.add(node)

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
        for agent in [*self.agents, *self.replaced]:
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


# ---- chapter 12's runs ----

WORKER_VARIABLES = ("GROUP_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")
RESTART_FLAGS = ("--train-size", "1024", "--batch-size", "16", "--lr", "0.05", "--timeout",
                 "60", "--checkpoint-every", "8")  # 32 steps on 2 ranks, a checkpoint every 8


def seen_by_workers(nodes: Cluster, before: dict[int, int] | None = None) -> dict[int, dict]:
    """What each node's worker finds in its environment (WORKER_VARIABLES), once every node
    has one (a new one, if before gives the earlier workers' pids), by node."""
    def found() -> dict[int, dict] | None:
        seen = {}
        for node in range(nodes.nnodes):
            new = [w for w in nodes.workers(node) if before is None or w.pid != before[node]]
            try:
                seen[node] = {"pid": new[0].pid, **{v: new[0].environ().get(v)
                                                    for v in WORKER_VARIABLES}}
            except (IndexError, psutil.NoSuchProcess):
                return None
            if seen[node]["RANK"] is None:
                return None  # forked, not yet started with the worker's environment
        return seen
    return nodes.wait_until(found, 120, "every node's worker")


def rounds_counted(seen: dict[str, str]) -> int:
    """How many rounds resume.round_name has named in the agents' store a worker saw."""
    store = dist.TCPStore(seen["MASTER_ADDR"], int(seen["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=30))
    return store.add("dpcourse/rounds", 0)


def restart_across_nodes(folder: Path) -> dict[str, Any]:
    """Two nodes of one worker each: node 1's worker SIGKILLed after the first checkpoint
    while node 0's is stopped (SIGSTOP, as a survivor blocked in an nccl collective). Returns
    what the workers saw before and after, the rounds named in the store, and the exit codes."""
    path = folder / "ckpt.pt"
    folder.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with Cluster(folder, 2, 1, [*RESTART_FLAGS, "--checkpoint", str(path)],
                 max_restarts=1) as nodes:
        nodes.wait_until(path.exists, 120, "the first checkpoint")
        before = seen_by_workers(nodes)
        [stopped], [killed] = nodes.workers(0), nodes.workers(1)
        stopped.suspend()
        killed.kill()
        nodes.wait_until(lambda: "will restart worker group" in nodes.log(0), 120,
                         "node 0's agent to restart its worker")
        stopped.resume()  # (it then ends on the SIGTERM its agent sent)
        after = seen_by_workers(nodes, {n: seen["pid"] for n, seen in before.items()})
        nodes.wait_until(lambda: ": resuming from epoch" in nodes.log(0) + nodes.log(1), 120,
                         "the run to resume")  # (after its round was named)
        rounds = rounds_counted(after[0])
        codes = nodes.wait(120)
        logs = [nodes.log(n) for n in range(2)]
    return {"before": before, "after": after, "rounds": rounds, "exit_codes": codes,
            "rendezvous": [log.count("Rendezvous complete for workers") for log in logs],
            "resumed": sum(log.count(": resuming from epoch") for log in logs)}


# a node is dead after keep_alive_interval x keep_alive_max_attempt without a beat (torch's
# default 5 s x 3); last_call_timeout (default 30 s) lets more nodes join a round that could
# already form; the README's recommended settings for this machine
ELASTIC_CONF = "join_timeout=120,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=4"
ELASTIC = {"train_size": 2048, "global_batch": 32, "lr": 0.05, "momentum": 0.9, "seed": 0}
ELASTIC_FLAGS = ("--train-size", "2048", "--global-batch-size", "32", "--epochs", "1000",
                 "--lr", "0.05", "--momentum", "0.9", "--seed", "0", "--dtype", "float64",
                 "--timeout", "60")


def elastic_run(folder: Path, steps: int, kill_at: int, every: int = 5) -> dict[str, Any]:
    """train_ddp on 2 nodes under --nnodes=1:2, in one job with a store per round
    (share_store=False): node 1 killed whole once a checkpoint of step kill_at or later exists,
    node 0 going on alone; at the world of one's first checkpoint node 1 is started again and
    joins at the next re-formation (a membership change); the world of 2 ends the run at steps.
    Node 0's worker is held (SIGSTOP) from that checkpoint until its agent sees node 1, so it
    cannot end the run first. Returns the events (seconds, node, what), each checkpoint seen
    (step: seconds, world size, weights), the exit codes, the final checkpoint and the error
    node 0's worker failed with when node 1 was lost."""
    path, start, events, seen = folder / "ckpt.pt", time.monotonic(), [], {}
    folder.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)

    def note(node: int, what: str) -> None:
        events.append((time.monotonic() - start, node, what))

    def checkpoint(condition: Callable[[dict], bool]) -> Callable[[], dict | None]:
        """A poll: the checkpoint, recorded in seen if new, when it exists and condition holds."""
        def poll() -> dict | None:
            try:
                state = resume.load(path) if path.exists() else None
            except (OSError, RuntimeError, EOFError):
                return None  # (replaced atomically, but it may go between exists and load)
            if state is not None and state["step"] not in seen:
                seen[state["step"]] = (time.monotonic() - start, len(state["ranks"]),
                                       state["model"])
            return state if state is not None and condition(state) else None
        return poll

    flags = [*ELASTIC_FLAGS, "--steps", str(steps), "--checkpoint", str(path),
             "--checkpoint-every", str(every)]
    with Cluster(folder, 2, 1, flags, max_restarts=3, rdzv_conf=ELASTIC_CONF, min_nodes=1,
                 share_store=False) as nodes:
        note(0, "started")
        nodes.wait_until(checkpoint(lambda s: s["step"] >= kill_at), 120,
                         f"a checkpoint of step {kill_at}")
        nodes.kill_node(1)
        note(1, "killed")
        nodes.wait_until(lambda: "written by 2 processes" in nodes.log(0), 120,
                         "node 0 to resume alone")
        note(0, f"alone, from step {resumed_steps(nodes.log(0))[-1]}")
        nodes.wait_until(checkpoint(lambda s: len(s["ranks"]) == 1), 120, "its checkpoint")
        [held] = nodes.workers(0)
        held.suspend()
        checkpoint(lambda s: True)()  # (one more it may have written meanwhile)
        nodes.restart_node(1)
        note(1, "started again")
        nodes.wait_until(lambda: "Detected 1 new nodes" in nodes.log(0), 120,
                         "node 0's agent to see node 1")
        held.resume()  # (it then ends on the SIGTERM its agent sent)
        note(0, "sees node 1")
        nodes.wait_until(lambda: "written by 1 processes" in nodes.log(0), 120,
                         "2 nodes to resume")
        note(0, f"2 nodes, from step {resumed_steps(nodes.log(0))[-1]}")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(a.poll() is None for a in nodes.agents):
            checkpoint(lambda state: True)()  # (every one the run writes, for the figure)
            time.sleep(0.02)
        codes = nodes.wait(1)
        lost = [line for line in nodes.log(0).splitlines() if line.startswith("RuntimeError: ")]
    note(0, "ended")
    checkpoint(lambda state: True)()
    return {"events": events, "seen": dict(sorted(seen.items())), "exit_codes": codes,
            "final": resume.load(path), "survivor_error": lost[-1]}


def one_process_run(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The elastic run's training (ELASTIC, float64) uninterrupted in this process, written
    out without train_ddp: each step's loss before the step, and the final weights."""
    data = fashion_mnist("train", ELASTIC["train_size"], environment()["DPCOURSE_DATA"])
    model = lenet_model(ELASTIC["seed"]).to(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=ELASTIC["lr"], momentum=ELASTIC["momentum"])
    sampler = GlobalBatchSampler(len(data), ELASTIC["global_batch"], 0, 1, ELASTIC["seed"])
    losses: list[float] = []
    for epoch in range(steps // len(sampler) + 1):
        sampler.set_epoch(epoch)
        for indices in list(sampler)[:steps - len(losses)]:
            X, y = data[indices]
            loss = F.cross_entropy(model(X.double()), y)
            losses.append(loss.item())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return losses, model.state_dict()


def losses_at(weights: dict[int, dict[str, torch.Tensor]]) -> dict[int, float]:
    """The loss of global batch s + 1 (the next one) under the weights after step s, by s."""
    data = fashion_mnist("train", ELASTIC["train_size"], environment()["DPCOURSE_DATA"])
    sampler = GlobalBatchSampler(len(data), ELASTIC["global_batch"], 0, 1, ELASTIC["seed"])
    model, losses = lenet_model(ELASTIC["seed"]).to(torch.float64), {}
    for step, state in weights.items():
        sampler.set_epoch(step // len(sampler))
        X, y = data[list(sampler)[step % len(sampler)]]
        model.load_state_dict(state)
        with torch.no_grad():
            losses[step] = F.cross_entropy(model(X.double()), y).item()
    return losses


# --- recovery: from a node lost to the first step of the smaller world (the benchmark's) -----

RECOVERY_SETTINGS = {"torchrun's defaults": ("join_timeout=600", True),  # (--rdzv-conf,
                     "README's settings": (ELASTIC_CONF, False)}  # the agents' shared store)


def lose_a_node(folder: Path, flags: Sequence[str], rdzv_conf: str, share_store: bool,
                nnodes: int = 2) -> tuple[float, dict]:
    """Kill the last node of an elastic job of nnodes nodes of one process (--nnodes=1:nnodes,
    train_ddp with flags, a checkpoint after every step) once they have taken 3 steps; return
    the seconds from the kill to the first step of the smaller world (its first checkpoint),
    and that checkpoint."""
    path = folder / "ckpt.pt"

    def checkpoint(processes: int, after: int) -> dict | None:
        try:
            state = resume.load(path) if path.exists() else None
        except (OSError, RuntimeError, EOFError):
            return None  # (replaced atomically, but it may go between exists and load)
        return state if state and len(state["ranks"]) == processes and state["step"] > after \
            else None

    with Cluster(folder, nnodes, 1, [*flags, "--checkpoint", str(path),
                                     "--checkpoint-every", "1"],
                 max_restarts=3, rdzv_conf=rdzv_conf, min_nodes=1,
                 share_store=share_store) as nodes:
        nodes.wait_until(lambda: checkpoint(nnodes, 2), 120, f"3 steps of {nnodes} processes")
        nodes.kill_node(nnodes - 1)
        killed = time.monotonic()
        smaller = nodes.wait_until(lambda: checkpoint(nnodes - 1, 0), 180,
                                   f"a step of the world of {nnodes - 1}")
        return time.monotonic() - killed, smaller


def recovery_seconds(folder: Path, rdzv_conf: str, share_store: bool) -> float:
    """Seconds from node 1 of 2 killed whole to the first step of the world of one, training
    the elastic run's model (ELASTIC_FLAGS)."""
    return lose_a_node(folder, ELASTIC_FLAGS, rdzv_conf, share_store)[0]
