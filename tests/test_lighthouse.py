"""The lighthouse's rules, each on a scripted sequence of heartbeats and requests (its Tracker:
no I/O, times given), in torchft's order; then the service over its store, with replicas'
Memberships."""
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from dpcourse import quorum, train_ft
from dpcourse.experiments.nodes import free_port
from dpcourse.lighthouse import Lighthouse, Rules, Tracker, quorum_members
from dpcourse.quorum import LighthouseGone, Membership

RULES = Rules(min_replicas=1, join_timeout=0.5, heartbeat_timeout=1.0)


class Script:
    """A tracker driven by a script: at(t).beat(...), .ask(...), then .quorum() at t."""

    def __init__(self, rules: Rules = RULES) -> None:
        self.tracker, self.t, self.n = Tracker(rules), 0.0, {}

    def at(self, t: float) -> "Script":
        self.t = t
        return self

    def beat(self, *replicas: str) -> "Script":
        for r in replicas:
            self.tracker.heartbeat(r, self.t)
        return self

    def ask(self, *replicas: str, step: int = 0, failed: bool = False) -> "Script":
        for r in replicas:
            self.n[r] = self.n.get(r, 0) + 1
            self.tracker.request(r, {"n": self.n[r], "step": step, "qid": 0, "failed": failed},
                                 self.t)
        return self

    def quorum(self) -> list[str] | None:
        decided, _ = self.tracker.decide(self.t)
        return decided and decided["members"]

    def quorum_id(self) -> int:
        return self.tracker.quorum_id


def test_a_fast_quorum_when_every_previous_member_asks_again_skips_the_next_two_checks():
    s = Script(Rules(min_replicas=1, join_timeout=0.5, heartbeat_timeout=1.0))
    assert s.beat("a", "b", "c", "d").ask("a").at(0.6).beat("a", "b", "c", "d").quorum() is None
    s.tracker.previous = ["a"]  # as if the last quorum had been a alone
    s.tracker.rules = Rules(min_replicas=3)  # the min_replicas check would refuse it
    # 1 of 4 healthy asked (no majority), b, c, d beat without asking (a join wait): fast
    assert s.quorum() == ["a"]
    assert s.at(0.7).ask("a", "c").quorum() == ["a", "c"]  # plus any other that asked


def test_without_a_fast_quorum_at_least_min_replicas_must_ask():
    s = Script(Rules(min_replicas=2, join_timeout=0.0, heartbeat_timeout=1.0))
    assert s.beat("a").ask("a").quorum() is None  # all healthy asked, but 1 < min_replicas
    assert s.at(0.5).beat("a", "b").ask("b").quorum() == ["a", "b"]


def test_more_than_half_of_the_heartbeating_replicas_must_ask():
    s = Script(Rules(min_replicas=1, join_timeout=0.0, heartbeat_timeout=10.0))
    s.beat("a", "b", "c", "d").ask("a", "b")
    assert s.at(5.0).quorum() is None  # 2 of 4: another 2 could form a quorum of their own
    assert s.ask("c").quorum() == ["a", "b", "c"]


def test_it_waits_up_to_the_join_timeout_for_replicas_that_beat_but_did_not_ask():
    s = Script()
    s.beat("a", "b", "c").ask("a", "b")
    assert s.at(0.49).beat("a", "b", "c").quorum() is None
    assert s.at(0.5).quorum() == ["a", "b"]
    s = Script()
    s.beat("a", "b", "c").ask("a", "b")
    assert s.at(0.1).ask("c").quorum() == ["a", "b", "c"]  # all asked: no wait


def test_a_request_left_out_of_a_quorum_waits_anew():
    s = Script()
    s.beat("a", "b", "c").ask("c")  # c asks, then stops beating: it is left out
    assert s.at(1.5).beat("a", "b").ask("a", "b").quorum() == ["a", "b"]
    s.at(1.6).beat("a", "c").ask("b")  # c is back; a beats but has not asked yet
    assert s.quorum() is None  # c's join wait counts from the last quorum, not from 0
    assert s.at(2.0).quorum() == ["b", "c"]


def test_a_replica_silent_for_the_heartbeat_timeout_is_dropped():
    s = Script()
    assert s.beat("a", "b").ask("a", "b").quorum() == ["a", "b"]
    s.at(0.2).beat("a").ask("a")  # b is killed: it neither beats nor asks
    assert s.at(0.99).beat("a").quorum() is None  # b may still come: not a majority
    assert s.at(1.0).quorum() == ["a"]


