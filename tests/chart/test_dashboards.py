"""The Grafana dashboards: generated, current, valid PromQL, and shipped by the chart.

- the committed charts/pagoda/dashboards/*.json are what ``python -m pagoda_operator.dashboards``
  generates (grafana-foundation-sdk; skips without it);
- every panel query, Grafana's variables substituted, parses (``promtool check rules`` on
  one recording rule per query; skips without promtool) — that the queries return series on
  a live replica, router and operator is tests/fleet/test_prometheus_scrape.py;
- ``grafanaDashboards.enabled`` renders one ConfigMap per file with the sidecar's label and
  the file's JSON unchanged.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

yaml = pytest.importorskip("yaml")

from tests.chart.test_alerts import promtool  # noqa: E402
from tests.chart.test_chart import CHART, run_helm, validate_builtin  # noqa: E402

DASHBOARDS = CHART / "dashboards"


def dashboard_files() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def substitute(expr: str, window: str = "5m", job: str = ".+") -> str:
    """A panel query as Grafana sends it: its variables replaced."""
    return expr.replace("$__rate_interval", window).replace("$job", job)


def test_committed_dashboards_are_the_generated_ones():
    pytest.importorskip("grafana_foundation_sdk")
    from pagoda_operator.dashboards.__main__ import generated

    files = {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}
    assert files == generated(), "regenerate: python -m pagoda_operator.dashboards"


def test_three_dashboards_with_unique_uids_and_panel_ids():
    boards = dashboard_files()
    assert set(boards) == {"pagoda-replica.json", "pagoda-fleet.json", "pagoda-operator.json"}
    for name, board in boards.items():
        assert board["uid"] == name.removesuffix(".json")
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and 0 not in ids, name
        assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "job"]
        assert len(panel_queries(board)) >= 10, name


def test_every_tenant_queue_series_has_a_fleet_panel():
    """Each series the router's flow control exports (``FlowControl.metric_lines``, every one
    present once a tenant's request was released) is read by some panel of the fleet dashboard."""
    import asyncio

    from pagoda.fleet.gate.flow_control import FlowControl, FlowOptions, Saturation
    from pagoda.fleet.routing.replicas import ReplicaSet

    options = FlowOptions(queue_size=4)
    flow = FlowControl(options, Saturation(options, lambda: []))
    replicas = ReplicaSet("static")
    replicas.set_members([("r0", {"grpc": "h:1", "http": "h:2"})])
    asyncio.run(flow.wait(flow.turn("tenant", 0, 10, None), replicas))  # room: released at once
    exported = {line.split()[2] for line in flow.metric_lines() if line.startswith("# TYPE")}
    assert len(exported) >= 5, exported
    read = {name for _, expr in panel_queries(dashboard_files()["pagoda-fleet.json"])
            for name in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)}
    missing = {name for name in exported if not {name, f"{name}_bucket", f"{name}_count"} & read}
    assert not missing, f"router queue series no fleet panel reads: {sorted(missing)}"


def test_every_panel_query_is_valid_promql(tmp_path):
    rules = [{"record": f"pagoda:panel_{i}", "expr": substitute(expr)}
             for i, (_, expr) in enumerate(q for b in dashboard_files().values() for q in panel_queries(b))]
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_chart_ships_each_dashboard_as_a_sidecar_configmap():
    assert "grafana_dashboard" not in run_helm("template", "pagoda", str(CHART))  # opt-in
    out = run_helm("template", "pagoda", str(CHART), "--show-only", "templates/dashboards.yaml",
                   "--set", "grafanaDashboards.enabled=true", "--set", "grafanaDashboards.annotations.folder=LLM")
    maps = [d for d in yaml.safe_load_all(out) if d]
    files = dashboard_files()
    assert {m["metadata"]["name"] for m in maps} == {f"pagoda-dashboard-{n.removesuffix('.json')}" for n in files}
    for config_map in maps:
        validate_builtin(config_map)
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"] == {"folder": "LLM"}
        (name, text), = config_map["data"].items()
        assert json.loads(text) == files[name]
