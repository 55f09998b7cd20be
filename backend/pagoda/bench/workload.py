"""The fixed, seeded mixed-length workload shared by every benchmark, and the synthetic
workloads of the ecosystem's load generators (``make_random_workload``).

Prompt lengths are uniform in [16, 256] tokens; output lengths are long-tailed in
[8, 256] (log-uniform: many short answers, a few long ones), generated with
``ignore_eos`` so every system produces exactly the same number of tokens. Prompts are
token ids drawn from the ordinary-word range of the vocabulary; ``prompt_text`` renders
them as text for HTTP/gRPC clients.

``make_random_workload`` draws lengths the way the peers' generators do, so one load can be
driven by either: ``vllm bench serve --dataset-name random`` (``--random-input-len``,
``--random-output-len``, ``--random-range-ratio``: uniform in ``[floor(len*(1-r)), ceil(len*(1+r))]``)
or AIPerf / genai-perf (``--synthetic-input-tokens-mean/-stddev``,
``--output-tokens-mean/-stddev``: normal, rounded, at least 1). Prompt tokens are drawn
uniformly from the same ordinary-word range.
"""

from __future__ import annotations

import math
import random
from typing import Optional
from dataclasses import dataclass

MIN_PROMPT, MAX_PROMPT = 16, 256
MIN_OUTPUT, MAX_OUTPUT = 8, 256


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(num_requests: int = 32, seed: int = 0, vocab_low: int = 1000,
                  vocab_high: int = 30000) -> list[WorkItem]:
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


def draw_length(rng: random.Random, mean: int, range_ratio: float = 0.0, stddev: Optional[float] = None) -> int:
    """One length: vLLM's uniform ``[mean*(1-r), mean*(1+r)]`` or, with ``stddev``, AIPerf's normal."""
    if stddev:
        return max(1, int(round(rng.gauss(mean, stddev))))
    low, high = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def make_random_workload(num_requests: int, seed: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                         input_stddev: Optional[float] = None, output_stddev: Optional[float] = None,
                         vocab_low: int = 1000, vocab_high: int = 30000) -> list[WorkItem]:
    """``num_requests`` items with the peers' length distributions (module docstring)."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input and output lengths must be >= 1, got {input_len} and {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        prompt_len = draw_length(rng, input_len, range_ratio, input_stddev)
        max_tokens = draw_length(rng, output_len, range_ratio, output_stddev)
        items.append(WorkItem([rng.randrange(vocab_low, vocab_high) for _ in range(prompt_len)], max_tokens))
    return items
