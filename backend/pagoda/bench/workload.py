"""The fixed, seeded mixed-length workload shared by every benchmark.

Prompt lengths are uniform in [16, 256] tokens; output lengths are long-tailed in
[8, 256] (log-uniform: many short answers, a few long ones), generated with
``ignore_eos`` so every system produces exactly the same number of tokens. Prompts are
token ids drawn from the ordinary-word range of the vocabulary; ``prompt_text`` renders
them as text for HTTP/gRPC clients.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MIN_PROMPT, MAX_PROMPT = 16, 256
MIN_OUTPUT, MAX_OUTPUT = 8, 256


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(num_requests: int = 32, seed: int = 0, vocab_low: int = 1000, vocab_high: int = 30000) -> list[WorkItem]:
    """``num_requests`` items, identical for the same arguments on every machine."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        prompt_len = rng.randint(MIN_PROMPT, MAX_PROMPT)
        output_len = int(round(math.exp(rng.uniform(math.log(MIN_OUTPUT), math.log(MAX_OUTPUT)))))
        items.append(WorkItem([rng.randrange(vocab_low, vocab_high) for _ in range(prompt_len)], output_len))
    return items


def prompt_text(item: WorkItem, tokenizer) -> str:
    """The prompt as text (re-tokenizing it gives about, not exactly, the same length)."""
    return tokenizer.decode(item.prompt_token_ids, skip_special_tokens=True)
