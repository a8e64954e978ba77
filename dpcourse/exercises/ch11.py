"""Checkers for chapter 11's parts and exercises (communicating less: bfloat16, PowerSGD,
DiLoCo), and the few runs on ranks the chapter shows with the package's code."""
from __future__ import annotations

import math
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..compression import PowerSGDState, bf16_hook, powersgd_hook
from ..cost_model import AlphaBeta, ring_allreduce_cost
from ..data import synthetic_fashion
from ..data_parallel import max_relative_difference
from ..ddp import GradBucket, ScratchDDP
from ..lenet import lenet_model
from ..local_sgd import DiLoCo
from . import answered, is_int, one_line_failure

BF16_BITS = 8  # significant bits of bfloat16 (7 stored, 1 implicit)
BF16_TOLERANCE = 2.0 ** (1 - BF16_BITS)  # two roundings of at most 2^-8 each, relative


@contextmanager
def recorded_all_reduces() -> Iterator[list[tuple[torch.Tensor, bool]]]:
    """Inside: every dist.all_reduce also notes a copy of the tensor it was handed, and
    whether it was asked not to wait (async_op=True)."""
    calls, all_reduce = [], dist.all_reduce

    def noting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((tensor.detach().clone(), bool(kwargs.get("async_op", False))))
        return all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = noting
    try:
        yield calls
    finally:
        dist.all_reduce = all_reduce


def is_future(value: Any) -> bool:
    """Whether value is a torch future (torch.futures.Future, or what .then returns)."""
    return isinstance(value, torch._C.Future)


def _rank_gradient(rank: int, numel: int) -> torch.Tensor:
    """Rank's made-up float32 gradient: signs and magnitudes from 1e-6 to 1e2."""
    gen = torch.Generator().manual_seed(100 + rank)
    scales = 10.0 ** torch.randint(-6, 3, (numel,), generator=gen)
    return torch.randn(numel, generator=gen) * scales


# --- section 2: bf16_hook (run on 2 ranks) ---------------------------------------------------

def check_bf16_hook(hook: Callable[[Any, GradBucket], torch.futures.Future]) -> str:
    """On each rank: your hook averages a bucket of float32 gradients within 2^-7 of the mean
    magnitude (bfloat16's 8 bits, rounded twice), hands all_reduce bfloat16 only, without
    waiting for it (async_op=True), and returns a future of a float32 tensor of the bucket's
    size."""
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = 1000
    param = nn.Parameter(torch.zeros(numel))
    bucket = GradBucket(0, _rank_gradient(rank, numel), [param], True)
    with recorded_all_reduces() as sent:
        future = hook(None, bucket)
        assert is_future(future), (
            f"the hook returned {type(future).__name__}: return a torch.futures.Future, "
            "work.get_future().then(...)")
        got = future.wait()
    assert sent, "nothing was sent: average the bucket with dist.all_reduce"
    kinds = {t.dtype for t, _ in sent}
    assert kinds == {torch.bfloat16}, (
        f"all_reduce was handed {sorted(map(str, kinds))}: cast to bfloat16 before sending, "
        "so that half the bytes travel")
    assert isinstance(got, torch.Tensor) and got.shape == (numel,), (
        f"the future holds {type(got).__name__} of shape {tuple(getattr(got, 'shape', ()))}: "
        f"return the bucket's buffer, {numel} numbers")
    assert got.dtype == torch.float32, (
        f"the future holds {got.dtype}: cast the average back into the float32 buffer")
    own = _rank_gradient(rank, numel)
    assert not (torch.equal(got, own) or torch.equal(got, own / world)), (
        "the future holds this rank's own gradients, not the average: write the sum that "
        "arrived back into the bucket's buffer, buffer.copy_(fut.value()[0])")
    grads = [_rank_gradient(r, numel).double() for r in range(world)]
    exact = sum(grads) / world
    scale = sum(g.abs() for g in grads) / world
    error = (got.double() - exact).abs()
    if (error > BF16_TOLERANCE * scale).any():
        summed = (got.double() - world * exact).abs() <= BF16_TOLERANCE * world * scale
        assert not summed.all(), (
            "that is the sum over the ranks: divide by the world size (before casting)")
        raise AssertionError("the average is further from float32's than bfloat16's 8 bits "
                             "allow: divide by the world size, cast, all_reduce, cast back")
    assert all(waits_not for _, waits_not in sent), (
        "the hook waited for its all_reduce: pass async_op=True and return "
        "work.get_future().then(...), so that backward goes on while the bucket travels")
    return (f"bf16_hook is right: on {world} ranks it sends bfloat16 without waiting and "
            "averages within 2^-7 of the ranks' mean magnitude, element by element")


