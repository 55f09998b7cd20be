"""Model families (by architecture name, see ``registry``), weight loading, GGUF import and tokenization.

Entry points: ``load_model(path)`` for a Hugging Face folder, ``config_from_pretrained``
/ ``config_from_dict`` for its config, ``ensure_default_model()``
for the bundled SmolLM2 (imported once from its GGUF), ``Tokenizer.from_pretrained(path)``
and ``IncrementalDetokenizer`` for text. ``tokenizer`` and ``gguf_import`` are not
imported here so that loading weights never pulls in the ``gguf`` package.
"""

from pagoda.models.config import ModelConfig
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.loader import load_model
from pagoda.models.registry import SUPPORTED_ARCHITECTURES, build_model, config_from_dict, config_from_pretrained

__all__ = ["ModelConfig", "LlamaForCausalLM", "load_model", "SUPPORTED_ARCHITECTURES", "build_model",
           "config_from_dict", "config_from_pretrained"]
