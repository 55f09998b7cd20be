"""Figures of benchmark results: the curves people read rather than tables.

Each function draws one PNG from results a bench command already computed (it measures
nothing itself), so a figure in docs/ is remade by the command named beside it:

- ``routing_ladder``: ``pagoda bench routing --plot FILE``: per arrival process, P90 TTFT
  against the number of replicas for each policy of the ladder (log-scaled), beside the TTFT
  CDF of every policy at the largest fleet;
- ``goodput_curve``: ``pagoda bench routing --rates R1,R2,... --plot FILE``: requests per
  second that met the TTFT objective against the offered rate, per policy, and the fraction
  that met it;
- ``ttft_cdf``: ``pagoda bench serve --plot FILE``: the measured TTFT and end-to-end latency
  CDFs of one run against a live server.

matplotlib is imported only here and only when drawing (the ``Agg`` backend: no display), so
the commands run without it and say so when asked to draw (``missing_matplotlib``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


def missing_matplotlib() -> Optional[str]:
    """``None`` when matplotlib can be imported, else what to tell the user."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"--plot: not drawn, {exc} (pip install matplotlib, or pagoda[test])"
    return None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def _save(pyplot: Any, figure: Any, panels: Sequence[Any], title: str, path: str) -> None:
    """Every panel gridded with its legend, the title on top, the PNG written, the figure freed."""
    for axes in panels:
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def _cdf(axes: Any, values: Sequence[float], label: str) -> None:
    """An empirical CDF: the fraction of values <= x, as steps."""
    ordered = sorted(values)
    if not ordered:
        return
    fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
    axes.step(ordered, fractions, where="post", label=label)


def routing_ladder(results: Sequence[Any], path: str, title: str) -> None:
    """The ladder's figure (module docstring).

    Args:
        results: ``fleet.sim.simulator.SimResult`` of every (arrival, N, policy) simulated.
        path: the PNG to write.
        title: the figure's title (the workload and the step model).
    """
    arrivals = list(dict.fromkeys(r.arrival for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    pyplot = _pyplot()
    figure, panels = pyplot.subplots(len(arrivals), 2, figsize=(11, 3.6 * len(arrivals)), dpi=100, squeeze=False)
    for row, arrival in zip(panels, arrivals):
        mine = [r for r in results if r.arrival == arrival]
        largest = max(r.num_replicas for r in mine)
        for policy in policies:
            points = sorted((r.num_replicas, r.percentile(0.9)) for r in mine if r.policy == policy)
            row[0].plot([n for n, _ in points], [p90 for _, p90 in points], marker="o", label=policy)
            _cdf(row[1], next((r.ttfts for r in mine if r.policy == policy and r.num_replicas == largest), []),
                 policy)
        counts = sorted({r.num_replicas for r in mine})
        row[0].set_xscale("log", base=2)
        row[0].set_xticks(counts, [str(n) for n in counts])
        row[0].set_yscale("log")
        row[0].set(xlabel="replicas", ylabel="P90 TTFT (s, log)", title=f"{arrival}: P90 TTFT by fleet size")
        row[1].set_xscale("log")
        row[1].set(xlabel="TTFT (s, log)", ylabel="fraction of requests", title=f"{arrival}: TTFT CDF, N = {largest}")
    _save(pyplot, figure, [axes for row in panels for axes in row], title, path)


def goodput_curve(curves: dict[str, list[tuple[float, float, float]]], path: str, title: str,
                  slo_s: float) -> None:
    """Goodput against offered load (module docstring).

    Args:
        curves: policy -> [(offered requests/s, goodput requests/s, fraction within the SLO)].
        path: the PNG to write.
        title: the figure's title.
        slo_s: the TTFT objective the goodput counts against.
    """
    pyplot = _pyplot()
    figure, panels = pyplot.subplots(1, 2, figsize=(11, 4), dpi=100)
    for policy, points in curves.items():
        points = sorted(points)
        panels[0].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        panels[1].plot([p[0] for p in points], [100 * p[2] for p in points], marker="o", label=policy)
    panels[0].set(xlabel="offered load (requests/s)", ylabel=f"goodput (requests/s with TTFT <= {slo_s:g} s)")
    panels[1].set(xlabel="offered load (requests/s)", ylabel=f"% of requests with TTFT <= {slo_s:g} s")
    panels[1].set_ylim(0, 105)
    _save(pyplot, figure, list(panels), title, path)


def ttft_cdf(series: dict[str, Sequence[float]], path: str, title: str) -> None:
    """Latency CDFs of one run, one line per series (label -> seconds), log-scaled x.

    Args:
        series: e.g. ``{"TTFT": [...], "end-to-end": [...]}`` (empty series are left out).
        path: the PNG to write.
        title: the figure's title.
    """
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(6.5, 4), dpi=100)
    for label, values in series.items():
        _cdf(axes, values, label)
    axes.set_xscale("log")
    axes.set(xlabel="seconds (log)", ylabel="fraction of requests")
    _save(pyplot, figure, [axes], title, path)
