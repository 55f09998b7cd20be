"""Tokenizer built from the GGUF metadata vs transformers' GGUF tokenizer, and the detokenizer."""

from __future__ import annotations

import random

import pytest

from pagoda.models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world!",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "def add(a, b):\n    return a + b  # sum\n\tx = [1, 2, 3]",
    "你好，世界。今日は良い天気ですね。",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷 ok",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "  leading spaces\t\ttabs\n\nand trailing   ",
    "don't I'll we're Ünïcödé café naïve",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers_gguf_tokenizer(smollm2_tokenizer, hf_gguf_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert ids == hf_gguf_tokenizer(text)["input_ids"]
    assert smollm2_tokenizer.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == hf_gguf_tokenizer.decode(ids)
    if "<|" not in text:
        assert smollm2_tokenizer.decode(ids) == text


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm2_tokenizer, hf_gguf_tokenizer, messages, add_generation_prompt):
    ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_special_tokens_and_ids(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, 2, {2}, 49152)
    assert tok.is_special(2) and tok.is_special(0) and not tok.is_special(504)
    assert tok.encode("<|im_end|>") == [2]  # special tokens stay whole
    assert tok.encode("12345") == [tok.encode(d)[0] for d in "12345"]  # digits split one by one


def test_chat_template_raise_exception_becomes_value_error(smollm2_tokenizer):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template) == "ok"
    with pytest.raises(ValueError, match="first must be user"):
        smollm2_tokenizer.apply_chat_template([{"role": "system", "content": "x"}], chat_template=template)
    with pytest.raises(ValueError, match="chat template"):  # malformed messages: a user error, not a crash
        smollm2_tokenizer.apply_chat_template([{"content": "no role"}], chat_template="{{ messages[0].role.upper() }}")


def test_generation_config_eos_list_joins_eos_ids(smollm2_tokenizer):
    tok = Tokenizer(smollm2_tokenizer.backend, smollm2_tokenizer.config, {"eos_token_id": [2, 0]})
    assert tok.eos_token_ids == {0, 2} and tok.eos_token_id == 2


# ---- incremental detokenizer ---------------------------------------------------------


def stream(tokenizer, prompt_ids, output_ids, chunk_sizes, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas, i = [], 0
    for size in chunk_sizes:
        deltas.append(detok.add(output_ids[i : i + size]))
        i += size
    assert i == len(output_ids)
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_detokenizer_streams_valid_text_without_broken_characters(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    assert tok.token_bytes() is not None, "SmolLM2 is byte-level: the exact byte strategy applies"
    prompt = tok.encode("Say something:")
    ids = tok.encode(text)
    deltas = stream(tok, prompt, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas), deltas
    assert deltas[-1] == ""  # nothing was left held back


def test_detokenizer_holds_back_a_split_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("🎉")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🎉"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_random_sequences_concatenate_to_decode(smollm2_tokenizer, skip_special_tokens):
    """Arbitrary ids, incomplete and invalid UTF-8 included: the deltas add up to decode()."""
    tok = smollm2_tokenizer
    rng = random.Random(1234 + skip_special_tokens)
    partial = [i for i in range(17, tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert len(partial) > 100
    for _ in range(300):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        # Bias towards special tokens now and then, otherwise uniform over the vocabulary.
        # Mix special tokens, partial-character tokens and anything else.
        pools = [range(17), partial, range(tok.vocab_size)]
        output = [rng.choice(rng.choices(pools, weights=[1, 4, 5])[0]) for _ in range(rng.randrange(1, 40))]
        chunks, left = [], len(output)
        while left:
            chunks.append(min(left, rng.choice([1, 1, 1, 2, 3])))
            left -= chunks[-1]
        deltas = stream(tok, prompt, output, chunks, skip_special_tokens)
        assert "".join(deltas) == tok.decode(output, skip_special_tokens=skip_special_tokens), (prompt, output)


@pytest.mark.parametrize("strategy", ["bytes", "window"])
def test_detokenizer_random_utf8_text_streams_exactly(smollm2_tokenizer, strategy):
    """Random mixes of ASCII, accents, CJK and emoji: deltas never carry a broken character.

    ``window`` forces the decode-window strategy that non-byte-level tokenizers use.
    """
    tok = smollm2_tokenizer
    if strategy == "window":
        tok = Tokenizer(tok.backend, tok.config)
        tok.token_bytes = lambda: None
    rng = random.Random(7)
    alphabet = list("abc XYZ 123 .,\n") + list("éßüñ") + list("中文字漢語日本") + ["🎉", "👍🏽", "🚀", "😀", "∑", "€"]
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        ids = tok.encode(text)
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.choice([1, 1, 2])))
            left -= chunks[-1]
        deltas = stream(tok, tok.encode("Q:"), ids, chunks)
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)
