"""TensorRT-LLM's LLM-API dialect (the ``tensorrt_llm`` model of its ``all_models/llmapi``) on pagoda.

Pure functions over numpy arrays; ``trtllm_front.LLMAPIFront`` runs them in the front model
``model_repository/tensorrt_llm``. That interface has no batch dimension
(``max_batch_size: 0``), takes one prompt in ``text_input``, the sampling values as
``sampling_param_*`` scalars, ``streaming``, ``return_finish_reason`` /
``return_stop_reason`` / ``return_cumulative_logprob`` and a **stop request**: a request
with ``stop`` true cancels the requests that carry its request id.

Invariants:

- every input is applied, accepted or refused with a ``ValueError`` whose message starts
  with its name (``REFUSED``; ``sampling_param_best_of`` above 1), as in ``trtllm_dialect``;
- text is what the LLM API's ``CompletionOutput.text`` holds: the generated text so far,
  so a streaming response repeats the text before it (cumulative, not a delta); with
  ``sampling_param_exclude_input_from_output`` false (the interface's default) the prompt
  is in front, as the input's name says;
- ``finish_reason`` and ``stop_reason`` are ``str()`` of the LLM API's values (``"None"``
  until a completion finishes; ``stop_reason`` is the stop string or token id).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np

from pagoda.serving.trtllm_dialect import kv_cache_metrics

SCALAR_KEYS = {"sampling_param_temperature": "temperature", "sampling_param_top_k": "top_k",
               "sampling_param_top_p": "top_p", "sampling_param_frequency_penalty": "frequency_penalty",
               "sampling_param_presence_penalty": "presence_penalty", "sampling_param_max_tokens": "max_tokens",
               "sampling_param_seed": "seed"}
FLAGS = ("streaming", "sampling_param_exclude_input_from_output", "sampling_param_return_perf_metrics",
         "return_finish_reason", "return_stop_reason", "return_cumulative_logprob", "stop")
REFUSED = {
    "image_url": "multimodal prompts are not served",
    "lora_path": "adapters are loaded by name (pagoda serve --lora NAME=PATH, or pagoda lora load); "
                 "give lora_name only",
    "lora_ckpt_source": "adapters are loaded by name (pagoda serve --lora NAME=PATH, or pagoda lora load); "
                        "give lora_name only",
    "sampling_param_logits_post_processor_name": "named logits post-processors are not configurable",
}
OTHER_INPUTS = ("text_input", "sampling_param_stop", "sampling_param_best_of", "lora_id", "lora_name")
INPUTS = (*OTHER_INPUTS, *SCALAR_KEYS, *FLAGS, *REFUSED)

Item = dict[str, np.ndarray]


def _one(name: str, item: Item) -> Any:
    array = item.get(name)
    if array is None:
        return None
    if array.size != 1:
        raise ValueError(f"{name}: expected one value, got {array.size}")
    value = array.reshape(-1)[0]
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    return value.item() if hasattr(value, "item") else value


def is_stop_request(item: Item) -> bool:
    return bool(_one("stop", item))


def to_pagoda_inputs(item: Item, decoupled: bool) -> dict[str, np.ndarray]:
    """pagoda's model inputs for one LLM-API request. Raises ValueError naming the input."""
    for name, why in REFUSED.items():
        if name in item:
            raise ValueError(f"{name}: not supported: {why}")
    prompt = _one("text_input", item)
    if prompt is None:
        raise ValueError("text_input: required input is missing")
    best_of = _one("sampling_param_best_of", item)
    if best_of is not None and best_of != 1:
        raise ValueError(f"sampling_param_best_of: only 1 is accepted (pagoda returns every sample it draws), "
                         f"got {best_of!r}")
    streaming = bool(_one("streaming", item))
    if streaming and not decoupled:
        raise ValueError("streaming: streaming needs the decoupled model (pagoda serve --trtllm-decoupled), "
                         "as the LLM API backend's decoupled setting")
    values: dict[str, Any] = {"output_dialect": "vllm"}  # finish_reason "None" until the end, as str(None)
    for name, key in SCALAR_KEYS.items():
        value = _one(name, item)
        if value is not None:
            values[key] = value
    stop = item.get("sampling_param_stop")
    words = [] if stop is None else [bytes(v).decode() if isinstance(v, bytes) else str(v) for v in stop.reshape(-1)]
    if any(words):
        values["stop"] = [w for w in words if w]
    if _one("lora_name", item) is not None:
        values["lora_name"] = _one("lora_name", item)  # lora_id: TensorRT-LLM's cache key; pagoda keys by name
    perf = bool(_one("sampling_param_return_perf_metrics", item))
    flag = lambda name: np.array([bool(_one(name, item))])  # noqa: E731
    return {"text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
            "sampling_parameters": np.array([json.dumps(values).encode()], dtype=np.object_),
            "stream": np.array([streaming]),
            "exclude_input_in_output": np.array([bool(_one("sampling_param_exclude_input_from_output", item))]),
            "return_finish_reason": flag("return_finish_reason"), "return_stop_reason": flag("return_stop_reason"),
            "return_cumulative_logprob": flag("return_cumulative_logprob"),
            "return_num_input_tokens": np.array([True]), "return_num_output_tokens": np.array([True]),
            "return_num_cached_tokens": np.array([perf])}


def requested(item: Item) -> dict[str, bool]:
    return {"perf": bool(_one("sampling_param_return_perf_metrics", item)), "log_probs": False,
            "cumulative_logprob": bool(_one("return_cumulative_logprob", item))}


def to_llmapi_outputs(tensors: dict[str, np.ndarray], texts: list[str],
                      perf: Optional[dict[str, Any]]) -> Item:
    """The LLM-API model's outputs from one pagoda response, ``texts`` being each
    completion's text so far (cumulative)."""
    out = {"text_output": np.array([t.encode("utf-8") for t in texts], dtype=np.object_)}
    for name in ("finish_reason", "stop_reason"):
        if name in tensors:
            out[name] = tensors[name].reshape(-1)
    if "cumulative_logprob" in tensors:
        out["cumulative_logprob"] = tensors["cumulative_logprob"].astype(np.float32).reshape(-1)
    if perf is not None:
        for name, value in perf.items():
            dtype = np.float32 if isinstance(value, float) else np.int64 if name.endswith("_ns") else np.int32
            out[name] = np.array([value], dtype=dtype)
    return out


def llmapi_kv_metrics(num_input_tokens: int, num_output_tokens: int, num_cached_tokens: int,
                      block_size: int) -> dict[str, Any]:
    """The LLM API's per-request KV-cache metrics: ``kv_cache_reused_block`` /
    ``kv_cache_missed_block`` (prompt blocks found / not found in the prefix cache), the
    allocated blocks and the hit rate."""
    metrics = kv_cache_metrics(num_input_tokens, num_output_tokens, num_cached_tokens, block_size)
    reused = metrics.pop("kv_cache_reused_blocks")
    prompt_blocks = -(-num_input_tokens // block_size)
    return {**metrics, "kv_cache_reused_block": reused, "kv_cache_missed_block": prompt_blocks - reused}