def test_the_quorum_id_changes_when_the_members_change_or_a_step_failed():
    s = Script()
    s.beat("a", "b").ask("a", "b").quorum()
    first = s.quorum_id()
    assert s.at(0.1).beat("a", "b").ask("a", "b").quorum() == ["a", "b"]
    assert s.quorum_id() == first  # the same members, no failure
    s.at(0.2).ask("a", failed=True).ask("b").quorum()
    assert s.quorum_id() == first + 1  # a's step aborted: a new group
    s.at(0.3).beat("a", "b", "c").ask("a", "b", "c").quorum()
    assert s.quorum_id() == first + 2  # c joined


def test_a_replica_started_again_is_a_new_member():
    s = Script()
    s.beat("r0-1", "r1-1").ask("r0-1", "r1-1").quorum()
    s.at(1.5).beat("r0-1", "r1-2").ask("r0-1", "r1-2")  # r1 restarted: a fresh id
    assert s.quorum() == ["r0-1", "r1-2"] and s.quorum_id() == 2


def test_it_keeps_the_largest_committed_step_and_logs_the_steps_redone():
    s = Script()
    s.beat("a", "b").ask("a", "b", step=10).quorum()
    s.at(2.0).beat("c").ask("c", step=7)  # a and b are gone; c loaded a checkpoint of step 7
    decided, _ = s.tracker.decide(2.0)
    assert decided["members"] == ["c"] and decided["steps"] == [7] and decided["seen"] == 10
    assert "steps 7 to 9 are redone" in s.tracker.events[-1][1]
    for step in (8, 9):  # the same quorum goes on: said once, not at every step
        s.at(2.0 + step / 100).beat("c").ask("c", step=step).quorum()
    assert sum("redone" in what for _, what in s.tracker.events) == 1


def test_a_replica_that_leaves_ends_the_run_and_every_later_request_is_told_so():
    s = Script()
    s.beat("a", "b").ask("a", "b").quorum()
    s.tracker.request("b", {"n": 2, "step": 20, "leaving": True}, 0.1)
    assert "lh/beat/b" in s.tracker.garbage  # b's keys go at once, no heartbeat timeout
    s.at(0.2).beat("a", "b").ask("a", step=19)  # a zombie back; b's beat (late) is ignored
    assert s.tracker.decide(0.2) == (None, "the run ended at step 20")
    assert s.tracker.outbox[-1] == ("lh/answer/a/2", '{"ended": 20}')
    assert "b" not in s.tracker.last_beat and s.tracker.max_step == 20


def test_a_replica_silent_for_forget_after_is_forgotten_with_its_keys():
    s = Script(Rules(heartbeat_timeout=1.0, forget_after=5.0))
    s.beat("a", "b").ask("a", "b").quorum()
    s.at(4.9).beat("a").ask("a").quorum()  # b was killed: dead, not yet forgotten
    assert "b" in s.tracker.last_beat and "lh/beat/b" not in s.tracker.garbage
    s.at(5.0).beat("a").ask("a").quorum()
    assert "b" not in s.tracker.last_beat and not s.tracker.requests.get("b")
    assert {"lh/beat/b", "lh/ask/b", "lh/answer/b/1"} <= set(s.tracker.garbage)


def test_a_quorum_s_group_and_last_votes_go_once_no_member_can_read_them():
    """Quorum 1 (a, b) ends at step 3 when b dies; a goes on in quorum 2. Quorum 1's keys
    go only once b is forgotten as well: a zombie b may still read its last vote."""
    s = Script(Rules(heartbeat_timeout=1.0, forget_after=5.0))
    for step in range(4):
        s.at(step / 10).beat("a", "b").ask("a", "b", step=step).quorum()
    first = s.quorum_id()
    s.at(2.0).beat("a").ask("a", step=4).quorum()  # b is dead: quorum 2, a alone
    assert not [k for k in s.tracker.garbage if f"/{first}/" in k]  # b may come back
    s.at(5.5).beat("a").ask("a", step=5).quorum()  # b forgotten
    assert set(s.tracker.garbage) >= {
        f"lh/vote/{first}/2/votes", f"lh/vote/{first}/2/decision", f"lh/vote/{first}/3/votes",
        f"lh/vote/{first}/3/decision", f"lh/group/{first}/0/0", f"lh/group/{first}/0/1"}
    assert list(s.tracker.open) == [first + 1]


def test_a_request_counts_once():
    s = Script()
    s.beat("a").ask("a").quorum()
    s.tracker.request("a", {"n": 1, "step": 0, "qid": 0, "failed": False}, 0.1)  # again
    assert s.at(0.1).quorum() is None


