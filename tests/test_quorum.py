"""A replica's pieces of chapter 13 on their own, members as threads of this process: the vote
decides a step once for all, a group per quorum leaves no threads behind, and live recovery
moves the whole state bitwise or raises."""
import io
import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dpcourse.quorum import Quorum, quorum_group, vote
from dpcourse.recovery import RecoveryError, digest, receive_state, recovery_plan, send_state


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield lambda: dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                timeout=timedelta(seconds=30))


def on_members(size: int, body) -> list:
    """body(member) on size threads at once; their results in member order."""
    results = [None] * size

    def run(member: int) -> None:
        try:
            results[member] = body(member)
        except Exception as error:  # noqa: BLE001 - returned, and checked by the caller
            results[member] = error.with_traceback(None)  # its frames (a group) end here
    threads = [threading.Thread(target=run, args=(m,)) for m in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


# --- the vote ---

def test_every_member_ready_commits(store):
    clients = [store() for _ in range(3)]
    assert on_members(3, lambda m: vote(clients[m], 1, 0, 3, True, 5.0)) == [True] * 3


def test_one_member_not_ready_aborts_the_step_for_all(store):
    clients = [store() for _ in range(3)]
    assert on_members(3, lambda m: vote(clients[m], 1, 0, 3, m != 1, 5.0)) == [False] * 3


def test_a_vote_that_comes_after_the_others_timed_out_does_not_commit(store):
    """The last vote completes the count, but the others already decided: abort for all
    (a vote taken as a collective could commit on the late member alone)."""
    clients = [store() for _ in range(3)]
    late = threading.Event()

    def member(m: int) -> bool:
        if m == 2:
            late.wait(30)
            return vote(clients[m], 1, 0, 3, True, 5.0)
        decided = vote(clients[m], 1, 0, 3, True, 0.3)
        late.set()
        return decided
    assert on_members(3, member) == [False] * 3


def test_each_quorum_and_step_has_a_decision_of_its_own(store):
    clients = [store() for _ in range(2)]
    assert on_members(2, lambda m: vote(clients[m], 1, 0, 2, m == 0, 5.0)) == [False] * 2
    assert on_members(2, lambda m: vote(clients[m], 2, 0, 2, True, 5.0)) == [True] * 2
    assert on_members(2, lambda m: vote(clients[m], 2, 1, 2, True, 5.0)) == [True] * 2


# --- a group per quorum ---

def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_group_per_quorum_leaves_no_threads_behind(store, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    clients = [store() for _ in range(2)]

    def step(m: int, quorum: Quorum) -> float:
        group = quorum_group(clients[m], quorum, m, timeout=10.0)
        summed = torch.ones(4)
        group.allreduce([summed]).wait()
        return summed[0].item()  # the group's last reference goes here
    before = threads_now()
    for qid in range(1, 31):
        quorum = Quorum(qid, ["a", "b"], [0, 0], [0, 0], 0)
        assert on_members(2, lambda m: step(m, quorum)) == [2.0, 2.0]
    assert threads_now() <= before + 2  # each live group holds 3 threads: 60 if kept


# --- live recovery ---

def test_members_behind_copy_from_the_up_to_date_ones_in_turn():
    assert recovery_plan([5, 5, 5], [2, 2, 2]) == {}
    assert recovery_plan([5, 0, 5, 3], [2, 0, 2, 1]) == {1: 0, 3: 2}  # spread over 0 and 2
    assert recovery_plan([0, 5, 0, 0], [0, 2, 0, 0]) == {0: 1, 2: 1, 3: 1}
    # the same step, another history (a commit under another quorum): it heals too
    assert recovery_plan([5, 5], [2, 3]) == {0: 1}


def training_state(seed: int) -> dict:
    """A model's and an SGD optimizer's state, with momentum (written out: an optimizer's first
    step would import torch._dynamo, seconds)."""
    g = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(300, 300, generator=g).double(), torch.randn(300).double()
    return {"model": {"weight": weight, "bias": bias},
            "optimizer": {"state": {0: {"momentum_buffer": weight / 3},
                                    1: {"momentum_buffer": bias / 3}},
                          "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": [0, 1]}]},
            "step": 7, "qid": 3}


TRANSFERS = iter(range(1, 1000))  # a quorum id each: a group never meets under an old one's keys


def transfer(store, monkeypatch, send) -> list:
    """Member 0 runs send(group), member 1 receive_state(group, 0): their results."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    clients = [store() for _ in range(2)]
    quorum = Quorum(next(TRANSFERS), ["a", "b"], [7, 0], [3, 0], 7)

    received = threading.Event()

    def member(m: int):
        group = quorum_group(clients[m], quorum, m, timeout=5.0)
        if m == 0:
            sent = send(group)  # if it raises, its group ends here: the receiver's recv fails
            received.wait(10)  # else the group lives until everything sent has been read
            return sent
        try:
            return receive_state(group, 0)
        finally:
            received.set()
    return on_members(2, member)


def test_a_recovered_state_is_the_source_s_bitwise(store, monkeypatch):
    state = training_state(0)
    sent, (received, sha) = transfer(store, monkeypatch, lambda g: send_state(g, state, 1))
    assert sent == sha == digest(state) == digest(received)
    assert torch.equal(received["optimizer"]["state"][0]["momentum_buffer"],
                       state["optimizer"]["state"][0]["momentum_buffer"])
    assert digest(training_state(1)) != sha


def test_a_transfer_cut_short_or_not_matching_its_digest_raises(store, monkeypatch):
    state = training_state(0)
    tampered = {**state, "step": 8}

    def cut_short(group):  # the source is gone after the first chunk
        send_state(group, state, 1, between_chunks=lambda: (_ for _ in ()).throw(
            ConnectionAbortedError("source lost")))
    _, received = transfer(store, monkeypatch, cut_short)
    assert isinstance(received, RuntimeError), received

    def lying(group):  # a digest that is not the state's
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        header = torch.tensor([len(payload), *bytes.fromhex(digest(tampered))])
        for message in (header, *payload.split(1 << 18)):
            group.send([message], 1, 0).wait()
    _, received = transfer(store, monkeypatch, lying)
    assert isinstance(received, RecoveryError) and "does not match its digest" in str(received)
