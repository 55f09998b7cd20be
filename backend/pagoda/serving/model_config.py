"""Engine settings carried in ``config.pbtxt`` ``parameters``, both directions.

The Triton model configuration is the one place a deployment states its engine settings
(model path, block size, KV budget, batch limits, chunked prefill, prefix caching), so the
same model repository works under ``pagoda serve``, in NVIDIA's container and under KServe.

- ``engine_config_from_parameters`` reads them (as ``model.py`` receives them: a dict of
  ``{key: {"string_value": "..."}}`` or plain ``{key: "..."}``) into an ``EngineConfig``.
  An empty string means "the default" (for ``model``: the default SmolLM2 import).
- ``rewrite_config_pbtxt`` sets parameter values and the instance kind in a config text;
  ``pagoda serve`` uses it on a copy of the repository so flags override the file.

- ``output_dialect`` and ``REPORT_CUSTOM_METRICS`` (serving parameters): the default shape of
  the ``logprobs`` / ``finish_reason`` outputs (``serving.dialects.vllm``), and whether the ``vllm:``
  metric series are reported (the vLLM backend's parameter of that name).
- ``allow_runtime_lora`` (a serving parameter, not an engine field): whether LoRA
  control requests may load and unload adapters at run time (``pagoda serve
  --allow-runtime-lora``; vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
- ``kv_events_config`` (a serving parameter): vLLM's ``--kv-events-config`` JSON, read by
  ``serving.kv_event_stream`` (KV events on a ZMQ socket in vLLM's format).
- ``kv_transfer_listen`` (a serving parameter): ``HOST:PORT`` of the replica's KV connector
  for disaggregated prefill/decode (``serving.kv_transfer_control``); empty: none.
  ``kv_transfer_backend``: which connector (``engine.kv_transfer.registry``: ``tcp``, the
  default when empty, or ``nixl``).

Server defaults (``SERVER_DEFAULTS``) differ from ``EngineConfig``'s where a server must
protect itself and an offline engine must not refuse its own work: ``max_queue_delay_s`` is
30 s here (admission from measured capacity, ``pagoda.engine.core.load_shedding``), 0 (off) in
``EngineConfig``. A parameter set to a value (``0`` included) wins.

Invariant: every key accepted here is an ``EngineConfig`` field (or a ``SERVING_PARAMETERS`` key),
so a misspelt parameter fails the model load with a message naming it instead of being
silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Optional

from pagoda.engine.config import EngineConfig

# Parameters that are not EngineConfig fields but are still ours.
SERVING_PARAMETERS = ("served_model_name", "allow_runtime_lora", "kv_events_config", "output_dialect",
                      "REPORT_CUSTOM_METRICS", "kv_transfer_listen", "kv_transfer_backend")

# EngineConfig fields whose server default differs from the engine's (module docstring).
SERVER_DEFAULTS = {"max_queue_delay_s": 30.0}

_BOOL_TRUE = ("1", "true", "yes", "on")
_BOOL_FALSE = ("0", "false", "no", "off")


def _parameter_text(value: Any) -> str:
    if isinstance(value, Mapping):
        value = value.get("string_value", "")
    return str(value).strip()


def _convert(name: str, text: str, field_type: Any) -> Any:
    type_name = field_type if isinstance(field_type, str) else getattr(field_type, "__name__", str(field_type))
    if "dict" in type_name:
        return _read_mapping(name, text)
    try:
        if "bool" in type_name:
            low = text.lower()
            if low in _BOOL_TRUE:
                return True
            if low in _BOOL_FALSE:
                return False
            raise ValueError(text)
        if "int" in type_name:
            return int(text)
        if "float" in type_name:
            return float(text)
    except ValueError:
        raise ValueError(f"config.pbtxt parameter {name}: cannot read {text!r} as {type_name}") from None
    return text


def _read_mapping(name: str, text: str) -> dict[str, str]:
    """A JSON object, or ``key=value`` pairs separated by commas (``lora_modules``)."""
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config.pbtxt parameter {name}: not a JSON object ({exc.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"config.pbtxt parameter {name}: expected a JSON object")
        return {str(k): str(v) for k, v in value.items()}
    pairs = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"config.pbtxt parameter {name}: expected name=path pairs, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def engine_config_from_parameters(parameters: Mapping[str, Any]) -> EngineConfig:
    """Build an ``EngineConfig`` from Triton model-config parameters.

    Args:
        parameters: ``model_config["parameters"]`` as Triton passes it to ``initialize``.

    Returns:
        The engine configuration; unset or empty parameters keep ``EngineConfig`` defaults.

    Raises:
        ValueError: an unknown key, an unreadable value, or an invalid setting.
    """
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    values: dict[str, Any] = {}
    for name, raw in parameters.items():
        if name in SERVING_PARAMETERS:
            continue
        if name not in fields:
            raise ValueError(f"config.pbtxt parameter {name}: unknown; known: {', '.join(sorted(fields))}")
        text = _parameter_text(raw)
        if text == "":
            continue
        values[name] = _convert(name, text, fields[name].type)
    return EngineConfig(**{**SERVER_DEFAULTS, **values})


def served_model_name(parameters: Mapping[str, Any], default: str) -> str:
    """The ``model_name`` label for metrics: the parameter if set, else ``default``."""
    return _parameter_text(parameters.get("served_model_name", "")) or default


def allow_runtime_lora(parameters: Mapping[str, Any]) -> bool:
    """The ``allow_runtime_lora`` parameter (empty or absent: false).

    Raises:
        ValueError: a value that is not a boolean word.
    """
    return bool(_convert("allow_runtime_lora", _parameter_text(parameters.get("allow_runtime_lora", "")) or "false",
                         bool))


def kv_transfer_listen(parameters: Mapping[str, Any]) -> Optional[str]:
    """The ``kv_transfer_listen`` parameter (``HOST:PORT``), or None when empty or absent."""
    return _parameter_text(parameters.get("kv_transfer_listen", "")) or None


def kv_transfer_backend(parameters: Mapping[str, Any]) -> str:
    """The ``kv_transfer_backend`` parameter (empty or absent: ``tcp``).

    Raises:
        ValueError: not a backend of ``engine.kv_transfer.registry`` (the message names them), or
            set while ``kv_transfer_listen`` is empty (there would be no connector to choose).
    """
    from pagoda.engine.kv_transfer.registry import DEFAULT_KV_TRANSFER_BACKEND, check_kv_transfer_backend

    backend = _parameter_text(parameters.get("kv_transfer_backend", ""))
    if backend and kv_transfer_listen(parameters) is None:
        raise ValueError(f"kv_transfer_backend {backend!r} needs kv_transfer_listen (HOST:PORT)")
    return check_kv_transfer_backend(backend or DEFAULT_KV_TRANSFER_BACKEND)


def output_dialect(parameters: Mapping[str, Any]) -> str:
    """The ``output_dialect`` parameter: the default shape of ``logprobs`` and ``finish_reason``
    (``pagoda.serving.dialects.vllm``; empty or absent: ``"vllm"``, the vLLM backend's).

    Raises:
        ValueError: not one of ``dialects.vllm.OUTPUT_DIALECTS``.
    """
    from pagoda.serving.dialects.vllm import check_output_dialect

    value = _parameter_text(parameters.get("output_dialect", "")) or "vllm"
    return check_output_dialect("config.pbtxt parameter output_dialect", value)


def report_custom_metrics(parameters: Mapping[str, Any]) -> bool:
    """The vLLM backend's ``REPORT_CUSTOM_METRICS`` parameter: whether the ``vllm:`` series
    are reported (empty or absent: true, pagoda's default; the vLLM backend's is false).

    Raises:
        ValueError: a value that is not a boolean word.
    """
    text = _parameter_text(parameters.get("REPORT_CUSTOM_METRICS", "")) or "true"
    return bool(_convert("REPORT_CUSTOM_METRICS", text, bool))


def rewrite_config_pbtxt(text: str, overrides: Mapping[str, Optional[str]],
                         instance_kind: Optional[str] = None) -> str:
    """Return ``text`` with parameter values replaced (or added) and the instance kind set.

    Args:
        text: a config.pbtxt using the ``parameters { key: ... value: { string_value: ... } }``
            form, one block per parameter.
        overrides: parameter name -> new string value; ``None`` values are skipped.
        instance_kind: ``"KIND_CPU"``, ``"KIND_GPU"`` or ``"KIND_MODEL"`` (tensor parallelism:
            the engine places its ranks) to replace the ``kind:`` in ``instance_group``;
            ``None`` leaves it.

    Returns:
        The rewritten configuration text.
    """
    for name, value in overrides.items():
        if value is None:
            continue
        escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
        pattern = re.compile(
            r'(key:\s*"' + re.escape(name) + r'"\s*value:\s*\{\s*string_value:\s*)"(?:[^"\\]|\\.)*"')
        text, count = pattern.subn(lambda m: m.group(1) + f'"{escaped}"', text)
        if count == 0:
            text += f'\nparameters {{\n  key: "{name}"\n  value: {{ string_value: "{escaped}" }}\n}}\n'
    if instance_kind is not None:
        if instance_kind not in ("KIND_CPU", "KIND_GPU", "KIND_MODEL"):
            raise ValueError(f"instance_kind: must be KIND_CPU, KIND_GPU or KIND_MODEL, got {instance_kind!r}")
        text = re.sub(r"kind:\s*KIND_[A-Z]+", f"kind: {instance_kind}", text)
    return text
