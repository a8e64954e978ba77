"""The course's figures: each chapter calls a `show_*` function so its cells fit on a slide.

Every show_* draws one figure, displays it (as a compact PNG) and returns None."""
from __future__ import annotations

import io
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import Image, display
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
from PIL import Image as PILImage

from .split import split_batch

# ---- chapter 00 ----

# ---- chapter 01 ----

def show_strategies() -> None:
    """Network partitioning, layer-wise partitioning and data parallelism of a four-layer
    network on two devices: what each device holds and what moves between them."""
    colors = ["#4C72B0", "#55A868", "#C44E52", "#8172B2"]  # layers 1 to 4
    xs, w, h = [0.3, 6.4], 3.3, 0.9  # left edge of each device, bar width and height
    level_y = [1.9 + 1.3 * i for i in range(4)]  # bottom of the bar at each height
    fig, axes = plt.subplots(1, 3, figsize=(10, 4))

    def bar(ax, x, level, label):
        ax.add_patch(Rectangle((x, level_y[level]), w, h, fc=colors[level], ec="black"))
        ax.text(x + w / 2, level_y[level] + h / 2, label, ha="center", va="center",
                color="white", fontsize=7)

    def arrow(ax, start, end, style="-|>", color="black"):
        ax.annotate("", xy=end, xytext=start,
                    arrowprops=dict(arrowstyle=style, color=color, lw=1.5, shrinkA=0, shrinkB=0))

    titles = ["(a) network partitioning", "(b) layer-wise partitioning", "(c) data parallelism"]
    for ax, title in zip(axes, titles):
        ax.set_xlim(0, 10), ax.set_ylim(0, 8.6), ax.axis("off")
        ax.set_title(title, fontsize=10)
        for d, x in enumerate(xs):
            ax.add_patch(FancyBboxPatch((x - 0.15, 1.0), w + 0.3, 6.5, boxstyle="round,pad=0.1",
                                        fc="#F2F2F2", ec="black", lw=1))
            ax.text(x + w / 2, 7.85, f"device {d}", ha="center", fontsize=8, weight="bold")
    a, b, c = axes
    gap_mid = (xs[0] + w + xs[1]) / 2

    # (a) layers 1-2 on device 0, layers 3-4 on device 1: the batch passes from one to the other
    for layer in range(4):
        bar(a, xs[layer // 2], layer, f"layer {layer + 1}")
    arrow(a, (xs[0] + w + 0.2, level_y[1] + h), (xs[1] - 0.2, level_y[2] + h))
    a.text(gap_mid, level_y[2] + h + 0.45, "activations", ha="center", fontsize=7)
    arrow(a, (xs[1] - 0.2, level_y[2]), (xs[0] + w + 0.2, level_y[1]), color="gray")
    a.text(gap_mid, level_y[1] - 0.6, "gradients", ha="center", fontsize=7, color="gray")
    a.text(5, 0.1, "whole batch,\ndevice 0 then device 1", ha="center", fontsize=8)

    # (b) every layer cut in two halves of its output channels
    for layer in range(4):
        for d, x in enumerate(xs):
            bar(b, x, layer, f"layer {layer + 1}\nhalf {d + 1}/2")
    for layer in range(3):
        y = level_y[layer] + h / 2
        arrow(b, (xs[0] + w + 0.2, y), (xs[1] - 0.2, y), style="<|-|>")
    b.text(5, 0.1, "whole batch on both;\nswap after every layer", ha="center", fontsize=8)

    # (c) the whole network on both devices, half of the batch each
    for layer in range(4):
        for x in xs:
            bar(c, x, layer, f"layer {layer + 1}")
    # one allreduce, after the backward pass, of the gradients of every layer
    c.add_patch(Rectangle((xs[0] + w + 0.35, level_y[0] - 0.1), xs[1] - xs[0] - w - 0.7,
                          level_y[3] + h - level_y[0] + 0.2, fc="none", ec="gray", ls="--"))
    for layer in range(4):
        y = level_y[layer] + h / 2
        arrow(c, (xs[0] + w + 0.2, y), (xs[1] - 0.2, y), style="<|-|>")
    c.text(gap_mid, level_y[3] + h + 0.3, "allreduce\nall gradients", ha="center", fontsize=7)
    for d, x in enumerate(xs):
        c.text(x + w / 2, 1.25, f"batch half {d + 1}", ha="center", fontsize=7)
    c.text(5, 0.1, "half of the batch each;\none allreduce per step", ha="center", fontsize=8)

    fig.suptitle("Three ways to split a four-layer network across 2 devices", fontsize=12)
    _show(fig)

# ---- chapter 02 ----

def show_class_samples(images: "torch.Tensor", labels: "torch.Tensor", classes: list[str],
                       source: str, per_class: int = 1) -> None:
    """per_class training images of each class, one column per class, drawn as one mosaic."""
    framed = [F.pad(images[(labels == c).nonzero().flatten()[:per_class], 0], (1, 1, 1, 1))
              for c in range(len(classes))]  # a white frame of one pixel around each image
    mosaic = torch.cat([torch.cat(list(column)) for column in framed], dim=1)
    zoom = 3  # screen pixels per image pixel, a whole number keeps the pixels sharp
    height, width = mosaic.shape
    fig, ax = plt.subplots(figsize=(width * zoom / 100, height * zoom / 100 + 0.5))
    ax.imshow(mosaic, cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks([30 * c + 14.5 for c in range(len(classes))], classes, fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks([])
    ax.set_title(f"Training images, {per_class} per class: {source}", fontsize=9)
    _show(fig)


def show_baseline(step_loss: list[float], epoch_loss: list[float], test_acc: list[float],
                  title: str) -> None:
    """Per-batch and per-epoch training loss next to the test accuracy per epoch."""
    epochs = range(1, len(epoch_loss) + 1)
    per_epoch = len(step_loss) / len(epoch_loss)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 2.8))
    ax1.plot([i / per_epoch for i in range(1, len(step_loss) + 1)], step_loss,
             color="lightsteelblue", linewidth=1, label="per batch")
    ax1.plot(epochs, epoch_loss, marker="o", label="epoch mean")
    ax1.set(xlabel="epoch", ylabel="training loss", title="Training loss")
    ax1.legend()
    ax2.plot(epochs, test_acc, marker="o", color="C2")
    ax2.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1), title="Test accuracy",
            xticks=list(epochs))
    fig.suptitle(title, fontsize=10)
    _show(fig)


