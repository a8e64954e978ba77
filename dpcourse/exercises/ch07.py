"""Checkers for chapter 07's exercises (many processes, DistributedDataParallel by hand)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

from ..comm_hooks import allreduce_hook
from ..data_parallel import max_relative_difference
from ..ddp import make_buckets
from ..experiments.rank_demos import TwoHeads
from ..lenet import init_lenet_params, lenet_model
from ..p2p import ring_chunks
from . import answered, count, forbidden, is_int, is_number, recorded

RING_CASES = [(n, world) for world in (1, 2, 3, 4, 5, 8) for n in (0, 1, 2, 3, 5, 7, 10, 11, 1001)]


def chunk_numels(n: int, world: int) -> list[int]:
    """Sizes of the world chunks torch.tensor_split cuts n elements into: the first
    n % world chunks get one element more."""
    return [n // world + (1 if c < n % world else 0) for c in range(world)]


def ring_sent_reference(n: int, world: int, rank: int) -> int:
    """Elements rank sends in p2p.ring_allreduce of n elements: chunk (rank - step - 1) % world
    in each of the 2(world-1) steps (p2p.ring_chunks)."""
    sizes = chunk_numels(n, world)
    return sum(sizes[(rank - step - 1) % world] for step in range(2 * (world - 1)))


def _ring_hint(got: object, n: int, world: int, rank: int) -> str:
    """Why an answer for one (n, world, rank) of the ring is wrong."""
    sizes = chunk_numels(n, world)
    if not is_int(got):
        return "count whole elements: return an int"
    if world == 1:
        return "with one rank there is no neighbour: nothing is sent"
    if got == 2 * (world - 1) * sizes[rank]:
        return ("a rank does not send its own chunk every time: in step s rank r sends chunk "
                "(r - s - 1) % world, a different one each step")
    if got == 2 * (world - 1) * n // world or got == 2 * (world - 1) * n / world:
        return (f"2(world-1)/world * n holds only on average: tensor_split gives chunks of "
                f"{sizes}, so count which chunks this rank sends")
    return (f"the chunks have {sizes} elements (tensor_split: the first n % world get one more); "
            "in step s = 0 .. 2(world-1)-1 rank r sends chunk (r - s - 1) % world")


def check_ring_sent(ring_sent: Callable[[int, int, int], int] | None) -> None:
    """Exercise 1: elements each rank sends in p2p.ring_allreduce of n elements on world
    ranks, for every rank of many (n, world), with n < world, n = 0 and world = 1 among them."""
    if not answered(ring_sent):
        return
    for n, world in RING_CASES:
        for rank in range(world):
            got, want = ring_sent(n, world, rank), ring_sent_reference(n, world, rank)
            if not is_int(got) or got != want:
                print(f"not quite: ring_sent({n}, {world}, {rank}) returns {got!r}, the ring "
                      f"sends {want}: {_ring_hint(got, n, world, rank)}")
                return
    print(f"correct: every rank's count for {len(RING_CASES)} tensor sizes and world sizes")


SAMPLER_CASES = [(n, world) for world in (1, 2, 3, 4, 8) for n in (0, 1, 2, 3, 7, 8, 10, 12, 25)]


def sampler_indices(n: int, world: int, rank: int, drop_last: bool) -> list[int]:
    """The indices torch's DistributedSampler gives rank of world, without shuffling."""
    return list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False,
                                   drop_last=drop_last))


def _sampler_hint(got: list, want: list, n: int, world: int, rank: int,
                  drop_last: bool) -> str:
    """Why a rank's indices differ from the sampler's."""
    if drop_last and len(got) > len(want):
        return (f"with drop_last the tail is dropped: each rank gets n // world = {n // world} "
                f"indices and the last n % world = {n % world} are never used")
    if not drop_last and len(got) < len(want):
        return (f"without drop_last no example is dropped: the sampler pads the list by wrapping "
                f"around to the start (0, 1, ...) until it divides by {world}, so every rank gets "
                f"ceil(n / world) = {len(want)} indices")
    if len(got) != len(want):
        return f"this rank should get {len(want)} indices"
    dealt = range(rank, min(n, len(want) * world), world)  # the positions not padded
    if got[:len(dealt)] != list(dealt):
        return ("the sampler deals indices out in turn, not in blocks: rank r gets r, r + world, "
                "r + 2 world, ...")
    return ("the padding repeats indices from the start of the dataset (0, 1, ...), wrapping "
            "around again when n < world needs more than n")


