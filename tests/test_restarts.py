"""Training that survives: a worker killed with SIGKILL after the first checkpoint, torchrun
--max-restarts=3 restarts the workers, and the run ends with the same parameters, bitwise,
as the same command uninterrupted, in every mode train_ddp offers; a checkpoint from another
command or version, or a truncated one, is refused with an error naming the file.

Every run is LeNet with dropout 0.2 on 3 CPU processes with gloo: bitwise equality holds there
only if every random draw is restored, and if the restarted wrappers reduce in the layout the
uninterrupted ones did (with 3 ranks, another order of the sum rounds differently; 2 ranks add
a + b = b + a). Each mode is two torchrun runs, so two modes run here: torch's DDP with PowerSGD
(a bucket layout and a hook's state to restore) and DiLoCo (each rank's own parameters);
tests/test_differential.py resumes every mode from its checkpoint in process, --fsdp and
--comm-hook bf16 among its explicit examples.
"""
import os
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import workers
from dpcourse import resume, train_ddp
from dpcourse.experiments import restarts
from dpcourse.launch import RankError, launch

WORLD = 3
COMMON = ["--train-size", "768", "--batch-size", "16", "--epochs", "2", "--lr", "0.05",
          "--dropout", "0.2", "--timeout", "30", "--checkpoint-every", "10"]  # 32 steps
MODES = {"torch, powersgd": ["--torch", "--comm-hook", "powersgd"], "diloco": ["--diloco", "7"]}


