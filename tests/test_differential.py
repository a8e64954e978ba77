"""Differential tests: drawn situations users create, our wrappers against torch's.

hypothesis draws a world size (1 to 4) and a few cases for one launch: a model (Linear or
Conv, with or without bias, a frozen parameter, BatchNorm buffers, seeded dropout, a layer
called twice, a layer some steps skip), per-rank batch sizes (1 included) and a sequence of
steps (zero_grad with or without set_to_none, or none; 1-3 micro-batches accumulated under
no_sync; an extra forward under no_grad or in eval mode between a forward and its backward;
a checkpoint resumed into fresh wrappers). Each rank runs every case under our wrapper and
under the reference (tests/differential_workers.py). The property: every step's gradients
and the final state agree within 1e-12 in float64 (bfloat16: chapter 10's tolerance), or
both refuse, ours saying what it does not support. Allowed differences, named where they are
allowed: ScratchDDP gives zeros to a parameter no rank used in a step, torch's DDP leaves it
None; DiLoCo averages buffers, DDP broadcasts rank 0's; DiLoCo's sync clears the gradients, so
gradients kept across steps are not drawn for it; ScratchDDP never communicates in a no_grad
forward, torch's broadcasts rank 0's buffers there after a training step, so buffers on other
ranks than 0 are not compared after one. The last test interrupts train_ddp's
own run at a drawn step and resumes it from its checkpoint: it must end bitwise as the run
uninterrupted.

CI runs a few derandomized examples per test (the same ones every run, so a failure
reproduces), and does not shrink a failure (each example is a launch). Run more with
DPCOURSE_HYPOTHESIS_EXAMPLES=N: N random examples per test, a failure shrunk and printed with
its DPCOURSE_HYPOTHESIS_SEED (set it to rerun the same examples).
"""
from __future__ import annotations

import os
import random
import tempfile
from typing import Callable

import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

import differential_workers
from dpcourse.launch import launch

CLOSE = {"rtol": 1e-12, "atol": 1e-12}  # float64: rounding only
BF16_SHARE = 2.0**-6  # chapter 10's tolerance: of the largest element of a gradient
OUR_NAMES = ("ScratchDDP", "ScratchFSDP", "DiLoCo", "not supported")


MORE = os.environ.get("DPCOURSE_HYPOTHESIS_EXAMPLES")
SEED = int(os.environ.get("DPCOURSE_HYPOTHESIS_SEED", random.randrange(2**32)))


def examples(in_ci: int) -> Callable:
    """in_ci derandomized examples, unshrunk (a launch takes seconds); or MORE random ones
    drawn from SEED, a failure shrunk to a minimal example and SEED printed with it."""
    phases = list(Phase) if MORE else [Phase.explicit, Phase.generate]
    chosen = settings(max_examples=int(MORE) if MORE else in_ci, derandomize=not MORE,
                      phases=phases, deadline=None, database=None, print_blob=True,
                      suppress_health_check=list(HealthCheck))
    return lambda test: seed(SEED)(chosen(test)) if MORE else chosen(test)


# --- what is drawn ---

MODELS = st.fixed_dictionaries({
    "conv": st.booleans(), "bias": st.booleans(), "batchnorm": st.booleans(),
    "dropout": st.sampled_from([0.0, 0.3]), "twice": st.booleans(),
    "frozen": st.none() | st.integers(0, 11)})  # which parameter, if any, is frozen


@st.composite
def steps(draw, world: int, same_skip: bool, keep: bool = True) -> list[dict]:
    """1-3 steps of 1-3 micro-batches each; a skipped layer per rank (or on all ranks);
    gradients kept from one step to the next only where keep."""
    def micro() -> dict:
        skip = draw(st.lists(st.booleans(), min_size=1 if same_skip else world,
                             max_size=1 if same_skip else world))
        return {"extra": draw(st.sampled_from([None, "no_grad", "eval"])),
                "skip": skip * world if same_skip else skip}
    zero_grads = ["none", "zeros", "keep"] if keep else ["none", "zeros"]
    return [{"zero_grad": draw(st.sampled_from(zero_grads)),
             "micro": [micro() for _ in range(draw(st.integers(1, 3)))]}
            for _ in range(draw(st.integers(1, 3)))]