@lru_cache(maxsize=1)
def _images() -> tuple[torch.Tensor, torch.Tensor]:
    """The first 1000 synthetic Fashion-MNIST training images and labels, drawn once."""
    return tuple(synthetic_fashion("train", 1000).tensors)


def _lenet_batch(rank: int, world: int, step: int, batch: int = 32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step's global batch of synthetic Fashion-MNIST images."""
    images, labels = _images()
    start = (step * batch) % 1000
    X, y = images[start:start + batch], labels[start:start + batch]
    return X.chunk(world)[rank], y.chunk(world)[rank]


def _train(model: nn.Module, steps: int, dtype: torch.dtype = torch.float32,
           lr: float = 0.1) -> torch.Tensor:
    """steps SGD steps on this rank's share of the batches; the flat parameters after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        X, y = _lenet_batch(rank, world, step)
        opt.zero_grad()
        F.cross_entropy(model(X.to(dtype)), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _hooked(wrapper: str, state: Any, hook: Callable | None, steps: int,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """steps SGD steps of LeNet under wrapper ("scratch" or "torch") with hook, if any."""
    model = lenet_model(0).to(dtype)
    ddp = ScratchDDP(model) if wrapper == "scratch" else DistributedDataParallel(model)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return _train(ddp, steps, dtype)


def bf16_against_float32(steps: int = 3) -> dict[str, Any]:
    """On each rank: LeNet's first gradient averaged by bf16_hook against the exact average
    (errors, elementwise, relative to the average and to the ranks' mean magnitude, and the
    2^-7 bound); steps SGD steps under bf16_hook on torch's DDP and
    on ScratchDDP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = lenet_model(0)
    X, y = _lenet_batch(rank, world, 0)
    F.cross_entropy(model(X), y).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    mine = [torch.zeros_like(grad) for _ in range(world)]
    dist.all_gather(mine, grad)
    exact = sum(g.double() for g in mine) / world
    scale = sum(g.double().abs() for g in mine) / world
    params = list(model.parameters())
    got = bf16_hook(None, GradBucket(0, grad.clone(), params, True)).wait().double()
    error = (got - exact).abs()
    return {"median relative error": (error / exact.abs())[exact != 0].median().item(),
            "largest error / mean magnitude": (error / scale)[scale != 0].max().item(),
            "within 2^-7 of the mean magnitude": bool((error <= BF16_TOLERANCE * scale).all()),
            "exact": bool(torch.equal(got, exact)),
            "torch DDP": _hooked("torch", None, bf16_hook, steps),
            "ScratchDDP": _hooked("scratch", None, bf16_hook, steps)}


# --- section 3: low_rank_averages (run on 2 ranks) -------------------------------------------

def _matrices(rank: int, shape: tuple[int, int], step: int) -> torch.Tensor:
    """Rank's made-up float64 gradient of the given shape at step."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _reference(grads: list[torch.Tensor], q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration on every rank's matrix at once: (approximation of the average, Q)."""
    p = torch.linalg.qr(sum(m @ q for m in grads)).Q
    q = sum(m.T @ p for m in grads) / len(grads)
    return p @ q.T, q


def _low_rank_hint(want: torch.Tensor, got: torch.Tensor, ms: list[torch.Tensor],
                   q: torch.Tensor) -> str:
    """Why an approximation differs from one power iteration's on the ranks' matrices ms from
    q, from the usual mistakes."""
    world = len(ms)
    if max_relative_difference([got], [world * want]) <= 1e-10:
        return "it is the ranks' sum: divide Q by the world size before its all_reduce"
    if max_relative_difference([got], [_iteration(ms, q, orthonormal=False)]) <= 1e-10:
        return ("P was not orthonormalised: once the P's have arrived, take "
                "torch.linalg.qr(p).Q of each sum before computing Q = M^T P / world")
    if max_relative_difference([got], [_iteration(ms, q, orthonormal=False, each=True)]) <= 1e-10:
        return ("each rank orthonormalised its own P before the all_reduce, and a sum of "
                "orthonormal matrices is not orthonormal: orthonormalise the sum, after it")
    return ("not one power iteration of the average: P = M Q, all_reduce P, orthonormalise it "
            "(torch.linalg.qr(p).Q), Q = M^T P divided by the world size, all_reduce Q, P Q^T")


def _iteration(ms: list[torch.Tensor], q: torch.Tensor, orthonormal: bool = True,
               each: bool = False) -> torch.Tensor:
    """P Q^T of one power iteration on the ranks' matrices ms from q, P orthonormalised
    after the sum (orthonormal) and/or on each rank before it (each)."""
    ps = [torch.linalg.qr(m @ q).Q if each else m @ q for m in ms]
    p = torch.linalg.qr(sum(ps)).Q if orthonormal else sum(ps)
    return p @ (sum(m.T @ p for m in ms) / len(ms)).T


def _one(future: Any, count: int = 1) -> Any:
    """The approximations low_rank_averages' future holds: a list of count tensors, or why
    not."""
    assert is_future(future), (
        f"returned {type(future).__name__}: return a future of the approximations, "
        "chain(summed(the P's), send_qs), so that nobody waits for the allreduces")
    result = future.wait()
    assert isinstance(result, (list, tuple)) and len(result) == count, (
        f"the future holds {type(result).__name__}{f' of {len(result)}' if isinstance(result, (list, tuple)) else ''}"
        f": let it hold a list with one approximation per matrix ({count} here)")
    return result[0] if count == 1 else result


def check_low_rank_average(fn: Callable[[PowerSGDState, list[torch.Tensor], list[torch.Tensor]],
                                        torch.futures.Future]) -> str:
    """On each rank: your low_rank_averages' future at full rank is the exact average (float64, 1e-12),
    for two matrices of other shapes at once too; at rank 2, three steps equal one power
    iteration each on the ranks' matrices plus their errors, warm-started (1e-10); the bytes
    are r(n + m) numbers; the state is kept."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n, m = 12, 7
    param = nn.Parameter(torch.zeros(n, m, dtype=torch.float64))
    state = PowerSGDState(10, start_step=0)  # above min(n, m): clamped to 7, exact
    got = _one(fn(state, [param], [_matrices(rank, (n, m), 0)]))
    exact = sum(_matrices(r, (n, m), 0) for r in range(world)) / world
    assert isinstance(got, torch.Tensor) and got.shape == (n, m), (
        f"returned {type(got).__name__} of shape {tuple(getattr(got, 'shape', ()))}: return "
        f"the approximation P Q^T, shaped like grad ({n} x {m})")
    assert max_relative_difference([got], [exact]) <= 1e-12, (
        "at full rank (matrix_rank clamped to min(n, m)) the result is not the exact average: "
        + _low_rank_hint(exact, got, [_matrices(r, (n, m), 0) for r in range(world)],
                         state.initial_q(exact, min(n, m))))
    assert state.bytes_sent == 8 * min(n, m) * (n + m), (
        f"bytes_sent is {state.bytes_sent} after one call at rank {min(n, m)} (clamped), want "
        f"{8 * min(n, m) * (n + m)}: add p.nbytes + q.nbytes, with the rank min(r, n, m)")
    state = PowerSGDState(2, start_step=0)
    q, errors = state.initial_q(torch.zeros(n, m, dtype=torch.float64), 2), [0] * world
    for step in range(3):
        grads = [_matrices(r, (n, m), step) for r in range(world)]
        ms = [g + e for g, e in zip(grads, errors)]
        q_before = q
        want, q = _reference(ms, q)
        errors = [mat - want for mat in ms]
        got = _one(fn(state, [param], [grads[rank].clone()]))
        if max_relative_difference([got], [want]) > 1e-10:
            assert step > 0, f"matrix rank 2: {_low_rank_hint(want, got, ms, q_before)}"
            raise AssertionError(
                f"matrix rank 2, step {step}: not the power iteration on grad + state.errors[param] "
                "(what was not sent yet), started from state.qs[param] (the last step's Q)")
        assert param in state.qs and max_relative_difference([state.qs[param]], [q]) <= 1e-10, (
            "state.qs[param] does not hold this step's Q (after its all_reduce): the next "
            "step starts from it (warm start)")
        assert param in state.errors and max_relative_difference(
            [state.errors[param]], [errors[rank]]) <= 1e-10, (
            "state.errors[param] must hold M - P Q^T, what this rank did not send")
    assert state.bytes_sent == 3 * 8 * 2 * (n + m), (
        f"bytes_sent is {state.bytes_sent} after 3 calls at matrix rank 2, want {3 * 8 * 2 * (n + m)}:"
        " p.nbytes + q.nbytes per call, r(n + m) numbers")
    off = PowerSGDState(2, start_step=0, error_feedback=False)
    _one(fn(off, [param], [_matrices(rank, (n, m), 0)]))
    assert param not in off.errors, "with error_feedback=False keep no error"
    shapes = [(5, 9), (8, 3)]
    pair = [nn.Parameter(torch.zeros(shape, dtype=torch.float64)) for shape in shapes]
    got = _one(fn(PowerSGDState(10, start_step=0), pair,
                  [_matrices(rank, shape, 7) for shape in shapes]), 2)
    for shape, approx in zip(shapes, got):
        exact = sum(_matrices(r, shape, 7) for r in range(world)) / world
        assert max_relative_difference([approx], [exact]) <= 1e-12, (
            f"two matrices at once: the {shape[0]} x {shape[1]} one is not its exact average at "
            "full rank: each P and Q belongs to its own matrix (summed keeps them apart)")
    return (f"low_rank_averages is right: on {world} ranks exact at full rank, also two "
            "matrices at once, one warm-started power iteration with error feedback at matrix "
            "rank 2, r(n + m) numbers sent")


def powersgd_exact_and_bytes(matrix_rank: int = 2, steps: int = 3) -> dict[str, Any]:
    """On each rank: steps SGD steps of LeNet in float64 on ScratchDDP under powersgd_hook at
    full rank (compressing from the first step) and under plain averaging; the bytes one
    float32 step sends at matrix_rank, compressed from the first step."""
    plain = _hooked("scratch", None, None, steps, torch.float64)
    full = _hooked("scratch", PowerSGDState(10**4, start_step=0), powersgd_hook, steps,
                   torch.float64)
    state = PowerSGDState(matrix_rank, start_step=0)
    _hooked("scratch", state, powersgd_hook, 1)
    return {"full rank against plain": max_relative_difference([full], [plain]),
            "bytes one step": state.bytes_sent}


# --- section 4: DiLoCo.sync (run on 2 ranks) -------------------------------------------------

def _bn_net(seed: int) -> nn.Module:
    """A small float64 net with BatchNorm's buffers (float statistics and an integer counter)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def _small_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's own batch of 8 examples at step (float64)."""
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (8,),
                                                                                generator=gen)


def _averaged(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's average over the ranks (copies)."""
    out = [t.detach().clone() for t in tensors]
    for t in out:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return out


def diloco_against_ddp(cls: type = DiLoCo, steps: int = 3) -> float:
    """On each rank: LeNet (float64) under cls with sync_every=1, inner SGD, outer lr 1 and no
    momentum, against torch's DDP with SGD: the largest relative difference after steps."""
    rank = dist.get_rank()
    model = lenet_model(rank).double()  # different on each rank: DiLoCo broadcasts rank 0's
    opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, outer_lr=1.0,
              outer_momentum=0.0)
    ours = _train_with(model, opt, steps)
    ddp = DistributedDataParallel(lenet_model(0).double())
    return max_relative_difference([ours], [_train(ddp, steps, torch.float64)])


