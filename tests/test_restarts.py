"""Training that survives: a worker killed with SIGKILL after the first checkpoint, torchrun
--max-restarts=3 restarts the workers, and the run ends with the same parameters, bitwise,
as the same command uninterrupted, in every mode train_ddp offers; a checkpoint from another
command, or a truncated one, is refused with an error naming the file.

Every run is LeNet on 2 CPU processes with gloo (bitwise equality holds there: the same
operations on the same data in the same order; torch's DDP too, since 2 ranks add a + b =
b + a whatever its buckets).
"""
import subprocess
from pathlib import Path

import pytest
import torch

from dpcourse import resume
from dpcourse.experiments import restarts

COMMON = ["--train-size", "1536", "--batch-size", "16", "--epochs", "2", "--lr", "0.05",
          "--timeout", "30", "--checkpoint-every", "10"]
MODES = {"scratch": ["--scratch"], "torch": ["--torch"], "fsdp": ["--fsdp"],
         "powersgd": ["--scratch", "--comm-hook", "powersgd"], "diloco": ["--diloco", "7"]}


def run(path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(restarts.torchrun_command(path, *COMMON, *flags), capture_output=True,
                          text=True, timeout=240, env=restarts.environment())


@pytest.fixture(scope="module", params=list(MODES))
def runs(request, tmp_path_factory) -> dict:
    flags = MODES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    whole = run(folder / "whole.pt", *flags)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    killed = restarts.killed_run(folder / "killed.pt", *COMMON, *flags)
    return {"mode": request.param, "whole": resume.load(folder / "whole.pt", torch.device("cpu")),
            "killed": resume.load(folder / "killed.pt", torch.device("cpu")),
            "code": killed["exit_code"], "output": killed["output"]}


def test_a_killed_worker_is_restarted_and_the_run_ends_like_the_uninterrupted_one(runs):
    assert runs["code"] == 0, runs["output"][-3000:]
    assert "resuming from epoch" in runs["output"], "torchrun restarted nothing"
    assert runs["killed"]["step"] == runs["whole"]["step"]
    for key, value in runs["whole"]["model"].items():
        assert torch.equal(runs["killed"]["model"][key], value), f"{runs['mode']}: {key}"


def test_a_restart_redoes_at_most_checkpoint_every_steps(runs):
    resumed = [int(line.rsplit("step", 1)[1]) for line in runs["output"].splitlines()
               if "resuming from epoch" in line]
    assert resumed and all(step % 10 == 0 and step >= 10 for step in resumed)


def test_a_checkpoint_of_another_command_is_refused_naming_what_differs(tmp_path):
    path = tmp_path / "ckpt.pt"
    first = run(path, "--steps", "3")
    assert first.returncode == 0, first.stderr
    other = run(path, "--steps", "6", "--batch-size", "32")
    assert other.returncode != 0
    assert f"checkpoint {path} was written by a different command" in other.stdout + other.stderr
    assert "batch_size 16 there, 32 here" in other.stdout + other.stderr


def test_a_truncated_checkpoint_gives_an_error_naming_the_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    resume.save(path, {"step": 3, "model": {"w": torch.zeros(1000)}})
    path.write_bytes(path.read_bytes()[:1500])
    with pytest.raises(RuntimeError, match=f"checkpoint {path} is truncated or corrupt"):
        resume.load(path, torch.device("cpu"))


def test_a_file_that_is_no_train_ddp_checkpoint_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(RuntimeError, match="was not written by python -m dpcourse.train_ddp"):
        resume.load(path, torch.device("cpu"))
