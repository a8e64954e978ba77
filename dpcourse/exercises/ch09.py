"""Checkers for chapter 09's exercises (ZeRO: where the memory goes, sharding it)."""
from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data import synthetic_fashion
from ..data_parallel import max_relative_difference
from ..ddp import ScratchDDP
from ..lenet import lenet_model
from ..memory import STAGES, bytes_per_rank
from ..zero import GradientSharding, ShardedOptimizer, partition
from ..experiments.zero_demos import activation_bytes
from . import answered, count, is_int, is_number, recorded

GPUS, GPU_BYTES = 8, 80 * 10**9
MIXED = {"param_bytes": 2, "grad_bytes": 2, "state_bytes": 12}


def largest_model(stage: str, gpus: int = GPUS, gpu_bytes: float = GPU_BYTES,
                  **widths: int) -> float:
    """Parameters whose model states (mixed-precision Adam unless widths say otherwise) just
    fill gpu_bytes per GPU on gpus GPUs at this ZeRO stage."""
    per_parameter = bytes_per_rank(10**9, gpus, stage, **{**MIXED, **widths})["total"] / 10**9
    return gpu_bytes / per_parameter


def close(got: float, want: float) -> bool:
    """Within 1 % of want."""
    return abs(got - want) <= 0.01 * want


def _largest_hint(stage: str, got: float) -> str:
    """Why one stage's answer is off, from the usual mistakes."""
    if close(got, largest_model(stage) / 10**9):
        return "give a number of parameters (for example 5e9), not billions"
    if close(got, largest_model(stage, gpu_bytes=80 * 2**30)):
        return "80 GB here is 80 x 10^9 bytes, not 80 x 2^30 (GiB)"
    parts = {"ddp": "nothing is divided: 2 + 2 + 12 bytes per parameter on every GPU",
             "zero1": "only the 12 bytes of optimizer state are divided by 8",
             "zero2": "the gradients (2 bytes) and the optimizer state (12) are divided by 8",
             "zero3": "all 16 bytes are divided by 8"}
    other = next((s for s in STAGES if s != stage and close(got, largest_model(s))), None)
    if other == "zero3" and stage != "zero3":
        return ("only ZeRO-3 divides all 16 bytes by the 8 GPUs; stage 1 divides only the "
                "optimizer state, stage 2 the state and the gradients")
    if other is not None:
        return f"that is what fits with {other}; with {stage} {parts[stage]}"
    if close(got, largest_model(stage, param_bytes=4, grad_bytes=4, state_bytes=8)):
        return ("that is float32 training (4 + 4 + 8 bytes); with mixed precision parameters "
                "and gradients take 2 bytes each and the optimizer 12 (master copy and moments)")
    if close(got, GPUS * largest_model(stage)):
        return ("each GPU must hold its own share: the model has to fit in 80 GB per GPU, not "
                "in the 640 GB of all eight")
    return f"{parts[stage]}; divide 80 x 10^9 bytes by the bytes per parameter on one GPU"


def check_largest_models(answer: dict[str, float] | None) -> None:
    """Exercise 1: the largest model (parameters) that fits on 8 GPUs of 80 GB with each
    stage, mixed-precision Adam, activations ignored; within 1 %."""
    if not answered(answer):
        return
    if not isinstance(answer, dict) or set(answer) != set(STAGES):
        print(f"not quite: answer with a dict with the keys {list(STAGES)}")
        return
    for stage in STAGES:
        got, want = answer[stage], largest_model(stage)
        if not is_number(got):
            print(f"not quite: {stage}: give a number of parameters, not {got!r}")
            return
        if not close(got, want):
            print(f"not quite: {stage}: {got:.4g} parameters: {_largest_hint(stage, got)}")
            return
    print("correct: " + ", ".join(f"{s} {largest_model(s) / 1e9:.1f}B" for s in STAGES)
          + " parameters; ZeRO-3 fits 8 times what DDP fits, before any activation")


