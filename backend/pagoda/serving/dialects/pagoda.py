"""pagoda's own model's inputs (ARCHITECTURE contract 1), read into pagoda's names.

The model takes (all optional but the prompt):

- the prompt: ``text_input`` (STRING) or ``input_ids`` (INT32 token ids, TensorRT-LLM's
  name), not both, unless the request names the tokenizer that made ``input_ids`` from
  ``text_input`` (``prompt_tokenizer``: the router tokenized the text to route it; the
  replica uses those ids when that is its own tokenizer, and encodes the text otherwise);
- the vLLM backend's vocabulary (``serving.dialects.vllm``): ``sampling_parameters`` JSON and
  request parameters, holding sampling fields, request options (``RequestOptions``) and the
  wire's keys (``output_dialect``, ``prompt_tokenizer``);
- TensorRT-LLM style scalars and word lists (``serving.dialects.trtllm``: ``PAGODA_SCALARS``,
  ``WORD_INPUTS``), which win over the same key in the JSON (the more specific, per-tensor
  statement; TensorRT-LLM clients never send the JSON); ``end_id`` adds a stop token id;
- ``image`` (STRING, one base64 image per element: the vLLM backend's input,
  ``vllm.read_images``);
- ``lora_name`` (STRING, the vLLM backend's input), or the same key in the JSON;
- the output flags (``OutputOptions.FLAGS``: ``stream``, ``exclude_input_in_output``,
  ``return_*``).

A request with ``lora_action`` is a LoRA control request, not a generation
(``read_lora_control``): it takes ``lora_name`` and ``lora_path`` and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagoda.contracts.request_options import check_adapter_name
from pagoda.serving.dialects import trtllm, vllm
from pagoda.serving.dialects.tensors import DialectRequest, GetInput, decode_text, flag, one, text, token_ids

FLAG_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_stop_reason",
               "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
               "return_num_output_tokens", "return_num_cached_tokens", "return_output_token_ids",
               "return_context_logits", "return_generation_logits")
# Every input of model_repository/pagoda/config.pbtxt -> its kind (a test keeps them equal):
# the one list the router's generate-body schema and the JSON form read.
INPUTS: dict[str, str] = {
    "text_input": "string", "input_ids": "ints", "sampling_parameters": "json",
    **dict.fromkeys(FLAG_INPUTS, "bool"),
    **{name: "uint" if name in ("seed", "random_seed") else "int" if kind is int else "number"
       for name, (_, kind) in trtllm.SCALARS.items() if name in trtllm.PAGODA_SCALARS},
    "stop_words": "strings", "bad_words": "strings", "embedding_bias_words": "strings",
    "embedding_bias_weights": "numbers", "end_id": "int", "beam_width": "int",
    "image": "strings", "lora_name": "string", "lora_action": "string", "lora_path": "string",
}
# Every input of a generation request, so a control request can refuse them.
GENERATION_INPUTS = tuple(name for name in INPUTS if name not in ("lora_name", "lora_action", "lora_path"))
LORA_ACTIONS = ("load", "unload", "list")


@dataclass(frozen=True)
class LoRAControl:
    """A LoRA control request: load ``lora_name`` from ``lora_path``, unload it, or list."""

    action: str
    lora_name: Optional[str] = None
    lora_path: Optional[str] = None

    @property
    def changes_adapters(self) -> bool:
        return self.action != "list"


def read_request(get_input: GetInput, parameters: Any = None,
                 encode: Optional[trtllm.Encode] = None) -> DialectRequest:
    """One generation request's inputs in pagoda's names.

    Args:
        get_input: returns the named input as a numpy array, or ``None`` if absent.
        parameters: the request's parameters (``request.parameters()``: JSON text), read as
            the vLLM backend reads them; ``None``: none.
        encode: text -> token ids without special tokens (the embedding bias's words);
            ``None``: ``embedding_bias_words`` is refused.

    Raises:
        ValueError: naming the offending input, request parameter or sampling field.
    """
    if get_input("lora_path") is not None:
        raise ValueError("lora_path: only a LoRA control request (lora_action 'load') takes a path; "
                         "to generate with an adapter, give its lora_name")
    raw_json = get_input("sampling_parameters")
    if raw_json is not None and raw_json.size != 1:
        raise ValueError(f"sampling_parameters: expected one JSON string, got {raw_json.size} elements")
    sampling, options = vllm.read_values(None if raw_json is None else decode_text(
        "sampling_parameters", raw_json.reshape(-1)[0]), parameters)
    sampling.update(trtllm.read_scalars(get_input, trtllm.PAGODA_SCALARS))
    trtllm.read_words(get_input, sampling, encode)
    lora_name = text("lora_name", get_input("lora_name"))
    if lora_name is not None:
        options["lora_name"] = lora_name
    prompt = _prompt_text(get_input("text_input"))
    ids = token_ids("input_ids", get_input("input_ids"))
    if prompt is None and ids is None:
        raise ValueError("text_input: required input is missing (or give input_ids)")
    if prompt is not None and ids is not None and options.get("prompt_tokenizer") is None:
        raise ValueError("input_ids: give the prompt as text_input or as input_ids, not both (a router that "
                         "tokenized text_input sends the ids with its tokenizer's prompt_tokenizer)")
    flags = {name: flag(name, get_input(name)) for name in FLAG_INPUTS}
    if flags["stream"] and get_input("exclude_input_in_output") is not None and not flags["exclude_input_in_output"]:
        # streamed responses carry only the new text (Triton's vLLM backend refuses this too, in these words)
        raise ValueError("exclude_input_in_output: When streaming, `exclude_input_in_output` = False is not allowed.")
    return DialectRequest(prompt=prompt, prompt_token_ids=ids, sampling=sampling, options=options, flags=flags,
                          images=vllm.read_images(get_input("image")))


def _prompt_text(array: Any) -> Optional[str]:
    if array is None:
        return None
    if array.size != 1:
        raise ValueError(f"text_input: expected exactly one string, got {array.size} elements")
    value = one("text_input", array)
    if not isinstance(value, str):
        raise ValueError(f"text_input: must be a string, got {type(value).__name__}")
    return value


def read_lora_control(get_input: GetInput) -> Optional[LoRAControl]:
    """A LoRA control request, or ``None`` when the request has no ``lora_action``.

    Raises:
        ValueError: an unknown action, a missing or extra ``lora_name``/``lora_path``, or a
            generation input (``text_input`` etc.) beside the action.
    """
    action = text("lora_action", get_input("lora_action"))
    if action is None:
        return None
    if action not in LORA_ACTIONS:
        raise ValueError(f"lora_action: must be one of {', '.join(LORA_ACTIONS)}, got {action!r}")
    extra = [name for name in GENERATION_INPUTS if get_input(name) is not None]
    if extra:
        raise ValueError(f"lora_action: a LoRA control request takes only lora_action, lora_name and lora_path; "
                         f"it cannot be combined with generation inputs ({', '.join(extra)})")
    name = text("lora_name", get_input("lora_name"))
    path = text("lora_path", get_input("lora_path"))
    if action != "list" and name is None:
        raise ValueError(f"lora_name: required by lora_action {action!r}")
    if action != "list":
        check_adapter_name(name)
    if action == "list" and name is not None:
        raise ValueError("lora_name: lora_action 'list' takes no lora_name")
    if action == "load" and path is None:
        raise ValueError("lora_path: required by lora_action 'load' (the adapter's folder on the replica)")
    if action != "load" and path is not None:
        raise ValueError(f"lora_path: only lora_action 'load' takes a path, not {action!r}")
    return LoRAControl(action, name, path)
