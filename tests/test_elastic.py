"""Elastic worlds: with --global-batch-size G the global batches are the same for every world
size k, so a checkpoint written by k processes resumes on k' (FSDP's momentum shards
re-divided, DDP's replicated state taken once) and the run ends as an uninterrupted one: in
float64 within 1e-12 (the ranks' sums round differently for each k; float32 drifts by far more
over many steps, so its gap is printed, not asserted). State each rank owns (PowerSGD's error
feedback, DiLoCo's parameters, dropout masks) is refused at another world size. Under
torchrun --nnodes=1:2 (and 1:3), the survivors of a node killed whole re-form a smaller world,
resume and go on, as one uninterrupted run; the node started again joins, and the world grows
back.
"""
import os
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from dpcourse import elastic, resume, train_ddp
from dpcourse.experiments import restarts
from dpcourse.experiments.nodes import ELASTIC_CONF, lose_a_node
from dpcourse.fsdp import flat_shard, padded_numel
from multinode import Cluster, environment

G = 32
# 256 images, G = 32: 8 steps per epoch; legs 2 ranks to step 5, 1 rank to 11 (into epoch 1),
# 2 ranks to 16
LEGS = [(2, 5), (1, 11), (2, 16)]
COMMON = ["--train-size", "256", "--global-batch-size", str(G), "--epochs", "2", "--lr", "0.05",
          "--momentum", "0.9", "--timeout", "60"]


def in_one_process(*argv: str) -> None:
    """train_ddp.main here, as a world of one, on the offline data."""
    alone = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    with mock.patch.dict(os.environ, {**alone, "DPCOURSE_DATA": "synthetic"}, clear=True):
        train_ddp.main(list(argv))


