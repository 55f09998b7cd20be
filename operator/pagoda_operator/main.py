"""`pagoda operator`: run the LLMService operator (kopf) until interrupted.

Usage:
    pagoda operator [--namespace NS ...] [--autoscale-interval S] [--liveness URL]
                    [--metrics-port PORT] [--verbose]

Without --namespace it serves the whole cluster (needs the chart's ClusterRole); with
one or more it serves only those (the chart's per-namespace Roles suffice). Credentials:
the pod's service account in a cluster, else the current kubeconfig context.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

from pagoda_operator.handlers import DEFAULT_AUTOSCALE_INTERVAL_S, make_registry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda operator",
                                     description="Run the pagoda LLMService operator.")
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="namespace to serve (repeatable); default: all namespaces")
    parser.add_argument("--autoscale-interval", type=float, default=DEFAULT_AUTOSCALE_INTERVAL_S,
                        help="seconds between autoscaler ticks (default: %(default)s)")
    parser.add_argument("--liveness", default=None,
                        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve the operator's Prometheus metrics (pagoda_operator_*) on this port; "
                             "0: off (default)")
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pagoda operator`. Returns the process exit status."""
    args = build_parser().parse_args(argv)
    if args.autoscale_interval <= 0:
        build_parser().error("--autoscale-interval must be > 0")
    kopf.configure(verbose=args.verbose)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    registry = make_registry(autoscale_interval=args.autoscale_interval)
    try:
        asyncio.run(kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
            memo=kopf.Memo(metrics_port=args.metrics_port),
        ))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
