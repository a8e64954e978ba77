"""torchrun across nodes, on this machine: agents started one by one stand in for nodes
(tests/multinode.py), as README's multi-node commands start them.

- 2 nodes x 2 processes (c10d rendezvous) and 2 x 1 (README's static form, --node_rank) train
  to the end with the parameters of torchrun --standalone at the same world size, bitwise.
- A worker SIGKILLed on one node, while the other node's worker is stopped (SIGSTOP, as a
  survivor blocked in an nccl collective): that node's agent restarts its worker as a
  membership change, which its TORCHELASTIC_RESTART_COUNT does not count. Every node restarts
  once, with --max-restarts=1 (a failed re-join would need a second), and the run ends as
  the uninterrupted one, bitwise.
- A node lost whole, with a fixed --nnodes=2: the other node's worker fails naming the lost
  rank and its node (resume.naming_lost_ranks: whose beats in the store stopped), its agent
  gives up when join_timeout ends, and the last checkpoint is intact.
"""
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dpcourse import resume
from multinode import Cluster, environment, free_port

FLAGS = ["--train-size", "1024", "--batch-size", "16", "--lr", "0.05", "--timeout", "60",
         "--checkpoint-every", "8"]  # 1024 / (16 x 2 ranks): 32 steps, a checkpoint every 8
