"""OutputProcessor: the engine core's token ids in, ``RequestOutput``s out.

For every ``EngineCoreOutput`` of a step it detokenizes the new tokens incrementally,
applies stop strings, collects logprobs, stamps the request's metrics and builds the
``RequestOutput`` with cumulative values and this step's deltas. It never touches the
scheduler: a stop string found here ends the output at once and is returned as an id to
abort, which the engine passes back to the core (``process(...) -> (outputs,
ids_to_abort)``).

Stop strings: several tokens at once (speculative decoding) go one at a time through
the stop strings, so the output ends exactly where it would without speculation; tokens
after the stop are dropped from the output (and from the generation-token count). While
a stop string may still match, a stop string's length of text is held back from the
deltas. Tokens that arrive for a completion already ended here (async scheduling: the
core learns of the stop one step late) are ignored.

Stop tokens: a request the core ended on a ``stop_token_ids`` hit or EOS keeps that id in
``token_ids`` but not its text (unless ``include_stop_str_in_output``), as vLLM's
detokenizer and TensorRT-LLM's ``end_id`` do; a finish for another reason (a completed
grammar) keeps its last token's text.

Prompt log-probabilities (``SamplingParams.prompt_logprobs``) arrive with a child's first
output; the group keeps the first child's that came and every ``RequestOutput`` of the
request carries them from then on (``None`` entry for the first prompt position). Context
logits likewise. Generation logits (``engine.logits_output``) arrive with each core output, one
row per new token: the rows of the tokens a stop string leaves in the output are kept, each
``RequestOutput`` carries its completions' rows since the last one (``delta_generation_logits``),
and with ``RequestOutputKind.CUMULATIVE`` the finished completion carries all of them
(``generation_logits``); with ``DELTA`` none are kept once handed out.

A resumed request (``engine.resume``: moved here from a replica that failed) starts with
its earlier tokens and their text as its own, the characters its client has counted as
emitted: stop strings see the whole text, deltas carry only what the client lacks.

n > 1 (the fan-in; the fan-out is ``engine.request_groups.parallel_sampling``'s): a user request's
``n`` children are one *group*; their outputs are reported together under the user's
request id, once any child progressed. The group is finished when every child is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from pagoda.engine.stats import LatencyWindow
from pagoda.engine.core.core_output import EngineCoreOutput
from pagoda.engine.logits_output import join_rows
from pagoda.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from pagoda.engine.resume import ResumedOutput
from pagoda.engine.sampling_params import RequestOutputKind, SamplingParams
from pagoda.models.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Completion:
    """Text state of one child: what has been decoded, and what has been emitted."""

    request_id: str  # the child's id in the engine core
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # every token the core reported
    text: str = ""
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: Optional[list[TokenLogprob]] = None
    num_emitted_logprobs: int = 0
    cumulative_logprob: Optional[float] = None
    beam_score: Optional[float] = None  # beam search: the beam's length-penalised score
    # Generation-logit rows (engine.logits_output): of the tokens not yet handed out; of every kept token
    # (RequestOutputKind.CUMULATIVE only, else None).
    new_rows: list = field(default_factory=list)
    all_rows: Optional[list] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    num_kept_tokens: Optional[int] = None  # set when a stop string ends the output before the last token


@dataclass
class _Group:
    """One user request: its children and the metrics reported under its id."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    completions: list[_Completion]
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # from the first child output that has them
    context_logits: Any = None  # float32 [prompt tokens, vocab], from the first child output that has them
    error: Optional[str] = None  # the core failed the request (e.g. its grammar did not compile)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    """Args:
    tokenizer: decodes output tokens.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        self._child_of: dict[str, tuple[_Group, int]] = {}
        self._aborted_outputs: list[RequestOutput] = []
        self.num_prompt_tokens = 0  # of requests that produced a first token
        self.recent_ttfts = LatencyWindow()  # first-token latencies of the last 30 s (heartbeat)
        self.num_generation_tokens = 0  # output tokens kept (past a stop string: not counted)

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], arrival_time: float,
                    resumed: Optional[ResumedOutput] = None) -> None:
        """Track a user request whose children (``child_ids``, ``params.n`` of them) the core runs;
        ``resumed``: the output its one completion has already (``engine.resume``)."""
        assert request_id not in self._groups, f"request {request_id!r} is already tracked"
        with_logprobs = params.logprobs is not None
        keeps_rows = params.return_generation_logits and params.output_kind == RequestOutputKind.CUMULATIVE
        completions = [
            _Completion(child_id, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                        logprobs=[] if with_logprobs else None, cumulative_logprob=0.0 if with_logprobs else None,
                        all_rows=[] if keeps_rows else None)
            for child_id in child_ids
        ]
        if resumed is not None:
            _continue(completions[0], resumed)
        group = _Group(request_id, prompt, list(prompt_token_ids), params, RequestMetrics(arrival_time=arrival_time),
                       completions)
        self._groups[request_id] = group
        for index, child_id in enumerate(child_ids):
            self._child_of[child_id] = (group, index)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._groups

    def group_of(self, child_id: str) -> Optional[str]:
        """The user request id of a core request (None when not tracked)."""
        entry = self._child_of.get(child_id)
        return entry[0].request_id if entry is not None else None

    def child_ids(self, request_id: str) -> list[str]:
        group = self._groups.get(request_id)
        return [c.request_id for c in group.completions] if group is not None else []

    def abort(self, request_id: str, now: Optional[float] = None, error: Optional[str] = None) -> list[str]:
        """End a user request: its final output (``finish_reason == "abort"`` for the
        unfinished children, ``error`` when given) comes from the next ``process``.
        Returns the children the core must abort ([] for an unknown or finished id)."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        if error is not None:
            group.error = error
        live = [c.request_id for c in group.completions if c.finish_reason is None]
        for completion in group.completions:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
        group.metrics.finished_time = time.time() if now is None else now
        self._aborted_outputs.append(self._make_output(group))
        self._forget(group)
        return live

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._aborted_outputs)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ outputs
    def process(self, core_outputs: Iterable[EngineCoreOutput],
                now: Optional[float] = None) -> tuple[list[RequestOutput], list[str]]:
        """Turn one step's core outputs into ``RequestOutput``s.

        Returns:
            (outputs: aborted requests' finals first, then one per user request that
            progressed, in first-seen order; child ids that a stop string ended here
            and the core must abort).
        """
        now = time.time() if now is None else now
        outputs, self._aborted_outputs = self._aborted_outputs, []
        touched: dict[str, _Group] = {}
        ids_to_abort = []
        for core_output in core_outputs:
            entry = self._child_of.get(core_output.request_id)
            if entry is None:
                continue  # aborted or finished here while the core was still running it
            group, index = entry
            completion = group.completions[index]
            if completion.finish_reason is not None:
                continue  # a stop string ended it one step earlier; the core heard late
            if self._absorb(group, completion, core_output, now):
                ids_to_abort.append(core_output.request_id)
            touched[group.request_id] = group
        for group in touched.values():
            outputs.append(self._make_output(group))
            if group.finished:
                self._forget(group)
        return outputs, ids_to_abort

    def _absorb(self, group: _Group, completion: _Completion, core_output: EngineCoreOutput, now: float) -> bool:
        """Detokenize a child's new tokens, apply stop strings, stamp metrics. Returns
        whether a stop string ended a child the core still runs."""
        new_ids = core_output.new_token_ids
        if core_output.error is not None:
            group.error = core_output.error
        self._stamp(group, core_output, len(new_ids), now)
        if core_output.prompt_logprobs is not None and group.prompt_logprobs is None:
            group.prompt_logprobs = [lp and TokenLogprob(lp.token_id, lp.logprob, lp.rank, list(lp.top))
                                     for lp in core_output.prompt_logprobs]
        if core_output.context_logits is not None and group.context_logits is None:
            group.context_logits = core_output.context_logits
        completion.token_ids.extend(new_ids)
        if core_output.cumulative_logprob is not None:  # a beam (whole, at once): its scores come with it
            completion.cumulative_logprob = core_output.cumulative_logprob
            completion.beam_score = core_output.beam_score
        num_tokens = len(completion.token_ids)
        params = group.params
        # A stop token (EOS or stop_token_ids) ends the request but is not text: its id stays
        # in token_ids, its text is dropped unless include_stop_str_in_output (as vLLM, and
        # TensorRT-LLM with end_id).
        text_ids = new_ids[:-1] if self._ends_on_stop_token(core_output, params) else new_ids
        pieces = [[t] for t in text_ids] if params.stop and len(text_ids) > 1 else [text_ids]
        stopped = False
        for i, piece in enumerate(pieces):
            if piece:
                completion.text += completion.detokenizer.add(piece)
            is_last = i == len(pieces) - 1
            if core_output.finished and is_last:
                completion.text += completion.detokenizer.finish()
            num_outputs = num_tokens - (len(new_ids) - sum(len(p) for p in pieces[: i + 1]))
            # A stop string wins over a length/EOS finish reached in the same step.
            stopped = bool(params.stop) and num_outputs >= params.min_tokens and _apply_stop_strings(completion, params)
            if stopped:
                if not is_last:
                    completion.num_kept_tokens = num_outputs
                    self.num_generation_tokens -= num_tokens - num_outputs
                break
        num_new_kept = len(new_ids) if completion.num_kept_tokens is None else \
            completion.num_kept_tokens - (num_tokens - len(new_ids))
        for lp in core_output.logprobs[:num_new_kept] if completion.logprobs is not None else ():
            completion.logprobs.append(TokenLogprob(lp.token_id, lp.logprob, lp.rank, list(lp.top)))
            if core_output.cumulative_logprob is None:  # a beam's sum came whole, above
                completion.cumulative_logprob += lp.logprob
        _keep_rows(completion, core_output, num_new_kept)
        if core_output.finished and not stopped:
            completion.finish_reason = core_output.finish_reason
            completion.stop_reason = core_output.stop_reason
        if completion.finish_reason is not None and group.finished:
            group.metrics.finished_time = now
        return stopped and not core_output.finished

    def _ends_on_stop_token(self, core_output: EngineCoreOutput, params: SamplingParams) -> bool:
        """The core finished the request on a stop token id or EOS (not, e.g., a completed
        grammar, whose last token is text)."""
        if core_output.finish_reason != "stop" or not core_output.new_token_ids or params.include_stop_str_in_output:
            return False
        last = core_output.new_token_ids[-1]
        return core_output.stop_reason == last or (not params.ignore_eos and last in self.tokenizer.eos_token_ids)

    def _stamp(self, group: _Group, core_output: EngineCoreOutput, num_new: int, now: float) -> None:
        m = group.metrics
        scheduled = core_output.first_scheduled_time
        if scheduled is not None and (m.first_scheduled_time is None or scheduled < m.first_scheduled_time):
            m.first_scheduled_time = scheduled
        if group.completions[0].request_id == core_output.request_id:
            # Prompt tokens only: a resumed request's hit may cover its earlier output too.
            group.num_cached_tokens = min(core_output.num_cached_tokens, len(group.prompt_token_ids))
        if not num_new:
            return
        self.num_generation_tokens += num_new
        if m.first_token_time is None:
            m.first_token_time = now
            self.num_prompt_tokens += len(group.prompt_token_ids)
            self.recent_ttfts.observe(now - m.arrival_time, now)
        else:
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now

    def _make_output(self, group: _Group) -> RequestOutput:
        completions = []
        for i, c in enumerate(group.completions):
            finished = c.finish_reason is not None
            # While stop strings may still match, hold back a stop string's length of text.
            hold = 0 if finished or not group.params.stop else max(len(s) for s in group.params.stop) - 1
            visible = max(c.num_emitted_chars, len(c.text) - hold)
            delta_text = c.text[c.num_emitted_chars:visible]
            c.num_emitted_chars = visible
            token_ids = c.token_ids[: c.num_kept_tokens]
            delta_ids = token_ids[c.num_emitted_tokens:]
            c.num_emitted_tokens = len(token_ids)
            delta_lp = None
            if c.logprobs is not None:
                delta_lp = c.logprobs[c.num_emitted_logprobs:]
                c.num_emitted_logprobs = len(c.logprobs)
            delta_rows = None
            if c.new_rows:  # only a request that asked for generation logits has any
                delta_rows, c.new_rows = join_rows(c.new_rows), []
            if finished and c.all_rows:
                c.all_rows = [join_rows(c.all_rows)]  # joined once; later outputs of the group reuse it
            completions.append(CompletionOutput(
                index=i, text=c.text[:visible], token_ids=list(token_ids), delta_text=delta_text,
                delta_token_ids=list(delta_ids), cumulative_logprob=c.cumulative_logprob,
                logprobs=list(c.logprobs) if c.logprobs is not None else None, delta_logprobs=delta_lp,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason, beam_score=c.beam_score,
                generation_logits=c.all_rows[0] if finished and c.all_rows else None,
                delta_generation_logits=delta_rows))
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            outputs=completions, finished=group.finished, metrics=group.metrics,
            num_cached_tokens=group.num_cached_tokens, prompt_logprobs=group.prompt_logprobs, error=group.error,
            context_logits=group.context_logits)

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for c in group.completions:
            self._child_of.pop(c.request_id, None)


def _keep_rows(completion: _Completion, core_output: EngineCoreOutput, num_new_kept: int) -> None:
    """A core output's generation-logit rows of the tokens the output keeps (``num_new_kept``)."""
    rows = core_output.generation_logits
    if rows is None:
        return
    kept = rows[:num_new_kept]
    completion.new_rows.append(kept)
    if completion.all_rows is not None:
        completion.all_rows.append(kept)


