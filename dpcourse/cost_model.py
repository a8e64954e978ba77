"""Chapter 08: the alpha-beta cost model - fitted to measurements, used to predict.

A message of n bytes takes ``alpha + n * beta`` seconds: alpha is the fixed cost of one
message (latency, a system call, a barrier), beta the cost of one byte (1 / bandwidth). An
allreduce is a sequence of messages, so its time is again ``alpha' + n * beta'``; from that
the bucket-size model predicts how much of DDP's communication backward cannot hide.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence


@dataclass(frozen=True)
class AlphaBeta:
    """Seconds for n bytes: alpha (seconds per message) + n * beta (seconds per byte)."""
    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        """Predicted seconds for a message (or a whole collective) of nbytes."""
        check_bytes(nbytes, "nbytes")
        return self.alpha + nbytes * self.beta

    @property
    def bandwidth(self) -> float:
        """1 / beta: bytes per second once the fixed cost is paid."""
        return 1 / self.beta


def check_bytes(nbytes: float, what: str) -> None:
    """Raise a clear error unless nbytes is a finite size >= 0."""
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"{what} must be a finite number of bytes >= 0, got {nbytes}")


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """alpha and beta minimising the squared *relative* errors sum(((alpha + n beta) - t) / t)^2.

    Relative, not plain, least squares: plain residuals in seconds would let the largest
    messages decide alone, while we want every size from KiB to MiB predicted within a few %.
    It is least squares with each residual divided by t, solved in closed form; with noisy data
    alpha may come out negative (then small messages are not predicted: look at the fit).
    """
    if len(nbytes) != len(seconds):
        raise ValueError(f"got {len(nbytes)} sizes but {len(seconds)} timings")
    if len(nbytes) < 2:
        raise ValueError(f"fitting alpha and beta needs at least 2 points, got {len(nbytes)}")
    for n in nbytes:
        check_bytes(n, "every message size")
    if not all(math.isfinite(t) and t > 0 for t in seconds):
        raise ValueError(f"every timing must be a finite number of seconds > 0, got {seconds}")
    if len(set(nbytes)) < 2:
        raise ValueError("fitting alpha and beta needs at least 2 different message sizes")
    weights = [1 / t**2 for t in seconds]
    total = sum(weights)
    n_mean = sum(w * n for w, n in zip(weights, nbytes)) / total
    t_mean = sum(w * t for w, t in zip(weights, seconds)) / total
    covariance = sum(w * (n - n_mean) * (t - t_mean) for w, n, t in zip(weights, nbytes, seconds))
    variance = sum(w * (n - n_mean) ** 2 for w, n in zip(weights, nbytes))
    beta = covariance / variance
    return AlphaBeta(alpha=t_mean - beta * n_mean, beta=beta)


def relative_errors(cost: AlphaBeta, nbytes: Sequence[float],
                    seconds: Sequence[float]) -> list[float]:
    """(predicted - measured) / measured for each measurement: 0.3 means 30% too slow."""
    return [(cost.time(n) - t) / t for n, t in zip(nbytes, seconds)]


# --- allreduce of n bytes over p ranks, each message costing link = (alpha, beta) --------------

def check_ranks(p: int) -> None:
    """Raise a clear error unless p is a number of ranks >= 1."""
    if not (isinstance(p, int) and p >= 1):
        raise ValueError(f"the number of ranks p must be an integer >= 1, got {p!r}")


def naive_allreduce_cost(link: AlphaBeta, p: int) -> AlphaBeta:
    """Reduce to rank 0, then send back: 2(p-1) * (alpha + n beta).

    Rank 0 receives the p-1 whole tensors one after another, then sends the sum p-1 times,
    one after another (its link carries one message at a time); the additions are free.
    """
    check_ranks(p)
    return AlphaBeta(2 * (p - 1) * link.alpha, 2 * (p - 1) * link.beta)


def ring_allreduce_cost(link: AlphaBeta, p: int) -> AlphaBeta:
    """Reduce-scatter then all-gather round a ring: 2(p-1) * (alpha + n/p beta).

    2(p-1) steps, in each of which every rank sends n/p bytes to its neighbour, all at once.
    """
    check_ranks(p)
    return AlphaBeta(2 * (p - 1) * link.alpha, 2 * (p - 1) / p * link.beta)


def tree_allreduce_cost(link: AlphaBeta, p: int) -> AlphaBeta:
    """Binomial-tree reduce then broadcast: 2 ceil(log2 p) * (alpha + n beta).

    Each of the ceil(log2 p) rounds of the reduce, then of the broadcast, sends whole tensors,
    the pairs of a round all at once.
    """
    check_ranks(p)
    rounds = (p - 1).bit_length()  # ceil(log2 p), exact for integers
    return AlphaBeta(2 * rounds * link.alpha, 2 * rounds * link.beta)


def double_tree_allreduce_cost(link: AlphaBeta, p: int, ranks_per_node: int = 1) -> AlphaBeta:
    """NCCL's double binary tree: 2 ((g-1) + floor(log2 p/g)) * alpha + 2 n beta, g ranks a node.

    Two binary trees across the nodes, each node a leaf in one and an inner node in the other,
    each reducing then broadcasting half the tensor in pipelined chunks; inside a node the g
    ranks form a chain (NCCL's tuning model). A rank sends (and receives) about 2n bytes.
    """
    check_ranks(p)
    if not (isinstance(ranks_per_node, int) and ranks_per_node >= 1 and p % ranks_per_node == 0):
        raise ValueError(f"ranks_per_node must be an integer >= 1 that divides p = {p}, "
                         f"got {ranks_per_node!r}")
    if p == 1:
        return AlphaBeta(0.0, 0.0)
    hops = ranks_per_node - 1 + (p // ranks_per_node).bit_length() - 1  # chain, tree's depth
    return AlphaBeta(2 * hops * link.alpha, 2 * link.beta)


ALLREDUCE_COSTS: dict[str, Callable[[AlphaBeta, int], AlphaBeta]] = {
    "naive": naive_allreduce_cost, "ring": ring_allreduce_cost, "tree": tree_allreduce_cost,
    "double tree": double_tree_allreduce_cost}


def allreduce_cost(link: AlphaBeta, p: int, algorithm: str = "ring") -> AlphaBeta:
    """(alpha', beta') of a whole allreduce over p ranks: ``.time(n)`` gives its seconds."""
    if algorithm not in ALLREDUCE_COSTS:
        raise ValueError(f"algorithm must be one of {tuple(ALLREDUCE_COSTS)}, got {algorithm!r}")
    return ALLREDUCE_COSTS[algorithm](link, p)


# --- buckets: how much of the gradients' allreduce backward hides ------------------------------

def check_backward(model_bytes: float, backward_seconds: float) -> None:
    """Raise a clear error unless the model size and the backward time make sense."""
    check_bytes(model_bytes, "model_bytes")
    if not (math.isfinite(backward_seconds) and backward_seconds >= 0):
        raise ValueError(f"backward_seconds must be finite and >= 0, got {backward_seconds}")


def layout_finish_times(bucket_bytes: Sequence[float], backward_seconds: float,
                        cost: AlphaBeta) -> list[float]:
    """When each bucket's allreduce finishes, backward starting at 0 and lasting backward_seconds.

    Backward produces the gradients, sum(bucket_bytes) bytes, at a uniform rate and fills the
    buckets in order; bucket k is ready when its last byte is; the allreduces, cost.time(size)
    each, run one after another in order: finish_k = max(ready_k, finish_{k-1}) + cost.time(b_k).
    """
    for size in bucket_bytes:
        check_bytes(size, "every bucket size")
    total = sum(bucket_bytes)
    check_backward(total, backward_seconds)
    finish, done, finishes = 0.0, 0.0, []
    for size in bucket_bytes:
        done += size
        ready = done / total * backward_seconds if total else backward_seconds
        finish = max(ready, finish) + cost.time(size)
        finishes.append(finish)
    return finishes


def equal_buckets(model_bytes: float, bucket_bytes: float) -> list[float]:
    """model_bytes cut into buckets of bucket_bytes, the last one holding what is left."""
    check_bytes(model_bytes, "model_bytes")
    if not (math.isfinite(bucket_bytes) and bucket_bytes > 0):
        raise ValueError(f"bucket_bytes must be finite and > 0, got {bucket_bytes}")
    sizes = [min(bucket_bytes, model_bytes - k * bucket_bytes)
             for k in range(math.ceil(model_bytes / bucket_bytes))]
    return [size for size in sizes if size > 0]  # rounding can leave an empty last piece


def exposed_communication(model_bytes: float, backward_seconds: float, bucket_bytes: float,
                          cost: AlphaBeta) -> float:
    """Seconds by which the buckets' allreduces extend the step beyond backward.

    The predicted step time is forward + backward + this + optimizer. With equal buckets
    (b divides M), t = cost.time(b) and tau = b/M * backward (the time to produce a bucket):
    exposed = t + (M/b - 1) * max(0, t - tau) - the last allreduce is never hidden (grows
    with b), and an allreduce slower than producing a bucket adds a backlog per bucket (many
    alphas when b is small).
    """
    return layout_exposed_communication(equal_buckets(model_bytes, bucket_bytes),
                                        backward_seconds, cost)


def layout_exposed_communication(bucket_bytes: Sequence[float], backward_seconds: float,
                                 cost: AlphaBeta) -> float:
    """exposed_communication of buckets of the given sizes, in the order backward fills them
    (a real model's: a bucket cap cannot cut a parameter)."""
    finishes = layout_finish_times(bucket_bytes, backward_seconds, cost)
    return finishes[-1] - backward_seconds if finishes else 0.0


def cost_in_step(alone: AlphaBeta, comm_seconds: float, buckets: int,
                 gradient_bytes: float) -> AlphaBeta:
    """The allreduce's cost inside a DDP step: alone's alpha, with the beta that makes buckets
    allreduces of gradient_bytes in all take comm_seconds (step_anatomy's comm_s), never
    below alone's beta.

    alone is fitted to allreduces timed by themselves; inside a step they also wait for the
    slower rank and, on a CPU host, share the cores with backward, so they can be slower.
    """
    check_bytes(gradient_bytes, "gradient_bytes")
    if not (gradient_bytes > 0 and isinstance(buckets, int) and buckets >= 1):
        raise ValueError(f"need at least one bucket and some bytes, got {buckets} bucket(s) "
                         f"of {gradient_bytes} bytes in all")
    if not (math.isfinite(comm_seconds) and comm_seconds >= 0):
        raise ValueError(f"comm_seconds must be finite and >= 0, got {comm_seconds}")
    beta = (comm_seconds - buckets * alone.alpha) / gradient_bytes
    return AlphaBeta(alone.alpha, max(beta, alone.beta))


def best_bucket_size(model_bytes: float, backward_seconds: float, cost: AlphaBeta,
                     candidates: Sequence[float]) -> float:
    """The candidate bucket size with the least exposed communication (the first, on ties).

    When backward outpaces the network (M beta' < backward), the best size is the smallest
    whose allreduce is no slower than producing it: b* = alpha' M / (backward - M beta').
    """
    return best_layout({b: equal_buckets(model_bytes, b) for b in candidates},
                       backward_seconds, cost)


def best_layout(layouts: Mapping[float, Sequence[float]], backward_seconds: float,
                cost: AlphaBeta) -> float:
    """The key of layouts (e.g. a bucket cap -> the sizes of its buckets) whose buckets
    expose the least communication (the first, on ties)."""
    if not layouts:
        raise ValueError("the best bucket size needs at least one candidate")
    return min(layouts, key=lambda key: layout_exposed_communication(layouts[key],
                                                                    backward_seconds, cost))


def predict_ddp_overhead(model_bytes: float, p: int, link_bandwidth_bytes_per_s: float,
                         latency_s: float, algorithm: str = "ring", *,
                         backward_seconds: float = 0.0,
                         bucket_bytes: float = 25 * 2**20) -> float:
    """Seconds a DDP step spends communicating beyond backward, from a link's published figures.

    Each message costs latency_s + n / link_bandwidth_bytes_per_s; the gradients are reduced in
    buckets with the given algorithm (a ring across nodes: pass the slowest link).
    backward_seconds=0 gives the whole time of the buckets' allreduces, none of it hidden.
    """
    if not (math.isfinite(link_bandwidth_bytes_per_s) and link_bandwidth_bytes_per_s > 0):
        raise ValueError(f"link bandwidth must be > 0 bytes/s, got {link_bandwidth_bytes_per_s}")
    if not (math.isfinite(latency_s) and latency_s >= 0):
        raise ValueError(f"latency must be >= 0 seconds, got {latency_s}")
    link = AlphaBeta(latency_s, 1 / link_bandwidth_bytes_per_s)
    cost = allreduce_cost(link, p, algorithm)
    return exposed_communication(model_bytes, backward_seconds, bucket_bytes, cost)
