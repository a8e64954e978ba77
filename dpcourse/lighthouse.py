"""Chapter 13: the lighthouse, which forms a quorum of replicas before every step.

    python -m dpcourse.lighthouse --port 29510 --heartbeat-timeout 1

It hosts a TCP store that is its only means of talking: each replica registers there, beats
there, and asks there for a quorum with its version (committed steps, and the quorum id of
its last commit); the lighthouse answers each member under a key of that request. The same
store holds the replicas' votes and each quorum's process group (chapter 13's ``quorum``).
``quorum_members`` is the rule, as torchft's (``src/lighthouse.rs``, ``quorum_compute``):
a pure function of what the lighthouse heard and when. Keys, under ``lh/``:

    replicas            every replica id ever registered, separated by spaces
    beat/ID             a counter the replica adds to; a change is a heartbeat
    ask/ID              its latest request (JSON: n, step, qid, failed; or leaving), "" at first
    answer/ID/N         the quorum answering its request n (JSON)
    wake                set after each request (and by a ticker): the lighthouse looks again
    settings            the lighthouse's rules (JSON), which replicas read to size timeouts
    run                 what shapes the training (JSON), set by the first replica to join
    group/QID/...       the gloo group of quorum QID (quorum.quorum_group)
    vote/QID/STEP/...   the votes and the decision of a step (quorum.vote)
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Rules:
    """min_replicas: the fewest members of a quorum; join_timeout: seconds a quorum waits for
    replicas that beat but have not asked; heartbeat_timeout: seconds of silence after which a
    replica counts as dead."""
    min_replicas: int = 1
    join_timeout: float = 0.5
    heartbeat_timeout: float = 1.0


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
    and requests with their times in, quorums out. ``events`` lists (time, what)."""

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.last_beat: dict[str, float] = {}
        self.requests: dict[str, dict] = {}  # each waiting replica's request
        self.asked: dict[str, float] = {}  # and when it came
        self.answered: dict[str, int] = {}  # the last request number answered, per replica
        self.left: set[str] = set()  # replicas done: never members again
        self.previous: list[str] | None = None  # the last quorum's members
        self.quorum_id = self.max_step = 0  # max_step: the most steps committed it has seen
        self.events: list[tuple[float, str]] = []

    def heartbeat(self, replica: str, now: float) -> None:
        if replica not in self.left:
            self.last_beat[replica] = now

    def request(self, replica: str, request: dict, now: float) -> None:
        """A request (n: its number, step, qid, failed; or leaving) counts once, and as a
        heartbeat."""
        if request["n"] <= max(self.answered.get(replica, 0),
                               self.requests.get(replica, {"n": 0})["n"]):
            return
        if request.get("leaving"):
            self.max_step = max(self.max_step, request["step"])
            self.left.add(replica)
            self.last_beat.pop(replica, None)
            self.events.append((now, f"{replica} left at step {request['step']}"))
        else:
            self.requests[replica], self.asked[replica] = request, now
            self.last_beat[replica] = now

    def decide(self, now: float) -> tuple[dict | None, str]:
        """The quorum, if one is ready (id, members, their steps and qids, seen: max_step),
        and why (or None and why not). Its id is new if its members changed or a member's
        last step failed; ``answered`` then holds the request each member is answered in."""
        members, reason = quorum_members(now, self.last_beat, self.asked, self.previous,
                                         self.rules)
        if members is None:
            return None, reason
        requests = [self.requests[r] for r in members]
        failed = [r for r, q in zip(members, requests) if q["failed"]]
        if members != self.previous or failed:
            self.quorum_id += 1
            why = "members changed" if members != self.previous else f"{failed} failed a step"
            self.events.append((now, f"quorum {self.quorum_id}: {members} ({reason}; {why})"))
        steps = [q["step"] for q in requests]
        self.max_step = max(self.max_step, *steps)
        if max(steps) < self.max_step:
            self.events.append((now, f"quorum {self.quorum_id} starts at step {max(steps)}: "
                                     f"steps {max(steps)} to {self.max_step - 1} are redone "
                                     "(every replica that had them is gone)"))
        quorum = {"id": self.quorum_id, "members": members, "steps": steps,
                  "qids": [q["qid"] for q in requests], "seen": self.max_step}
        for r, q in zip(members, requests):
            self.answered[r] = q["n"]
            del self.requests[r], self.asked[r]
        self.asked = dict.fromkeys(self.asked, now)  # the others wait anew
        self.previous = members
        return quorum, reason


