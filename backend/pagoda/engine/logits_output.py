"""Raw logits a request asked for: TensorRT-LLM's ``return_context_logits`` and
``return_generation_logits`` (``SamplingParams`` fields of the same names), their size bound, and
how they travel from the runner to the request's outputs.

What they are (TensorRT-LLM's definitions): context logits are the model's logits at every prompt
position (``[num_prompt_tokens, vocab_size]``: row ``q`` scores the token after ``prompt[:q + 1]``,
so the last row is the first generated token's distribution); generation logits are, per
generated token, the logits it was sampled from (``[num_output_tokens, vocab_size]``). Both are
the raw model's, float32, padding columns cut off: before temperature, penalties, biases and
grammar masks (as TensorRT-LLM's, which gathers them from the engine's output).

Cost: opt-in per request. A step none of whose requests asks computes and copies nothing more.
A request asking for context logits never takes its prefix from the prefix cache (cached
positions have no logits, as with ``prompt_logprobs``) and runs eagerly (no CUDA graph); one
asking for generation logits copies its sampled rows to the host once per step, before sampling.

Bound: each output of one request holds at most ``MAX_LOGITS_VALUES`` float32 values (256 MiB):
``num_prompt_tokens * vocab_size`` and ``max_tokens * vocab_size`` (``max_tokens`` unset: what
``max_model_len`` leaves) are checked when the request arrives, and a request over it is refused
naming the field, before it runs.

How they travel. Context rows are kept on the request (``KeptLogits``) by prompt position (a chunk
computed again after a preemption overwrites its rows) until the prompt is done; they go out with
the request's first output. Generation rows are never kept on the request: each step's rows of the
tokens it kept (``runner.raw_logits.kept_rows``: accepted drafts and the bonus token) leave with
that step's ``EngineCoreOutput``, cut to the tokens the scheduler appended (a stop token or
``max_tokens`` inside a speculative run ends it early). The output processor hands each output its
new tokens' rows (``CompletionOutput.delta_generation_logits``, cut where a stop string ends the
text) and, for ``RequestOutputKind.CUMULATIVE``, keeps every row for the finished output
(``generation_logits``); for ``DELTA`` (a server's streamed request) it keeps none, so a stream's
memory is one step's rows, as TensorRT-LLM's streaming responses each carry their own tokens' rows.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

MAX_LOGITS_VALUES = 1 << 26  # float32 values per output of one request (256 MiB)


def check_logits_size(params, num_prompt_tokens: int, max_model_len: int, vocab_size: int) -> None:
    """Refuse a request whose asked-for logits would exceed ``MAX_LOGITS_VALUES``.

    Raises:
        ValueError: naming ``return_context_logits`` or ``return_generation_logits``.
    """
    if params.return_context_logits and num_prompt_tokens * vocab_size > MAX_LOGITS_VALUES:
        raise ValueError(f"return_context_logits: {num_prompt_tokens} prompt tokens x vocabulary {vocab_size} "
                         f"= {num_prompt_tokens * vocab_size} values, over the limit of {MAX_LOGITS_VALUES} "
                         f"({MAX_LOGITS_VALUES // vocab_size} prompt tokens for this model)")
    if params.return_generation_logits:
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt_tokens
        if max_tokens * vocab_size > MAX_LOGITS_VALUES:
            raise ValueError(f"return_generation_logits: max_tokens {max_tokens} x vocabulary {vocab_size} = "
                             f"{max_tokens * vocab_size} values, over the limit of {MAX_LOGITS_VALUES} (set "
                             f"max_tokens to at most {MAX_LOGITS_VALUES // vocab_size} for this model)")


class KeptLogits:
    """One request's context-logit rows, as the runner computes them (module docstring)."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.context: list[tuple[int, np.ndarray]] = []

    def add_context(self, start: int, rows: np.ndarray) -> None:
        """Rows ``[n, vocab]`` of prompt positions ``start .. start + n - 1``."""
        assert 0 <= start and start + len(rows) <= self.num_prompt_tokens, "context logits past the prompt"
        self.context.append((start, rows))

    def take_context(self) -> Optional[np.ndarray]:
        """``[num_prompt_tokens, vocab]`` float32, and the kept chunks dropped; None when not all
        computed (an aborted request)."""
        if not self.context:
            return None
        vocab = self.context[0][1].shape[1]
        out = np.empty((self.num_prompt_tokens, vocab), dtype=np.float32)
        covered = np.zeros(self.num_prompt_tokens, dtype=bool)
        for start, rows in self.context:  # in step order: a recomputed chunk overwrites
            out[start:start + len(rows)] = rows
            covered[start:start + len(rows)] = True
        self.context = []
        return out if covered.all() else None


def step_rows(rows: Optional[np.ndarray], num_new_tokens: int) -> Optional[np.ndarray]:
    """One step's generation rows cut to the ``num_new_tokens`` tokens the scheduler appended
    (``None``: none asked, or no token this step).

    Raises:
        AssertionError: fewer rows than tokens (the runner lost a step's rows).
    """
    if rows is None or not num_new_tokens:
        return None
    assert len(rows) >= num_new_tokens, f"{len(rows)} generation-logit rows for {num_new_tokens} new tokens"
    return rows[:num_new_tokens]


def join_rows(parts: Optional[list[np.ndarray]]) -> Optional[np.ndarray]:
    """Rows kept step by step as one ``[rows, vocab]`` array (``None`` for none)."""
    parts = [part for part in parts or () if len(part)]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
