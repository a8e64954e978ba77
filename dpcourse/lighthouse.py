"""Chapter 13: the lighthouse, which forms a quorum of replicas before every step.

    python -m dpcourse.lighthouse --port 29510 --heartbeat-timeout 1

It hosts a TCP store that is its only means of talking: each replica registers there, beats
there, and asks there for a quorum with its version (committed steps, and the quorum id of
its last commit); the lighthouse answers each member under a key of that request. The same
store holds the replicas' votes and each quorum's process group (chapter 13's ``quorum``).
``quorum_members`` is the rule, as torchft's (``src/lighthouse.rs``, ``quorum_compute``):
a pure function of what the lighthouse heard and when. Keys, under ``lh/``:

    joins               replica ids registered since the lighthouse last looked, then ""
    beat/ID             a counter the replica adds to; a change is a heartbeat
    ask/ID              its latest request (JSON: n, step, qid, failed; or leaving), "" at first
    answer/ID/N         the answer to its request n (JSON: a quorum, or the step the run ended)
    wake                set after each request (and by a ticker): the lighthouse looks again
    status              the lighthouse's loop count and why no quorum is ready (JSON)
    settings            the lighthouse's rules (JSON), which replicas read to size timeouts
    run                 what shapes the training (JSON), set by the first replica to join
    group/QID/...       the gloo group of quorum QID (quorum.quorum_group), or of each
                        shard of its groups' (group/QID/shard/R/..., chapter 14)
    vote/QID/STEP/...   the votes and the decision of a step (quorum.vote)

The store stays small over any run: a replica that leaves, or stays silent for
``forget_after``, is forgotten with its keys, and a quorum's group and last votes are
deleted once none of its members can read them again (its earlier votes go as it commits).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a key in the store, a word in joins
EVENTS_KEPT = 10_000  # the lighthouse's log keeps the latest events only


@dataclass(frozen=True)
class Rules:
    """min_replicas: the fewest members of a quorum; join_timeout: seconds a quorum waits for
    replicas that beat but have not asked; heartbeat_timeout: seconds of silence after which a
    replica counts as dead; forget_after: seconds of silence after which its keys go too."""
    min_replicas: int = 1
    join_timeout: float = 0.5
    heartbeat_timeout: float = 1.0
    forget_after: float = 30.0


def quorum_members(now: float, last_beat: dict[str, float], asked: dict[str, float],
                   previous: list[str] | None, rules: Rules) -> tuple[list[str] | None, str]:
    """The quorum's members in a fixed order (sorted ids), or None if none is ready, and why.
    last_beat: each replica's latest heartbeat; asked: when each replica waiting for a quorum
    asked; previous: the members of the last quorum. Only healthy replicas count (a beat less
    than heartbeat_timeout ago). A fast quorum when every previous member asked again; else at
    least min_replicas, more than half of the healthy replicas, and, unless every healthy
    replica asked, join_timeout since the first request."""
    healthy = {r for r, t in last_beat.items() if now - t < rules.heartbeat_timeout}
    asking = sorted(r for r in asked if r in healthy)
    if previous and all(r in asking for r in previous):
        return asking, f"fast quorum: the {len(previous)} previous members asked again"
    if len(asking) < rules.min_replicas:
        return None, f"{len(asking)} asked, fewer than min_replicas {rules.min_replicas}"
    if len(asking) <= len(healthy) // 2:
        return None, f"{len(asking)} of {len(healthy)} healthy replicas asked: not a majority"
    if len(asking) < len(healthy) and now - min(asked[r] for r in asking) < rules.join_timeout:
        return None, (f"{len(asking)} of {len(healthy)} healthy replicas asked: waiting up to "
                      f"{rules.join_timeout:g} s for the others")
    return asking, f"{len(asking)} of {len(healthy)} healthy replicas asked"


class Tracker:
    """What the lighthouse heard and decided, without any I/O (tests script it): heartbeats
    and requests with their times in; quorums, the answers to write (``outbox``) and the keys
    to delete (``garbage``) out. ``events`` lists (time, what), the latest EVENTS_KEPT."""

    def __init__(self, rules: Rules, first_id: int = 0) -> None:
        self.rules = rules
        self.last_beat: dict[str, float] = {}  # every replica it knows, and its latest beat
        self.requests: dict[str, dict] = {}  # each waiting replica's request
        self.asked: dict[str, float] = {}  # and when it came
        self.answered: dict[str, int] = {}  # the last request number answered, per replica
        self.left: set[str] = set()  # replicas done: never members again
        self.previous: list[str] | None = None  # the last quorum's members
        self.quorum_id, self.max_step = first_id, 0  # max_step: the most steps committed seen
        self.ended: int | None = None  # the step the first replica left at: the run is over
        self.open: dict[int, dict] = {}  # quorums whose keys a member may still read
        self.outbox: list[tuple[str, str]] = []  # (key, value): the answers to write
        self.garbage: list[str] = []  # the keys to delete
        self.events: deque[tuple[float, str]] = deque(maxlen=EVENTS_KEPT)
        self.noted = 0  # events noted in all

    def note(self, now: float, what: str) -> None:
        self.events.append((now, what))
        self.noted += 1

    def heartbeat(self, replica: str, now: float) -> None:
        if replica not in self.left:
            self.last_beat[replica] = now

    def request(self, replica: str, request: dict, now: float) -> None:
        """A request (n: its number, step, qid, failed; or leaving) counts once, and as a
        heartbeat. The first replica to leave ends the run: it committed every step."""
        if replica in self.left or request["n"] <= max(
                self.answered.get(replica, 0), self.requests.get(replica, {"n": 0})["n"]):
            return
        if request.get("leaving"):
            self.max_step = max(self.max_step, request["step"])
            self.ended = request["step"] if self.ended is None else self.ended
            self.left.add(replica)
            self.note(now, f"{replica} left at step {request['step']}")
            self.forget(replica)
        else:
            self.requests[replica], self.asked[replica] = request, now
            self.last_beat[replica] = now

    def forget(self, replica: str) -> None:
        """Drop replica and its keys (it left, or was silent for forget_after); a quorum whose
        members are all done with it goes too."""
        for known in (self.last_beat, self.requests, self.asked):
            known.pop(replica, None)
        n = self.answered.pop(replica, None)
        self.garbage += [f"lh/beat/{replica}", f"lh/ask/{replica}",
                         *([f"lh/answer/{replica}/{n}"] if n else [])]
        self._done_with_quorums(replica, but=None)

    def _done_with_quorums(self, replica: str, but: int | None) -> None:
        """replica will read no key of any open quorum but `but` again: retire those it was
        the last member of, deleting their group and their last two steps' votes."""
        for qid in [q for q in self.open if q != but]:
            quorum = self.open[qid]
            quorum["pending"].discard(replica)
            if not quorum["pending"]:
                del self.open[qid]
                last = quorum["last"]
                self.garbage += [f"lh/vote/{qid}/{step}/{key}" for step in (last - 1, last)
                                 for key in ("votes", "decision")]
                self.garbage += [f"lh/group/{qid}/0/{rank}" if quorum["shards"] == 1 else
                                 f"lh/group/{qid}/shard/{shard}/0/{rank}"
                                 for shard in range(quorum["shards"])
                                 for rank in range(quorum["size"])]

    def expire(self, now: float) -> None:
        """Forget every replica silent for forget_after (if it comes back, it registers
        again)."""
        for replica, beat in list(self.last_beat.items()):
            if now - beat >= self.rules.forget_after:
                self.note(now, f"forgot {replica}: silent for {now - beat:.1f} s")
                self.forget(replica)

    def decide(self, now: float) -> tuple[dict | None, str]:
        """The quorum, if one is ready (id, members, their steps and qids, seen: max_step),
        and why (or None and why not); each member's answer goes to ``outbox``. Its id is new
        if its members changed or a member's last step failed. Once the run has ended, every
        request is answered with the step it ended at."""
        self.expire(now)
        if self.ended is not None:
            for replica, request in self.requests.items():
                self._answer(replica, request, {"ended": self.ended})
                self.note(now, f"{replica} asked at step {request['step']}, after the run "
                               f"ended at step {self.ended}: told so")
            self.requests.clear()
            self.asked.clear()
            return None, f"the run ended at step {self.ended}"
        members, reason = quorum_members(now, self.last_beat, self.asked, self.previous,
                                         self.rules)
        if members is None:
            return None, reason
        requests = [self.requests[r] for r in members]
        failed = [r for r, q in zip(members, requests) if q["failed"]]
        new = members != self.previous or bool(failed)
        steps = [q["step"] for q in requests]
        if new:
            self.quorum_id += 1
            why = "members changed" if members != self.previous else f"{failed} failed a step"
            self.note(now, f"quorum {self.quorum_id}: {members} ({reason}; {why})")
            if max(steps) < self.max_step:
                self.note(now, f"quorum {self.quorum_id} starts at step {max(steps)}: steps "
                               f"{max(steps)} to {self.max_step - 1} are redone (every "
                               "replica that had them is gone)")
        self.max_step = max(self.max_step, *steps)
        quorum = {"id": self.quorum_id, "members": members, "steps": steps,
                  "qids": [q["qid"] for q in requests], "seen": self.max_step}
        for r, q in zip(members, requests):
            self._answer(r, q, quorum)
            del self.requests[r], self.asked[r]
            self._done_with_quorums(r, but=self.quorum_id)
        self.open.setdefault(self.quorum_id, {"pending": set(members), "size": len(members),
                                              "shards": requests[0].get("shards", 1)})
        self.open[self.quorum_id]["last"] = max(steps)  # the step its members attempt now
        self.asked = dict.fromkeys(self.asked, now)  # the others wait anew
        self.previous = members
        return quorum, reason

    def _answer(self, replica: str, request: dict, answer: dict) -> None:
        self.answered[replica] = request["n"]
        self.outbox.append((f"lh/answer/{replica}/{request['n']}", json.dumps(answer)))