def show_cpu_settings(curves: dict[tuple[float, float], list[float]], warmup: int) -> None:
    """Per-step training loss for each (init scale, lr), with ln 10 and the warm-up marked."""
    fig, ax = plt.subplots(figsize=(7.5, 3))
    for (scale, lr), values in sorted(curves.items(), key=lambda item: (-item[0][0], item[0][1])):
        ax.plot(range(1, len(values) + 1), values, linewidth=1.2, zorder=3,
                label=f"scale {scale}, lr {lr}")
    ax.axhline(math.log(10), color="gray", linestyle="--", linewidth=0.8, zorder=1,
               label="ln 10 (uniform guess)")
    ax.axvspan(0.5, warmup + 0.5, color="gray", alpha=0.15, label=f"warm-up ({warmup} steps)")
    ax.set(xlabel="SGD step (batch 256)", ylabel="training loss of the batch",
           title="The CPU run's steps with each setting (same data, same order)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    _show(fig)

# ---- chapter 03 ----

def _show(fig: Figure, colors: int = 64) -> None:
    """How every show_* ends: lay fig out, display it as a PNG with a palette of `colors`
    colours (it looks the same as plt.show()'s and takes a fraction of the bytes, which keeps
    the stored notebooks small), and close it."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    compact = io.BytesIO()
    PILImage.open(buffer).convert("RGB").quantize(colors).save(compact, format="png", optimize=True)
    display(Image(compact.getvalue()))


def show_ring_topology(k: int = 4) -> None:
    """k devices on a ring, each holding its tensor cut into k chunks; arrows i -> i+1."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    angle = [math.pi / 2 - 2 * math.pi * i / k for i in range(k)]  # clockwise from the top
    pos = [(1.6 * math.cos(a), 1.2 * math.sin(a)) for a in angle]
    w = 0.22  # width of one chunk
    for i, (x, y) in enumerate(pos):
        for c in range(k):
            ax.add_patch(Rectangle((x - k * w / 2 + c * w, y - 0.12), w, 0.24, fc=f"C{c}",
                                   ec="black", alpha=0.75))
            ax.text(x - k * w / 2 + (c + 0.5) * w, y, str(c), ha="center", va="center", fontsize=8)
        c, s = math.cos(angle[i]), math.sin(angle[i])  # label outside the ring
        if abs(c) > 0.5:
            ax.text(x + (k * w / 2 + 0.08) * (1 if c > 0 else -1), y, f"device {i}",
                    ha="left" if c > 0 else "right", va="center", fontsize=10)
        else:
            ax.text(x, y + (0.2 if s > 0 else -0.2), f"device {i}", ha="center",
                    va="bottom" if s > 0 else "top", fontsize=10)
    for i in range(k):
        (x0, y0), (x1, y1) = pos[i], pos[(i + 1) % k]
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), connectionstyle="arc3,rad=-0.25",
                                     arrowstyle="-|>", mutation_scale=18, lw=1.8, color="gray",
                                     shrinkA=28, shrinkB=28))
    ax.text(0, 0, f"every step:\ndevice i sends one chunk\nto device (i + 1) mod {k}",
            ha="center", va="center", fontsize=9)
    ax.set(xlim=(-3, 3), ylim=(-1.7, 1.7), aspect="equal",
           title=f"A ring of {k} devices, every tensor cut into {k} chunks")
    ax.axis("off")
    _show(fig)


