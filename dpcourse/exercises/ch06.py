"""Checkers for chapter 06's exercises (nn.DataParallel built by hand)."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..data_parallel import ScratchDataParallel, sgd_steps
from ..resnet import resnet18
from . import answered, count, is_int


def check_same_batch_settings(same_batch_settings: Callable[[int], Any] | None) -> None:
    """Exercise 1: settings for k devices with the textbook's 1-GPU run's global batch 256 and
    learning rate 0.1."""
    if not answered(same_batch_settings):
        return
    for k in (1, 2, 4, 8):
        s, on = same_batch_settings(k), f"on {count(k, 'device')}"
        if not is_int(s.batch_per_device):
            print(f"not quite: {on} batch_per_device is {s.batch_per_device!r}, but a "
                  "batch holds a whole number of examples: use 256 // k")
            return
        batch, lr = s.batch_per_device * k, s.lr_per_device * k
        if batch != 256:
            print(f"not quite: {on} the global batch is {s.batch_per_device} x {k} = "
                  f"{batch}; keep it at 256 by giving each device 256 / k examples")
            return
        if abs(lr - 0.1) > 1e-12:
            print(f"not quite: {on} the learning rate is {s.lr_per_device} x {k} = "
                  f"{lr:g}; train_module multiplies lr_per_device by k, so use 0.1 / k")
            return
    print("correct: the same global batch and learning rate on every device count")


def _shard_stats(sizes: list[int], channels: int = 3, seed: int = 0
                 ) -> tuple[torch.Tensor, list[int], list[torch.Tensor], list[torch.Tensor]]:
    """A float64 batch cut into shards of these sizes, whose means differ from shard to shard,
    and each shard's count, per-channel mean and biased variance."""
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(n, channels, generator=g, dtype=torch.float64) * (1 + i) + 3 * i
              for i, n in enumerate(sizes)]
    return (torch.cat(shards), sizes, [s.mean(0) for s in shards],
            [s.var(0, correction=0) for s in shards])


def check_combine_stats(combine_stats: Callable | None) -> None:
    """Exercise 2: combine_stats(counts, means, variances), the whole batch's per-channel mean
    and biased variance from each shard's count, mean and biased variance (SyncBatchNorm)."""
    if not answered(combine_stats):
        return
    for sizes in ([4, 4, 2], [5, 5], [1, 6, 3, 2], [7]):
        batch, counts, means, variances = _shard_stats(sizes)
        got = combine_stats(counts, means, variances)
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(t, torch.Tensor) and t.shape == (3,) for t in got)):
            return print(f"not quite: return a pair (mean, variance) of tensors with one value "
                         f"per channel, shape (3,), not {got!r:.60}")
        mean, var = got
        want_mean, want_var = batch.mean(0), batch.var(0, correction=0)
        where = f"shards of {sizes} examples"
        if not torch.allclose(mean, want_mean, rtol=1e-10, atol=1e-12):
            hint = ("the mean of the shard means weighs every shard alike; weigh each by its "
                    "count" if torch.allclose(mean, torch.stack(means).mean(0)) else
                    "the batch's mean is the sum of all examples over their number")
            return print(f"not quite: {where}: the mean is off: {hint}")
        if torch.allclose(var, want_var, rtol=1e-10, atol=1e-12):
            continue
        n = sum(counts)
        within = sum(c * v for c, v in zip(counts, variances)) / n
        if torch.allclose(var, want_var * n / (n - 1)):  # every batch here has n > 1
            hint = "that is the unbiased variance; batch norm divides by the count, N, not N - 1"
        elif torch.allclose(var, within) or torch.allclose(var, torch.stack(variances).mean(0)):
            hint = ("the shards' variances leave out how far each shard's mean lies from the "
                    "batch's: add count x (shard mean - batch mean)^2 for each shard")
        else:
            hint = "the variance is the mean squared distance of all examples from the batch mean"
        return print(f"not quite: {where}: the variance is off: {hint}")
    print("correct: the counts weigh the means, and the variance adds the spread of the shard "
          "means to the shards' own variances")


