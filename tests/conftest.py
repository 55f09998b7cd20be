"""Test-wide settings. TRITON_INTERPRET must be set before anything imports triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    """The default model folder (SmolLM2-135M-Instruct), imported once from the GGUF."""
    from pagoda.models.gguf_import import ensure_default_model

    return str(ensure_default_model())