JOIN_TIMEOUT = 30  # seconds
REFERENCES = [(2, "--scratch"), (4, "--scratch"), (2, "--fsdp")]  # (processes, mode)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final checkpoint of train_ddp with FLAGS and a mode under torchrun --standalone on
    nproc workers, by (nproc, mode): every run REFERENCES lists starts at once, in the
    background, as the first test needs one, and is ended with the module."""
    runs = {}
    try:
        for nproc, mode in REFERENCES:
            folder = tmp_path_factory.mktemp(f"standalone-{nproc}")
            runs[nproc, mode] = Cluster(folder, 1, nproc, [*FLAGS, "--checkpoint",
                                                           str(folder / "ckpt.pt"), mode],
                                        rendezvous="standalone").start()

        def final(nproc: int, mode: str) -> dict:
            assert runs[nproc, mode].wait(300) == [0], runs[nproc, mode].logs()
            return final_state(runs[nproc, mode].folder / "ckpt.pt")
        yield final
    finally:
        for run in runs.values():
            run.close()


@pytest.fixture
def cluster(tmp_path):
    """Start a Cluster running train_ddp with FLAGS and flags, checkpointing to
    tmp_path/ckpt.pt; every process it started is ended when the test ends, pass or fail."""
    started = []

    def start(nnodes: int, nproc: int, *flags: str, **options) -> Cluster:
        started.append(Cluster(tmp_path, nnodes, nproc,
                               [*FLAGS, "--checkpoint", str(tmp_path / "ckpt.pt"), *flags],
                               **options))
        return started[-1].start()
    yield start
    for each in started:
        each.close()


def final_state(path: Path) -> dict:
    """The checkpoint train_ddp wrote at path."""
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_parameters(state: dict, reference: dict) -> None:
    assert state["step"] == reference["step"]
    assert state["model"].keys() == reference["model"].keys()
    for key, value in reference["model"].items():
        assert torch.equal(state["model"][key], value), key


@pytest.mark.parametrize("rendezvous, nproc", [("c10d", 2), ("static", 1)])
def test_two_nodes_end_bitwise_as_one_node_with_as_many_processes(cluster, uninterrupted,
                                                                   rendezvous, nproc, tmp_path):
    nodes = cluster(2, nproc, "--scratch", rendezvous=rendezvous)
    assert nodes.wait(300) == [0, 0], nodes.logs()
    state = final_state(tmp_path / "ckpt.pt")
    assert len(state["ranks"]) == 2 * nproc  # one world over both nodes
    assert_same_parameters(state, uninterrupted(2 * nproc, "--scratch"))


@pytest.mark.parametrize("mode, victim", [("--scratch", 1), ("--fsdp", 0)])
def test_a_worker_killed_on_one_node_restarts_every_node_once_and_ends_as_uninterrupted(
        cluster, uninterrupted, mode, victim, tmp_path):
    nodes, survivor = cluster(2, 1, mode, max_restarts=1), 1 - victim
    nodes.wait_until((tmp_path / "ckpt.pt").exists, 300, "the first checkpoint")
    [stopped], [killed] = nodes.workers(survivor), nodes.workers(victim)
    stopped.suspend()  # blocked, as in an nccl collective: its agent sees it healthy
    killed.kill()
    nodes.wait_until(lambda: "will restart worker group" in nodes.log(survivor), 120,
                     "the survivor's agent to restart its worker")
    stopped.resume()  # (it then ends on the SIGTERM its agent sent)
    assert nodes.wait(300) == [0, 0], nodes.logs()
    logs = [nodes.log(victim), nodes.log(survivor)]
    assert "Worker group FAILED. 1/1 attempts left" in logs[0]
    assert re.search(r"Detected 1 new nodes from group_rank=\d; will restart", logs[1])
    for log in logs:  # one restart round: the first rendezvous, and one more
        assert log.count("Rendezvous complete for workers") == 2, nodes.logs()
    assert "".join(logs).count(": resuming from epoch") == 1
    assert_same_parameters(final_state(tmp_path / "ckpt.pt"), uninterrupted(2, mode))


def test_a_node_lost_whole_stops_the_other_naming_the_peer_and_keeps_the_checkpoint(cluster,
                                                                                     tmp_path):
    nodes = cluster(2, 1, "--scratch", max_restarts=1, rdzv_conf=f"join_timeout={JOIN_TIMEOUT}")
    nodes.wait_until((tmp_path / "ckpt.pt").exists, 300, "the first checkpoint")
    [lost] = nodes.workers(1)
    lost = lost.environ()
    nodes.kill_node(1)  # its agent and its worker: the rendezvous' store lives on node 0
    [code] = nodes.wait(JOIN_TIMEOUT + 60)[:1]  # its worker fails at once, then join_timeout
    log = nodes.log(0)
    assert code != 0, log[-3000:]
    assert f"RuntimeError: rank {lost['RANK']} (node {lost['GROUP_RANK']}, host " \
           f"{socket.gethostname()}) is gone (no beat in the store for" in log, log
    assert re.search(r"\[127\.0\.0\.1\]:\d+: Connection reset by peer"  # gloo, naming the
                     r"|Connection closed by peer \[127\.0\.0\.1\]:\d+", log), log  # peer's address
    assert "Worker group FAILED. 1/1 attempts left" in log
    assert "RendezvousTimeoutError" in log  # node 1 never joined the next round
    state = resume.load(tmp_path / "ckpt.pt")
    assert state["step"] in (8, 16, 24)


def test_every_rank_of_a_round_gets_one_new_name_whatever_a_dead_round_left_in_the_store():
    """round_name on 3 ranks (threads, each a client of one store): two rounds, and between
    them a rank 1 that asked and died unanswered (its question is still in the store)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))

    def rank(r: int, delay: float = 0.0, timeout: float = 60.0) -> str:
        time.sleep(delay)
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                              timeout=timedelta(seconds=timeout))
        return resume.round_name(store, r, 3, timedelta(seconds=timeout))

    with ThreadPoolExecutor(3) as pool:
        first = list(pool.map(rank, range(3)))
        with pytest.raises(dist.DistStoreError, match="dpcourse/answer/"):
            rank(1, timeout=0.5)  # no rank 0 answers it: its worker dies
        second = list(pool.map(rank, range(3), [0, 0.5, 0]))  # rank 0 first answers the
    assert first == ["1"] * 3  # dead question, then rank 1's own when it comes
    assert second == ["2"] * 3


