"""Beam search in the engine: one user request runs as a group of beams that share KV blocks.

Semantics are Hugging Face's ``generate(num_beams=k)`` (transformers 5 ``_beam_search``, the
old ``BeamSearchScorer``), step by step, for a group of width ``k``:

1. every live beam ``b`` (cumulative log-probability ``s_b``) reports its top ``2k`` raw
   log-probabilities; the candidates ``s_b + logprob`` of all beams are ranked and the best
   ``2k`` kept (the global top ``2k`` of ``k x vocab`` lies inside each beam's own top ``2k``);
2. a candidate *ends* when its token is a stop token (EOS unless ``ignore_eos``, or
   ``stop_token_ids``), its text holds a stop string (``find_stop_string``, given by the
   engine, which has the tokenizer; as HF's ``StopStringCriteria``) or its length reaches
   ``max_tokens``; among the best ``k`` candidates, ending ones join the finished
   hypotheses with score
   ``s / length ** length_penalty`` (length counts the stop token), the best ``k`` kept,
   unless the group is full under ``early_stopping=True`` or can no longer improve;
3. the best ``k`` candidates that do not end are the next beams;
4. the group can no longer improve once ``k`` hypotheses are finished and the best next
   beam's score, at the current length (or at ``max_tokens`` under ``"never"`` with a
   positive penalty), does not beat the worst of them; it is done then, when
   ``early_stopping=True`` and ``k`` are finished, or when every candidate ended. The ``n``
   best hypotheses are returned, best first.

KV and scheduling. Beams are ordinary scheduler requests with ``beam_group`` set, sampled
greedily with ``logprobs=max(2k, N)`` (the sampler's top-``2k`` on the device; ``2k``
pairs per beam, or ``N`` with ``logprobs=N > 2k``, reach the host). The scheduler appends no token to a beam; after
each update ``BeamSearch.advance`` records each beam's log-probabilities and, once every live beam of a
group has reported (beams step together; a recomputing beam holds its group back), the
group chooses. A beam continuing with one child appends that token; every further child of
the same beam is a *fork* (``KVCacheManager.fork``): a new request whose block table is its
parent's, shared by reference count, with its partial last block copied on the device
(copy-on-write) or, when no block is free, recomputed. A beam without children is pruned
(finished): only the blocks it alone held return to the pool. The first beam's id is the
user request's first output id; forks are ``"{id}@beam{i}"``. When the group is done its
live beams are freed and the ``n`` best come back as final outputs under the user's
output ids (``child_request_ids``), nothing before: beams reorder, so nothing streams.

Per-token log-probabilities (``params.logprobs = N``): each beam row reads its top
``max(2k, N)`` on the device (``2k`` rank the candidates, ``N`` are reported; ``N <= 20``
as for every request). A kept candidate's entry is the chosen token, its log-probability
and rank (exact: every token that beats it is in its parent's top list) and the parent's
top ``N``: the values the beam ranked by (raw ``log_softmax``; a guided beam's leave out
the tokens its grammar forbids). Each beam holds its entries as a ``_Trail`` (a persistent
list: a fork shares its parent's, one new cell per step, no copying); a returned beam's
list is built once, at the end.

Structured output: every beam has its own grammar matcher (``guided.manager``): its rows'
logits are masked by it as any guided request's, and its reported log-probabilities are the
raw ones with the grammar's forbidden tokens at ``-inf`` (``SamplingRow.logprobs_allowed_only``;
Hugging Face masks after ``log_softmax`` too), so every candidate is grammatical. A beam's
chosen token advances its matcher; a fork gets its parent's grammar replayed over its tokens.

The group is one admission unit: only its first beam is queued; ``check`` refuses a group
whose worst case (prompt blocks, plus ``k`` beams of ``max_tokens`` and a partial block
each; ``k`` whole sequences without prefix caching, where a preempted group cannot share
its prompt again) exceeds the cache; while none of its beams runs, it is admitted only
when that many blocks are free (``core.sched.constraints.BeamGroupReserve``). Preempting any
beam preempts the group's running beams, always by recompute (a swapped-out beam that
already reported would come back with nothing to compute). A report counts only while the
beam's tokens are all computed: one from a step that ran while its group chose (async
scheduling) or from a beam preempted since is stale, and the beam reports again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from pagoda.engine.request_groups.parallel_sampling import child_request_ids
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.sampling.row import SamplingRow, TokenLogprobs
from pagoda.engine.sampling_params import SamplingParams

# (params, a beam's output token ids) -> the stop string its text holds, or None.
StopStringFinder = Callable[[SamplingParams, list[int]], Optional[str]]


@dataclass(frozen=True)
class _Trail:
    """A beam's per-token log-probabilities, newest last, as a persistent list: a fork
    shares its parent's cells, so a step costs one cell per kept candidate."""

    entry: TokenLogprobs
    previous: Optional["_Trail"]

    def to_list(self) -> list[TokenLogprobs]:
        entries, cell = [], self
        while cell is not None:
            entries.append(cell.entry)
            cell = cell.previous
        return entries[::-1]