def torchrun(nproc: int, path: Path, *flags: str) -> str:
    """train_ddp under torchrun --standalone on nproc processes; its output."""
    done = subprocess.run(restarts.torchrun_command(path, *flags, nproc=nproc, max_restarts=0),
                          capture_output=True, text=True, timeout=240, env=environment())
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def largest_gap(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --- the same global batches for every world size ---

@pytest.mark.parametrize("n", [100, 96])
def test_every_world_size_takes_the_same_global_batches_the_tail_dropped(n):
    global_batch = 12
    samplers = {k: [elastic.GlobalBatchSampler(n, global_batch, r, k, seed=3)
                    for r in range(k)] for k in (1, 2, 3, 4)}
    for epoch in (0, 1):
        batches = {}
        for k, ranks in samplers.items():
            for sampler in ranks:
                sampler.set_epoch(epoch)
            shares = [list(sampler) for sampler in ranks]
            assert all(len(share) == n // global_batch for share in shares)
            assert all(len(b) == global_batch // k for share in shares for b in share)
            batches[k] = [sum(step, []) for step in zip(*shares)]  # rank order: the whole batch
        assert batches[1] == batches[2] == batches[3] == batches[4]
        used = sum(batches[1], [])
        assert len(set(used)) == len(used) == n // global_batch * global_batch
        if epoch == 0:
            first = batches[1]
    assert batches[1] != first  # each epoch shuffles anew


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_naming_the_allowed():
    with pytest.raises(ValueError, match=r"--global-batch-size 12 on 5 processes.*"
                                         r"allows k in \[1, 2, 3, 4, 6, 12\]"):
        elastic.GlobalBatchSampler(100, 12, 0, 5, seed=0)


def test_batch_size_and_global_batch_size_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        train_ddp.parse_args(["--batch-size", "8", "--global-batch-size", "16"])
    assert "--batch-size (per process) and --global-batch-size" in capsys.readouterr().err


# --- the optimizer state re-divided ---

@pytest.mark.parametrize("numel, before, after", [(10, 3, 2), (10, 2, 4), (7, 1, 3), (9, 4, 1)])
def test_fsdp_momentum_shards_are_re_divided_for_the_new_world(numel, before, after):
    """The whole momentum of a unit, cut into `before` padded shards, comes back cut into
    `after`: together (padding stripped) the same vector, and each shard as long as the
    parameter shards of `after` ranks, padded with zeros."""
    whole = torch.arange(1.0, numel + 1, dtype=torch.float64)
    saved = [{"state": {0: {"momentum_buffer": flat_shard(whole, r, before),
                            "step": torch.tensor(4.0)}},
              "param_groups": [{"params": [0], "lr": 0.1}]} for r in range(before)]
    shards = [elastic.redivided_optimizer(saved, [numel], r, after) for r in range(after)]
    buffers = [s["state"][0]["momentum_buffer"] for s in shards]
    assert all(len(b) == padded_numel(numel, after) // after for b in buffers)
    assert torch.equal(torch.cat(buffers)[:numel], whole)
    assert not torch.cat(buffers)[numel:].any()
    assert all(s["state"][0]["step"] == 4 and s["param_groups"] == saved[0]["param_groups"]
               for s in shards)


# --- what a checkpoint of another world size may hold ---

def as_if_written_by_two(path: Path, change_rank_1=None) -> None:
    """Rewrite path (written by one process) as two processes with the same state write it."""
    state = torch.load(path, weights_only=True)
    second = resume.to_cpu(state["ranks"][0])
    if change_rank_1:
        change_rank_1(second)
    state["ranks"].append(second)
    resume.save(path, {k: v for k, v in state.items() if k != "format"})


@pytest.mark.parametrize("flags, named", [
    (["--comm-hook", "powersgd"], "PowerSGD's error feedback"),
    (["--diloco", "2"], "DiLoCo's parameters"),
    (["--dropout", "0.1"], "dropout masks")])
def test_state_each_rank_owns_is_refused_at_another_world_size(tmp_path, flags, named):
    path, small = tmp_path / "ckpt.pt", [*COMMON, "--train-size", "64", *flags]
    in_one_process(*small, "--steps", "1", "--checkpoint", str(path))
    as_if_written_by_two(path)
    with pytest.raises(RuntimeError, match=f"checkpoint {path} was written by 2 processes and "
                                           f"holds state each of them owns: .*{named}"):
        in_one_process(*small, "--steps", "2", "--checkpoint", str(path))


def test_ddp_optimizer_state_that_differs_between_ranks_is_refused(tmp_path):
    path, small = tmp_path / "ckpt.pt", [*COMMON, "--train-size", "64"]
    in_one_process(*small, "--steps", "1", "--checkpoint", str(path))

    def nudge(rank: dict) -> None:
        rank["optimizer"]["state"][0]["momentum_buffer"] += 1e-9
    as_if_written_by_two(path, nudge)
    with pytest.raises(RuntimeError, match=r"optimizer state of rank\(s\) \[1\] differs"):
        in_one_process(*small, "--steps", "2", "--checkpoint", str(path))


def test_without_a_global_batch_size_another_world_size_is_refused(tmp_path):
    path, small = tmp_path / "ckpt.pt", ["--train-size", "64", "--batch-size", "16"]
    in_one_process(*small, "--steps", "1", "--checkpoint", str(path))
    state = torch.load(path, weights_only=True)
    state["args"]["world_size"] = 2
    resume.save(path, {k: v for k, v in state.items() if k != "format"})
    with pytest.raises(RuntimeError, match="world_size 2 there, 1 here"):
        in_one_process(*small, "--steps", "2", "--checkpoint", str(path))


# --- 2 -> 1 -> 2 processes, as one uninterrupted run ---

@pytest.fixture(scope="module", params=[("--scratch", "float64"), ("--fsdp", "float64"),
                                        ("--scratch", "float32")],
                ids=lambda param: "_".join(param).strip("-"))
def two_one_two(request, tmp_path_factory) -> dict:
    """The run on 2, then 1 (this process), then 2 processes, each leg resuming the last's
    checkpoint; and the same command uninterrupted in this process, and in float32 on 2
    processes too (chapter 05's 1-vs-k drift, for scale)."""
    mode, dtype = request.param
    folder, flags = tmp_path_factory.mktemp(mode.strip("-")), [*COMMON, mode, "--dtype", dtype]
    outputs = []
    for nproc, steps in LEGS:
        leg = [*flags, "--steps", str(steps)]
        if nproc == 1:
            in_one_process(*leg, "--checkpoint", str(folder / "legs.pt"))
        else:
            outputs.append(torchrun(nproc, folder / "legs.pt", *leg))
    in_one_process(*flags, "--checkpoint", str(folder / "whole.pt"))
    if dtype == "float32":
        torchrun(2, folder / "whole_on_2.pt", *flags)
    return {"mode": mode, "dtype": dtype, "legs": resume.load(folder / "legs.pt"),
            "whole": resume.load(folder / "whole.pt"), "last": outputs[-1],
            "whole_on_2": resume.load(folder / "whole_on_2.pt") if dtype == "float32" else None}


def test_two_one_two_processes_end_as_one_uninterrupted_run(two_one_two):
    legs, whole = two_one_two["legs"], two_one_two["whole"]
    assert legs["step"] == whole["step"] == LEGS[-1][1]
    assert len(legs["ranks"]) == 2 and "written by 1 processes" in two_one_two["last"]
    gap = largest_gap(legs["model"], whole["model"])
    drift = "" if two_one_two["whole_on_2"] is None else (
        f"; uninterrupted on 2 processes vs on 1 (chapter 05's 1-vs-k drift): "
        f"{largest_gap(two_one_two['whole_on_2']['model'], whole['model']):.2e}")
    print(f"\n{two_one_two['mode']} {two_one_two['dtype']}, {whole['step']} steps: 2 -> 1 -> 2 "
          f"processes vs uninterrupted on 1, largest parameter gap {gap:.2e}{drift}")
    if two_one_two["dtype"] == "float64":
        assert gap <= 1e-12
    assert all(t.dtype == getattr(torch, two_one_two["dtype"]) for t in legs["model"].values())


def test_fsdp_momentum_resumed_on_two_is_the_uninterrupted_one(two_one_two):
    """The momentum the last leg's 2 ranks hold, re-divided from the middle leg's one shard,
    matches the uninterrupted run's (one process: its whole momentum per unit)."""
    if two_one_two["mode"] != "--fsdp":
        pytest.skip("DDP's momentum is replicated: compared in the parameters")
    legs = [r["optimizer"]["state"] for r in two_one_two["legs"]["ranks"]]
    whole = two_one_two["whole"]["ranks"][0]["optimizer"]["state"]
    for i, state in whole.items():
        joined = torch.cat([leg[i]["momentum_buffer"] for leg in legs])
        numel = state["momentum_buffer"].numel()
        assert (joined[:numel] - state["momentum_buffer"]).abs().max() <= 1e-12
        assert not joined[numel:].any()


# --- elastic torchrun: a node lost, the world shrinks; it comes back, the world grows ---

def checkpoint_where(path: Path, condition) -> dict | None:
    """The checkpoint at path if it exists and condition holds for it."""
    if not path.exists():
        return None
    state = resume.load(path)
    return state if condition(state) else None


@pytest.mark.parametrize("nnodes", [2, 3])
def test_an_elastic_world_shrinks_when_a_node_is_lost_and_goes_on(tmp_path, nnodes):
    training = [*COMMON, "--train-size", "8192", "--epochs", "100", "--dtype", "float64",
                "--global-batch-size", str(G * 3)]  # divided by 3 nodes, then by 2
    seconds, smaller = lose_a_node(tmp_path, training, ELASTIC_CONF, False, nnodes)
    print(f"\nnode {nnodes - 1} killed: the world of {nnodes - 1} took step {smaller['step']} "
          f"{seconds:.1f} s later ({ELASTIC_CONF})")
    assert f"written by {nnodes} processes" in (tmp_path / "node0.log").read_text()  # resumed
    in_one_process(*training, "--steps", str(smaller["step"]),
                   "--checkpoint", str(tmp_path / "whole.pt"))
    assert largest_gap(smaller["model"], resume.load(tmp_path / "whole.pt")["model"]) <= 1e-12


def test_an_elastic_world_grows_back_when_the_lost_node_starts_again(tmp_path):
    """2 -> 1 -> 2 nodes in one torchrun job: node 1 killed whole, started again; its agent
    joins as a waiting node, node 0's agent restarts its worker (a membership change) and the
    world of 2 resumes the world of one's checkpoint. Each round needs a store of its own
    (share_store=False): with torch's shared store the new node waits for an address the
    survivor's agent never publishes again (torch 2.14)."""
    # into epoch 1, room for node 1 to join before the end (by step 80 to 160 here); lr 0.02, as
    # at lr 0.05 the 1 vs 2 ranks' rounding grows past 1e-12 (1.1e-12) by step 384
    path, steps = tmp_path / "ckpt.pt", 384
    training = [*COMMON, "--train-size", "8192", "--steps", str(steps), "--dtype", "float64",
                "--lr", "0.02"]
    flags = [*training, "--checkpoint", str(path), "--checkpoint-every", "10"]
    with Cluster(tmp_path, 2, 1, flags, max_restarts=3, rdzv_conf=ELASTIC_CONF, min_nodes=1,
                 share_store=False) as nodes:
        two = nodes.wait_until(lambda: checkpoint_where(path, lambda s: len(s["ranks"]) == 2),
                               120, "a checkpoint of 2 processes")
        nodes.kill_node(1)
        one = nodes.wait_until(lambda: checkpoint_where(path, lambda s: len(s["ranks"]) == 1
                                                        and s["step"] > two["step"]),
                               120, "a checkpoint of the world of one")
        nodes.restart_node(1)
        started = time.monotonic()
        grown = nodes.wait_until(lambda: checkpoint_where(path, lambda s: len(s["ranks"]) == 2
                                                          and s["step"] > one["step"]),
                                 120, "a checkpoint of the world grown back to 2")
        print(f"\nnode 1 killed at step {two['step']}, started again at step {one['step']}; "
              f"2 nodes again by step {grown['step']}, {time.monotonic() - started:.1f} s later")
        codes = nodes.wait(120)
        assert codes == [0, 0]
        assert "Detected 1 new nodes" in nodes.log(0)  # a membership change: no retry used
        assert nodes.log(0).count("written by 1 processes") == 1  # (rank 0 tells)
    final = resume.load(path)
    assert final["step"] == steps and len(final["ranks"]) == 2
    in_one_process(*training, "--checkpoint", str(tmp_path / "whole.pt"))
    gap = largest_gap(final["model"], resume.load(tmp_path / "whole.pt")["model"])
    print(f"largest parameter gap to the uninterrupted run: {gap:.2e}")
    assert gap <= 1e-12
