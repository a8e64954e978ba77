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
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpcourse import resume, train_ddp
from dpcourse.data import synthetic_fashion
from dpcourse.lenet import LeNet, init_lenet_params, lenet_layers, lenet_model

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


def test_diloco_help_says_a_checkpoint_syncs_nothing(capsys):
    with pytest.raises(SystemExit):
        train_ddp.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "sync point" not in text and "a checkpoint syncs nothing" in text


# --- dropout (--dropout P), and a resume that draws what the uninterrupted run draws ---

def test_dropout_draws_as_torchs_dropout_layers_and_keeps_lenets_keys():
    X = synthetic_fashion("train", 16).tensors[0]
    plain = lenet_layers(0)
    reference = nn.Sequential(*list(plain)[:7], nn.Dropout(0.3), plain[7], plain[8],
                              nn.Dropout(0.3), plain[9])  # torch's layers, other keys
    out = {}
    for name, model in [("torch", reference), ("layers", lenet_layers(0, dropout=0.3)),
                        ("model", lenet_model(0, dropout=0.3))]:
        torch.manual_seed(1)
        out[name] = model(X)
    assert torch.equal(out["layers"], out["torch"])
    torch.testing.assert_close(out["model"], out["torch"], rtol=1e-5, atol=1e-6)
    assert (out["torch"] - plain(X)).abs().max() > 0.1  # the masks act
    assert lenet_layers(0, dropout=0.3).state_dict().keys() == plain.state_dict().keys()
    assert lenet_model(0, dropout=0.3).state_dict().keys() == lenet_model(0).state_dict().keys()
    assert torch.equal(lenet_model(0, dropout=0.3).eval()(X), lenet_model(0)(X))


@pytest.mark.parametrize("mode", ["--scratch", "--fsdp"])
def test_a_resumed_run_with_dropout_ends_bitwise_like_the_uninterrupted_one(mode, tmp_path,
                                                                            monkeypatch):
    """A world of one (on a GPU where there is one: its generator is restored too); 3 steps,
    then resumed to 10, crossing into epoch 1."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DPCOURSE_DATA", "synthetic")
    paths = {name: str(tmp_path / f"{name}.pt") for name in ("whole", "plain", "resumed")}
    dropout = [*COMMON, mode, "--dropout", "0.5"]
    train_ddp.main([*dropout, "--steps", "10", "--checkpoint", paths["whole"]])
    train_ddp.main([*COMMON, mode, "--steps", "10", "--checkpoint", paths["plain"]])
    train_ddp.main([*dropout, "--steps", "3", "--checkpoint", paths["resumed"]])
    train_ddp.main([*dropout, "--steps", "10", "--checkpoint", paths["resumed"]])
    whole, plain, resumed = (load(paths[name]) for name in ("whole", "plain", "resumed"))
    assert whole["step"] == resumed["step"] == 10
    for key, value in whole["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    assert any(not torch.equal(plain["model"][k], v) for k, v in whole["model"].items())


def test_a_rank_saves_and_restores_its_device_generator(monkeypatch):
    """rank_state keeps the generator of the rank's device (CUDA's, ...) beside the CPU's; a
    stand-in device module holds it here."""
    class Generators:
        state = torch.tensor([7, 8, 9], dtype=torch.uint8)

        def get_rng_state(self, device):
            return self.state.clone()

        def set_rng_state(self, state, device):
            self.state = state.clone()

    cuda, device_module = torch.device("cuda", 0), Generators()
    monkeypatch.setattr(torch, "get_device_module", lambda device: device_module)
    model = nn.Linear(2, 2)
    run = train_ddp.Training(model, torch.optim.SGD(model.parameters(), lr=0.1), cuda)
    saved = train_ddp.rank_state(run)["rng"]
    assert torch.equal(saved["cpu"], torch.get_rng_state())
    device_module.state = torch.zeros(3, dtype=torch.uint8)
    resume.set_rng_state(saved, cuda)
    assert device_module.state.tolist() == [7, 8, 9]


# --- a checkpoint of an earlier train_ddp ---

def old_package(tmp_path, commit: str):
    """dpcourse as it was at commit (git archive of this repository), or skip saying why."""
    root = Path(__file__).resolve().parents[1]
    folder = tmp_path / commit
    folder.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", commit, "dpcourse"],
                             capture_output=True)
    if archive.returncode:
        pytest.skip(f"needs this repository's history (git archive {commit}): "
                    f"{archive.stderr.decode().strip()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


def test_a_checkpoint_from_before_momentum_dtype_and_global_batch_resumes(tmp_path, monkeypatch):
    """4667fef wrote format 2 without those arguments (c4a3ae0 added them, no new format):
    read as their defaults then, it resumes, and ends bitwise as a run of today's code."""
    old = old_package(tmp_path, "4667fef")
    flags = ["--train-size", "64", "--batch-size", "16", "--seed", "3"]
    path, whole = tmp_path / "old.pt", tmp_path / "whole.pt"
    env = {**os.environ, "DPCOURSE_DATA": "synthetic", "PYTHONPATH": str(old)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
        monkeypatch.delenv(name, raising=False)
    subprocess.run([sys.executable, "-m", "dpcourse.train_ddp", *flags, "--steps", "2",
                    "--checkpoint", str(path)], cwd=old, env=env, check=True, timeout=120,
                   capture_output=True)
    assert "momentum" not in load(path)["args"]
    monkeypatch.setenv("DPCOURSE_DATA", "synthetic")
    train_ddp.main([*flags, "--steps", "4", "--checkpoint", str(path)])
    train_ddp.main([*flags, "--steps", "4", "--checkpoint", str(whole)])
    resumed, uninterrupted = load(path), load(whole)
    assert resumed["step"] == uninterrupted["step"] == 4
    for key, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][key], value), key
