"""Checkers for chapter 14's parts and exercises (fault-tolerant HSDP: the global batch cut among
groups and their ranks, the gradient path, shard-wise recovery, groups at scale)."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..elastic import rank_indices
from . import answered, is_int, is_number, one_line_failure

# --- part 2: the global batch for any quorum of groups ---

GROUP_CASES = [  # (what, n, G, groups, group size, steps, seed)
    ("G=22 in 3 groups of 2", 66, 22, 3, 2, [0, 1, 2, 4], 3),
    ("G=7 in 2 groups of 3", 30, 7, 2, 3, [0, 3, 4, 9], 1),
    ("G=8 in 2 groups of 1 rank", 40, 8, 2, 1, [0, 6], 2),
    ("G=5 in 2 groups of 4 (more ranks than samples)", 20, 5, 2, 4, [0, 5], 0),
    ("G=2 in 3 groups of 2 (more groups than samples)", 10, 2, 3, 2, [0, 7], 5),
]


def reference_group_share(n: int, global_batch: int, groups: int, group: int, size: int,
                          rank: int, step: int, seed: int) -> list[int]:
    """An independent reference: the step's whole global batch, the group's cut of it among
    min(groups, G) members (none past them), and the rank's cut of that."""
    batch = rank_indices(n, global_batch, 1, 0, step, seed)
    members = min(groups, global_batch)
    if group >= members:
        return []
    mine = batch[group * global_batch // members:(group + 1) * global_batch // members]
    return mine[rank * len(mine) // size:(rank + 1) * len(mine) // size]


def _share_hint(got: list[int], everyone: list[list[int]], n: int, global_batch: int,
                groups: int, group: int, size: int, rank: int, step: int, seed: int) -> str:
    """Why rank `rank`'s samples are wrong; everyone: what each rank of its group took."""
    if groups * size <= global_batch and got == rank_indices(
            n, global_batch, groups * size, group * size + rank, step, seed):
        return (f"the flat cut among all {groups} x {size} ranks: a group's samples must not "
                "depend on its size g, so cut the global batch among the groups first "
                "(chapter 13's member cut, whatever g), then the group's cut among its ranks")
    if not set(got) <= set(rank_indices(n, global_batch, 1, 0, step, seed)):
        return (f"samples outside global batch {step}: take the step's global batch "
                "(rank_indices(n, G, 1, 0, step, seed): its epoch's order, seed + epoch), "
                "then the group's cut of it")
    cut = reference_group_share(n, global_batch, groups, group, 1, 0, step, seed)
    if sorted(i for took in everyone for i in took) != sorted(cut):
        return (f"the ranks of group {group} overlap or miss samples: together they take its "
                f"cut {cut} exactly once")
    return (f"rank r of g takes positions floor(r m / g) up to floor((r + 1) m / g) of its "
            f"group's m samples, {cut} (share(n, G, groups, group, step, seed))")


def check_group_share(group_share: Callable[..., list[int]]) -> None:
    """Part 2: group_share(n, G, groups, group, size, rank, step, seed) is chapter 13's cut
    among the groups, cut again among the group's ranks, on uneven cuts and over epochs."""
    one_line_failure("group_share", lambda: group_share(66, 22, 3, 1, 2, 0, 0, 3))
    for what, n, global_batch, groups, size, steps, seed in GROUP_CASES:
        for step in steps:
            for group in range(groups):
                everyone = [one_line_failure(
                    f"{what}, step {step}: group {group} rank {rank}",
                    lambda: [int(i) for i in group_share(n, global_batch, groups, group, size,
                                                         rank, step, seed)])
                    for rank in range(size)]
                for rank, got in enumerate(everyone):
                    want = reference_group_share(n, global_batch, groups, group, size, rank,
                                                 step, seed)
                    if got != want:
                        raise AssertionError(
                            f"{what} (n={n}, seed {seed}), step {step}: group {group} rank "
                            f"{rank} took {got}, expected {want}: " + _share_hint(
                                got, everyone, n, global_batch, groups, group, size, rank,
                                step, seed))
    nested = [len(reference_group_share(66, 22, 3, i // 2, 2, i % 2, 0, 3)) for i in range(6)]
    flat = [len(rank_indices(66, 22, 6, r, 0, 3)) for r in range(6)]
    print(f"correct: {len(GROUP_CASES)} cases over two epochs; G=22 in 3 groups of 2: the ranks "
          f"take {nested} samples (the flat cut among 6 ranks would take {flat})")


# --- part 3: the gradient path ---

GRADIENT_CASES = [(2, 3, 13), (3, 2, 5), (1, 4, 9), (2, 1, 3), (1, 1, 2), (3, 4, 25), (2, 2, 7)]
# (groups q, group size g, global batch G: never q x g, so that the divisions differ)
CHUNK = 3  # elements of one shard


def _close(got: Any, want: torch.Tensor) -> bool:
    """Whether got is a tensor of want's shape within 1e-12 of it, relative to its largest."""
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and (got - want).abs().max().item() <= 1e-12 * want.abs().max().item())


def _all_close(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> bool:
    return all(_close(g, w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))


def _gradient_hint(got: list[list[torch.Tensor]], sums: list[list[torch.Tensor]],
                   global_batch: int) -> str:
    """Why the shards are wrong, from the usual slips."""
    groups, size = len(sums), len(sums[0])
    total = sum(s for group in sums for s in group)
    shards = [chunk / global_batch for chunk in total.chunk(size)]
    if _all_close(got, [[s * global_batch / (groups * size) for s in shards]] * groups):
        return (f"divided by q x g = {groups * size}, not by G = {global_batch}: a mean of the "
                "ranks' means weighs ranks of different sample counts equally; the sum over "
                "the global batch is divided by its sample count, G")
    own = [[c / global_batch for c in sum(group).chunk(size)] for group in sums]
    if groups > 1 and _all_close(got, own):
        return ("each group holds its own sum only: shard r must be allreduced across the "
                "groups (the ranks holding shard r, one per group) before dividing by G")
    if _all_close(got, [[total[r::size] / global_batch for r in range(size)]] * groups):
        return ("rank r's shard is a contiguous chunk, the r-th of g (tensor.chunk(g)[r]), "
                "not every g-th element")
    for i, group in enumerate(got):
        for r, shard in enumerate(group):
            other = [s for s in range(size) if _close(shard, shards[s])]
            if other and other != [r]:
                return (f"group {i} holds shard {other[0]} in position {r}: each group's list "
                        "holds shard r in position r (rank r's)")
    return ("reduce-scatter each group's sums (rank r: the sum of the r-th of g chunks), "
            "allreduce shard r across the groups, divide by G")


def check_shard_gradients(shard_gradients: Callable[..., list[list[torch.Tensor]]]) -> None:
    """Part 3: shard_gradients(sums, G): rank r of every group gets shard r of the global
    batch's mean gradient, on random float64 sums, within 1e-12 (rounding only)."""
    generator = torch.Generator().manual_seed(14)
    for groups, size, global_batch in GRADIENT_CASES:
        sums = [[torch.randn(size * CHUNK, generator=generator, dtype=torch.float64)
                 for _ in range(size)] for _ in range(groups)]
        what = f"{groups} groups of {size} ranks, G={global_batch}"
        got = one_line_failure(f"shard_gradients ({what})", lambda: shard_gradients(
            [[s.clone() for s in group] for group in sums], global_batch))
        total = sum(s for group in sums for s in group)
        want = [[chunk / global_batch for chunk in total.chunk(size)]] * groups
        if not (isinstance(got, (list, tuple)) and len(got) == groups and all(
                isinstance(g, (list, tuple)) and len(g) == size for g in got)):
            raise AssertionError(f"{what}: return one list per group ({groups}), each of its "
                                 f"{size} ranks' shards; got {type(got).__name__} {got!r}")
        if not all(isinstance(s, torch.Tensor) and s.shape == (CHUNK,) for g in got for s in g):
            raise AssertionError(f"{what}: each shard is a tensor of {CHUNK} elements (the "
                                 f"sums have {size * CHUNK}, in {size} chunks); got shapes "
                                 f"{[[tuple(getattr(s, 'shape', ())) for s in g] for g in got]}")
        if not _all_close(got, want):
            raise AssertionError(f"{what}, sums of {size * CHUNK} elements: "
                                 + _gradient_hint(got, sums, global_batch))
    print(f"correct: {len(GRADIENT_CASES)} cases of 1 to 3 groups of 1 to 4 ranks, to 1e-12: "
          "every group holds the same shards of the global batch's mean gradient")


# --- part 5: shard-wise recovery ---

SOURCE_CASES = [  # (what, steps, qids)
    ("2 up-to-date groups, 1 behind", [5, 0, 5], [2, 0, 2]),
    ("1 up-to-date group, 2 behind", [0, 5, 0], [0, 2, 0]),
    ("3 up-to-date groups, 1 behind", [5, 5, 5, 3], [2, 2, 2, 1]),
    ("3 up-to-date groups, 2 behind", [5, 0, 5, 3, 5], [2, 0, 2, 1, 2]),
    ("the same step under an older quorum id", [5, 5, 5], [2, 3, 3]),
    ("every group up to date", [5, 5], [2, 2]),
]
SHARDS = 4  # shards 0 to 3 of every case


def reference_sources(steps: list[int], qids: list[int], shard: int) -> dict[int, int]:
    """An independent reference: the j-th group behind copies shard `shard` from the
    ((j + shard) mod n)-th of the n up-to-date groups."""
    versions = list(zip(steps, qids))
    current = [i for i, v in enumerate(versions) if v == max(versions)]
    behind = [i for i, v in enumerate(versions) if v != max(versions)]
    return {member: current[(j + shard) % len(current)] for j, member in enumerate(behind)}


def _sources_hint(got: dict[int, int], steps: list[int], qids: list[int], shard: int) -> str:
    """Why a plan of one shard is wrong, from the usual slips."""
    versions = list(zip(steps, qids))
    current = {i for i, v in enumerate(versions) if v == max(versions)}
    if got == reference_sources(steps, [0] * len(steps), shard):
        return ("compare whole versions (step, then quorum id): the same step committed under "
                "another quorum id is another history, so that group is behind")
    if set(got) & current:
        return (f"an up-to-date group in the plan ({sorted(set(got) & current)}): only the "
                "groups behind copy")
    if set(got.values()) - current:
        return (f"a source that is itself behind ({sorted(set(got.values()) - current)}): copy "
                "only from an up-to-date group (the largest version)")
    if shard and got == reference_sources(steps, qids, 0):
        return ("every shard from the same group: move shard r's source r places along the "
                "up-to-date groups from chapter 13's recovery_plan, so that one group's shards "
                "come from several groups")
    return ("chapter 13's recovery_plan(steps, qids) (the up-to-date groups in turn), each "
            "source moved `shard` places along the up-to-date groups")


def check_shard_sources(shard_sources: Callable[[list[int], list[int], int], dict[int, int]]
                        ) -> None:
    """Part 5: shard_sources(steps, qids, shard) maps each group behind to the up-to-date group
    that sends it shard `shard`, spread over the up-to-date groups."""
    one_line_failure("shard_sources", lambda: shard_sources([5, 0, 5], [2, 0, 2], 1))
    for what, steps, qids in SOURCE_CASES:
        for shard in range(SHARDS):
            got = one_line_failure(f"shard_sources({steps}, {qids}, {shard})", lambda: {
                int(k): int(v) for k, v in dict(shard_sources(list(steps), list(qids),
                                                              shard)).items()})
            want = reference_sources(steps, qids, shard)
            if got != want:
                raise AssertionError(f"{what} (steps {steps}, quorum ids {qids}), shard "
                                     f"{shard}: got {got}, expected {want}: "
                                     + _sources_hint(got, steps, qids, shard))
    spread = [reference_sources([5, 0, 5, 3, 5], [2, 0, 2, 1, 2], s)[1] for s in range(SHARDS)]
    print(f"correct: {len(SOURCE_CASES)} quorums, shards 0 to {SHARDS - 1}; with 3 up-to-date "
          f"groups, group 1's shards 0 to {SHARDS - 1} come from groups {spread}")


# --- exercises ---

def _tried(what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn(), None), or (None, a one-line account of the exception it raised: "what failed:
    ValueError: ...")."""
    try:
        return one_line_failure(what, fn), None
    except AssertionError as failure:
        return None, str(failure) or f"{what} failed: AssertionError"


BYTES_CASES = [(1e9, 2, 8, 4), (7e9, 4, 1, 2), (3e8, 4, 8, 3), (70e9, 2, 64, 16), (1e6, 4, 4, 1)]
# (params, bytes per parameter, group size, groups)
LINK_BYTES_S = 400e9 / 8  # 400 Gbps a GPU: imbue, "From bare metal to a 70B model:
# infrastructure set-up and scripts" (2024): 4,088 H100s, each with its own ConnectX-7


def reference_bytes_across(params: float, bytes_per_param: float, group_size: int,
                           groups: int) -> tuple[float, float]:
    """(bytes a rank hands to the allreduce across groups, bytes it sends on a ring's wire)."""
    handed = params * bytes_per_param / group_size
    return handed, 2 * (groups - 1) / groups * handed


def _bytes_hint(got: tuple[float, float], case: tuple) -> str:
    params, bytes_per_param, group_size, groups = case
    handed, sent = reference_bytes_across(*case)
    if group_size > 1 and math.isclose(got[0], params * bytes_per_param, rel_tol=1e-9):
        return ("each rank hands only its shard, 1/g of the gradient (the reduce-scatter "
                "inside the group came first): divide by the group size")
    if math.isclose(got[0], handed, rel_tol=1e-9) and math.isclose(
            got[1], (groups - 1) / groups * handed, rel_tol=1e-9):
        return ("a ring allreduce is a reduce-scatter then an all-gather: each sends (q-1)/q "
                "of what it hands in each, 2 (q-1)/q in all")
    return ("a rank hands params x bytes_per_param / g (its shard) and a ring of q sends "
            "2 (q-1)/q of that")


def _gb(value: float) -> str:
    return f"{value / 1e9:,.3g} GB"


def check_bytes_across(bytes_across: Callable[[float, float, int, int], tuple[float, float]]
                       | None) -> None:
    """Exercise 1: the bytes a rank hands to the allreduce across groups and sends on the
    ring's wire; then a 70B model on 1,024 GPUs, beside DDP."""
    if not answered(bytes_across):
        return
    for case in BYTES_CASES:
        got, failed = _tried(f"bytes_across{case}", lambda: bytes_across(*case))
        if failed:
            print(f"not quite: {failed}")
            return
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(map(is_number, got))):
            print(f"not quite: bytes_across{case} returns {got!r}: return two numbers of "
                  "bytes, (handed, sent), as a tuple")
            return
        want = reference_bytes_across(*case)
        if not all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-9) for g, w in zip(got, want)):
            print(f"not quite: {case[0]:.3g} parameters of {case[1]} bytes, groups of "
                  f"{case[2]}, {case[3]} groups: {tuple(got)}, want {want}: "
                  + _bytes_hint(got, case))
            return
    hsdp = reference_bytes_across(70e9, 2, 64, 16)
    ddp = reference_bytes_across(70e9, 2, 1, 1024)
    print(f"correct: 70B parameters in bfloat16, 16 groups of 64 GPUs (8 nodes of 8): each rank "
          f"hands {_gb(hsdp[0])} to the allreduce across groups and sends {_gb(hsdp[1])}, "
          f"{hsdp[1] / LINK_BYTES_S:.3f} s at 400 Gbps a GPU (imbue's H100 cluster); DDP over "
          f"the 1,024 ranks hands {_gb(ddp[0])} and sends {_gb(ddp[1])}, "
          f"{ddp[1] / LINK_BYTES_S:.2f} s: {ddp[0] / hsdp[0]:.0f}x the bytes handed, "
          f"{ddp[1] / hsdp[1]:.1f}x the bytes sent")


NEEDED_CASES = [(2 ** -10, 4.0, 256.0, 0.03515625), (1e-6, 10.0, 180.0, 0.01),
                (1.5e-4, 10.9, 180.0, 0.01), (1e-3, 2.0, 600.0, 0.05)]
# (failures_per_s, step_s, out_s, budget); the first's fraction at q = 8 is its budget exactly
IMPOSSIBLE_CASES = [(1e-3, 30.0, 60.0, 0.02), (2 ** -10, 8.0, 60.0, 2 ** -7)]  # r t >= budget
NODES, GPUS_PER_NODE = 2_048, 8
NODE_FAILURES_PER_DAY = 6.5 / 1_000  # Kokolis et al., "Revisiting Reliability in Large-Scale
# Machine Learning Research Clusters", HPCA 2025 (arXiv 2410.21680): its 16k-GPU cluster
STEP_S = 10.9  # PyTorch blog, "Fault Tolerant Llama" (2025-06-20): "each step took 10.9 seconds"
OUT_S = 180.0  # FT-HSDP, Salpekar et al. (arXiv 2602.00277): the stall per failure, 3 minutes


def lost_fraction(failures_per_s: float, step_s: float, out_s: float, groups: int) -> float:
    """The share of the job's time lost: every group's step in flight, and the failed group's
    1/q of the job for out_s, per failure."""
    return failures_per_s * (step_s + out_s / groups)


def reference_groups_needed(failures_per_s: float, step_s: float, out_s: float,
                            budget: float) -> int:
    """The least q >= 2 whose lost fraction is below budget: q > r o / (budget - r t)."""
    spare = budget - failures_per_s * step_s
    if spare <= 0:
        raise ValueError("the step in flight alone loses the budget, whatever q")
    return max(2, math.floor(failures_per_s * out_s / spare) + 1)


def _needed_hint(got: int, case: tuple) -> str:
    want, lost = reference_groups_needed(*case), lost_fraction(*case[:3], got)
    if got < 2:
        return ("q >= 2: a single group has nobody to train while it is out, so a failure "
                "stops the whole job")
    if got < want and lost == case[3]:
        return (f"at q = {got} the lost fraction equals the budget exactly: the least q whose "
                "fraction is below it")
    if got < want:
        return f"at q = {got} the job loses {lost:.4%}, not below the budget"
    return (f"not the least: q = {want} already loses {lost_fraction(*case[:3], want):.4%}; "
            "the lost fraction is failures_per_s * (step_s + out_s / q)")


def check_groups_needed(groups_needed: Callable[[float, float, float, float], int] | None
                        ) -> None:
    """Exercise 2: the least number of groups that keeps the time lost to failures below a
    budget; then a 16,384-GPU job at a published failure rate."""
    if not answered(groups_needed):
        return
    for case in NEEDED_CASES:
        what = "failures_per_s={}, step_s={}, out_s={}, budget={}".format(*case)
        want = reference_groups_needed(*case)
        got, failed = _tried(f"groups_needed({what})", lambda: groups_needed(*case))
        if failed and f"{what}) failed: ValueError" in failed:
            print(f"not quite: {failed}, but q = {want} loses "
                  f"{lost_fraction(*case[:3], want):.4%}: a failure takes out only the failed "
                  "group, 1/q of the job, for out_s: out_s / q of the job's time (every group "
                  "loses only the step in flight)")
            return
        if failed:
            print(f"not quite: {failed}")
            return
        if not is_int(got):
            print(f"not quite: {what}: {got!r}: return a whole number of groups")
            return
        if got != want:
            print(f"not quite: {what}: {got}, want {want}: " + _needed_hint(got, case))
            return
    for case in IMPOSSIBLE_CASES:
        _, failed = _tried(f"groups_needed{case}", lambda: groups_needed(*case))
        if failed is None or ") failed: ValueError" not in failed:
            print(f"not quite: failures_per_s * step_s = {case[0] * case[1]:g} >= budget "
                  f"{case[3]:g}: every failure costs every group the step in flight, whatever "
                  "q, so no q is enough: raise ValueError saying so"
                  + (f" (got {failed})" if failed else ""))
            return
    rate = NODE_FAILURES_PER_DAY * NODES / 86_400
    fractions = ", ".join(f"{q}: {lost_fraction(rate, STEP_S, OUT_S, q):.2%}"
                          for q in (1, 2, 4, 8, 16, 64))
    answer = reference_groups_needed(rate, STEP_S, OUT_S, 0.01)
    print(f"correct: {NODES:,} nodes of {GPUS_PER_NODE} GPUs at 6.5 failures per 1,000 "
          f"node-days fail {rate * 3_600:.3f} times an hour; a {STEP_S} s step, {OUT_S / 60:g} "
          f"min out per failure: the time lost with q = {fractions} (never below "
          f"{rate * STEP_S:.2%}, the step in flight); below 1%: q = {answer} "
          f"({NODES / answer:,.4g} nodes a group)")
