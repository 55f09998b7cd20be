"""KV transfer between replicas: the ``KVConnector`` seam and its TCP implementation (docs/kv_transfer.md)."""
