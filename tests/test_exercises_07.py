"""The checkers of chapter 07 say "correct" to right answers and reject known wrong ones; their
references agree with real ring runs and with a gradient computed in float64."""
import pytest
import torch

import workers
from dpcourse.exercises.ch07 import (check_broadcast, check_bucket_sizes, check_finish,
                                     check_grad_ready, check_launch, check_plain_ring,
                                     check_ring_left, check_ring_sent, check_shard_indices,
                                     check_sum_loss_factor, ring_sent_reference)
from dpcourse.exercises.yours import on_ranks
from dpcourse.launch import launch
from dpcourse.p2p import ring_chunks

RING_NUMELS = [0, 1, 2, 3, 5, 10, 1001]


def said(capsys) -> str:
    return capsys.readouterr().out


@pytest.mark.parametrize("check", [check_ring_sent, check_shard_indices, check_sum_loss_factor,
                                   check_bucket_sizes, check_ring_left])
def test_no_answer_is_not_answered_yet(capsys, check):
    check(None)
    assert said(capsys) == "not answered yet\n"


# --- exercise 1: elements each rank sends in the ring ---------------------------------------

def ring_sent(n, world, rank):
    """Exercise 1 written independently: the real chunks of tensor_split, each sent twice
    (once per half), but the rank's own chunk (reduce-scatter) and its right-hand
    neighbour's (all-gather) once."""
    chunks = [len(c) for c in torch.arange(n).tensor_split(world)]
    return 2 * n - chunks[rank] - chunks[(rank + 1) % world]


def own_chunk_every_step(n, world, rank):
    return 2 * (world - 1) * len(torch.arange(n).tensor_split(world)[rank])


def test_ring_sent_reference_equals_what_real_ring_allreduces_send():
    cases = [("ring_allreduce", n, torch.float32, False, {}) for n in RING_NUMELS]
    runs = launch(workers.p2p_cases_in_subgroups, cases, [1, 2, 3, 4], world_size=4,
                  backend="gloo", timeout=120)
    checked = 0
    for rank, records in enumerate(runs):
        for r in records:
            n, world = r["case"][1], r["world"]
            assert r["sent"] == ring_sent_reference(n, world, rank), (n, world, rank)
            checked += 1
    assert checked == len(RING_NUMELS) * (1 + 2 + 3 + 4)


