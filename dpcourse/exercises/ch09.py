"""Checkers for chapter 09's exercises (ZeRO: where the memory goes, sharding it)."""
from __future__ import annotations

from typing import Callable

from ..data import synthetic_fashion
from ..lenet import lenet_model
from ..memory import STAGES, bytes_per_rank
from ..zero import partition
from ..experiments.zero_demos import activation_bytes
from . import answered, is_int, is_number

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
