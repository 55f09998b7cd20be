"""TensorRT-LLM's Triton vocabulary: its scalar inputs, word lists and beam inputs, the
``ensemble`` / ``tensorrt_llm_bls`` interface, and that interface's outputs.

The only reader of this vocabulary. Pure functions over numpy arrays (no server). Two users:

- pagoda's own model takes TensorRT-LLM style scalars beside the vLLM backend's JSON
  (ARCHITECTURE contract 1): ``read_scalars`` and ``read_words`` over its inputs
  (``PAGODA_SCALARS``, ``WORD_INPUTS``), with the same rules as the fronts;
- the front models ``ensemble`` and ``tensorrt_llm_bls`` (``serving.trtllm_front``): a batched
  request (``[B, 1]`` scalars, ``[B, W]`` word lists) is cut into B items (``split_batch``) and
  each item read whole (``read_item``) into pagoda's names; ``to_trtllm_outputs`` turns one
  of pagoda's responses back into the interface's outputs.

Rules (TensorRT-LLM's): ``top_p`` / ``top_k`` of 0 mean "off"; ``min_length`` (BLS) and
``min_tokens`` (ensemble) are one field, so are ``random_seed`` and ``seed``: two inputs of one
field must agree; ``end_id`` is one more stop token id; ``beam_width`` above 1 is beam search
(``temperature`` 0 unless given); ``stop_words`` / ``bad_words`` are string lists (empty ones
ignored); ``embedding_bias_words`` / ``_weights`` become a ``logit_bias`` (each word's tokens
get its weight, as TensorRT-LLM's preprocessing builds its embedding bias).

Front invariants: every input of the interface (``INPUTS``) is applied or refused with a
``ValueError`` whose message starts with its name (``REFUSED``); nothing is dropped but
``length_penalty`` at beam width 1, which changes nothing there (as in TensorRT-LLM, which
accepts it). ``return_context_logits`` / ``return_generation_logits`` ask pagoda's model for the
raw logits (``engine.logits_output``), sent as TensorRT-LLM's backend sends them (its
``LlmRequest::createResponse`` and ``fillTritonResponse``): FP32 ``context_logits`` ``[1, prompt
tokens, vocab]`` and ``generation_logits`` ``[1, sequences, tokens, vocab]`` per item on its one
answer; streaming, every response of a sequence carries ``context_logits`` and its own tokens'
generation rows as ``[1, tokens in this response, 1, vocab]`` (TensorRT-LLM keeps a stream's rows
token-major: ``[tokens, beams, vocab]``, with one beam here: beam search refuses raw logits).
A beam search returns ``num_return_sequences`` beams (default: all, as TensorRT-LLM does), best
first, each with its ``cum_log_probs`` and ``output_log_probs`` (``[1, beams, tokens]``, 0.0
padded). Outputs carry a batch dimension: one row per item (``batch_index``), one response per
sequence when decoupled (``sequence_index``), ``[B, n]`` when not; ``text_output`` alone is flat.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Collection, Optional

import numpy as np

from pagoda.contracts import json_input
from pagoda.serving.dialects.tensors import DialectRequest, GetInput, Item, flag, number, one, strings, text

# TensorRT-LLM scalar input -> (pagoda sampling field, its type).
SCALARS: dict[str, tuple[str, type]] = {
    "max_tokens": ("max_tokens", int), "min_tokens": ("min_tokens", int), "min_length": ("min_tokens", int),
    "temperature": ("temperature", float), "top_k": ("top_k", int), "top_p": ("top_p", float),
    "seed": ("seed", int), "random_seed": ("seed", int), "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float), "frequency_penalty": ("frequency_penalty", float),
    "num_return_sequences": ("n", int),
}
# The scalars pagoda's own model takes (model_repository/pagoda/config.pbtxt).
PAGODA_SCALARS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "seed", "random_seed",
                  "repetition_penalty", "presence_penalty", "frequency_penalty")
WORD_INPUTS = ("stop_words", "bad_words", "end_id", "beam_width", "embedding_bias_words", "embedding_bias_weights")
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
OTHER_INPUTS = ("text_input", "length_penalty", "lora_task_id", "guided_decoding_guide_type", "guided_decoding_guide")
INPUTS = (*OTHER_INPUTS, *SCALARS, *FLAGS, *WORD_INPUTS, *ACCEPTED, *REFUSED)
# tritonserver's own request fields and the generate extension's "id" (as serving.dialects.vllm tolerates).
TOLERATED_PARAMETERS = frozenset({"id", "traceparent", "priority", "timeout", "sequence_id", "sequence_start",
                                  "sequence_end", "triton_enable_empty_final_response"})
PERF_OUTPUTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                "kv_cache_hit_rate", "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
Encode = Callable[[str], list[int]]


def read_scalars(get_input: GetInput, names: tuple[str, ...] = tuple(SCALARS)) -> dict[str, Any]:
    """Sampling values from the scalar inputs ``names`` (TensorRT-LLM's rules, module docstring).

    Raises:
        ValueError: naming the input: not one value, the wrong type, two inputs of one field
            that disagree.
    """
    values: dict[str, Any] = {}
    for name in names:
        key, kind = SCALARS[name]
        value = number(name, get_input(name), kind)
        if value is None or (name in ("top_p", "top_k") and value == 0):  # 0: off, as in TensorRT-LLM
            continue
        if key in values and values[key] != value:
            raise ValueError(f"{name}: contradicts another input for {key} ({values[key]!r} != {value!r})")
        values[key] = value
    return values


def read_words(get_input: GetInput, values: dict[str, Any], encode: Optional[Encode]) -> None:
    """Apply the word-list and beam inputs to sampling ``values`` (module docstring's rules).

    Raises:
        ValueError: naming the input (a bad ``end_id`` / ``beam_width``, one weight per word
            not given, a summed bias outside [-100, 100], words without a tokenizer).
    """
    if strings("stop_words", get_input("stop_words")):
        values["stop"] = strings("stop_words", get_input("stop_words"))
    if strings("bad_words", get_input("bad_words")):
        values["bad_words"] = strings("bad_words", get_input("bad_words"))
    end_id = number("end_id", get_input("end_id"), int)
    if end_id is not None:
        stop_ids = values.get("stop_token_ids") or []
        if not isinstance(stop_ids, list):
            raise ValueError(f"stop_token_ids: must be a list of integers, got {stop_ids!r}")
        values["stop_token_ids"] = [*stop_ids, end_id]
    width = beam_width(get_input)
    if width > 1:  # beam search; SamplingParams checks the width
        values.update(use_beam_search=True, beam_width=width)
        values.setdefault("temperature", 0.0)
    words = strings("embedding_bias_words", get_input("embedding_bias_words"))
    weights_array = get_input("embedding_bias_weights")
    weights = [] if weights_array is None else [float(w) for w in weights_array.reshape(-1)]
    if words or weights:
        if encode is None:
            raise ValueError("embedding_bias_words: this model has no tokenizer to read the words with")
        bias = embedding_bias(words, weights, encode)
        for token_id, weight in (values.get("logit_bias") or {}).items():  # both given: they add up
            bias[int(token_id)] = bias.get(int(token_id), 0.0) + float(weight)
        values["logit_bias"] = bias


def beam_width(get_input: GetInput) -> int:
    """The beam width (1: no beam search). Raises ValueError naming ``beam_width``."""
    width = number("beam_width", get_input("beam_width"), int)
    if width is None:
        return 1
    if width < 1:
        raise ValueError(f"beam_width: must be an integer >= 1, got {width!r}")
    return width


def embedding_bias(words: list[str], weights: list[float], encode: Encode) -> dict[int, float]:
    """TensorRT-LLM's embedding bias as a ``logit_bias``: every token of each word gets the
    word's weight (summed where words share a token).

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


# ------------------------------------------------------------------- the front models
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
    """The request options among a front request's parameters: ``cache_salt`` only (the router's
    per-tenant prefix-cache salt). Any other is refused, naming it: TensorRT-LLM's models read
    none, and over HTTP an unknown ``generate`` key arrives as one (a silent drop otherwise)."""
    if isinstance(parameters, str):
        parameters = json_input.loads(parameters or "{}", "parameters")
    parameters = dict(parameters or {})
    options = {"cache_salt": parameters.pop("cache_salt")} if "cache_salt" in parameters else {}
    keys = sorted(set(parameters) - TOLERATED_PARAMETERS)
    if keys:
        raise ValueError(f"{', '.join(keys)}: unknown input(s) of the TensorRT-LLM dialect (inputs: "
                         f"{', '.join(sorted(inputs))})")
    return options


def read_item(item: Item, decoupled: bool, encode: Optional[Encode] = None) -> DialectRequest:
    """One batch item of ``ensemble`` / ``tensorrt_llm_bls`` in pagoda's names.

    Raises:
        ValueError: naming the input (module docstring's invariants).
    """
    get_input = item.get
    prompt = text("text_input", get_input("text_input"))
    if prompt is None:
        raise ValueError("text_input: required input is missing")
    stream = flag("stream", get_input("stream"))
    if stream and not decoupled:
        raise ValueError("stream: streaming needs the decoupled model (pagoda serve --trtllm-decoupled), "
                         "as TensorRT-LLM's decoupled_mode")
    _check_neutral(item)
    values = read_scalars(get_input)
    read_words(get_input, values, encode)
    width = beam_width(get_input)
    length_penalty = number("length_penalty", get_input("length_penalty"), float)
    if width > 1:
        values.setdefault("n", width)  # TensorRT-LLM returns every beam unless num_return_sequences says
        if length_penalty is not None:
            values["length_penalty"] = length_penalty
    # at beam width 1 a length penalty changes nothing (TensorRT-LLM accepts it so; its clients send 1.0)
    guided = _guided(item)
    if guided is not None:
        values["guided_decoding"] = guided
    log_probs = flag("return_log_probs", get_input("return_log_probs"))
    if log_probs:
        values["logprobs"] = 0
    task = one("lora_task_id", get_input("lora_task_id"))
    options: dict[str, Any] = {"output_dialect": "pagoda"}
    if task is not None:
        options["lora_name"] = str(task)  # the adapter loaded under that name (docs/serving.md)
    flags = {"stream": stream, "exclude_input_in_output": flag("exclude_input_in_output",
                                                               get_input("exclude_input_in_output")),
             "return_context_logits": flag("return_context_logits", get_input("return_context_logits")),
             "return_generation_logits": flag("return_generation_logits", get_input("return_generation_logits")),
             "return_cumulative_logprob": log_probs, "return_logprobs": log_probs,
             "return_num_input_tokens": True, "return_num_output_tokens": True,
             "return_num_cached_tokens": flag("return_perf_metrics", get_input("return_perf_metrics"))}
    return DialectRequest(prompt=prompt, sampling=values, options=options, flags=flags)


def _check_neutral(item: Item) -> None:
    for name, why in REFUSED.items():
        if name in item:
            raise ValueError(f"{name}: not supported: {why}")


def _guided(item: Item) -> Optional[dict[str, Any]]:
    kind = one("guided_decoding_guide_type", item.get("guided_decoding_guide_type"))
    guide = one("guided_decoding_guide", item.get("guided_decoding_guide"))
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


def requested(item: Item, outputs: Collection[str] = ()) -> dict[str, bool]:
    """Which optional TensorRT-LLM outputs this item asked for (its ``return_*`` inputs), and
    whether the request named a log-probability output (``outputs``: the requested output
    names) without ``return_log_probs`` (``log_prob_outputs``: they are sent as zeros)."""
    asked = {name: flag(flag_name, item.get(flag_name)) for name, flag_name in (
        ("log_probs", "return_log_probs"), ("perf", "return_perf_metrics"),
        ("num_input_tokens", "return_num_input_tokens"), ("num_output_tokens", "return_num_output_tokens"),
        ("context_logits", "return_context_logits"), ("generation_logits", "return_generation_logits"))}
    asked["log_prob_outputs"] = bool({"cum_log_probs", "output_log_probs"} & set(outputs))
    return asked


def to_trtllm_outputs(tensors: dict[str, np.ndarray], asked: dict[str, bool], batch_index: int,
                      sequence: Optional[int], perf: Optional[dict[str, Any]] = None, stream: bool = False) -> Item:
    """TensorRT-LLM outputs of one batch item from one pagoda response.

    ``sequence``: the one completion this response carries (decoupled: one response per
    sequence), or ``None`` for all of them. ``text_output`` is flat (``[n]``), as
    TensorRT-LLM's postprocessing model sends it and its clients read it (``output[0]``);
    the others have a leading batch dimension of 1, as its C++ backend sends them. ``stream``:
    a streamed response (its generation rows token-major, module docstring).
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
    if asked.get("log_prob_outputs") and not asked["log_probs"]:
        # named as outputs without return_log_probs: none were computed, but clients read them
        tokens = int(pick(tensors["num_output_tokens"]).max(initial=0))
        out["cum_log_probs"] = np.zeros((1, texts.size), dtype=np.float32)
        out["output_log_probs"] = np.zeros((1, texts.size, tokens), dtype=np.float32)
    counts = {"num_input_tokens": tensors["num_input_tokens"].reshape(-1)[0],
              "num_output_tokens": pick(tensors["num_output_tokens"]).reshape(-1)[0]}
    for name in ("num_input_tokens", "num_output_tokens"):
        if asked[name]:
            out[name] = np.array([[counts[name]]], dtype=np.int32)
    if asked.get("context_logits") and "context_logits" in tensors:  # [1, prompt tokens, vocab]
        out["context_logits"] = tensors["context_logits"].astype(np.float32)[None]
    if asked.get("generation_logits") and "generation_logits" in tensors:
        out["generation_logits"] = _generation_logits(tensors, sequence, stream)
    if asked["perf"] and perf is not None:
        out.update({name: np.array([[value]], dtype=_perf_dtype(name, value)) for name, value in perf.items()})
    return out


def _generation_logits(tensors: dict[str, np.ndarray], sequence: Optional[int], stream: bool) -> np.ndarray:
    """pagoda's ``[n, tokens, vocab]`` as TensorRT-LLM's ``[1, sequences, tokens, vocab]``; one
    sequence's own rows (its ``num_output_tokens``, padding cut) as ``[1, 1, tokens, vocab]``, or
    streamed as ``[1, tokens, 1, vocab]``."""
    rows = tensors["generation_logits"].astype(np.float32)
    if sequence is None:
        return rows[None]
    mine = rows[sequence, :int(tensors["num_output_tokens"].reshape(-1)[sequence])]
    return mine[None, :, None] if stream else mine[None, None]


def _perf_dtype(name: str, value: Any) -> type:
    return np.float32 if isinstance(value, float) else np.int64 if name.endswith("_ns") else np.int32


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
