"""TensorRT-LLM's LLM-API dialect (the ``tensorrt_llm`` model of its ``all_models/llmapi``).

The only reader of this vocabulary. Pure functions over numpy arrays;
``serving.trtllm_front.LLMAPIFront`` runs them in the front model
``model_repository/tensorrt_llm``. That interface has no batch dimension (``max_batch_size:
0``), takes one prompt in ``text_input``, the sampling values as ``sampling_param_*``
scalars, ``streaming``, ``return_finish_reason`` / ``return_stop_reason`` /
``return_cumulative_logprob`` and a **stop request**: a request with ``stop`` true cancels
the requests that carry its request id.

Invariants:

- every input is applied, accepted or refused with a ``ValueError`` whose message starts
  with its name (``REFUSED``; ``sampling_param_best_of`` above 1), as in ``trtllm``;
- text is what the LLM API's ``CompletionOutput.text`` holds: the generated text so far,
  so a streaming response repeats the text before it (cumulative, not a delta); with
  ``sampling_param_exclude_input_from_output`` false (the interface's default) the prompt
  is in front, as the input's name says;
- ``image_url`` (STRING ``[-1]``, optional; TensorRT-LLM's 2026 multimodal input): one URL
  per image, in prompt order, read by ``dialects.media`` (``data:image/...;base64,`` URLs;
  ``http(s)`` only with the server's allow-list, ``--allowed-media-domains``); the text holds
  the model's image placeholder once per image (as the vLLM dialect's ``image`` input: the
  engine expands and checks them); a bad URL is refused naming ``image_url[i]``;
- ``finish_reason`` and ``stop_reason`` are ``str()`` of the LLM API's values (``"None"``
  until a completion finishes; ``stop_reason`` is the stop string or token id): the vLLM
  output dialect.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from pagoda.serving.dialects.media import image_url_bytes
from pagoda.serving.dialects.tensors import DialectRequest, Item, flag, number, one, strings, string_array, text
from pagoda.serving.dialects.trtllm import kv_cache_metrics

SCALAR_KEYS: dict[str, tuple[str, type]] = {
    "sampling_param_temperature": ("temperature", float), "sampling_param_top_k": ("top_k", int),
    "sampling_param_top_p": ("top_p", float), "sampling_param_frequency_penalty": ("frequency_penalty", float),
    "sampling_param_presence_penalty": ("presence_penalty", float),
    "sampling_param_max_tokens": ("max_tokens", int), "sampling_param_seed": ("seed", int)}
FLAGS = ("streaming", "sampling_param_exclude_input_from_output", "sampling_param_return_perf_metrics",
         "return_finish_reason", "return_stop_reason", "return_cumulative_logprob", "stop")
REFUSED = {
    "lora_path": "adapters are loaded by name (pagoda serve --lora NAME=PATH, or pagoda lora load); "
                 "give lora_name only",
    "lora_ckpt_source": "adapters are loaded by name (pagoda serve --lora NAME=PATH, or pagoda lora load); "
                        "give lora_name only",
    "sampling_param_logits_post_processor_name": "named logits post-processors are not configurable",
}
OTHER_INPUTS = ("text_input", "image_url", "sampling_param_stop", "sampling_param_best_of", "lora_id", "lora_name")
INPUTS = (*OTHER_INPUTS, *SCALAR_KEYS, *FLAGS, *REFUSED)


def is_stop_request(item: Item) -> bool:
    return flag("stop", item.get("stop"))


def read_item(item: Item, decoupled: bool, fetcher: Optional[Any] = None) -> DialectRequest:
    """One LLM-API request in pagoda's names (``fetcher``: fetches ``http(s)`` image URLs, None:
    refused). Raises ValueError naming the input."""
    for name, why in REFUSED.items():
        if name in item:
            raise ValueError(f"{name}: not supported: {why}")
    prompt = text("text_input", item.get("text_input"))
    if prompt is None:
        raise ValueError("text_input: required input is missing")
    best_of = one("sampling_param_best_of", item.get("sampling_param_best_of"))
    if best_of is not None and best_of != 1:
        raise ValueError(f"sampling_param_best_of: only 1 is accepted (pagoda returns every sample it draws), "
                         f"got {best_of!r}")
    streaming = flag("streaming", item.get("streaming"))
    if streaming and not decoupled:
        raise ValueError("streaming: streaming needs the decoupled model (pagoda serve --trtllm-decoupled), "
                         "as the LLM API backend's decoupled setting")
    values: dict[str, Any] = {}
    for name, (key, kind) in SCALAR_KEYS.items():
        value = number(name, item.get(name), kind)
        if value is not None:
            values[key] = value
    stop = strings("sampling_param_stop", item.get("sampling_param_stop"))
    if stop:
        values["stop"] = stop
    options: dict[str, Any] = {"output_dialect": "vllm"}  # finish_reason "None" until the end, as str(None)
    lora_name = text("lora_name", item.get("lora_name"))
    if lora_name is not None:
        options["lora_name"] = lora_name  # lora_id: TensorRT-LLM's cache key; pagoda keys by name
    flags = {"stream": streaming,
             "exclude_input_in_output": flag("sampling_param_exclude_input_from_output",
                                             item.get("sampling_param_exclude_input_from_output")),
             **{name: flag(name, item.get(name)) for name in
                ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob")},
             "return_num_input_tokens": True, "return_num_output_tokens": True,
             "return_num_cached_tokens": flag("sampling_param_return_perf_metrics",
                                              item.get("sampling_param_return_perf_metrics"))}
    urls = strings("image_url", item.get("image_url")) or []
    images = [image_url_bytes(url, f"image_url[{i}]", fetcher) for i, url in enumerate(urls)]
    return DialectRequest(prompt=prompt, sampling=values, options=options, flags=flags, images=images)


def requested(item: Item) -> dict[str, bool]:
    return {"perf": flag("sampling_param_return_perf_metrics", item.get("sampling_param_return_perf_metrics")),
            "log_probs": False,
            "cumulative_logprob": flag("return_cumulative_logprob", item.get("return_cumulative_logprob"))}


def to_llmapi_outputs(tensors: dict[str, np.ndarray], texts: list[str],
                      perf: Optional[dict[str, Any]]) -> Item:
    """The LLM-API model's outputs from one pagoda response, ``texts`` being each
    completion's text so far (cumulative)."""
    out = {"text_output": string_array(texts)}
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
