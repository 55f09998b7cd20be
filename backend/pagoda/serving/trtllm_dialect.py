"""TensorRT-LLM's Triton dialect: the ``ensemble`` / ``tensorrt_llm_bls`` interface on pagoda.

Pure functions over numpy arrays (no server); ``trtllm_front`` is the Triton glue that runs
them inside the front models ``model_repository/{ensemble,tensorrt_llm_bls}``.

A TensorRT-LLM client sends batched tensors (``max_batch_size > 0``: ``[B, 1]`` scalars,
``[B, W]`` word lists). ``split_batch`` cuts them into B items; ``to_pagoda_inputs`` turns
one item into the inputs of pagoda's own model (``text_input``, ``stream``,
``exclude_input_in_output``, the ``return_*`` flags and one ``sampling_parameters`` JSON),
so every value is validated once, by ``triton_io``, with the engine that serves it.
``to_trtllm_outputs`` turns one pagoda response back into TensorRT-LLM's outputs.

Invariants:

- every input of the interface (``INPUTS``) is either applied (``SCALAR_KEYS``, the words
  lists, flags, guided decoding, ``lora_task_id``) or refused with a ``ValueError`` whose
  message starts with its name (``REFUSED``, ``length_penalty`` without beam search and
  ``return_*_logits`` when set to anything but their neutral value); nothing is dropped;
- ``beam_width`` above 1 is beam search (``use_beam_search``, ``temperature`` 0 unless
  given, ``length_penalty`` applied): ``num_return_sequences`` beams (default: all of
  them, as TensorRT-LLM returns) come back best first, one ``sequence_index`` each, with
  ``return_log_probs`` their ``cum_log_probs`` and per-token ``output_log_probs``
  (``[1, beams, tokens]``, shorter beams padded with 0.0, as TensorRT-LLM's);
- a request parameter (an HTTP ``generate`` key that is not an input) is refused, naming it:
  TensorRT-LLM's models read none; pagoda's fronts read one, ``cache_salt`` (the router's
  per-tenant prefix-cache salt, as pagoda's own model takes it);
- outputs carry a batch dimension: one row per item (``batch_index``), one response per
  sequence when decoupled (``sequence_index``), ``[B, n]`` when not; ``text_output`` alone is
  flat (``[B * n]``), as TensorRT-LLM's postprocessing model sends it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from pagoda.contracts import json_input

# TensorRT-LLM scalar input -> pagoda sampling field. ``min_length`` (tensorrt_llm_bls) and
# ``min_tokens`` (ensemble) are one field; so are ``random_seed`` and ``seed``.
SCALAR_KEYS = {
    "max_tokens": "max_tokens", "min_tokens": "min_tokens", "min_length": "min_tokens",
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed", "random_seed": "seed",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "num_return_sequences": "n",
}
FLAGS = ("stream", "exclude_input_in_output", "return_log_probs", "return_context_logits",
         "return_generation_logits", "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens")
# Accepted and without effect, with the reason.
ACCEPTED = {"pad_id": "pagoda pads nothing (requests are not padded into a batch tensor)"}
REFUSED = {
    "decoder_text_input": "encoder-decoder models are not served by pagoda",
    "prompt_embedding_table": "prompt tuning tables are not supported",
    "prompt_vocab_size": "prompt tuning tables are not supported",
    "prompt_table_extra_id": "prompt tuning tables are not supported",
    "lora_weights": "adapters are loaded by name (pagoda serve --lora NAME=PATH, or pagoda lora load), "
                    "then chosen with lora_task_id",
    "lora_config": "adapters are loaded by name (pagoda serve --lora NAME=PATH, or pagoda lora load), "
                   "then chosen with lora_task_id",
    "num_draft_tokens": "speculative decoding is configured on the server (pagoda serve --speculative-*)",
    "use_draft_logits": "speculative decoding is configured on the server (pagoda serve --speculative-*)",
}
# guided_decoding_guide_type -> pagoda guided_decoding kind (TensorRT-LLM's GuidedDecodingParams.GuideType).
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
WORD_INPUTS = ("stop_words", "bad_words", "embedding_bias_words", "embedding_bias_weights")
OTHER_INPUTS = ("text_input", "end_id", "beam_width", "length_penalty", "lora_task_id",
                "guided_decoding_guide_type", "guided_decoding_guide")
INPUTS = (*OTHER_INPUTS, *SCALAR_KEYS, *FLAGS, *WORD_INPUTS, *ACCEPTED, *REFUSED)
PERF_OUTPUTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                "kv_cache_hit_rate", "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")

Item = dict[str, np.ndarray]


def split_batch(inputs: Item) -> list[Item]:
    """The B items of one batched request: each input's row ``b`` (the batch dimension dropped).

    Raises:
        ValueError: inputs disagree on B (naming the first that does).
    """
    sizes = {name: array.shape[0] if array.ndim else 1 for name, array in inputs.items()}
    batch = sizes.get("text_input", max(sizes.values(), default=0))
    for name, size in sizes.items():
        if size != batch:
            raise ValueError(f"{name}: batch dimension is {size}, text_input's is {batch}")
    return [{name: np.asarray(array[b]) if array.ndim else array for name, array in inputs.items()}
            for b in range(batch)]


def read_request_parameters(parameters: Any, inputs: tuple[str, ...] = INPUTS) -> dict[str, Any]:
    """The request options among the request parameters: ``cache_salt`` only (pagoda's
    addition: the router's per-tenant prefix-cache salt). Every other one is refused,
    naming it: TensorRT-LLM's models read none, and over HTTP an unknown ``generate`` key
    arrives as one (a silent drop otherwise)."""
    if isinstance(parameters, str):
        parameters = json_input.loads(parameters or "{}", "parameters")
    parameters = dict(parameters or {})
    options = {"cache_salt": parameters.pop("cache_salt")} if "cache_salt" in parameters else {}
    if "cache_salt" in options and (not isinstance(options["cache_salt"], str) or not options["cache_salt"]):
        raise ValueError(f"cache_salt: must be a non-empty string, got {options['cache_salt']!r}")
    # tritonserver's own request fields and the generate extension's "id" (see vllm_dialect).
    keys = sorted(set(parameters) - {"id", "traceparent", "priority", "timeout", "sequence_id",
                                     "sequence_start", "sequence_end", "triton_enable_empty_final_response"})
    if keys:
        raise ValueError(f"{', '.join(keys)}: unknown input(s) of the TensorRT-LLM dialect (inputs: "
                         f"{', '.join(sorted(inputs))})")
    return options


def with_options(inputs: dict[str, np.ndarray], options: dict[str, Any]) -> dict[str, np.ndarray]:
    """pagoda's inputs with request options (``cache_salt``) added to their ``sampling_parameters``."""
    if not options:
        return inputs
    values = {**json.loads(inputs["sampling_parameters"][0]), **options}
    return {**inputs, "sampling_parameters": np.array([json.dumps(values).encode()], dtype=np.object_)}


def _one(name: str, item: Item) -> Any:
    array = item.get(name)
    if array is None:
        return None
    if array.size != 1:
        raise ValueError(f"{name}: expected one value per batch item, got {array.size}")
    value = array.reshape(-1)[0]
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    return value.item() if hasattr(value, "item") else value


def _words(name: str, item: Item) -> list[str]:
    array = item.get(name)
    values = [] if array is None else array.reshape(-1).tolist()
    return [bytes(v).decode("utf-8") if isinstance(v, (bytes, bytearray)) else str(v) for v in values if v]


def _beam_width(item: Item) -> int:
    """The item's beam width (1: no beam search). Raises ValueError naming ``beam_width``."""
    width = _one("beam_width", item)
    if width is None:
        return 1
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"beam_width: must be an integer >= 1, got {width!r}")
    return width