@dataclass
class Hypothesis:
    """A finished (or, at the very end, a best running) beam."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    stop_token: Optional[int] = None  # the stop token (EOS or stop_token_ids) it ended on
    stop_string: Optional[str] = None  # the stop string its text holds
    trail: Optional[_Trail] = None  # its per-token log-probabilities (params.logprobs set)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stop_token is not None or self.stop_string is not None else "length"

    @property
    def logprobs(self) -> Optional[list[TokenLogprobs]]:
        """One entry per token (``params.logprobs`` set), else None."""
        return self.trail.to_list() if self.trail is not None else None


@dataclass
class _Candidate:
    cumulative_logprob: float
    parent: Request
    token_id: int
    ends: bool = False
    stop_string: Optional[str] = None
    trail: Optional[_Trail] = None  # the parent's trail and this token's entry (params.logprobs set)


class BeamGroup:
    """The beams of one user request and its finished hypotheses (see the module docstring)."""

    def __init__(self, request_id: str, params: SamplingParams, stop_token_ids: frozenset[int],
                 first: Request, find_stop_string: Optional[StopStringFinder] = None) -> None:
        self.request_id = request_id
        self.params = params
        self.width = params.num_beams
        self.stop_token_ids = stop_token_ids
        self.output_ids = child_request_ids(request_id, params.n)
        self.members: list[Request] = [first]
        self.scores: dict[str, float] = {first.request_id: 0.0}
        self.trails: dict[str, Optional[_Trail]] = {first.request_id: None}  # with params.logprobs
        self.pending: dict[str, TokenLogprobs] = {}
        self.finished: list[Hypothesis] = []
        self.improvable = True
        self.num_forks = 0
        self.worst_case_blocks = 0  # set by BeamSearch.check (core.sched.constraints.BeamGroupReserve reads it)
        self.first_scheduled_time: Optional[float] = None  # the first beam's, for the final outputs
        self.num_cached_tokens = 0  # the first beam's prefix-cache hit
        self.find_stop_string = find_stop_string if params.stop else None
        first.beam_group = self

    @property
    def ready(self) -> bool:
        """Every live beam reported its log-probabilities for the current length."""
        return all(m.request_id in self.pending for m in self.members)

    def choose(self, max_tokens: int) -> tuple[list[_Candidate], bool]:
        """One step (rules 1-4): the next beams' candidates, and whether the group is done."""
        k = self.width
        candidates = [_Candidate(self.scores[m.request_id] + logprob, m, token)
                      for m in self.members for token, logprob in self.pending[m.request_id].top[:2 * k]
                      if logprob != float("-inf")]  # a token its grammar forbids
        candidates.sort(key=lambda c: -c.cumulative_logprob)
        candidates = candidates[:2 * k]
        length = self.members[0].num_output_tokens + 1
        for c in candidates:
            if self.params.logprobs is not None:
                c.trail = _Trail(self._entry(c), self.trails[c.parent.request_id])
            if self.find_stop_string is not None:
                c.stop_string = self.find_stop_string(self.params, c.parent.output_token_ids + [c.token_id])
            c.ends = c.token_id in self.stop_token_ids or c.stop_string is not None or length >= max_tokens
        self._add_finished(candidates[:k], length)
        running = [c for c in candidates if not c.ends][:k]
        self._update_improvable(running, length, max_tokens)
        full = len(self.finished) == k and self.params.early_stopping is True
        return running, not self.improvable or full or not running

    def _entry(self, c: _Candidate) -> TokenLogprobs:
        """The chosen token's log-probability, rank and its parent's top ``params.logprobs``
        (what the beam ranked by: a guided beam's forbidden tokens left out)."""
        top = self.pending[c.parent.request_id].top
        logprob = next(lp for token, lp in top if token == c.token_id)  # exact, not a difference of sums
        allowed = [(token, lp) for token, lp in top[:self.params.logprobs] if lp != float("-inf")]
        return TokenLogprobs(c.token_id, logprob, 1 + sum(lp > logprob for _, lp in top), allowed)

    def _add_finished(self, best: list[_Candidate], length: int) -> None:
        if not self.improvable or (len(self.finished) == self.width and self.params.early_stopping is True):
            return
        for c in best:
            if c.ends:
                stop = c.token_id if c.token_id in self.stop_token_ids else None
                self.finished.append(Hypothesis(c.parent.output_token_ids + [c.token_id], c.cumulative_logprob,
                                                c.cumulative_logprob / length ** self.params.length_penalty, stop,
                                                c.stop_string, c.trail))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width:]

    def _update_improvable(self, running: list[_Candidate], length: int, max_tokens: int) -> None:
        penalty = self.params.length_penalty
        if len(self.finished) < self.width or not running:
            return
        if self.params.early_stopping == "never" and penalty > 0.0:
            length = max_tokens
        if not running[0].cumulative_logprob / length ** penalty > self.finished[-1].score:
            self.improvable = False

    def results(self, running: list[_Candidate]) -> list[Hypothesis]:
        """The ``n`` best hypotheses; the best running beams fill in when too few finished."""
        best = list(self.finished)
        length = self.members[0].num_output_tokens + 1 if self.members else 0
        for c in running[: max(0, self.params.n - len(best))]:
            best.append(Hypothesis(c.parent.output_token_ids + [c.token_id], c.cumulative_logprob,
                                   c.cumulative_logprob / length ** self.params.length_penalty, trail=c.trail))
        return best[: self.params.n]


