"""Our collectives against gloo's all_reduce, run in real processes."""
import multiprocessing as mp
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dpcourse import allreduce, ring_allreduce

TIMEOUT_S = 60


def gloo_allreduce(rank, world, port, tensor, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        dist.all_reduce(tensor)
        results.put((rank, tensor.numpy()))  # plain bytes: a tensor would be shared by a file
    finally:                                 # descriptor that dies with this process
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("collective", [allreduce, ring_allreduce])
def test_same_sums_as_gloo_all_reduce(collective):
    world, shape = 3, (1031, 3)
    inputs = [torch.randn(shape, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=gloo_allreduce, args=(r, world, port, inputs[r].clone(), results))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        gloo = dict(results.get(timeout=TIMEOUT_S) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()
    ours = [t.clone() for t in inputs]
    collective(ours)
    for r in range(world):
        torch.testing.assert_close(ours[r], torch.from_numpy(gloo[r]), rtol=1e-5, atol=1e-6)
