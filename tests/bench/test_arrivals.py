import math
import statistics

import pytest

from batchserve.bench.arrivals import ArrivalProcess


def _gaps(times):
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_all_at_once():
    assert ArrivalProcess().offsets(5) == [0.0] * 5


def test_poisson_mean_rate_and_reproducible():
    p = ArrivalProcess(request_rate=4.0)
    times = p.offsets(4000, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = _gaps(times)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.08)  # exponential: CV 1
    assert p.offsets(50, seed=1) == times[:50]
    assert p.offsets(50, seed=2) != times[:50]


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_mean_and_burstiness(burstiness):
    gaps = _gaps(ArrivalProcess(2.0, "gamma", burstiness).offsets(4000, seed=3))
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.1)
    cv = statistics.stdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.12)


def test_validation():
    with pytest.raises(ValueError):
        ArrivalProcess(request_rate=0).offsets(3)
    with pytest.raises(ValueError):
        ArrivalProcess(process="uniform").offsets(3)
    with pytest.raises(ValueError):
        ArrivalProcess(max_concurrency=0).offsets(3)
    assert "at most 8" in ArrivalProcess(max_concurrency=8).describe()
