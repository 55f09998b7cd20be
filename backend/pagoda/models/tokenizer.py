"""Tokenizer and incremental detokenizer, without transformers.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (from ``tokenizer.json``) with what
``tokenizer_config.json`` and ``generation_config.json`` add: the special tokens, the
stop ids and the Jinja chat template (rendered in a sandbox the way transformers renders
it, so prompts are byte-identical).

``IncrementalDetokenizer`` turns a stream of generated ids into text deltas, emitting only
completed characters: a multi-byte UTF-8 character split across tokens is held back
until the token that completes it arrives. Two strategies:

- Byte-level BPE (GPT-2 style, the default model's): every token maps to fixed bytes, so
  the ids become a byte stream fed to Python's incremental UTF-8 decoder (``replace``
  errors, like the tokenizer's own lossy decode). Exactly O(1) per token.
- Any other decoder: keep two offsets into the token list, ``prefix_offset <=
  read_offset``. Tokens in ``[prefix_offset, read_offset)`` were already emitted and serve
  as context (sentencepiece decoders render a token differently at the start of a
  string). Each step decodes only the window ``[prefix_offset, end)`` and emits what is
  new in it, minus a trailing U+FFFD (an incomplete character). Once the window decodes
  cleanly the offsets move forward, so the work per token is bounded by the window. The
  prompt's last few tokens seed the context.

Invariant (tested on random token sequences, invalid UTF-8 included): for byte-level
tokenizers the concatenation of all deltas plus ``finish()`` equals
``tokenizer.decode(output_ids)``. The window strategy meets it for valid text; on
invalid byte runs longer than ``_MAX_HELD_TOKENS`` it flushes a U+FFFD early rather than
let the window grow without bound.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import jinja2
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5
# A valid UTF-8 character spans at most 4 bytes, hence at most 4 tokens; a window still
# incomplete after this many tokens holds invalid bytes, and is flushed as it is.
_MAX_HELD_TOKENS = 8


class Tokenizer:
    """A model folder's tokenizer: encode/decode, special tokens, chat template."""

    def __init__(
        self, backend: _HFTokenizer, config: dict[str, Any], generation_config: Optional[dict[str, Any]] = None
    ) -> None:
        self.backend = backend
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.pad_token_id = self._id_of(self.pad_token)
        eos_ids = {self.eos_token_id} if self.eos_token_id is not None else set()
        generation_eos = (generation_config or {}).get("eos_token_id")
        if isinstance(generation_eos, int):
            eos_ids.add(generation_eos)
        elif isinstance(generation_eos, list):
            eos_ids.update(generation_eos)
        if self.eos_token_id is None and eos_ids:
            self.eos_token_id = min(eos_ids)
        self.eos_token_ids: set[int] = eos_ids
        self.special_ids: frozenset[int] = frozenset(
            i for i, added in backend.get_added_tokens_decoder().items() if added.special
        )
        self.chat_template: Optional[str] = _pick_chat_template(config.get("chat_template"))

    @classmethod
    def from_pretrained(cls, path: Union[str, Path]) -> "Tokenizer":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json``).

        Raises:
            FileNotFoundError: no tokenizer.json in ``path``.
        """
        path = Path(path)
        backend = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        return cls(backend, _read_json(path / "tokenizer_config.json"), _read_json(path / "generation_config.json"))

    @cached_property
    def fingerprint(self) -> str:
        """Who made a prompt's token ids: a hash of the whole tokenizer (vocabulary, merges,
        normalizer, pre- and post-processing, special tokens), 16 hex digits. Two tokenizers
        with one fingerprint encode every text alike, so a replica uses token ids a router
        made with its fingerprint instead of encoding the text again (``serving.wire``)."""
        return hashlib.sha256(self.backend.to_str().encode("utf-8")).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def max_chars_per_token(self) -> Optional[int]:
        """The most characters of input one token can cover, when that is knowable exactly;
        else ``None``. Byte-level BPE with no normalizer and no unknown token (GPT-2,
        Llama 3, Qwen, SmolLM2): every input character is at least one byte and every token
        covers the bytes of its vocabulary string (one character per byte) or an added
        token's text, so a text of C characters has at least C / max tokens. Lets a door
        refuse a prompt that cannot fit the context without tokenizing it."""
        if not hasattr(self, "_max_chars_per_token"):
            spec = json.loads(self.backend.to_str())
            model = spec.get("model") or {}
            byte_level = '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer"))
            exact = (spec.get("normalizer") is None and byte_level and model.get("type") == "BPE"
                     and not model.get("unk_token"))
            self._max_chars_per_token = (max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))
                                         if exact else None)
        return self._max_chars_per_token

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to a prompt string with the model's Jinja template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: end with the header of an assistant turn.
            chat_template: overrides the model's template.
            kwargs: extra template variables (e.g. ``tools``).
        Raises:
            ValueError: no template, or the template raised (e.g. a role it rejects).
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat_template; pass one or send a plain prompt")
        # Like transformers: every *_token from the config is a template variable.
        variables = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token")}
        variables.update(bos_token=self.bos_token or "", eos_token=self.eos_token or "", pad_token=self.pad_token or "")
        variables.update(kwargs)
        try:
            return _compile_template(template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except (ChatTemplateError, jinja2.TemplateError) as exc:  # a request the template rejects
            raise ValueError(f"chat template: {exc}") from exc

    def token_bytes(self) -> Optional[list[bytes]]:
        """Each id's bytes when the tokenizer is byte-level (else None); built once, lazily."""
        if not hasattr(self, "_token_bytes"):
            self._token_bytes = _byte_level_table(self.backend)
        return self._token_bytes

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.backend.token_to_id(token)


