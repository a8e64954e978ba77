"""Fashion-MNIST through torchvision, or an offline stand-in that dpcourse draws itself."""
from __future__ import annotations

import functools
import math
import os
import socket
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat",
           "sandal", "shirt", "sneaker", "bag", "ankle boot"]
SOURCES = ("auto", "fashion-mnist", "synthetic")
MIRROR = ("fashion-mnist.s3-website.eu-central-1.amazonaws.com", 80)
FULL_SIZE = {"train": 60_000, "test": 10_000}
BLOCK = 1_000  # synthetic images are drawn in blocks, so a subset is a prefix of the full set


class Images(TensorDataset):
    """Images (n, 1, 28, 28) in [0, 1] and labels (n,), with the name of where they came from."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, source: str) -> None:
        super().__init__(images, labels)
        self.source = source


# ---- the offline stand-in: ten garment silhouettes, randomly warped, shaded and noised ----

def _templates(size: int = 56) -> torch.Tensor:
    """One silhouette per class, drawn at size x size on [-1, 1]^2 and pooled to 28 x 28."""
    v = torch.linspace(-1, 1, size)
    y, x = torch.meshgrid(v, v, indexing="ij")  # y grows downwards

    def box(x0, x1, y0, y1):
        return (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)

    def oval(cx, cy, rx, ry):
        return ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1

    def slab(y0, y1, half_top, half_bottom, cx=0.0):  # a trapezoid, wider at the bottom
        half = half_top + (half_bottom - half_top) * (y - y0) / (y1 - y0)
        return (y >= y0) & (y <= y1) & ((x - cx).abs() <= half)

    neck = oval(0, -0.62, 0.2, 0.13)
    body = box(-0.42, 0.42, -0.62, 0.72)
    long_sleeves = (((x.abs() >= 0.47) & (x.abs() <= 0.66 + 0.1 * y) & (y <= 0.66))
                    | box(-0.7, 0.7, -0.62, -0.45))
    opening = box(-0.035, 0.035, -0.5, 0.85)
    collar = slab(-0.62, -0.3, 0.2, 0.0)
    buttons = sum(oval(0, b, 0.05, 0.05) for b in (-0.2, 0.1, 0.4)) > 0
    shapes = [
        (body | slab(-0.62, -0.25, 0.42, 0.78)) & ~neck,                       # t-shirt
        box(-0.38, 0.38, -0.85, -0.6) | slab(-0.6, 0.9, 0.38, 0.42) & ~slab(-0.45, 0.9, 0.0, 0.07),
        (body | long_sleeves) & ~neck,                                         # pullover
        slab(-0.7, 0.88, 0.22, 0.62) | box(-0.2, -0.12, -0.9, -0.7) | box(0.12, 0.2, -0.9, -0.7),
        (box(-0.44, 0.44, -0.66, 0.88) | slab(-0.66, 0.75, 0.44, 0.74)) & ~opening & ~collar,
        box(-0.85, 0.85, 0.42, 0.55) | (sum(box(-0.75 + 0.32 * i, -0.61 + 0.32 * i, 0.05, 0.42)
                                            for i in range(5)) > 0) | box(-0.8, 0.6, 0.05, 0.12),
        (body | long_sleeves) & ~collar & ~buttons & ~box(-0.42, 0.42, 0.25, 0.3),  # shirt
        (oval(0.2, 0.35, 0.65, 0.22) | box(-0.85, 0.2, 0.13, 0.5)) & ~box(-0.85, 0.85, 0.5, 1)
        | box(-0.8, 0.85, 0.42, 0.55) | box(-0.85, -0.4, -0.1, 0.5),          # sneaker
        box(-0.62, 0.62, -0.2, 0.7) | oval(0, -0.2, 0.4, 0.45) & ~oval(0, -0.2, 0.3, 0.35),
        box(0.0, 0.55, -0.75, 0.5) | oval(-0.25, 0.32, 0.55, 0.22) | box(-0.75, 0.6, 0.42, 0.58),
    ]
    hi = torch.stack([s.float() for s in shapes]).unsqueeze(1)
    return F.avg_pool2d(hi, size // 28)


def _draw_block(templates: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n images as uint8 (n, 1, 28, 28) and their labels, from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    u = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    angle = (u(n) - 0.5) * math.radians(24)
    scale = 0.85 + 0.3 * u(n, 2)
    shear = (u(n) - 0.5) * 0.3
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([
        torch.stack([cos / scale[:, 0], -sin / scale[:, 0] + shear, (u(n) - 0.5) * 0.25], 1),
        torch.stack([sin / scale[:, 1], cos / scale[:, 1], (u(n) - 0.5) * 0.25], 1)], 1)
    grid = F.affine_grid(theta, [n, 1, 28, 28], align_corners=False)
    shape = F.grid_sample(templates[labels], grid, align_corners=False)
    texture = F.interpolate(u(n, 1, 7, 7), size=28, mode="bilinear", align_corners=False)
    brightness = 0.3 + 0.7 * u(n, 1, 1, 1)
    img = shape * brightness * (0.6 + 0.8 * texture) + 0.12 * torch.randn(n, 1, 28, 28, generator=g)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8), labels


def synthetic_fashion(split: str, size: int | None = None, seed: int = 0) -> Images:
    """The offline stand-in for Fashion-MNIST: deterministic for a given split, size and seed."""
    full = FULL_SIZE[split]
    size = full if size is None else size
    if not 0 < size <= full:
        raise ValueError(f"size must be between 1 and {full} for the {split} split, got {size}")
    templates = _templates()
    salt = {"train": 1, "test": 2}[split]
    blocks = [_draw_block(templates, BLOCK, seed * 1_000_003 + salt * 100_003 + b)
              for b in range(math.ceil(size / BLOCK))]
    images = torch.cat([b[0] for b in blocks])[:size].float() / 255
    labels = torch.cat([b[1] for b in blocks])[:size]
    return Images(images, labels, f"synthetic Fashion-MNIST stand-in (offline, seed {seed})")


# ---- the real Fashion-MNIST, when it is on disk or can be downloaded ----

def data_dir() -> Path:
    """Where Fashion-MNIST is kept: $DPCOURSE_DATA_DIR, else ~/.cache/dpcourse."""
    return Path(os.environ.get("DPCOURSE_DATA_DIR", Path.home() / ".cache" / "dpcourse"))


def _reachable(address: tuple[str, int], timeout: float = 3.0) -> bool:
    """Whether a TCP connection to address opens within timeout seconds (DNS included)."""
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(address, timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


@functools.cache
def mirror_reachable() -> bool:
    """Whether Fashion-MNIST's download mirror answers; asked once per process."""
    return _reachable(MIRROR)


