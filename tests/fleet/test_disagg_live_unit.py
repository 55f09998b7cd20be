"""``pagoda bench disagg-live``'s split of a stream's inter-token gaps around a burst."""

from pagoda.bench.disagg_live import _gaps


def test_gaps_are_split_by_where_they_end():
    times = [0.0, 0.1, 0.2, 1.5, 1.6, 3.0, 3.1]
    assert _gaps(times, 1.0, 3.0, inside=False) == [0.1, 0.1]  # ended before the burst began
    during = _gaps(times, 1.0, 3.0, inside=True)
    assert [round(g, 6) for g in during] == [1.3, 0.1, 1.4]  # the stall that ends inside counts
    assert _gaps([], 0.0, 1.0, inside=True) == []
