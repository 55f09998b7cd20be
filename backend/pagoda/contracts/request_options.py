"""How a request is run, beside how it samples: ``RequestOptions``, one typed object every service shares.

A request's options travel from the door that takes it (the router's OpenAI, Triton and
KServe doors, a replica's own Triton door, TensorRT-LLM's fronts, the offline ``LLM``) to the
engine unchanged: the router sets ``cache_salt`` and ``tenant`` from the API key, the P/D
stages set ``kv_transfer_params``, the engine reads ``priority``, ``cache_salt``,
``lora_name`` and ``timeout``. They live here, under every floor, because the engine's
envelope (``engine.request.EngineRequest``), the replica's wire request
(``serving.wire.WireRequest``) and the fleet's doors all hold the same object.

Invariant: a ``RequestOptions`` is valid once built. Each field is checked in
``__post_init__`` (a ``ValueError`` whose message starts with the field's name), so the
value is checked where it enters and nothing downstream checks it again. Dialects that
carry options as text (Triton's vLLM backend sends ``"priority": "3"``) convert the text
first; this type takes typed values only.

``kv_transfer_params`` (vLLM's disaggregated prefill/decode option) is checked here for its
shape (an object of known keys and types); what the keys mean is the serving loop's
(``serving.kv_transfer_control``).

Migration (docs/reliability.md): ``allow_migration`` false asks the router not to move the
request to another replica when its replica fails; ``resume`` is what the router sends when
it does move a streaming request: the output its client already has (``Resume``), which
the engine continues (``engine.resume``) as if the request had never left its first replica.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional

# kv_transfer_params keys -> their type (vLLM's NixlConnector keys that pagoda reads).
KV_TRANSFER_PARAM_TYPES: dict[str, type] = {"do_remote_decode": bool, "do_remote_prefill": bool, "remote_host": str,
                                            "remote_port": int, "remote_block_count": int}
_KIND_NAMES = {bool: "a boolean", str: "a string", int: "an integer"}
# The longest output a resumed request may bring (far above any max_tokens a request is served with).
MAX_RESUMED_TOKENS = 1 << 20


@dataclass(frozen=True)
class Resume:
    """A request resumed on another replica after its first one failed mid-stream.

    Attributes:
        output_token_ids: the tokens the request generated so far, in order (its journal);
            the engine takes them as this request's output already, not as prompt: the
            sampler's seeded positions, penalties, ``min_tokens``/``max_tokens``, stop
            strings and the grammar all continue from them.
        num_sent_chars: characters of their text the client already has (the first
            replica may have held text back: an incomplete character, a possible stop
            string); the rest is sent with the next new token's text.
        cumulative_logprob: the sum of their log-probabilities as the client last saw it
            (``None``: it was not reported); the engine's sum continues from it.
    """

    output_token_ids: tuple[int, ...]
    num_sent_chars: int = 0
    cumulative_logprob: Optional[float] = None

    def __post_init__(self) -> None:
        ids = self.output_token_ids
        if not isinstance(ids, (list, tuple)) or not ids or len(ids) > MAX_RESUMED_TOKENS:
            raise ValueError(f"resume.output_token_ids: must be a non-empty list of at most {MAX_RESUMED_TOKENS} "
                             f"token ids, got {ids!r:.80}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError("resume.output_token_ids: every token id must be an integer >= 0")
        object.__setattr__(self, "output_token_ids", tuple(ids))
        chars = self.num_sent_chars
        if isinstance(chars, bool) or not isinstance(chars, int) or chars < 0:
            raise ValueError(f"resume.num_sent_chars: must be an integer >= 0, got {chars!r}")
        value = self.cumulative_logprob
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValueError(f"resume.cumulative_logprob: must be a finite number, got {value!r}")

    @classmethod
    def from_dict(cls, value: Any) -> "Resume":
        """From its JSON object (or a ``Resume``). Raises ValueError naming the key."""
        if isinstance(value, Resume):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"resume: must be a JSON object, got {value!r:.80}")
        unknown = sorted(set(value) - set(_RESUME_KEYS))
        if unknown:
            raise ValueError(f"resume: unknown key(s) {', '.join(map(str, unknown))}; known: {', '.join(_RESUME_KEYS)}")
        if "output_token_ids" not in value:
            raise ValueError("resume.output_token_ids: required")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"output_token_ids": list(self.output_token_ids), "num_sent_chars": self.num_sent_chars}
        if self.cumulative_logprob is not None:
            out["cumulative_logprob"] = self.cumulative_logprob
        return out


_RESUME_KEYS = ("output_token_ids", "num_sent_chars", "cumulative_logprob")


@dataclass(frozen=True)
class RequestOptions:
    """Attributes:
        priority: smaller runs first under the priority scheduling policy (vLLM's convention).
        cache_salt: tenant key: requests with different salts never share KV blocks.
        lora_name: a loaded LoRA adapter to generate with; ``None``: the base model.
        timeout: seconds from arrival; past it the request ends with a "deadline exceeded"
            error (``engine.core`` admission).
        kv_transfer_params: disaggregated prefill/decode (``serving.kv_transfer_control``).
        tenant: who sent it, as the router's API keys name it (traces; the replica does not
            schedule by it).
        allow_migration: false: the router does not move this request to another replica
            when its replica fails (the client gets the failure); the replica ignores it.
        resume: the output a migrated request already has (``Resume``); ``None``: a new request.
    """

    priority: int = 0
    cache_salt: Optional[str] = None
    lora_name: Optional[str] = None
    timeout: Optional[float] = None
    kv_transfer_params: Optional[Mapping[str, Any]] = None
    tenant: Optional[str] = None
    allow_migration: bool = True
    resume: Optional[Resume] = None

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority: must be an integer, got {self.priority!r}")
        for name in ("cache_salt", "lora_name", "tenant"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}: must be a non-empty string, got {value!r}")
        check_timeout(self.timeout)
        if self.kv_transfer_params is not None:
            object.__setattr__(self, "kv_transfer_params",
                               MappingProxyType(check_kv_transfer_params(self.kv_transfer_params)))
        if not isinstance(self.allow_migration, bool):
            raise ValueError(f"allow_migration: must be a boolean, got {self.allow_migration!r}")
        if self.resume is not None:
            object.__setattr__(self, "resume", Resume.from_dict(self.resume))

    def replace(self, **changes: Any) -> "RequestOptions":
        """A copy with ``changes`` (checked as a new object). Raises ValueError naming the field."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The options that differ from their defaults, as JSON values (``from_dict`` reads them back)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = dict(value) if f.name == "kv_transfer_params" else \
                    value.to_dict() if isinstance(value, Resume) else value
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RequestOptions":
        """Options from typed values (JSON); raises ValueError naming an unknown key or a bad value."""
        unknown = sorted(set(values) - set(OPTION_NAMES))
        if unknown:
            raise ValueError(f"unknown request option(s): {', '.join(unknown)}; known: {', '.join(OPTION_NAMES)}")
        return cls(**values)


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RequestOptions))


