"""Chapter 13: a replica's side of the quorum. It registers with the lighthouse and beats there
from a thread of its own (``Membership``), asks for a quorum before each step, builds a
process group per quorum under that quorum's own store prefix (``quorum_group``: a straggler of
an older quorum can never join it), and after the step's allreduce votes (``vote``): one
decision per (quorum id, step), taken atomically in the lighthouse's store.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from .lighthouse import REPLICA_ID, Rules

T = TypeVar("T")


class LighthouseGone(ConnectionError):
    """The lighthouse's store does not answer: training cannot go on safely."""


class RunEnded(Exception):
    """The run this replica asked to train in has ended: its replicas committed every step
    and left."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the run ended at step {step}: its replicas committed every step "
                         "and left")
        self.step = step


@dataclass(frozen=True)
class Quorum:
    """A quorum as the lighthouse answers it: its id, its members in order, each member's
    version (committed steps, and the quorum id of its last commit), and the most steps the
    lighthouse has seen committed (more than the members': replicas now gone had them)."""
    id: int
    members: list[str]
    steps: list[int]
    qids: list[int]
    seen: int

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def max_step(self) -> int:
        return max(self.steps)


def connect(address: str, timeout: float) -> dist.TCPStore:
    """A client of the lighthouse's store at HOST:PORT; waits up to timeout for it."""
    host, port = address.rsplit(":", 1)
    try:
        return dist.TCPStore(host, int(port), is_master=False,
                             timeout=timedelta(seconds=timeout), use_libuv=True)
    except RuntimeError as error:
        raise LighthouseGone(f"no lighthouse answers at {address} within {timeout:g} s "
                             f"({error}); start one: python -m dpcourse.lighthouse") from None


PATIENCE_S = 2.0  # a replica waiting longer for a quorum reads why, and says it


class Membership:
    """This replica's standing with the lighthouse at address: registered under replica_id,
    beating every beat_every seconds (on a store client of its own) until close(). A beat
    that finds its counter gone (the lighthouse forgot a replica silent for forget_after)
    registers again; ``silences`` counts the gaps between beats longer than half that."""

    def __init__(self, address: str, replica_id: str, beat_every: float = 0.1,
                 connect_timeout: float = 30.0) -> None:
        if not REPLICA_ID.fullmatch(replica_id):
            raise ValueError(f"replica id {replica_id!r}: use letters, digits, '.', '_' and "
                             "'-' (at most 128, starting with a letter or digit); it is a key "
                             "in the lighthouse's store")
        self.address, self.replica_id, self.requests = address, replica_id, 0
        self.store = connect(address, connect_timeout)  # the main thread's client
        self.rules = Rules(**json.loads(self.store.get("lh/settings")))
        self.gone: str | None = None  # why the heartbeat thread ended, if it did
        self.silences, self.last_beat = 0, time.monotonic()
        self._beats = connect(address, connect_timeout)
        self._beats.add(f"lh/beat/{replica_id}", 1)
        self._register()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(beat_every,),
                                        name="heartbeat", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        """Its request key made if missing (never overwritten), then its id in lh/joins."""
        self._beats.compare_set(f"lh/ask/{self.replica_id}", "", "")
        self._beats.append("lh/joins", f"{self.replica_id} ")

    def _beat(self, every: float) -> None:
        try:
            while not self._stop.wait(every):
                count = self._beats.add(f"lh/beat/{self.replica_id}", 1)
                now = time.monotonic()
                if now - self.last_beat > self.rules.forget_after / 2:
                    self.silences += 1  # before last_beat moves: a reader sees one or the other
                self.last_beat = now
                if count == 1:  # forgotten while silent (stopped): known again from now on
                    self._register()
        except BaseException as error:  # noqa: BLE001 - any end of the beats must be acted on
            cause = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            self.gone = (f"the lighthouse at {self.address} did not answer (heartbeat: {cause})"
                         if isinstance(error, dist.DistStoreError) else
                         f"the lighthouse at {self.address} is gone (heartbeat: {cause})"
                         if isinstance(error, RuntimeError) else
                         f"this replica's heartbeat stopped ({cause}): every quorum would "
                         "leave it out")

    def silent_since(self, silences: int) -> bool:
        """Whether this replica was silent long enough to be forgotten since ``silences``
        was read (a gap that ended, or the one going on)."""
        return (time.monotonic() - self.last_beat > self.rules.forget_after / 2
                or self.silences != silences)

    def close(self) -> None:
        """Stop beating: the lighthouse drops this replica after its heartbeat timeout. A beat
        stuck in a store call (a lighthouse that stopped answering: add has no timeout) is
        left to end with the process."""
        self._stop.set()
        self._thread.join(5)

    def _beating(self) -> None:
        if self.gone:
            raise LighthouseGone(self.gone)

    def call(self, what: str, operation: Callable[[], T]) -> T:
        """operation() on the store, a lost lighthouse (or heartbeat) raised as LighthouseGone
        naming it."""
        self._beating()
        try:
            return operation()
        except dist.DistStoreError as error:
            raise LighthouseGone(f"the lighthouse at {self.address} did not answer ({what}: "
                                 f"{str(error).splitlines()[0]})") from error
        except RuntimeError as error:
            raise LighthouseGone(f"the lighthouse at {self.address} is gone ({what}: "
                                 f"{str(error).splitlines()[0]})") from error

    def join_run(self, run: dict[str, Any]) -> None:
        """Raise unless the run (what shapes the training) is the one the replicas already
        with this lighthouse train (the first to join sets it)."""
        mine = json.dumps(run, sort_keys=True)
        theirs = self.call("joining", lambda: self.store.compare_set("lh/run", "", mine))
        if theirs.decode() != mine:
            differ = {k: v for k, v in json.loads(theirs).items() if run.get(k) != v}
            raise ValueError(f"this replica's run differs from the one the lighthouse at "
                             f"{self.address} trains: there {differ}, here "
                             f"{ {k: run.get(k) for k in differ} }")

    def leave(self, step: int) -> None:
        """Stop beating, then tell the lighthouse this replica is done, at step: it stops
        counting it and deletes its keys at once."""
        self.close()
        self.requests += 1
        request = json.dumps({"n": self.requests, "step": step, "leaving": True})
        self.call("leaving", lambda: (self.store.set(f"lh/ask/{self.replica_id}", request),
                                      self.store.set("lh/wake", "")))

    def ask(self, step: int, qid: int, failed: bool, timeout: float,
            waiting: Callable[[str], None] = lambda why: None, shards: int = 1) -> Quorum:
        """Ask for the next quorum with this replica's version (step, qid; failed: its last
        attempt aborted) and wait up to timeout seconds for it; past PATIENCE_S, waiting(why)
        hears why none is ready each time that changes, and TimeoutError says it. RunEnded
        if the run is over. shards: a group's, each with a gloo group across the quorum."""
        self.requests += 1
        me, n = self.replica_id, self.requests
        request = json.dumps({"n": n, "step": step, "qid": qid, "failed": failed,
                              **({"shards": shards} if shards > 1 else {})})
        answer, deadline = f"lh/answer/{me}/{n}", time.monotonic() + timeout

        def ask() -> dict[str, Any]:
            why, loop, looped = "", None, time.monotonic()
            while True:  # the request again each round: a lighthouse that forgot us hears it
                self.store.set(f"lh/ask/{me}", request)
                self.store.set("lh/wake", "")
                left = deadline - time.monotonic()
                try:
                    self.store.wait([answer], timedelta(seconds=max(0.001, min(PATIENCE_S,
                                                                                left))))
                    if self.store.check([answer]):
                        break
                    continue  # forgotten since (a zombie), the answer with it: ask again
                except dist.DistStoreError:
                    self._beating()
                status = json.loads(self.store.get("lh/status"))
                if status["loop"] != loop:
                    loop, looped = status["loop"], time.monotonic()
                    now_why = status["why"] or ("the lighthouse forms quorums without this "
                                                "replica (do its heartbeats reach it?)")
                else:
                    now_why = (f"the lighthouse has not looked at the requests for "
                               f"{time.monotonic() - looped:.1f} s: it hangs (its log may say "
                               "why)")
                if now_why != why:
                    why = now_why
                    waiting(why)
                if left <= PATIENCE_S:
                    raise TimeoutError(f"no quorum within {timeout:g} s (lighthouse "
                                       f"{self.address}): {why}")
            decided = json.loads(self.store.get(answer))
            self.store.delete_key(answer)
            return decided
        decided = self.call("asking for a quorum", ask)
        if "ended" in decided:
            raise RunEnded(decided["ended"])
        return Quorum(**decided)


def quorum_group(store: dist.Store, quorum: Quorum, rank: int,
                 timeout: float) -> dist.ProcessGroup:
    """A gloo group of quorum's members, rank being this replica's place, met under the
    quorum's own prefix of store; its collectives fail after timeout seconds. gloo's abort()
    and shutdown() do nothing: drop every reference to it once its collectives end."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"lh/group/{quorum.id}", store), rank,
                                 quorum.size, timedelta(seconds=timeout))


def vote(store: dist.Store, quorum_id: int, step: int, size: int, ready: bool,
         timeout: float) -> bool:
    """Whether step commits in quorum quorum_id of size members. Each member adds its vote
    when ready (its allreduce succeeded); the member that brings the count to size sets the
    decision "commit", one that is not ready sets "abort", and one that waits timeout seconds
    without a decision sets "abort": whichever compare_set comes first decides for all."""
    decision = f"lh/vote/{quorum_id}/{step}/decision"
    if ready and store.add(f"lh/vote/{quorum_id}/{step}/votes", 1) == size:
        return store.compare_set(decision, "", "commit") == b"commit"
    if ready:
        try:
            store.wait([decision], timedelta(seconds=timeout))
        except dist.DistStoreError:
            pass  # no decision in time: abort, unless one came meanwhile
    return store.compare_set(decision, "", "abort") == b"commit"


def forget_vote(store: dist.Store, quorum_id: int, step: int) -> None:
    """Delete the keys of step's vote in quorum quorum_id: once a member commits the next
    step there, every member has read this decision (each took part in that allreduce)."""
    for key in ("votes", "decision"):
        store.delete_key(f"lh/vote/{quorum_id}/{step}/{key}")