def _check_neutral(item: Item) -> None:
    beam = _beam_width(item) > 1
    for name, neutral, why in (
            ("length_penalty", 1.0 if not beam else _one("length_penalty", item),
             "it applies to beam search (beam_width > 1)"),
            ("return_context_logits", False, "pagoda returns no logits (prompt log-probabilities: "
                                             "the OpenAI door's echo with logprobs)"),
            ("return_generation_logits", False, "pagoda returns no logits; use return_log_probs")):
        value = _one(name, item)
        if value is not None and value != neutral:
            raise ValueError(f"{name}: {why} (got {value!r}, only {neutral!r} is accepted)")
    for name, why in REFUSED.items():
        if name in item:
            raise ValueError(f"{name}: not supported: {why}")


def _guided(item: Item) -> Optional[dict[str, Any]]:
    kind, guide = _one("guided_decoding_guide_type", item), _one("guided_decoding_guide", item)
    if kind is None:
        if guide is not None:
            raise ValueError("guided_decoding_guide: needs guided_decoding_guide_type")
        return None
    if kind not in GUIDE_TYPES:
        raise ValueError(f"guided_decoding_guide_type: must be one of {', '.join(GUIDE_TYPES)}, got {kind!r} "
                         "(structural_tag is not supported)")
    if kind == "json":
        if guide is not None:
            raise ValueError("guided_decoding_guide: guide type 'json' takes no guide (any JSON object); "
                             "use 'json_schema' for a schema")
        return {"json_object": True}
    if guide is None:
        raise ValueError(f"guided_decoding_guide: required by guided_decoding_guide_type {kind!r}")
    return {GUIDE_TYPES[kind]: guide}


