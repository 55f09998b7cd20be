"""A real Prometheus scrapes a live replica, router and operator; every dashboard query and alert runs on it.

One module-scoped stack: Redis, ``pagoda serve`` (default SmolLM2 on CPU, ``max_num_seqs=4``,
runtime LoRA on so ``vllm:lora_requests_info`` exists, publishing to Redis), ``pagoda router``
in front of it (Redis, the index mirror), the operator (kopf over the emulated API of
tests/operator, a fake fleet loaded enough to scale up once, ``pagoda_operator_*`` on its
metrics port), and Debian's ``prometheus`` scraping the three every second with the chart's
relabelling (the router's re-exported ``vllm:`` series dropped) and the chart's alert rules
loaded. A few requests go through the router's OpenAI door (each with a timeout), then the
test waits for two more scrapes of every target.

Then: every panel query of every committed dashboard (``$job`` -> ``.+``, the rate interval ->
the whole test's window) returns at least one series, so no panel reads a metric pagoda does
not export; and every alert expression is accepted by Prometheus' query API and evaluated by
its rule manager without error. Skips without ``prometheus``, Redis, kopf/kmock (and, for the
alerts, helm).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from pagoda.fleet.gate.flow_control import FlowOptions
from pagoda.serving.launch.launcher import TritonServer, find_free_port
from pagoda.serving.launch.serve_options import ServeOptions
from tests.chart.test_dashboards import dashboard_files, panel_queries, substitute

pytestmark = [pytest.mark.server, pytest.mark.redis]

MODEL_NAME = "smol"
SCRAPE_INTERVAL_S = 1
PREFIX = "Pagoda observability check. " + " ".join(f"Line {i}: the tea house opens at {i} o'clock." for i in range(12))


def _get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _wait(predicate, what: str, timeout_s: float = 60.0, step=None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if step is not None:
            step()
        if predicate():
            return
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


class Prometheus:
    """A throwaway ``prometheus`` server (temp storage, loopback) and its HTTP API."""

    def __init__(self, folder: Path, targets: dict[str, str], rules: Path | None) -> None:
        self.port = find_free_port()
        jobs = [{"job_name": job, "static_configs": [{"targets": [target]}]} for job, target in targets.items()]
        for job in jobs:
            if job["job_name"].endswith("-router"):  # as the chart's router ServiceMonitor
                job["metric_relabel_configs"] = [{"source_labels": ["__name__"], "regex": "vllm:.*",
                                                  "action": "drop"}]
        config = {"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": "1s"},
                  "scrape_configs": jobs, **({"rule_files": [str(rules)]} if rules else {})}
        (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = open(folder / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [shutil.which("prometheus"), f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        _wait(self._ready, "prometheus is ready", timeout_s=60)

    def _ready(self) -> bool:
        assert self.process.poll() is None, f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        return _get_json(f"http://127.0.0.1:{self.port}/api/v1/{path}" + (f"?{query}" if query else ""))

    def last_scrapes(self) -> dict[str, tuple[str, str]]:
        targets = self.api("targets")["data"]["activeTargets"]
        return {t["labels"]["job"]: (t["lastScrape"], t["health"]) for t in targets}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def _rendered_rules(folder: Path) -> Path | None:
    """The chart's alert groups (helm), or None without helm. The TTFT SLO is set to what a
    shared 2-core CPU can promise (a cold first request there can take seconds): 60 s."""
    from tests.chart.test_alerts import rendered_rule, write_rules

    try:
        return write_rules(rendered_rule({"ttftP99SLOSeconds": 60}, folder), folder)
    except pytest.skip.Exception:
        return None


@contextlib.contextmanager
def _operator(metrics_port: int):
    """The kopf operator over the emulated API, one LLMService scaled up once by a busy fake fleet."""
    pytest.importorskip("kopf")
    pytest.importorskip("kmock")
    harness = str(Path(__file__).resolve().parents[1] / "operator")
    if harness not in sys.path:  # as tests/operator/conftest.py: its helpers import each other by name
        sys.path.insert(0, harness)
    from operator_harness import LLMS, NS, Cluster, FakeClock, FakeDeploymentController, FakeFleet, Operator
    from pagoda_operator import crd

    cluster = Cluster().start()
    fleet = FakeFleet()
    busy = {"waiting": 20.0, "running": 4.0, "kv_usage": 0.9, "ts": 0.0}
    controller = FakeDeploymentController(cluster, fleet, "smol-replicas",
                                          on_new_pod=lambda name: fleet.set_load(name, **busy))
    operator = Operator(cluster, fleet=fleet, clock=FakeClock(), interval=0.2)
    operator.memo.metrics_port, operator.memo.metrics_host = metrics_port, "127.0.0.1"
    try:
        with operator:
            cluster.create(LLMS, {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                  "metadata": {"name": "smol", "namespace": NS},
                                  "spec": {"image": "pagoda:0.1", "replicas": {"min": 1, "max": 2},
                                           "model": {"name": MODEL_NAME, "storageUri": "pvc://models/smollm2"}}})
            _wait(lambda: cluster.events("ScaledUp"), "the operator scales up", step=controller.step)
            yield controller
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def scraped(redis_server, smollm2_path, tmp_path_factory):
    """The whole stack after its requests and two more scrapes: (Prometheus, the rules file or None)."""
    if not shutil.which("prometheus"):
        pytest.skip("prometheus not installed (apt-get install -y prometheus; setup.sh does it)")
    from pagoda.fleet.service import BackgroundRouter, RouterOptions

    folder = tmp_path_factory.mktemp("prometheus")
    options = ServeOptions(model=smollm2_path, http_port=find_free_port(), grpc_port=find_free_port(),
                           metrics_port=find_free_port(), max_model_len=512, max_num_seqs=4, startup_timeout_s=600,
                           redis_url=redis_server.url, replica_id="r0", fleet_model=MODEL_NAME,
                           engine_args={"enable_lora": "true", "allow_runtime_lora": "true"})
    replica = TritonServer(options, log_path=str(folder / "replica.log"))
    operator_port = find_free_port()
    with contextlib.ExitStack() as stack:
        replica.start()
        stack.callback(replica.stop)
        spec = f"id=r0,grpc={replica.grpc_url},http={replica.http_url},metrics={options.host}:{options.metrics_port}"
        router = stack.enter_context(BackgroundRouter(RouterOptions(
            model_dir=smollm2_path, model_name=MODEL_NAME, replicas=spec, redis_url=redis_server.url,
            host="127.0.0.1", http_port=0, grpc_port=0, health_interval_s=0.5, registry_interval_s=0.2,
            flow=FlowOptions(queue_size=16))))  # flow control on: the fleet dashboard's tenant queues
        controller = stack.enter_context(_operator(operator_port))
        rules = _rendered_rules(folder)
        prometheus = Prometheus(folder, {"smol-replicas": f"{options.host}:{options.metrics_port}",
                                         "smol-router": router.http_url,
                                         "pagoda-operator": f"127.0.0.1:{operator_port}"}, rules)
        stack.callback(prometheus.stop)
        jobs = {"smol-replicas", "smol-router", "pagoda-operator"}
        _wait(lambda: {job for job, (_, health) in prometheus.last_scrapes().items() if health == "up"} == jobs,
              "every target is up", step=controller.step)
        _wait(lambda: router.run(lambda: router.service.router.fleet.follower.is_synced), "the index mirror syncs")
        for i in range(4):  # one prefix: prefix-cache hits on the replica, exact matches in the router
            body = json.dumps({"model": MODEL_NAME, "prompt": f"{PREFIX} Question {i}:", "max_tokens": 6,
                               "temperature": 0}).encode()
            request = urllib.request.Request(f"http://{router.http_url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                assert response.status == 200 and json.loads(response.read())["choices"][0]["text"]
        for _ in range(2):  # two more scrapes of every target after the last request
            before = prometheus.last_scrapes()
            _wait(lambda: all(prometheus.last_scrapes()[job][0] != seen for job, (seen, _) in before.items()),
                  "a scrape of every target", timeout_s=30, step=controller.step)
        yield prometheus, rules


def test_every_dashboard_panel_query_returns_series(scraped):
    prometheus, _ = scraped
    window = "10m"  # the whole test: the stack started minutes ago at most
    empty, checked = [], 0
    for name, board in dashboard_files().items():
        for title, expr in panel_queries(board):
            answer = prometheus.api("query", query=substitute(expr, window=window))
            assert answer["status"] == "success", (name, title, expr, answer)
            checked += 1
            if not answer["data"]["result"]:
                empty.append(f"{name} / {title}: {expr}")
    up = prometheus.api("query", query="up")["data"]["result"]
    assert not empty, "panels with no series (a metric pagoda does not export?):\n" + "\n".join(empty) + \
        f"\nup: {up}\nprometheus log: {Path(prometheus.log.name).read_text()[-3000:]}"
    assert checked >= 60


def test_every_alert_expression_runs_on_prometheus(scraped):
    prometheus, rules = scraped
    if rules is None:
        pytest.skip("helm not installed: the chart's rules could not be rendered")
    import yaml

    exprs = [r["expr"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]]
    for expr in exprs:
        answer = prometheus.api("query", query=expr)
        assert answer["status"] == "success", (expr, answer)
    # The rule manager evaluated every rule (the scrapes above took longer than its 1 s interval).
    loaded = [r for g in prometheus.api("rules")["data"]["groups"] for r in g["rules"]]
    assert len(loaded) == len(exprs) and all(r["health"] == "ok" for r in loaded), \
        [(r["name"], r["health"], r.get("lastError")) for r in loaded]
    # A healthy stack: no alert is even pending (the replica is up, Redis reachable, the index synced).
    active = [(r["name"], r["state"]) for r in loaded if r["state"] != "inactive"]
    assert not active, active
