"""cost_model: the alpha-beta fit, the allreduce formulas and the bucket-size model, checked
against known parameters, hand-computed cases and numpy's weighted polyfit."""
import random

import numpy as np
import pytest

from dpcourse import cost_model
from dpcourse.cost_model import AlphaBeta
from dpcourse.experiments.throughput import bus_bandwidth

ALPHA, BETA = 50e-6, 1e-9  # 50 us per message, 1 GB/s
SIZES = [2**k for k in range(12, 27)]  # 4 KiB .. 64 MiB
MiB = 2**20


def timings(noise: float, seed: int) -> list[float]:
    """ALPHA + n BETA for each size, times (1 + u) with u uniform in [-noise, noise]."""
    rng = random.Random(seed)
    return [(ALPHA + n * BETA) * (1 + rng.uniform(-noise, noise)) for n in SIZES]


# --- the fit ------------------------------------------------------------------------------------

def test_fit_recovers_alpha_and_beta_exactly_without_noise():
    fit = cost_model.fit_alpha_beta(SIZES, timings(0.0, seed=0))
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-9)
    assert fit.beta == pytest.approx(BETA, rel=1e-9)
    assert fit.bandwidth == pytest.approx(1e9, rel=1e-9)


def test_fit_recovers_alpha_and_beta_within_a_few_percent_with_5_percent_noise():
    fit = cost_model.fit_alpha_beta(SIZES, timings(0.05, seed=0))
    assert fit.alpha == pytest.approx(ALPHA, rel=0.05)
    assert fit.beta == pytest.approx(BETA, rel=0.02)


def test_fit_minimises_relative_errors_like_numpys_polyfit_weighted_by_one_over_t():
    seconds = timings(0.05, seed=1)
    beta, alpha = np.polyfit(SIZES, seconds, 1, w=[1 / t for t in seconds])
    fit = cost_model.fit_alpha_beta(SIZES, seconds)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)
    assert fit.beta == pytest.approx(beta, rel=1e-9)


def test_relative_fit_predicts_small_messages_where_a_plain_fit_does_not():
    seconds = timings(0.05, seed=2)
    fit = cost_model.fit_alpha_beta(SIZES, seconds)
    plain_beta, plain_alpha = np.polyfit(SIZES, seconds, 1)  # plain least squares on seconds
    plain = AlphaBeta(plain_alpha, plain_beta)
    assert max(map(abs, cost_model.relative_errors(fit, SIZES, seconds))) < 0.07
    assert max(map(abs, cost_model.relative_errors(plain, SIZES, seconds))) > 0.3


def test_relative_errors_are_predicted_minus_measured_over_measured():
    assert cost_model.relative_errors(AlphaBeta(1.0, 0.5), [2, 4], [4.0, 2.0]) == [-0.5, 0.5]


@pytest.mark.parametrize("nbytes, seconds, message", [
    ([1024], [1e-3], "at least 2 points"),
    ([], [], "at least 2 points"),
    ([1024, 2048], [1e-3], "2 sizes but 1 timings"),
    ([-1024, 2048], [1e-3, 2e-3], "bytes >= 0"),
    ([1024, 2048], [1e-3, 0.0], "seconds > 0"),
    ([1024, 1024], [1e-3, 2e-3], "2 different message sizes"),
])
def test_fit_rejects_too_few_or_invalid_points_clearly(nbytes, seconds, message):
    with pytest.raises(ValueError, match=message):
        cost_model.fit_alpha_beta(nbytes, seconds)


def test_time_rejects_a_negative_size():
    with pytest.raises(ValueError, match="bytes >= 0"):
        AlphaBeta(ALPHA, BETA).time(-1)


# --- allreduce formulas ---------------------------------------------------------------------------

LINK = AlphaBeta(1e-5, 1e-9)  # 10 us per message, 1 GB/s


