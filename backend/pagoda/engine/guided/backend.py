"""Grammar backends: compile a request's format, then follow its tokens with a matcher.

The engine sees two small protocols, so another library (llguidance, outlines-core) is
one more class here:

- ``GrammarBackend.compile(kind, spec, any_whitespace)`` turns a ``GuidedDecodingParams`` kind and its
  text into an opaque compiled grammar (thread-safe: it runs on the compile pool), raising
  ``ValueError`` with the library's reason when the format cannot be compiled.
- ``GrammarBackend.make_matcher(compiled)`` gives a fresh ``Matcher`` for one sequence:
  ``fill_bitmask(bitmask, row)`` writes which tokens may come next, ``accept_token``
  advances by one token (``False``: the grammar forbids it, and the state is unchanged),
  ``is_terminated`` says the grammar has accepted a stop token, ``rollback(n)`` undoes
  the last ``n`` accepted tokens.

Bitmask layout (shared by xgrammar and llguidance): ``int32 [rows, ceil(vocab / 32)]``,
token ``t`` allowed iff bit ``t % 32`` of word ``t // 32`` is set.

``XGrammarBackend`` builds xgrammar's ``TokenizerInfo`` from pagoda's own tokenizer
(``tokenizer.json`` via the ``tokenizers`` library, no transformers), with the model's
vocabulary size (the logits' width) and its EOS ids as stop tokens, so EOS is allowed
exactly where the grammar may end.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol, Sequence

import torch

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:line: "; users need the rest.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class Matcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, kind: str, spec: str, any_whitespace: bool = True) -> Any: ...
    def make_matcher(self, compiled: Any) -> Matcher: ...


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly ``choices`` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


class XGrammarBackend:
    """xgrammar behind ``GrammarBackend``.

    Args:
        tokenizer: a ``pagoda.models.tokenizer.Tokenizer``.
        vocab_size: the model's vocabulary size (logits columns past the tokenizer's
            vocabulary are padding and are always masked).
        stop_token_ids: ids that end a sequence (the tokenizer's EOS ids).
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar  # imported here: ~3 s, paid on the compile pool by the first guided request

        self._xgr = xgrammar
        backend = tokenizer.backend
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * max(len(vocab), max(vocab.values()) + 1)
        for token, token_id in vocab.items():
            encoded[token_id] = token
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType(metadata["vocab_type"]), vocab_size=vocab_size,
                                      stop_token_ids=list(stop_token_ids),
                                      add_prefix_space=metadata["add_prefix_space"])
        # pagoda keeps its own LRU of compiled grammars (manager.py); xgrammar's would be unbounded.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: str, any_whitespace: bool = True) -> Any:
        compiler = self._compiler
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
            if kind == "json_object":
                # Any JSON object (OpenAI's json_object), not any JSON value.
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "grammar":
                return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"guided_decoding.{kind}: cannot be compiled: {_clean(exc)}") from None
        raise ValueError(f"guided_decoding: unknown kind {kind!r}")

    def make_matcher(self, compiled: Any) -> Matcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))


def _clean(exc: Exception) -> str:
    text = str(exc).strip()
    return _CPP_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__).strip()
