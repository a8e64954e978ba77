"""Chapter 11: communicating less, measured - bf16, PowerSGD, local SGD and DiLoCo on one
task, the alpha-beta model across two machines, against torch's powerSGD_hook, and a
gradient's low-rank approximation error.

The drivers (``one_task``, ``compare_with_torch_powersgd``) run in the parent and start the
ranks with ``launch``; the ``*_on_rank`` functions are what every rank runs.
``approximation_error`` and the models (``alpha_beta_step``, ``ddp_across_two_machines``)
compute here, without ranks.
"""
from __future__ import annotations

import math
import statistics
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..compression import PowerSGDState, bf16_hook, powersgd_hook
from ..cost_model import AlphaBeta, allreduce_cost
from ..data import fashion_mnist, resolve_source
from ..ddp import ScratchDDP
from ..launch import launch, rank_device
from ..lenet import lenet_model
from ..local_sgd import DiLoCo
from .timing import alternate

METHODS = ("ddp", "bf16", "powersgd r=1", "powersgd r=4", "local sgd H=4", "diloco H=4",
           "diloco H=16")
INNER_LR = 2e-3  # AdamW, every method's (DiLoCo's inner) optimizer: the paper's inner AdamW
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov SGD, as in the paper
QUICK = {"steps": 80, "batch_size": 16, "train_size": 2048, "test_size": 1000}  # notebook
FULL = {"steps": 320, "batch_size": 32, "train_size": 8192, "test_size": 2000}  # benchmark


# --- the bytes a rank hands to all_reduce ------------------------------------------------------

@contextmanager
def all_reduce_payload() -> Iterator[dict[str, int]]:
    """While inside, {"calls", "bytes"}: the dist.all_reduce calls made in this process and
    the bytes of the tensors handed to them (the payload; a ring sends 2(k-1)/k of it)."""
    counted = {"calls": 0, "bytes": 0}
    original = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted["calls"] += 1
        counted["bytes"] += tensor.nbytes
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield counted
    finally:
        dist.all_reduce = original


# --- one task, every method --------------------------------------------------------------------

def method_argument(method: str) -> tuple[str, int | None]:
    """("powersgd", 4) for "powersgd r=4", ("diloco", 16) for "diloco H=16", ("ddp", None)."""
    name, _, arg = method.rpartition(" ")
    if not name:
        if method not in ("ddp", "bf16"):
            raise ValueError(f"unknown method {method!r}: e.g. {METHODS}")
        return method, None
    kind, number = arg.split("=") if "=" in arg else ("", "")
    expected = {"powersgd": "r", "diloco": "H", "local sgd": "H"}.get(name)
    if kind != expected or not number.isdigit() or int(number) < 1:
        raise ValueError(f"unknown method {method!r}: e.g. {METHODS}")
    return name, int(number)


def built(method: str, seed: int = 0) -> tuple[nn.Module, Any]:
    """LeNet (seed's weights) and its optimizer for method: ScratchDDP with the plain
    allreduce ("ddp"), bf16_hook ("bf16") or powersgd_hook ("powersgd r=R"), AdamW; or no
    DDP and DiLoCo with AdamW inside ("local sgd H=N": outer lr 1, no momentum; "diloco H=N":
    outer lr 0.7, Nesterov momentum 0.9)."""
    name, arg = method_argument(method)
    model = lenet_model(seed)
    if name in ("local sgd", "diloco"):
        inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
        outer = (1.0, 0.0) if name == "local sgd" else (OUTER_LR, OUTER_MOMENTUM)
        return model, DiLoCo(model, inner, arg, *outer)
    ddp = ScratchDDP(model)
    if name == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif name == "powersgd":
        ddp.register_comm_hook(PowerSGDState(arg), powersgd_hook)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=INNER_LR)


