"""Checkers for chapter 10's parts and exercises (FSDP: flat shards, gather, reduce-scatter)."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data_parallel import max_relative_difference
from ..fsdp import flat_shard, padded_numel
from ..lenet import lenet_layers
from . import answered, count, is_int, is_number, one_line_failure

# --- the flat parameters (step 2), checked in the notebook's own process --------------------

SIZES = [1, 2, 5, 7, 12, 200]  # numels: smaller than, equal to and larger than the ranks


def check_padded_numel(padded: Callable[[int, int], int]) -> str:
    """Your padded_numel against ceil(numel / world) * world, numel 0 to 30, 1 to 5 ranks."""
    for numel in range(31):
        for world in range(1, 6):
            got, want = padded(numel, world), math.ceil(numel / world) * world
            assert got == want, (
                f"padded_numel({numel}, {world}) returns {got!r}, want {want}: the smallest "
                "multiple of world_size that is at least numel")
            assert is_int(got), (
                f"padded_numel({numel}, {world}) returns {got!r}, a {type(got).__name__}: "
                "return an int, a count of numbers (// divides whole numbers, / makes floats)")
    return "padded_numel is right: the smallest multiple of world_size at least numel"


def check_flat_shard(shard: Callable[[torch.Tensor, int, int], torch.Tensor]) -> str:
    """Your flat_shard against torch.chunk of the zero-padded vector, and a shard that owns its
    storage (a copy, not a view into flat or into the padded vector)."""
    gen = torch.Generator().manual_seed(0)
    for numel in SIZES:
        flat = torch.randn(numel, generator=gen, dtype=torch.float64)
        for world in range(1, 5):
            padded = torch.cat([flat, flat.new_zeros(-numel % world)])
            for rank, want in enumerate(padded.chunk(world)):
                where = f"flat_shard(flat, {rank}, {world}) with flat.numel() == {numel}"
                try:
                    got = shard(flat, rank, world)
                except IndexError as error:
                    raise AssertionError(
                        f"{where} raised IndexError ({error}): .chunk(world_size) gives fewer "
                        "than world_size pieces when they do not divide numel: pad flat with "
                        "zeros to padded_numel first (F.pad)") from None
                assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
                    f"{where}: shape {tuple(getattr(got, 'shape', ()))}, want "
                    f"{tuple(want.shape)}: every shard has ceil(numel / world) numbers (pad "
                    "with zeros first)")
                assert got.dtype == flat.dtype, f"the shard is {got.dtype}: keep flat's dtype"
                front = torch.cat([flat.new_zeros(-numel % world), flat]).chunk(world)[rank]
                assert torch.equal(got, want) or not torch.equal(got, front), (
                    f"{where} has the padding's zeros at the front: they go at the end, after "
                    "flat's numbers (F.pad(flat, (0, pad)))")
                assert torch.equal(got, want), (
                    f"{where} differs from torch.chunk of the zero-padded vector: rank r "
                    "takes the r-th equal piece")
                storage = got.untyped_storage()
                assert storage.data_ptr() != flat.untyped_storage().data_ptr(), (
                    f"{where} shares flat's storage (writing into it changes flat): return a "
                    "copy of the piece (.clone())")
                assert storage.nbytes() == got.nbytes, (
                    f"{where} is a view into a storage of {storage.nbytes() // got.itemsize} "
                    "numbers, which it keeps alive: return a copy of the piece (.clone()), "
                    "whose storage holds the piece only")
    return "flat_shard is right: rank r's equal piece of the zero-padded vector, a copy"


def check_unflatten(unflatten: Callable[[torch.Tensor, list[torch.Size]], list[torch.Tensor]]
                    ) -> str:
    """Your unflatten on LeNet's layers: views of full with the parameters' shapes and values."""
    for world in (1, 2, 3):
        for layer in [m for m in lenet_layers(0) if isinstance(m, (nn.Conv2d, nn.Linear))]:
            params = list(layer.parameters())
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            full = torch.cat([flat, flat.new_zeros(padded_numel(flat.numel(), world)
                                                   - flat.numel())])
            got = unflatten(full, [p.shape for p in params])
            assert len(got) == len(params), (
                f"unflatten returned {count(len(got), 'tensor')} for "
                f"{count(len(params), 'shape')}: one per shape")
            for p, view in zip(params, got):
                assert view.shape == p.shape, (
                    f"a view has shape {tuple(view.shape)}, want {tuple(p.shape)}: .view(shape)")
                assert torch.equal(view, p.detach()), (
                    "a view holds other numbers than the parameter: take the pieces in order, "
                    "each as long as its shape's numel (full[:total].split(numels))")
                assert view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), (
                    "a result is a copy: return views into full (split and view, no clone or cat)")
    return "unflatten is right: views into full, shaped and valued as the layers' parameters"


# --- the methods you write: checked on 2 ranks (on_ranks), each check returns one line --------

BATCH, STEPS = 8, 3  # images per global batch (float64), AdamW steps against one process


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step's global batch of BATCH random 28x28 images (float64), the same on every rank."""
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, 1, 28, 28, generator=gen, dtype=torch.float64),
            torch.randint(0, 10, (BATCH,), generator=gen))


