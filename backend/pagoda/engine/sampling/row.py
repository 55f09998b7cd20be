"""One request's sampling inputs and outputs as plain values: ``SamplingRow``, ``make_seed``
and ``TokenLogprobs``.

Pure Python (no torch), so the engine core builds a request's row when the request
arrives without importing the device side. A row holds *references* to the request's
prompt and output token lists: the sampler reads the output history as it is when the
step samples (after the previous step's tokens were applied, see ``EngineCore``'s gate),
never a copy taken at schedule time.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pagoda.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """Everything the sampler needs to know about one request row in this step.

    Attributes:
        params: the request's sampling parameters.
        seed: the row's noise stream (see ``make_seed``) when the request is seeded;
            ``None`` means the row draws from the sampler's own stream.
        prompt_token_ids: the prompt, for the repetition penalty.
        output_token_ids: tokens generated so far, for penalties, min_tokens and the
            position of a seeded row's draws.
        min_tokens_blocked_ids: ids masked while ``len(output_token_ids) <
            params.min_tokens`` (eos ids + stop_token_ids; the engine decides).
        bad_words_token_ids: token sequences the output must never complete (vLLM's
            ``bad_words``, tokenized by the engine): a sequence's last id is masked while
            the output ends with the rest of it.
        logprobs_allowed_only: the row's logprobs give ``-inf`` to the tokens the logits
            processors removed (its grammar's forbidden ones): a guided beam's candidates
            are the tokens its grammar allows, at their raw log-probabilities (as Hugging
            Face's beam search masks after ``log_softmax``).
    """

    params: SamplingParams
    seed: Optional[int] = None
    prompt_token_ids: Sequence[int] = field(default_factory=list)
    output_token_ids: Sequence[int] = field(default_factory=list)
    min_tokens_blocked_ids: frozenset[int] = frozenset()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs_allowed_only: bool = False



@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob information for one sampled token (raw model distribution).

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability under ``log_softmax(raw logits)``.
        rank: 1 + the number of tokens with a strictly larger logprob.
        top: the ``params.logprobs`` most likely ``(token_id, logprob)``, best first.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def make_seed(seed: Optional[int], index: int = 0) -> Optional[int]:
    """The noise stream of child ``index`` of a request seeded with ``seed`` (``n > 1``).

    Child 0 uses ``seed`` itself. Other children use the first 8 bytes (little-endian) of
    ``SHA-256(b"pagoda-sampler-child-v1" || u64le(seed) || u32le(index))``: deterministic
    across processes (no ``hash()``) and different for every index.

    Returns:
        The child's stream seed, or ``None`` when ``seed`` is ``None``.
    """
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(b"pagoda-sampler-child-v1" + struct.pack("<QI", seed, index)).digest()
    return int.from_bytes(digest[:8], "little")