class _ComputedWith(TorchFunctionMode):
    """Records the storage of every tensor that an out-of-place op under it computes with."""

    def __init__(self) -> None:
        super().__init__()
        self.pointers: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.startswith("__")
        if isinstance(out, torch.Tensor) and not in_place:
            self.pointers.update(a.data_ptr() for a in [*args, *(kwargs or {}).values()]
                                 if isinstance(a, torch.Tensor))
        return out


def _stale_grads(wrapper: nn.Module) -> bool:
    """Whether the wrapper's copies still hold gradients after a step."""
    return any(t.is_leaf and t.grad is not None
               for replica in wrapper.replicas for t in replica.values())


def _cached_wrapper_problem(wrapper: nn.Module, n_extra: int, X: torch.Tensor) -> str | None:
    """What is wrong with how the wrapper keeps its copies, or None."""
    replicas = getattr(wrapper, "replicas", None)
    if not isinstance(replicas, list) or len(replicas) != n_extra or not all(replicas):
        return (f"keep the copies in self.replicas: a list of {n_extra} dicts of tensors, one per "
                "extra device")
    originals = {p.data_ptr() for p in wrapper.parameters()}
    if any(t.data_ptr() in originals for replica in replicas for t in replica.values()):
        return "the copies share memory with the module's parameters: make real copies"
    with _ComputedWith() as used:
        wrapper(X)
    if any(t.data_ptr() not in used.pointers for replica in replicas for t in replica.values()):
        return ("the forward pass does not compute with the copies in self.replicas (does it "
                "make new ones?); pass them to parallel_apply")
    return None


def check_cached_wrapper(wrapper_class: type | None) -> None:
    """Exercise 3: a wrapper that keeps its copies between steps, computes with them, and still
    takes the steps of ScratchDataParallel (in float64, 3 SGD steps on 3 simulated devices)."""
    if not answered(wrapper_class):
        return
    devs = [torch.device("cpu", i) for i in range(3)]  # devices(3, simulate=True), silently
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    theirs = wrapper_class(copy.deepcopy(net), devs)
    reference = ScratchDataParallel(copy.deepcopy(net), devs)
    kept = None
    for step in range(1, 4):
        batch = [(torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 3, (9,)))]
        want = sgd_steps(reference, batch, 0.1, devs[0])
        got = sgd_steps(theirs, batch, 0.1, devs[0])
        if not all(torch.allclose(g, w, rtol=1e-10, atol=1e-12) for g, w in zip(got, want)):
            if step == 1:
                why = "are the copies' gradients added to the module's parameters?"
            elif hasattr(theirs, "replicas") and _stale_grads(theirs):
                why = ("the copies still hold gradients after the step: clear each copy's .grad "
                       "once it is added to the original (optimizer.zero_grad() clears only the "
                       "module's parameters), or the steps' gradients add up")
            else:
                why = "are the copies refreshed after each optimizer.step()?"
            print(f"not quite: after {step} step(s) the parameters differ from "
                  f"ScratchDataParallel's: {why}")
            return
        problem = _cached_wrapper_problem(theirs, len(devs) - 1, batch[0][0])
        if problem:
            print(f"not quite: {problem}")
            return
        ptrs = [t.data_ptr() for replica in theirs.replicas for t in replica.values()]
        if kept is not None and ptrs != kept:
            print("not quite: the copies were replaced; refresh them in place (copy_) instead")
            return
        kept = ptrs
    print("correct: the copies are reused, refreshed after every step, and their gradients reach "
          "the module")


def check_bytes_received(answer: float | None) -> None:
    """Exercise 4: bytes device 0 receives per step for dpcourse's resnet18 on 4 devices,
    per-device batch 256: the 3 other shards' outputs plus the 3 other replicas' gradients."""
    if not answered(answer):
        return
    n = sum(p.numel() for p in resnet18().parameters())
    outputs, grads = 3 * 256 * 10 * 4, 3 * n * 4
    want = outputs + grads

    def near(x: float) -> bool:
        return abs(answer - x) < 1_000  # exact bytes: the outputs are only 30,720 of them

    if near(want):
        print(f"correct: {outputs:,} bytes of outputs + {grads:,} bytes of gradients")
    elif near(grads):
        print("not quite: that is the gradients only; device 0 also receives the other "
              "devices' outputs (gather)")
    elif near(outputs):
        print("not quite: that is the outputs only; add the gradients of the 3 other replicas")
    elif near(want + 256 * 10 * 4):
        print("not quite: device 0 computes its own shard's outputs; it receives only the 3 other "
              "shards' outputs")
    elif near(4 / 3 * want):
        print("not quite: device 0 receives from the 3 other devices, not from itself")
    elif answer > want:
        print("not quite: too much; count only what arrives at device 0 (the replicas and the "
              "input shards leave it)")
    else:
        print("not quite: count 3 shards of 256 outputs of 10 numbers, and 3 copies of every "
              "parameter's gradient, 4 bytes each")


