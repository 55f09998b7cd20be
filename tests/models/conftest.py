"""Session fixtures for the model tests: the default SmolLM2, imported once and cached.

The imported folder lives under ``~/.cache/pagoda`` (or ``$PAGODA_MODEL_DIR``), so only
the first run on a machine pays for the GGUF import. The loaded models (ours, and
transformers' reference read from the GGUF, the slowest part of these tests) are ~0.5 GB
each in fp32: they are built lazily, once per module that uses them (today only
test_llama_vs_hf.py), and freed when it ends rather than held for the rest of the session.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.models import load_model
from pagoda.models.gguf_import import find_smollm2_gguf
from pagoda.models.testing import ensure_test_model
from pagoda.models.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_dir():
    return ensure_test_model()


@pytest.fixture(scope="session")
def smollm2_gguf():
    return find_smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def hf_gguf_model(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
