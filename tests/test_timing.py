"""timing.alternate: the cases alternated round after round, each call timed alone."""
import pytest

from dpcourse.experiments import timing
from dpcourse.experiments.timing import alternate, median_seconds, repeat


def test_each_round_runs_every_case_once_in_order_after_the_warm_up():
    calls = []
    samples = alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3,
                        warmup=2)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert {name: len(ts) for name, ts in samples.items()} == {"a": 3, "b": 3}


class FakeClock:
    """A perf_counter that moves only when told: timings without wall-clock time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def test_each_sample_is_its_own_call_and_before_is_not_timed(clock):
    log = []
    samples = alternate({"one": lambda: clock.advance(1.0), "five": lambda: clock.advance(5.0)},
                        2, warmup=1, before=lambda: (log.append("before"), clock.advance(100.0)))
    assert samples == {"one": [1.0, 1.0], "five": [5.0, 5.0]}
    assert log == ["before"] * 6  # before every call, the warm-up's too


def test_repeat_calls_a_step_the_given_number_of_times_and_medians_are_per_case():
    count = []
    repeat(lambda: count.append(1), 4)()
    assert len(count) == 4
    assert median_seconds({"a": [3.0, 1.0, 2.0], "b": [5.0]}) == {"a": 2.0, "b": 5.0}


def test_no_rounds_is_an_error():
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        alternate({"a": lambda: None}, 0)