def _mine(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step's global batch."""
    X, y = _global_batch(step)
    rank, world = dist.get_rank(), dist.get_world_size()
    return X.chunk(world)[rank], y.chunk(world)[rank]


def _layers(model: nn.Module) -> list[nn.Module]:
    """The layers of lenet_layers (one unit each), in order."""
    return [m for m in model if isinstance(m, (nn.Conv2d, nn.Linear))]


def _flat_grad(layer: nn.Module) -> torch.Tensor:
    """The layer's gradients flattened in its parameters' order (a unit's flat gradient)."""
    return torch.cat([p.grad.reshape(-1) for p in layer.parameters()])


def check_start_gather(cls: type) -> str:
    """On each rank: forward through your _start_gather gives one process's output (float64,
    1e-12; with and without prefetch, both collective kinds), counts the gathered bytes, casts
    to compute_dtype before gathering, and frees every unit after forward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    X, _ = _global_batch(0)
    want = lenet_layers(0).double()(X).detach()
    for prefetch, ring in ((True, False), (False, False), (True, True)):
        model = cls(lenet_layers(rank).double(), prefetch=prefetch, ring=ring)
        out = one_line_failure("forward", lambda: model(X))
        assert max_relative_difference([out], [want]) <= 1e-12, (
            f"forward (prefetch={prefetch}, ring={ring}) differs from one process's: all-gather "
            "every rank's shard into full (shard.numel() * world numbers), rank r's at r")
        numbers = sum(padded_numel(u.numel, world) for u in model.units)
        gathered = model.timeline.bytes["all-gather"]
        assert gathered == 8 * numbers, (
            f"the timeline counts {gathered} bytes gathered in one forward, want {8 * numbers} "
            "(the full tensors' bytes, once per unit): call self.timeline.collective("
            '"all-gather", unit, full, future) once per all-gather')
        assert all(u.full is None and u.arriving is None for u in model.units), (
            "a unit is still gathered after forward: record (future, full) in unit.arriving")
    model = cls(lenet_layers(rank), compute_dtype=torch.bfloat16)
    one_line_failure("forward with compute_dtype=bfloat16", lambda: model(X.float()))
    numbers = sum(padded_numel(u.numel, world) for u in model.units)
    gathered = model.timeline.bytes["all-gather"]
    assert gathered == 2 * numbers, (
        f"with compute_dtype=bfloat16 {gathered} bytes were gathered, want "
        f"{2 * numbers}: cast the shard to self.compute_dtype before the all-gather")
    return (f"_start_gather is right: on {world} ranks forward equals one process's within "
            "1e-12 (prefetch or not, ring or not), bfloat16 gathers half the bytes")


def check_finish(cls: type) -> str:
    """On each rank: after backward, with your _finish, each shard's gradient is this rank's
    slice of one process's on the global batch (float64, 1e-12), also summed over two backward
    passes; nothing stays gathered; then 3 AdamW steps train as one process does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    X, y = _global_batch(0)
    whole = lenet_layers(0).double()
    F.cross_entropy(whole(X), y).backward()
    for prefetch, ring in ((True, False), (False, True)):
        model = cls(lenet_layers(rank).double(), prefetch=prefetch, ring=ring)
        inputs, labels = _mine(0)
        for passes in (1, 2):
            one_line_failure("backward", lambda: F.cross_entropy(model(inputs), labels).backward())
            assert not model._reducing and not model._callback_queued, (
                "after backward self._reducing is not empty or self._callback_queued is still "
                "True: reset both, so that the next backward starts afresh")
            for unit, layer in zip(model.units, _layers(whole)):
                want = passes * flat_shard(_flat_grad(layer), rank, world)
                got = unit.shard.grad
                assert got is not None, (
                    f"unit {unit.name} has no gradient after backward: for each (unit, future) "
                    "in self._reducing, write future.wait() / self.world to unit.shard.grad")
                if max_relative_difference([got], [want]) <= 1e-12:
                    continue
                assert max_relative_difference([got], [world * want]) > 1e-12, (
                    "the gradients are the sums over the ranks: divide out by self.world")
                assert passes == 1, (
                    "a second backward before the step replaced the first one's gradient: add "
                    "to unit.shard.grad when it is not None")
                raise AssertionError(
                    f"unit {unit.name}'s gradient (prefetch={prefetch}, ring={ring}) is not "
                    "this rank's slice of the average: future.wait() returns this rank's sum")
        assert all(u.full is None and u.arriving is None for u in model.units), (
            "a unit is still gathered after backward: call self._free(unit) for every unit")
    model = cls(lenet_layers(rank).double())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference = torch.optim.AdamW(whole.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        for m, o, (inputs, labels) in ((model, opt, _mine(step)), (whole, reference,
                                                                   _global_batch(step))):
            o.zero_grad()
            F.cross_entropy(m(inputs), labels).backward()
            o.step()
    trained = model.full_state_dict()
    for key, value in whole.state_dict().items():
        assert max_relative_difference([trained[key]], [value]) <= 1e-12, (
            f"after {STEPS} AdamW steps {key} differs from one process's (the gradients "
            "were right): keep the shard's .grad as _finish leaves it")
    return (f"_finish is right: on {world} ranks each shard gets its slice of the averaged "
            f"gradient within 1e-12, also over two backward passes, and {STEPS} AdamW steps "
            "train as one process")


def check_clip_grad_norm(cls: type) -> str:
    """On each rank: your clip_grad_norm_ returns the norm over all ranks' shards and clips as
    torch.nn.utils.clip_grad_norm_ does in one process on the global batch (float64, 1e-12)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    X, y = _global_batch(0)
    for max_norm in (0.5, 1e6):  # clips; leaves the gradients as they are
        whole = lenet_layers(0).double()
        F.cross_entropy(whole(X), y).backward()
        model = cls(lenet_layers(rank).double())
        F.cross_entropy(model(_mine(0)[0]), _mine(0)[1]).backward()
        local = math.sqrt(sum(u.shard.grad.square().sum().item() for u in model.units))
        norm = model.clip_grad_norm_(max_norm)
        want = torch.nn.utils.clip_grad_norm_(whole.parameters(), max_norm)
        assert isinstance(norm, torch.Tensor), "return the norm as a tensor (as torch does)"
        assert abs(norm.item() - local) > 1e-12 * local or world == 1, (
            "that is this rank's shard's norm: all_reduce the sum of squares over the ranks "
            "before the square root (the classic FSDP mistake)")
        assert abs(norm.item() - want.item()) <= 1e-12 * want.item(), (
            f"the norm is {norm.item():.6g}, torch's {want.item():.6g}: the square root of the "
            "sum over all ranks of every shard gradient's sum of squares")
        for unit, layer in zip(model.units, _layers(whole)):
            wanted = flat_shard(_flat_grad(layer), rank, world)
            assert max_relative_difference([unit.shard.grad], [wanted]) <= 1e-12, (
                f"max_norm={max_norm}: unit {unit.name}'s gradient differs from torch's clipped "
                "one: multiply every gradient by min(1, max_norm / (norm + 1e-6)), in place")
    return (f"clip_grad_norm_ is right: on {world} ranks the norm and the clipped gradients "
            "equal torch.nn.utils.clip_grad_norm_'s in one process within 1e-12")


# --- exercise 1: units for a memory budget --------------------------------------------------

Units = list[list[int]]  # each unit: the indices of its consecutive layers


def unit_numbers(units: Units, numels: list[int], world: int) -> list[int]:
    """The numbers each unit's all-gather holds (its layers' numels, padded for world)."""
    return [padded_numel(sum(numels[i] for i in unit), world) for unit in units]


def peak_gathered(units: Units, numels: list[int], world: int) -> int:
    """With prefetch, two neighbouring units are gathered at once: the largest such pair
    (a single unit alone if there is one)."""
    sizes = unit_numbers(units, numels, world)
    return max([a + b for a, b in zip(sizes, sizes[1:])] or sizes)


def fewest_units(numels: list[int], world: int, budget: int) -> int | None:
    """The fewest units of consecutive layers whose peak_gathered is within budget (None if
    none is): over every last unit [j, i), the best split of the layers before it."""
    n = len(numels)
    size = lambda j, i: padded_numel(sum(numels[j:i]), world)  # noqa: E731
    best: dict[tuple[int, int], int] = {}  # (j, i): fewest units for layers :i ending [j, i)
    for i in range(1, n + 1):
        for j in range(i):
            if j == 0:
                if size(0, i) <= budget:
                    best[j, i] = 1
                continue
            options = [best[h, j] for h in range(j) if (h, j) in best
                       and size(h, j) + size(j, i) <= budget]
            if options:
                best[j, i] = min(options) + 1
    ends = [count for (j, i), count in best.items() if i == n]
    return min(ends) if ends else None


LENET_LAYERS = [200, 25050, 102528, 1290]  # numbers per layer of lenet_layers, in order
BUDGET_CASES = [(LENET_LAYERS, 2, 128_000), (LENET_LAYERS, 2, 127_600),
                (LENET_LAYERS, 2, 129_068), (LENET_LAYERS, 4, 128_000), ([4, 4, 4, 4, 4, 4], 1, 12),
                ([5, 1, 1, 5, 1, 1, 5], 2, 14), ([10, 10, 10], 3, 60), ([3, 9, 3, 3, 9], 1, 15)]


def _units_hint(got: object, numels: list[int], world: int, budget: int) -> str:
    """What is wrong with a choice of units."""
    if not isinstance(got, (list, tuple)) or not all(isinstance(u, (list, tuple)) for u in got):
        return "return a list of units, each a list of layer indices"
    if [i for u in got for i in u] != list(range(len(numels))):
        return ("every layer in exactly one unit, in order, each unit consecutive layers: "
                f"the indices 0 to {len(numels) - 1} in turn")
    if any(len(u) == 0 for u in got):
        return "leave out empty units"
    if peak_gathered(got, numels, world) > budget:
        return ("with prefetch two neighbouring units are gathered at once: each pair's "
                "padded sizes together must fit the budget")
    return "another split needs fewer units: merge neighbours while every pair still fits"


def check_units_for_budget(choose_units: Callable[[list[int], int, int], Units] | None) -> None:
    """Exercise 1: the fewest units of consecutive layers whose gathered numbers, two
    neighbouring units at once (prefetch), fit the budget."""
    if not answered(choose_units):
        return
    for numels, world, budget in BUDGET_CASES:
        got = choose_units(list(numels), world, budget)
        want = fewest_units(numels, world, budget)
        nested = isinstance(got, (list, tuple)) and all(isinstance(u, (list, tuple)) for u in got)
        units = [list(u) for u in got] if nested else []
        if (not nested or [i for u in units for i in u] != list(range(len(numels)))
                or any(not u for u in units) or peak_gathered(units, numels, world) > budget
                or len(units) != want):
            print(f"not quite: choose_units({numels}, {world}, {budget}) returns {got!r}, "
                  f"{count(want, 'unit')} will do: {_units_hint(got, numels, world, budget)}")
            return
    lenet = BUDGET_CASES[0]
    best = fewest_units(*lenet)
    print(f"correct: LeNet's layers {lenet[0]} on {lenet[1]} ranks within {lenet[2]:,} numbers "
          f"gathered at once take {best} units, not 4: each unit saved is one all-gather "
          "and one reduce-scatter fewer per step")


# --- exercise 2: clipping by the norm over all shards ---------------------------------------

NORM_CASES = [([3.0, 4.0], 1.0), ([3.0, 4.0], 10.0), ([1.0, 1.0, 1.0, 1.0], 1.0),
              ([0.5], 0.1), ([2.0, 0.0, 1.0], 2.5), ([6.0, 8.0], 5.0)]


def clip_scale_reference(shard_norms: list[float], max_norm: float) -> float:
    """What torch.nn.utils.clip_grad_norm_ multiplies every gradient by, given the 2-norms of
    the shards' gradients: min(1, max_norm / (total norm + 1e-6))."""
    total = math.sqrt(sum(n * n for n in shard_norms))
    return min(1.0, max_norm / (total + 1e-6))


def torch_clip_scale(shard_norms: list[float], max_norm: float) -> float:
    """The same factor, measured: torch's clip_grad_norm_ on vectors of these norms."""
    grads = [torch.full((4,), n / 2, dtype=torch.float64) for n in shard_norms]
    params = [torch.zeros(4, dtype=torch.float64, requires_grad=True) for _ in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    return (torch.cat([p.grad for p in params]).norm() / torch.cat(grads).norm()).item()


def _scale_hint(got: object, norms: list[float], max_norm: float) -> str:
    """Why a clipping factor is off."""
    if isinstance(got, (list, tuple)):
        return ("one factor for every rank: each rank clipping by its own shard's norm bends the "
                "gradient's direction")
    if not is_number(got):
        return "return one number, the factor every rank multiplies its gradient by"
    total = math.sqrt(sum(n * n for n in norms))
    if abs(got - max_norm / total) <= 1e-6 and total < max_norm:
        return "never scale a gradient up: the factor is at most 1"
    if abs(got - min(1.0, max_norm / sum(norms))) <= 1e-6:
        return "norms add as squares: the total is the square root of the sum of their squares"
    return "the total norm is sqrt(sum of squares); the factor min(1, max_norm / (total + 1e-6))"


def check_clip_scale(clip_scale: Callable[[list[float], float], float] | None) -> None:
    """Exercise 2: the factor FSDP's clip_grad_norm_ applies on every rank, from the shards'
    gradient norms; against torch's clip_grad_norm_ in one process, within 1e-5 relative."""
    if not answered(clip_scale):
        return
    for norms, max_norm in NORM_CASES:
        got, want = clip_scale(list(norms), max_norm), torch_clip_scale(norms, max_norm)
        if not is_number(got) or abs(got - want) > 1e-5 * want:  # torch adds 1e-6 to the norm
            print(f"not quite: clip_scale({norms}, {max_norm}) returns {got!r}, torch's "
                  f"clip_grad_norm_ scales by {want:.6g}: {_scale_hint(got, norms, max_norm)}")
            return
    norms, max_norm = NORM_CASES[0]
    scale = clip_scale_reference(norms, max_norm)
    local = [min(1.0, max_norm / (n + 1e-6)) for n in norms]
    clipped = math.sqrt(sum((n * s) ** 2 for n, s in zip(norms, local)))
    cosine = sum(n * n * s for n, s in zip(norms, local)) / (clipped * math.hypot(*norms))
    print(f"correct: shard norms {norms}, max_norm {max_norm}: every rank scales by "
          f"{scale:.3f}; clipping by the local norms would scale by "
          f"{[round(s, 3) for s in local]}, leave a norm of {clipped:.3f} > {max_norm} and turn "
          f"the gradient by {math.degrees(math.acos(min(cosine, 1.0))):.1f} degrees")
