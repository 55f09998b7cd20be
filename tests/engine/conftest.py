"""Fixtures shared by the engine tests."""

import pytest

from tests.engine.hf_reference import make_random_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, smollm2_path):
    """A tiny random Llama (GQA 3, head dim 64) with the default model's tokenizer."""
    return str(make_random_model(tmp_path_factory.mktemp("m") / "llama", "llama-gqa3-hd64", smollm2_path))