def check_shard_indices(shard_indices: Callable[[int, int, int, bool], list[int]] | None) -> None:
    """Exercise 2: each rank's indices from DistributedSampler(range(n), shuffle=False), with
    and without drop_last, compared with torch's sampler itself."""
    if not answered(shard_indices):
        return
    for drop_last in (False, True):
        for n, world in SAMPLER_CASES:
            for rank in range(world):
                got = shard_indices(n, world, rank, drop_last)
                want = sampler_indices(n, world, rank, drop_last)
                if list(got) != want:
                    print(f"not quite: shard_indices({n}, {world}, {rank}, drop_last={drop_last}) "
                          f"returns {list(got)}, DistributedSampler gives {want}: "
                          f"{_sampler_hint(list(got), want, n, world, rank, drop_last)}")
                    return
    print("correct: the sampler's indices on every rank, with and without drop_last; "
          "e.g. 10 samples over 3 ranks:", [sampler_indices(10, 3, r, False) for r in range(3)])


SUM_LOSS_HINTS = {
    256: "256 is what the 4 ranks' gradients add up to; DDP averages them, dividing by the "
         "4 ranks",
    4: "4 is the number of ranks; each rank's sum over its 64 examples is 64 times its mean",
    0.25: "the gradient grows, it does not shrink: a sum over 64 examples is 64 times their mean",
    1: "1 is the factor with reduction='mean' (why DDP averages); reduction='sum' makes each "
       "rank's gradient 64 times its mean's",
    1 / 64: "the other way round: a sum over 64 examples is 64 times their mean, not a 64th",
}


def check_sum_loss_factor(answer: float | None) -> None:
    """Exercise 3: 4 ranks, 64 examples each, reduction='sum', DDP averaging: the gradient is
    64 times the gradient of the mean loss over the global batch of 256."""
    if not answered(answer):
        return
    if not is_number(answer):
        print(f"not quite: give the factor as a number, not {answer!r}")
    elif abs(answer - 64) <= 1e-9:
        print("correct: each rank's sum is 64 x its mean; averaging 4 ranks' means gives the "
              "global mean, so the step is 64 x too large (use lr / 64, or reduction='mean')")
    else:
        hint = next((h for k, h in SUM_LOSS_HINTS.items() if abs(answer - k) <= 1e-9),
                    "write each rank's sum as 64 x its mean, then average over the 4 ranks")
        print(f"not quite: {answer}: {hint}")


def bucket_sizes_reference(numels: list[int], cap_mb: float,
                           dtype: torch.dtype = torch.float32) -> list[int]:
    """Elements per bucket that make_buckets makes for parameters of these numels, in order."""
    params = [nn.Parameter(torch.empty(n, dtype=dtype)) for n in numels]
    return [sum(p.numel() for p in bucket) for bucket in make_buckets(params, cap_mb)]


def lenet_numels() -> list[int]:
    """LeNet's parameter sizes in registration order."""
    return [p.numel() for p in init_lenet_params()]


def bucket_cases() -> list[tuple[list[int], float, torch.dtype]]:
    """(numels, cap in MiB, dtype): LeNet's at several caps, exact fits, oversized, float64."""
    lenet = lenet_numels()
    return [(lenet, 25.0, torch.float32), (lenet, 0.25, torch.float32),
            (lenet, 0.1, torch.float32), (lenet, 0.0, torch.float32),
            ([2**17, 2**17, 2**17], 1.0, torch.float32),  # half a MiB each: two fill a bucket
            ([2**18, 2**18], 1.0, torch.float32),  # exactly one MiB each
            ([10, 3 * 2**18, 20, 30], 0.5, torch.float32),  # 3 MiB: over the cap, alone
            (lenet, 0.1, torch.float64)]


def _bucket_hint(got: list, numels: list[int], cap_mb: float, dtype: torch.dtype) -> str:
    """Why bucket sizes differ from make_buckets'."""
    if sum(got) != sum(numels):
        return f"every parameter goes into exactly one bucket: the sizes add up to {sum(numels)}"
    if cap_mb == 0:
        return "cap 0 means one bucket per parameter"
    forward = bucket_sizes_reference(numels[::-1], cap_mb, dtype)  # filled first to last
    if got in (forward, forward[::-1]):
        return ("buckets are filled in reverse registration order (backward produces the last "
                "layer's gradients first), and listed in that order")
    if dtype != torch.float32 and got == bucket_sizes_reference(numels, cap_mb):
        return "these parameters are float64: 8 bytes per element (use bytes_per_element)"
    cap = f"{cap_mb * 2**20:,.1f}".removesuffix(".0")
    return (f"the cap is cap_mb * 2**20 = {cap} bytes; a bucket may fill up to "
            "exactly the cap, a new one starts only when the next parameter would exceed it, "
            "and a parameter larger than the cap gets a bucket of its own")