class Lighthouse:
    """The service: a TCP store at host:port (0: a free port; ``address`` says which) and a
    thread that feeds a Tracker what the replicas write there and writes its answers back.
    ``events`` lists (seconds since the start, what); ``close()`` ends it all."""

    def __init__(self, port: int = 0, host: str = "0.0.0.0", rules: Rules = Rules(),
                 tick: float = 0.05, verbose: bool = False) -> None:
        self.rules, self.tick, self.verbose = rules, tick, verbose
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   use_libuv=True)
        self.port = self.store.port
        self.address = f"{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"
        self.store.set("lh/replicas", "")
        self.store.set("lh/settings", json.dumps(asdict(rules)))
        self.tracker, self.beats = Tracker(rules), {}
        self.start_time, self.stopped, self.logged = time.monotonic(), threading.Event(), 0
        self.threads = [threading.Thread(target=self._loop, name="lighthouse", daemon=True),
                        threading.Thread(target=self._ticker, name="lighthouse-ticker",
                                         daemon=True)]

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
        self.store.set("lh/wake", "")
        for thread in self.threads:
            thread.join(5)
        del self.store

    def __enter__(self) -> Lighthouse:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _client(self) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", self.port, is_master=False,
                             timeout=timedelta(seconds=10))

    def _ticker(self) -> None:
        """Wake the loop every tick, so that silent replicas expire and joins time out."""
        store = self._client()
        while not self.stopped.wait(self.tick):
            store.set("lh/wake", "")

    def _loop(self) -> None:
        store, reason = self._client(), ""
        while not self.stopped.is_set():
            store.wait(["lh/wake"], timedelta(days=1))
            store.delete_key("lh/wake")  # before reading: a request after this wakes us again
            self._listen(store, time.monotonic())
            now = time.monotonic()
            quorum, why = self.tracker.decide(now)
            for replica in quorum["members"] if quorum else []:
                n = self.tracker.answered[replica]
                store.set(f"lh/answer/{replica}/{n}", json.dumps(quorum))
            waited = now - min(self.tracker.asked.values(), default=now)
            if quorum is None and why != reason and waited > self.tick:
                reason = why  # a wait of more than a tick (else: between two steps)
                self.tracker.events.append((now, f"no quorum yet: {why}"))
            elif quorum is not None:
                reason = ""
            if self.verbose:
                for t, what in self.events[self.logged:]:
                    print(f"lighthouse {t:8.3f} s: {what}", flush=True)
                self.logged = len(self.tracker.events)

    def _listen(self, store: dist.Store, now: float) -> None:
        """Feed the tracker every registered replica's heartbeat (its counter moved) and
        request."""
        ids = [r for r in store.get("lh/replicas").decode().split()
               if r not in self.tracker.left]
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
    args = p.parse_args(argv)
    if args.min_replicas < 1 or args.join_timeout < 0 or args.heartbeat_timeout <= 0:
        p.error("--min-replicas needs at least 1, the timeouts more than 0")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run a lighthouse until interrupted."""
    args = parse_args(argv)
    rules = Rules(args.min_replicas, args.join_timeout, args.heartbeat_timeout)
    with Lighthouse(args.port, args.host, rules, verbose=True) as lighthouse:
        print(f"lighthouse listening on {args.host}:{lighthouse.port} ({rules})", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
