"""Benchmark: `python -m dpcourse.bench [--quick] [--json PATH] [--csv PATH]`. Every ratio
compares timings taken side by side, in one run; --quick uses small sizes and few repeats (for
CI), --json writes every measured figure to PATH and --csv the allreduce sweep as a table."""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .collectives import allreduce, get_params
from .cost_model import AlphaBeta, best_layout, cost_in_step
from .experiments import (comm_demos, fsdp_demos, ft_runs, group_runs, long_runs, nodes,
                          performance, torchft_hsdp, torchft_runs, zero_memory)
from .experiments.performance import FIT_FROM, FIT_TO, fit_allreduces, size_label
from .experiments.simulated import forward_backward_seconds
from .experiments.throughput import (ALLREDUCES, NO_ALLREDUCE, bus_bandwidth, busy_processes,
                                     compare_ddp, compare_processes_and_threads)
from .experiments.timing import alternate, median_seconds
from .hardware import devices
from .lenet import init_lenet_params, lenet, loss
from .ring import ring_allreduce
from .training import sgd, train_batch


def bench_train_batch(batch_size: int, repeats: int, figures: dict | None = None) -> None:
    """Print one SGD step of LeNet against train_batch on k simulated devices (seconds into
    figures, when given)."""
    X, y = torch.rand(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    params = init_lenet_params(0, scale=0.1)
    plain = get_params(params, torch.device("cpu"))

    def plain_step() -> None:
        loss(lenet(X, plain), y).sum().backward()
        sgd(plain, 0.2, batch_size)

    cases = {"plain step, 1 device": plain_step}
    for k in (1, 2, 4, 8):
        devs = devices(k, simulate=True)
        dp = [get_params(params, d) for d in devs]
        cases[f"train_batch, k={k}"] = (lambda dp=dp, devs=devs:
                                        train_batch(X, y, dp, devs, 0.2))
    result = median_seconds(alternate(cases, repeats))
    if figures is not None:
        figures.update(result)
    base = result["plain step, 1 device"]
    print(f"\nOne SGD step of LeNet on a batch of {batch_size}, simulated CPU devices "
          f"(median of {repeats}):")
    for name, t in result.items():
        print(f"  {name:22s} {t * 1e3:8.1f} ms   x{t / base:.2f} of the plain step")


def bench_allreduce(repeats: int, figures: dict | None = None) -> None:
    """Print naive against ring allreduce on simulated devices (ms into figures, when given)."""
    lenet_grads = init_lenet_params(0)
    n_lenet = sum(p.numel() for p in lenet_grads)
    print(f"\nallreduce vs ring_allreduce in place on simulated CPU devices (median of {repeats});"
          "\n'busiest' is the most elements one device sends, as a multiple of the tensor size N:")
    print(f"  {'tensors':32s} {'k':>2s} {'naive ms':>9s} {'ring ms':>9s} {'ring/naive':>10s}"
          f" {'busiest naive':>14s} {'busiest ring':>13s}")
    for label, shapes in ((f"LeNet gradient ({n_lenet:,} floats)", [p.shape for p in lenet_grads]),
                          ("16 MiB tensor", [(4 * 2**20,)])):
        for k in (2, 4, 8):
            per_device = [[torch.randn(s) for s in shapes] for _ in range(k)]
            cases = {c.__name__: (lambda c=c: [c(list(ts)) for ts in zip(*per_device)])
                     for c in (allreduce, ring_allreduce)}
            r = median_seconds(alternate(cases, repeats))
            naive, ring = r["allreduce"] * 1e3, r["ring_allreduce"] * 1e3
            n = sum(t.numel() for t in per_device[0])
            busiest = [max(map(sum, zip(*[c(list(ts)) for ts in zip(*per_device)]))) / n
                       for c in (allreduce, ring_allreduce)]
            if figures is not None:
                figures[f"{label}, k={k}"] = {"naive_ms": naive, "ring_ms": ring}
            print(f"  {label:32s} {k:2d} {naive:9.2f} {ring:9.2f} {ring / naive:10.2f}"
                  f" {busiest[0]:13.2f}N {busiest[1]:12.2f}N")


@dataclass(frozen=True)
class Sizes:
    """How much the benchmark measures: the full run, or QUICK (--quick, for CI)."""
    repeats: int = 20  # simulated sections and the allreduce sweep
    batch_size: int = 256  # the simulated train_batch section
    sweep_numels: tuple[int, ...] = tuple(performance.SWEEP_NUMELS)  # 4 KiB to 64 MiB
    ddp_steps: int = 30
    anatomy_steps: int = 10
    bucket_caps_mb: tuple[float, ...] = tuple(4.0**k / 1024 for k in range(9))  # 1 KiB-64 MiB
    bucket_steps: int = 3
    bucket_repeats: int = 3
    scaling_steps: int = 20
    scaling_repeats: int = 3


QUICK = Sizes(repeats=3, batch_size=64,
              sweep_numels=(1024, 16384, 262144, 4 * 2**20, 16 * 2**20), ddp_steps=5,
              anatomy_steps=5, bucket_caps_mb=(1 / 1024, 1 / 64, 1 / 4, 1.0, 4.0, 16.0, 64.0),
              bucket_steps=1, bucket_repeats=2, scaling_steps=5, scaling_repeats=2)
WORLDS = (2, 4)  # the allreduce sweep's process counts
ANATOMY_BATCH = {"lenet": 64, "resnet18": 16}  # per process; bench_buckets uses ResNet-18's
BUCKET_BATCH = 16
SCALING_BATCH = 128
ZERO_BATCH = 64
FSDP_BATCH = 64  # LeNet images per process; the peak is measured on fsdp_demos' "mlp"
SHM_OVER_GLOO = 2.5  # the raw allreduce's goal: its bus bandwidth over gloo's, 16 and 64 MiB
SHM_DDP_BATCHES = (16, 128)  # images per process
SHM_DDP_BUSY = 2  # processes the bench keeps busy for the shm/gloo row beside other work
SHM_DDP_ROUNDS, SHM_DDP_STEPS = 5, 30  # what the shm/gloo goals are set for
NEAR_BEST = 1.05  # bucket caps whose step is within 5% of the best are printed as ties


def verdict(ratio: float, goal: float) -> str:
    """The ratio, the course's goal for it, and whether it is met."""
    met = "goal met" if ratio >= goal else "below the goal"
    return f"x{ratio:.2f} (goal >= {goal}x: {met})"


def bench_processes(repeats: int, sweeps: dict[int, dict], steps: int, figures: dict) -> None:
    """Chapter 07 on real processes (gloo over loopback), each comparison in one run; the
    allreduce figures are the chapter-08 sweep's largest size (its medians, as chapter 07)."""
    rounds = max(3, repeats // 4)  # a training round takes seconds
    numel = max(next(iter(sweeps.values()))["dist.all_reduce"])  # 64 MiB unless told less
    print(f"\nChapter 07, separate processes (load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores: other work slows them unevenly)."
          f"\nAllreduce of {size_label(4 * numel)} of float32 (median of {repeats}), "
          "bus bandwidth 2(w-1)/w * bytes / s:")
    for world, samples in sweeps.items():
        seconds = performance.per_size(samples, "median")
        busbw = {name: bus_bandwidth(4 * numel, t[numel], world) / 1e9
                 for name, t in seconds.items() if name in ALLREDUCES}
        ring, gloo = busbw["p2p.ring_allreduce"], busbw["dist.all_reduce"]
        print(f"  {world} processes: gloo {gloo:.2f} GB/s, p2p.ring_allreduce {ring:.2f} GB/s, "
              f"p2p.allreduce {busbw['p2p.allreduce']:.2f} GB/s; "
              f"ring/gloo {verdict(ring / gloo, 0.9)}")
    ddp = compare_ddp(steps=steps, repeats=rounds, timeout=300)
    print(f"LeNet training, 2 processes x 128 images, {steps} steps (median of {rounds} "
          "rounds): " + ", ".join(f"{name} {rate:.0f} images/s" for name, rate in ddp.items()))
    print(f"  ScratchDDP/torch DDP {verdict(ddp['ScratchDDP'] / ddp['torch DDP'], 0.95)}; "
          f"with our ring x{ddp['ScratchDDP, ring'] / ddp['torch DDP']:.2f}")
    pt = compare_processes_and_threads(steps=steps, repeats=rounds, timeout=300)
    threads = pt["1 process x 2 threads"]
    print(f"LeNet training, 256 images per step, {steps} steps (median of {rounds} rounds): "
          + ", ".join(f"{name} {rate:.0f} images/s" for name, rate in pt.items()))
    for name in ("2 processes x 1 thread", "2 processes x 1 thread, shm"):
        print(f"  {name} / 1 process x 2 threads {verdict(pt[name] / threads, 1.3)}")
    print(f"  bound: no allreduce x{pt['2 processes x 1 thread, no allreduce'] / threads:.2f}; "
          f"2 threads are x{threads / pt['1 process x 1 thread']:.2f} as fast as 1")
    figures.update({"ddp_images_per_s": ddp, "processes_and_threads_images_per_s": pt})


# --- chapter 08 --------------------------------------------------------------------------------

def print_sweep(seconds: dict[str, dict[int, float]], world: int, repeats: int) -> None:
    """The sweep as a table: per implementation, ms per call and bus bandwidth in GB/s."""
    busbw = performance.sweep_busbw(seconds, world)
    print(f"\nAllreduce of float32, {world} processes (fastest of {repeats} calls; medians in "
          f"--json and --csv): ms per call, bus bandwidth GB/s; {performance.MEMCPY}: "
          "Tensor.copy_ of as many bytes on every process at once, its GB/s the bound of an "
          "allreduce made of copies:")
    print(f"  {'size':>7s}" + "".join(f"{name:>20s}" for name in seconds))
    for n in next(iter(seconds.values())):
        print(f"  {size_label(4 * n):>7s}" + "".join(
            f"{seconds[name][n] * 1e3:12.3f}{busbw[name][n] / 1e9:8.2f}" for name in seconds))


def shm_goals(seconds: dict[str, dict[int, float]], world: int) -> dict[str, float]:
    """Print shm's bus bandwidth against gloo's (goal SHM_OVER_GLOO) and the memcpy bound
    (goal 0.3x) at 16 and 64 MiB, where the sweep has them; return the ratios."""
    busbw = performance.sweep_busbw(seconds, world)
    ratios = {}
    for n in (4 * 2**20, 16 * 2**20):
        if "shm" not in busbw or n not in busbw["shm"]:
            continue
        shm, gloo, bound = (busbw[k][n] for k in ("shm", "dist.all_reduce", performance.MEMCPY))
        ratios[f"shm/gloo {size_label(4 * n)}"] = shm / gloo
        ratios[f"shm/memcpy {size_label(4 * n)}"] = shm / bound
        print(f"  shm at {size_label(4 * n)}: shm/gloo {verdict(shm / gloo, SHM_OVER_GLOO)}, "
              f"shm/memcpy bound {verdict(shm / bound, 0.3)}")
    return ratios


def print_fits(fits: dict[str, dict[str, float]], world: int) -> None:
    """One line per fit, with the goal of a worst error of at most 30% for gloo and the ring."""
    print(f"  alpha-beta fits to the fastest calls, {world} processes, {size_label(FIT_FROM)} to "
          f"{size_label(FIT_TO)} (least squares on relative errors):")
    for name, f in fits.items():
        worst = f["worst_relative_error"]
        goal = ("" if name not in ("dist.all_reduce", "p2p.ring_allreduce") else
                f" (goal <= 30%: {'goal met' if worst <= 0.3 else 'below the goal'})")
        print(f"    {name:20s} alpha {f['alpha'] * 1e6:8.1f} us, 1/beta {1 / f['beta'] / 1e9:6.2f}"
              f" GB/s, worst error {worst:5.0%}{goal}")


def bench_anatomy(sizes: Sizes, figures: dict) -> None:
    """The ScratchDDP step of each model split into compute and communication."""
    print("\nScratchDDP step, 2 processes, 25 MiB buckets (medians of the slowest rank; "
          "exposed = backward with sync - backward inside no_sync; overlap = hidden / comm):")
    for model in ANATOMY_BATCH:
        a = performance.step_anatomy(sizes.anatomy_steps, ANATOMY_BATCH[model], 25.0,
                                     model=model, timeout=300)
        figures[model] = a
        ms = {k: a[k] * 1e3 for k in ("forward_s", "backward_no_sync_s", "backward_sync_s",
                                       "optimizer_s", "comm_s", "exposed_comm_s")}
        print(f"  {model} ({size_label(a['gradient_bytes'])} of gradients, {a['buckets']} "
              f"bucket(s), 2 x {ANATOMY_BATCH[model]} images): forward {ms['forward_s']:.1f} "
              f"ms, backward alone {ms['backward_no_sync_s']:.1f} ms, with sync "
              f"{ms['backward_sync_s']:.1f} ms, optimizer {ms['optimizer_s']:.1f} ms; comm "
              f"{ms['comm_s']:.1f} ms, exposed {ms['exposed_comm_s']:.1f} ms, overlap "
              f"{a['overlap']:.0%}")


def bench_shm_ddp(sizes: Sizes, figures: dict) -> None:
    """ScratchDDP over shared memory against over gloo, LeNet: at a few per-process batches
    (the smaller, the larger communication's share of a step), then at the smallest beside
    SHM_DDP_BUSY busy processes; goal 1.0x at the smallest (figures: images/s, load average)."""
    rounds = max(3, sizes.repeats // 4)
    settings = f"{sizes.ddp_steps} steps a round, median of {rounds} rounds"
    if (rounds, sizes.ddp_steps) != (SHM_DDP_ROUNDS, SHM_DDP_STEPS):
        settings += (f"; the goals are set for {SHM_DDP_ROUNDS} rounds of {SHM_DDP_STEPS} "
                     "steps: with fewer, a verdict is a smoke test")
    print(f"\nScratchDDP with the shared-memory allreduce / with gloo's, LeNet, 2 processes x 1 "
          f"thread on {os.cpu_count()} cores ({settings}):")
    rows = [(batch, 0) for batch in SHM_DDP_BATCHES] + [(SHM_DDP_BATCHES[0], SHM_DDP_BUSY)]
    for batch, busy in rows:
        load = os.getloadavg()[0]  # before the busy processes start: the 1-minute mean lags
        variants = ("ScratchDDP", "ScratchDDP, shm") + ((NO_ALLREDUCE,) if not busy else ())
        with busy_processes(busy):
            ddp = compare_ddp(steps=sizes.ddp_steps, batch_size=batch, repeats=rounds,
                              timeout=300, variants=variants)
        figures[f"{batch} images, {busy} busy"] = {"images_per_s": ddp, "load_average": load}
        where = (f"beside {busy} busy processes (load average {load:.1f} before they started)"
                 if busy else f"load average {load:.1f}")
        ceiling = "" if busy else (
            f"; no allreduce at all x{ddp[NO_ALLREDUCE] / ddp['ScratchDDP']:.2f} of gloo (the "
            "ceiling, give or take the rounds' spread of a few %)")
        ratio = ddp["ScratchDDP, shm"] / ddp["ScratchDDP"]
        print(f"  2 x {batch:3d} images, {where}: gloo {ddp['ScratchDDP']:6.0f} images/s, shm "
              f"{ddp['ScratchDDP, shm']:6.0f} images/s, shm/gloo "
              + (verdict(ratio, 1.0) if batch == SHM_DDP_BATCHES[0] else
                 f"x{ratio:.2f} (no goal: the step is mostly computation)") + ceiling)
    print("  Beside busy processes (started and ended here) each rank gets a share of a core, "
          "and a rank that waits must\n  leave its core to those that compute: gloo's threads "
          "and shm's waits both sleep in the kernel until the other rank's data is there.")


def bench_buckets(sizes: Sizes, gloo: AlphaBeta, anatomy: dict, figures: dict) -> None:
    """The bucket-size sweep against the cost model's best cap, for the real buckets of each
    cap, with gloo's allreduce as fast as alone and at its pace inside a DDP step (anatomy:
    step_anatomy of ResNet-18); goal: within 4x of the measured best."""
    r = performance.bucket_sweep(sizes.bucket_caps_mb, sizes.bucket_steps, BUCKET_BATCH,
                                 repeats=sizes.bucket_repeats, timeout=300)
    steps = r["step_seconds"]
    measured = min(steps, key=steps.get) * 2**20
    near = [cap for cap, t in steps.items() if t <= NEAR_BEST * min(steps.values())]
    in_step = cost_in_step(gloo, anatomy["comm_s"], anatomy["buckets"],
                           anatomy["gradient_bytes"])
    best, off = {}, {}
    for name, cost in (("alone", gloo), ("in a step", in_step)):
        best[name] = 2**20 * best_layout(r["bucket_bytes"], r["backward_seconds"], cost)
        off[name] = max(measured / best[name], best[name] / measured)
    print(f"\nBucket sweep: ResNet-18 on 8x8 images ({size_label(r['gradient_bytes'])} of "
          f"gradients), ScratchDDP on gloo, 2 x {BUCKET_BATCH} images (median of "
          f"{sizes.bucket_repeats} rounds of {sizes.bucket_steps} steps):")
    print("  cap      " + "".join(f"{size_label(cap * 2**20):>9s}" for cap in steps))
    print("  buckets  " + "".join(f"{r['buckets'][cap]:9d}" for cap in steps))
    print("  step ms  " + "".join(f"{t * 1e3:9.1f}" for t in steps.values()))
    print(f"  measured best {size_label(measured)} (within {NEAR_BEST - 1:.0%} of it: "
          f"{', '.join(size_label(cap * 2**20) for cap in near)})")
    print(f"  cost model's best for these buckets, backward alone "
          f"{r['backward_seconds'] * 1e3:.0f} ms: with gloo as fast as alone "
          f"({gloo.bandwidth / 1e9:.2f} GB/s) {size_label(best['alone'])}, "
          f"x{off['alone']:.1f} from the measured best; at its pace inside a DDP step "
          f"({in_step.bandwidth / 1e9:.2f} GB/s, from the anatomy) "
          f"{size_label(best['in a step'])}, x{off['in a step']:.1f} (goal within 4x: "
          f"{'goal met' if off['in a step'] <= 4 else 'below the goal'})")
    figures.update(r, measured_best_bytes=measured, predicted_best_bytes=best["in a step"],
                   predicted_best_bytes_alone=best["alone"], near_best_caps_mb=near,
                   beta_in_step=in_step.beta)


def bench_scaling(sizes: Sizes, figures: dict) -> None:
    """Strong and weak scaling of LeNet with torch's DDP over 1, 2 and 4 processes."""
    s = performance.scaling((1, 2, 4), ("strong", "weak"), sizes.scaling_steps, SCALING_BATCH,
                            repeats=sizes.scaling_repeats, timeout=300)
    figures.update(s)
    print(f"\nScaling, LeNet with torch DDP, one thread per process (4 processes on "
          f"{os.cpu_count()} cores oversubscribe): strong = {SCALING_BATCH} images per step "
          f"in all, weak = {SCALING_BATCH} per process; images/s (efficiency):")
    for w in next(iter(s.values()))["images_per_s"]:
        print(f"  {w} process{'es' if w > 1 else '  '}: " + ", ".join(
            f"{mode} {s[mode]['images_per_s'][w]:6.0f} ({s[mode]['efficiency'][w]:.2f})"
            for mode in s))


CSV_COLUMNS = ("processes", "implementation", "bytes", "calls", "fastest_s", "median_s",
               "busbw_fastest_GBps")


def write_sweep_csv(path: Path, sweeps: dict[int, dict[str, dict[int, list[float]]]]) -> None:
    """The allreduce sweeps as CSV: one row per process count, implementation and size."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(CSV_COLUMNS)
        for world, samples in sweeps.items():
            busbw = performance.sweep_busbw(performance.per_size(samples, "min"), world)
            for name, by_numel in samples.items():
                for n, ts in by_numel.items():
                    out.writerow([world, name, 4 * n, len(ts), min(ts), statistics.median(ts),
                                  busbw[name][n] / 1e9])


def bench_zero(sizes: Sizes, figures: dict) -> None:
    """Chapter 09: per-rank optimizer state and step time of DDP, ZeRO-1 and ZeRO-2 (AdamW)."""
    rounds = max(3, sizes.repeats // 4)
    r = zero_memory.compare_zero(2, sizes.ddp_steps, ZERO_BATCH, rounds, timeout=300)
    figures.update(r)
    print(f"\nChapter 09, LeNet with AdamW, 2 processes x {ZERO_BATCH} images, "
          f"{sizes.ddp_steps} steps (median of {rounds} rounds): optimizer state and "
          "gradients per rank, seconds per step")
    for stage, f in r.items():
        state = " + ".join(size_label(b) for b in f["optimizer_state_bytes"])
        grads = " + ".join(size_label(b) for b in f["gradient_bytes"])
        print(f"  {stage:5s}: state {state:>21s}, gradients {grads:>21s}, "
              f"{f['seconds_per_step'] * 1e3:6.1f} ms per step "
              f"(x{f['seconds_per_step'] / r['ddp']['seconds_per_step']:.2f} of ddp's)")


def bench_fsdp(sizes: Sizes, figures: dict) -> None:
    """Chapter 10: ScratchFSDP's training throughput against torch's fully_shard (LeNet, the
    same units, gloo, 2 ranks), prefetch's gain, and the measured peak against the formula."""
    rounds = max(3, sizes.repeats // 4)
    ways = ("fsdp", "fsdp no prefetch", "torch fully_shard")
    r = fsdp_demos.compare_fsdp(2, sizes.ddp_steps, FSDP_BATCH, rounds, ways=ways, timeout=300)
    seconds = {way: r[way]["seconds_per_step"] for way in ways}
    ratio = seconds["torch fully_shard"] / seconds["fsdp"]
    gain = seconds["fsdp no prefetch"] / seconds["fsdp"]
    print(f"\nChapter 10, LeNet with AdamW, one unit per layer, 2 processes x {FSDP_BATCH} "
          f"images, {sizes.ddp_steps} steps (median of {rounds} rounds):")
    for way, t in seconds.items():
        print(f"  {way:17s} {t * 1e3:6.1f} ms per step")
    print(f"  ScratchFSDP's throughput against torch's fully_shard: {verdict(ratio, 0.9)}")
    print(f"  prefetch's gain (no prefetch's time / prefetch's): x{gain:.2f}")
    peak = fsdp_demos.measure_sharding(2, "mlp", ways=("zero3",), timeout=300)["zero3"]
    measured = max(peak["peak"])
    met = "goal met" if abs(measured / peak["formula_peak"] - 1) <= 0.1 else "outside the goal"
    print(f"  peak per rank, {fsdp_demos.MLP_DEPTH} Linear({fsdp_demos.MLP_WIDTH}) layers: "
          f"measured {size_label(measured)}, formula {size_label(peak['formula_peak'])}: "
          f"x{measured / peak['formula_peak']:.3f} (goal within 10%: {met})")
    figures.update(steps=r, throughput_vs_fully_shard=ratio, prefetch_gain=gain,
                   peak=peak)


COMM_METHODS = ("ddp", "bf16", "powersgd r=1", "powersgd r=2", "powersgd r=4", "local sgd H=4",
                "diloco H=4", "diloco H=16")  # chapter 11's methods, and PowerSGD's goal rank
DILOCO_SWEEP = {False: (400, ("ddp", "diloco H=4", "diloco H=16", "diloco H=50", "diloco H=100")),
                True: (100, ("ddp", "diloco H=4", "diloco H=50"))}  # quick -> (steps, methods)


def print_comm_table(results: dict) -> None:
    """One row per method: test accuracy and loss, payload per rank, ms per step measured
    here and modelled across two machines at 1 Gbit/s."""
    modelled = comm_demos.across_two_machines(results, link_gbit=1.0)
    ddp = results["ddp"]["bytes_sent_per_rank"]
    print(f"  {'method':14s} {'accuracy':>8s} {'loss':>6s} {'bytes/rank':>10s} {'x fewer':>7s}"
          f" {'syncs':>5s} {'ms here':>7s} {'ms @1Gbit/s':>11s}")
    for m, r in results.items():
        print(f"  {m:14s} {100 * r['final_accuracy']:7.1f}% {r['final_loss']:6.3f} "
              f"{size_label(r['bytes_sent_per_rank']):>10s} "
              f"{ddp / r['bytes_sent_per_rank']:7.1f} {r['syncs']:5d} "
              f"{r['seconds_per_step'] * 1e3:7.1f} {modelled[m]['step_s'] * 1e3:11.1f}")


def bench_comm(quick: bool, figures: dict) -> None:
    """Chapter 11: every method on one task (LeNet, AdamW, 2 ranks), our PowerSGD against
    torch's powerSGD_hook at rank 2, and DiLoCo's longer sync intervals."""
    r = comm_demos.one_task(2, methods=COMM_METHODS, quick=quick, timeout=600)
    size = comm_demos.QUICK if quick else comm_demos.FULL
    print(f"\nChapter 11, LeNet with AdamW, 2 processes x {size['batch_size']} images, "
          f"{size['steps']} steps; test figures on {size['test_size']} images; modelled: "
          "measured compute + a ring allreduce of the payload, 50 us per message:")
    print_comm_table(r)
    ddp, r2 = r["ddp"], r["powersgd r=2"]
    plain = ddp["bytes_sent_per_rank"] / ddp["steps"]  # PowerSGD's first 2 steps send this
    compressed = (r2["bytes_sent_per_rank"] - 2 * plain) / (r2["steps"] - 2) / plain
    gap = 100 * (ddp["final_accuracy"] - r2["final_accuracy"])
    print(f"  PowerSGD rank 2: a compressed step sends x{compressed:.3f} of DDP's bytes "
          f"(goal <= 0.1: {'goal met' if compressed <= 0.1 else 'above the goal'}); "
          f"accuracy {gap:+.1f} points below DDP's (goal <= 1: "
          f"{'goal met' if gap <= 1 else 'outside the goal'})")
    torch_r = comm_demos.compare_with_torch_powersgd(2, 2, quick=quick, timeout=600)
    print("  on torch's DDP at rank 2, ours against torch's powerSGD_hook:")
    for way in ("ours", "torch"):
        t = torch_r[way]
        print(f"    {way:5s}: {100 * t['final_accuracy']:5.1f}%, loss {t['final_loss']:.3f}, "
              f"{size_label(t['bytes_sent_per_rank'])} per rank in {t['allreduces']} "
              f"allreduces, {t['seconds_per_step'] * 1e3:.1f} ms per step")
    met = "goal met" if torch_r["time_ratio"] <= 1.1 else "above the goal"
    print(f"    our time per step / torch's: x{torch_r['time_ratio']:.2f} (goal <= 1.1: {met})")
    steps, methods = DILOCO_SWEEP[quick]
    sweep = comm_demos.one_task(2, steps=steps, methods=methods, quick=quick, timeout=600)
    print(f"  DiLoCo sweep, {steps} steps (inner AdamW, outer lr 0.7, Nesterov 0.9):")
    print_comm_table(sweep)
    for m in methods[1:]:
        fewer = sweep["ddp"]["bytes_sent_per_rank"] / sweep[m]["bytes_sent_per_rank"]
        loss = sweep[m]["final_loss"] / sweep["ddp"]["final_loss"] - 1
        print(f"    {m}: x{fewer:.0f} fewer bytes than DDP, final loss {100 * loss:+.1f}% of "
              f"DDP's" + (f" (goal >= 40x and within 5%: "
                           f"{'goal met' if fewer >= 40 and loss <= 0.05 else 'not met'})"
                           if m == "diloco H=50" else ""))
    figures.update(one_task=r, modelled_1gbit=comm_demos.across_two_machines(r),
                   torch_powersgd=torch_r, diloco_sweep=sweep,
                   section_1=comm_demos.ddp_across_two_machines(ddp["seconds_per_step"]))


RECOVERY_GOAL_S = 20.0  # issue 28: from the kill to the first step, with README's settings


def bench_recovery(quick: bool, figures: dict) -> None:
    """Chapter 12: seconds from node 1 of an elastic 2-node job killed whole to the first step
    of the world of one, under torchrun's rendezvous defaults and under README's settings."""
    print("\nChapter 12, node 1 of 2 (--nnodes=1:2) killed whole: seconds to the first step of "
          "the world of one\n(a lower bound: here a killed process's sockets close at once)")
    if quick:
        print("  not measured with --quick (it takes about 90 s): run the full benchmark")
        return
    for name, (conf, shared) in nodes.RECOVERY_SETTINGS.items():
        with tempfile.TemporaryDirectory() as folder:
            figures[name] = nodes.recovery_seconds(Path(folder), conf, shared)
        print(f"  {name:20s} {figures[name]:5.1f} s   --rdzv-conf={conf}"
              + ("" if shared else ", TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"))
    met = "met" if figures["README's settings"] <= RECOVERY_GOAL_S else "not met"
    print(f"  goal with README's settings: at most {RECOVERY_GOAL_S:g} s ({met})")


NEVER_STOPS_REPEATS = 3
README_RECOVERY_S = 9.7  # chapter 12's figure in README (bench_recovery, README's settings)
CHAPTER_12 = "chapter 12, README's settings, s"
COMMAND_RUNS = ("; a replica's start to its first commit timed apart, started as a command "
                "(imports included)")


def bench_never_stops(quick: bool, figures: dict) -> None:
    """Chapter 13: train_ft beside torchft 0.2.0 on one failure (medians of 3 runs) and in the
    steady state against ScratchDDP's plain step, beside chapter 12's recovery (figures holds
    it, measured in this run, under CHAPTER_12); --quick: ours once, no torchft."""
    repeats = 1 if quick else NEVER_STOPS_REPEATS
    ok, why = torchft_runs.available()
    systems = {"ours": False} | ({"torchft 0.2.0": True} if ok and not quick else {})
    print(f"\nChapter 13, training that never stops (load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores): 2 replicas, LeNet in float64, G=32, heartbeat timeout "
          f"{torchft_runs.RULES.heartbeat_timeout:g} s, join timeout "
          f"{torchft_runs.RULES.join_timeout:g} s, --timeout 5; r1 SIGKILLed at step "
          f"{torchft_runs.KILL_AT} of {torchft_runs.STEPS}, started again (forked) once r0 "
          f"committed alone{'' if quick else COMMAND_RUNS}; torchft with its own sampler, "
          f"G // 2 samples a group; medians of {repeats} run(s)")
    if len(systems) == 1:
        print(f"  torchft: not measured ({'--quick' if ok else why})")
    with tempfile.TemporaryDirectory() as folder:
        for name, torchft in systems.items():
            figures[name] = torchft_runs.failure_figures(Path(folder), torchft, repeats,
                                                         command=not quick)
        steady = {name: [] for name in ("ScratchDDP", *systems)}
        for i in range(repeats):  # alternated, round after round
            rate = compare_ddp(steps=60, batch_size=32, repeats=1, variants=("ScratchDDP",),
                               timeout=300)["ScratchDDP"]
            steady["ScratchDDP"].append(64 / rate)
            for name, torchft in systems.items():
                run = Path(folder) / f"steady-{name}-{i}"
                run.mkdir()
                steady[name].append(torchft_runs.steady_step_seconds(run, torchft))
    step = {name: statistics.median(t) for name, t in steady.items()}
    figures["steady_step_s"] = step
    print_never_stops(figures, step, figures.get(CHAPTER_12))


ROUNDING_STEPS, ROUNDING_MEMBERS = (40, 150, 300), (1, 2, 3)


def bench_rounding(quick: bool, figures: dict) -> None:
    """Chapter 13's rounding without failures, by steps and members, against one process
    (README's flags in float64); not in --quick."""
    if quick:
        print("  rounding without failures, by steps: not measured (--quick)")
        return
    flags = ("--global-batch-size", "64", "--momentum", "0.9", "--dtype", "float64")
    gaps = ft_runs.rounding_gaps(flags, ROUNDING_STEPS, ROUNDING_MEMBERS)
    figures["rounding_gaps"] = {f"{n} steps, {q} members": g for (n, q), g in gaps.items()}
    print(f"  rounding without failures ({' '.join(flags)}; one process on "
          f"{torch.get_num_threads()} threads): the largest parameter gap")
    print("  " + f"{'steps':>6s}" + "".join(f"{f'{q} member(s)':>14s}" for q in ROUNDING_MEMBERS))
    for n in ROUNDING_STEPS:
        print("  " + f"{n:6d}" + "".join(f"{gaps[n, q]:14.1e}" for q in ROUNDING_MEMBERS))


LONG_RUN = 10_000, 100  # steps, and a restart every so many


def bench_long_run(quick: bool, figures: dict) -> None:
    """What the lighthouse keeps over a long run with restarts (long_runs.watched_run)."""
    steps, every = (500, 100) if quick else LONG_RUN
    with tempfile.TemporaryDirectory() as folder:
        run = long_runs.watched_run(Path(folder), steps, every)
    keys, rss = [k for _, k, _ in run["samples"]], [m for _, _, m in run["samples"]]
    half = len(keys) // 2
    trips = run["round_trip_ms"]
    figures["long_run"] = {k: v for k, v in run.items() if k != "samples"}
    print(f"  the lighthouse over {steps} steps of 3 replicas (G=2), r1 killed and started again "
          f"every {every} ({run['restarts']} restarts, {run['seconds']:.0f} s, exit codes "
          f"{run['codes']}): keys at most {max(keys)} (median {statistics.median(keys[:half])} "
          f"in the first half, {statistics.median(keys[half:])} in the second), "
          f"{run['left']} at the end; resident {rss[0]:.0f} MiB at the start, {rss[-1]:.0f} at "
          f"the end; r0's median quorum round trip per 1,000 steps {trips[min(trips)]:.2f} "
          f"ms in the first, {trips[max(trips)]:.2f} ms in the last")


HSDP_NUMELS = {"LeNet": group_runs.LENET_NUMEL, "25M parameters": 25_000_000}


def bench_fault_tolerant_hsdp(quick: bool, figures: dict, chapter_13: dict) -> None:
    """Chapter 14: 2 groups of 2 ranks under torchrun, a rank killed (group_runs.
    failure_figures, medians of 3); shard-wise recovery against a whole-state copy; the
    steady step against plain ScratchFSDP in one group and torch's HSDP; bytes across."""
    repeats = 1 if quick else NEVER_STOPS_REPEATS
    rules = torchft_runs.RULES
    print(f"\nChapter 14, fault-tolerant HSDP (load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores): 2 groups of 2 ranks, LeNet in float64, G=32, heartbeat "
          f"timeout {rules.heartbeat_timeout:g} s, --timeout 5; g1's rank 1 SIGKILLed at step "
          f"{group_runs.KILL_AT}, g1 started again by torchrun; medians of {repeats} run(s)")
    if quick:
        print("  failures, samples and torchft: not measured with --quick (about 90 s): run the "
              "full benchmark")
        bench_hsdp_recovery(quick, repeats, figures)
        return
    with tempfile.TemporaryDirectory() as folder:
        run = group_runs.failure_figures(Path(folder), rules, repeats)
    figures.update(run)
    ours_13 = chapter_13.get("ours", {}).get("kill_to_next_commit_s")
    ratio = f" (chapter 13 in this run: {ours_13:.2f} s, x{run['kill_to_next_commit_s'] / ours_13:.2f}; " \
        f"goal <= 1.2x: {'met' if run['kill_to_next_commit_s'] <= 1.2 * ours_13 else 'not met'})" \
        if ours_13 else ""
    print(f"  a rank SIGKILLed -> the other group's next commit: "
          f"{run['kill_to_next_commit_s']:.2f} s{ratio}")
    print(f"  the kill -> the restarted group's first commit: "
          f"{run['kill_to_restarted_commit_s']:.2f} s (torchrun's restart, imports, joining, "
          f"healing); its shard-wise recovery {run['shard_recovery_s'] * 1e3:.1f} ms")
    whole = group_runs.LENET_NUMEL * 8  # LeNet's gradient in float64: what DDP hands
    print(f"  bytes a rank hands across groups per step: {run['bytes_across']:,} (DDP over all "
          f"4 ranks: {whole:,}, x{run['bytes_across'] / whole:.2f}); on a ring's wire "
          f"(q-1)/(qg-1) = x{1 / 3:.2f} of DDP's")
    print(f"  samples of the run skipped {run['samples_skipped']:.0f}, trained twice "
          f"{run['samples_repeated']:.0f}; parameter gap to one process {run['gap']:.1e}")
    ok, why = torchft_runs.available()
    if ok and not quick:
        with tempfile.TemporaryDirectory() as folder:
            flags = list(group_runs.BENCH_FLAGS)
            theirs = torchft_hsdp.figures(torchft_hsdp.run_groups(
                Path(folder), flags, group_runs.KILL_AT, pace=group_runs.BENCH_PACE), flags)
        figures["torchft 0.2.0"] = theirs
        print(f"  torchft 0.2.0's FT-HSDP, the same run and kill (one run): the other group's "
              f"next commit {theirs['kill_to_next_commit_s']:.2f} s, the restarted group's "
              f"first commit {theirs['kill_to_restarted_commit_s']:.2f} s, samples skipped "
              f"{theirs['samples']['skipped']} and trained twice {theirs['samples']['repeated']}"
              f" of {theirs['samples']['expected']}, gap {theirs['gap']:.1e}")
    else:
        print(f"  torchft's FT-HSDP: not measured ({'--quick' if ok else why})")
    bench_hsdp_recovery(quick, repeats, figures)
    steady = group_runs.steady_steps()
    figures["steady_step_s"] = steady
    ours = steady["train_ft, 2 groups of 2"]
    print("  steady step (8 samples a rank): " + ", ".join(
        f"{name} {t * 1e3:.1f} ms" + ("" if t == ours else f" (ours x{ours / t:.2f})")
        for name, t in steady.items()) + "; goal <= 1.15x plain ScratchFSDP in one group and "
        "torch's HSDP (4 processes share 2 cores here, a group of 2 alone does not)")


def bench_hsdp_recovery(quick: bool, repeats: int, figures: dict) -> None:
    """Chapter 14: a group of 2 healing shard by shard against a whole-state copy (LeNet, and
    25M parameters unless quick)."""
    numels = {"LeNet": HSDP_NUMELS["LeNet"]} if quick else HSDP_NUMELS
    for name, numel in numels.items():
        took = group_runs.recovery_seconds(numel, 2, repeats)
        figures[f"recovery {name}"] = took
        whole_s, shards_s = took["whole state from one peer"], took["shard by shard"]
        print(f"  a group of 2 healing at {name}: whole state from one peer {whole_s * 1e3:.1f} "
              f"ms, shard by shard {shards_s * 1e3:.1f} ms (x{whole_s / shards_s:.2f})")


def print_never_stops(figures: dict, step: dict[str, float], torchrun_s: float | None) -> None:
    """The issue's table: ours, torchft's, chapter 12's, and each goal."""
    ours, theirs = figures["ours"], figures.get("torchft 0.2.0")
    chapter_12 = torchrun_s or README_RECOVERY_S
    faster = chapter_12 / ours["kill_to_next_commit_s"]
    steady = step["ours"] / step["ScratchDDP"]

    def against_torchft(key: str, goal: float) -> str:
        if theirs is None:
            return " (no torchft figure)"
        ratio = ours[key] / theirs[key]
        return f" ({'met' if ratio <= goal else 'not met'}: x{ratio:.2f})"
    rows = [("a replica SIGKILLed -> survivors' next commit", "kill_to_next_commit_s", "{:.2f} s",
             f"{torchrun_s:.1f} s" if torchrun_s else f"{README_RECOVERY_S:g} s (README)",
             f"ours <= 1.2x torchft's{against_torchft('kill_to_next_commit_s', 1.2)}, >= 5x "
             f"faster than chapter 12's ({'met' if faster >= 5 else 'not met'}: x{faster:.1f})"),
            ("a replica started -> its first commit", "start_to_first_commit_s", "{:.2f} s", "-",
             f"ours <= torchft's{against_torchft('start_to_first_commit_s', 1.0)}"),
            ("samples skipped (of a run without failures)", "samples_skipped", "{:.0f}",
             "0 (steps redone)",
             f"ours 0 ({'met' if ours['samples_skipped'] == 0 else 'not met'})"),
            ("samples trained twice", "samples_repeated", "{:.0f}", "-",
             f"ours 0 ({'met' if ours['samples_repeated'] == 0 else 'not met'})"),
            (f"steady step / ScratchDDP's ({step['ScratchDDP'] * 1e3:.1f} ms, G=64, float32)",
             None, "x{:.2f}", "-", f"<= 1.15x ({'met' if steady <= 1.15 else 'not met'})"),
            ("parameter gap to one uninterrupted process", "gap", "{:.1e}", "-",
             f"ours: rounding only ({ours['replay_gap']:.1e} from one process replaying its "
             f"memberships; 2 members, no failure: {ours['failure_free_gap']:.1e})")]
    print(f"  {'figure':56s} {'ours':>8s} {'torchft 0.2.0':>13s}  {'chapter 12 (torchrun)':22s} "
          "goal")
    for row, key, form, ch12, goal in rows:
        cells = [form.format(figures[name][key] if key else step[name] / step["ScratchDDP"])
                 if name in figures else "-" for name in ("ours", "torchft 0.2.0")]
        print(f"  {row:56s} {cells[0]:>8s} {cells[1]:>13s}  {ch12:22s} {goal}")


class Laps(dict):
    """Seconds each section of the benchmark took, by name, in order."""

    def __init__(self) -> None:
        super().__init__()
        self._mark = time.perf_counter()

    def lap(self, section: str) -> None:
        """Note the seconds since the previous lap as section's."""
        now = time.perf_counter()
        self[section], self._mark = now - self._mark, now


def bench_chapter_08(sizes: Sizes, sweeps: dict[int, dict], figures: dict, laps: Laps) -> None:
    """Chapter 08: allreduce sweep and fits, the DDP step's anatomy, buckets, scaling."""
    print(f"\nChapter 08, performance measured and modelled (load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores).")
    fits = {}
    for world, samples in sweeps.items():
        seconds = performance.per_size(samples, "min")
        print_sweep(seconds, world, sizes.repeats)
        if world == 2:  # the goals for the shared-memory allreduce
            figures["shm_goals"] = shm_goals(seconds, world)
        fits[world] = fit_allreduces(seconds)
        print_fits(fits[world], world)
    figures["alpha_beta"] = fits
    bench_anatomy(sizes, figures.setdefault("anatomy", {}))
    laps.lap("anatomy")
    bench_shm_ddp(sizes, figures.setdefault("shm_ddp_images_per_s", {}))
    laps.lap("ScratchDDP over shm")
    gloo = AlphaBeta(fits[2]["dist.all_reduce"]["alpha"], fits[2]["dist.all_reduce"]["beta"])
    bench_buckets(sizes, gloo, figures["anatomy"]["resnet18"],
                  figures.setdefault("buckets", {}))
    laps.lap("bucket sweep")
    bench_scaling(sizes, figures.setdefault("scaling", {}))
    laps.lap("scaling")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few repeats (for CI)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repeats of each timing (default 20, or 3 with --quick)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="batch of the simulated train_batch section (256, or 64 with --quick)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write every measured figure to PATH as JSON")
    parser.add_argument("--csv", type=Path, metavar="PATH",
                        help="also write the allreduce sweep to PATH as CSV, one row per size")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; return (and with --json write) every measured figure."""
    laps = Laps()
    args = parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    for option in ("repeats", "batch_size"):
        if getattr(args, option) is not None:
            sizes = replace(sizes, **{option: getattr(args, option)})
    figures: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                     "cores": os.cpu_count(), "quick": args.quick, "sizes": asdict(sizes),
                     "elapsed_s": laps}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    threads = sorted({1, torch.get_num_threads()})
    times = forward_backward_seconds(threads, repeats=sizes.repeats)
    figures["forward_backward_s"] = times
    print("\nLeNet forward and backward on 128 images (median): "
          + ", ".join(f"{n} thread(s) {t * 1e3:.1f} ms" for n, t in times.items()))
    bench_train_batch(sizes.batch_size, sizes.repeats, figures.setdefault("train_batch_s", {}))
    bench_allreduce(sizes.repeats, figures.setdefault("simulated_allreduce", {}))
    laps.lap("simulated devices")
    sweeps = {w: performance.allreduce_sweep(sizes.sweep_numels, w, sizes.repeats, timeout=300)
              for w in WORLDS}
    figures["allreduce_s"] = sweeps
    laps.lap("allreduce sweeps")
    bench_processes(sizes.repeats, sweeps, sizes.ddp_steps, figures.setdefault("chapter_07", {}))
    laps.lap("chapter 07 training")
    bench_chapter_08(sizes, sweeps, figures.setdefault("chapter_08", {}), laps)
    bench_zero(sizes, figures.setdefault("chapter_09", {}))
    laps.lap("chapter 09")
    bench_fsdp(sizes, figures.setdefault("chapter_10", {}))
    laps.lap("chapter 10")
    bench_comm(args.quick, figures.setdefault("chapter_11", {}))
    laps.lap("chapter 11")
    bench_recovery(args.quick, figures.setdefault("chapter_12_recovery_s", {}))
    laps.lap("chapter 12")
    bench_never_stops(args.quick, figures.setdefault("chapter_13", {
        CHAPTER_12: figures["chapter_12_recovery_s"].get("README's settings")}))
    laps.lap("chapter 13")
    bench_rounding(args.quick, figures["chapter_13"])
    laps.lap("chapter 13 rounding")
    bench_long_run(args.quick, figures["chapter_13"])
    laps.lap("chapter 13 long run")
    bench_fault_tolerant_hsdp(args.quick, figures.setdefault("chapter_14", {}),
                              figures["chapter_13"])
    laps.lap("chapter 14")
    print(f"\nThe benchmark took {sum(laps.values()):.0f} s: "
          + ", ".join(f"{name} {t:.0f} s" for name, t in laps.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
        print(f"Every figure written to {args.json}")
    if args.csv is not None:
        write_sweep_csv(args.csv, sweeps)
        print(f"The allreduce sweep written to {args.csv}")
    return figures


if __name__ == "__main__":
    main()