def client(port: int) -> dist.Store:
    """A client of the store at port, under one round's prefix, as train_ddp's workers join."""
    return dist.PrefixStore("dpcourse/round1", dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)))


def killed_in(port: int, rank: int, world_size: int) -> None:
    """A process of node 7 SIGKILLed inside naming_lost_ranks as rank."""
    code = f"""import time, torch.distributed as dist
from dpcourse import resume
store = dist.PrefixStore("dpcourse/round1", dist.TCPStore("127.0.0.1", {port}, is_master=False))
with resume.naming_lost_ranks(store, {rank}, {world_size}):
    print("in", flush=True)
    time.sleep(120)"""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).parents[1],
                               env={**environment(), "GROUP_RANK": "7"})
    try:
        assert process.stdout.readline() == "in\n"
    finally:
        process.kill()
        process.wait()


def test_a_failed_collective_names_the_killed_ranks_not_those_that_left_or_beat():
    """naming_lost_ranks on 4 ranks, clients of one store: rank 3 (a process) is SIGKILLed,
    rank 2 leaves (it ended with an error of its own), rank 1 beats all along. Rank 0's error
    names rank 3 only, chained to the original."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    killed_in(server.port, 3, 4)
    with resume.naming_lost_ranks(client(server.port), 2, 4):
        pass
    original, leave = RuntimeError("Read error [127.0.0.1]:1234: Connection reset by peer"), \
        threading.Event()

    def rank_1() -> None:
        with resume.naming_lost_ranks(client(server.port), 1, 4):
            leave.wait(30)
    beating = threading.Thread(target=rank_1)
    beating.start()
    try:
        with pytest.raises(RuntimeError) as caught:
            with resume.naming_lost_ranks(client(server.port), 0, 4):
                raise original
    finally:
        leave.set()
        beating.join()
    assert str(caught.value) == (f"rank 3 (node 7, host {socket.gethostname()}) is gone (no "
                                 f"beat in the store for {resume.QUIET_S:g} s): {original}")
    assert caught.value.__cause__ is original


def raised_by_each(port: int, world_size: int, error: RuntimeError) -> list[BaseException]:
    """What naming_lost_ranks raises in each of world_size ranks (threads) raising error."""
    def rank(r: int) -> BaseException:
        try:
            with resume.naming_lost_ranks(client(port), r, world_size):
                raise error
        except RuntimeError as raised:
            return raised
    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(rank, range(world_size)))


def test_an_error_every_rank_raises_is_raised_as_it_was():
    """In a world of one, and on 3 ranks that raise it together."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    original = RuntimeError("checkpoint ckpt.pt was written by a different command")
    assert raised_by_each(server.port, 1, original) == [original]
    assert raised_by_each(server.port, 3, original) == [original] * 3


@pytest.mark.parametrize("agent_store, hosted", [
    ("True", r"node 0 \(its torchrun agent\), which hosts it, is gone"),
    (None, r"rank 0's worker \(at 127\.0\.0\.1:\d+; with a store per round, a worker killed "
           r"alone takes it along while its agent restarts the workers\), which hosts it")])
def test_a_failed_collective_with_the_store_gone_names_who_hosted_it(monkeypatch, agent_store,
                                                                     hosted):
    """torchrun's shared store lives in node 0's agent; a store per round (issue 34: the
    README's elastic settings) in rank 0's worker, whose agent may well be alive."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    if agent_store:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent_store)
    else:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    host = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as dist; "
                             f"s = dist.TCPStore('127.0.0.1', {port}, is_master=True); "
                             "print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)  # node 0's agent
    try:
        assert host.stdout.readline() == "up\n"
        with pytest.raises(RuntimeError, match=r"the store does not answer either \(.*\): "
                                               + hosted):
            with resume.naming_lost_ranks(client(port), 1, 2):
                host.kill()
                host.wait()
                raise RuntimeError("Connection reset by peer")
    finally:
        host.kill()
        host.wait()
