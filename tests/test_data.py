import socket
import struct
import time

import pytest
import torch

import dpcourse.data as data
from dpcourse import CLASSES, fashion_mnist, load_fashion_mnist, synthetic_fashion


def test_synthetic_data_is_deterministic_and_subsets_are_prefixes():
    a, b = synthetic_fashion("train", 2500), synthetic_fashion("train", 2500)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    small = synthetic_fashion("train", 1500)
    assert torch.equal(small.tensors[0], a.tensors[0][:1500])
    assert not torch.equal(synthetic_fashion("test", 1500).tensors[0], small.tensors[0])
    assert not torch.equal(synthetic_fashion("train", 1500, seed=1).tensors[0], small.tensors[0])


def test_synthetic_data_looks_like_fashion_mnist():
    images, labels = synthetic_fashion("test", 3000).tensors
    assert images.shape == (3000, 1, 28, 28) and images.dtype == torch.float32
    assert 0 <= images.min() and images.max() <= 1
    counts = torch.bincount(labels, minlength=len(CLASSES))
    assert counts.min() > 200  # all ten classes, roughly balanced
    assert len(synthetic_fashion("train")) == 60_000 and len(synthetic_fashion("test")) == 10_000


def write_idx(raw, name, array):
    dims = array.shape
    magic = 0x08 << 8 | len(dims)  # 0x08: unsigned bytes, then the number of dimensions
    with open(raw / name, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in dims))
        f.write(array.numpy().tobytes())


@pytest.fixture
def fake_fashion(tmp_path):
    """A tiny Fashion-MNIST in torchvision's raw IDX format: 12 training, 5 test images."""
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 12), ("t10k", 5)):
        write_idx(raw, f"{prefix}-images-idx3-ubyte",
                  torch.arange(n * 784, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, 28, 28))
        write_idx(raw, f"{prefix}-labels-idx1-ubyte", torch.arange(n, dtype=torch.uint8) % 10)
    return tmp_path


def test_files_on_disk_are_read_through_torchvision(fake_fashion, monkeypatch):
    monkeypatch.setattr(data, "mirror_reachable", lambda: pytest.fail("no network needed"))
    train = fashion_mnist("train", source="auto", root=fake_fashion)
    assert train.source == "Fashion-MNIST (torchvision)" and len(train) == 12
    images, labels = train.tensors
    assert images.shape == (12, 1, 28, 28)
    assert float(images[0, 0, 0, 5]) == pytest.approx(5 / 255)
    assert labels.tolist() == [i % 10 for i in range(12)]
    assert len(fashion_mnist("test", 3, source="fashion-mnist", root=fake_fashion)) == 3


def test_without_files_or_network_auto_falls_back_to_the_stand_in(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "mirror_reachable", lambda: False)
    monkeypatch.setenv("DPCOURSE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("DPCOURSE_DATA", raising=False)
    assert fashion_mnist("test", 10).source.startswith("synthetic")


def test_the_environment_variable_forces_the_stand_in(fake_fashion, monkeypatch, capsys):
    monkeypatch.setenv("DPCOURSE_DATA", "synthetic")
    monkeypatch.setenv("DPCOURSE_DATA_DIR", str(fake_fashion))
    train_iter, test_iter = load_fashion_mnist(16, train_size=40, test_size=20)
    assert "Data: synthetic Fashion-MNIST stand-in" in capsys.readouterr().out
    assert len(train_iter.dataset) == 40 and len(test_iter.dataset) == 20


def test_unknown_dataset_names_are_refused():
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        fashion_mnist("train", source="mnist")
    with pytest.raises(ValueError, match="unknown split 'val'"):
        fashion_mnist("val", source="synthetic")


def test_the_network_probe_answers_quickly_on_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert data._reachable(server.getsockname(), timeout=2)
        port = server.getsockname()[1]
    start = time.monotonic()
    assert not data._reachable(("127.0.0.1", port), timeout=2)
    assert time.monotonic() - start < 3
