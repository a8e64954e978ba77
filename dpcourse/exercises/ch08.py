"""Checkers for chapter 08's exercises (performance measured and modelled)."""
from __future__ import annotations

from ..cost_model import AlphaBeta, allreduce_cost, predict_ddp_overhead
from ..experiments.performance import MIB
from . import answered, is_number

PREDICT_BYTES = 3 * MIB  # exercise 1: a size the chapter's sweep (powers of 4) never measures
CROSSOVER_RANKS = 8  # exercise 2
CROSSOVER_LINK = AlphaBeta(alpha=5e-6, beta=1 / 25e9)  # 5 us per message, 25 GB/s
# exercise 3: ResNet-18's float32 gradients, a backward of 0.2 s, an allreduce of
# 0.5 ms + n / (1 GB/s)
BUCKET_MODEL_BYTES = 11_175_818 * 4
BUCKET_BACKWARD_S = 0.2
BUCKET_COST = AlphaBeta(alpha=5e-4, beta=1 / 1e9)
# exercise 4: a 1B-parameter model's bfloat16 gradients on 8 GPUs over NVLink (section 6's link)
BF16_MODEL_BYTES = 10**9 * 2
BF16_RANKS = 8
NVLINK_BYTES_PER_S = 450e9  # each way
NVLINK_LATENCY_S = 3.4e-6  # per ring step


