"""KV connectors by backend name: configuration picks one, every caller builds it here.

``make_kv_connector(backend, engine, listen=...)`` builds the ``KVConnector`` named by
``backend`` (``pagoda serve --kv-transfer-backend``, config parameter
``kv_transfer_backend``, ``pagoda bench kv-transfer --backend``):

- ``tcp``: ``tcp.TcpKVConnector``, between processes on any machines (the default).
- ``nixl``: ``nixl.NixlKVConnector``, the same control path with the bytes read over NIXL
  (UCX: RDMA, NVLink, shared memory, TCP); needs the optional ``nixl`` package.

A new backend (shared memory on one host, LMCache) is one more entry: a class taking
``(engine, listen=None, **limits)`` that implements ``connector.KVConnector``. Modules are
imported on use, so an optional backend's package is needed only when it is chosen.
"""

from __future__ import annotations

import importlib

DEFAULT_KV_TRANSFER_BACKEND = "tcp"
KV_CONNECTOR_BACKENDS = {
    "tcp": ("pagoda.engine.kv_transfer.tcp", "TcpKVConnector"),
    "nixl": ("pagoda.engine.kv_transfer.nixl", "NixlKVConnector"),
}


def check_kv_transfer_backend(backend: str) -> str:
    """``backend`` if it names a connector; ValueError naming the choices otherwise."""
    if backend not in KV_CONNECTOR_BACKENDS:
        raise ValueError(f"KV transfer backend {backend!r}: must be one of {', '.join(KV_CONNECTOR_BACKENDS)}")
    return backend


def make_kv_connector(backend: str, engine, **kwargs):
    """The connector ``backend`` names, over ``engine``; ``kwargs`` go to its constructor
    (``listen``, ``ttl_s``, ...).

    Raises:
        ValueError: an unknown backend (naming the choices), or the backend cannot run here
            (``nixl`` without its package: the message says how to install it).
    """
    module_name, class_name = KV_CONNECTOR_BACKENDS[check_kv_transfer_backend(backend)]
    return getattr(importlib.import_module(module_name), class_name)(engine, **kwargs)
