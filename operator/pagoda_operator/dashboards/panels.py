"""The dashboards' vocabulary: ``Query``, ``Graph``, ``Row``, ``Board``, and their Grafana JSON.

A board is data (dataclasses a test can walk: every query of every panel), turned into
Grafana's dashboard model by grafana-foundation-sdk's builders in ``to_sdk`` and encoded
with sorted keys (``to_json``), so regenerating gives byte-identical files.

Layout: each row is a full-width row header followed by its graphs, two per line (12 of
Grafana's 24 columns, 8 high); the SDK's builder places them left to right. Panel ids count
from 1 in order (Grafana wants them unique within a dashboard).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

# Grafana's variables (the test substitutes them: ``$job`` -> ``.+``, the rate interval -> a window).
JOB = '$job'
RATE = '$__rate_interval'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Query:
    """One PromQL expression and its legend (Grafana's ``{{label}}`` templates)."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Graph:
    """A time-series panel: a title, what it shows (description), a Grafana unit, its queries."""

    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"

    def __post_init__(self) -> None:
        if not self.queries:
            raise ValueError(f"panel {self.title!r}: needs at least one query")


@dataclass(frozen=True)
class Row:
    title: str
    graphs: tuple[Graph, ...]


@dataclass(frozen=True)
class Board:
    """A dashboard: ``uid`` is also its file name; ``job_metric`` fills the ``$job`` variable."""

    uid: str
    title: str
    description: str
    job_metric: str
    rows: tuple[Row, ...] = field(default_factory=tuple)

    def queries(self) -> list[tuple[str, str]]:
        """Every (panel title, PromQL) pair, in order."""
        return [(g.title, q.expr) for r in self.rows for g in r.graphs for q in g.queries]


def quantiles(histogram: str, selector: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> tuple[Query, ...]:
    """``histogram_quantile`` queries of a Prometheus histogram, per job, one per quantile.

    Args:
        histogram: the family name (``vllm:time_to_first_token_seconds``); ``_bucket`` is added.
        selector: the label matchers, e.g. ``job=~"$job"``.
        qs: the quantiles.

    Returns:
        One ``Query`` per quantile, legend ``p50 {{job}}`` etc.
    """
    return tuple(Query(f"histogram_quantile({q}, sum by (job, le) (rate({histogram}_bucket{{{selector}}}[{RATE}])))",
                       f"p{round(q * 100)} {{{{job}}}}") for q in qs)


def to_sdk(board: Board):
    """The board as a grafana-foundation-sdk ``Dashboard`` builder.

    Returns:
        ``grafana_foundation_sdk.builders.dashboard.Dashboard`` (call ``.build()``).
    """
    from grafana_foundation_sdk.builders import dashboard as gd
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.models import dashboard as model

    source = model.DataSourceRef(type_val=DATASOURCE["type"], uid=DATASOURCE["uid"])
    builder = (gd.Dashboard(board.title).uid(board.uid).description(board.description)
               .tags(["pagoda", "generated"]).refresh("30s").time("now-1h", "now")
               .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
               .with_variable(gd.QueryVariable("job").label("Job").datasource(source)
                              .query(f"label_values({board.job_metric}, job)")
                              .include_all(True).all_value(".+").multi(True)))
    ids = itertools.count(1)  # Grafana wants each panel's id unique in its dashboard
    for row in board.rows:
        builder = builder.with_row(gd.Row(row.title).id(next(ids)))
        for graph in row.graphs:
            panel = (timeseries.Panel().id(next(ids)).title(graph.title).description(graph.description).unit(graph.unit)
                     .datasource(source).height(8).span(12))
            for ref, query in zip("ABCDEFGH", graph.queries):
                panel = panel.with_target(prometheus.Dataquery().expr(query.expr).legend_format(query.legend)
                                          .ref_id(ref).datasource(source))
            builder = builder.with_panel(panel)
    return builder


def to_json(board: Board) -> str:
    """Grafana's dashboard JSON of ``board`` (sorted keys, two-space indent, final newline)."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return JSONEncoder(sort_keys=True, indent=2).encode(to_sdk(board).build()) + "\n"