def _relative_gap(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


def _prediction_hint(got: float, cost: AlphaBeta, nbytes: float) -> str:
    """Why a predicted time is off."""
    numel = nbytes / 4
    if _relative_gap(got, cost.alpha + numel * cost.beta) < 1e-3:
        return f"beta is seconds per *byte*: {nbytes / MIB:g} MiB of float32 is {nbytes:,.0f} bytes"
    if _relative_gap(got, nbytes * cost.beta) < 1e-3:
        return "add alpha, the fixed cost every call pays"
    if _relative_gap(got, 1e3 * cost.time(nbytes)) < 1e-3:
        return "give seconds, not milliseconds"
    if _relative_gap(got, cost.time(nbytes / 1.048576)) < 1e-3:
        return f"a MiB is 2**20 = {MIB:,} bytes, not 10**6"
    return f"evaluate alpha + n * beta at n = {nbytes:,.0f} bytes"


def check_predicted_seconds(answer: float | None, cost: AlphaBeta,
                            nbytes: float = PREDICT_BYTES) -> None:
    """Exercise 1: the fitted alpha-beta line's time for an allreduce of nbytes (3 MiB), in s."""
    if not answered(answer):
        return
    if not is_number(answer):
        print(f"not quite: give the time as a number of seconds, not {answer!r}")
        return
    want = cost.time(nbytes)  # alpha + nbytes * beta
    if _relative_gap(answer, want) <= 1e-6:
        print(f"correct: the fit predicts {1e3 * want:.3f} ms for {nbytes / MIB:g} MiB; now "
              "measure it")
    else:
        print(f"not quite: {answer!r} s; {_prediction_hint(answer, cost, nbytes)}")


def ring_tree_crossover_reference(link: AlphaBeta = CROSSOVER_LINK,
                                  p: int = CROSSOVER_RANKS) -> float:
    """The message size (bytes) above which the ring allreduce beats the binomial tree: where
    their alpha-beta lines cross, from cost_model's formulas."""
    ring, tree = allreduce_cost(link, p, "ring"), allreduce_cost(link, p, "tree")
    return (ring.alpha - tree.alpha) / (tree.beta - ring.beta)


def _crossover_hint(got: float, link: AlphaBeta, p: int) -> str:
    """Why a crossover size is off."""
    # a ring sending whole tensors, 2(p-1)(alpha + n beta), meets the tree at n = alpha/beta
    if _relative_gap(got, link.alpha / link.beta) < 1e-3:
        return ("each ring step sends n/p bytes, not n: the ring's beta term is "
                "2(p-1)/p * n * beta")
    return (f"the ring costs 2(p-1)(alpha + n/p beta), the tree 2 ceil(log2 p)(alpha + n beta); "
            f"with p = {p}, set them equal and solve for n")


def check_ring_tree_crossover(answer: float | None, link: AlphaBeta = CROSSOVER_LINK,
                              p: int = CROSSOVER_RANKS) -> None:
    """Exercise 2: the message size (bytes) where ring and tree allreduce take equally long on
    p ranks with this link, within 0.1%."""
    if not answered(answer):
        return
    if not is_number(answer):
        print(f"not quite: give the size as a number of bytes, not {answer!r}")
        return
    want = ring_tree_crossover_reference(link, p)
    if _relative_gap(answer, want) <= 1e-3:
        ring, tree = allreduce_cost(link, p, "ring"), allreduce_cost(link, p, "tree")
        print(f"correct: {want / 1024:.1f} KiB; below it the tree's {tree.alpha * 1e6:.0f} us "
              f"of latency beat the ring's {ring.alpha * 1e6:.0f} us, above it the ring's "
              "bandwidth wins")
    else:
        print(f"not quite: {answer:,.0f} bytes; {_crossover_hint(answer, link, p)}")


def best_bucket_reference(model_bytes: float = BUCKET_MODEL_BYTES,
                          backward_seconds: float = BUCKET_BACKWARD_S,
                          cost: AlphaBeta = BUCKET_COST) -> float:
    """b*, the smallest equal bucket whose allreduce is no slower than backward takes to
    produce it: alpha + b beta = b / M * backward, so b* = alpha M / (backward - M beta)."""
    return cost.alpha * model_bytes / (backward_seconds - model_bytes * cost.beta)


def check_best_bucket(answer: float | None, model_bytes: float = BUCKET_MODEL_BYTES,
                      backward_seconds: float = BUCKET_BACKWARD_S,
                      cost: AlphaBeta = BUCKET_COST) -> None:
    """Exercise 3: the formula's bucket size b* in bytes, within 0.1%."""
    if not answered(answer):
        return
    if not is_number(answer):
        print(f"not quite: give the size as a number of bytes, not {answer!r}")
        return
    want = best_bucket_reference(model_bytes, backward_seconds, cost)
    if _relative_gap(answer, want) <= 1e-3:
        print(f"correct: {want / 1024:.0f} KiB, {model_bytes / want:.0f} buckets; each one's "
              f"allreduce ({cost.time(want) * 1e3:.2f} ms) takes as long as backward takes "
              "to produce the next")
    elif _relative_gap(answer, cost.alpha * model_bytes / backward_seconds) <= 1e-3:
        print("not quite: the allreduce also spends beta per byte while backward produces "
              "the bucket: alpha + b beta = b / M * backward")
    elif _relative_gap(answer, want / 4) <= 1e-3 or _relative_gap(answer, 4 * want) <= 1e-3:
        print("not quite: the model size is in bytes (4 per float32 parameter), and so is b")
    else:
        print(f"not quite: {answer:,.0f} bytes; a bucket of b bytes is ready every b / M * "
              "backward seconds and its allreduce takes alpha + b beta: set them equal")


def bf16_overhead_reference(model_bytes: float = BF16_MODEL_BYTES, p: int = BF16_RANKS,
                            bandwidth: float = NVLINK_BYTES_PER_S,
                            latency: float = NVLINK_LATENCY_S) -> float:
    """Seconds of the buckets' ring allreduces (25 MiB buckets, no overlap) for model_bytes."""
    return predict_ddp_overhead(model_bytes, p, bandwidth, latency)


def _bf16_hint(got: float) -> str:
    """Why a predicted bfloat16 overhead is off."""
    if _relative_gap(got, bf16_overhead_reference(2 * BF16_MODEL_BYTES)) < 1e-3:
        return "that is float32's 4 bytes per parameter; bfloat16 has 2"
    if _relative_gap(got, bf16_overhead_reference(bandwidth=2 * NVLINK_BYTES_PER_S)) < 1e-3:
        return "900 GB/s counts both directions; a ring sends each way at 450 GB/s"
    if _relative_gap(got, 1e3 * bf16_overhead_reference()) < 1e-3:
        return "give seconds, not milliseconds"
    ring = allreduce_cost(AlphaBeta(NVLINK_LATENCY_S, 1 / NVLINK_BYTES_PER_S), BF16_RANKS)
    if _relative_gap(got, ring.time(BF16_MODEL_BYTES)) < 1e-3:
        return ("that is one allreduce of everything; in 25 MiB buckets each bucket pays the "
                "ring's 2(p-1) latencies")
    return (f"call predict_ddp_overhead(model_bytes, {BF16_RANKS}, {NVLINK_BYTES_PER_S:g}, "
            f"{NVLINK_LATENCY_S:g}) with the gradients' bytes")


def check_bf16_overhead(answer: float | None) -> None:
    """Exercise 4: predict_ddp_overhead's seconds for a 1B-parameter model's bfloat16
    gradients on 8 GPUs over NVLink, within 0.1%."""
    if not answered(answer):
        return
    if not is_number(answer):
        print(f"not quite: give the time as a number of seconds, not {answer!r}")
        return
    want = bf16_overhead_reference()
    if _relative_gap(answer, want) <= 1e-3:
        float32 = bf16_overhead_reference(2 * BF16_MODEL_BYTES)
        print(f"correct: {1e3 * want:.2f} ms, x{float32 / want:.2f} less than float32's "
              f"{1e3 * float32:.2f} ms: half the bytes, and half as many buckets to pay "
              "latency for")
    else:
        print(f"not quite: {answer!r} s; {_bf16_hint(answer)}")