def rank_batches(steps: int, batch_size: int, train_size: int, source: str,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share (batch_size images) of each step's global batch, epochs of a
    seeded shuffle of the first train_size training images: the same for every method."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = fashion_mnist("train", train_size, source)
    images, labels = data.tensors
    per_epoch = train_size // (batch_size * world)
    if per_epoch < 1:
        raise ValueError(f"{train_size} images make no global batch of {batch_size} x {world}")
    batches = []
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(train_size, generator=torch.Generator().manual_seed(seed + epoch))
        start = (i * world + rank) * batch_size
        take = order[start:start + batch_size]
        batches.append((images[take], labels[take]))
    return batches


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Accuracy and mean cross-entropy of model on images."""
    logits = model(images)
    return {"accuracy": (logits.argmax(1) == labels).float().mean().item(),
            "loss": nn.functional.cross_entropy(logits, labels).item()}


def train_round(model: nn.Module, opt: Any, batches: Iterator, steps: int, curve: list[float],
                payload: dict[str, int]) -> None:
    """steps training steps on the next batches; each step's loss appended to curve, the
    all_reduce calls and bytes added to payload."""
    with all_reduce_payload() as counted:
        for _ in range(steps):
            X, y = next(batches)
            loss = nn.functional.cross_entropy(model(X), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
    payload["calls"] += counted["calls"]
    payload["bytes"] += counted["bytes"]


def alternated_rounds(runs: dict[str, tuple[nn.Module, Any]], batches: list, round_steps: int,
                      steps: int) -> tuple[dict[str, list[float]], dict, dict]:
    """Each (model, optimizer) of runs trains steps steps on the same batches, the runs
    alternated in rounds of round_steps (timing.alternate): each one's seconds per round,
    loss curve and all_reduce payload ({"calls", "bytes"})."""
    feeds = {name: iter(batches) for name in runs}
    curves: dict[str, list[float]] = {name: [] for name in runs}
    payload = {name: {"calls": 0, "bytes": 0} for name in runs}
    cases = {n: (lambda n=n: train_round(*runs[n], feeds[n], round_steps, curves[n], payload[n]))
             for n in runs}
    return alternate(cases, steps // round_steps, warmup=0), curves, payload


def one_task_on_rank(methods: list[str], steps: int, batch_size: int, train_size: int,
                     test_size: int, source: str) -> dict[str, dict[str, Any]]:
    """Every method trains LeNet for steps steps on the same batches, the methods alternated
    in rounds of the largest sync_every steps (the same at every round for DiLoCo): each
    method's loss curve, payload, median seconds per step, syncs, and the test figures."""
    batches = rank_batches(steps, batch_size, train_size, source)
    test = fashion_mnist("test", test_size, source).tensors
    round_steps = max([method_argument(m)[1] or 1 for m in methods if "H=" in m] or [1])
    if steps % round_steps:
        raise ValueError(f"steps ({steps}) must be a multiple of the largest H ({round_steps})")
    runs = {m: built(m) for m in methods}
    seconds, curves, payload = alternated_rounds(runs, batches, round_steps, steps)
    out = {}
    for m in methods:
        model, opt = runs[m]
        syncs = opt.syncs if isinstance(opt, DiLoCo) else steps
        out[m] = {**{f"final_{k}": v for k, v in evaluate(model, *test).items()},
                  "loss_curve": curves[m], "bytes_sent_per_rank": payload[m]["bytes"],
                  "allreduces": payload[m]["calls"], "syncs": syncs,
                  "seconds_per_step": statistics.median(seconds[m]) / round_steps,
                  "steps": steps}
    return out


def one_task(world_size: int = 2, steps: int | None = None, batch_size: int | None = None,
             methods: Sequence[str] = METHODS, quick: bool = True,
             train_size: int | None = None, test_size: int | None = None,
             source: str | None = None, timeout: float = 300.0) -> dict[str, dict[str, Any]]:
    """Each of methods trains LeNet (AdamW, lr INNER_LR) for the same steps on the same
    batches (batch_size images per rank) in one launch: {method: {"final_accuracy",
    "final_loss" (on test_size test images), "loss_curve" (rank 0's loss at each step),
    "bytes_sent_per_rank" (payload handed to all_reduce over the run), "allreduces" (calls),
    "seconds_per_step" (median over the rounds, slowest rank), "syncs", "steps"}}.
    quick: the notebook's sizes (QUICK), else the benchmark's (FULL); steps must be a multiple
    of the largest H."""
    sizes = {**(QUICK if quick else FULL)}
    for key, given in (("steps", steps), ("batch_size", batch_size),
                       ("train_size", train_size), ("test_size", test_size)):
        if given is not None:
            sizes[key] = given
    for m in methods:
        method_argument(m)  # a clear error here, not on the ranks
    ranks = launch(one_task_on_rank, list(methods), sizes["steps"], sizes["batch_size"],
                   sizes["train_size"], sizes["test_size"], resolve_source(source),
                   world_size=world_size, backend="gloo", timeout=timeout)
    return ranks[0]


# --- the alpha-beta model: the same steps across two machines ---------------------------------

LAN_LATENCY_S = 50e-6  # assumed: one TCP message between two machines on one Ethernet switch
LINKS_GBIT = (1, 10, 100)
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap: one allreduce per bucket
# 1B parameters: 6 N T FLOPs per step (Kaplan et al. 2020, arXiv:2001.08361: forward 2 N T,
# backward 4 N T) for T tokens per machine, assumed: one micro-batch of 8 sequences of 2,048
# (TinyLlama-1.1B's length, arXiv:2401.02385; its steps were 8 times T a GPU), on one H100 SXM
# per machine at 989 TFLOP/s dense bf16 (NVIDIA's datasheet) and 40% of it used (a typical MFU)
ONE_BILLION = {"params": 10**9, "tokens_per_step": 8 * 2048, "flops_per_s": 0.4 * 989e12}


def link(gbit: float, latency_s: float = LAN_LATENCY_S) -> AlphaBeta:
    """One message over a gbit Gbit/s link: latency_s + bytes * 8 / (gbit 1e9) seconds."""
    if not gbit > 0:
        raise ValueError(f"the link must carry > 0 Gbit/s, got {gbit}")
    return AlphaBeta(latency_s, 8 / (gbit * 1e9))


def alpha_beta_step(method_bytes: Mapping[str, float],
                    compute_seconds: Mapping[str, float] | float, link_gbit: float = 1.0, *,
                    messages: Mapping[str, float] | None = None,
                    latency_s: float = LAN_LATENCY_S,
                    world_size: int = 2) -> dict[str, dict[str, float]]:
    """Seconds per step of each method across world_size machines on a link_gbit link:
    compute plus a ring allreduce of its payload per step (method_bytes), no overlap, each of
    its allreduces per step (messages; default 1) paying the ring's 2(k-1) latencies:
    {method: {"compute_s", "comm_s", "step_s", "comm_share"}}."""
    ring = allreduce_cost(link(link_gbit, latency_s), world_size, "ring")
    out = {}
    for m, nbytes in method_bytes.items():
        compute = (compute_seconds[m] if isinstance(compute_seconds, Mapping)
                   else compute_seconds)
        calls = 1.0 if messages is None else messages[m]
        comm = calls * ring.alpha + nbytes * ring.beta
        out[m] = {"compute_s": compute, "comm_s": comm, "step_s": compute + comm,
                  "comm_share": comm / (compute + comm)}
    return out


def across_two_machines(results: Mapping[str, Mapping[str, Any]],
                        link_gbit: float = 1.0) -> dict[str, dict[str, float]]:
    """alpha_beta_step for one_task's results: each method's payload and allreduces per step,
    and its seconds per step measured here as the compute (they include this machine's
    loopback allreduces, which the link replaces: a slight overestimate)."""
    per_step = {m: r["bytes_sent_per_rank"] / r["steps"] for m, r in results.items()}
    calls = {m: r["allreduces"] / r["steps"] for m, r in results.items()}
    compute = {m: r["seconds_per_step"] for m, r in results.items()}
    return alpha_beta_step(per_step, compute, link_gbit, messages=calls)


def one_billion_compute_seconds(params: float = ONE_BILLION["params"],
                                tokens: float = ONE_BILLION["tokens_per_step"],
                                flops_per_s: float = ONE_BILLION["flops_per_s"]) -> float:
    """Seconds of one step's forward and backward: 6 params tokens FLOPs at flops_per_s."""
    return 6 * params * tokens / flops_per_s


def ddp_across_two_machines(lenet_compute_s: float, lenet_numel: int | None = None,
                            links_gbit: Sequence[float] = LINKS_GBIT,
                            latency_s: float = LAN_LATENCY_S) -> dict[str, dict[float, dict]]:
    """One DDP step (float32 gradients in 25 MiB buckets, allreduced on a ring after
    backward, no overlap) of LeNet (its compute measured: lenet_compute_s) and of a
    1B-parameter model (one_billion_compute_seconds) across two machines at each link:
    {model: {gbit: {"compute_s", "comm_s", "step_s", "comm_share"}}}."""
    numel = lenet_numel or sum(p.numel() for p in lenet_model(0).parameters())
    models = {"LeNet": (4 * numel, lenet_compute_s),
              "1B parameters": (4 * ONE_BILLION["params"], one_billion_compute_seconds())}
    out: dict[str, dict[float, dict]] = {}
    for name, (nbytes, compute) in models.items():
        buckets = {name: math.ceil(nbytes / BUCKET_BYTES)}
        out[name] = {g: alpha_beta_step({name: nbytes}, compute, g, messages=buckets,
                                        latency_s=latency_s)[name] for g in links_gbit}
    return out


# --- against torch's powerSGD_hook ------------------------------------------------------------

def torch_powersgd(matrix_rank: int) -> tuple[Any, Callable]:
    """torch's PowerSGD state and hook set as ours: compression from step 2, error feedback,
    warm start, and every matrix compressed whose factors are smaller than it
    (min_compression_rate 1; the biases are then sent whole, as ours does)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_hook

    state = torch_hook.PowerSGDState(process_group=None, matrix_approximation_rank=matrix_rank,
                                     start_powerSGD_iter=2, min_compression_rate=1,
                                     use_error_feedback=True, warm_start=True)
    return state, torch_hook.powerSGD_hook


@contextmanager
def torch_powersgd_on_cpu() -> Iterator[None]:
    """While this rank's buckets are on the CPU, let torch's powerSGD_hook skip its CUDA sync:
    it calls torch.cuda.synchronize(the bucket's device) whenever CUDA is available, which
    raises for a CPU bucket on a GPU host (torch 2.11 on an H100, docs/gpu-runs.md; proposed
    upstream fix: pytorch/pytorch#196568)."""
    if rank_device().type != "cpu":
        yield
        return
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        yield


class TorchsFirstQs(PowerSGDState):
    """Our PowerSGD state, from the first Qs torch's powerSGD_hook (default seed) draws for a
    model in one bucket: its seed, one draw per compressed matrix in the bucket's order. Only
    a Q's span counts, so from them both hooks compute the same, within rounding."""

    def __init__(self, matrix_rank: int) -> None:
        import numpy as np  # torch's hook draws its seeds with numpy

        super().__init__(matrix_rank, start_step=2)
        seed = int(np.random.RandomState(0).randint(1_000_000_000))
        self.generator = torch.Generator().manual_seed(seed)

    def initial_q(self, grad: torch.Tensor, matrix_rank: int) -> torch.Tensor:
        return torch.randn(grad.shape[1], matrix_rank, generator=self.generator,
                           dtype=grad.dtype).to(grad.device)


def compare_powersgd_on_rank(matrix_rank: int, steps: int, round_steps: int, batch_size: int,
                             train_size: int, test_size: int,
                             source: str) -> dict[str, dict[str, Any]]:
    """LeNet under torch's DDP with our powersgd_hook and with torch's powerSGD_hook at
    matrix_rank, alternated in rounds of round_steps on the same batches."""
    batches = rank_batches(steps, batch_size, train_size, source)
    test = fashion_mnist("test", test_size, source).tensors
    hooks = {"ours": (PowerSGDState(matrix_rank), powersgd_hook),
             "torch": torch_powersgd(matrix_rank)}
    runs = {}
    for way, (state, hook) in hooks.items():
        ddp = DistributedDataParallel(lenet_model(0))
        ddp.register_comm_hook(state, hook)
        runs[way] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=INNER_LR))
    with torch_powersgd_on_cpu():
        seconds, curves, payload = alternated_rounds(runs, batches, round_steps, steps)
    return {w: {**{f"final_{k}": v for k, v in evaluate(runs[w][0].module, *test).items()},
                "loss_curve": curves[w], "bytes_sent_per_rank": payload[w]["bytes"],
                "allreduces": payload[w]["calls"], "steps": steps,
                "seconds_per_step": statistics.median(seconds[w]) / round_steps}
            for w in hooks}


def compare_with_torch_powersgd(world_size: int = 2, matrix_rank: int = 2,
                                steps: int | None = None, batch_size: int | None = None,
                                quick: bool = True, round_steps: int = 8,
                                source: str | None = None,
                                timeout: float = 300.0) -> dict[str, Any]:
    """Our powersgd_hook and torch's powerSGD_hook (torch_powersgd), each on torch's DDP with
    LeNet and AdamW, the same batches and rank: {"ours": {...}, "torch": {...}} with
    one_task's keys (the payload counted by wrapping dist.all_reduce), and
    "time_ratio": our seconds per step / torch's (medians over rounds alternated in one run)."""
    sizes = {**(QUICK if quick else FULL)}
    steps = sizes["steps"] if steps is None else steps
    if steps % round_steps:
        raise ValueError(f"steps ({steps}) must be a multiple of round_steps ({round_steps})")
    ranks = launch(compare_powersgd_on_rank, matrix_rank, steps, round_steps,
                   batch_size or sizes["batch_size"], sizes["train_size"], sizes["test_size"],
                   resolve_source(source), world_size=world_size, backend="gloo",
                   timeout=timeout)
    out: dict[str, Any] = dict(ranks[0])
    out["time_ratio"] = out["ours"]["seconds_per_step"] / out["torch"]["seconds_per_step"]
    return out


# --- one gradient, approximated at each rank ---------------------------------------------------

RANKS = (1, 2, 4, 8, 16, 32, 64, 128)


def lenet_gradient(steps: int = 20, batch_size: int = 64, layer: int = 4,
                   source: str | None = None, seed: int = 0) -> torch.Tensor:
    """The gradient of LeNet's parameter layer (4: the 800 x 128 dense weight) on one batch
    of training images, after steps AdamW steps on the batches before it (one process)."""
    model = lenet_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    images, labels = fashion_mnist("train", (steps + 1) * batch_size, source).tensors
    for i, (X, y) in enumerate(zip(images.split(batch_size), labels.split(batch_size))):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        if i < steps:  # the last batch's gradient is the one returned
            opt.step()
    return model.params[layer].grad.detach().clone()


def power_iteration_approximation(matrix: torch.Tensor, rank: int, seed: int = 0) -> torch.Tensor:
    """P Q^T from one power iteration from a random Q (PowerSGD's first step): P = M Q
    orthonormalised, Q = M^T P."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(matrix.shape[1], rank, generator=g, dtype=matrix.dtype)
    p = torch.linalg.qr(matrix @ q).Q
    return p @ (matrix.T @ p).T


def approximation_error(matrix: torch.Tensor | None = None,
                        ranks: Sequence[int] = RANKS, seed: int = 0) -> dict[str, Any]:
    """The relative Frobenius error ||M - M_r|| / ||M|| of matrix (default: lenet_gradient(),
    800 x 128, float32) at each rank r: M_r from one power iteration from a random Q, and
    the best rank-r approximation (the SVD's first r terms: sqrt(sum of the other squared
    singular values) / ||M||). {"shape", "ranks", "power_iteration", "best"}."""
    M = lenet_gradient() if matrix is None else matrix
    if max(ranks) > min(M.shape) or min(ranks) < 1:
        raise ValueError(f"ranks must lie in 1..{min(M.shape)}, got {list(ranks)}")
    norm = torch.linalg.matrix_norm(M)
    singular = torch.linalg.svdvals(M.double())
    power = [(torch.linalg.matrix_norm(M - power_iteration_approximation(M, r, seed))
              / norm).item() for r in ranks]
    best = [(singular[r:].square().sum().sqrt() / singular.square().sum().sqrt()).item()
            for r in ranks]
    return {"shape": tuple(M.shape), "ranks": list(ranks), "power_iteration": power,
            "best": best}
