"""Contracts shared by the engine, the fleet and the operator: block hashing, KV events, Redis keys, errors."""