def show_ring_steps(snapshots: list, schedule: list, k: int) -> None:
    """One k x k grid per step of a ring allreduce: rows devices, columns chunks, text and
    colour the devices whose values a chunk holds; received chunks outlined in red."""
    fig, axes = plt.subplots(2, k, figsize=(9, 4.4))
    titles = ["start"] + [f"step {n}: {phase}" for n, (phase, _) in enumerate(schedule, 1)]
    received = [[]] + [transfers for _, transfers in schedule]
    for ax, snap, title, transfers in zip(axes.flat, snapshots, titles, received):
        rows = snap.tolist()
        ax.imshow([[bin(v).count("1") for v in row] for row in rows], cmap="Blues",
                  vmin=0, vmax=k + 1)
        for i, row in enumerate(rows):
            for c, v in enumerate(row):
                who = "".join(str(d) for d in range(k) if v >> d & 1)
                ax.text(c, i, who, ha="center", va="center", fontsize=8,
                        color="white" if len(who) > k // 2 else "black")
        for _, dst, c in transfers:
            ax.add_patch(Rectangle((c - 0.5, dst - 0.5), 1, 1, fill=False, ec="red", lw=2))
        ax.set_title(title, fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in axes[:, 0]:
        ax.set_yticks(range(k), [f"device {i}" for i in range(k)], fontsize=7)
    for ax in axes[-1, :len(snapshots) - k]:
        ax.set_xticks(range(k), [str(c) for c in range(k)], fontsize=7)
        ax.set_xlabel("chunk", fontsize=8)
    for ax in axes.flat[len(snapshots):]:
        ax.axis("off")
    axes.flat[-1].text(0, 0.5, "text: devices whose values\nthe chunk holds\ncolour: how many\n"
                       "red: received in this step\n(added in reduce-scatter,\noverwritten "
                       "in all-gather)", va="center", fontsize=8)
    fig.suptitle(f"Ring allreduce on {k} devices: reduce-scatter (steps 1-{k - 1}), "
                 f"then all-gather (steps {k}-{2 * k - 2})", fontsize=10)
    _show(fig)


def show_traffic(traffic: dict[int, tuple[int, int]], n: int) -> None:
    """Elements sent by the busiest device per allreduce, counted, against the device count."""
    ks = list(traffic)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot(ks, [traffic[k][0] / n for k in ks], marker="o", lw=6, alpha=0.35, color="C0",
            label="naive: device 0 (counted)")
    ax.plot(ks, [k - 1 for k in ks], linestyle=":", marker="x", lw=2, color="black", zorder=3,
            label="tutorial's unchunked ring, every device (formula)")
    ax.plot(ks, [traffic[k][1] / n for k in ks], marker="s", color="C1",
            label="chunked ring: busiest device (counted)")
    ax.axhline(2, color="C1", linestyle="--", lw=0.8, label="chunked ring's limit 2N")
    ax.set(xlabel="devices k", ylabel="elements sent / N",
           title="Elements the busiest device sends per allreduce of N elements")
    ax.legend(loc="upper left", fontsize=8)
    _show(fig)


# ---- chapter 04 ----

def show_shards(batch_sizes: list[int], devs: list) -> None:
    """For each batch size, which range of examples split_batch gives each device."""
    fig, axes = plt.subplots(1, len(batch_sizes), figsize=(10, 3.4), sharey=True)
    for ax, n in zip(axes, batch_sizes):
        shards, _ = split_batch(torch.zeros(n, 1), torch.zeros(n), devs)
        start = 0
        for i in range(len(devs)):
            if i < len(shards):
                ax.barh(i, len(shards[i]), left=start, color=f"C{i % 10}", edgecolor="black")
                ax.text(start + len(shards[i]) / 2, i, str(len(shards[i])), ha="center",
                        va="center")
                start += len(shards[i])
            else:
                ax.text(0.3, i, "idle: no examples", va="center", color="gray")
        ax.set(xlim=(0, n), xlabel="example index in the batch", yticks=range(len(devs)),
               yticklabels=[str(d) for d in devs], title=f"batch of {n} on {len(devs)} devices")
    axes[0].set_ylabel("device")
    axes[0].invert_yaxis()  # device 0 on top (the axes share y, so once is enough)
    fig.suptitle("torch.chunk shards: ceil(n / k) examples per device until the batch runs out")
    _show(fig)


# ---- chapter 05 ----

def show_data_parallel_step(k: int = 3) -> None:
    """One step of train_batch on k devices: split, forward/backward per replica, allreduce of
    the gradients, the same sgd update on every replica."""
    fig, ax = plt.subplots(figsize=(10, 1.3 + 0.8 * k))
    y = {d: k - 1 - d for d in range(k)}  # device 0 on top
    mid = (k - 1) / 2

    def box(x: float, yc: float, text: str, color: str, h: float = 0.56) -> None:
        ax.add_patch(FancyBboxPatch((x - 0.75, yc - h / 2), 1.5, h, boxstyle="round,pad=0.02",
                                    fc=color, ec="black", lw=0.8))
        ax.text(x, yc, text, ha="center", va="center", fontsize=8)

    def arrow(x0: float, y0: float, x1: float, y1: float) -> None:
        ax.add_patch(FancyArrowPatch((x0 + 0.75, y0), (x1 - 0.75, y1), arrowstyle="-|>",
                                     mutation_scale=10, lw=1.1, color="black"))

    box(0, mid, "minibatch X, y\n(B examples)", "lightgray")
    box(6, mid, "allreduce\nevery device now holds\ng = Σ_d g_d", "khaki", h=k - 0.3)
    for d in range(k):
        box(2, y[d], f"shard X{d}, y{d}\n(about B/{k})", "lightblue")
        box(4, y[d], f"replica θ{d}: forward,\nbackward → g_{d}", "mistyrose")
        box(8, y[d], f"θ{d} -= lr · g / B", "honeydew")
        arrow(0, mid, 2, y[d])
        arrow(2, y[d], 4, y[d])
        arrow(4, y[d], 6, y[d])
        arrow(6, y[d], 8, y[d])
        ax.text(-1.0, y[d], f"device {d}", ha="right", va="center", fontsize=9)
    for x, name in [(2, "1. split_batch"), (4, "2. forward + backward"), (6, "3. allreduce"),
                    (8, "4. sgd")]:
        ax.text(x, k - 0.55, name, ha="center", va="bottom", fontsize=9, weight="bold")
    ax.set(xlim=(-1.9, 8.9), ylim=(-0.5, k - 0.05))
    ax.set_title("One data-parallel step (train_batch): every replica applies the same summed "
                 "gradient, so the replicas stay identical", fontsize=10)
    ax.axis("off")
    _show(fig)


def show_divergence(curves: dict[str, dict[str, list[float]]]) -> None:
    """Per step, the largest parameter difference from the 1-device run: k devices in each
    dtype (curves[dtype][name], from training.divergence), and a run from another seed."""
    fig, ax = plt.subplots(figsize=(10, 4.2))
    styles = {"float32": "-", "float64": "--"}
    for dtype, by_run in curves.items():
        for i, (name, diffs) in enumerate(by_run.items()):
            steps = range(1, len(diffs) + 1)
            if name.startswith("seed"):
                if dtype == "float32":
                    ax.plot(steps, diffs, color="black", lw=2, label=f"{name} (another run)")
                continue
            ax.plot(steps, [max(d, 1e-18) for d in diffs], styles[dtype], color=f"C{i}",
                    marker="o", ms=3, label=f"{name}, {dtype}")
    f32 = [v for n, v in curves["float32"].items() if not n.startswith("seed")]
    f64 = [v for n, v in curves["float64"].items() if not n.startswith("seed")]
    ax.set(yscale="log", xlabel="SGD step", ylim=(1e-18, 10),
           ylabel="largest |parameter difference|\nfrom the 1-device run")
    ax.set_title(f"k devices vs 1 device: float64 stays at most {max(map(max, f64)):.0e}, float32 "
                 f"grows from {min(v[0] for v in f32):.0e} to {max(v[-1] for v in f32):.0e}; "
                 "another seed differs by "
                 f"{min(v for n, c in curves['float32'].items() if n.startswith('seed') for v in c):.1f}",
                 fontsize=10)
    ax.legend(fontsize=8, ncol=2, loc="center right")
    _show(fig)


def show_training_runs(results: dict) -> None:
    """Training loss per step of each run (results: label -> TrainResult) and time per epoch."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, r in results.items():
        ax1.plot(range(1, len(r.step_loss) + 1), r.step_loss, lw=1, label=label)
    ax1.set(xlabel="SGD step", ylabel="training loss of the minibatch",
            title="Training loss: together at first, then apart (float32 rounding, amplified)")
    ax1.legend(fontsize=8)
    labels = [str(k) for k in results]
    ax2.bar(labels, [r.seconds_per_epoch for r in results.values()], color="C1", label="mean")
    ax2.scatter(labels, [min(r.epoch_seconds) for r in results.values()], color="black",
                zorder=3, label="fastest epoch")
    first = next(iter(results.values()))
    where = "simulated on the CPU" if first.devices[-1].startswith("cpu") else first.devices[-1]
    ax2.set(xlabel="run", ylabel="seconds per epoch", title=f"Time per epoch ({where})")
    ax2.legend(fontsize=8)
    s = first.settings
    fig.suptitle(f"LeNet, batch {s.batch_size}, lr {s.lr}, {len(first.test_acc)} epochs, "
                 f"{first.data}", fontsize=10)
    _show(fig)


# ---- chapter 06 ----

def show_data_parallel_flow(k: int = 3) -> None:
    """One step of nn.DataParallel on k devices: scatter and replicate from device 0, the
    replicas' forward, gather and loss on device 0, gradients summed back onto device 0."""
    stages = ["on device 0", "scatter +\nreplicate", "parallel_apply", "gather", "loss",
              "backward", "reduce +\noptimizer.step()"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.85 * k))
    y = {d: k - 1 - d for d in range(k)}  # device 0 on top

    def box(col: int, dev: int, text: str, color: str) -> None:
        ax.add_patch(FancyBboxPatch((col * 1.5 - 0.6, y[dev] - 0.28), 1.2, 0.56,
                                    boxstyle="round,pad=0.02", fc=color, ec="black", lw=0.8))
        ax.text(col * 1.5, y[dev], text, ha="center", va="center", fontsize=8)

    def arrow(c0: int, d0: int, c1: int, d1: int, color: str = "black", style: str = "-") -> None:
        ax.add_patch(FancyArrowPatch((c0 * 1.5 + 0.6, y[d0]), (c1 * 1.5 - 0.6, y[d1]),
                                     arrowstyle="-|>", mutation_scale=10, lw=1.1, color=color,
                                     linestyle=style))

    box(0, 0, "X (whole batch)\nθ (the module)", "lightgray")
    for d in range(k):
        box(1, d, f"X{d}, θ{d}" + (" = θ" if d == 0 else " (copy)"), "lightblue")
        box(2, d, f"ŷ{d} = f(X{d}; θ{d})", "lightblue")
        box(5, d, f"∂ℓ/∂θ{d}", "mistyrose")
        arrow(0, 0, 1, d)
        arrow(1, d, 2, d)
        arrow(2, d, 3, 0)
        arrow(4, 0, 5, d, color="tab:red", style="--")
        arrow(5, d, 6, 0, color="tab:red", style="--")
    box(3, 0, "ŷ = [ŷ0, ..., ŷ%d]" % (k - 1), "lightgray")
    box(4, 0, "ℓ(ŷ, y)", "lightgray")
    box(6, 0, "θ.grad = Σ ∂ℓ/∂θd\nθ -= lr · θ.grad", "mistyrose")
    arrow(3, 0, 4, 0)
    for col, name in enumerate(stages):
        ax.text(col * 1.5, k - 0.6, name, ha="center", va="bottom", fontsize=9, weight="bold")
    for d in range(k):
        ax.text(-0.75, y[d], f"device {d}", ha="right", va="center", fontsize=9)
    ax.set(xlim=(-1.6, 9.7), ylim=(-0.5, k - 0.05))
    ax.set_title("One step of nn.DataParallel: device 0 scatters, gathers, computes the loss "
                 "and receives every gradient (red: backward)", fontsize=10)
    ax.axis("off")
    _show(fig)


def show_device0_traffic(traffic: dict[str, dict[int, dict[str, float]]]) -> None:
    """Stacked MB through device 0 per step for each model (model -> k -> part -> bytes)."""
    fig, axes = plt.subplots(1, len(traffic), figsize=(9, 3.2))
    for ax, (model, by_k) in zip(axes, traffic.items()):
        ks = list(by_k)
        bottom = [0.0] * len(ks)
        for part in by_k[ks[0]]:
            mb = [by_k[k][part] / 1e6 for k in ks]
            ax.bar([str(k) for k in ks], mb, bottom=bottom, label=part)
            bottom = [b + m for b, m in zip(bottom, mb)]
        ax.set(title=model, xlabel="devices k", ylabel="MB through device 0 per step")
    axes[0].legend(fontsize=8)
    fig.suptitle("Counted, not measured: float32, per-device batch 256; "
                 "the same bytes on any hardware", fontsize=10)
    _show(fig)


# ---- chapter 07 ----

def show_overlap_timeline(timelines: list[dict]) -> None:
    """Per rank, the backward pass and each bucket's allreduce (from ScratchDDP.timeline(),
    in ms after backward began): buckets launched before backward ends overlap it."""
    fig, ax = plt.subplots(figsize=(9, 0.9 + 1.1 * len(timelines)))
    colors = plt.cm.tab10.colors
    for rank, t in enumerate(timelines):
        row = len(timelines) - 1 - rank
        start, end = (1e3 * s for s in t["backward"])
        ax.barh(row + 0.2, end - start, left=start, height=0.3, color="lightgray",
                edgecolor="black", label="backward" if rank == 0 else None)
        for i, launched, finished in t["buckets"]:
            ax.barh(row - 0.2, 1e3 * (finished - launched), left=1e3 * launched, height=0.3,
                    color=colors[i % 10], edgecolor="black",
                    label=f"bucket {i}: {t['numels'][i]:,} numbers" if rank == 0 else None)
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in reversed(range(len(timelines)))])
    ax.set(xlabel="ms after backward began (top bar: backward; bottom: bucket allreduces)")
    ax.set_title("ScratchDDP: each bucket's allreduce starts as soon as its gradients are "
                 "ready, while backward goes on", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _show(fig)


# ---- chapter 08 ----

def _bytes_label(nbytes: float) -> str:
    """4096 -> '4K', 25 * 2**20 -> '25M' (binary units)."""
    return f"{nbytes / 2**20:g}M" if nbytes >= 2**20 else f"{nbytes / 2**10:g}K"


def _size_ticks(ax, nbytes: list[float], spacing: float = 16) -> None:
    """Log x axis of sizes in bytes, labelled 4K, 64K, 1M, ...: the smallest size, then each
    next one at least spacing times the last labelled."""
    ax.set_xscale("log", base=2)
    ticks: list[float] = []
    for n in sorted(nbytes):
        if not ticks or n >= spacing * ticks[-1]:
            ticks.append(n)
    ax.set_xticks(ticks, [_bytes_label(n) for n in ticks], fontsize=8)
    ax.minorticks_off()  # also on a log y axis: fewer marks, a smaller figure


def show_allreduce_fit(seconds: dict[str, dict[int, float]], fits: dict, world_size: int) -> None:
    """Measured seconds per allreduce (markers) against each fitted alpha + n beta (lines), on
    log axes, with the time the memcpy bound allows (seconds["memcpy"] x 2(w-1)/w, dashed)."""
    fig, ax = plt.subplots(figsize=(4.8, 2.3))
    colors = plt.cm.tab10.colors
    for i, (name, cost) in enumerate(fits.items()):
        nbytes = [4 * n for n in seconds[name]]
        ax.plot(nbytes, [1e3 * t for t in seconds[name].values()], "o", color=colors[i],
                markersize=4)
        ax.plot(nbytes, [1e3 * cost.time(b) for b in nbytes], "-", color=colors[i], lw=1,
                label=f"{name}: {1e6 * cost.alpha:.0f} us + n / {cost.bandwidth / 1e9:.2f} GB/s")
    copies = seconds["memcpy"]
    factor = 2 * (world_size - 1) / world_size
    ax.plot([4 * n for n in copies], [1e3 * factor * t for t in copies.values()], "k--", lw=1,
            label="memcpy bound")
    ax.set_yscale("log")
    _size_ticks(ax, [4 * n for n in copies])
    ax.set(xlabel="bytes per rank (float32)", ylabel="ms per allreduce")
    ax.set_title(f"Allreduce on {world_size} processes: fastest calls (dots), fits (lines)",
                 fontsize=9)
    ax.legend(fontsize=6, loc="upper left")
    _show(fig)


def show_timing_spread(samples: dict[str, dict[int, list[float]]], names: list[str],
                       numels: list[int]) -> None:
    """Every call's time (dots, log scale) of each named allreduce at each of the numels, side
    by side; a bar marks the fastest call, the figure the fit uses."""
    fig, ax = plt.subplots(figsize=(5, 2.2))
    g = torch.Generator().manual_seed(0)  # the same horizontal jitter on every run
    colors = plt.cm.tab10.colors
    for k, name in enumerate(names):
        for i, n in enumerate(numels):
            ts = samples[name][n]
            x = i + (k - (len(names) - 1) / 2) * 0.35
            jitter = (torch.rand(len(ts), generator=g) - 0.5) * 0.2
            ax.plot([x + float(j) for j in jitter], [1e3 * t for t in ts], ".", color=colors[k],
                    label=name if i == 0 else None)
            ax.plot([x - 0.14, x + 0.14], [1e3 * min(ts)] * 2, "-", color="black",
                    label="fastest call" if (i, k) == (0, 0) else None)
    ax.set_xticks(range(len(numels)), [_bytes_label(4 * n) for n in numels], fontsize=8)
    ax.set(xlabel="bytes per rank", ylabel="ms per call", yscale="log")
    ax.minorticks_off()
    ax.set_title("Every call timed: the same allreduce at the same size", fontsize=9)
    ax.legend(fontsize=7)
    _show(fig)


def show_shm_layout(world: int = 3) -> None:
    """Chapter 08's shared buffers on world ranks: one row per rank's buffer (its header, then
    one region per rank), each region labelled with who writes it, in which phase, and who
    reads it. Only a buffer's owner writes it; everyone reads."""
    fig, ax = plt.subplots(figsize=(7.2, 0.75 * world + 0.9))
    for q in range(world):  # rank q's buffer, top to bottom
        y = world - 1 - q
        ax.add_patch(Rectangle((0, y + 0.1), 0.9, 0.8, facecolor="lightgray", edgecolor="black"))
        ax.text(0.45, y + 0.5, "header\ncounter,\nnumel, dtype", ha="center", va="center",
                fontsize=6)
        for r in range(world):
            own = r == q
            text = (f"1 copy-in: rank {q}\nwrites its slice {r}\n2 reduce: rank {r} reads"
                    if not own else f"2 reduce: rank {q} writes\nthe sum of slice {q}\n"
                    "3 gather: all read")
            ax.add_patch(Rectangle((1 + 1.6 * r, y + 0.1), 1.5, 0.8, edgecolor="black",
                                   facecolor="tab:orange" if own else "lightsteelblue"))
            ax.text(1.75 + 1.6 * r, y + 0.5, text, ha="center", va="center", fontsize=6)
        ax.text(-0.1, y + 0.5, f"buffer of\nrank {q}", ha="right", va="center", fontsize=7)
    for r in range(world):
        ax.text(1.75 + 1.6 * r, world + 0.1, f"region {r}", ha="center", fontsize=7)
    ax.set(xlim=(-1.1, 1 + 1.6 * world), ylim=(-0.1, world + 0.45))
    ax.axis("off")
    ax.set_title(f"{world} ranks: a buffer is written only by its owner, in phase 1 (blue) or 2 "
                 "(orange), and read by the others after a wait", fontsize=8)
    _show(fig)


def show_step_anatomy(anatomy: dict) -> None:
    """One ScratchDDP step (performance.step_anatomy): forward, backward, the exposed
    communication and the optimizer in a row, and each bucket's allreduce under backward."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ms = {k: 1e3 * anatomy[k] for k in ("forward_s", "backward_no_sync_s", "exposed_comm_s",
                                         "optimizer_s")}
    left = 0.0
    for key, label, color in (("forward_s", "forward", "tab:blue"),
                              ("backward_no_sync_s", "backward (computation)", "lightgray"),
                              ("exposed_comm_s", "exposed communication", "tab:red"),
                              ("optimizer_s", "optimizer", "tab:green")):
        ax.barh(1, ms[key], left=left, height=0.5, color=color, edgecolor="black", label=label)
        left += ms[key]
    for i, launched, finished in anatomy["timeline"]:
        ax.barh(0, 1e3 * (finished - launched), left=ms["forward_s"] + 1e3 * launched,
                height=0.5, color="tab:orange", edgecolor="black",
                label="bucket allreduces" if i == 0 else None)
    ax.set_yticks([0, 1], ["allreduces", "step"])
    ax.set(xlabel="ms from the start of the step (medians; allreduces of one step)")
    ax.set_title(f"One step on 2 processes, {anatomy['buckets']} bucket(s): communication "
                 "under backward is hidden, after it exposed", fontsize=10)
    ax.legend(fontsize=9, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    _show(fig)


def show_bucket_sweep(step_seconds: dict[float, float],
                      models: dict[str, dict[float, float]]) -> None:
    """Measured seconds per step against the bucket cap (MiB), next to each model's seconds
    (label -> {cap: s}, backward and communication only); the best of each marked with a star."""
    fig, ax = plt.subplots(figsize=(6.2, 2.5))
    caps = [c * 2**20 for c in step_seconds]
    for (label, values), color in zip({"measured step": step_seconds, **models}.items(),
                                      plt.cm.tab10.colors):
        ax.plot(caps, [1e3 * t for t in values.values()], "o-", color=color, label=label,
                markersize=3, lw=1)
        best = min(values, key=values.get)
        ax.plot([best * 2**20], [1e3 * values[best]], "*", color=color, markersize=13)
    _size_ticks(ax, caps, spacing=2)
    ax.set(xlabel="bucket cap (bytes)", ylabel="ms per step")
    ax.set_title("ResNet-18, ScratchDDP, 2 processes: bucket cap against step time (stars: "
                 "the best)\nmodels: backward + exposed communication, no forward or optimizer",
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # off the curves
    _show(fig)


def show_scaling(scaling: dict[str, dict[str, dict[int, float]]]) -> None:
    """Efficiency against the number of processes, for strong and weak scaling."""
    fig, ax = plt.subplots(figsize=(4.5, 2.3))
    for mode, r in scaling.items():
        ax.plot(list(r["efficiency"]), list(r["efficiency"].values()), "o-", lw=1,
                markersize=4, label=mode)
    worlds = list(next(iter(scaling.values()))["efficiency"])
    ax.axhline(1.0, color="gray", linestyle=":", label="perfect")
    ax.set(xlabel="processes", ylabel="efficiency", xticks=worlds, ylim=(0, 1.2))
    ax.set_title("LeNet, torch's DDP, one thread per process", fontsize=9)
    ax.legend(fontsize=7)
    _show(fig)


def show_lr_scaling(curves: dict[str, dict[str, list[float]]]) -> None:
    """Training loss against samples seen for each run (label -> {"samples", "loss"})."""
    fig, ax = plt.subplots(figsize=(5, 2.3))
    for label, c in curves.items():
        ax.plot(c["samples"], c["loss"], "-", lw=1, label=label)
    ax.set(xlabel="training samples seen", ylabel="training loss", yscale="log")
    ax.minorticks_off()
    ax.set_title("The same samples in batches of different sizes (LeNet)", fontsize=9)
    ax.legend(fontsize=7)
    _show(fig)


# ---- chapter 09 ----

def show_zero_memory(stages: dict[int, dict[str, dict]]) -> None:
    """Each rank's measured bytes (stacked: parameters, gradients, optimizer state) for each
    stage, one panel per world size (world -> zero_memory.measure_stages(world)); a black line
    over each stage marks the formula's total per rank."""
    parts = ("parameters", "gradients", "optimizer_state")
    colors = ("#4C72B0", "#55A868", "#C44E52")
    fig, axes = plt.subplots(1, len(stages), figsize=(10, 3.2), sharey=True)
    for ax, (world, by_stage) in zip(axes, stages.items()):
        width = 0.8 / world
        for s, (stage, r) in enumerate(by_stage.items()):
            for rank, measured in enumerate(r["measured"]):
                x, bottom = s - 0.4 + width * (rank + 0.5), 0.0
                for part, color in zip(parts, colors):
                    ax.bar(x, measured[part] / 1e6, width * 0.9, bottom=bottom, color=color,
                           label=part.replace("_", " ") if (s, rank) == (0, 0) else None)
                    bottom += measured[part] / 1e6
            ax.hlines(r["formula"]["total"] / 1e6, s - 0.45, s + 0.45, colors="black",
                      label="formula per rank" if s == 0 else None)
        ax.set_xticks(range(len(by_stage)), list(by_stage))
        ax.set_title(f"{world} process{'es' if world > 1 else ''}: one bar per rank", fontsize=10)
    axes[0].set_ylabel("MB on the rank (LeNet, float32)")
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _show(fig)


# ---- chapter 10 ----

def show_fsdp_timeline(timelines: dict[str, list]) -> None:
    """One panel per case (fsdp_demos.fsdp_timelines(...): name -> events): each unit's forward and
    backward on the compute lane (a black bar: waiting for a gather), its all-gathers and
    reduce-scatters on the communication lane, in ms after the step began."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 0.5 + 1.3 * len(timelines)),
                             sharex=True, squeeze=False)
    units = sorted({unit for events in timelines.values() for _, unit, _, _ in events})
    colors = {unit: plt.cm.tab10.colors[i % 10] for i, unit in enumerate(units)}
    lanes = {"forward": 1, "backward": 1, "wait": 1, "all-gather": 0, "reduce-scatter": 0}
    for ax, (name, events) in zip(axes[:, 0], timelines.items()):
        for kind, unit, start, end in events:
            style = ({"color": "black"} if kind == "wait" else
                     {"color": colors[unit], "hatch": "//" if kind == "reduce-scatter" else
                      "..." if kind == "backward" else None, "edgecolor": "black"})
            ax.barh(lanes[kind], 1e3 * (end - start), left=1e3 * start, height=0.6, **style)
        ax.set_yticks([0, 1], ["communication", "compute"], fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
    handles = [Rectangle((0, 0), 1, 1, color=colors[u], label=f"unit {u}") for u in units]
    handles += [Rectangle((0, 0), 1, 1, color="black", label="waiting for a gather"),
                Rectangle((0, 0), 1, 1, fill=False, hatch="...", label="backward"),
                Rectangle((0, 0), 1, 1, fill=False, hatch="//", label="reduce-scatter")]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1, 0].set_xlabel("ms after the step began (plain bars: forward, all-gather)")
    _show(fig)


def show_sharding_memory(sharding: dict[int, dict[str, dict]]) -> None:
    """For each way, the largest rank's bytes between steps and at the peak of forward and
    backward (bars), and the formulas' (black marks), one panel per world size (world ->
    fsdp_demos.measure_sharding(world))."""
    fig, axes = plt.subplots(1, len(sharding), figsize=(10, 3.2), sharey=True, squeeze=False)
    for ax, (world, ways) in zip(axes[0], sharding.items()):
        for i, (way, r) in enumerate(ways.items()):
            between = max(b["total"] for b in r["between_steps"]) / 1e6
            for dx, value, formula, color, label in (
                    (-0.2, between, r["formula"]["total"], "#4C72B0", "between steps"),
                    (0.2, max(r["peak"]) / 1e6, r["formula_peak"], "#C44E52", "peak")):
                ax.bar(i + dx, value, 0.38, color=color, label=label if i == 0 else None)
                ax.hlines(formula / 1e6, i + dx - 0.19, i + dx + 0.19, colors="black",
                          label="formula" if (i, dx) == (0, 0.2) else None)
        ax.set_xticks(range(len(ways)), list(ways), fontsize=8)
        ax.set_title(f"{world} processes: the largest rank", fontsize=10)
    axes[0, 0].set_ylabel("MB on the rank (float32 AdamW)")
    axes[0, -1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _show(fig)


def show_largest_model(device_bytes: float = 80e9, worlds: tuple[int, ...] = (8, 64, 1024)) -> None:
    """The most parameters whose model states (mixed-precision Adam, 16 bytes a parameter)
    fit a device of device_bytes, for DDP and ZeRO-1/2/3 at each world size (log scale)."""
    from .memory import STAGES, largest_model

    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    width = 0.8 / len(worlds)
    for j, world in enumerate(worlds):
        sizes = [largest_model(device_bytes, world, stage) for stage in STAGES]
        x = [i - 0.4 + width * (j + 0.5) for i in range(len(STAGES))]
        ax.bar(x, sizes, width * 0.9, color=plt.cm.viridis(j / len(worlds)), label=f"k = {world}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(STAGES)), list(STAGES))
    ax.set_ylabel("parameters")
    ax.set_title(f"The largest model whose states fit {device_bytes / 1e9:g} GB per device",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    _show(fig)


# ---- chapter 11 ----

def show_rank_error(errors: dict) -> None:
    """The relative error of a gradient's rank-r approximation against r, log-log: one power
    iteration from a random Q, and the best (the SVD's; comm_demos.approximation_error)."""
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    floor = 1e-8  # an exact approximation drawn at the bottom of the log scale
    for key, label, style in (("power_iteration", "one power iteration", "o-"),
                              ("best", "best rank r (SVD)", "s--")):
        ax.plot(errors["ranks"], [max(e, floor) for e in errors[key]], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(errors["ranks"], [str(r) for r in errors["ranks"]])
    ax.set_xlabel("rank r")
    ax.set_ylabel("||M - M_r|| / ||M||")
    n, m = errors["shape"]
    ax.set_title(f"LeNet's {n} x {m} gradient, approximated at rank r", fontsize=10)
    ax.legend(fontsize=8)
    _show(fig)


def show_bytes_against_loss(results: dict) -> None:
    """Each method's final test loss against the bytes it sent per rank (log x; left) and its
    loss curves, smoothed (right): comm_demos.one_task's results."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, (method, r) in enumerate(results.items()):
        color = plt.cm.tab10.colors[i % 10]
        left.scatter(r["bytes_sent_per_rank"], r["final_loss"], color=color, label=method)
        left.annotate(method, (r["bytes_sent_per_rank"], r["final_loss"]), fontsize=7,
                      xytext=(4, 3), textcoords="offset points")
        curve = torch.tensor(r["loss_curve"])
        window = min(8, len(curve))
        smooth = curve.unfold(0, window, 1).mean(1)
        right.plot(range(window, len(curve) + 1), smooth, color=color, label=method)
    left.set_xscale("log")
    left.xaxis.set_minor_formatter(plt.NullFormatter())
    left.set_xlabel("bytes sent per rank over the run")
    left.set_ylabel("final test loss")
    right.set_xlabel("step")
    right.set_ylabel("training loss (rank 0, mean of 8)")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("The same task and steps: bytes against loss", fontsize=10)
    _show(fig)


def show_comm_model(model: dict) -> None:
    """The share of a DDP step spent communicating across two machines, per link, for each
    model (comm_demos.ddp_across_two_machines)."""
    fig, ax = plt.subplots(figsize=(6.4, 2.6))
    width = 0.8 / len(model)
    for j, (name, links) in enumerate(model.items()):
        x = [i - 0.4 + width * (j + 0.5) for i in range(len(links))]
        shares = [100 * r["comm_share"] for r in links.values()]
        ax.bar(x, shares, width * 0.9, label=name)
        for xi, s in zip(x, shares):
            ax.text(xi, s + 1, f"{s:.0f}%", ha="center", fontsize=7)
    ax.set_xticks(range(len(links)), [f"{g:g} Gbit/s" for g in links])
    ax.set_ylim(0, 110)
    ax.set_ylabel("% of the step communicating")
    ax.set_title("One DDP step across two machines (alpha-beta model, no overlap)",
                 fontsize=10)
    ax.legend(fontsize=8)
    _show(fig)


# ---- chapter 12 ----

def show_elastic_run(events: list[tuple[float, int, str]], seen: dict[int, tuple],
                     uninterrupted: list[float], losses: dict[int, float]) -> None:
    """Left: a timeline per node, each event (seconds, node, what) marked and each checkpoint
    seen (step: seconds, world size, ...) on the nodes of its world. Right: the uninterrupted run's
    loss per step, and the loss at each checkpoint of the elastic run, coloured by world size."""
    fig, (timeline, curve) = plt.subplots(1, 2, figsize=(9, 2.8), width_ratios=[1.3, 1])
    for i, (seconds, node, what) in enumerate(events):  # labels staggered: events come close
        timeline.plot(seconds, node, "kv", ms=6)
        timeline.annotate(what, (seconds, node), xytext=(2, 7 if node else -11 - 8 * (i % 4)),
                          textcoords="offset points", fontsize=6)
    for step, (seconds, world, *_) in seen.items():
        for node in range(world):
            timeline.plot(seconds, node, "o", color=f"C{world - 1}", ms=4)
    timeline.set(xlabel="seconds since the start", yticks=[0, 1],
                 yticklabels=["node 0", "node 1"], ylim=(-1.0, 1.5))
    timeline.set_title("Events, and checkpoints written (colour: world size)", fontsize=9)
    curve.plot(range(len(uninterrupted)), uninterrupted, "-", color="0.6", lw=1,
               label="uninterrupted, 1 process")
    for world in sorted({v[1] for v in seen.values()}):
        steps = [s for s, v in seen.items() if v[1] == world and s in losses]
        curve.plot(steps, [losses[s] for s in steps], "o", color=f"C{world - 1}", ms=5,
                   label=f"elastic run, {world} node{'s' if world > 1 else ''}")
    curve.set(xlabel="step", ylabel="loss of the next global batch")
    curve.set_title("2 -> 1 -> 2 nodes over the uninterrupted run", fontsize=9)
    curve.legend(fontsize=7)
    _show(fig)


# ---- chapter 13 ----

SIGNAL_MARKS = {"SIGKILL": ("X", "killed"), "exited -9": ("X", "killed"),
                "SIGSTOP": ("v", "stopped"), "stopped": ("v", "stopped"),
                "SIGCONT": ("^", "continued"), "started": (">", "started")}


def show_ft_timeline(events: list[dict], signals: list[tuple[float, str, str]],
                     uninterrupted: list[float]) -> None:
    """Left: a timeline per replica (ft_runs' events): each committed step a dot coloured by
    its quorum id, each aborted attempt a red x, each recovery a star, and what Replicas
    noted in signals (kills, stops, continues, starts). Right: the loss of each committed
    step over the uninterrupted run's, coloured by the number of members."""
    fig, (timeline, curve) = plt.subplots(1, 2, figsize=(9, 2.8), width_ratios=[1.4, 1])
    names = sorted({e["name"] for e in events})
    row, start = {name: i for i, name in enumerate(names)}, min(t for t, _, _ in signals)
    for e in events:
        x, y = e["time"] - start, row[e["name"]]
        if e.get("decision") == "commit":
            timeline.plot(x, y, ".", color=f"C{e['qid'] % 10}", ms=3)
        elif e.get("decision") == "abort":
            timeline.plot(x, y, "x", color="red", ms=6)
        elif e["event"] == "heal":
            timeline.plot(x, y, "*", color="green", ms=9)
    first_start = {}
    for t, name, what in signals:
        own_start = what == "started" and first_start.setdefault(name, t) == t
        if own_start or what not in SIGNAL_MARKS:
            continue  # the run's own start, or an end
        mark, label = SIGNAL_MARKS[what]
        below = label in ("started", "continued")  # a kill and its restart come together
        timeline.plot(t - start, row[name], mark, color="black", ms=6)
        timeline.annotate(label, (t - start, row[name]), xytext=(-8, -12 if below else 6),
                          textcoords="offset points", fontsize=6)
    timeline.set(xlabel="seconds since the start", yticks=range(len(names)), yticklabels=names,
                 ylim=(-0.7, len(names) - 0.3))
    timeline.set_title("Commits (colour: quorum id), aborts (x), recoveries (*)", fontsize=9)
    curve.plot(range(len(uninterrupted)), uninterrupted, "-", color="0.6", lw=1,
               label="uninterrupted, 1 process")
    losses = {e["step"]: (e["loss"], e["size"]) for e in events if e.get("decision") == "commit"}
    for size in sorted({q for _, q in losses.values()}):
        steps = [s for s, (_, q) in losses.items() if q == size]
        curve.plot(steps, [losses[s][0] for s in steps], "o", ms=3, color=f"C{size}",
                   label=f"{size} member{'s' if size > 1 else ''}")
    curve.set(xlabel="step", ylabel="loss of the global batch")
    curve.set_title("Each committed step over the uninterrupted run", fontsize=9)
    curve.legend(fontsize=7)
    _show(fig)
