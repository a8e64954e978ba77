import pytest
import torch

from dpcourse import accelerators, devices


def test_simulated_cpu_devices_are_distinct_and_announced(capsys):
    devs = devices(4, simulate=True)
    assert [str(d) for d in devs] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert "4 devices requested" in capsys.readouterr().out


@pytest.mark.skipif(bool(accelerators()), reason="this machine has accelerators")
def test_without_accelerators_n_devices_are_simulated_on_the_cpu(capsys):
    assert [str(d) for d in devices(3)] == ["cpu:0", "cpu:1", "cpu:2"]
    assert capsys.readouterr().out.strip() == (
        "3 devices requested, 0 GPUs: simulating 3 devices on the CPU")
    assert devices() == [torch.device("cpu")]


def test_all_real_accelerators_are_used_when_enough_exist(capsys):
    real = accelerators()
    if not real:
        pytest.skip("no accelerator here")
    assert devices(len(real)) == real and capsys.readouterr().out == ""


@pytest.mark.parametrize("n", [0, -1, 2.0])
def test_device_count_must_be_a_positive_whole_number(n):
    with pytest.raises(ValueError, match="n >= 1"):
        devices(n)


@pytest.mark.skipif(bool(accelerators()), reason="this machine has accelerators")
def test_one_device_without_accelerators_is_the_cpu_itself(capsys):
    assert devices(1) == [torch.device("cpu")] and capsys.readouterr().out == ""
    assert devices(1, simulate=True) == [torch.device("cpu", 0)]
    assert capsys.readouterr().out.strip() == (
        "1 device requested, simulation requested: simulating 1 device on the CPU")