def test_the_rule_never_returns_an_empty_quorum():
    for previous in (None, [], ["a"]):
        assert quorum_members(0.0, {"a": 0.0}, {}, previous, RULES)[0] is None


# --- the service ---

def test_the_service_answers_over_its_store_and_a_closed_lighthouse_is_named():
    lighthouse = Lighthouse(rules=Rules(join_timeout=0.2, heartbeat_timeout=0.5),
                            tick=0.01).start()
    members = [Membership(lighthouse.address, f"r{i}", beat_every=0.05) for i in range(2)]
    answers = [[], []]

    def steps(i: int) -> None:
        for step in range(5):
            answers[i].append(members[i].ask(step, 0, False, timeout=10))
    threads = [threading.Thread(target=steps, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert [q.members for q in answers[0]] == [["r0", "r1"]] * 5 == [q.members for q in
                                                                         answers[1]]
        first = answers[0][0].id  # the lighthouse's start in ms: no other lighthouse's
        assert {q.id for q in answers[0]} == {first} and members[0].rules == lighthouse.rules
        assert abs(first / 1000 - time.time()) < 60
        members[1].close()  # r1 stops beating: r0 goes on alone after the heartbeat timeout
        started = time.monotonic()
        alone = members[0].ask(5, 1, False, timeout=10)
        assert alone.members == ["r0"] and alone.id == first + 1
        assert 0.3 <= time.monotonic() - started < 5
    finally:
        lighthouse.close()
    with pytest.raises(LighthouseGone, match=f"lighthouse at {lighthouse.address} is gone"):
        members[0].ask(6, 2, False, timeout=10)
    members[0].close()


def test_a_replica_of_another_run_is_refused_naming_what_differs():
    with Lighthouse(rules=Rules(join_timeout=0.2, heartbeat_timeout=0.5)) as lighthouse:
        first = Membership(lighthouse.address, "r0")
        other = Membership(lighthouse.address, "r1")
        try:
            first.join_run({"global_batch_size": 64, "lr": 0.1})
            first.join_run({"global_batch_size": 64, "lr": 0.1})  # the same run: welcome
            with pytest.raises(ValueError, match=r"there \{'global_batch_size': 64\}, here "
                                                 r"\{'global_batch_size': 32\}"):
                other.join_run({"global_batch_size": 32, "lr": 0.1})
        finally:
            first.close()
            other.close()


def test_ids_that_are_no_replica_s_never_deafen_the_lighthouse():
    """A name with a space is refused where it is given; a registration that is not a
    replica's (another client's, keys missing) is ignored, and quorums go on."""
    with pytest.raises(ValueError, match="replica id 'gpu 0-ab12cd': use letters"):
        Membership("127.0.0.1:1", "gpu 0-ab12cd")
    with pytest.raises(SystemExit):
        train_ft.parse_args(["--lighthouse", "127.0.0.1:1", "--name", "gpu 0"])
    with Lighthouse(rules=Rules(join_timeout=0.1), tick=0.01) as lighthouse:
        host, port = lighthouse.address.split(":")
        dist.TCPStore(host, int(port), is_master=False).append("lh/joins", "gpu 0-ab12cd ")
        member = Membership(lighthouse.address, "r0", beat_every=0.05)
        try:
            assert [member.ask(step, 0, False, timeout=10).members for step in range(3)] == \
                [["r0"]] * 3
        finally:
            member.close()
        ignored = [what for _, what in lighthouse.events if what.startswith("ignored")]
    assert ignored == ["ignored the registration 'gpu': not a replica id with its keys",
                       "ignored the registration '0-ab12cd': not a replica id with its keys"]


def test_quorum_ids_never_repeat_across_lighthouses():
    """A version (step, quorum id) from an earlier lighthouse's run never equals one of
    this run's: two histories at one step still differ, and one heals from the other."""
    ids = []
    for _ in range(2):
        with Lighthouse(rules=Rules(join_timeout=0.1), tick=0.01) as lighthouse:
            member = Membership(lighthouse.address, "r0", beat_every=0.05)
            try:
                ids.append(member.ask(0, 0, False, timeout=10).id)
                ids.append(member.ask(1, ids[-1], True, timeout=10).id)  # a new quorum
            finally:
                member.close()
    assert ids[0] < ids[1] < ids[2] < ids[3], ids


@pytest.fixture
def patience(monkeypatch):
    monkeypatch.setattr(quorum, "PATIENCE_S", 0.2)  # a waiting replica reads why every 0.2 s


def test_a_replica_waiting_for_min_replicas_says_so_and_so_does_its_error(patience):
    heard = []
    with Lighthouse(rules=Rules(min_replicas=2, join_timeout=0.1), tick=0.01) as lighthouse:
        member = Membership(lighthouse.address, "r0", beat_every=0.05)
        try:
            with pytest.raises(TimeoutError, match=r"no quorum within 1 s \(lighthouse .*\): "
                                                   "1 asked, fewer than min_replicas 2"):
                member.ask(0, 0, False, timeout=1, waiting=heard.append)
        finally:
            member.close()
    assert heard == ["1 asked, fewer than min_replicas 2"]


def test_a_replica_waiting_for_a_lighthouse_that_hangs_says_so(patience, monkeypatch):
    stuck = threading.Event()
    with Lighthouse(rules=Rules(join_timeout=0.1), tick=0.01) as lighthouse:
        member = Membership(lighthouse.address, "r0", beat_every=0.05)
        monkeypatch.setattr(lighthouse.tracker, "decide", lambda now: stuck.wait(30))
        try:
            with pytest.raises(TimeoutError, match="has not looked at the requests for "
                                                   r"[0-9.]+ s: it hangs"):
                member.ask(0, 0, False, timeout=1)
        finally:
            stuck.set()
            member.close()


def test_a_replica_whose_heartbeat_died_stops_waiting_naming_it(patience):
    """Without beats it would be left out of every quorum: it ends instead, at once."""
    class Broken:
        def add(self, key: str, amount: int) -> int:
            raise ValueError("injected")
    with Lighthouse(rules=Rules(min_replicas=2), tick=0.01) as lighthouse:
        member = Membership(lighthouse.address, "r0", beat_every=0.05)
        member._beats = Broken()
        started = time.monotonic()
        try:
            with pytest.raises(LighthouseGone, match=r"this replica's heartbeat stopped "
                                                     r"\(ValueError: injected\)"):
                member.ask(0, 0, False, timeout=30)
        finally:
            member.close()
    assert time.monotonic() - started < 5


def test_an_unexpected_error_ends_the_lighthouse_loudly_and_replicas_see_it_gone():
    """A request that is not JSON (another client's) stops python -m dpcourse.lighthouse,
    exit code 1 and the error printed, rather than leave a store that takes requests nobody
    answers."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "dpcourse.lighthouse", "--port",
                                str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        assert "listening" in process.stdout.readline()
        member = Membership(f"127.0.0.1:{port}", "r0", beat_every=0.05)
        other = dist.TCPStore("127.0.0.1", port, is_master=False)
        other.add("lh/beat/x", 1)
        other.set("lh/ask/x", "not JSON")
        other.append("lh/joins", "x ")
        started = time.monotonic()
        try:
            with pytest.raises(LighthouseGone, match=f"the lighthouse at 127.0.0.1:{port} is "
                                                     "gone"):
                member.ask(0, 0, False, timeout=30)
        finally:
            member.close()
        assert time.monotonic() - started < 10
        assert process.wait(10) == 1
        assert "stopped by an unexpected error (JSONDecodeError" in process.stderr.read()
    finally:
        process.kill()
        process.communicate()


def test_an_unexpected_error_closes_an_in_process_lighthouse_s_store(monkeypatch):
    """Threads of a notebook or a test: no process exit closes the store for them."""
    def broken(now: float) -> None:
        raise KeyError("injected")
    with Lighthouse(tick=0.01) as lighthouse:
        member = Membership(lighthouse.address, "r0", beat_every=0.05)
        monkeypatch.setattr(lighthouse.tracker, "decide", broken)
        try:
            with pytest.raises(LighthouseGone, match=f"the lighthouse at {lighthouse.address} "
                                                     "is gone"):
                member.ask(0, 0, False, timeout=30)
        finally:
            member.close()
    assert lighthouse.error == "KeyError: 'injected'"
    assert lighthouse.events[-1][1] == "stopped by an unexpected error: KeyError: 'injected'"


def test_a_store_call_that_times_out_names_the_lighthouse():
    """Not a bare DistStoreError. (A lighthouse process stopped with SIGSTOP is another
    case: torch 2.14.1's TCPStore client then waits in add or get with no timeout, and the
    replica's watchdog ends it, saying so.)"""
    with Lighthouse(tick=0.01) as lighthouse:
        member = Membership(lighthouse.address, "r0", beat_every=0.05)
        try:
            with pytest.raises(LighthouseGone, match=f"the lighthouse at {lighthouse.address} "
                                                     r"did not answer \(voting: "):
                member.call("voting", lambda: member.store.wait(["lh/vote/never"],
                                                                timedelta(seconds=0.1)))
        finally:
            member.close()