def check_bucket_sizes(bucket_sizes: Callable[..., list[int]] | None) -> None:
    """Exercise 4: elements per bucket, in launch order, that dpcourse.ddp.make_buckets makes,
    compared with make_buckets itself on real parameters."""
    if not answered(bucket_sizes):
        return
    for numels, cap_mb, dtype in bucket_cases():
        width = torch.empty(0, dtype=dtype).element_size()
        got = list(bucket_sizes(list(numels), cap_mb, width))
        want = bucket_sizes_reference(numels, cap_mb, dtype)
        if got != want:
            print(f"not quite: bucket_sizes({numels}, {cap_mb}, {width}) returns {got}, "
                  f"make_buckets makes {want}: {_bucket_hint(got, numels, cap_mb, dtype)}")
            return
    print("correct: the buckets of make_buckets; LeNet's at 0.25 MiB:",
          bucket_sizes_reference(lenet_numels(), 0.25), "elements")


def ring_chunks_left_reference(rank: int, world: int, step: int) -> tuple[int, int]:
    """The ring the other way: rank r sends to r - 1 and receives from r + 1, and still holds
    the full sum of chunk r after the reduce-scatter."""
    return (rank + step + 1) % world, (rank + step + 2) % world


def play_ring(chunks: Callable[[int, int, int], tuple[int, int]], world: int,
              left: bool) -> str:
    """Play the ring's 2(world-1) steps on sets of contributions (which ranks' values a chunk
    holds) with chunks(rank, world, step) -> (sent, received); "" if it sums right, else why."""
    held = [[{r} for _ in range(world)] for r in range(world)]
    for step in range(2 * (world - 1)):
        plan = [tuple(chunks(r, world, step)) for r in range(world)]
        if any(len(pair) != 2 or not all(is_int(c) and 0 <= c < world for c in pair)
               for pair in plan):
            return (f"in step {step} on {world} ranks: return two chunk numbers from 0 to "
                    f"{world - 1}")
        sent = [set(held[r][plan[r][0]]) for r in range(world)]
        for r in range(world):
            source = (r + 1) % world if left else (r - 1) % world
            if plan[source][0] != plan[r][1]:
                return (f"in step {step} on {world} ranks, rank {source} sends chunk "
                        f"{plan[source][0]} to rank {r}, which expects chunk {plan[r][1]}")
            if step < world - 1:
                if held[r][plan[r][1]] & sent[source]:
                    return (f"in step {step} on {world} ranks, rank {r} adds rank(s) "
                            f"{sorted(held[r][plan[r][1]] & sent[source])}' values to chunk "
                            f"{plan[r][1]} a second time")
                held[r][plan[r][1]] |= sent[source]
            else:
                held[r][plan[r][1]] = sent[source]
        if step == world - 2:
            short = [r for r in range(world) if held[r][r] != set(range(world))]
            if short:
                return (f"on {world} ranks, after the reduce-scatter rank {short[0]} does not "
                        f"hold the full sum of chunk {short[0]}")
    everyone = set(range(world))
    missing = [(r, c) for r in range(world) for c in range(world) if held[r][c] != everyone]
    if missing:
        return (f"on {world} ranks, at the end rank {missing[0][0]}'s chunk {missing[0][1]} is "
                "not the full sum")
    return ""


def check_ring_left(ring_chunks_left: Callable[[int, int, int], tuple[int, int]] | None) -> None:
    """Exercise 5: the chunk schedule of a ring that sends to the left, played on 2-7 ranks."""
    if not answered(ring_chunks_left):
        return
    for world in range(2, 8):
        why = play_ring(ring_chunks_left, world, left=True)
        if why:
            print(f"not quite: {why}")
            return
    print("correct: sending left, rank r sends chunk (r + s + 1) % world in step s and receives "
          "(r + s + 2) % world; e.g. rank 0 of 4:",
          [ring_chunks_left_reference(0, 4, s) for s in range(6)])


# --- the parts you write: they run on the ranks (on_ranks); each check returns one line ------

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all")


def _ring_values(rank: int, n: int) -> torch.Tensor:
    """Rank's n int64 values for the ring's check, the same on every run."""
    generator = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randint(-1000, 1000, (n,), generator=generator)


