"""Chapter 11's measurements: the alpha-beta arithmetic by hand, the approximation error of
a LeNet gradient, and on real ranks (two launches of 2): every method's payload equals its
formula, and our PowerSGD and torch's send the same bytes and both train."""
import math

import pytest

from dpcourse.experiments import comm_demos
from dpcourse.lenet import LENET_SHAPES

NUMEL = sum(math.prod(s) for s in LENET_SHAPES)  # 129,068
MATRICES = [(s[0], math.prod(s[1:])) for s in LENET_SHAPES if len(s) > 1]
VECTORS = sum(s[0] for s in LENET_SHAPES if len(s) == 1)
STEPS, START = 16, 2  # PowerSGD averages exactly before START


def powersgd_bytes(rank: int, steps: int) -> int:
    """START plain steps, then r(n + m) numbers per n x m matrix (r clamped) plus the
    vectors, in float32."""
    compressed = sum(min(rank, n, m) * (n + m) for n, m in MATRICES) + VECTORS
    return 4 * (START * NUMEL + (steps - START) * compressed)


def test_alpha_beta_step_by_hand():
    """1 MB in 2 allreduces over 2 machines at 1 Gbit/s and 100 us: each allreduce pays 2
    latencies, the ring sends 2 (k-1)/k = 1 x the bytes at 8 ns per byte."""
    out = comm_demos.alpha_beta_step({"a": 1e6}, 0.01, 1.0, messages={"a": 2},
                                     latency_s=1e-4)["a"]
    assert out["comm_s"] == pytest.approx(2 * 2e-4 + 1e6 * 8e-9, rel=1e-12)
    assert out["step_s"] == pytest.approx(0.0184, rel=1e-12)
    assert out["comm_share"] == pytest.approx(8.4 / 18.4, rel=1e-12)
    four = comm_demos.alpha_beta_step({"a": 1e6}, 0.0, 10.0, world_size=4, latency_s=0)
    assert four["a"]["comm_s"] == pytest.approx(1.5 * 1e6 * 0.8e-9, rel=1e-12)


def test_one_billion_parameters_across_two_machines_by_hand():
    """4 GB of float32 gradients in 153 buckets of 25 MiB: 32 s at 1 Gbit/s against 6 x 1e9
    x 16,384 FLOPs at 395.6 TFLOP/s (0.2485 s)."""
    out = comm_demos.ddp_across_two_machines(lenet_compute_s=0.01)
    compute = 6e9 * 16_384 / (0.4 * 989e12)
    for gbit in (1, 10, 100):
        one_b = out["1B parameters"][gbit]
        comm = 153 * 2 * comm_demos.LAN_LATENCY_S + 4e9 * 8 / (gbit * 1e9)
        assert one_b["compute_s"] == pytest.approx(compute, rel=1e-12)
        assert one_b["comm_s"] == pytest.approx(comm, rel=1e-12)
        lenet = out["LeNet"][gbit]
        assert lenet["comm_s"] == pytest.approx(2 * 50e-6 + 4 * NUMEL * 8 / (gbit * 1e9))
    assert out["1B parameters"][1]["comm_share"] > 0.99


def test_approximation_error_falls_with_the_rank_and_vanishes_at_full_rank():
    err = comm_demos.approximation_error()
    assert err["shape"] == (800, 128) and err["ranks"] == list(comm_demos.RANKS)
    best, power = err["best"], err["power_iteration"]
    assert all(a >= b for a, b in zip(best, best[1:]))  # the SVD's is non-increasing
    assert all(p >= b - 1e-6 for p, b in zip(power, best))  # nothing beats the SVD
    assert 0.01 < best[0] < 1 and power[-1] < 1e-5 and best[-1] < 1e-6  # float32 at 128


def test_a_bad_method_is_refused_in_the_parent():
    for bad in ("powersgd", "diloco r=4", "local sgd H=0", "adam"):
        with pytest.raises(ValueError, match="unknown method"):
            comm_demos.one_task(methods=[bad])


@pytest.fixture(scope="module")
def task():
    return comm_demos.one_task(2, steps=STEPS, batch_size=4, train_size=256, test_size=64,
                               source="synthetic", methods=comm_demos.METHODS)


def test_each_methods_payload_is_its_formula(task):
    formula = {"ddp": 4 * NUMEL * STEPS, "bf16": 2 * NUMEL * STEPS,
               "powersgd r=1": powersgd_bytes(1, STEPS), "powersgd r=4": powersgd_bytes(4, STEPS),
               "local sgd H=4": 4 * NUMEL * STEPS // 4, "diloco H=4": 4 * NUMEL * STEPS // 4,
               "diloco H=16": 4 * NUMEL * STEPS // 16}
    assert {m: r["bytes_sent_per_rank"] for m, r in task.items()} == formula
    assert {m: r["syncs"] for m, r in task.items()} == {
        "ddp": 16, "bf16": 16, "powersgd r=1": 16, "powersgd r=4": 16, "local sgd H=4": 4,
        "diloco H=4": 4, "diloco H=16": 1}
    assert task["powersgd r=4"]["allreduces"] == START + (STEPS - START) * 3  # biases, P's, Q's


def test_each_method_reports_a_curve_and_a_test_score(task):
    for r in task.values():
        assert len(r["loss_curve"]) == STEPS and r["steps"] == STEPS
        assert 0 <= r["final_accuracy"] <= 1 and r["seconds_per_step"] > 0


def test_across_two_machines_charges_each_method_its_own_bytes(task):
    model = comm_demos.across_two_machines(task, link_gbit=1.0)
    for m, r in task.items():
        assert model[m]["compute_s"] == r["seconds_per_step"]
        assert model[m]["comm_s"] == pytest.approx(
            (r["allreduces"] * 2 * comm_demos.LAN_LATENCY_S + r["bytes_sent_per_rank"] * 8e-9)
            / STEPS, rel=1e-12)


def test_our_powersgd_and_torchs_send_the_same_bytes_and_both_train():
    """Same rank, compression from step 2, every matrix compressed and the biases sent
    whole: the same payload; 32 steps of AdamW take either from chance (ln 10 = 2.30)."""
    out = comm_demos.compare_with_torch_powersgd(2, matrix_rank=2, steps=32, batch_size=8,
                                                 source="synthetic")
    assert out["ours"]["bytes_sent_per_rank"] == out["torch"]["bytes_sent_per_rank"] \
        == powersgd_bytes(2, 32)
    for way in ("ours", "torch"):
        assert out[way]["final_loss"] < 1.5
