"""Checkers for chapter 08's exercises (performance measured and modelled)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ..cost_model import AlphaBeta, allreduce_cost, predict_ddp_overhead
from ..experiments.performance import MIB
from ..shm import SharedBuffers, SharedMemoryAllreduce
from . import answered, count, forbidden, is_number
from .yours import on_ranks

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
                                  p: int = CROSSOVER_RANKS, tree: str = "double tree") -> float:
    """The message size (bytes) above which the ring allreduce beats the tree (NCCL's double
    binary tree; tree="tree": the binomial one): where their alpha-beta lines cross."""
    ring, other = allreduce_cost(link, p, "ring"), allreduce_cost(link, p, tree)
    return (ring.alpha - other.alpha) / (other.beta - ring.beta)


def _crossover_hint(got: float, link: AlphaBeta, p: int) -> str:
    """Why a crossover size is off."""
    if _relative_gap(got, ring_tree_crossover_reference(link, p, "tree")) < 1e-3:
        return ("that is where the ring overtakes the *binomial* tree; NCCL's tree is the "
                "double binary tree: with one rank a node, 2 floor(log2 p) alpha + 2 n beta")
    if _relative_gap(got, ring_tree_crossover_reference(link, p) * 8) < 1e-3:
        return "the answer is in bytes, not bits"
    return (f"the ring costs 2(p-1)(alpha + n/p beta), the double tree (one rank a node) "
            f"2 floor(log2 p) alpha + 2 n beta; with p = {p}, set them equal and solve for n")


def check_ring_tree_crossover(answer: float | None, link: AlphaBeta = CROSSOVER_LINK,
                              p: int = CROSSOVER_RANKS) -> None:
    """Exercise 2: the message size (bytes) where the ring and NCCL's double binary tree take
    equally long on p ranks with this link, within 0.1%."""
    if not answered(answer):
        return
    if not is_number(answer):
        print(f"not quite: give the size as a number of bytes, not {answer!r}")
        return
    want = ring_tree_crossover_reference(link, p)
    if _relative_gap(answer, want) <= 1e-3:
        binomial = ring_tree_crossover_reference(link, p, "tree")
        print(f"correct: {want / 2**20:.2f} MiB, x{want / binomial:.0f} the binomial tree's "
              f"{binomial / 1024:.0f} KiB: the double tree sends about the ring's bytes, so "
              "only large messages repay the ring's extra latencies")
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


# --- the parts you write: SharedMemoryAllreduce's round, run on the ranks (on_ranks) -------

CHECK_BYTES = 1 << 12  # 4 KiB buffers: one region holds 512 float32 on 2 ranks
SENTINEL = -7.0  # what a region holds before anyone writes it in the check


def _inputs(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank's tensor in the checks: whole numbers, so that every sum is exact; any rank can
    rebuild any rank's tensor."""
    gen = torch.Generator().manual_seed(rank)
    return torch.randint(-99, 100, (numel,), generator=gen).to(dtype)


def _sync(group: dist.ProcessGroup | None) -> None:
    dist.barrier(group=group)