def _every_step_adds(n: int, world: int) -> list[torch.Tensor]:
    """What each rank would hold if every step of the ring added what it received (the
    all-gather steps included): a common slip, named by check_plain_ring."""
    held = [[c.clone() for c in _ring_values(r, n).tensor_split(world)] for r in range(world)]
    for step in range(2 * (world - 1)):
        sent = [held[r][ring_chunks(r, world, step)[0]].clone() for r in range(world)]
        for r in range(world):
            held[r][ring_chunks(r, world, step)[1]] += sent[(r - 1) % world]
    return [torch.cat(h) for h in held]


def check_plain_ring(ring: Callable[[torch.Tensor], int]) -> str:
    """On each rank: your plain_ring_allreduce sums int64 tensors of several sizes in place,
    with send and receive only, and returns the elements this rank sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for n in (0, 1, 2, world, 10, 3001):
        mine = _ring_values(rank, n)
        with forbidden(COLLECTIVES, "the ring may use only send/recv (isend/irecv, P2POp): "
                       "no collective such as dist.all_reduce"):
            sent = ring(mine)
        want = sum((_ring_values(r, n) for r in range(world)), torch.zeros(n, dtype=torch.int64))
        wrong = (mine != want).nonzero()
        slip = ("; the all-gather steps (the last world - 1) must overwrite the chunk they "
                "receive, not add to it" if torch.equal(mine, _every_step_adds(n, world)[rank])
                else "")
        assert len(wrong) == 0, (
            f"{count(n, 'element')}: element {wrong[0].item()} is {mine[wrong[0]].item()}, "
            f"the sum over the ranks is {want[wrong[0]].item()}{slip}")
        should = ring_sent_reference(n, world, rank)
        assert sent == should, (f"{count(n, 'element')}: returns {sent!r} elements sent, but "
                                f"the chunks it sent hold {should}")
    return (f"plain_ring_allreduce is right: the sum on {world} ranks for 0 to 3001 elements, "
            "send and receive only, and the elements each rank sent")


class _WithBuffer(nn.Module):
    """Two parameters and a buffer (a BatchNorm's running mean), all filled from seed."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layer, self.norm = nn.Linear(4, 3), nn.BatchNorm1d(3)
        self.norm.running_mean += torch.randn(3)


def check_broadcast(broadcast_parameters: Callable[[nn.Module], None]) -> str:
    """On each rank: your broadcast_parameters gives every rank rank 0's parameters and
    buffers, as torch's DistributedDataParallel does at construction."""
    rank = dist.get_rank()
    model = _WithBuffer(seed=rank)
    with recorded("broadcast") as handed:
        broadcast_parameters(model)
    given = {t.untyped_storage().data_ptr() for t in handed}  # the storage broadcast into
    rank_0 = _WithBuffer(seed=0)
    for (name, got), want in zip(model.state_dict().items(), rank_0.state_dict().values()):
        if name.endswith("num_batches_tracked"):
            continue
        into_a_copy = given and got.untyped_storage().data_ptr() not in given
        assert torch.equal(got, want), (
            f"{name} is not rank 0's after broadcast_parameters" + (
                ": broadcast writes rank 0's values in place into the tensor it is given, and "
                "it was given a copy (.clone() or .to()): give it the parameter itself"
                if into_a_copy else
                ": broadcast the buffers too (module.buffers())" if "running" in name else ""))
    torch_ddp = nn.parallel.DistributedDataParallel(_WithBuffer(seed=rank))
    assert all(torch.equal(a, b) for a, b in zip(torch_ddp.module.state_dict().values(),
                                                 model.state_dict().values())), (
        "torch's DDP starts from other values than yours")
    return ("broadcast_parameters is right: every rank holds rank 0's parameters and buffers, "
            "as torch's DDP does")


class _Recorder:
    """A comm hook's state: what each call received (bucket index, a copy of the buffer)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor, list, bool]] = []


def _recording_hook(state: _Recorder, bucket: Any) -> torch.futures.Future:
    state.calls.append((bucket.index(), bucket.buffer().clone(), bucket.parameters(),
                        bucket.is_last()))
    return allreduce_hook(None, bucket)


def _shards(batch: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float64 batch drawn alike on every rank, and this rank's equal share of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    X = torch.randn(batch, 1, 28, 28, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return X, y, X.chunk(world)[rank], y.chunk(world)[rank]


def _grads(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of the mean loss of a fresh copy of model's start on X, y."""
    model.zero_grad()
    F.cross_entropy(model(X), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _scratch_steps(cls: type, bucket_cap_mb: float) -> dict[str, Any]:
    """Two ScratchDDP steps of LeNet (float64, started differently on every rank) with your
    class; what the comm hook received, and the gradients against one process's."""
    X, y, Xr, yr = _shards()
    model = cls(lenet_model(seed=dist.get_rank()).double(), bucket_cap_mb)
    record = _Recorder()
    model.register_comm_hook(record, _recording_hook)
    found: dict[str, Any] = {"steps": []}
    for _ in range(2):
        record.calls.clear()
        model.module.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(Xr), yr)
        try:
            loss.backward()
        except (NotImplementedError, AssertionError):
            raise
        except Exception as error:  # noqa: BLE001 - said in one line instead
            raise AssertionError(f"backward failed: {type(error).__name__}: {error}") from None
        found["steps"].append({"calls": list(record.calls), "finished": not model._syncing,
                               "futures left": sum(b.future is not None for b in model.buckets),
                               "launched in backward": model.launched_in_backward})
    found["buckets"] = [b.params for b in model.buckets]
    found["position"] = {id(p): k for k, p in enumerate(model.module.parameters())}
    found["local"] = _grads(lenet_model(seed=0).double(), Xr, yr)
    found["global"] = _grads(lenet_model(seed=0).double(), X, y)
    found["got"] = [p.grad for p in model.module.parameters()]
    return found


def _flat_local(found: dict[str, Any], params: list) -> torch.Tensor:
    """This rank's own (not averaged) gradients of params, flattened in order."""
    return torch.cat([found["local"][found["position"][id(p)]].reshape(-1) for p in params])


def _check_ddp_steps(cls: type, what: str) -> None:
    """What every ScratchDDP part must give: each bucket handed to the comm hook once per
    step, in index order, during backward, with this rank's finished gradients; and the
    averaged gradients of one process on the whole batch in .grad."""
    for cap in (0.0, 0.1):  # one bucket per parameter (8), then LeNet's 3
        found = _scratch_steps(cls, cap)
        buckets = found["buckets"]
        for step in found["steps"]:
            assert step["finished"], ("backward ended but _finish never ran: the given "
                                      "_queue_finish() queues it once per backward")
            assert not step["futures left"], (
                f"{step['futures left']} buckets still hold a future after backward: set "
                "bucket.future = None once its average is written")
            order = [c[0] for c in step["calls"]]
            assert order == list(range(len(buckets))), (
                f"{count(len(buckets), 'bucket')}: the comm hook got buckets {order} in one "
                f"backward; want each once, in index order {list(range(len(buckets)))}")
            for i, flat, params, last in step["calls"]:
                assert len(params) == len(buckets[i]) and all(
                    p is q for p, q in zip(params, buckets[i])), (
                    f"bucket {i} handed to the hook with other parameters than "
                    "self.buckets[i].params")
                assert last == (i == len(buckets) - 1), (
                    f"bucket {i} says is_last()={last}")
                local = _flat_local(found, buckets[i])
                assert flat.shape == local.shape and torch.allclose(flat, local, rtol=1e-12,
                                                                    atol=0), (
                    f"bucket {i}'s buffer is not this rank's finished gradients "
                    "of its parameters, flattened in order (launched before they were ready?)")
            assert step["launched in backward"] == len(buckets), (
                f"{count(len(buckets), 'bucket')}: only {step['launched in backward']} "
                "launched while backward ran; launch each as soon as it and those before it "
                "are ready")
        difference = max_relative_difference(found["got"], found["global"])
        assert difference < 1e-12, (
            f".grad differs from one process's gradient on the whole batch by "
            f"{difference:.1e} of its scale (averaged and written back?)")
    return f"{what} is right: buckets in index order during backward, gradients averaged"


def check_grad_ready(cls: type) -> str:
    """On each rank: ScratchDDP with your _grad_ready launches every bucket during backward,
    in index order, once complete, and queues _finish; gradients equal one process's."""
    return _check_ddp_steps(cls, "_grad_ready")


def check_launch(cls: type) -> str:
    """On each rank: ScratchDDP with your _launch hands the hook GradBucket(i, this rank's
    flattened gradients, the bucket's parameters, is_last) and keeps its future."""
    return _check_ddp_steps(cls, "_launch")


def check_finish(cls: type) -> str:
    """On each rank: ScratchDDP with your _finish launches what is left, waits for every
    bucket and writes the averages into .grad; an unused layer gets zeros."""
    line = _check_ddp_steps(cls, "_finish")
    torch.manual_seed(0)  # TwoHeads: a layer unused in every step
    net = TwoHeads()
    model = cls(net, 0.0)
    model(torch.randn(8, 4)).sum().backward()
    grad = net.head_b.weight.grad
    assert grad is not None and torch.equal(grad, torch.zeros_like(grad)), (
        f"the unused head's gradient is {grad}, want zeros: launch the "
        "buckets backward never completed before waiting")
    return line + ", an unused layer's gradient zero"
