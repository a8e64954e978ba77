"""Chapter 10: fully sharded data parallelism (FSDP, ZeRO-3) built by hand.

``ScratchFSDP(module)`` keeps on each rank 1/k of every trainable parameter. The parameters
are grouped into units (submodules); each unit's are flattened into one vector, zero-padded to
a multiple of k, and this rank keeps its slice as an ``nn.Parameter`` (``model.parameters()``
yields these shards, so an optimizer built on them holds sharded state). A unit's full
parameters exist only while it runs: all-gathered just before its forward, freed after it,
gathered again when backward needs them, and their gradient is reduce-scattered (averaged
over the ranks, like DDP) into the shards' ``.grad``. With ``prefetch`` the next unit's
all-gather runs while the current unit computes: in forward the next in the last forward's
order, in backward the previous in this forward's order. Autograd would keep the gathered
parameters alive from forward to backward; a saved-tensor hook keeps a note instead and
re-gathers. ``model.timeline`` records what ran when and the bytes sent; ``close()`` (or a
``with`` block) removes the hooks and ends the helper thread.

Supported: every rank runs the same units in the same order; a unit's parameters are used
only inside its own forward (called as ``unit(x)``), which activation checkpointing may run
again in backward (reentrant or not; a recomputed unit is gathered again); a parameter
belongs to one unit (the innermost listed); frozen parameters and buffers stay whole on every rank (rank 0's, sent at
wrap time; buffers a forward changes stay per rank, as in torch's FSDP). The shards keep the
parameters' dtype; with ``compute_dtype`` (say bfloat16) the shards are cast before each
all-gather and the frozen parameters for each forward (as FSDP2 casts every parameter it
manages; buffers are not cast), forward, backward and the reduce-scatter run in that dtype,
the averaged gradients arrive in the shards' dtype (float32 master weights) and the output
is float32.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import p2p
from .comm_hooks import HelperThread

# torch 2.14 renamed all_gather_into_tensor and reduce_scatter_tensor (deprecated there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def padded_numel(numel: int, world_size: int) -> int:
    """numel rounded up to a multiple of world_size, so that every rank's shard is as long."""
    return -(-numel // world_size) * world_size


@torch.no_grad()
def flat_shard(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Step 2: flat zero-padded to a multiple of world_size; a copy of rank's slice of it."""
    padded = F.pad(flat, (0, padded_numel(flat.numel(), world_size) - flat.numel()))
    return padded.chunk(world_size)[rank].clone()


def unflatten(full: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Step 2: views into full, one shaped like each of shapes, in order (padding left out)."""
    numels = [shape.numel() for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(full[:sum(numels)].split(numels), shapes)]


class NotGathered(torch.Tensor):
    """What a unit's parameter attribute holds while the unit is not gathered: using it raises
    an error that names it and says what is supported."""

    @staticmethod
    def of(name: str) -> "NotGathered":
        placeholder = torch.Tensor._make_subclass(NotGathered, torch.empty(0))
        placeholder.fsdp_name = name
        return placeholder

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = next((a.fsdp_name for a in args if isinstance(a, NotGathered)), "a parameter")
        raise RuntimeError(
            f"ScratchFSDP: {name} is used while its unit is not gathered. A unit's parameters "
            "exist only during the unit's own forward, called as a module (unit(x)), and its "
            "backward. Make the module that uses it (or a parent) a unit (units=[...]; "
            "units=[] puts everything in one root unit), or, to use the model on one rank, "
            "load model.full_state_dict() into an unwrapped copy")


class Unit:
    """One unit: its module, where its parameters live, and this rank's flat shard of them."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter],
                 owners: list[list[tuple[nn.Module, str, str]]], rank: int,
                 world: int) -> None:
        self.name, self.module, self.owners = name, module, owners
        self.shapes = [p.shape for p in params]
        self.numel = sum(p.numel() for p in params)
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        dist.broadcast(flat, src=0)  # rank 0's parameters are the ones sharded
        self.shard = nn.Parameter(flat_shard(flat, rank, world))
        self.full: torch.Tensor | None = None  # the gathered parameters, while they exist
        self.arriving: tuple[torch.futures.Future, torch.Tensor] | None = None  # in flight


class Timeline:
    """What a ScratchFSDP did when, kept apart from the algorithm (for figures and tests): the
    last step's events (kind, unit, started, finished; perf_counter seconds) and the bytes of
    the full tensors each collective kind moved ("all-gather", "reduce-scatter"), summed."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float]] = []
        self.bytes = {"all-gather": 0, "reduce-scatter": 0}
        self._since = time.perf_counter()  # when the rank last went back to computing

    def clear(self) -> None:
        """A new step: forget the last one's events."""
        self.events, self._since = [], time.perf_counter()

    def collective(self, kind: str, unit: Unit, full: torch.Tensor,
                   future: torch.futures.Future) -> None:
        """A collective of kind on unit's full tensor started: count its bytes, add the event
        once future completes."""
        start = self._since = time.perf_counter()
        self.bytes[kind] += full.nbytes
        future.add_done_callback(lambda _: self.events.append(
            (kind, unit.name, start, time.perf_counter())))

    @contextmanager
    def waiting(self, unit: Unit) -> Iterator[None]:
        """The block waits for unit's all-gather: add a "wait" event."""
        start = time.perf_counter()
        yield
        self._since = time.perf_counter()
        self.events.append(("wait", unit.name, start, self._since))

    def computed(self, kind: str, unit: Unit) -> None:
        """unit's forward or backward (kind) ends now; it began at the last event's end."""
        start, self._since = self._since, time.perf_counter()
        self.events.append((kind, unit.name, start, self._since))


class _GatherUnit(torch.autograd.Function):
    """Forward: the unit's full parameters, all-gathered from the shards. Backward: their
    gradient reduce-scattered back to the shards (written into .grad when backward ends)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, fsdp: "ScratchFSDP", unit: Unit) -> torch.Tensor:
        ctx.fsdp, ctx.unit = fsdp, unit
        return fsdp._gathered(unit).view_as(unit.full)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[None, None, None]:
        ctx.fsdp.timeline.computed("backward", ctx.unit)
        ctx.fsdp._reduce_scatter(ctx.unit, grad_full)
        return None, None, None


class ScratchFSDP(nn.Module):
    """Shard module's trainable parameters over group's ranks (None: all), unit by unit (default
    units: each child with trainable parameters, the rest the root); replicate: chapter 14."""

    def __init__(self, module: nn.Module, units: Iterable[nn.Module] | None = None,
                 prefetch: bool = True, compute_dtype: torch.dtype | None = None,
                 ring: bool = False, group: dist.ProcessGroup | None = None,
                 replicate: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ScratchFSDP needs the default process group: build it in a "
                               "function run by dpcourse.launch.launch")
        if ring and (group or replicate):
            raise ValueError("ScratchFSDP: the ring runs over every rank, in one group")
        self.module, self.prefetch, self.ring = module, prefetch, ring
        self.compute_dtype, self.group, self.replicate = compute_dtype, group, replicate
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._shapes = {k: t.shape for k, t in module.state_dict().items()}  # full_state_dict's
        self.units = _build_units(module, units, self.rank, self.world)
        self.shards = nn.ParameterList([unit.shard for unit in self.units])
        for t in [*module.parameters(), *module.buffers()]:  # what is left: frozen parameters
            dist.broadcast(t, src=0)  # and buffers, rank 0's, kept whole on every rank
        self._hook_units()
        self._guard_frozen()
        self._start_bookkeeping()

    def _hook_units(self) -> None:
        """A forward pre-hook and a forward hook on every unit (close() removes them)."""
        self._hooks = [hook for unit in self.units for hook in (
            unit.module.register_forward_pre_hook(partial(self._before_unit, unit),
                                                  with_kwargs=True),
            unit.module.register_forward_hook(partial(self._after_unit, unit)))]

    def _start_bookkeeping(self) -> None:
        """What the steps keep track of: gathered storages, unit order, work in flight."""
        self._by_storage: dict[int, Unit] = {}  # data_ptr of a gathered unit's storage
        self._order: list[Unit] = []  # the order the last forward ran the units in
        self._running: list[Unit] = []  # the units this forward has run so far
        self._reducing: list[tuple[Unit, torch.futures.Future]] = []  # this rank's sums
        self._in_forward, self._callback_queued, self._closed = False, False, False
        self._thread = HelperThread()  # runs the ring, or waits for a reduce-scatter
        self.timeline = Timeline()  # what ran when, the bytes sent: for figures and tests

    def _check_open(self, what: str) -> None:
        """Raise, saying what works instead, if close() has run."""
        if self._closed:
            raise RuntimeError(
                f"ScratchFSDP: {what} after the wrapper is closed (close() or the end of its "
                "with block), which ended its helper thread and removed its hooks; its module "
                "holds no parameters (they live in the shards). Run every forward and backward "
                "before closing; to train on, load full_state_dict() (on every rank, before or "
                "after closing) into a new copy of the model and wrap that")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (frozen parameters and the inputs in compute_dtype too); autograd
        keeps notes instead of the gathered parameters."""
        self._check_open("a forward")
        self._running, self._in_forward, self._callback_queued = [], True, False
        self.timeline.clear()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                frozen = _frozen_in(self.module, self.compute_dtype)
                if self.compute_dtype is not None:  # as FSDP2: the inputs, for the root's use
                    args, kwargs = (_cast(a, self.compute_dtype) for a in (args, kwargs))
                out = torch.func.functional_call(self.module, frozen, args, kwargs)
        finally:
            self._in_forward = False
            for unit in self.units:  # a prefetched unit nobody ran: wait for it, drop it
                self._free(unit)
        self._order = self._running  # backward's prefetch walks it in reverse
        return _to_float32(out) if self.compute_dtype is not None else out

    # --- gathering and freeing ---

    def _start_gather(self, unit: Unit) -> None:
        """Start the all-gather of unit's parameters, unless they are here or on their way."""
        if unit.full is not None or unit.arriving is not None:
            return
        shard = unit.shard.detach().to(self.compute_dtype or unit.shard.dtype)
        full = shard.new_empty(shard.numel() * self.world)
        if self.ring:
            full.chunk(self.world)[self.rank].copy_(shard)
            future = self._thread.submit(_ring_gathered, full)
        else:
            future = _all_gather(full, shard, group=self.group, async_op=True).get_future()
        unit.arriving = (future, full)
        self.timeline.collective("all-gather", unit, full, future)

    def _gathered(self, unit: Unit) -> torch.Tensor:
        """unit's full parameters: waited for if on their way, else gathered now."""
        self._start_gather(unit)
        if unit.arriving is not None:
            future, full = unit.arriving
            with self.timeline.waiting(unit):
                future.wait()
            unit.full, unit.arriving = full, None
            self._by_storage[full.untyped_storage().data_ptr()] = unit
        return unit.full

    def _free(self, unit: Unit) -> None:
        """Drop unit's full parameters (and their views in the module)."""
        if unit.arriving is not None:
            unit.arriving[0].wait()
            unit.arriving = None
        if unit.full is not None:
            del self._by_storage[unit.full.untyped_storage().data_ptr()]
            unit.full = None
        for owners in unit.owners:
            for module, attr, name in owners:
                setattr(module, attr, NotGathered.of(name))

    def _prefetch(self, unit: Unit, step: int) -> None:
        """Start gathering the unit that runs after unit (step 1: in forward; -1: in backward),
        by the order the last finished forward ran them in (in backward: this step's)."""
        if self.prefetch and unit in self._order:
            i = self._order.index(unit) + step
            if 0 <= i < len(self._order):
                self._start_gather(self._order[i])

    # --- forward ---

    def _before_unit(self, unit: Unit, module: nn.Module, args: tuple,
                     kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook: gather unit, prefetch the next, point the module at the views
        (also when backward recomputes the unit for activation checkpointing)."""
        recomputing = self._recomputing(unit)
        full = _GatherUnit.apply(unit.shard, self, unit)
        if not recomputing:
            self._running.append(unit)
            self._prefetch(unit, 1)
        for owners, view in zip(unit.owners, unflatten(full, unit.shapes)):
            for owner, attr, _ in owners:
                setattr(owner, attr, view)
        if self.compute_dtype is None:
            return args, kwargs
        return _cast(args, self.compute_dtype), _cast(kwargs, self.compute_dtype)

    def _after_unit(self, unit: Unit, module: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook: free unit's full parameters."""
        self.timeline.computed("forward", unit)
        self._free(unit)

    def _recomputing(self, unit: Unit) -> bool:
        """Whether unit runs because backward recomputes it (activation checkpointing); an
        error if it runs outside the wrapper's forward and backward."""
        if self._in_forward:
            return False
        if torch._C._current_graph_task_id() == -1:  # not inside a backward either
            raise RuntimeError(f"ScratchFSDP: unit {unit.name} was called outside the "
                               "wrapper's forward; call the wrapper (model(x)), which gathers "
                               "each unit as it runs")
        return True

    def _guard_frozen(self) -> None:
        """With compute_dtype, every module that holds frozen parameters refuses to be
        recomputed by activation checkpointing: forward ran them cast, a recompute would not."""
        for m in self.module.modules() if self.compute_dtype is not None else []:
            if any(p.is_floating_point() for p in m.parameters(recurse=False)):
                self._hooks.append(m.register_forward_pre_hook(self._refuse_recompute,
                                                               prepend=True))

    def _refuse_recompute(self, module: nn.Module, args: tuple) -> None:
        if not self._in_forward and torch._C._current_graph_task_id() != -1:
            raise RuntimeError(f"ScratchFSDP: {type(module).__name__}, which holds frozen "
                               "parameters, recomputed by activation checkpointing with "
                               "compute_dtype: not supported (the recompute would not cast "
                               "them as forward did)")

    def _pack(self, tensor: torch.Tensor) -> Any:
        """What autograd saves: a note in place of a view of gathered parameters."""
        unit = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return unit, tensor.shape, tensor.stride(), tensor.storage_offset()

    # --- backward ---

    def _unpack(self, saved: Any) -> torch.Tensor:
        """What backward gets back: the saved tensor, or the noted view re-gathered."""
        if isinstance(saved, torch.Tensor):
            return saved
        self._check_open("a backward")
        unit, shape, stride, offset = saved
        self._queue_finish()
        full = self._gathered(unit)
        self._prefetch(unit, -1)
        return full.as_strided(shape, stride, offset)

    def _reduce_scatter(self, unit: Unit, grad_full: torch.Tensor) -> None:
        """Start summing unit's gradient into this rank's slice of it; free the parameters."""
        self._check_open("a backward")
        self._queue_finish()
        self._free(unit)
        grad = grad_full.detach().contiguous()
        if self._reducing:  # one in flight at a time (as torch's FSDP): a full gradient
            self._reducing[-1][1].wait()  # waiting to be sent is memory too
        if self.ring:
            future = self._thread.submit(_ring_shard, grad, self.rank, self.world)
        else:
            out = grad.new_empty(grad.numel() // self.world)
            work = _reduce_scatter(out, grad, group=self.group, async_op=True)  # gloo's: no
            future = self._thread.submit(_waited, work, out, self.replicate)  # future: wait
        self._reducing.append((unit, future))
        self.timeline.collective("reduce-scatter", unit, grad, future)

    def _queue_finish(self) -> None:
        """Once per backward: have autograd call _finish when it is done."""
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True

    @torch.no_grad()
    def _finish(self) -> None:
        """End of backward: wait for every reduce-scatter, add its average to the shard's grad."""
        for unit, future in self._reducing:
            average = future.wait().to(unit.shard.dtype) / self.world
            if unit.shard.grad is None:
                unit.shard.grad = average
            else:
                unit.shard.grad += average
        self._reducing, self._callback_queued = [], False
        for unit in self.units:  # a prefetched unit backward never needed
            self._free(unit)

    # --- between steps ---

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every shard's gradient so that the 2-norm over all ranks' shards is at most
        max_norm (as torch.nn.utils.clip_grad_norm_ on the whole model); return that norm."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=self.shards[0].dtype, device=self.shards[0].device)
        for grad in grads:
            squares += grad.square().sum()
        dist.all_reduce(squares, group=self.group)  # the local shard's alone: a classic bug
        norm = squares.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's formula
        for grad in grads:
            grad.mul_(scale)
        return norm

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded state dict, on every rank: the keys of module.state_dict() before
        wrapping, CPU tensors (the parameters in the shards' dtype, float32 master weights)."""
        gathered = {}
        for unit in self.units:
            full = unit.shard.new_empty(unit.shard.numel() * self.world)
            _all_gather(full, unit.shard.detach(), group=self.group)
            for owners, view in zip(unit.owners, unflatten(full, unit.shapes)):
                gathered.update({name: view.cpu().clone() for _, _, name in owners})
        return {key: gathered[key] if key in gathered else
                getattr(*_owner_of(self.module, key)).detach().cpu().clone()
                for key in self._shapes}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (full_state_dict's keys; the same on every rank)."""
        missing, unexpected = self._shapes.keys() - state_dict, state_dict.keys() - self._shapes
        if missing or unexpected:
            raise KeyError(f"load_full_state_dict: missing keys {sorted(missing)[:5]}, "
                           f"unexpected keys {sorted(unexpected)[:5]}")
        for key, shape in self._shapes.items():
            if state_dict[key].shape != shape:
                raise ValueError(f"load_full_state_dict: {key} has shape "
                                 f"{tuple(state_dict[key].shape)}, the module's {tuple(shape)}")
        sharded = set()
        for unit in self.units:
            names = [owners[0][2] for owners in unit.owners]
            flat = torch.cat([state_dict[name].reshape(-1) for name in names]).to(unit.shard)
            unit.shard.copy_(flat_shard(flat, self.rank, self.world))
            sharded.update(name for owners in unit.owners for _, _, name in owners)
        for key in self._shapes.keys() - sharded:  # frozen parameters and buffers
            getattr(*_owner_of(self.module, key)).copy_(state_dict[key])

    def close(self) -> None:
        """Remove the hooks from the units and end the helper thread: the wrapper cannot run
        after (its shards and full_state_dict() stay)."""
        for hook in self._hooks:
            hook.remove()
        self._thread.close()
        self._closed = True

    def __enter__(self) -> "ScratchFSDP":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _build_units(module: nn.Module, units: Iterable[nn.Module] | None, rank: int,
                 world: int) -> list[Unit]:
    """The units, each with its trainable parameters (a parameter goes to the innermost unit
    listed that holds it; the rest to the root unit, module itself), rank's shards of world."""
    names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    if units is None:
        units = [m for m in module.children() if any(p.requires_grad for p in m.parameters())]
    units = list(units)
    for m in units:
        if id(m) not in names:
            raise ValueError(f"units must be submodules of the wrapped module; "
                             f"{type(m).__name__} is not")
    if len({id(m) for m in units}) < len(units):
        raise ValueError("a module is listed twice in units")
    if all(m is not module for m in units):
        units.append(module)  # the root unit takes what no listed unit holds
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}  # param -> where it is set
    for name, m in module.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None and p.requires_grad:
                owners.setdefault(id(p), []).append((m, attr, f"{name}.{attr}".lstrip(".")))
    claimed: dict[int, nn.Module] = {}
    for m in sorted(units, key=lambda m: -names[id(m)].count(".") - (names[id(m)] != "")):
        for p in m.parameters():
            if p.requires_grad:
                claimed.setdefault(id(p), m)
    built = []
    for m in sorted(units, key=[m for m in module.modules()].index):  # registration order
        params = [p for p in m.parameters() if p.requires_grad and claimed[id(p)] is m]
        if params:
            built.append(Unit(names[id(m)] or "(root)", m, params,
                              [owners[id(p)] for p in params], rank, world))
    for unit in built:  # the parameters leave the modules: the shards replace them
        for owners in unit.owners:
            for owner, attr, name in owners:
                del owner._parameters[attr]
                setattr(owner, attr, NotGathered.of(name))
    return built


def _owner_of(module: nn.Module, key: str) -> tuple[nn.Module, str]:
    """The submodule and attribute name of a state_dict key."""
    path, _, attr = key.rpartition(".")
    return module.get_submodule(path), attr


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """value's floating-point tensors (at the top level of a tuple or dict) cast to dtype."""
    def cast(v: Any) -> Any:
        return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    if isinstance(value, dict):
        return {k: cast(v) for k, v in value.items()}
    return tuple(cast(v) for v in value)


def _frozen_in(module: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """module's floating-point parameters left after wrapping (the frozen ones) cast to dtype,
    by name (for torch.func.functional_call); none without a dtype."""
    if dtype is None:
        return {}
    return {name: p.to(dtype) for name, p in module.named_parameters() if p.is_floating_point()}


def _to_float32(out: Any) -> Any:
    """The model's output in float32 (the loss is computed in float32)."""
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return out.float()
    return out


def _ring_gathered(full: torch.Tensor) -> torch.Tensor:
    """full, once the ring's second half (p2p) has filled in the other ranks' slices."""
    p2p.ring_all_gather(full)
    return full


def _ring_shard(grad: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of grad summed over the ranks, by the ring's first half (p2p)."""
    p2p.ring_reduce_scatter(grad)
    return grad.chunk(world)[rank].clone()  # not a view: grad is freed


def _waited(work: dist.Work, out: torch.Tensor,
            then: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """out, once the collective work writes into has completed (and then(out), given then)."""
    work.wait()
    return out if then is None else then(out)
