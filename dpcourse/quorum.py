"""Chapter 13: a replica's side of the quorum. It registers with the lighthouse and beats there
from a thread of its own (``Membership``), asks for a quorum before each step, builds a
process group per quorum under that quorum's own store prefix (``quorum_group``: a straggler of
an older quorum can never join it), and after the step's allreduce votes (``vote``): one
decision per (quorum id, step), taken atomically in the lighthouse's store.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from .lighthouse import Rules

T = TypeVar("T")


class LighthouseGone(ConnectionError):
    """The lighthouse's store does not answer: training cannot go on safely."""


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


class Membership:
    """This replica's standing with the lighthouse at address: registered under replica_id,
    beating every beat_every seconds (on a store client of its own) until close()."""

    def __init__(self, address: str, replica_id: str, beat_every: float = 0.1,
                 connect_timeout: float = 30.0) -> None:
        self.address, self.replica_id, self.requests = address, replica_id, 0
        self.store = connect(address, connect_timeout)  # the main thread's client
        self.rules = Rules(**json.loads(self.store.get("lh/settings")))
        self.gone: str | None = None  # what the heartbeat thread saw go wrong
        self._beats = connect(address, connect_timeout)
        self._beats.add(f"lh/beat/{replica_id}", 1)
        self._beats.set(f"lh/ask/{replica_id}", "")
        self._beats.append("lh/replicas", f"{replica_id} ")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(beat_every,),
                                        name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, every: float) -> None:
        try:
            while not self._stop.wait(every):
                self._beats.add(f"lh/beat/{self.replica_id}", 1)
        except RuntimeError as error:
            self.gone = str(error)

    def close(self) -> None:
        """Stop beating: the lighthouse drops this replica after its heartbeat timeout."""
        self._stop.set()
        self._thread.join()

    def call(self, what: str, operation: Callable[[], T]) -> T:
        """operation() on the store, a lost lighthouse raised as LighthouseGone naming it."""
        try:
            return operation()
        except dist.DistStoreError:
            raise  # a wait that timed out: the caller decides
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
        """Tell the lighthouse this replica is done, at step: it stops counting it at once."""
        self.requests += 1
        request = json.dumps({"n": self.requests, "step": step, "leaving": True})
        self.call("leaving", lambda: (self.store.set(f"lh/ask/{self.replica_id}", request),
                                      self.store.set("lh/wake", "")))

    def ask(self, step: int, qid: int, failed: bool, timeout: float) -> Quorum:
        """Ask for the next quorum with this replica's version (step, qid; failed: its last
        attempt aborted) and wait up to timeout seconds for it."""
        self.requests += 1
        me, n = self.replica_id, self.requests
        request = json.dumps({"n": n, "step": step, "qid": qid, "failed": failed})
        answer = f"lh/answer/{me}/{n}"

        def ask() -> dict[str, Any]:
            self.store.set(f"lh/ask/{me}", request)
            self.store.set("lh/wake", "")
            try:
                self.store.wait([answer], timedelta(seconds=timeout))
            except dist.DistStoreError:
                raise TimeoutError(f"no quorum within {timeout:g} s (lighthouse "
                                   f"{self.address})") from None
            quorum = json.loads(self.store.get(answer))
            self.store.delete_key(answer)
            return quorum
        return Quorum(**self.call("asking for a quorum", ask))


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