class IncrementalDetokenizer:
    """Streams the text of generated tokens; see the module docstring for the algorithm."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._token_bytes = tokenizer.token_bytes()
        if self._token_bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return
        self.token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        # Characters of decode(token_ids[prefix_offset:]) already emitted.
        self.num_emitted_chars = len(self._decode(self.prefix_offset, self.read_offset))

    def add(self, new_token_ids: Iterable[int]) -> str:
        """Append generated ids; return only the text they complete (may be empty)."""
        if self._token_bytes is not None:
            return self._utf8.decode(self._bytes_of(new_token_ids))
        self.token_ids.extend(new_token_ids)
        text = self._decode(self.prefix_offset, len(self.token_ids))
        complete = text.rstrip(_REPLACEMENT)
        num_held = len(self.token_ids) - self.read_offset
        if len(complete) < len(text) and num_held <= _MAX_HELD_TOKENS:
            delta = complete[self.num_emitted_chars :]
            self.num_emitted_chars = max(self.num_emitted_chars, len(complete))
            return delta
        delta = text[self.num_emitted_chars :]
        self._advance()
        return delta

    def finish(self) -> str:
        """Text still held back at the end of generation (e.g. a dangling partial character)."""
        if self._token_bytes is not None:
            return self._utf8.decode(b"", final=True)
        text = self._decode(self.prefix_offset, len(self.token_ids))
        delta = text[self.num_emitted_chars :]
        self._advance()
        return delta

    def _bytes_of(self, token_ids: Iterable[int]) -> bytes:
        table, skip = self._token_bytes, self.skip_special_tokens
        special = self.tokenizer.special_ids
        return b"".join(table[i] for i in token_ids if 0 <= i < len(table) and not (skip and i in special))

    def _advance(self) -> None:
        """Everything is emitted: the newest tokens become the context of the next window."""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.num_emitted_chars = len(self._decode(self.prefix_offset, self.read_offset))

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)


# ---- helpers -------------------------------------------------------------------------


class ChatTemplateError(Exception):
    """Raised by a chat template through ``raise_exception``."""


def _byte_level_table(backend: _HFTokenizer) -> Optional[list[bytes]]:
    """Bytes of every id, as the ByteLevel decoder maps them; None for other decoders.

    The decoder maps each character of a token through GPT-2's byte alphabet; a token
    with a character outside that alphabet (an added token written in plain text) is
    taken as its own UTF-8 bytes instead.
    """
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    byte_of_char = {c: b for b, c in _gpt2_byte_alphabet().items()}
    table = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i) or ""
        if all(c in byte_of_char for c in token):
            table.append(bytes(byte_of_char[c] for c in token))
        else:
            table.append(token.encode("utf-8"))
    return table


def _gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(token: Any) -> Optional[str]:
    """tokenizer_config gives a special token as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _pick_chat_template(template: Any) -> Optional[str]:
    """A config may hold one template or a list of named ones; take the default."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default")
    return template


@lru_cache(maxsize=8)
def _compile_template(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        # Jinja's own tojson escapes HTML characters, which templates do not expect.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not parse: {exc}") from exc