def _continue(completion: _Completion, resumed: ResumedOutput) -> None:
    """A resumed completion: its earlier tokens and text are its own, and only what the
    client lacks is emitted (the held-back text with the next delta, no earlier token)."""
    completion.detokenizer = resumed.detokenizer
    completion.token_ids = list(resumed.token_ids)
    completion.num_emitted_tokens = len(resumed.token_ids)
    completion.text = resumed.text
    completion.num_emitted_chars = resumed.num_sent_chars
    if completion.cumulative_logprob is not None and resumed.cumulative_logprob is not None:
        completion.cumulative_logprob = resumed.cumulative_logprob


def _apply_stop_strings(completion: _Completion, params: SamplingParams) -> bool:
    """Truncate at the earliest stop string in the unscanned tail; True if one matched."""
    # Only the tail can hold a new match: the text not yet emitted plus a stop
    # string's length of overlap with what was.
    longest = max(len(s) for s in params.stop)
    scan_from = max(0, completion.num_emitted_chars - longest)
    best = None
    for stop in params.stop:
        pos = completion.text.find(stop, scan_from)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    if best is None:
        return False
    pos, stop = best
    completion.text = completion.text[: pos + len(stop) if params.include_stop_str_in_output else pos]
    completion.finish_reason = "stop"
    completion.stop_reason = stop
    return True
