"""Chapter 11: communicating fewer bytes - gradients cast to bfloat16, or approximated by
PowerSGD's low-rank factors with error feedback.

Each is a communication hook, ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``,
so one function registers on torch's ``DistributedDataParallel.register_comm_hook`` and on
``ScratchDDP.register_comm_hook`` alike (chapter 07's seam). Both are asynchronous, as torch's
compress hooks: they start their allreduce and return its future, so backward goes on while
the bucket travels. PowerSGD is Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank
Gradient Compression for Distributed Optimization", NeurIPS 2019 (arXiv:1905.13727),
algorithm 1 with error feedback and warm start. (No ``from __future__ import annotations``:
torch's DDP checks a hook's annotations.)
"""
from typing import Any, Callable

import torch
import torch.distributed as dist

from .comm_hooks import allreduce_hook

__all__ = ["allreduce_hook", "bf16_hook", "PowerSGDState", "powersgd_hook", "compressed_average",
           "low_rank_averages", "approximations", "summed", "chain"]


def _done(value: Any) -> torch.futures.Future:
    """A future that already holds value."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def bf16_hook(group: dist.ProcessGroup | None,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: half the bytes of float32, 8 significant bits. Returns
    at once; the future copies the average back into the bucket when it arrives."""
    buffer = bucket.buffer()
    half = buffer.div(dist.get_world_size(group)).to(torch.bfloat16)
    work = dist.all_reduce(half, group=group, async_op=True)
    return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0]))


class PowerSGDState:
    """powersgd_hook's state: the rank of the approximation, when compression starts, and per
    parameter its last Q (warm start) and its error (what was not sent yet)."""

    def __init__(self, matrix_rank: int, start_step: int = 2, error_feedback: bool = True,
                 seed: int = 0) -> None:
        if matrix_rank < 1 or start_step < 0:
            raise ValueError(f"need matrix_rank >= 1 and start_step >= 0, got {matrix_rank}, "
                             f"{start_step}")
        self.matrix_rank, self.start_step = matrix_rank, start_step
        self.error_feedback, self.seed = error_feedback, seed
        self.step = 0  # synchronised backward passes so far (counted at each last bucket)
        self.qs: dict[torch.Tensor, torch.Tensor] = {}
        self.errors: dict[torch.Tensor, torch.Tensor] = {}
        self.bytes_sent = 0  # payload bytes this rank handed to all_reduce
        self.in_flight: torch.futures.Future | None = None  # the last compressed bucket's

    def state_dict(self, params: list[torch.Tensor]) -> dict:
        """The step, the Qs and the errors, each under its parameter's position in params."""
        where = {p: i for i, p in enumerate(params)}
        return {"step": self.step, "bytes_sent": self.bytes_sent,
                "qs": {where[p]: q for p, q in self.qs.items()},
                "errors": {where[p]: e for p, e in self.errors.items()}}

    def load_state_dict(self, state: dict, params: list[torch.Tensor]) -> None:
        """Take back what state_dict(params) returned."""
        self.step, self.bytes_sent = state["step"], state["bytes_sent"]
        self.qs = {params[i]: q.to(params[i].device) for i, q in state["qs"].items()}
        self.errors = {params[i]: e.to(params[i].device) for i, e in state["errors"].items()}

    def compresses(self, param: torch.Tensor) -> bool:
        """Whether param's gradient, n x m (a kernel as shape[0] x the rest), travels as
        factors: only where r(n + m) < n m, with r = min(matrix_rank, n, m); else whole."""
        if param.dim() < 2:
            return False
        n, m = param.shape[0], param[0].numel()
        return min(self.matrix_rank, n, m) * (n + m) < n * m

    def initial_q(self, grad: torch.Tensor, matrix_rank: int) -> torch.Tensor:
        """The same random orthonormal m x matrix_rank matrix on every rank, whatever the
        buckets' layout (drawn from seed and the n x m grad's shape)."""
        n, m = grad.shape
        g = torch.Generator().manual_seed(hash((self.seed, n, m, matrix_rank)) % 2**63)
        q = torch.randn(m, matrix_rank, generator=g, dtype=torch.float64)
        return torch.linalg.qr(q).Q.to(grad)


