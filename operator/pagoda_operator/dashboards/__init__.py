"""Grafana dashboards as code: the replica, fleet and operator dashboards.

Each dashboard is a function returning a ``Board`` (rows of typed ``Graph`` panels, each
with its PromQL queries), built into Grafana's JSON by grafana-foundation-sdk
(``panels.to_sdk``). ``python -m pagoda_operator.dashboards`` writes them to
``charts/pagoda/dashboards/<uid>.json``; the chart ships them as ConfigMaps for Grafana's
sidecar (``grafanaDashboards.enabled``). Nobody edits the JSON: a test regenerates it and
compares (tests/chart/test_dashboards.py), and a test runs every panel's query against a real
Prometheus scraping a live replica, router and operator (tests/fleet/test_prometheus_scrape.py).

Invariants: every query selects a metric pagoda exports (the names of
``pagoda.serving.metrics``, the router's ``/metrics`` and ``pagoda_operator.metrics``); the
only template variables are ``$datasource``, ``$job`` (a regex over Prometheus' ``job``
label) and Grafana's ``$__rate_interval``.
"""
