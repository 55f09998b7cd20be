"""KV transfer between replicas: the ``KVConnector`` seam, its registry and its TCP and NIXL
implementations (docs/kv_transfer.md)."""