def test_ring_sent_accepts_the_chunk_count_and_rejects_the_average_law(capsys):
    check_ring_sent(ring_sent)
    assert said(capsys).startswith("correct")
    check_ring_sent(lambda n, world, rank: 2 * (world - 1) * n // world)
    out = said(capsys)
    assert out.startswith("not quite: ring_sent(1, 3, 1)") and "only on average" in out
    check_ring_sent(own_chunk_every_step)
    assert "a different one each step" in said(capsys)
    check_ring_sent(lambda n, world, rank: float(ring_sent(n, world, rank)))
    assert "return an int" in said(capsys)


# --- exercise 2: DistributedSampler's indices --------------------------------------------

def shard_indices(n, world, rank, drop_last):
    """Exercise 2 written independently: pad by wrapping around, or drop the tail; deal."""
    indices = list(range(n))
    if drop_last:
        indices = indices[:n // world * world]
    while len(indices) % world:
        indices.append(indices[len(indices) - n])
    return indices[rank::world]


def pad_with_last(n, world, rank, drop_last):
    per_rank = len(shard_indices(n, world, rank, drop_last))
    return [min(i, n - 1) for i in range(rank, per_rank * world, world)]


def blocks(n, world, rank, drop_last):
    per_rank = len(shard_indices(n, world, rank, drop_last))
    return [i % n for i in range(rank * per_rank, (rank + 1) * per_rank)]


@pytest.mark.parametrize("wrong, reason", [
    (lambda n, world, rank, drop_last: list(range(rank, n, world)), "wrapping around"),
    (lambda n, world, rank, drop_last: shard_indices(n, world, rank, False), "tail is dropped"),
    (pad_with_last, "repeats indices from the start"),
    (blocks, "not in blocks"),
])
def test_shard_indices_rejects_no_padding_no_drop_wrong_padding_and_blocks(capsys, wrong, reason):
    check_shard_indices(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


def test_shard_indices_accepts_the_samplers_indices(capsys):
    check_shard_indices(shard_indices)
    assert said(capsys).startswith("correct")


# --- exercise 3: reduction="sum" under DDP -----------------------------------------------

def test_sum_loss_under_ddp_averaging_is_64_times_the_global_mean_gradient():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(256, 5, generator=g, dtype=torch.float64)
    y = torch.randn(256, generator=g, dtype=torch.float64)
    w = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)

    def grad(loss):
        return torch.autograd.grad(loss, w)[0]

    per_rank = [grad(((Xr @ w - yr) ** 2).sum()) for Xr, yr in zip(X.chunk(4), y.chunk(4))]
    ddp = sum(per_rank) / 4  # DDP averages the ranks' gradients
    global_mean = grad(((X @ w - y) ** 2).mean())
    torch.testing.assert_close(ddp / global_mean, torch.full_like(global_mean, 64.0),
                               rtol=1e-9, atol=0)


@pytest.mark.parametrize("answer", [64, 64.0, 256 / 4])
def test_sum_loss_factor_accepts_64(capsys, answer):
    check_sum_loss_factor(answer)
    assert said(capsys).startswith("correct")


@pytest.mark.parametrize("answer, reason", [
    (256, "dividing by the 4 ranks"), (4, "number of ranks"), (0.25, "does not shrink"),
    (1, "reduction='mean'"), (1 / 64, "the other way round"), (63, "64 x its mean"),
    ("64", "as a number"),
])
def test_sum_loss_factor_explains_common_wrong_answers(capsys, answer, reason):
    check_sum_loss_factor(answer)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- exercise 4: bucket sizes ----------------------------------------------------------

def bucket_sizes(numels, cap_mb, bytes_per_element=4, reverse=True, fits=lambda a, b: a <= b,
                 no_cap_at_0=False):
    """Exercise 4 written independently; the keywords make the typical mistakes."""
    cap = float("inf") if no_cap_at_0 and cap_mb == 0 else cap_mb * 2**20
    sizes, filled = [], 0
    for n in (reversed(numels) if reverse else numels):
        if not sizes or not fits(filled + n * bytes_per_element, cap):
            sizes.append(0)
            filled = 0
        sizes[-1] += n
        filled += n * bytes_per_element
    return sizes


def test_bucket_sizes_accepts_make_buckets_sizes(capsys):
    check_bucket_sizes(bucket_sizes)
    assert said(capsys).startswith("correct")


@pytest.mark.parametrize("wrong, reason", [
    (lambda numels, cap, b=4: bucket_sizes(numels, cap, b, reverse=False), "reverse registration"),
    (lambda numels, cap, b=4: bucket_sizes(numels, cap, b, no_cap_at_0=True), "cap 0 means"),
    (lambda numels, cap, b=4: bucket_sizes(numels, cap, b, fits=lambda a, c: a < c),
     "fill up to exactly the cap"),
    (lambda numels, cap, b=4: bucket_sizes(numels, cap), "float64: 8 bytes"),
    (lambda numels, cap, b=4: bucket_sizes(numels, cap, b)[:-1], "exactly one bucket"),
])
def test_bucket_sizes_explains_order_cap_0_exact_fit_dtype_and_lost_parameters(capsys, wrong,
                                                                               reason):
    check_bucket_sizes(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- exercise 5: the ring the other way -----------------------------------------------------

def test_ring_left_accepts_the_mirrored_schedule(capsys):
    check_ring_left(lambda rank, world, step: ((rank + step + 1) % world,
                                               (rank + step + 2) % world))
    assert said(capsys).startswith("correct")


@pytest.mark.parametrize("wrong, reason", [
    (ring_chunks, "which expects chunk"),  # the right-hand schedule, sent left
    (lambda rank, world, step: ((rank + step) % world, (rank + step + 1) % world),
     "does not hold the full sum of chunk"),  # sums right, but chunk r lands elsewhere
    (lambda rank, world, step: (rank, rank), "which expects chunk"),
])
def test_ring_left_says_where_a_wrong_schedule_breaks(capsys, wrong, reason):
    check_ring_left(wrong)
    out = said(capsys)
    assert out.startswith("not quite") and reason in out, out


# --- the parts a student writes: their checks run on ranks ----------------------------------

PARTS = {  # (check, name, world size): a file that imports the package's version passes
    "ring": (check_plain_ring, "plain_ring_allreduce", 3, "dpcourse.p2p"),
    "broadcast": (check_broadcast, "broadcast_parameters", 2, "dpcourse.ddp"),
    "grad_ready": (check_grad_ready, "ScratchDDP", 2, "dpcourse.ddp"),
    "launch": (check_launch, "ScratchDDP", 2, "dpcourse.ddp"),
    "finish": (check_finish, "ScratchDDP", 2, "dpcourse.ddp"),
}


@pytest.mark.parametrize("part", PARTS)
def test_each_part_check_passes_the_package_and_stops_at_a_stub(tmp_path, part):
    check, name, world, module = PARTS[part]
    right = tmp_path / "right.py"
    right.write_text(f"from {module} import {name}\n")
    said_right = on_ranks(check, right, name, world_size=world)[0]
    assert said_right.startswith(name if name != "ScratchDDP" else f"_{part}"), said_right
    stub = tmp_path / "stub.py"
    if name == "ScratchDDP":
        method = {"grad_ready": "_grad_ready", "launch": "_launch", "finish": "_finish"}[part]
        stub.write_text("from dpcourse.ddp import ScratchDDP\n\n\nclass ScratchDDP(ScratchDDP):\n"
                        f"    def {method}(self, *args):\n        raise NotImplementedError()\n")
    else:
        stub.write_text(f"def {name}(*args):\n    raise NotImplementedError()\n")
    with pytest.raises(NotImplementedError):
        on_ranks(check, stub, name, world_size=world)


INTO_CLONES = """import torch.distributed as dist


def broadcast_parameters(module):
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.detach().clone(), src=0)
"""


def test_broadcast_check_names_a_broadcast_into_a_copy(tmp_path):
    """The cause, not only the symptom ("not rank 0's")."""
    slip = tmp_path / "slip.py"
    slip.write_text(INTO_CLONES)
    with pytest.raises(AssertionError, match=r"^rank 1: layer\.weight is not rank 0's after "
                                             r"broadcast_parameters: broadcast writes rank 0's "
                                             r"values in place into the tensor it is given"):
        on_ranks(check_broadcast, slip, "broadcast_parameters", world_size=2)


def test_ring_check_refuses_a_collective(tmp_path):
    cheat = tmp_path / "cheat.py"
    cheat.write_text("import torch.distributed as dist\n\n\ndef plain_ring_allreduce(t):\n"
                     "    dist.all_reduce(t)\n    return 0\n")
    with pytest.raises(AssertionError, match="only send/recv"):
        on_ranks(check_plain_ring, cheat, "plain_ring_allreduce", world_size=3)


ADDS_EVERY_STEP = """import torch
import torch.distributed as dist
from dpcourse.p2p import ring_chunks


def plain_ring_allreduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks, sent = tensor.tensor_split(world), 0
    for step in range(2 * (world - 1)):
        out, into = ring_chunks(rank, world, step)
        landing = torch.empty_like(chunks[into])
        ops = [dist.P2POp(dist.isend, chunks[out], (rank + 1) % world),
               dist.P2POp(dist.irecv, landing, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        chunks[into].add_(landing)  # the slip: the all-gather steps add too
        sent += chunks[out].numel()
    return sent
"""


def test_ring_check_says_the_all_gather_steps_overwrite_when_every_step_adds(tmp_path):
    slip = tmp_path / "slip.py"
    slip.write_text(ADDS_EVERY_STEP)
    with pytest.raises(AssertionError, match="the all-gather steps .* must overwrite the chunk"):
        on_ranks(check_plain_ring, slip, "plain_ring_allreduce", world_size=3)


def test_finish_check_catches_an_unlaunched_unused_bucket(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text('''from dpcourse.ddp import ScratchDDP, _write_average


class ScratchDDP(ScratchDDP):
    def _finish(self):
        self.launched_in_backward = self._next
        for i, bucket in enumerate(self.buckets):
            if bucket.future is not None:
                _write_average(self._hook, i, bucket, bucket.future.wait())
            bucket.future = None
        self._syncing = False
''')
    with pytest.raises(AssertionError, match="unused head"):
        on_ranks(check_finish, lazy, "ScratchDDP")


def test_grad_ready_check_names_buckets_left_for_the_end(tmp_path):
    counts_only = tmp_path / "counts_only.py"  # counts, but launches nothing: _finish does
    counts_only.write_text('''from dpcourse.ddp import ScratchDDP


class ScratchDDP(ScratchDDP):
    def _grad_ready(self, param):
        if not self._syncing:
            return
        self._queue_finish()
        self._note_ready(param)
        self.buckets[self._where[param]].ready += 1
''')
    with pytest.raises(AssertionError, match="launched while backward ran; launch each as soon"):
        on_ranks(check_grad_ready, counts_only, "ScratchDDP")


def test_finish_check_wants_the_futures_dropped(tmp_path):
    keeps = tmp_path / "keeps.py"
    keeps.write_text('''from dpcourse.ddp import ScratchDDP, _write_average


class ScratchDDP(ScratchDDP):
    def _finish(self):
        self.launched_in_backward = self._next
        while self._next < len(self.buckets):
            self._launch(self._next)
        for i, bucket in enumerate(self.buckets):
            _write_average(self._hook, i, bucket, bucket.future.wait())
        self._syncing = False
''')
    with pytest.raises(AssertionError, match="still hold a future"):
        on_ranks(check_finish, keeps, "ScratchDDP")
