"""Fixtures for the operator tests. Integration tests need kopf + kmock and skip without."""

from __future__ import annotations

import os
import sys

import pytest

# The suite runs with --import-mode=importlib: make this folder's helpers importable.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cluster():
    """An emulated Kubernetes API server (kmock), started and stopped per test."""
    pytest.importorskip("kopf")
    pytest.importorskip("kmock")
    from operator_harness import Cluster

    instance = Cluster().start()
    try:
        yield instance
    finally:
        instance.stop()