def check_timeout(timeout: Any) -> None:
    """A request's ``timeout`` (seconds > 0, finite) or ``None``; raises ValueError naming it."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
            or not math.isfinite(timeout):
        raise ValueError(f"timeout: must be a number of seconds > 0, got {timeout!r}")


def check_kv_transfer_params(value: Any) -> dict[str, Any]:
    """A checked copy of a ``kv_transfer_params`` object. Raises ValueError naming it (or its key)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"kv_transfer_params: must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(KV_TRANSFER_PARAM_TYPES))
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(KV_TRANSFER_PARAM_TYPES)}")
    for key, kind in KV_TRANSFER_PARAM_TYPES.items():
        if key in value and (not isinstance(value[key], kind) or (kind is int and isinstance(value[key], bool))):
            raise ValueError(f"kv_transfer_params.{key}: must be {_KIND_NAMES[kind]}, got {value[key]!r}")
    if value.get("do_remote_decode") and value.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: do_remote_decode (this replica prefills) and do_remote_prefill "
                         "(this replica pulls the prefill) exclude each other")
    if value.get("do_remote_prefill"):
        if not value.get("remote_host") or "remote_port" not in value:
            raise ValueError("kv_transfer_params: do_remote_prefill needs remote_host and remote_port (the prefill "
                             "replica's answer)")
        if not 0 < value["remote_port"] < 65536:
            raise ValueError(f"kv_transfer_params.remote_port: must be 1-65535, got {value['remote_port']}")
    return dict(value)
