"""The torchrun entry point: 2 processes train, checkpoint, resume, and match one process.

The reference is trained here in one process, on the global batches that the ranks' shares
add up to, rebuilt from DistributedSampler's rule: in epoch e, the permutation
randperm(n, seed + e), of which rank r takes indices[r::world]. 256 images, 32 per rank and
step, 2 ranks: 4 steps per epoch, so 3 steps then a resumed run to 5 stops mid-epoch,
resumes mid-epoch and crosses into epoch 1 (set_epoch).
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dpcourse import train_ddp
from dpcourse.data import synthetic_fashion
from dpcourse.lenet import LeNet, init_lenet_params

WORLD, SIZE, BATCH, LR, SEED = 2, 256, 32, 0.1, 0
COMMON = ["--train-size", str(SIZE), "--batch-size", str(BATCH), "--lr", str(LR),
          "--seed", str(SEED), "--epochs", "2"]
# float32 after 5 steps: the one-process reference alone moves by up to 5.7e-6 between 1 and
# 2 intra-op threads (measured here), so 2e-5 absolute; averaging wrongly (a sum, one rank's
# gradient) moves parameters by about lr * gradient, 1e-3 and more. assert_same_parameters
# prints the measured gap.
RTOL, ATOL = 1e-5, 2e-5


def torchrun(*args: str) -> str:
    """Run the entry point under torchrun with WORLD processes; its output (stdout, stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={WORLD}", "-m", "dpcourse.train_ddp", *COMMON, *args]
    env = {**os.environ, "DPCOURSE_DATA": "synthetic"}  # never wait for the network
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> dict:
    """ScratchDDP: 3 steps with a checkpoint, then a second run to 5 steps from it."""
    path = tmp_path_factory.mktemp("scratch") / "ckpt.pt"
    first = torchrun("--scratch", "--steps", "3", "--checkpoint", str(path))
    at_3 = load(path)
    second = torchrun("--scratch", "--steps", "5", "--checkpoint", str(path))
    return {"first": first, "at_3": at_3, "second": second, "at_5": load(path)}


@pytest.fixture(scope="module")
def torch_ddp(tmp_path_factory) -> dict:
    """torch's DistributedDataParallel: 5 steps in one run."""
    path = tmp_path_factory.mktemp("torch") / "ckpt.pt"
    return {"output": torchrun("--torch", "--steps", "5", "--checkpoint", str(path)),
            "at_5": load(path)}


def one_process(steps: int, world: int) -> dict:
    """LeNet trained in this process on the global batches world ranks would share."""
    data = synthetic_fashion("train", SIZE)
    model = LeNet(init_lenet_params(SEED, scale=0.1))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_epoch = SIZE // world // BATCH
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(SIZE, generator=torch.Generator().manual_seed(SEED + epoch))
        index = torch.cat([order[r::world][k * BATCH:(k + 1) * BATCH] for r in range(world)])
        X, y = data[index]
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()  # mean over the global batch
        opt.step()
    return model.state_dict()


def assert_same_parameters(state: dict, reference: dict) -> None:
    """Equal within RTOL/ATOL; prints the largest relative gap (pytest -s shows it)."""
    assert state.keys() == reference.keys()
    gap = max(((state[k] - v).abs() / v.abs().clamp_min(ATOL / RTOL)).max().item()
              for k, v in reference.items())
    print(f"largest relative gap to one process: {gap:.2e} (RTOL {RTOL:g})")
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=name)


def test_two_processes_write_a_checkpoint_that_loads_into_a_plain_lenet(scratch):
    state = scratch["at_3"]
    assert (state["step"], state["epoch"]) == (3, 0)
    assert not any(k.startswith("module.") for k in state["model"])
    LeNet(init_lenet_params()).load_state_dict(state["model"])  # strict: every key matches
    assert "Done: 3 steps" in scratch["first"] and "replicas identical" in scratch["first"]


def test_a_second_run_resumes_from_the_checkpoint(scratch):
    assert "resuming from epoch 0, step 3" in scratch["second"]
    assert "Done: 5 steps" in scratch["second"]
    assert (scratch["at_5"]["step"], scratch["at_5"]["epoch"]) == (5, 1)


def test_scratch_ddp_with_a_resume_equals_one_process_on_the_global_batches(scratch):
    assert_same_parameters(scratch["at_5"]["model"], one_process(5, WORLD))


def test_torch_ddp_equals_one_process_on_the_global_batches(torch_ddp):
    assert "Done: 5 steps" in torch_ddp["output"]
    assert_same_parameters(torch_ddp["at_5"]["model"], one_process(5, WORLD))


def test_without_torchrun_main_runs_as_a_world_of_one(tmp_path, monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DPCOURSE_DATA", "synthetic")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the reference's CPU: on a
    # GPU host the GPU's TF32 moved it 6.2e-4 (docs/gpu-runs.md)
    path = tmp_path / "ckpt.pt"
    train_ddp.main([*COMMON, "--steps", "2", "--checkpoint", str(path)])
    assert "running as a single process (world size 1)" in capsys.readouterr().out
    assert not torch.distributed.is_initialized()  # the group was destroyed
    assert_same_parameters(load(path)["model"], one_process(2, world=1))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> dict:
    """ScratchFSDP (LeNet as layers): 3 steps with a checkpoint, then a second run to 5."""
    path = tmp_path_factory.mktemp("fsdp") / "ckpt.pt"
    first = torchrun("--fsdp", "--steps", "3", "--checkpoint", str(path))
    second = torchrun("--fsdp", "--steps", "5", "--checkpoint", str(path))
    return {"first": first, "second": second, "at_5": load(path)}


def as_lenet(layers: dict) -> dict:
    """lenet_layers' state dict in LeNet's keys (its dense weights are the layers' transposed)."""
    names = ["0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias", "9.weight",
             "9.bias"]
    return {f"params.{i}": layers[name].T if name in ("7.weight", "9.weight") else layers[name]
            for i, name in enumerate(names)}


def test_fsdp_with_a_resume_equals_one_process_on_the_global_batches(fsdp):
    assert "each rank holds 1/2 of the parameters" in fsdp["first"]
    assert "resuming from epoch 0, step 3" in fsdp["second"]
    assert len(fsdp["at_5"]["ranks"]) == WORLD  # each rank's state: its optimizer shard
    assert_same_parameters(as_lenet(fsdp["at_5"]["model"]), one_process(5, WORLD))


def test_diloco_syncing_every_step_without_momentum_equals_one_process(tmp_path):
    path = tmp_path / "ckpt.pt"
    torchrun("--diloco", "1", "--outer-lr", "1", "--outer-momentum", "0", "--steps", "5",
             "--checkpoint", str(path))
    assert_same_parameters(load(path)["model"], one_process(5, WORLD))


@pytest.mark.parametrize("flags", [("--scratch", "--comm-hook", "powersgd"),
                                   ("--torch", "--comm-hook", "bf16"), ("--diloco", "3")])
def test_communicating_less_trains_and_leaves_identical_replicas(flags, tmp_path):
    path = tmp_path / "ckpt.pt"
    output = torchrun(*flags, "--steps", "5", "--checkpoint", str(path))
    assert "Done: 5 steps" in output and "replicas identical" in output
    assert load(path)["model"].keys() == one_process(0, WORLD).keys()


def test_fsdp_refuses_a_comm_hook():
    with pytest.raises(SystemExit):
        train_ddp.parse_args(["--fsdp", "--comm-hook", "bf16"])