def _cpu_group() -> dist.ProcessGroup | None:
    """A gloo group for the checks' own CPU collectives (None: the default group is gloo)."""
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def _numels(shm: SharedBuffers) -> list[int]:
    """Sizes that fit one round: a full round, uneven slices, fewer numbers than ranks."""
    return [shm.world * (shm.region_bytes // 4), 7 * shm.world + 1, 1]


def _expected_region(q: int, r: int, numel: int, world: int, phase: str) -> torch.Tensor:
    """What region r of rank q's buffer holds after copy-in or reduce (its slice's length)."""
    if r != q:
        return _inputs(q, numel).tensor_split(world)[r]
    if phase == "copy-in":
        return torch.full_like(_inputs(q, numel).tensor_split(world)[r], SENTINEL)
    return sum(_inputs(k, numel).tensor_split(world)[r] for k in range(world))


def _check_buffers(shm: SharedBuffers, numel: int, phase: str) -> None:
    """Every region of every buffer as it must be after phase ("copy-in" or "reduce")."""
    regions = shm._regions(torch.float32)
    for q in range(shm.world):
        for r in range(shm.world):
            want = _expected_region(q, r, numel, shm.world, phase)
            got, n = regions[q][r], want.numel()
            assert torch.equal(got[:n], want) and bool((got[n:] == SENTINEL).all()), (
                f"{count(numel, 'number')} on {shm.world} ranks, after {phase}: region {r} of "
                f"rank {q}'s buffer {_region_hint(q, r, phase)}")


def _region_hint(q: int, r: int, phase: str) -> str:
    if r == q and phase == "copy-in":
        return ("was written: a rank's own slice stays in its tensor (copy-in skips it), and "
                "the others may still be gathering last round's sum from that region")
    if r == q:
        return (f"does not hold the sum of slice {r} over the ranks (rank k's part is in "
                f"region {r} of rank k's buffer, the rank's own part in slices[{r}]; write the "
                "sum into regions[self.rank][self.rank][:n])")
    if phase == "copy-in":
        return (f"does not hold rank {q}'s slice {r} (and nothing past its numel): copy "
                f"slices[{r}] into regions[self.rank][{r}][:slices[{r}].numel()]")
    return "changed during the reduce: write only region self.rank of your own buffer"


def _fresh(shm: SharedBuffers, group: dist.ProcessGroup | None) -> None:
    """Every rank fills its own buffer with SENTINEL, once nobody reads it any more."""
    _sync(group)
    for region in shm._regions(torch.float32)[shm.rank]:
        region.fill_(SENTINEL)
    _sync(group)


def check_copy_in(cls: type) -> str:
    """On each rank: your _copy_in writes every slice but the rank's own into its region of
    the rank's own buffer (uneven slices, empty ones), and touches nothing else."""
    group = _cpu_group()
    with cls(CHECK_BYTES) as shm:
        for numel in _numels(shm):
            _fresh(shm, group)
            x = _inputs(shm.rank, numel)
            shm._copy_in(shm._regions(torch.float32), x.tensor_split(shm.world))
            assert torch.equal(x, _inputs(shm.rank, numel)), (
                "_copy_in changed the tensor: only copy from its slices")
            _sync(group)
            _check_buffers(shm, numel, "copy-in")
    return (f"_copy_in is right: on {dist.get_world_size()} ranks each buffer holds its "
                "rank's slices, its own region untouched")


def check_reduce(cls: type) -> str:
    """On each rank: after the package's copy-in and a wait, your _reduce leaves the sum of
    slice rank, over the ranks, in region rank of the rank's own buffer (on 3 ranks or more,
    added in rank order to the bit), and nothing else, without making a tensor as large as
    the slice (a scratch tensor)."""
    group = _cpu_group()
    scratch: list[str] = []
    with cls(CHECK_BYTES) as shm:
        for numel in _numels(shm):
            _fresh(shm, group)
            x = _inputs(shm.rank, numel)
            slices, regions = x.tensor_split(shm.world), shm._regions(torch.float32)
            SharedMemoryAllreduce._copy_in(shm, regions, slices)
            _sync(group)
            with _NewTensors(slices[shm.rank].numel()) as made:
                shm._reduce(regions, slices)
            scratch += made.names
            assert torch.equal(x, _inputs(shm.rank, numel)), (
                "_reduce changed the tensor: the sum goes into the buffer, not the slice")
            _sync(group)
            _check_buffers(shm, numel, "reduce")
        if shm.world >= 3:  # from 3 parts on, the order of a float sum shows in its rounding
            _check_rank_order(shm, group)
    assert not scratch, (
        f"the sums are right, but _reduce made a scratch tensor as large as the slice "
        f"(with {scratch[0]}): sum straight into regions[self.rank][self.rank][:n], "
        "torch.add(a, b, out=that region), then += the other parts")
    order = ", added in rank order," if dist.get_world_size() >= 3 else ""
    return (f"_reduce is right: on {dist.get_world_size()} ranks region r of rank r's "
            f"buffer holds the sum of slice r{order} and nothing else changed")


def spread_inputs(rank: int, numel: int) -> torch.Tensor:
    """Rank's tensor in the order check: float32 of magnitudes 1e-4 to 1e4, so that adding
    the ranks' parts in another order rounds some sums differently."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=gen) * 10 ** (8 * torch.rand(numel, generator=gen) - 4)


def rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1], then + parts[2], ...: the sum in rank order, as float32 rounds it."""
    total = parts[0] + parts[1]
    for part in parts[2:]:
        total += part
    return total


def _check_rank_order(shm: SharedBuffers, group: dist.ProcessGroup | None) -> None:
    """After a full round's copy-in and reduce of spread_inputs, region rank of the rank's
    own buffer holds its slice summed in rank order, to the bit."""
    numel = shm.world * (shm.region_bytes // 4)
    _fresh(shm, group)
    slices = spread_inputs(shm.rank, numel).tensor_split(shm.world)
    regions = shm._regions(torch.float32)
    SharedMemoryAllreduce._copy_in(shm, regions, slices)
    _sync(group)
    shm._reduce(regions, slices)
    want = rank_order_sum([spread_inputs(q, numel).tensor_split(shm.world)[shm.rank]
                           for q in range(shm.world)])
    assert torch.equal(regions[shm.rank][shm.rank][:want.numel()], want), (
        f"on {shm.world} ranks the sums hold the right parts but not added in rank order, "
        "and float sums round by their order: add parts[0] + parts[1], then += parts[2] and "
        "on, rank q's part at place q (the rank's own part too)")
    _sync(group)


class _NewTensors(TorchFunctionMode):
    """Inside: the torch functions that returned a tensor of at least numel elements (numel
    > 0) in storage of its own, not a view of their inputs or an out= argument."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.names = numel, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {t.untyped_storage().data_ptr() for t in [*args, *kwargs.values()]
                 if isinstance(t, torch.Tensor)}
        if (isinstance(out, torch.Tensor) and 0 < self.numel <= out.numel()
                and out.untyped_storage().data_ptr() not in given):
            self.names.append(getattr(func, "__name__", str(func)))
        return out


def check_gather(cls: type) -> str:
    """On each rank: after the package's copy-in and reduce, your _gather leaves the whole sum
    in the rank's tensor, and equals dist.all_reduce's."""
    group = _cpu_group()
    with cls(CHECK_BYTES) as shm:
        for numel in _numels(shm):
            _fresh(shm, group)
            x = _inputs(shm.rank, numel)
            slices, regions = x.tensor_split(shm.world), shm._regions(torch.float32)
            SharedMemoryAllreduce._copy_in(shm, regions, slices)
            _sync(group)
            SharedMemoryAllreduce._reduce(shm, regions, slices)
            _sync(group)
            shm._gather(regions, slices)
            want = _inputs(shm.rank, numel)
            dist.all_reduce(want, group=group)
            wrong = [q for q, (a, b) in enumerate(zip(slices, want.tensor_split(shm.world)))
                     if not torch.equal(a, b)]
            assert not wrong, (
                f"{count(numel, 'number')} on {shm.world} ranks: slice {wrong[0]} of the tensor "
                f"is not dist.all_reduce's sum: copy region {wrong[0]} of rank {wrong[0]}'s buffer "
                f"(regions[{wrong[0]}][{wrong[0]}]) into it")
    return (f"_gather is right: on {dist.get_world_size()} ranks every tensor holds "
                "dist.all_reduce's sum")


ROUND_STEPS = ["_copy_in", "_arrive", "_reduce", "_arrive", "_gather"]


def check_round(cls: type) -> str:
    """On each rank: your _round, with the package's _copy_in, _reduce and _gather, sums
    float32 and int64 tensors of many rounds like dist.all_reduce, in the order copy in,
    wait, (check the call, first round only), reduce, wait, gather; and ranks that pass
    different tensors get a ValueError."""
    group = _cpu_group()
    with cls(CHECK_BYTES, timeout=20.0) as shm:
        calls: list[str] = []
        for name in ["_check_same_call", *dict.fromkeys(ROUND_STEPS)]:
            method = getattr(shm, name)
            setattr(shm, name, lambda *a, _m=method, _n=name: calls.append(_n) or _m(*a))
        numel = 5 * shm.world * (shm.region_bytes // 4) + 3  # 6 rounds, the last one short
        for dtype in (torch.float32, torch.int64):
            calls.clear()
            x = shm.allreduce(_inputs(shm.rank, numel, dtype))
            want = _inputs(shm.rank, numel, dtype)
            dist.all_reduce(want, group=group)
            rounds = -(-numel // (shm.world * (shm.region_bytes // dtype.itemsize)))
            order = ROUND_STEPS[:2] + ["_check_same_call"] + ROUND_STEPS[2:]
            order += ROUND_STEPS * (rounds - 1)
            assert calls == order, (
                f"{rounds} rounds of {dtype} called {_runs(calls)}; each round must call "
                f"{', '.join(ROUND_STEPS)}, the first also _check_same_call after its first "
                "_arrive (if first)")
            assert torch.equal(x, want), (
                f"{numel} numbers of {dtype}: the sum differs from dist.all_reduce's")
        try:
            shm.allreduce(torch.zeros(10 + shm.rank))
        except ValueError:
            pass
        else:
            raise AssertionError("ranks passed 10 and 11 numbers and got no ValueError: call "
                                 "self._check_same_call() in the first round (first=True)")
    return (f"_round is right: on {dist.get_world_size()} ranks, many rounds of float32 "
                "and int64 sum like dist.all_reduce, two waits a round")


def _runs(calls: list[str]) -> str:
    """calls, shortened: the first 8 and how many in all."""
    head = ", ".join(calls[:8])
    return f"[{head}{', ...' if len(calls) > 8 else ''}] ({len(calls)} calls)"


# --- exercise 5: a shared-memory broadcast ------------------------------------------------

BROADCAST_RANKS = 3


# what exercise 5's shared-memory broadcast may not call: torch.distributed's own messaging
NOT_SHARED_MEMORY = ("barrier", "broadcast", "all_reduce", "send", "recv", "isend", "irecv",
                     "all_gather", "all_gather_object", "broadcast_object_list", "scatter",
                     "gather")


def _broadcast_on_rank(cls: type) -> None:
    """On each rank: your SharedMemoryBroadcast(CHECK_BYTES).broadcast(tensor, src) against
    dist.broadcast, from every src, for tensors of several rounds, uneven, empty, int64,
    float64 and not contiguous, in place, without torch.distributed."""
    group, rank = _cpu_group(), dist.get_rank()
    with cls(CHECK_BYTES) as shm:
        per = shm.world * shm.region_bytes // 4  # float32 numbers in one buffer
        cases = [(0, 3 * per + 5, torch.float32, False), (shm.world - 1, 7, torch.int64, False),
                 (1, 0, torch.float32, False), (1, per, torch.float64, False),
                 (shm.world - 1, 2 * per, torch.float32, True)]
        for src, numel, dtype, transposed in cases:
            x = _inputs(rank, numel, dtype)
            x = x.view(2, -1).t() if transposed else x
            with forbidden(NOT_SHARED_MEMORY, "broadcast called torch.distributed: use "
                           "the shared buffers and self._arrive() only"):
                returned = shm.broadcast(x, src)
            want = _inputs(rank, numel, dtype)
            dist.broadcast(want, src, group=group)
            want = want.view(2, -1).t() if transposed else want
            assert returned is x, "broadcast must return the tensor it was given (in place)"
            assert torch.equal(x, want), (
                f"{numel} numbers of {dtype}{', not contiguous,' if transposed else ''} from "
                f"rank {src}: rank {rank}'s tensor differs from dist.broadcast's")
            _sync(group)


def check_shm_broadcast(path: str | Path = "yours/shm_broadcast.py") -> None:
    """Exercise 5: the class SharedMemoryBroadcast in the file at path, run on 3 ranks
    against dist.broadcast (_broadcast_on_rank)."""
    if not Path(path).exists():
        print("not answered yet")
        return
    try:
        on_ranks(_broadcast_on_rank, path, "SharedMemoryBroadcast",
                 world_size=BROADCAST_RANKS, timeout=120)
    except NotImplementedError:
        print("not answered yet")
    except AssertionError as error:
        print(f"not quite: {error}")
    else:
        print(f"correct: on {BROADCAST_RANKS} ranks, from every src, tensors of up to 4 rounds, "
              "int64, float64, empty and not contiguous arrive like dist.broadcast's")