def powersgd_hook(state: PowerSGDState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket exactly until state.start_step, then by compressed_average. Returns
    at once, the bucket still travelling, but a compressed bucket's Q allreduce starts from a
    callback, and every rank must start its collectives in one order: a compressed bucket
    waits for the one before, and the last for itself (torch's DDP may start one next)."""
    if state.step < state.start_step:
        state.bytes_sent += bucket.buffer().nbytes
        future = allreduce_hook(None, bucket)
    else:
        if state.in_flight is not None:
            state.in_flight.wait()
        future = state.in_flight = compressed_average(state, bucket)
        if bucket.is_last():  # nothing is left to overlap; it is waited for next anyway
            future.wait()
    if bucket.is_last():
        state.step += 1
    return future


def compressed_average(state: PowerSGDState,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A future of the bucket's average: each matrix-shaped gradient that state.compresses
    as a rank-r product P Q^T, r(n + m) numbers sent instead of n m; the rest (biases,
    matrices no smaller as factors) averaged whole, in one allreduce."""
    world, buffer, params = dist.get_world_size(), bucket.buffer(), bucket.parameters()
    pieces = buffer.split([p.numel() for p in params])
    whole = [piece for p, piece in zip(params, pieces) if not state.compresses(p)]
    state.bytes_sent += sum(piece.nbytes for piece in whole)
    averages = summed([piece / world for piece in whole])
    matrices = [(p, piece.view(p.shape[0], -1))
                for p, piece in zip(params, pieces) if state.compresses(p)]
    approxes = (low_rank_averages(state, [p for p, _ in matrices], [g for _, g in matrices])
                if matrices else _done([]))

    def write(_: torch.futures.Future) -> torch.Tensor:
        for piece, average in zip(whole, averages.value()):
            piece.copy_(average)
        for (_, grad), approx in zip(matrices, approxes.value()):
            grad.copy_(approx)  # a view into the bucket's buffer
        return buffer
    return torch.futures.collect_all([averages, approxes]).then(write)


def low_rank_averages(state: PowerSGDState, params: list[torch.Tensor],
                      grads: list[torch.Tensor]) -> torch.futures.Future[list[torch.Tensor]]:
    """One power iteration on each of this rank's n x m grads (plus its error): a future of
    the rank-r approximations P Q^T of the averages over the ranks, each P orthonormal. The
    P's of all the matrices travel in one allreduce, then their Q's in another (as torch's hook
    does), started by the P's arrival: nobody waits, but the next collective must wait for it."""
    world = dist.get_world_size()
    Ms = [g + state.errors[p] if p in state.errors else g.clone() for p, g in zip(params, grads)]
    qs = [state.qs[p] if p in state.qs else  # rank min(n, m) at most: then it is exact
          state.initial_q(g, min(state.matrix_rank, *g.shape)) for p, g in zip(params, grads)]

    def send_qs(sums: list[torch.Tensor]) -> torch.futures.Future[list[torch.Tensor]]:
        ps = [torch.linalg.qr(p).Q for p in sums]  # the sum's: scale does not matter to QR
        return summed([M.T @ p / world for M, p in zip(Ms, ps)]).then(
            lambda arrived: approximations(state, params, Ms, ps, arrived.value()))
    return chain(summed([M @ q for M, q in zip(Ms, qs)]), send_qs)


def approximations(state: PowerSGDState, params: list[torch.Tensor], Ms: list[torch.Tensor],
                   ps: list[torch.Tensor], qs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each matrix's P Q^T, once its Q's have arrived; counts the bytes of P and Q, keeps Q
    (the next step's warm start) and, with error feedback, M - P Q^T (sent next step)."""
    approxes = []
    for param, M, p, q in zip(params, Ms, ps, qs):
        state.bytes_sent += p.nbytes + q.nbytes
        state.qs[param] = q  # warm start for the next step
        approxes.append(p @ q.T)
        if state.error_feedback:
            state.errors[param] = M - approxes[-1]  # what was not sent, added next time
    return approxes


def summed(tensors: list[torch.Tensor]) -> torch.futures.Future[list[torch.Tensor]]:
    """A future of the tensors summed over the ranks: one asynchronous all_reduce of them
    all, flattened together."""
    if not tensors:
        return _done([])
    flat = torch.cat([t.reshape(-1) for t in tensors])
    work = dist.all_reduce(flat, async_op=True)
    return work.get_future().then(lambda _: [piece.view_as(t) for piece, t in
                                             zip(flat.split([t.numel() for t in tensors]), tensors)])


def chain(future: torch.futures.Future, then: Callable[[Any], torch.futures.Future]
          ) -> torch.futures.Future:
    """A future of what then(value)'s future holds, then called with future's value as soon
    as it is done (on the thread that completes it); an exception on the way ends it."""
    out: torch.futures.Future = torch.futures.Future()

    def settle(last: torch.futures.Future) -> None:
        try:
            out.set_result(last.value())
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits
            out.set_exception(error)

    def start(first: torch.futures.Future) -> None:
        try:
            then(first.value()).add_done_callback(settle)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits
            out.set_exception(error)
    future.add_done_callback(start)
    return out
