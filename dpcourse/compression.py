"""Chapter 11: communicating fewer bytes - gradients cast to bfloat16, or approximated by
PowerSGD's low-rank factors with error feedback.

Each is a communication hook, ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``,
so one function registers on torch's ``DistributedDataParallel.register_comm_hook`` and on
``ScratchDDP.register_comm_hook`` alike (chapter 07's seam). PowerSGD is Vogels, Karimireddy
and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization",
NeurIPS 2019 (arXiv:1905.13727), algorithm 1 with error feedback and warm start. (No
``from __future__ import annotations``: torch's DDP checks a hook's annotations.)
"""
import torch
import torch.distributed as dist

from .comm_hooks import allreduce_hook

__all__ = ["allreduce_hook", "bf16_hook", "PowerSGDState", "powersgd_hook", "low_rank_averages",
           "summed"]


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future that already holds value."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


def bf16_hook(group: dist.ProcessGroup | None,
              bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: half the bytes of float32, 8 significant bits."""
    buffer = bucket.buffer()
    half = buffer.div(dist.get_world_size(group)).to(torch.bfloat16)
    dist.all_reduce(half, group=group)
    return _done(buffer.copy_(half))


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

    def initial_q(self, grad: torch.Tensor, rank: int) -> torch.Tensor:
        """The same random orthonormal m x rank matrix on every rank, whatever the buckets'
        layout (drawn from seed and the n x m grad's shape)."""
        n, m = grad.shape
        g = torch.Generator().manual_seed(hash((self.seed, n, m, rank)) % 2**63)
        q = torch.randn(m, rank, generator=g, dtype=torch.float64)
        return torch.linalg.qr(q).Q.to(grad)


def powersgd_hook(state: PowerSGDState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket exactly until state.start_step, then each matrix-shaped gradient
    (a conv kernel as shape[0] x the rest) as a rank-r product P Q^T: r(n + m) numbers sent
    instead of n m. Vectors (biases) are averaged uncompressed, in one allreduce."""
    world, buffer = dist.get_world_size(), bucket.buffer()
    params = bucket.parameters()
    if state.step < state.start_step:
        state.bytes_sent += buffer.nbytes
        dist.all_reduce(buffer.div_(world))
    else:
        pieces = buffer.split([p.numel() for p in params])
        vectors = [piece for p, piece in zip(params, pieces) if p.dim() <= 1]
        state.bytes_sent += sum(v.nbytes for v in vectors)
        for piece, average in zip(vectors, summed([v / world for v in vectors])):
            piece.copy_(average)
        matrices = [(p, piece.view(p.shape[0], -1))
                    for p, piece in zip(params, pieces) if p.dim() > 1]
        approxes = low_rank_averages(state, [p for p, _ in matrices], [g for _, g in matrices])
        for (_, grad), approx in zip(matrices, approxes):
            grad.copy_(approx)  # a view into the bucket's buffer
    if bucket.is_last():
        state.step += 1
    return _done(buffer)


def low_rank_averages(state: PowerSGDState, params: list[torch.Tensor],
                      grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One power iteration on each of this rank's n x m grads (plus its error): the rank-r
    approximations P Q^T of the averages over the ranks, each P orthonormal. The P's of all
    the matrices travel in one allreduce, then their Q's in another (as torch's hook does)."""
    world = dist.get_world_size()
    Ms = [g + state.errors[p] if p in state.errors else g.clone() for p, g in zip(params, grads)]
    qs = [state.qs[p] if p in state.qs else  # rank min(n, m) at most: then it is exact
          state.initial_q(g, min(state.matrix_rank, *g.shape)) for p, g in zip(params, grads)]
    ps = [torch.linalg.qr(p).Q for p in summed([M @ q for M, q in zip(Ms, qs)])]  # the sum's
    qs = summed([M.T @ p / world for M, p in zip(Ms, ps)])  # scale does not matter to QR
    approxes = []
    for param, M, p, q in zip(params, Ms, ps, qs):
        state.bytes_sent += p.nbytes + q.nbytes
        state.qs[param] = q  # warm start for the next step
        approxes.append(p @ q.T)
        if state.error_feedback:
            state.errors[param] = M - approxes[-1]  # what was not sent, added next time
    return approxes


def summed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors summed over the ranks, in one all_reduce of them all, flattened together."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
