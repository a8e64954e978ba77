"""Checkers for chapter 01's exercises (splitting the problem).

The reference values are recomputed here from the models themselves, independently of the
chapter's tables: parameter counts, the elements at a cut, and the inputs layer-wise
partitioning gathers.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..lenet import init_lenet_params
from ..resnet import resnet18
from . import answered as _answered, is_int as _is_int, is_number as _is_number

FP32 = 4  # bytes


def _valid(answer: object, whole: bool = False) -> bool:
    """Whether answer is a number (an int if whole); if not, say what to give instead."""
    if whole and not _is_int(answer):
        print(f"not quite: give an int, a whole number, not the {type(answer).__name__} "
              f"{answer!r}")
    elif not whole and not _is_number(answer):
        print(f"not quite: give a number, not the {type(answer).__name__} {answer!r}")
    return _is_int(answer) if whole else _is_number(answer)


def _close(answer: float, truth: float, rel: float = 0.005) -> bool:
    return abs(answer - truth) <= rel * truth


def _ring_bytes(k: int, elements: int) -> float:
    return 2 * (k - 1) / k * elements * FP32


def resnet_parameters() -> int:
    """The number of parameters of the course's ResNet-18."""
    return sum(p.numel() for p in resnet18().parameters())


def resnet_elements_after_stage2() -> int:
    """Elements of one example's activations after ResNet-18's second stage (resnet_block2)."""
    net = resnet18().eval()
    with torch.no_grad():
        return net[:5](torch.zeros(1, 1, 28, 28)).numel()


