"""kopf handlers for LLMService: thin glue around reconcile.py and scaling.py.

`make_registry()` builds a fresh kopf registry (so tests can run several operators and
choose the timer interval). Handlers:
- startup: settings (kopf's progress and diff-base go to `pagoda.dev/` annotations,
  since our structural status schema would prune `status.kopf`), and the shared
  KubeClient in the memo;
- login: `memo.connection` if given (tests), else the service account, else kubeconfig;
- create / update / resume: parse the spec (SpecError -> `SpecValid=False` condition
  naming the field + kopf.PermanentError), then reconcile (idempotent);
- timer: the autoscaler tick (mode Deployment); also refreshes ready counts.

Memo keys (a `kopf.Memo`; per-object copies share these objects):
    connection     kopf.ConnectionInfo to use instead of the cluster's (optional)
    kube           KubeClient (made at startup unless given)
    fleet_store    a FleetStore for every LLMService (optional; tests inject a fake)
    clock          time source for the policy and drain timing (default time.time)
    metrics        the operator's OperatorMetrics (made at startup unless given)
    metrics_port   serve them on this port (`pagoda operator --metrics-port`; None/0: not served;
                   the server's runner is kept as `metrics_runner`)
Per object: `policies` (an AutoscalerPolicy per scaled pool, pools.py), made on first tick.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import kopf

from pagoda_operator import crd
from pagoda_operator.conditions import set_condition
from pagoda_operator.kube import SERVICE_ACCOUNT_TOKEN, KubeClient, KubeError
from pagoda_operator.load import FallbackFleetStore, MetricsScraper, RedisFleetStore
from pagoda_operator.metrics import OperatorMetrics, start_server
from pagoda_operator.render_redis import with_ca_file
from pagoda_operator.reconcile import reconcile
from pagoda_operator.scaling import autoscale_tick
from pagoda_operator.spec import LLMService, SpecError, parse_llmservice

ANNOTATION_PREFIX = "pagoda.dev"
DEFAULT_AUTOSCALE_INTERVAL_S = 15.0


def _clock(memo: Any):
    return getattr(memo, "clock", None) or time.time


def _parse_or_fail(body: Any, status: Any, patch: kopf.Patch, memo: Any) -> LLMService:
    generation = int(body.get("metadata", {}).get("generation", 0) or 0)
    try:
        svc = parse_llmservice(dict(body))
    except SpecError as error:
        patch.status["conditions"] = set_condition(
            status.get("conditions"), type_="SpecValid", status="False", reason="InvalidSpec",
            message=str(error), generation=generation, now=_clock(memo)())
        patch.status["observedGeneration"] = generation
        kopf.warn(dict(body), reason="InvalidSpec", message=str(error))
        raise kopf.PermanentError(f"invalid LLMService spec: {error}") from error
    return svc


async def _fleet_store(memo: Any, svc: LLMService):
    """The injected store, or one per (Redis URL, password) with a /metrics fallback."""
    injected = getattr(memo, "fleet_store", None)
    if injected is not None:
        return injected
    password = None
    if svc.spec.redis.password_secret_name:
        secret = await memo.kube.get("v1", "Secret", svc.namespace,
                                     svc.spec.redis.password_secret_name)
        data = ((secret or {}).get("data") or {}).get(svc.spec.redis.password_secret_key)
        password = base64.b64decode(data).decode() if data else None
    stores = memo.setdefault("fleet_stores", {})
    url = with_ca_file(svc, svc.spec.redis.url)
    key = (url, password)
    if key not in stores:
        stores[key] = FallbackFleetStore(RedisFleetStore.from_url(url, password),
                                         MetricsScraper())
    return stores[key]


def make_registry(autoscale_interval: float = DEFAULT_AUTOSCALE_INTERVAL_S) -> kopf.OperatorRegistry:
    """Build the operator's handler registry.

    Args:
        autoscale_interval: seconds between autoscaler ticks per LLMService.
    """
    registry = kopf.OperatorRegistry()
    resource = dict(group=crd.GROUP, version=crd.VERSION, plural=crd.PLURAL)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
        settings.posting.level = 20  # logging.INFO: our decisions become events
        settings.watching.server_timeout = 300
        memo.setdefault("fleet_stores", {})
        if getattr(memo, "metrics", None) is None:
            memo.metrics = OperatorMetrics()
        if getattr(memo, "metrics_port", None):
            memo.metrics_runner = await start_server(memo.metrics, getattr(memo, "metrics_host", "0.0.0.0"),
                                                     memo.metrics_port)
        if getattr(memo, "kube", None) is None:
            info = getattr(memo, "connection", None)
            token_path = None
            if info is None:
                info = kopf.login_with_service_account(settings=settings)
                token_path = SERVICE_ACCOUNT_TOKEN if info is not None else None
            if info is None:
                info = kopf.login_with_kubeconfig(settings=settings)
            if info is None:
                raise kopf.PermanentError("no Kubernetes credentials (service account or kubeconfig)")
            memo.kube = KubeClient(info, token_path=token_path)

    @kopf.on.login(registry=registry)
    def login(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any):
        if getattr(memo, "connection", None) is not None:
            return memo.connection
        return (kopf.login_with_service_account(settings=settings)
                or kopf.login_with_kubeconfig(settings=settings))

    @kopf.on.cleanup(registry=registry)
    async def close(memo: kopf.Memo, **_: Any) -> None:
        runner = getattr(memo, "metrics_runner", None)
        if runner is not None:
            await runner.cleanup()
        kube = getattr(memo, "kube", None)
        if kube is not None and not getattr(memo, "keep_kube", False):
            await kube.close()

    @kopf.on.resume(**resource, registry=registry)
    @kopf.on.create(**resource, registry=registry)
    @kopf.on.update(**resource, field="spec", registry=registry)
    async def reconcile_llmservice(body: kopf.Body, status: kopf.Status, patch: kopf.Patch,
                                   memo: kopf.Memo, logger: Any, **_: Any) -> None:
        svc = _parse_or_fail(body, status, patch, memo)
        try:
            result = await reconcile(memo.kube, svc)
        except KubeError as error:
            raise kopf.TemporaryError(f"applying children failed: {error}", delay=10) from error
        now = _clock(memo)()
        conditions = set_condition(status.get("conditions"), type_="SpecValid", status="True",
                                   reason="Valid", message="spec is valid",
                                   generation=svc.generation, now=now)
        patch.status["conditions"] = conditions
        patch.status["observedGeneration"] = svc.generation
        patch.status["mode"] = svc.spec.mode
        patch.status["routerService"] = svc.name
        replicas: dict[str, int] = {"desired": result.desired_replicas}
        if result.ready_replicas is not None:
            replicas["ready"] = result.ready_replicas
        patch.status["replicas"] = replicas
        if result.prefill is not None:
            patch.status["prefill"] = {"replicas": result.prefill}
            memo.metrics.set_replicas(svc.namespace, svc.name, "prefill", result.prefill.get("desired"),
                                      result.prefill.get("ready"))
        memo.metrics.set_replicas(svc.namespace, svc.name, "decode" if result.prefill is not None else "replicas",
                                  result.desired_replicas, result.ready_replicas)
        changed = {k: v for k, v in result.actions.items() if v != "unchanged"}
        if changed:
            kopf.info(dict(body), reason="Reconciled",
                      message=", ".join(f"{k} {v}" for k, v in sorted(changed.items())))
        logger.info(f"reconciled: {result.actions}")

    @kopf.timer(**resource, interval=autoscale_interval, initial_delay=autoscale_interval,
                registry=registry)
    async def autoscale(body: kopf.Body, status: kopf.Status, patch: kopf.Patch,
                        memo: kopf.Memo, logger: Any, **_: Any) -> None:
        try:
            svc = parse_llmservice(dict(body))
        except SpecError:
            return  # the reconcile handler has reported it
        if svc.spec.mode != "Deployment":
            return
        if getattr(memo, "policies", None) is None:
            memo.policies = {}
        try:
            result = await autoscale_tick(kube=memo.kube, fleet=await _fleet_store(memo, svc),
                                          policies=memo.policies, svc=svc, status=dict(status),
                                          clock=_clock(memo))
        except KubeError as error:
            logger.warning(f"autoscaler tick failed: {error}")
            memo.metrics.record_tick(svc.namespace, svc.name, (), ok=False)
            return
        memo.metrics.record_tick(svc.namespace, svc.name, result.reports)
        for key, value in result.status.items():
            patch.status[key] = value
        for reason, message in result.events:
            kopf.info(dict(body), reason=reason, message=message)

    @kopf.on.delete(**resource, optional=True, registry=registry)  # optional: no finalizer
    async def forget_llmservice(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        memo.metrics.forget(body["metadata"].get("namespace", ""), body["metadata"]["name"])

    return registry