def test_allreduce_formulas_for_4_ranks_and_1_mib():
    # one whole message: 1e-5 + 1,048,576e-9 = 1.058576e-3 s; a quarter: 1e-5 + 262,144e-9
    assert cost_model.naive_allreduce_cost(LINK, 4).time(MiB) == pytest.approx(
        6 * 1.058576e-3, rel=1e-12)  # 2(p-1) = 6 whole messages through rank 0
    assert cost_model.ring_allreduce_cost(LINK, 4).time(MiB) == pytest.approx(
        6 * 2.72144e-4, rel=1e-12)  # 6 steps of a quarter
    assert cost_model.tree_allreduce_cost(LINK, 4).time(MiB) == pytest.approx(
        4 * 1.058576e-3, rel=1e-12)  # 2 rounds up, 2 rounds down, whole messages


def test_tree_rounds_are_ceil_log2_p():
    rounds = {p: cost_model.tree_allreduce_cost(AlphaBeta(1.0, 0.0), p).time(0) / 2
              for p in [1, 2, 3, 4, 5, 8, 9]}
    assert rounds == {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 8: 3, 9: 4}


def test_double_tree_is_logarithmic_latency_and_twice_the_bytes():
    """NCCL's tuning model: 2 floor(log2 p) latencies (its log2i; the depth of a binary tree of
    p nodes), 2n bytes at the link's rate (algbw = busbw / 2), so the ring wins back only
    through bytes: 2(p-1)/p n < 2n."""
    link = AlphaBeta(1.0, 1.0)
    for p, depth in [(2, 1), (3, 1), (8, 3), (9, 3), (64, 6)]:
        cost = cost_model.double_tree_allreduce_cost(link, p)
        assert (cost.alpha, cost.beta) == (2 * depth, 2.0)
        assert cost.beta > cost_model.ring_allreduce_cost(link, p).beta


def test_double_tree_latency_is_a_chain_inside_a_node_and_logarithmic_across_nodes():
    """NCCL's tuning.cc: 2 ((nRanks/nNodes - 1) intraLat + log2(nNodes) interLat)."""
    link = AlphaBeta(1.0, 1.0)
    for p, per_node, hops in [(8, 8, 7), (8, 1, 3), (16, 8, 8), (64, 8, 10), (24, 8, 8)]:
        cost = cost_model.double_tree_allreduce_cost(link, p, ranks_per_node=per_node)
        assert (cost.alpha, cost.beta) == (2 * hops, 2.0)
    with pytest.raises(ValueError, match="ranks_per_node must be an integer >= 1 that divides"):
        cost_model.double_tree_allreduce_cost(link, 8, ranks_per_node=3)


def test_one_rank_costs_nothing():
    for algorithm in ["naive", "ring", "tree", "double tree"]:
        assert cost_model.allreduce_cost(LINK, 1, algorithm).time(MiB) == 0.0


def test_ring_bus_bandwidth_is_the_link_bandwidth_for_any_number_of_ranks():
    link = AlphaBeta(0.0, 1e-9)  # no latency: the nccl-tests bus bandwidth is 1/beta
    for p in [2, 3, 4, 8, 64]:
        seconds = cost_model.allreduce_cost(link, p, "ring").time(64 * MiB)
        assert bus_bandwidth(64 * MiB, seconds, p) == pytest.approx(1e9, rel=1e-12)


@pytest.mark.parametrize("p, algorithm, message", [
    (0, "ring", "integer >= 1"), (2.5, "ring", "integer >= 1"), (2, "butterfly", "one of")])
def test_allreduce_cost_rejects_bad_ranks_or_algorithm(p, algorithm, message):
    with pytest.raises(ValueError, match=message):
        cost_model.allreduce_cost(LINK, p, algorithm)


# --- the bucket-size model -----------------------------------------------------------------------

def test_finish_times_of_a_backlogged_network_by_hand():
    # M = 10 bytes, backward 1 s, b = 4: buckets of 4, 4, 2 bytes ready at 0.4, 0.8, 1.0 s,
    # each reduced in 0.1 + 0.1 * size s = 0.5, 0.5, 0.3 s:
    # finish_1 = 0.4 + 0.5 = 0.9; finish_2 = max(0.8, 0.9) + 0.5 = 1.4;
    # finish_3 = max(1.0, 1.4) + 0.3 = 1.7: communication extends backward by 0.7 s.
    cost = AlphaBeta(0.1, 0.1)
    buckets = cost_model.equal_buckets(10, 4)
    assert cost_model.layout_finish_times(buckets, 1.0, cost) == pytest.approx([0.9, 1.4, 1.7],
                                                                               rel=1e-12)
    assert cost_model.exposed_communication(10, 1.0, 4, cost) == pytest.approx(0.7, rel=1e-12)