@st.composite
def cases(draw, pair: str, world: int) -> dict:
    """One case of pair: the model, the batches, the steps, where to checkpoint."""
    # DiLoCo's sync clears the inner gradients (its outer step uses .grad), so they never
    # accumulate across steps as DDP's do: not drawn for it
    sequence = draw(steps(world, same_skip=pair == "fsdp", keep=pair != "diloco"))
    case = {"pair": pair, "model": draw(MODELS), "seed": draw(st.integers(0, 2**16)),
            "batches": draw(st.lists(st.integers(1, 4), min_size=world, max_size=world)),
            "steps": sequence,
            "resume_after": draw(st.none() | st.integers(0, len(sequence) - 1)),
            "unused": any(any(m["skip"]) for s in sequence for m in s["micro"])}
    if pair == "hooks":
        case.update(hook=draw(st.sampled_from(["bf16", "powersgd"])),
                    powersgd_rank=draw(st.integers(1, 3)), start_step=draw(st.integers(0, 2)))
    if pair == "fsdp":
        case["bf16"] = draw(st.booleans())
    return case


@st.composite
def launches(draw, pair: str) -> tuple[int, list[dict]]:
    """A world size and 1-6 cases, run in one launch (launching is the costly part)."""
    world = draw(st.integers(1, 4))
    return world, draw(st.lists(cases(pair, world), min_size=1, max_size=6))


def run(world: int, cases_: list[dict]) -> list[list[dict]]:
    """For each case, each rank's {"ours", "theirs"} results."""
    per_rank = launch(differential_workers.run_cases, cases_, world_size=world, backend="gloo",
                      timeout=180)
    return [list(ranks) for ranks in zip(*per_rank)]


# --- the property ---

def assert_agree(case: dict, rank: int, ours: dict, theirs: dict) -> None:
    """ours and theirs left the same gradients and state, or both refused."""
    where = f"rank {rank}, case {case}"
    if "error" in ours or "error" in theirs:
        assert "error" in ours and "error" in theirs, (
            f"only one refused: ours {ours.get('error')!r}, the reference's "
            f"{theirs.get('error')!r} ({where})")
        assert ours["error"] == theirs["error"] or any(
            name in ours["error"] for name in OUR_NAMES), (
            f"ours refused without saying what is not supported: {ours['error']!r}, "
            f"the reference's {theirs['error']!r} ({where})")
        return
    grad_tolerances = []
    if case["pair"] == "diloco":  # DiLoCo's gradients are each rank's own, DDP's averaged
        ours, theirs = {**ours, "grads": []}, {**theirs, "grads": []}
    for step, (mine, reference) in enumerate(zip(ours["grads"], theirs["grads"])):
        tolerance = {key: gradient_tolerance(case, g) for key, g in reference.items()}
        grad_tolerances.append(tolerance)
        for key, expected in reference.items():
            got = mine[key]
            if expected is None:
                # the allowed difference: a parameter that got no gradient on any rank in a
                # step keeps None under torch's DDP (find_unused_parameters=True); ScratchDDP
                # gives it zeros, which an SGD step without momentum applies as no change
                assert got is None or (case["pair"] in ("ddp", "hooks") and not got.any()), (
                    f"step {step}: {key} has no gradient in the reference, ours {got} ({where})")
                continue
            assert got is not None, f"step {step}: {key} has no gradient in ours ({where})"
            torch.testing.assert_close(got, expected, **tolerance[key],
                                       msg=lambda m: f"step {step} gradient {key}: {m} ({where})")
    buffers = set(theirs["buffers"])
    no_grad_forward = case["pair"] in ("ddp", "hooks") and any(
        m["extra"] for step in case["steps"] for m in step["micro"])
    for key, expected in theirs["state"].items():
        if case["pair"] == "diloco" and key in buffers:
            continue  # DiLoCo averages float buffers at each sync; DDP broadcasts rank 0's
        if key in buffers and no_grad_forward and rank:
            continue  # torch broadcasts rank 0's buffers in a no_grad forward, ScratchDDP not
        torch.testing.assert_close(ours["state"][key], expected,
                                   **state_tolerance(case, key, expected, grad_tolerances),
                                   msg=lambda m: f"final {key}: {m} ({where})")


def gradient_tolerance(case: dict, reference: torch.Tensor | None) -> dict:
    """1e-12 in float64; chapter 10's share of the largest element where bfloat16 rounds."""
    if reference is None or not (case.get("bf16") or case.get("hook") == "bf16"):
        return CLOSE
    return {"rtol": 0, "atol": BF16_SHARE * reference.abs().max().item()}