def resnet_gathered_elements() -> int:
    """Elements of the distinct inputs of ResNet-18's conv and dense layers, the image excluded."""
    net, image = resnet18().eval(), torch.zeros(1, 1, 28, 28)
    inputs: dict[int, torch.Tensor] = {}  # kept alive, so that no two share an id

    def record(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        inputs[id(args[0])] = args[0]

    hooks = [m.register_forward_hook(record) for m in net.modules()
             if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        net(image)
    for h in hooks:
        h.remove()
    return sum(t.numel() for t in inputs.values() if t is not image)


ADAM_FP32 = 16  # bytes of model state per parameter: weight, gradient, Adam's two moments


def resnet_parameters_after_stage2() -> int:
    """The parameters of ResNet-18 after the cut at the end of its second stage (net[5:])."""
    return sum(p.numel() for p in resnet18()[5:].parameters())


def check_model_state(answer: tuple[float, float] | None) -> None:
    """Says whether answer is (data parallelism's, network partitioning's) bytes of model
    state on the fuller of 2 devices, ResNet-18 with Adam in float32, cut after stage 2."""
    if not _answered(answer):
        return
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2
            and all(_is_number(a) for a in answer)):
        return print(f"not quite: give a pair of numbers (data parallelism, network "
                     f"partitioning), not {answer!r:.60}")
    total, after = resnet_parameters(), resnet_parameters_after_stage2()
    replicated, partitioned = total * ADAM_FP32, max(after, total - after) * ADAM_FP32
    data_parallel, cut = answer
    if _close(data_parallel, total * FP32) or _close(cut, max(after, total - after) * FP32):
        return print("not quite: that counts the weights only; with Adam each parameter also "
                     "has a gradient and two moments: 16 bytes in float32")
    if not _close(data_parallel, replicated):
        return print(f"not quite: data parallelism is off by a factor of "
                     f"{data_parallel / replicated:.3g}: every device holds a whole replica")
    if _close(cut, replicated / 2):
        return print("not quite: that assumes the cut halves the parameters; count each side's "
                     "(net[:5] and net[5:])")
    if _close(cut, (total - after) * ADAM_FP32):
        return print("not quite: that is the device with fewer parameters; the fuller one "
                     "decides whether the model fits")
    if not _close(cut, partitioned):
        return print(f"not quite: network partitioning is off by a factor of "
                     f"{cut / partitioned:.3g}: count the parameters after the cut, net[5:]")
    print(f"correct: the cut balances the arithmetic, not the parameters: the second device "
          f"keeps {after / total:.0%} of them, so partitioning saves only "
          f"{1 - partitioned / replicated:.0%} of the memory here")


def check_break_even(answer: int | None) -> None:
    """Says whether answer is the smallest batch at which ResNet-18's cut after
    resnet_block2.1 sends more bytes per device than the 2-device allreduce."""
    if not (_answered(answer) and _valid(answer, whole=True)):
        return
    allreduce = _ring_bytes(2, resnet_parameters())
    per_example = resnet_elements_after_stage2() * FP32
    truth = int(allreduce // per_example) + 1
    if answer == truth:
        print("correct")
    elif answer * per_example <= allreduce:
        print(f"not quite: at batch {answer} the cut sends {answer * per_example:,} bytes, "
              f"not more than the allreduce's {allreduce:,.0f}")
    else:
        print(f"not quite: batch {answer - 1} already sends more "
              f"({(answer - 1) * per_example:,} bytes > {allreduce:,.0f})")


def check_lenet_memory_cut(answer: int | None) -> None:
    """Says whether answer is the bytes per device per step, batch 256, when LeNet is cut
    where its parameters are most balanced (ties: the smallest activation)."""
    if not (_answered(answer) and _valid(answer)):
        return
    W1, b1, W2, b2, W3, b3, W4, b4 = init_lenet_params()
    pooled = F.avg_pool2d(F.conv2d(torch.zeros(1, 1, 28, 28), W1, b1), 2)
    after_conv2 = F.conv2d(pooled, W2, b2).numel()  # also after relu2: same split, larger
    groups = [[W1, b1], [W2, b2], [W3, b3], [W4, b4]]
    crossing = [pooled.numel(), W3.shape[0], W4.shape[0]]  # smallest entering layers 2, 3, 4
    sizes = [sum(p.numel() for p in g) for g in groups]
    cut = min(range(3), key=lambda c: max(sum(sizes[:c + 1]), sum(sizes[c + 1:])))
    truth = 256 * crossing[cut] * FP32
    if answer == truth:
        print("correct")
    elif any(_close(answer, truth / unit) for unit in (1e6, 2**20, 1e3, 2**10)):
        print("not quite: that looks like MB or kB; give the answer in bytes")
    elif answer == 256 * after_conv2 * FP32:
        print(f"not quite: a cut after conv2 or relu2 splits the parameters the same way, but "
              f"carries {after_conv2:,} elements per example; among equal splits take the "
              "smallest activation")
    else:
        print("not quite: dense1 alone holds most of the parameters, so the balanced cut "
              "is right before it; multiply batch, elements at the cut and 4 bytes")


def check_k4_costs(data_parallel: float | None, layer_wise: float | None) -> None:
    """Says whether the bytes per device of data parallelism and layer-wise partitioning for
    ResNet-18 on k = 4 devices, batch 256, are right."""
    if not (_answered(data_parallel) and _answered(layer_wise)
            and _valid(data_parallel) and _valid(layer_wise)):
        return
    truths = {"data parallelism": (data_parallel, _ring_bytes(4, resnet_parameters())),
              "layer-wise partitioning":
                  (layer_wise, 256 * _ring_bytes(4, resnet_gathered_elements()))}
    wrong = [name for name, (answer, truth) in truths.items() if not _close(answer, truth)]
    for name in wrong:
        answer, truth = truths[name]
        print(f"not quite: {name} is off by a factor of {answer / truth:.3g}; "
              "both costs carry the factor 2(k-1)/k, which is 3/2 for k = 4")
    if not wrong:
        print("correct")


def check_owner_bytes(bytes_sent: Callable[[int, float], float] | None) -> None:
    """Says whether bytes_sent(k, S) is what each device sends when device i owns and sums
    one k-th of the S gradient bytes, then sends its sum to every other device."""
    if not _answered(bytes_sent):
        return
    for k in (2, 3, 4, 8):
        for S in (1.0, 1024.0, 4e6):
            truth = (k - 1) * S / k + (k - 1) * S / k  # send k-1 slices, then k-1 copies of one
            if not _close(bytes_sent(k, S), truth, 1e-9):
                print(f"not quite: for k = {k}, S = {S:g} you give {bytes_sent(k, S):g}, "
                      f"the scheme sends {truth:g}: count the slices sent out, then the sums")
                return
    print("correct: 2(k-1)/k x S, exactly the ring's cost")


def pipeline_idle_fraction(k: int, m: int) -> float:
    """The share of k devices' time spent waiting when m micro-batches pass k equal stages,
    played step by step: stage s starts micro-batch j once stage s-1 has finished it and
    stage s has finished micro-batch j-1."""
    finish = [[0] * m for _ in range(k)]
    for s in range(k):
        for j in range(m):
            finish[s][j] = 1 + max(finish[s - 1][j] if s else 0, finish[s][j - 1] if j else 0)
    return 1 - m / finish[k - 1][m - 1]  # every device works m of the span's stage times


def check_idle_fraction(idle_fraction: Callable[[int, int], float] | None) -> None:
    """Exercise 6: idle_fraction(k, m), the pipeline's idle share, against the played schedule
    for 1 to 8 stages and 1 to 32 micro-batches."""
    if not _answered(idle_fraction):
        return
    for k in range(1, 9):
        for m in range(1, 33):
            got, truth = idle_fraction(k, m), pipeline_idle_fraction(k, m)
            if _is_number(got) and abs(got - truth) <= 1e-9:
                continue
            if _is_number(got) and m > 1 and abs(got - (k - 1) / k) <= 1e-9:
                hint = ("that holds for one micro-batch; with m of them each device works m "
                        "stage times in a span of m + k - 1")
            elif _is_number(got) and abs(got - (k - 1) / m) <= 1e-9:
                hint = ("that is the waiting over the working time; divide the waiting by the "
                        "whole span instead")
            else:
                hint = ("the last stage starts k - 1 stage times after the first, then works "
                        "m in a row; each device works m of that span")
            stages = f"{k} stage{'s' * (k != 1)}, {m} micro-batch{'es' * (m != 1)}"
            print(f"not quite: for {stages} you give {got!r}, the schedule idles {truth:.4f} of "
                  f"the time: {hint}")
            return
    print("correct: (k - 1) / (m + k - 1), GPipe's bubble: k - 1 stage times of waiting per "
          "device in a span of m + k - 1")


def check_micro_batches(answer: int | None, k: int = 4, most: float = 0.1) -> None:
    """Exercise 6: the fewest micro-batches for which k stages wait at most `most` of the time."""
    if not (_answered(answer) and _valid(answer, whole=True)):
        return
    truth = next(m for m in range(1, 10_000) if pipeline_idle_fraction(k, m) <= most + 1e-12)
    if answer == truth:
        print(f"correct: {truth} micro-batches, {pipeline_idle_fraction(k, truth):.0%} idle; "
              f"{truth - 1} would idle {pipeline_idle_fraction(k, truth - 1):.1%}")
    elif answer > truth and pipeline_idle_fraction(k, answer) <= most:
        print(f"not quite: {answer} micro-batches keep the waiting at most {most:.0%}, but "
              "fewer do too")
    else:
        print(f"not quite: with {answer} micro-batches the {k} stages wait "
              f"{pipeline_idle_fraction(k, max(answer, 1)):.1%} of the time")


def check_profile_steps(profile_steps: Callable) -> None:
    """Your profile_steps on a small network whose counts are worked out here by hand:
    a 3 x 3 convolution of 4 filters on one 8 x 8 image, a ReLU, a flatten, a dense layer."""
    g = torch.Generator().manual_seed(0)
    W1, b1 = torch.randn(4, 1, 3, 3, generator=g), torch.zeros(4)
    W2, b2 = torch.randn(4 * 6 * 6, 5, generator=g), torch.zeros(5)
    steps = [("conv", lambda h: F.conv2d(h, W1, b1), [W1, b1]), ("relu", F.relu, []),
             ("flatten", lambda h: h.reshape(h.shape[0], -1), []),
             ("dense", lambda h: h @ W2 + b2, [W2, b2])]
    rows = profile_steps(steps, torch.randn(1, 1, 8, 8, generator=g))
    columns = ("layer", "params", "out", "acts", "macs", "gather", "exchanges")
    want = [("conv", 36 + 4, 4 * 6 * 6, 144, 144 * 9, 0, 0), ("relu", 0, 144, 144, 0, 0, 0),
            ("flatten", 0, 144, 0, 0, 0, 0), ("dense", 144 * 5 + 5, 5, 5, 5 * 144, 144, 1)]
    hints = {"params": "the elements of the parameters the step uses",
             "out": "the elements of the step's output", "acts": "a reshape makes no new "
             "memory: compare untyped_storage().data_ptr() of its input and output",
             "macs": "output elements x (used[0].numel(), the weight, / output channels)",
             "gather": "the input's elements, for a step with parameters that is not the first",
             "exchanges": "1 for a step with parameters that is not the first, else 0"}
    assert isinstance(rows, list) and len(rows) == len(want), (
        f"profile_steps should return a list of one row per step ({len(want)}), got {rows!r:.80}")
    for row, values in zip(rows, want):
        assert isinstance(row, dict) and set(row) == set(columns), (
            f"each row is a dict with the keys {columns}, got {row!r:.80}")
        for column, value in zip(columns, values):
            assert row[column] == value, (f"step {values[0]}, {column}: got {row[column]}, "
                                          f"want {value} ({hints.get(column, 'the step name')})")
    print("profile_steps is right: every count of a convolution, a ReLU, a flatten and a "
          "dense layer")


def check_node_bytes(answer: tuple[float, float] | None) -> None:
    """Exercise 7: bytes that leave one node per step for ResNet-18's float32 gradients on two
    nodes of four GPUs, (hierarchical allreduce, one flat ring over the eight GPUs)."""
    if not _answered(answer):
        return
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2
            and all(_is_number(a) for a in answer)):
        print(f"not quite: give a pair of numbers (hierarchical, flat), not {answer!r}")
        return
    S = sum(p.numel() for p in resnet18().parameters()) * FP32
    per_gpu = 2 * (2 - 1) / 2 * (S / 4)  # its quarter, ring-allreduced over two nodes
    truth = (4 * per_gpu, 2 * (8 - 1) / 8 * S)  # four GPUs; the one GPU whose link leaves
    hierarchical, flat = answer
    right = [abs(a - t) <= max(1.0, 1e-6 * t) for a, t in zip(answer, truth)]
    if all(right):
        print(f"correct: {truth[0]:,.0f} bytes against {truth[1]:,.0f}")
        return
    if not right[0]:
        hint = (": that is one GPU's part; all four GPUs of the node send theirs"
                if abs(hierarchical - per_gpu) <= max(1.0, 1e-6 * per_gpu) else
                ": each GPU ring-allreduces a quarter of the gradients with one peer")
        print(f"not quite: the hierarchical scheme sends {hierarchical:,.0f} bytes{hint}")
    if not right[1]:
        print(f"not quite: in the flat ring, {flat:,.0f} bytes; only one GPU's link leaves "
              "the node, and it carries all that GPU sends in the 8-device ring")