def test_finish_times_when_the_network_waits_for_buckets_by_hand():
    # same buckets, reduced in 0.05 + 0.05 * size s = 0.25, 0.25, 0.15 s:
    # finish_1 = 0.4 + 0.25 = 0.65; finish_2 = max(0.8, 0.65) + 0.25 = 1.05;
    # finish_3 = max(1.0, 1.05) + 0.15 = 1.2: exposed 0.2 s.
    cost = AlphaBeta(0.05, 0.05)
    assert cost_model.layout_finish_times(cost_model.equal_buckets(10, 4), 1.0, cost) == (
        pytest.approx([0.65, 1.05, 1.2], rel=1e-12))
    assert cost_model.exposed_communication(10, 1.0, 4, cost) == pytest.approx(0.2, rel=1e-12)


@pytest.mark.parametrize("cost", [AlphaBeta(0.01, 0.0005), AlphaBeta(0.002, 0.002)])
def test_exposed_communication_matches_the_closed_form_for_equal_buckets(cost):
    model_bytes, backward = 1000, 1.0
    for b in [1, 2, 5, 8, 10, 20, 25, 40, 100, 125, 250, 500, 1000]:
        t, tau = cost.time(b), b / model_bytes * backward
        closed_form = t + (model_bytes / b - 1) * max(0.0, t - tau)
        assert cost_model.exposed_communication(model_bytes, backward, b, cost) == (
            pytest.approx(closed_form, rel=1e-9)), b


def test_one_bucket_hides_nothing_and_no_backward_hides_nothing():
    cost = AlphaBeta(0.01, 0.0005)
    assert cost_model.exposed_communication(1000, 1.0, 4000, cost) == pytest.approx(
        cost.time(1000), rel=1e-12)
    # backward 0: the 4 buckets' allreduces one after another, 4 alphas and M betas
    assert cost_model.exposed_communication(1000, 0.0, 250, cost) == pytest.approx(
        4 * 0.01 + 1000 * 0.0005, rel=1e-12)


def test_no_gradients_means_no_communication():
    assert cost_model.exposed_communication(0, 1.0, 25 * MiB, LINK) == 0.0


def test_best_bucket_size_picks_the_middle_when_both_extremes_are_bad():
    # M = 1000 bytes, backward 1 s, allreduce 0.01 + 0.0005 b s. b = 1: 1000 alphas, a backlog
    # of 9.5 s; b = 1000: nothing overlaps, 0.51 s; b = 20: each bucket reduced (0.02 s) as
    # fast as it is produced (0.02 s), only the last one exposed: 0.02 s.
    cost = AlphaBeta(0.01, 0.0005)
    assert cost_model.best_bucket_size(1000, 1.0, cost, [1, 20, 1000]) == 20


def test_best_bucket_size_among_all_divisors_is_the_docstrings_b_star():
    # b* = alpha' M / (backward - M beta') = 0.01 * 1000 / (1 - 0.5) = 20 bytes
    cost = AlphaBeta(0.01, 0.0005)
    divisors = [b for b in range(1, 1001) if 1000 % b == 0]
    assert cost_model.best_bucket_size(1000, 1.0, cost, divisors) == 20


@pytest.mark.parametrize("args, message", [
    ((-1, 1.0, 4), "model_bytes"), ((10, -1.0, 4), "backward_seconds"),
    ((10, 1.0, 0), "bucket_bytes"), ((10, float("nan"), 4), "backward_seconds")])
def test_bucket_model_rejects_invalid_sizes_and_times(args, message):
    with pytest.raises(ValueError, match=message):
        cost_model.exposed_communication(*args, AlphaBeta(0.1, 0.1))