def _train_with(model: nn.Module, opt: Any, steps: int) -> torch.Tensor:
    """steps steps of opt (an optimizer-like DiLoCo) on this rank's LeNet batches (float64)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        X, y = _lenet_batch(rank, world, step)
        opt.zero_grad()
        F.cross_entropy(model(X.double()), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _sync_hint(got: list[torch.Tensor], start: list[torch.Tensor],
               current: list[torch.Tensor], update: list[torch.Tensor],
               summed_update: list[torch.Tensor]) -> str:
    """Why the parameters after sync are off, from the usual mistakes."""
    if max_relative_difference(got, [s - 0.7 * u for s, u in zip(start, summed_update)]) < 1e-9:
        return "that is the sum of the pseudo-gradients: divide by the world size"
    if max_relative_difference(got, [c - 0.7 * u for c, u in zip(current, update)]) < 1e-9:
        return ("the outer step went from the current parameters: copy the round's start "
                "back into each parameter (p.copy_(s)) before self.outer.step()")
    return ("for each parameter: p back to its start, p.grad = its averaged pseudo-gradient "
            "(self._average_round()'s, in order); then self.outer.step()")


def check_sync(cls: type) -> str:
    """On each rank: your DiLoCo.sync, twice, against the outer Nesterov step by hand on the
    averaged pseudo-gradients (float64, 1e-12); buffers averaged (counters rank 0's); the
    round's start, bytes and syncs updated; every rank equal; and with sync_every=1, inner
    SGD, outer lr 1 and no momentum it trains as torch's DDP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _bn_net(rank)  # different on each rank: __init__ broadcasts rank 0's
    opt = cls(model, torch.optim.AdamW(model.parameters(), lr=0.05), sync_every=10**6)
    params = list(model.parameters())
    momenta = [torch.zeros_like(p) for p in params]
    for round_ in range(2):
        for step in range(2):
            X, y = _small_batch(rank, 3 * round_ + step)
            opt.zero_grad()
            F.cross_entropy(model(X), y).backward()
            opt.step()
        if rank == 1 and round_ == 0:
            model(X)  # one more batch seen: rank 1's statistics and counter move on
        start, current = [s.clone() for s in opt.start], [p.detach().clone() for p in params]
        floats = [b for b in model.buffers() if b.is_floating_point()]
        counters = [b.clone() for b in model.buffers() if not b.is_floating_point()]
        for c in counters:
            dist.broadcast(c, src=0)
        stats = _averaged(floats)
        deltas = _averaged([s - c for s, c in zip(start, current)])
        momenta = [0.9 * m + d for m, d in zip(momenta, deltas)]
        update = [d + 0.9 * m for d, m in zip(deltas, momenta)]  # Nesterov
        sent, syncs = opt.bytes_sent, opt.syncs
        opt.sync()
        got = [p.detach() for p in params]
        want = [s - 0.7 * u for s, u in zip(start, update)]
        if max_relative_difference(got, want) > 1e-12:
            if round_ == 0:
                summed = [world * d + 0.9 * world * d for d in deltas]
                raise AssertionError(f"sync: {_sync_hint(got, start, current, update, summed)}")
            raise AssertionError(
                "the second sync is off (the first was right): keep self.outer (its momentum) "
                "and let the parameters after the outer step be the next round's start")
        assert max_relative_difference(opt.start, got) == 0, (
            "after sync the round's start must be the new parameters: s.copy_(p) for each")
        assert max_relative_difference(floats, stats) <= 1e-12, (
            "BatchNorm's statistics are not the ranks' average: average the float buffers too")
        assert all(torch.equal(b, c) for b, c in zip(
            [b for b in model.buffers() if not b.is_floating_point()], counters)), (
            "an integer buffer (BatchNorm's counter) is not rank 0's: broadcast it from rank 0")
        assert all(p.grad is None or not p.grad.any() for p in params), (
            "the parameters keep a gradient after sync: call self.inner.zero_grad()")
        numbers = sum(p.numel() for p in params) + sum(b.numel() for b in floats)
        assert opt.bytes_sent - sent == 8 * numbers, (
            f"one sync added {opt.bytes_sent - sent} to bytes_sent, want {8 * numbers}: the "
            "pseudo-gradients and float buffers, sent in one message (flat.nbytes)")
        assert opt.syncs == syncs + 1, "count each sync: self.syncs += 1"
    everyone = [torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
                for _ in range(world)]
    dist.all_gather(everyone, torch.cat([p.detach().reshape(-1) for p in params]))
    assert all(torch.equal(e, everyone[0]) for e in everyone), "the ranks differ after sync"
    gap = one_line_failure("DiLoCo with sync_every=1", lambda: diloco_against_ddp(cls))
    assert gap <= 1e-12, (
        f"with sync_every=1, inner SGD, outer lr 1 and no momentum, 3 steps differ from DDP's "
        f"by {gap:.1e}: the outer step must apply exactly the averaged pseudo-gradient")
    return (f"sync is right: on {world} ranks two outer Nesterov steps on the averaged "
            "pseudo-gradients, buffers averaged, every rank equal; with sync_every=1, inner "
            "SGD, outer lr 1 and no momentum it trains as DDP within 1e-12 (float64)")


# --- exercise 1: the PowerSGD rank that sends as many bytes as bfloat16 ----------------------

DENSE = (800, 128)  # LeNet's dense layer, W3


def rank_like_bf16(shape: tuple[int, int] = DENSE, factor_bytes: int = 4,
                   bf16_bytes: int = 2) -> int:
    """The largest rank r whose factors, r(n + m) numbers of factor_bytes, send no more than
    the n x m matrix in bfloat16."""
    n, m = shape
    return (bf16_bytes * n * m) // (factor_bytes * (n + m))


def check_rank_like_bf16(answer: int | None) -> None:
    """Exercise 1: the largest PowerSGD rank (float32 factors) sending no more bytes than
    bfloat16 for LeNet's 800 x 128 dense layer."""
    if not answered(answer):
        return
    want = rank_like_bf16()
    n, m = DENSE
    if not is_int(answer):
        print(f"not quite: a rank is a whole number, not {answer!r}")
        return
    hints = {rank_like_bf16(factor_bytes=2): "PowerSGD's factors P and Q are float32 here: 4 "
             "bytes per number (bfloat16 takes 2)",
             rank_like_bf16(bf16_bytes=1): "a bfloat16 number takes 2 bytes, not 1",
             want + 1: f"at rank {want + 1} PowerSGD sends {4 * (want + 1) * (n + m):,} bytes, "
             f"more than bfloat16's {2 * n * m:,}: round down",
             min(n, m): "at full rank the factors would be exact, but "
             f"{4 * min(n, m) * (n + m):,} bytes, more than float32's {4 * n * m:,}: "
             "powersgd_hook sends the matrix whole there, in float32"}
    if answer != want:
        print(f"not quite: {answer}: " + hints.get(answer, (
            f"bfloat16 sends 2 x {n} x {m} bytes; rank r sends 4 r ({n} + {m}); take the "
            "largest whole r that is not more")))
        return
    print(f"correct: rank {want} sends {4 * want * (n + m):,} bytes, bfloat16 {2 * n * m:,}; "
          f"rank 2 sends {4 * 2 * (n + m):,}, {2 * n * m / (8 * (n + m)):.0f} times less than "
          "bfloat16")


# --- exercise 2: sync_every for a link --------------------------------------------------------

def sync_every_reference(model_bytes: float, step_seconds: float, link: AlphaBeta,
                         world: int, share: float = 0.1) -> int:
    """The smallest H >= 1 such that one ring allreduce of model_bytes every H steps of
    step_seconds takes at most share of the round: t <= share (H step_seconds + t)."""
    t = ring_allreduce_cost(link, world).time(model_bytes)
    h = max(1, math.ceil((1 - share) * t / (share * step_seconds)))
    while h > 1 and t <= share * ((h - 1) * step_seconds + t):
        h -= 1  # float rounding in the ceil
    while t > share * (h * step_seconds + t):
        h += 1
    return h


GBIT = 1e9 / 8  # bytes per second of one Gbit/s
SYNC_CASES = [(4 * 10**9, 1.0, AlphaBeta(50e-6, 1 / GBIT), 2),
              (4 * 10**9, 1.0, AlphaBeta(50e-6, 1 / (10 * GBIT)), 2),
              (4 * 10**9, 1.0, AlphaBeta(50e-6, 1 / (100 * GBIT)), 8),
              (516_272, 0.01, AlphaBeta(50e-6, 1 / GBIT), 2),
              (516_272, 0.5, AlphaBeta(50e-6, 1 / (100 * GBIT)), 2),
              (4 * 10**9, 2.0, AlphaBeta(14e-6, 1 / 50e9), 16)]


def _sync_every_hint(got: object, case: tuple) -> str:
    """Why an H is off, from the usual mistakes."""
    model_bytes, step_seconds, link, world = case
    t = ring_allreduce_cost(link, world).time(model_bytes)
    if not is_int(got):
        return "return a whole number of steps"
    if got == max(1, math.ceil(t / (0.1 * step_seconds))):
        return ("the round lasts H steps plus the allreduce: the share is t / (H step + t), "
                "not t / (H step)")
    if got == max(1, math.ceil(9 * link.time(model_bytes) / step_seconds)):
        return ("one message is not an allreduce: on a ring it costs "
                "ring_allreduce_cost(link, world).time(model_bytes)")
    return "the smallest whole H >= 1 with t <= 0.1 (H step_seconds + t)"


def check_sync_every(sync_every_for: Callable[[float, float, AlphaBeta, int], int] | None
                     ) -> None:
    """Exercise 2: the smallest sync_every that keeps the allreduce under 10% of a round."""
    if not answered(sync_every_for):
        return
    for case in SYNC_CASES:
        got, want = sync_every_for(*case), sync_every_reference(*case)
        if got != want:
            model_bytes, step_seconds, link, world = case
            print(f"not quite: {model_bytes:,} bytes, {step_seconds} s per step, "
                  f"{link.bandwidth * 8 / 1e9:g} Gbit/s, {world} ranks: {got!r}, want {want}: "
                  + _sync_every_hint(got, case))
            return
    lines = ", ".join(f"{c[2].bandwidth * 8 / 1e9:g} Gbit/s H = {sync_every_reference(*c)}"
                      for c in SYNC_CASES[:3])
    print(f"correct: a 1B-parameter model (float32), 1 s per step: {lines}")


# --- what the chapter shows with the package's code, in one launch ---------------------------

def shown_on_ranks() -> dict[str, Any]:
    """On each rank: bf16_against_float32 (section 2), powersgd_exact_and_bytes (section 3)
    and diloco_against_ddp (section 4), one launch for the three."""
    return {"bf16": bf16_against_float32(), "powersgd": powersgd_exact_and_bytes(),
            "diloco against ddp": diloco_against_ddp()}