def _devs(k: int) -> list[torch.device]:
    """k simulated CPU devices, without devices()' announcement."""
    return [torch.device("cpu", i) for i in range(k)]


def check_scatter(scatter: Callable) -> None:
    """Your scatter: torch.chunk's pieces along dim 0, piece i on device i, differentiable."""
    X = torch.randn(10, 3, requires_grad=True)
    shards = scatter(X, [torch.device("cpu"), torch.device("meta"), torch.device("cpu")])
    assert [s.device.type for s in shards] == ["cpu", "meta", "cpu"], (
        f"devices cpu, meta, cpu got shards on {[s.device.type for s in shards]}: "
        "move shard i to devs[i]")
    for k in range(1, 6):
        for n in range(1, 21):
            t = torch.arange(n * 2.0).reshape(n, 2)
            got, want = scatter(t, _devs(k)), t.chunk(k)
            where = f"{count(n, 'row')} on {count(k, 'device')}"
            assert [len(s) for s in got] == [len(c) for c in want], (
                f"{where}: shards of {[len(s) for s in got]}, torch.chunk "
                f"gives {[len(c) for c in want]}")
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (
                f"{where}: the shards are not the rows of t in order")
    total = sum(s.sum() for s in scatter(X, _devs(3)))
    if total.requires_grad:
        total.backward()
    assert X.grad is not None and torch.equal(X.grad, torch.ones_like(X)), (
        "the shards are not connected to t in autograd: use t.chunk and .to, no detach")
    print("scatter is right: torch.chunk's shards for 1-20 rows on 1-5 devices, shard i on "
          "devs[i], gradients flow back")


def check_replicate(replicate: Callable) -> None:
    """Your replicate: the originals for the first device, differentiable copies on the
    others (parameters and buffers), and a ValueError for a module on another device."""
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    states = replicate(module, _devs(3))
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    assert len(states) == 3, f"3 devices got {len(states)} states: one dict per device"
    for i, state in enumerate(states):
        assert sorted(state) == sorted(names), (
            f"device {i}'s state has keys {sorted(state)}; want the parameters' and buffers' "
            f"names, {sorted(names)}")
    originals = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    assert all(states[0][n] is t for n, t in originals.items()), (
        "the first device's state must hold the module's own tensors, not copies")
    for i, state in enumerate(states[1:], start=1):
        for n, t in state.items():
            assert torch.equal(t, originals[n]) and t.data_ptr() != originals[n].data_ptr(), (
                f"device {i}'s {n} must be a copy of the original: equal values, its own memory")
    sum(s["0.weight"].sum() for s in states).backward()
    grad = module[0].weight.grad
    assert grad is not None and torch.equal(grad, torch.full_like(grad, 3.0)), (
        "the copies' gradients do not flow back to the original parameters: copy with "
        ".to(d, copy=True), without detach")
    on_meta = replicate(module, [torch.device("cpu"), torch.device("meta")])[1]
    assert all(t.device.type == "meta" for t in on_meta.values()), (
        "devices cpu, meta: the second state is not on meta; copy each tensor to its device")
    twice = replicate(module, [torch.device("cpu"), torch.device("cpu")])[1]
    aliased = [n for n, t in twice.items() if t.data_ptr() == originals[n].data_ptr()]
    assert not aliased, (
        f"devices cpu, cpu: device 1's {aliased[0]} is the original itself: t.to(d) returns t "
        "when t is already on d (chapters 00 and 03); ask .to for copy=True")
    try:
        replicate(nn.Linear(3, 4, device="meta"), [torch.device("cpu")])
    except ValueError:
        return print("replicate is right: the originals on the first device, differentiable "
                     "copies of parameters and buffers on the others, a clear error otherwise")
    raise AssertionError("a module on meta replicated from cpu was accepted: raise a ValueError "
                         "naming the tensor that is not on devs[0] (use same_device)")