def test_unequal_buckets_by_hand():
    # buckets of 6 then 4 bytes (a cap cannot cut a parameter), backward 1 s, allreduce
    # 0.1 + 0.1 * size s: ready at 0.6 and 1.0 s; finish_1 = 0.6 + 0.7 = 1.3;
    # finish_2 = max(1.0, 1.3) + 0.5 = 1.8: exposed 0.8 s
    cost = AlphaBeta(0.1, 0.1)
    assert cost_model.layout_finish_times([6, 4], 1.0, cost) == pytest.approx([1.3, 1.8],
                                                                             rel=1e-12)
    assert cost_model.layout_exposed_communication([6, 4], 1.0, cost) == pytest.approx(
        0.8, rel=1e-12)
    assert cost_model.layout_exposed_communication([], 1.0, cost) == 0.0
    with pytest.raises(ValueError, match="every bucket size"):
        cost_model.layout_finish_times([4, -1], 1.0, cost)


def test_equal_buckets_leave_the_rest_to_the_last():
    assert cost_model.equal_buckets(10, 4) == [4, 4, 2]
    assert cost_model.equal_buckets(8, 4) == [4, 4]
    assert cost_model.equal_buckets(0, 4) == []
    assert cost_model.equal_buckets(0.1 + 0.2, 0.1) == pytest.approx([0.1, 0.1, 0.1])  # no 0.0


def test_cost_in_step_by_hand():
    # 2 buckets of 100 bytes in all took 0.5 s inside a step; alpha 0.01 s:
    # beta = (0.5 - 2 * 0.01) / 100 = 0.0048 s per byte, which gives back the 0.5 s
    alone = AlphaBeta(0.01, 1e-3)
    slow = cost_model.cost_in_step(alone, 0.5, 2, 100)
    assert slow.alpha == 0.01 and slow.beta == pytest.approx(0.0048, rel=1e-12)
    assert 2 * slow.alpha + 100 * slow.beta == pytest.approx(0.5, rel=1e-12)
    # faster than alone (even less than the alphas): as fast as alone
    assert cost_model.cost_in_step(alone, 0.05, 2, 100) == alone
    assert cost_model.cost_in_step(alone, 0.001, 2, 100) == alone


@pytest.mark.parametrize("args, message", [
    ((0.5, 0, 100), "at least one bucket"), ((0.5, 2, 0), "at least one bucket"),
    ((float("nan"), 2, 100), "comm_seconds"), ((-0.1, 2, 100), "comm_seconds")])
def test_cost_in_step_rejects_nonsense(args, message):
    with pytest.raises(ValueError, match=message):
        cost_model.cost_in_step(AlphaBeta(0.01, 1e-3), *args)


def test_empty_buckets_are_ready_when_backward_ends():
    # no bytes to produce: nothing is ready before backward ends, each bucket costs alpha
    cost = AlphaBeta(0.01, 1.0)
    assert cost_model.layout_exposed_communication([0, 0], 1.0, cost) == pytest.approx(0.02)


def test_best_bucket_size_needs_a_candidate():
    with pytest.raises(ValueError, match="at least one candidate"):
        cost_model.best_bucket_size(10, 1.0, AlphaBeta(0.1, 0.1), [])


# --- predictions from published link figures ---------------------------------------------------

def test_predict_ddp_overhead_without_overlap_by_hand():
    # 100 MiB of gradients, 8 ranks, ring, 10 GB/s, 5 us: 4 buckets of 25 MiB, each
    # 14 * 5e-6 s + 25 MiB * 14/8 / 1e10 s; together 2.8e-4 + 104,857,600 * 1.75e-10 s.
    seconds = cost_model.predict_ddp_overhead(100 * MiB, 8, 1e10, 5e-6)
    assert seconds == pytest.approx(2.8e-4 + 104_857_600 * 1.75e-10, rel=1e-12)


def test_predict_ddp_overhead_hides_all_but_the_last_bucket_behind_a_slow_backward():
    slow_backward = cost_model.predict_ddp_overhead(100 * MiB, 8, 1e10, 5e-6,
                                                    backward_seconds=10.0)
    last_bucket = 14 * 5e-6 + 25 * MiB * 1.75e-10
    assert slow_backward == pytest.approx(last_bucket, rel=1e-9)


@pytest.mark.parametrize("bandwidth, latency, message", [
    (0.0, 5e-6, "bandwidth"), (1e10, -1.0, "latency")])
def test_predict_ddp_overhead_rejects_impossible_links(bandwidth, latency, message):
    with pytest.raises(ValueError, match=message):
        cost_model.predict_ddp_overhead(100 * MiB, 8, bandwidth, latency)