OWNER_CASES = [([102400, 25000, 1250, 180, 128, 50, 20, 10], 2), ([10, 10, 10, 10], 3),
               ([5, 3], 4), ([7], 2), ([], 3), ([4, 4, 2, 2, 2, 2], 2), ([1, 2, 3, 4, 5, 6], 3),
               ([3, 3, 3], 1), ([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2)]


def owner_cases() -> list[tuple[list[int], int]]:
    """(numels, world): LeNet's on 1 to 5 ranks, ties, fewer parameters than ranks, none."""
    lenet = [p.numel() for p in lenet_model().parameters()]
    return [(lenet, world) for world in range(1, 6)] + OWNER_CASES


def _owners_hint(got: list, numels: list[int], world: int) -> str:
    """Why an assignment of owners differs from partition's."""
    if len(got) != len(numels):
        return f"give one owner per parameter: {len(numels)} of them"
    if any(not is_int(r) or not 0 <= r < world for r in got):
        return f"owners are ranks: whole numbers from 0 to {world - 1}"
    if got == [i % world for i in range(len(numels))]:
        return "taking turns ignores the sizes: give each parameter to the least loaded rank"
    in_order, loads = [], [0] * world
    for n in numels:
        in_order.append(min(range(world), key=lambda r: loads[r]))
        loads[in_order[-1]] += n
    if got == in_order:
        return "take the parameters largest first (a stable sort: equal sizes in their order)"
    return ("the least loaded rank is the one owning the fewest numbers so far; on a tie, the "
            "lowest rank")


def check_owners(owners: Callable[[list[int], int], list[int]] | None) -> None:
    """Exercise 2: the owner of each parameter, as zero.partition decides, on many cases."""
    if not answered(owners):
        return
    for numels, world in owner_cases():
        got, want = list(owners(list(numels), world)), partition(numels, world)
        if got != want:
            print(f"not quite: owners({numels}, {world}) returns {got}, partition gives {want}: "
                  f"{_owners_hint(got, numels, world)}")
            return
    lenet = owner_cases()[1][0]
    loads = [sum(n for n, o in zip(lenet, partition(lenet, 2)) if o == r) for r in range(2)]
    print(f"correct: partition's owners in {len(owner_cases())} cases; LeNet on 2 ranks: "
          f"{loads} numbers, the largest share {max(loads) / sum(lenet):.0%} instead of 50%")


TRAFFIC_LAW = {"ddp": 2, "zero1": 3, "zero2": 2, "zero3": 3}  # times (k-1)/k * n


def traffic_reference(stage: str, n: int, k: int) -> float:
    """Numbers each rank sends per step with ring collectives: (k-1)/k * n per reduce-scatter
    or all-gather, an allreduce being one of each."""
    return TRAFFIC_LAW[stage] * (k - 1) / k * n


def _traffic_hint(stage: str, got: float, n: int, k: int) -> str:
    """Why one stage's traffic is off, from the number of ring halves it amounts to."""
    if not is_number(got):
        return "return a number: how many numbers each rank sends"
    if k == 1:
        return "a single rank sends nothing"
    if abs(got - TRAFFIC_LAW[stage] * n) <= 1e-9 * n:
        return "each reduce-scatter or all-gather sends (k-1)/k of the data per rank, not all"
    halves = round(got / ((k - 1) / k * n))
    hints = {("ddp", 1): "an allreduce is a reduce-scatter plus an all-gather: two halves",
             ("zero1", 2): "ZeRO-1 here all-reduces the gradients (ScratchDDP), then "
                           "all-gathers the parameters: three halves",
             ("zero2", 3): "ZeRO-2 reduce-scatters the gradients instead of all-reducing "
                           "them, then all-gathers the parameters: two halves",
             ("zero3", 2): "ZeRO-3 all-gathers the parameters twice (forward and backward) "
                           "and reduce-scatters the gradients: three halves"}
    exact = abs(got - halves * (k - 1) / k * n) <= 1e-9 * n
    if exact and (stage, halves) in hints:
        return hints[(stage, halves)]
    return "each reduce-scatter or all-gather sends (k-1)/k * n per rank"


def check_traffic(traffic: Callable[[str, int, int], float] | None) -> None:
    """Exercise 3: numbers sent per rank and step for each stage, n parameters, k ranks."""
    if not answered(traffic):
        return
    for stage in STAGES:
        for n, k in ((840, 1), (840, 2), (840, 4), (10**9, 8), (1000, 3)):
            got, want = traffic(stage, n, k), traffic_reference(stage, n, k)
            if not is_number(got) or abs(got - want) > 1e-9 * max(n, 1):
                print(f"not quite: traffic({stage!r}, {n}, {k}) returns {got!r}, the ring "
                      f"sends {want:g}: {_traffic_hint(stage, got, n, k)}")
                return
    print("correct: DDP and ZeRO-2 send 2(k-1)/k n per rank, ZeRO-1 (ours) and ZeRO-3 "
          "3(k-1)/k n; for 1B parameters on 8 ranks: "
          + ", ".join(f"{s} {traffic_reference(s, 10**9, 8) / 1e9:.2f}B" for s in STAGES))


def lenet_activation_bytes(batch_size: int) -> int:
    """What activation_bytes measures for LeNet on batch_size synthetic images."""
    X, y = synthetic_fashion("train", max(batch_size, 1)).tensors
    return activation_bytes(lenet_model(), X[:batch_size], y[:batch_size])


def lenet_states() -> int:
    """LeNet's bytes of parameters, gradients and Adam state in float32."""
    return int(bytes_per_rank(sum(p.numel() for p in lenet_model().parameters()), 1,
                              "ddp")["total"])


def activation_crossover() -> int:
    """The smallest batch size at which LeNet's activations exceed its model states."""
    batch = 1
    while lenet_activation_bytes(batch) <= lenet_states():
        batch += 1
    return batch


def check_activation_crossover(answer: int | None) -> None:
    """Exercise 4: the smallest per-rank batch at which LeNet's activations exceed its
    16 bytes per parameter."""
    if not answered(answer):
        return
    want = activation_crossover()
    if not is_int(answer):
        print(f"not quite: give a whole number of images, not {answer!r}")
    elif answer == want:
        print(f"correct: {want} images ({lenet_activation_bytes(want):,} bytes of activations "
              f"against {lenet_states():,} bytes of model states)")
    elif answer == want - 1:
        print(f"not quite: {answer} images give {lenet_activation_bytes(answer):,} bytes, not "
              "yet more than the model states: one more")
    else:
        print(f"not quite: {answer}: divide LeNet's {lenet_states():,} bytes of model states by "
              "its activation bytes per image (section 1); the first whole number of images "
              "above that")


# --- the parts you write: checked on the ranks (on_ranks), each check returns one line ------

SHAPES = [(6, 5), (5,), (20,), (3, 2), (4,)]  # a few parameters of uneven sizes


def _device() -> torch.device:
    """Where this rank's tensors go: its GPU under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _same_everywhere(seed: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Tensors of SHAPES drawn from seed (on the CPU): the same on every rank, on its device."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype).to(_device()) for shape in SHAPES]


def check_share_parameters(cls: type) -> str:
    """On each rank: your ShardedOptimizer._share_parameters gives every rank the values each
    owner holds for its shard (float32 and float64 parameters), in one broadcast per owner
    and dtype, and leaves the rank's own shard as it is."""
    rank = dist.get_rank()
    params = [nn.Parameter(t.to(torch.float32 if i % 2 else torch.float64))
              for i, t in enumerate(_same_everywhere(0))]
    opt = cls(params, torch.optim.SGD, lr=0.1)
    stepped = [p.detach() * 2 + 1 for p in params]  # what the owners' step left
    kinds = {(opt.owner(p), p.dtype) for p in params}
    with torch.no_grad():
        for p, new in zip(params, stepped):
            if opt.owner(p) == rank:
                p.copy_(new)
    with recorded("broadcast") as handed, torch.no_grad():  # no_grad: as in step
        opt._share_parameters()
    calls = [(t.dtype, t.numel()) for t in handed]
    for i, (p, new) in enumerate(zip(params, stepped)):
        owner = opt.owner(p)
        assert p.dtype == new.dtype, f"parameter {i} changed dtype: copy into it, same dtype"
        assert torch.equal(p.detach(), new), (
            f"parameter {i} (owned by rank {owner}) does not hold rank {owner}'s values after "
            "_share_parameters: every rank in turn broadcasts its shard (src=that rank) and "
            "the others copy it into their parameters")
    assert len(calls) <= len(kinds), (
        f"{count(len(calls), 'broadcast')} for {count(len(kinds), '(owner, dtype) pair')}: "
        "send each owner's shard as one flat buffer per dtype (torch.cat of the flattened "
        "parameters)")
    want = sorted((str(dtype), sum(p.numel() for p in params
                                   if opt.owner(p) == owner and p.dtype == dtype))
                  for owner, dtype in kinds)
    sent = sorted((str(dtype), n) for dtype, n in calls)
    assert sent == want, (
        f"the broadcasts sent {sent}, one buffer per (owner, dtype) would send {want}: a shard "
        "of float32 and float64 parameters in one torch.cat goes as float64 (the float32 ones "
        "at twice their bytes); make one flat buffer per dtype")
    return (f"_share_parameters is right: on {dist.get_world_size()} ranks every parameter "
                "holds its owner's values, one broadcast per owner and dtype")


def check_step(cls: type) -> str:
    """On each rank: your ShardedOptimizer.step over AdamW equals plain AdamW over all the
    parameters for 3 steps (float64, 1e-12), a change of lr included; the closure is called
    with gradients enabled and its loss returned; this rank keeps state for its shard only."""
    rank = dist.get_rank()
    params = [nn.Parameter(t) for t in _same_everywhere(0)]
    reference = [nn.Parameter(t) for t in _same_everywhere(0)]
    opt = cls(params, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for p, r, g in zip(params, reference, _same_everywhere(step + 1)):
            p.grad, r.grad = g.clone(), g.clone()
        if step == 2:  # as a scheduler does: the new lr is set in param_groups
            for group in (*opt.param_groups, *plain.param_groups):
                group["lr"] = 5e-2
        seen: list[bool] = []
        loss = opt.step(lambda: seen.append(torch.is_grad_enabled()) or 1.5)
        plain.step()
        assert len(seen) == 1 and loss == 1.5, (
            f"step(closure) called the closure {len(seen)} times and returned {loss!r}: call "
            "it once and return its loss")
        assert seen == [True], ("the closure ran without gradients: call it under "
                                "torch.enable_grad() (step itself runs under torch.no_grad())")
        for i, (p, r) in enumerate(zip(params, reference)):
            if max_relative_difference(p.detach(), r.detach()) <= 1e-12:
                continue
            assert step == 2 or opt.owner(p) == rank, (
                f"after step {step + 1}, parameter {i} (owned by rank {opt.owner(p)}) differs "
                "from plain AdamW's: after stepping your shard, call self._share_parameters()")
            assert step == 2, (f"after step {step + 1}, parameter {i}, which this rank owns, "
                               "differs from plain AdamW's: step it with self.optim.step()")
            raise AssertionError(
                f"after lr changed in param_groups, parameter {i} differs from plain AdamW's: "
                "copy each group's hyperparameters (all but 'params') into the matching group "
                "of self.optim.param_groups before self.optim.step()")
    assert len(opt.optim.state) == len(opt.shard()), (
        "this rank's optimizer holds state for parameters it does not own: step self.optim "
        "(built over your shard), not another optimizer over all the parameters")
    return (f"step is right: on {dist.get_world_size()} ranks, 3 AdamW steps equal plain "
                "AdamW's within 1e-12 (a change of lr included), state for the own shard only")


def check_reduce_scatter_hook(hook: Callable) -> str:
    """On each rank: ScratchDDP with your hook leaves this rank the average over the ranks of
    the gradients of the parameters it owns (against one process on the whole batch, 1e-12),
    and no gradient of the others; a second backward before the step adds to them. With one
    bucket for the whole model and with one bucket per parameter."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(4 * world, 6, generator=gen, dtype=torch.float64).to(_device())
    y = (torch.arange(4 * world) % 3).to(_device())
    for cap in (25.0, 0.0):
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double().to(X.device)
        ddp = ScratchDDP(model, bucket_cap_mb=cap)  # rank 0's parameters everywhere
        whole = copy.deepcopy(model)
        F.cross_entropy(whole(X), y).backward()
        opt = ShardedOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
        with GradientSharding(opt) as state:
            ddp.register_comm_hook(state, hook)
            for passes in (1, 2):
                calls, reduce_scatter = [], dist.reduce_scatter
                dist.reduce_scatter = lambda *a, **k: calls.append(1) or reduce_scatter(*a, **k)
                try:
                    F.cross_entropy(ddp(X.chunk(world)[rank]), y.chunk(world)[rank]).backward()
                finally:
                    dist.reduce_scatter = reduce_scatter
                assert len(calls) == len(ddp.buckets), (
                    f"{count(len(calls), 'call')} of dist.reduce_scatter for "
                    f"{count(len(ddp.buckets), 'bucket')}: "
                    "reduce-scatter each bucket once (no allreduce)")
                for i, (p, r) in enumerate(zip(model.parameters(), whole.parameters())):
                    if opt.owner(p) != rank:
                        assert p.grad is None, (
                            f"rank {rank} still holds the gradient of parameter {i}, owned by "
                            f"rank {opt.owner(p)}: call state._queue_drop() first")
                        continue
                    want = passes * r.grad
                    if max_relative_difference(p.grad, want) <= 1e-12:
                        continue
                    assert max_relative_difference(p.grad, world * want) > 1e-12, (
                        "your gradients are the sums over the ranks: divide each rank's piece "
                        "by the number of ranks")
                    assert passes == 1 and max_relative_difference(p.grad, r.grad) > 1e-12, (
                        "a second backward before the step lost the first one's averages: "
                        "hand _own_averages state.set_aside.pop(p, None) with each own slice")
                    raise AssertionError(
                        f"parameter {i}'s gradient on its owner, rank {rank}, is not the "
                        "average over the ranks: lay out the slices owner by owner and "
                        "reduce-scatter them (dist.reduce_scatter(mine, pieces))")
    return (f"reduce_scatter_hook is right: on {world} ranks each keeps the average of its "
                "own gradients only, also over two backward passes")


# --- exercise 5: shard by numbers, not by whole parameters -----------------------------------

Piece = tuple[int, int, int]  # (parameter index, start, stop) within that parameter


def flat_shards_reference(numels: list[int], world: int) -> list[list[Piece]]:
    """The parameters laid end to end, cut into world runs of ceil(N / world) numbers (the
    last ones shorter or empty): each rank's pieces, in order, empty pieces left out."""
    size = -(-sum(numels) // world)
    shards: list[list[Piece]] = [[] for _ in range(world)]
    offset = 0
    for i, n in enumerate(numels):
        start = offset
        while start < offset + n:
            rank = start // size
            stop = min(offset + n, (rank + 1) * size)
            shards[rank].append((i, start - offset, stop - offset))
            start = stop
        offset += n
    return shards


def flat_loads(shards: list[list[Piece]]) -> list[int]:
    """The numbers each rank owns."""
    return [sum(stop - start for _, start, stop in shard) for shard in shards]


def _flat_hint(got: object, numels: list[int], world: int) -> str:
    """Why a flat sharding differs from the reference."""
    if not isinstance(got, (list, tuple)) or len(got) != world:
        return f"return one list of pieces per rank: {world} lists"
    if any(not isinstance(s, (list, tuple)) or any(
            not isinstance(x, (list, tuple)) or len(x) != 3 for x in s) for s in got):
        return "each rank's list holds (parameter index, start, stop) triples"
    pieces = [tuple(x) for s in got for x in s]
    if any(start == stop for _, start, stop in pieces):
        return "leave out empty pieces (start == stop)"
    covered = sum(stop - start for _, start, stop in pieces)
    if covered != sum(numels):
        return (f"the pieces cover {covered} of the {sum(numels)} numbers: with runs of "
                "ceil(N / world) numbers every number has exactly one owner")
    return ("rank r owns the numbers r*s to (r+1)*s - 1 of the flat vector, s = ceil(N / "
            "world); a piece's start and stop count from the start of its parameter")


def check_flat_shards(flat_shards: Callable[[list[int], int], list] | None) -> None:
    """Exercise 5: each rank's pieces when the flat parameters are cut into equal runs."""
    if not answered(flat_shards):
        return
    cases = owner_cases() + [([5, 0, 3], 2), ([0, 0], 2), ([10], 3), ([2, 2], 8)]
    for numels, world in cases:
        got, want = flat_shards(list(numels), world), flat_shards_reference(numels, world)
        if not (_is_nested(got) and [[tuple(x) for x in s] for s in got] == want):
            print(f"not quite: flat_shards({numels}, {world}) returns {got}, want {want}: "
                  f"{_flat_hint(got, numels, world)}")
            return
    lenet = owner_cases()[1][0]
    shares = []
    for world in (2, 4):
        flat, whole = flat_loads(flat_shards_reference(lenet, world)), [
            sum(n for n, o in zip(lenet, partition(lenet, world)) if o == r) for r in range(world)]
        shares.append(f"{world} ranks: largest share {max(flat) * world / sum(lenet):.3f} x the "
                      f"even one, by whole parameters {max(whole) * world / sum(lenet):.3f} x")
    print("correct: every number has one owner; LeNet, " + "; ".join(shares))


def _is_nested(got: object) -> bool:
    """Whether got is a list of lists of triples (so it can be compared)."""
    return isinstance(got, (list, tuple)) and all(
        isinstance(s, (list, tuple)) and all(isinstance(x, (list, tuple)) for x in s)
        for s in got)