def run(path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(restarts.torchrun_command(path, *COMMON, *flags, nproc=WORLD),
                          capture_output=True, text=True, timeout=240, env=restarts.environment())


@pytest.fixture(scope="module", params=list(MODES))
def runs(request, tmp_path_factory) -> dict:
    flags = MODES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    whole = run(folder / "whole.pt", *flags)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    killed = restarts.killed_run(folder / "killed.pt", *COMMON, *flags, nproc=WORLD)
    return {"mode": request.param, "whole": resume.load(folder / "whole.pt"),
            "killed": resume.load(folder / "killed.pt"),
            "code": killed["exit_code"], "output": killed["output"]}


def test_a_killed_worker_is_restarted_and_the_run_ends_like_the_uninterrupted_one(runs):
    assert runs["code"] == 0, runs["output"][-3000:]
    assert "resuming from epoch" in runs["output"], "torchrun restarted nothing"
    assert runs["killed"]["step"] == runs["whole"]["step"]
    for key, value in runs["whole"]["model"].items():
        assert torch.equal(runs["killed"]["model"][key], value), f"{runs['mode']}: {key}"


def test_every_rank_draws_its_own_dropout_masks(runs):
    states = [rank["rng"]["cpu"] for rank in runs["whole"]["ranks"]]
    assert len(states) == WORLD
    assert all(not torch.equal(a, b) for i, a in enumerate(states) for b in states[i + 1:])


def test_a_checkpoint_syncs_nothing_diloco_keeps_each_rank_own_parameters(runs):
    models = [rank["model"] for rank in runs["whole"]["ranks"]]
    if runs["mode"] != "diloco":
        assert models == [None] * WORLD  # the weights, the same on every rank, saved once
    else:  # 32 steps, a sync every 7: the last checkpoint is 4 inner steps into a round
        assert all(not torch.equal(m["params.4"], models[0]["params.4"]) for m in models[1:])


def test_a_restart_redoes_at_most_checkpoint_every_steps(runs):
    resumed = restarts.resumed_steps(runs["output"])
    assert resumed and all(step % 10 == 0 and step >= 10 for step in resumed)


@pytest.fixture
def world_of_one(monkeypatch):
    """train_ddp.main in this process, as a world of one, on the offline data."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DPCOURSE_DATA", "synthetic")


def test_a_checkpoint_of_another_command_is_refused_naming_what_differs(tmp_path, world_of_one):
    path = tmp_path / "ckpt.pt"
    small = ["--train-size", "256", "--batch-size", "16", "--checkpoint", str(path)]
    train_ddp.main([*small, "--steps", "3"])
    with pytest.raises(RuntimeError, match=f"checkpoint {path} was written by a different "
                                           "command .*batch_size 16 there, 32 here"):
        train_ddp.main([*small, "--steps", "6", "--batch-size", "32"])
    with pytest.raises(RuntimeError, match="dropout 0.0 there, 0.1 here"):
        train_ddp.main([*small, "--steps", "6", "--dropout", "0.1"])


def test_a_checkpoint_of_the_previous_format_is_refused_naming_both_formats(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"format": "dpcourse.train_ddp/1", "args": {}, "model": {}}, path)
    with pytest.raises(RuntimeError, match=f"checkpoint {path} has format dpcourse.train_ddp/1, "
                                           ".* this one reads dpcourse.train_ddp/2"):
        resume.load(path)


def test_resume_reads_every_rank_state_onto_the_cpu_not_the_rank_device(tmp_path, world_of_one,
                                                                        monkeypatch):
    """The file holds every rank's state (all k optimizer shards): read onto a rank's GPU, all
    of it would land there. "meta" stands in for that GPU: nothing may be read onto it."""
    path, read_onto = tmp_path / "ckpt.pt", []
    train_ddp.main(["--train-size", "64", "--fsdp", "--steps", "1", "--checkpoint", str(path)])
    real_load = torch.load

    def spy(*args, **kwargs):
        read_onto.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    args = train_ddp.parse_args(["--train-size", "64", "--fsdp", "--checkpoint", str(path)])
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    try:
        run = train_ddp.build_training(args, torch.device("cpu"))
        run.device = torch.device("meta")
        state = resume.load_if_found(path)
        assert train_ddp.load_training_state(path, state, args, run) == (1, 1)  # epoch, step
    finally:
        torch.distributed.destroy_process_group()
    assert read_onto == ["cpu"]


def test_a_truncated_checkpoint_gives_an_error_naming_the_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    resume.save(path, {"step": 3, "model": {"w": torch.zeros(1000)}})
    path.write_bytes(path.read_bytes()[:1500])
    with pytest.raises(RuntimeError, match=f"checkpoint {path} is truncated or corrupt"):
        resume.load(path)


def test_a_file_that_is_no_train_ddp_checkpoint_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(RuntimeError, match="was not written by python -m dpcourse.train_ddp"):
        resume.load(path)


# --- checkpoint files: concurrent writers, durable renames, one node's view ---

def test_two_writers_at_once_each_leave_a_complete_file(tmp_path):
    """Each write has a temporary file of its own (a fixed name let one writer truncate the
    other's, or rename it away first)."""
    path, values = tmp_path / "ckpt.pt", [torch.full((200_000,), float(i)) for i in range(2)]

    def write(value: torch.Tensor) -> None:
        for _ in range(15):
            resume.write_atomically(path, {"x": value})

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(write, values))  # raises what a writer raised
    saved = torch.load(path, weights_only=True)["x"]
    assert any(torch.equal(saved, value) for value in values)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left


def test_the_rename_is_flushed_to_its_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)),
                                                 real_fsync(fd)))
    resume.write_atomically(tmp_path / "ckpt.pt", {"x": torch.ones(3)})
    assert synced == [False, True]  # the file's data, then the directory holding the rename


def test_ranks_that_cannot_read_the_checkpoint_rank_0_found_all_fail_at_once_naming_it(tmp_path):
    """Two nodes without a shared filesystem (each rank's folder its own): rank 0 finds the
    checkpoint, rank 1 does not. Before, each rank decided alone: rank 0 resumed at step 2,
    rank 1 started from 0, and the ranks failed late, or waited."""
    folders = [tmp_path / f"node{r}" for r in range(2)]
    for folder in folders:
        folder.mkdir()
    argv = ["--data", "synthetic", "--train-size", "64", "--batch-size", "8", "--steps", "2",
            "--checkpoint", "ckpt.pt"]
    launch(workers.train_ddp_in_own_folder, [str(folders[0])] * 2, argv, world_size=2,
           backend="gloo", timeout=120)  # a checkpoint in node 0's folder only
    with pytest.raises(RankError, match=r"checkpoint ckpt.pt: rank 0 found it, but rank\(s\) "
                                        r"\[1\] cannot read it \(FileNotFoundError.*\): every "
                                        "node must see the same file"):
        launch(workers.train_ddp_in_own_folder, [str(f) for f in folders],
               [*argv[:-3], "4", *argv[-2:]], world_size=2, backend="gloo", timeout=60)
