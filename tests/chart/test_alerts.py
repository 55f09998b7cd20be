"""The chart's PrometheusRule, checked by Prometheus' own tool.

The rule groups are rendered with helm (default thresholds, and non-default ones), then
`promtool check rules` parses them and `promtool test rules` (tests/chart/alerts_test.yaml)
fires every alert from synthetic series, with a neighbour series that must not fire beside
most. Every alert has a runbook section in docs/observability.md. Skips when helm or
promtool (Debian's `prometheus` package; setup.sh installs it) are absent.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from tests.chart.test_chart import CHART, REPO, run_helm  # noqa: E402

UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")
RUNBOOKS = REPO / "docs" / "observability.md"


def promtool() -> str:
    path = shutil.which("promtool")
    if not path:
        pytest.skip("promtool not installed (apt-get install -y prometheus; setup.sh does it)")
    return path


def rendered_rule(values: dict | None = None, folder: Path | None = None) -> dict:
    args = ["template", "pagoda", str(CHART), "--show-only", "templates/prometheusrule.yaml",
            "--set", "prometheusRule.enabled=true"]
    if values:  # a file: `--set` passes 0.5 as a string, which the values schema refuses
        path = folder / "values.yaml"
        path.write_text(yaml.safe_dump({"prometheusRule": values}))
        args += ["-f", str(path)]
    docs = [d for d in yaml.safe_load_all(run_helm(*args)) if d]
    assert len(docs) == 1 and docs[0]["kind"] == "PrometheusRule", docs
    return docs[0]


def write_rules(rule: dict, folder: Path) -> Path:
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def alert_names(rule: dict) -> list[str]:
    return [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]


def test_rule_is_opt_in():
    out = run_helm("template", "pagoda", str(CHART))
    assert "kind: PrometheusRule" not in out


@pytest.mark.parametrize("values", [None, {"ttftP99SLOSeconds": 0.5, "kvCacheUsageHigh": 0.8,
                                             "replicaJob": "llm/.*", "labels": {"release": "prom"}}])
def test_promtool_check_rules_accepts_the_rendered_groups(tmp_path, values):
    rule = rendered_rule(values, tmp_path)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    result = subprocess.run([promtool(), "check", "rules", str(write_rules(rule, tmp_path))],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_names(rule))} rules found" in result.stdout
    exprs = " ".join(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"])
    if values:
        assert "> 0.5" in exprs and "> 0.8" in exprs and 'job=~"llm/.*"' in exprs
        assert rule["metadata"]["labels"]["release"] == "prom"


def test_promtool_unit_tests_fire_every_alert(tmp_path):
    rule = rendered_rule()
    write_rules(rule, tmp_path)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    result = subprocess.run([promtool(), "test", "rules", UNIT_TESTS.name], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case.get("exp_alerts")}
    assert fired == set(alert_names(rule)), "every alert needs a unit test that fires it"


def test_every_alert_has_a_runbook():
    text = RUNBOOKS.read_text()
    headings = {re.sub(r"[^a-z0-9]", "", h.lower()) for h in re.findall(r"^### (.+)$", text, re.M)}
    for group in rendered_rule()["spec"]["groups"]:
        for rule in group["rules"]:
            anchor = rule["annotations"]["runbook"].split("#", 1)[1]
            assert rule["annotations"]["runbook"].startswith("docs/observability.md#")
            assert anchor in headings, f"{rule['alert']}: no '### {rule['alert']}' runbook in {RUNBOOKS}"