def _torchvision_fashion(root: Path, split: str, size: int | None, download: bool) -> Images:
    """Fashion-MNIST from torchvision's files, held in memory as one tensor."""
    from torchvision.datasets import FashionMNIST

    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)  # a download that stalls fails instead of hanging
    try:
        ds = FashionMNIST(str(root), train=split == "train", download=download)
    finally:
        socket.setdefaulttimeout(old)
    images, labels = ds.data[:size].unsqueeze(1).float() / 255, ds.targets[:size]
    return Images(images, labels, "Fashion-MNIST (torchvision)")


def _fashion_on_disk(root: Path) -> bool:
    from torchvision.datasets import FashionMNIST

    raw = root / "FashionMNIST" / "raw"
    return all((raw / Path(name).stem).exists() for name, _ in FashionMNIST.resources)


def resolve_source(source: str | None = None, root: Path | None = None) -> str:
    """What a source means here: "fashion-mnist" or "synthetic".

    source: "fashion-mnist" (torchvision), "synthetic" (offline) or "auto": the real data
    when it is on disk or its mirror answers within 3 s, else the stand-in.
    None means $DPCOURSE_DATA, or "auto" when that is unset.
    """
    source = source or os.environ.get("DPCOURSE_DATA") or "auto"
    if source not in SOURCES:
        raise ValueError(f"unknown dataset {source!r}: choose one of {', '.join(SOURCES)}")
    if source != "auto":
        return source
    on_hand = _fashion_on_disk(root or data_dir()) or mirror_reachable()
    return "fashion-mnist" if on_hand else "synthetic"


def fashion_mnist(split: str, size: int | None = None, source: str | None = None,
                  root: Path | None = None) -> Images:
    """The first size images of one split ("train" or "test") of the resolved source."""
    if split not in FULL_SIZE:
        raise ValueError(f"unknown split {split!r}: choose 'train' or 'test'")
    if resolve_source(source, root) == "synthetic":
        return synthetic_fashion(split, size)
    root = root or data_dir()
    try:
        return _torchvision_fashion(root, split, size, download=not _fashion_on_disk(root))
    except (OSError, RuntimeError) as e:
        raise RuntimeError(f"Fashion-MNIST is not in {root} and could not be downloaded ({e}); "
                           "set DPCOURSE_DATA=synthetic to use the offline stand-in") from e


def load_fashion_mnist(batch_size: int, train_size: int | None = None,
                       test_size: int | None = None, source: str | None = None,
                       seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Shuffled training and ordered test loaders; prints which data they hold."""
    source = resolve_source(source)
    train, test = fashion_mnist("train", train_size, source), fashion_mnist("test", test_size, source)
    print(f"Data: {train.source}, {len(train):,} training / {len(test):,} test images")
    shuffle = torch.Generator().manual_seed(seed)
    return (DataLoader(train, batch_size, shuffle=True, generator=shuffle),
            DataLoader(test, batch_size))