def sampling_values(item: Item) -> dict[str, Any]:
    """One item's ``sampling_parameters`` JSON for pagoda's model. Raises ValueError naming the input."""
    _check_neutral(item)
    values: dict[str, Any] = {"output_dialect": "pagoda"}
    for name, key in SCALAR_KEYS.items():
        value = _one(name, item)
        if value is None or (name in ("top_p", "top_k") and value == 0):  # 0: off, as in TensorRT-LLM
            continue
        if key in values and values[key] != value:
            raise ValueError(f"{name}: contradicts another input for {key} ({values[key]!r} != {value!r})")
        values[key] = value
    if _words("stop_words", item):
        values["stop"] = _words("stop_words", item)
    if _words("bad_words", item):
        values["bad_words"] = _words("bad_words", item)
    end_id = _one("end_id", item)
    if end_id is not None:
        values["stop_token_ids"] = [int(end_id)]
    task = _one("lora_task_id", item)
    if task is not None:
        values["lora_name"] = str(task)  # the adapter loaded under that name (docs/serving.md)
    guided = _guided(item)
    if guided is not None:
        values["guided_decoding"] = guided
    width = _beam_width(item)
    if width > 1:
        values.update(use_beam_search=True, beam_width=width)
        values.setdefault("temperature", 0.0)
        values.setdefault("n", width)  # TensorRT-LLM returns every beam unless num_return_sequences says
        if _one("length_penalty", item) is not None:
            values["length_penalty"] = float(_one("length_penalty", item))
    if _one("return_log_probs", item):
        values["logprobs"] = 0
    return values


def embedding_bias(words: list[str], weights: list[float], encode: Callable[[str], list[int]]) -> dict[int, float]:
    """TensorRT-LLM's embedding bias as a ``logit_bias``: every token of each word gets the
    word's weight (summed where words share a token), as its preprocessing model builds it.

    Raises:
        ValueError: not one weight per word, or a summed bias outside [-100, 100].
    """
    if len(words) != len(weights):
        raise ValueError(f"embedding_bias_weights: {len(weights)} weights for {len(words)} "
                         "embedding_bias_words (give one weight per word)")
    bias: dict[int, float] = {}
    for word, weight in zip(words, weights):
        for token_id in encode(word):
            bias[token_id] = bias.get(token_id, 0.0) + weight
    if any(not -100.0 <= value <= 100.0 for value in bias.values()):
        raise ValueError("embedding_bias_weights: a token's summed bias must lie in [-100, 100]")
    return bias


def to_pagoda_inputs(item: Item, decoupled: bool) -> dict[str, np.ndarray]:
    """pagoda's model inputs for one batch item (``[1]`` tensors). Raises ValueError naming the input."""
    prompt = _one("text_input", item)
    if prompt is None:
        raise ValueError("text_input: required input is missing")
    stream = bool(_one("stream", item))
    if stream and not decoupled:
        raise ValueError("stream: streaming needs the decoupled model (pagoda serve --trtllm-decoupled), "
                         "as TensorRT-LLM's decoupled_mode")
    perf = bool(_one("return_perf_metrics", item))
    inputs = {"text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
              "sampling_parameters": np.array([json.dumps(sampling_values(item)).encode()], dtype=np.object_),
              "stream": np.array([stream]),
              "exclude_input_in_output": np.array([bool(_one("exclude_input_in_output", item))]),
              "return_cumulative_logprob": np.array([bool(_one("return_log_probs", item))]),
              "return_logprobs": np.array([bool(_one("return_log_probs", item))]),
              "return_num_input_tokens": np.array([True]), "return_num_output_tokens": np.array([True]),
              "return_num_cached_tokens": np.array([perf])}
    for name in ("embedding_bias_words", "embedding_bias_weights"):  # pagoda's model tokenizes the words
        if name in item:
            inputs[name] = item[name].reshape(-1)
    return inputs


def requested(item: Item) -> dict[str, bool]:
    """Which optional TensorRT-LLM outputs this item asked for."""
    return {"log_probs": bool(_one("return_log_probs", item)), "perf": bool(_one("return_perf_metrics", item)),
            "num_input_tokens": bool(_one("return_num_input_tokens", item)),
            "num_output_tokens": bool(_one("return_num_output_tokens", item))}