class BeamSearch:
    """The engine core's beam groups, over its scheduler (``EngineCore`` owns one).

    Args:
        scheduler: the core's scheduler (its KV cache manager forks beams' block tables).
        guided: the core's ``GuidedDecodingManager`` (guided beams' matchers), or None.
    """

    def __init__(self, scheduler, guided=None) -> None:
        self.scheduler = scheduler
        self.guided = guided
        self._groups: dict[str, BeamGroup] = {}  # each output id -> its group
        self.find_stop_string: Optional[StopStringFinder] = None  # the engine's (it has the tokenizer)

    def make_first_beam(self, request: Request, user_request_id: str, eos_token_ids: frozenset[int]) -> Request:
        """Make ``request`` (user request ``user_request_id``'s only scheduler request) its group's first beam."""
        params = request.sampling_params
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        row_params = params.clone(use_beam_search=False, n=1, best_of=None, beam_width=None,
                                  logprobs=max(2 * params.num_beams, params.logprobs or 0))
        request.sampling_state = SamplingRow(params=row_params, prompt_token_ids=request.prompt_token_ids,
                                             output_token_ids=request.output_token_ids,
                                             logprobs_allowed_only=params.guided_decoding is not None)
        BeamGroup(user_request_id, params, stop_ids, request, self.find_stop_string)
        return request

    def check(self, first: Request) -> None:
        """Raise ValueError when the group's worst case exceeds the KV cache (see the module docstring)."""
        scheduler = self.scheduler
        layout = scheduler.config.layout
        if layout.state_group is not None:
            raise ValueError("use_beam_search: this model keeps recurrent states (linear-attention layers); each "
                             "fork would need its own copy of the state at every step, which pagoda does not make "
                             "yet; use n > 1 sampling instead")
        max_tokens = scheduler.check_request(first)
        block_size = scheduler.config.block_size
        width = first.beam_group.width
        if scheduler.config.enable_prefix_caching:  # beams share the prompt, even after a preemption
            worst = -(-first.num_prompt_tokens // block_size) + width * (-(-max_tokens // block_size) + 1)
        else:  # a preempted group recomputes every beam's prompt into blocks of its own
            worst = width * -(-(first.num_prompt_tokens + max_tokens) // block_size)
        worst *= len(layout.paged_groups)  # a block table per KV cache group (a bound: windows hold fewer)
        first.beam_group.worst_case_blocks = worst
        if worst > scheduler.block_pool.num_usable_blocks:
            raise ValueError(f"beam_width: {first.beam_group.width} beams of max_tokens {max_tokens} may need {worst} "
                             f"KV blocks, more than the cache's {scheduler.block_pool.num_usable_blocks}; "
                             "lower beam_width or max_tokens")

    def add(self, first: Request) -> None:
        """Track the group of a first beam the scheduler accepted."""
        for output_id in first.beam_group.output_ids:
            self._groups[output_id] = first.beam_group

    def expand(self, request_ids: Iterable[str]) -> list[str]:
        """Scheduler ids to finish for ``request_ids``: a group's output id stands for its live
        beams (the group is forgotten); other ids pass through."""
        expanded = []
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is None:
                expanded.append(request_id)
                continue
            expanded += [m.request_id for m in group.members]
            self._forget(group)
        return expanded

    def advance(self, logprobs_by_id: dict[str, list]) -> list[tuple[BeamGroup, list[Hypothesis]]]:
        """Record one applied step's beam log-probabilities; step every group whose beams all
        reported. Returns the groups that are done, with their ``n`` best hypotheses."""
        if not self._groups:
            return []  # no beam search running: nothing to look at
        ready: dict[int, BeamGroup] = {}
        for request_id, entries in logprobs_by_id.items():
            request = self.scheduler.get_request(request_id)
            if request is None or request.beam_group is None or not entries or entries[0] is None:
                continue
            if request.num_computed_tokens != request.num_tokens or request.num_output_placeholders:
                continue  # stale (its group chose while it ran, async) or preempted since: it reports again
            request.beam_group.pending[request_id] = entries[0]
            ready[id(request.beam_group)] = request.beam_group
        done = []
        for group in ready.values():
            if group.ready and group.output_ids[0] in self._groups:
                results = self._step(group)
                if results is not None:
                    done.append((group, results))
        return done

    def _step(self, group: BeamGroup) -> Optional[list[Hypothesis]]:
        running, done = group.choose(group.members[0].max_tokens)
        group.pending.clear()
        if group.first_scheduled_time is None:
            group.first_scheduled_time = group.members[0].metrics.first_scheduled_time
            group.num_cached_tokens = max(group.members[0].num_cached_tokens, 0)
        guided = self.guided if group.params.guided_decoding is not None else None
        if done:
            results = group.results(running)
            self._finish([m.request_id for m in group.members], guided)
            group.members = []
            self._forget(group)
            return results
        continuing: dict[str, _Candidate] = {}
        forks = []
        for c in running:
            if c.parent.request_id in continuing:
                forks.append(c)
            else:
                continuing[c.parent.request_id] = c
        # Pruned beams free what only they held.
        self._finish([m.request_id for m in group.members if m.request_id not in continuing], guided)
        children = [self._fork(group, c) for c in forks]  # before the parents append their own token
        for child, c in children if guided is not None else ():
            guided.fork(c.parent.request_id, child.request_id, child.output_token_ids)
        for c in continuing.values():
            c.parent.append_output_token_ids(c.token_id)
            if guided is not None:
                guided.accept(c.parent.request_id, [c.token_id])
        group.members = [c.parent for c in continuing.values()] + [child for child, _ in children]
        group.scores = {c.parent.request_id: c.cumulative_logprob for c in continuing.values()}
        group.scores.update({child.request_id: c.cumulative_logprob for child, c in children})
        group.trails = {c.parent.request_id: c.trail for c in continuing.values()}
        group.trails.update({child.request_id: c.trail for child, c in children})
        return None

    def _finish(self, request_ids: list[str], guided) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if guided is not None:
            guided.release(request_ids)  # now, not at the next schedule: the engine may go idle

    def _fork(self, group: BeamGroup, c: _Candidate) -> tuple[Request, _Candidate]:
        """A new beam: ``c.parent``'s tokens and KV (shared, ``KVCacheManager.fork``), then ``c.token_id``."""
        parent, scheduler = c.parent, self.scheduler
        group.num_forks += 1
        child = Request(f"{group.request_id}@beam{group.num_forks}", parent.prompt_token_ids, parent.sampling_params,
                        eos_token_ids=parent.eos_token_ids, arrival_time=parent.arrival_time,
                        priority=parent.priority, cache_salt=parent.cache_salt, adapter_id=parent.adapter_id)
        child.append_output_token_ids(parent.output_token_ids + [c.token_id])
        child.sampling_state = dataclasses.replace(parent.sampling_state, prompt_token_ids=child.prompt_token_ids,
                                                   output_token_ids=child.output_token_ids)
        child.beam_group = group
        child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
        scheduler.add_request(child)  # its own insertion index and block hashes
        scheduler.waiting.remove(child)
        if parent.status != RequestStatus.RUNNING:  # its parent was preempted: it waits with it, at the front
            scheduler.waiting.add_preempted(child)
        else:  # runs at once, on its parent's KV
            child.num_computed_tokens = scheduler.kv_cache_manager.fork(parent, child, parent.num_computed_tokens)
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = RequestStatus.RUNNING
            scheduler.running.append(child)
        return child, c

    def _forget(self, group: BeamGroup) -> None:
        for output_id in group.output_ids:
            self._groups.pop(output_id, None)

    @property
    def num_groups(self) -> int:
        return len({id(g) for g in self._groups.values()})
