"""The lighthouse's rules, each on a scripted sequence of heartbeats and requests (its Tracker:
no I/O, times given), in torchft's order; then the service over its store, with replicas'
Memberships."""
import threading
import time

import pytest

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


def test_a_replica_that_leaves_is_never_a_member_again_and_its_step_counts():
    s = Script()
    s.beat("a", "b").ask("a", "b").quorum()
    s.tracker.request("b", {"n": 2, "step": 20, "leaving": True}, 0.1)
    s.at(0.2).beat("a", "b").ask("a", step=19)
    decided, _ = s.tracker.decide(0.2)  # b needs no heartbeat timeout to be gone
    assert decided["members"] == ["a"] and decided["seen"] == 20


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
        assert {q.id for q in answers[0]} == {1} and members[0].rules == lighthouse.rules
        members[1].close()  # r1 stops beating: r0 goes on alone after the heartbeat timeout
        started = time.monotonic()
        alone = members[0].ask(5, 1, False, timeout=10)
        assert alone.members == ["r0"] and alone.id == 2
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