def to_trtllm_outputs(tensors: dict[str, np.ndarray], asked: dict[str, bool], batch_index: int,
                      sequence: Optional[int], perf: Optional[dict[str, Any]] = None) -> Item:
    """TensorRT-LLM outputs of one batch item from one pagoda response.

    ``sequence``: the one completion this response carries (decoupled: one response per
    sequence), or ``None`` for all of them. ``text_output`` is flat (``[n]``), as
    TensorRT-LLM's postprocessing model sends it and its clients read it (``output[0]``);
    the others have a leading batch dimension of 1, as its C++ backend sends them.
    """
    pick = (lambda a: a[sequence:sequence + 1]) if sequence is not None else (lambda a: a)
    texts = pick(tensors["text_output"])
    out = {"text_output": texts.reshape(-1),
           "batch_index": np.array([[batch_index]], dtype=np.int32),
           "sequence_index": np.array([[sequence]] if sequence is not None else [list(range(texts.size))],
                                      dtype=np.int32)}
    if asked["log_probs"]:
        out["cum_log_probs"] = pick(tensors["cumulative_logprob"]).astype(np.float32).reshape(1, -1)
    if asked["log_probs"] and "logprobs" in tensors:  # [1, sequences (beams), tokens], 0.0-padded
        rows = [[lp["logprob"] for lp in json.loads(_text(t))] for t in pick(tensors["logprobs"])]
        width = max((len(r) for r in rows), default=0)
        out["output_log_probs"] = np.array([[r + [0.0] * (width - len(r)) for r in rows]],
                                           dtype=np.float32).reshape(1, len(rows), width)
    counts = {"num_input_tokens": tensors["num_input_tokens"].reshape(-1)[0],
              "num_output_tokens": pick(tensors["num_output_tokens"]).reshape(-1)[0]}
    for name in ("num_input_tokens", "num_output_tokens"):
        if asked[name]:
            out[name] = np.array([[counts[name]]], dtype=np.int32)
    if asked["perf"] and perf is not None:
        out.update({name: np.array([[value]], dtype=np.float32 if isinstance(value, float) else np.int64
                                   if name.endswith("_ns") else np.int32) for name, value in perf.items()})
    return out


def _text(value: Any) -> str:
    return bytes(value).decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


def kv_cache_metrics(num_input_tokens: int, num_output_tokens: int, num_cached_tokens: int,
                     block_size: int) -> dict[str, Any]:
    """TensorRT-LLM's per-request KV-cache metrics from pagoda's token counts: blocks the
    request's tokens fill, of which the prefix cache gave ``reused`` (whole blocks)."""
    total = math.ceil((num_input_tokens + num_output_tokens) / block_size)
    reused = num_cached_tokens // block_size
    prompt_blocks = math.ceil(num_input_tokens / block_size)
    return {"kv_cache_alloc_total_blocks": total, "kv_cache_reused_blocks": reused,
            "kv_cache_alloc_new_blocks": total - reused,
            "kv_cache_hit_rate": float(reused / prompt_blocks) if prompt_blocks else 0.0}


def stack_items(items: list[Item]) -> Item:
    """One non-decoupled response from the items' outputs, in batch order (``text_output``
    flat; ragged ``output_log_probs`` padded with 0.0)."""
    out: Item = {}
    for name in items[0]:
        arrays = [item[name] for item in items]
        width = [max(a.shape[d] for a in arrays) for d in range(1, arrays[0].ndim)]
        padded = []
        for a in arrays:
            pad = [(0, 0)] + [(0, w - s) for w, s in zip(width, a.shape[1:])]
            padded.append(np.pad(a, pad, constant_values=b"" if a.dtype == np.object_ else 0)
                          if any(p[1] for p in pad) else a)
        out[name] = np.concatenate(padded, axis=0)
    return out


def set_decoupled(config_text: str, decoupled: bool) -> str:
    """A front model's config.pbtxt with its ``decoupled`` policy set (``pagoda serve --trtllm-decoupled``)."""
    text, count = re.subn(r"(model_transaction_policy\s*\{\s*decoupled:\s*)(true|false)",
                            lambda m: m.group(1) + str(decoupled).lower(), config_text)
    if count != 1:
        raise ValueError("config.pbtxt: expected one model_transaction_policy { decoupled: ... }")
    return text


def block_size_of(config_text: str, default: int = 16) -> int:
    """The ``block_size`` parameter of pagoda's config.pbtxt (KV-cache metrics' unit)."""
    match = re.search(r'key:\s*"block_size"\s*value:\s*\{\s*string_value:\s*"(\d+)"', config_text)
    return int(match.group(1)) if match else default



FRONT_MODELS = ("ensemble", "tensorrt_llm_bls", "tensorrt_llm")  # tensorrt_llm: trtllm_llmapi


def configure_fronts(repository: Path, decoupled: dict[str, bool]) -> None:
    """Set the front models' ``decoupled`` policy in a materialized repository.

    Raises:
        ValueError: ``decoupled`` names a model that is not a front of this repository.
    """
    for name, value in decoupled.items():
        config = repository / name / "config.pbtxt"
        if name not in FRONT_MODELS or not config.exists():
            raise ValueError(f"trtllm_decoupled: {name!r} is not a TensorRT-LLM front model of {repository} "
                             f"({', '.join(FRONT_MODELS)})")
        config.write_text(set_decoupled(config.read_text(), value))