def state_tolerance(case: dict, key: str, expected: torch.Tensor,
                    grad_tolerances: list[dict]) -> dict:
    """1e-12 in float64; under bfloat16, what the gradients' tolerances let SGD (momentum
    0.9: at most 3 times the step in 3 steps) move apart, plus a float32 rounding."""
    if not (case.get("bf16") or case.get("hook") == "bf16"):
        return CLOSE
    if not any(key in t for t in grad_tolerances):  # a buffer or a frozen parameter
        return {"rtol": 2**-7, "atol": BF16_SHARE * expected.abs().max().item()}
    drift = sum(t[key]["atol"] for t in grad_tolerances if key in t)
    return {"rtol": 2**-20, "atol": 3 * differential_workers.LR * drift}


def check(world: int, cases_: list[dict]) -> None:
    if MORE:
        note(f"DPCOURSE_HYPOTHESIS_SEED={SEED} draws these examples again")
    for case, ranks in zip(cases_, run(world, cases_)):
        for rank, result in enumerate(ranks):
            assert_agree(case, rank, result["ours"], result["theirs"])


@examples(in_ci=3)
@given(launches("ddp"))
def test_scratch_ddp_trains_like_torch_ddp(drawn):
    check(*drawn)


@examples(in_ci=2)
@given(launches("hooks"))
def test_our_comm_hooks_do_the_same_on_scratch_ddp_and_on_torch_ddp(drawn):
    check(*drawn)


@examples(in_ci=3)
@given(launches("fsdp"))
def test_scratch_fsdp_trains_like_torch_fully_shard(drawn):
    check(*drawn)


@examples(in_ci=2)
@given(launches("diloco"))
def test_diloco_syncing_every_step_with_outer_lr_1_is_ddp(drawn):
    check(*drawn)


# --- resume: train_ddp's own checkpoint, against the same run uninterrupted ---

RESUME_MODES = [["--scratch"], ["--torch"], ["--fsdp"], ["--scratch", "--comm-hook", "bf16"],
                ["--scratch", "--comm-hook", "powersgd", "--powersgd-rank", "2"],
                ["--torch", "--comm-hook", "powersgd", "--powersgd-rank", "1"],
                ["--diloco", "2"], ["--diloco", "3", "--outer-momentum", "0"]]


@st.composite
def resumed_runs(draw) -> tuple[int, list[dict]]:
    """A world size and 1-2 runs of train_ddp, each with the step it is interrupted at."""
    world = draw(st.integers(1, 4))

    def run_() -> dict:
        steps = draw(st.integers(2, 6))
        return {"mode": draw(st.sampled_from(RESUME_MODES)),
                "dropout": draw(st.sampled_from([0.0, 0.2, 0.5])),
                "batch_size": draw(st.integers(1, 4)),
                "train_size": draw(st.integers(world, 24)), "seed": draw(st.integers(0, 99)),
                "steps": steps, "stop": draw(st.integers(1, steps - 1))}
    return world, [run_() for _ in range(draw(st.integers(1, 2)))]


def differences(ours: object, theirs: object, path: str = "") -> list[str]:
    """Where two checkpoints (nested dicts, lists, tensors) are not bitwise equal."""
    if isinstance(theirs, torch.Tensor):
        same = isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(
            ours, theirs)
        return [] if same else [path]
    if isinstance(theirs, dict) and isinstance(ours, dict):
        keys = list(theirs) + [k for k in ours if k not in theirs]
        return [d for k in keys for d in differences(ours.get(k), theirs.get(k), f"{path}/{k}")]
    if isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)):
        if len(ours) != len(theirs):
            return [path]
        return [d for i, (a, b) in enumerate(zip(ours, theirs))
                for d in differences(a, b, f"{path}/{i}")]
    return [] if ours == theirs else [path]


@examples(in_ci=2)
@given(resumed_runs())
def test_a_run_resumed_from_its_checkpoint_ends_bitwise_as_the_run_uninterrupted(drawn):
    world, runs = drawn
    if MORE:
        note(f"DPCOURSE_HYPOTHESIS_SEED={SEED} draws these examples again")
    with tempfile.TemporaryDirectory(prefix="dpcourse-resume-") as folder:
        checkpoints = launch(differential_workers.train_and_resume, runs, folder,
                             world_size=world, backend="gloo", timeout=300)[0]
    for case, pair in zip(runs, checkpoints):
        differ = differences(pair["resumed"], pair["whole"])
        assert not differ, f"resumed after step {case['stop']} differs in {differ} ({case})"
