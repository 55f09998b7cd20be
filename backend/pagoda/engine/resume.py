"""A request resumed on this engine after its first replica failed mid-stream (``RequestOptions.resume``).

The router's migration (docs/reliability.md) sends a streaming request again, as it came,
with the tokens it generated so far (``Resume.output_token_ids``, K of them) and how much of
their text the client already has. The engine takes those tokens as the request's output,
not as more prompt, so everything that depends on the output continues as if the request
had never moved:

- scheduling: the request arrives with ``num_computed_tokens`` 0 and K output tokens, as a
  request readmitted after a preemption by recompute does: its prompt and those tokens are
  computed (prefix-cache hits included), then it decodes;
- sampling: a seeded request's draw at output position i is a function of (seed, i)
  (``sampling.noise``), and i counts the K tokens; frequency and presence penalties, bad
  words and ``min_tokens`` read the same output list; ``max_tokens`` counts it;
- the grammar: its matcher is replayed over the K tokens before the request is scheduled
  (``guided.manager``); a token the grammar refuses fails the request;
- text: the detokenizer decodes the K tokens as output (``ResumedOutput``); the client has
  the first ``num_sent_chars`` characters, the rest (what the first replica held back: an
  incomplete character, a possible stop string) goes out with the next new token's text,
  and stop strings are matched across the seam (``output_processor``);
- what is reported: ``num_output_tokens``, token ids and log-probabilities of the new tokens
  only (the client has the others); ``num_input_tokens`` is the prompt's;
  ``cumulative_logprob`` continues from ``Resume.cumulative_logprob``.

Refused (``ValueError`` naming ``resume``): ``n`` > 1 or beam search (several completions; the
router does not migrate them), ``prompt_logprobs`` (sent with the first tokens: the router
clears it), ``return_context_logits`` / ``return_generation_logits`` (not supported: the K tokens
would be recomputed as prompt, without generation rows, and the context logits went with the first
response; the router does not resume such a request), K >= ``max_tokens`` (nothing left to
generate), a token id outside the vocabulary, ``num_sent_chars`` past the text of the K tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagoda.contracts.request_options import Resume
from pagoda.engine.request import EngineRequest
from pagoda.models.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class ResumedOutput:
    """A resumed request's output so far, as the output processor continues it.

    Attributes:
        token_ids: the K tokens.
        detokenizer: primed with the prompt, then fed the K tokens (it holds what they did
            not complete, as the first replica's did).
        text: the text the K tokens made.
        num_sent_chars: characters of ``text`` the client has.
        cumulative_logprob: where the log-probability sum continues from (``None``: 0).
    """

    token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    text: str
    num_sent_chars: int
    cumulative_logprob: Optional[float]


def resumed_output(request: EngineRequest, prompt_token_ids: list[int], tokenizer: Tokenizer,
                   vocab_size: int) -> Optional[ResumedOutput]:
    """The output a resumed request brings (``None`` for a new request), checked.

    Args:
        request: the envelope; ``request.options.resume`` says what it brings.
        prompt_token_ids: its prompt as the engine runs it (encoded, truncated).
        tokenizer: the model's tokenizer (the detokenizer's).
        vocab_size: the model's vocabulary size.

    Raises:
        ValueError: naming ``resume`` (module docstring: what is refused).
    """
    resume: Optional[Resume] = request.options.resume
    if resume is None:
        return None
    params = request.params
    if params.n != 1 or params.use_beam_search:
        raise ValueError("resume: only a request with one completion can resume (n 1, no beam search)")
    if params.prompt_logprobs is not None:
        raise ValueError("resume: prompt_logprobs were sent with the first tokens; a resumed request does not ask "
                         "for them again")
    for flag in ("return_context_logits", "return_generation_logits"):
        if getattr(params, flag):
            raise ValueError(f"resume: {flag} cannot resume (the earlier tokens would be recomputed as prompt, "
                             f"without their rows; the router does not migrate such a request)")
    token_ids = list(resume.output_token_ids)
    if params.max_tokens is not None and len(token_ids) >= params.max_tokens:
        raise ValueError(f"resume.output_token_ids: {len(token_ids)} tokens leave nothing to generate under "
                         f"max_tokens {params.max_tokens}")
    outside = next((t for t in token_ids if t >= vocab_size), None)
    if outside is not None:
        raise ValueError(f"resume.output_token_ids: token id {outside} is not in the vocabulary [0, {vocab_size})")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
    text = detokenizer.add(token_ids)
    if resume.num_sent_chars > len(text):
        raise ValueError(f"resume.num_sent_chars: {resume.num_sent_chars} characters sent, but the "
                         f"{len(token_ids)} tokens make {len(text)}")
    return ResumedOutput(token_ids, detokenizer, text, resume.num_sent_chars, resume.cumulative_logprob)