def check_parallel_apply(parallel_apply: Callable) -> None:
    """Your parallel_apply: the module run with state i on shard i, for each device in order."""
    module = nn.Linear(3, 2)
    states = [{"weight": torch.randn(2, 3, requires_grad=True), "bias": torch.randn(2)}
              for _ in range(3)]
    shards = [torch.randn(n, 3) for n in (4, 4, 2)]
    outputs = parallel_apply(module, states, shards)
    assert len(outputs) == 3, f"3 states and 3 shards gave {len(outputs)} outputs: one each"
    for i, (out, state, shard) in enumerate(zip(outputs, states, shards)):
        want = nn.functional.linear(shard, state["weight"], state["bias"])
        assert out.shape == want.shape and torch.allclose(out, want), (
            f"output {i} is not the module run with state {i} on shard {i} "
            "(torch.func.functional_call(module, state, (shard,)))")
    if outputs[1].requires_grad:
        outputs[1].sum().backward()
    assert states[1]["weight"].grad is not None and states[0]["weight"].grad is None, (
        "output 1's gradient does not reach state 1's weight alone: compute with the states")
    print("parallel_apply is right: each shard through the module with its own device's state")


def check_gather(gather: Callable) -> None:
    """Your gather: the outputs concatenated along dim 0 on the given device, differentiable."""
    outputs = [torch.randn(n, 2, requires_grad=True) for n in (4, 4, 2)]
    got = gather(outputs, torch.device("cpu"))
    assert isinstance(got, torch.Tensor) and torch.equal(got, torch.cat(outputs)), (
        "the result is not the outputs concatenated along dim 0, in order")
    if got.requires_grad:
        got.sum().backward()
    assert all(o.grad is not None and torch.equal(o.grad, torch.ones_like(o)) for o in outputs), (
        "gradients do not flow back to each output: move with .to(device), no detach")
    on = gather(outputs, torch.device("meta")).device.type
    assert on == "meta", f"gather(outputs, meta) returned a tensor on {on}: move them to device"
    print("gather is right: the outputs concatenated on the device, gradients flow back")


class _Gathered(TorchFunctionMode):
    """Notes whether torch.cat joins 2-D tensors of `width` columns (gathered outputs)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.seen = width, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.cat and args:
            self.seen |= all(t.dim() == 2 and t.shape[1] == self.width for t in args[0])
        return func(*args, **(kwargs or {}))


def check_parallel_loss(parallel_loss: Callable | None) -> None:
    """Exercise 5: the batch's mean cross entropy computed on every device, from its own
    shard's outputs, without gathering the outputs: the value and the gradient of one device's."""
    if not answered(parallel_loss):
        return
    torch.manual_seed(0)
    for k, n in ((1, 10), (2, 10), (3, 10), (4, 3)):
        module = nn.Linear(5, 7).double()
        X, y = torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 7, (n,))
        want = nn.functional.cross_entropy(module(X), y)
        (want_grad,) = torch.autograd.grad(want, [module.weight])
        with _Gathered(7) as mode:
            got = parallel_loss(module, X, y, _devs(k))
        where = f"{n} examples on {count(k, 'device')}"
        if mode.seen:
            return print("not quite: the outputs were gathered (torch.cat); compute each "
                         "shard's loss on its own device and add up the losses")
        if not torch.isclose(got.detach(), want.detach(), rtol=1e-10):
            sizes = [len(s) for s in X.chunk(k)]
            return print(f"not quite: {where} (shards {sizes}): loss {float(got.detach()):.6f}, "
                         f"the batch's mean is {float(want.detach()):.6f}; each example weighs "
                         f"1/{n}, whatever its shard")
        (grad,) = (torch.autograd.grad(got, [module.weight], allow_unused=True)
                   if got.requires_grad else (None,))
        if grad is None or not torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-14):
            return print(f"not quite: {where}: the loss is right but its "
                         "gradient is not; keep the losses in the autograd graph")
    print("correct: summed losses per shard, added on the first device and divided by the "
          "whole batch, with the gradient of one device")