class Lighthouse:
    """The service: a TCP store at host:port (0: a free port; ``address`` says which) and a
    thread that feeds a Tracker what the replicas write there and writes its answers back.
    Its quorum ids start at its start time in milliseconds: no two lighthouses issue the same
    one (unless the clock goes back), so a version from another's run never equals one of
    this run's. ``events`` lists (seconds since the start, what); ``close()`` ends it all. An
    unexpected error in its threads closes the store too (replicas then fail, naming the
    lighthouse), and ``error`` says what it was."""

    def __init__(self, port: int = 0, host: str = "0.0.0.0", rules: Rules = Rules(),
                 tick: float = 0.05, verbose: bool = False) -> None:
        self.rules, self.tick, self.verbose = rules, tick, verbose
        self.store: dist.TCPStore | None = dist.TCPStore(host, port, is_master=True,
                                                         wait_for_workers=False, use_libuv=True)
        self.port = self.store.port
        self.address = f"{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"
        for key, value in (("lh/joins", ""), ("lh/settings", json.dumps(asdict(rules))),
                           ("lh/status", json.dumps({"loop": 0, "why": ""}))):
            self.store.set(key, value)
        self.tracker, self.beats = Tracker(rules, first_id=int(time.time() * 1000)), {}
        self.start_time, self.stopped, self.logged = time.monotonic(), threading.Event(), 0
        self.error: str | None = None
        self.threads = [threading.Thread(target=self._guarded, args=(body,), name=name,
                                         daemon=True)
                        for body, name in ((self._loop, "lighthouse"),
                                           (self._ticker, "lighthouse-ticker"))]

    @property
    def events(self) -> list[tuple[float, str]]:
        return [(t - self.start_time, what) for t, what in self.tracker.events]

    def start(self) -> Lighthouse:
        for thread in self.threads:
            thread.start()
        return self

    def close(self) -> None:
        """Stop answering and close the store (replicas then fail, naming the lighthouse)."""
        self.stopped.set()
        store = self.store
        if store is not None:
            store.set("lh/wake", "")
        for thread in self.threads:
            thread.join(5)
        self.store = None

    def __enter__(self) -> Lighthouse:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _guarded(self, body: Callable[[], None]) -> None:
        """Run body; an unexpected error stops the lighthouse loudly, its store closed, rather
        than leave a store that takes requests nobody answers."""
        try:
            body()
        except BaseException as error:  # noqa: BLE001 - any error ends the service, loudly
            if self.stopped.is_set():
                return  # closing: a call on the closing store failed
            self.error = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            print(f"lighthouse: stopped by an unexpected error ({self.error}):",
                  file=sys.stderr, flush=True)
            traceback.print_exc()
            self.tracker.note(time.monotonic(), f"stopped by an unexpected error: {self.error}")
            self.stopped.set()
            self.store = None  # the server goes with its last reference

    def _client(self) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", self.port, is_master=False,
                             timeout=timedelta(seconds=10))

    def _ticker(self) -> None:
        """Wake the loop every tick, so that silent replicas expire and joins time out."""
        store = self._client()
        while not self.stopped.wait(self.tick):
            store.set("lh/wake", "")

    def _loop(self) -> None:
        store, reason, loops = self._client(), "", 0
        while not self.stopped.is_set():
            store.wait(["lh/wake"], timedelta(days=1))
            store.delete_key("lh/wake")  # before reading: a request after this wakes us again
            self._listen(store, time.monotonic())
            now = time.monotonic()
            quorum, why = self.tracker.decide(now)
            outbox, self.tracker.outbox = self.tracker.outbox, []
            for key, value in outbox:
                store.set(key, value)
            garbage, self.tracker.garbage = self.tracker.garbage, []
            for key in garbage:
                store.delete_key(key)
            if garbage:
                self.beats = {r: b for r, b in self.beats.items() if r in self.tracker.last_beat}
            waited = now - min(self.tracker.asked.values(), default=now)
            if quorum is None and why != reason and waited > self.tick:
                reason = why  # a wait of more than a tick (else: between two steps)
                self.tracker.note(now, f"no quorum yet: {why}")
            elif quorum is not None:
                reason = ""
            loops += 1
            store.set("lh/status", json.dumps({"loop": loops, "why": reason}))
            if self.verbose:
                fresh = min(self.tracker.noted - self.logged, len(self.tracker.events))
                for t, what in list(self.tracker.events)[len(self.tracker.events) - fresh:]:
                    print(f"lighthouse {t - self.start_time:8.3f} s: {what}", flush=True)
                self.logged = self.tracker.noted

    def _listen(self, store: dist.Store, now: float) -> None:
        """Take the replicas registered since the last look, then feed the tracker each known
        replica's heartbeat (its counter moved) and request."""
        joins = store.get("lh/joins")
        if joins and store.compare_set("lh/joins", joins, "") == b"":  # else: look again
            for replica in joins.decode().split():
                self._join(store, replica, now)
        ids = list(self.tracker.last_beat)
        if not ids:
            return
        beats = store.multi_get([f"lh/beat/{r}" for r in ids])
        asks = store.multi_get([f"lh/ask/{r}" for r in ids])
        for r, beat, ask in zip(ids, beats, asks):
            if self.beats.get(r) != beat:
                self.beats[r] = beat
                self.tracker.heartbeat(r, now)
            if ask:
                self.tracker.request(r, json.loads(ask), now)

    def _join(self, store: dist.Store, replica: str, now: float) -> None:
        """Know replica from now on, if it is a replica id whose keys are there."""
        if replica in self.tracker.last_beat or replica in self.tracker.left:
            return
        if REPLICA_ID.fullmatch(replica) and store.check([f"lh/beat/{replica}",
                                                           f"lh/ask/{replica}"]):
            self.tracker.heartbeat(replica, now)
        else:
            self.tracker.note(now, f"ignored the registration {replica!r}: not a replica id "
                                   "with its keys")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dpcourse.lighthouse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    p.add_argument("--port", type=int, default=29510, help="port (default 29510; 0: any free)")
    p.add_argument("--min-replicas", type=int, default=1, help="fewest members (default 1)")
    p.add_argument("--join-timeout", type=float, default=0.5,
                   help="seconds a quorum waits for beating replicas that have not asked "
                        "(default 0.5)")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0,
                   help="seconds without a beat after which a replica is dead (default 1)")
    p.add_argument("--forget-after", type=float, default=30.0,
                   help="seconds without a beat after which a replica's keys are deleted "
                        "(default 30; it registers again if it comes back)")
    args = p.parse_args(argv)
    if args.min_replicas < 1 or args.join_timeout < 0 or args.heartbeat_timeout <= 0:
        p.error("--min-replicas needs at least 1, the timeouts more than 0")
    if args.forget_after <= args.heartbeat_timeout:
        p.error("--forget-after must exceed --heartbeat-timeout")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run a lighthouse until interrupted; exit 1 if an unexpected error stopped it."""
    args = parse_args(argv)
    rules = Rules(args.min_replicas, args.join_timeout, args.heartbeat_timeout,
                  args.forget_after)
    with Lighthouse(args.port, args.host, rules, verbose=True) as lighthouse:
        print(f"lighthouse listening on {args.host}:{lighthouse.port} ({rules})", flush=True)
        try:
            lighthouse.stopped.wait()
        except KeyboardInterrupt:
            pass
    if lighthouse.error:
        sys.exit(f"lighthouse: stopped by an unexpected error: {lighthouse.error}")


if __name__ == "__main__":
    main()
