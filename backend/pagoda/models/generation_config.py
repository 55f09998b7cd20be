"""A model's own sampling defaults, from its ``generation_config.json`` (as vLLM's ``--generation-config auto``).

Model authors ship the settings their model is meant to sample with (Qwen3: temperature 0.6,
top_p 0.95, top_k 20). ``generation_defaults`` reads them under ``SamplingParams``' names
(``max_new_tokens`` is ``max_tokens``); the engine applies them to the fields a request
leaves unset (``SamplingParams.with_defaults``). Only these fields are read, as vLLM reads
them: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``max_new_tokens``. A missing file, or a file without them, gives no defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

# generation_config.json name -> SamplingParams name
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: Union[str, Path]) -> dict[str, Any]:
    """The sampling defaults a model folder declares (``{}`` when none).

    Raises:
        ValueError: the file is not a JSON object.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return {ours: raw[theirs] for theirs, ours in FIELDS.items() if raw.get(theirs) is not None}
