"""The engine's structured-output state: compiled grammars, and one matcher per sequence.

Life of a guided request (the engine calls each method from its one thread, except
``prepare_bitmask``, see 3):

1. ``submit(group_id, child_ids, params, tenant)`` at ``add_request``: the grammar is
   looked up in an LRU of compiled grammars keyed by ``GuidedDecodingParams.cache_key``
   (the entry is a compile job, so equal formats submitted together compile once); a miss
   checks the format's size and complexity (``limits.py``: ``ValueError`` naming the
   limit) and queues the compile on the pool in the tenant's turn (``pool.py``: fair,
   bounded threads, a time budget; ``CompilePoolFull`` while every stuck slot is taken).
   Nothing is kept when it raises. The engine keeps the request out of the scheduler.
2. ``poll()`` at the start of every step: compiles past ``guided_compile_timeout_s`` fail;
   requests whose grammar is ready get a matcher per child and go to the scheduler;
   requests whose grammar failed to compile (or timed out) finish with that error. A step
   never waits for a compile: the batch runs without them.
3. ``truncate_drafts(drafts)`` after the speculator proposes: a guided request's drafted
   tokens are cut before the first one its grammar forbids or a stop token that would end
   it (the target emits that one itself), so every scheduled draft is grammatical.
   ``prepare_bitmask(items)`` in the step's device job, behind the gate (after the
   previous step's ``accept``; on the worker thread with async scheduling, which then
   has the matchers to itself until the host applies this step): one packed bitmask row per
   logits row of a request with a grammar (``None`` when the batch has none, so the
   sampler does no grammar work at all): one row for a plain decode, ``1 + n`` for a
   request verifying ``n`` drafts (the matcher walks the drafts and rolls back). It rides
   in the step's ``SamplingBatch``, and the sampler's last logits processor
   (``GrammarBitmaskProcessor``) applies it on the logits' device, for plain sampling
   and the speculator's verification alike, so a draft the target may not emit has
   probability 0 and is rejected.
4. ``accept(request_id, token_ids)`` after sampling advances the matcher by the tokens
   the request kept; it returns ``True`` once the grammar has terminated (it accepted a
   stop token), so the engine finishes the request with ``stop``.
   A beam-search group's beams each have a matcher: a fork's is its parent's grammar
   replayed over the fork's tokens (``fork``), and a beam's chosen token advances its own
   (``request_groups.beam_search``).
5. ``release(request_ids)`` drops matchers of finished requests; ``cancel(group_id)``
   forgets a request still waiting for its grammar (an abort: it stops waiting at once),
   and a queued compile that nobody waits for any more never starts.

A resumed request (``engine.resume``) brings output tokens from another replica (``replay``,
right after ``submit``): its matcher consumes them in ``poll`` before the request is
scheduled (a token the grammar refuses fails the request, as a grammar that does not
compile does).

Preemption by recompute keeps a request's output tokens (only its KV is recomputed), so
the matcher, which has consumed exactly those tokens, stays valid. Drafts are walked and
rolled back within ``truncate_drafts`` and ``prepare_bitmask``; only the tokens a request
keeps (accepted drafts plus one) reach ``accept``, so a rejected draft never stays in a
matcher.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import wait, FIRST_COMPLETED
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch

from pagoda.engine.guided.backend import GrammarBackend, Matcher, bitmask_width
from pagoda.engine.config import EngineConfig, GuidedConfig
from pagoda.engine.guided.bitmask import TokenBitmask
from pagoda.engine.guided.limits import check_complexity
from pagoda.engine.guided.params import GuidedDecodingParams
from pagoda.engine.guided.pool import CompileJob, CompilePool

logger = logging.getLogger(__name__)


class GuidedDecodingManager:
    """Args:
    make_backend: builds the ``GrammarBackend`` (called once, on the compile pool, so a
        slow import never blocks the engine thread).
    vocab_size: the sampler's vocabulary size (bitmask width).
    config: the compile budget (``EngineConfig.guided``; defaults when ``None``).
    cache_size: compiled grammars kept (LRU).
    pin_memory: allocate bitmasks in pinned memory (a CUDA engine) for async copies.
    """

    def __init__(self, make_backend: Callable[[], GrammarBackend], vocab_size: int,
                 config: Optional[GuidedConfig] = None, cache_size: int = 256, pin_memory: bool = False) -> None:
        self._lazy = _LazyBackend(make_backend)  # what a compile job holds: not the manager (no cycle)
        self._config = config = config or EngineConfig().guided
        self._pool = CompilePool(config.guided_compile_workers, config.guided_compile_timeout_s,
                                 config.guided_max_stuck_compiles)
        self._cache: "OrderedDict[tuple, CompileJob]" = OrderedDict()
        self._cache_size = cache_size
        self._waiting: dict[str, tuple[CompileJob, list[str]]] = {}
        self._replay: dict[str, list[int]] = {}  # group id -> a resumed request's output (poll replays it)
        self._matchers: dict[str, Matcher] = {}
        self._grammar_of: dict[str, Any] = {}  # request id -> its compiled grammar (for ``fork``)
        self._width = bitmask_width(vocab_size)
        self._pin_memory = pin_memory
        self.num_compilations = 0

    # 1-2. compile ----------------------------------------------------------------------
    def submit(self, group_id: str, child_ids: Sequence[str], params: GuidedDecodingParams,
               tenant: Optional[str] = None) -> None:
        """Wait for ``params``' grammar under ``group_id`` (compiled in ``tenant``'s turn).

        Raises (nothing is kept then):
            ValueError: the format is over a size/complexity limit (``limits.py``).
            CompilePoolFull: it needs a compile and every stuck-compile slot is taken.
        """
        key = params.cache_key
        job = self._cache.get(key)
        if job is None:
            check_complexity(params, self._config)
            job = self._pool.submit(partial(self._lazy.compile, params.kind, params.spec,
                                            not params.disable_any_whitespace), tenant or "")
            self.num_compilations += 1
            self._cache[key] = job
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        job.num_waiters += 1
        self._waiting[group_id] = (job, list(child_ids))

    def replay(self, group_id: str, token_ids: Sequence[int]) -> None:
        """A resumed request's output so far (``engine.resume``), for ``group_id`` waiting for its
        grammar (``submit`` just now): its matchers consume it when the grammar is ready (``poll``)."""
        assert group_id in self._waiting, f"{group_id!r} is not waiting for a grammar"
        self._replay[group_id] = list(token_ids)

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """``(ready group ids, [(group id, error message)])`` since the last poll (compiles
        past their time budget fail here)."""
        self._pool.expire()
        ready, failed = [], []
        for group_id, (job, child_ids) in list(self._waiting.items()):
            if not job.future.done():
                continue
            del self._waiting[group_id]
            replay = self._replay.pop(group_id, ())
            error = job.future.exception()
            if error is not None:
                message = str(error) if isinstance(error, ValueError) else \
                    f"guided_decoding: the grammar backend failed: {type(error).__name__}: {error}"
                failed.append((group_id, message))
                continue
            for child_id in child_ids:
                self._grammar_of[child_id] = job.future.result()
                self._matchers[child_id] = self._backend.make_matcher(self._grammar_of[child_id])
            refused = self._replayed(child_ids, replay)
            if refused is not None:
                self.release(child_ids)
                failed.append((group_id, refused))
                continue
            ready.append(group_id)
        return ready, failed

    def _replayed(self, child_ids: Sequence[str], token_ids: Sequence[int]) -> Optional[str]:
        """Advance fresh matchers over a resumed request's output; the error when the grammar
        refuses one of its tokens or ended before them (None: consumed)."""
        for child_id in child_ids if token_ids else ():
            matcher = self._matchers[child_id]
            for i, token_id in enumerate(token_ids):
                if matcher.is_terminated() or not matcher.accept_token(token_id):
                    return (f"resume.output_token_ids: token {token_id} at output position {i} is outside the "
                            "request's guided_decoding format")
        return None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_stuck_compiles(self) -> int:
        """Compiles past their time budget still running in the backend (``pool.py``)."""
        return self._pool.num_stuck

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds (less when a compile's budget ends sooner) for
        any pending compile (only when the engine has nothing else to run, so an idle loop
        does not spin)."""
        pending = [job.future for job, _ in self._waiting.values()]
        deadline = self._pool.next_deadline()
        if pending:
            wait(pending, timeout=timeout if deadline is None else min(timeout, deadline),
                 return_when=FIRST_COMPLETED)

    def cancel(self, group_id: str) -> None:
        """Stop waiting for ``group_id``'s grammar; a compile nobody waits for any more that
        has not started never starts."""
        entry = self._waiting.pop(group_id, None)
        self._replay.pop(group_id, None)
        if entry is None:
            return
        job = entry[0]
        job.num_waiters -= 1
        if job.num_waiters == 0 and self._pool.discard(job):
            key = next((k for k, cached in self._cache.items() if cached is job), None)
            if key is not None:
                del self._cache[key]

    @property
    def _backend(self) -> Optional[GrammarBackend]:
        return self._lazy.backend

    # 3-5. per step ---------------------------------------------------------------------
    def truncate_drafts(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """Cut each guided request's drafts before the first token its grammar forbids or
        the stop token that would end it (the target then emits that one itself)."""
        for request_id, token_ids in drafts.items():
            matcher = self._matchers.get(request_id)
            if matcher is None or not token_ids:
                continue
            num_valid = 0
            for token_id in token_ids:
                if not matcher.accept_token(token_id):
                    break
                num_valid += 1
                if matcher.is_terminated():
                    num_valid -= 1
                    break
            matcher.rollback(num_valid + (1 if matcher.is_terminated() else 0))
            drafts[request_id] = list(token_ids[:num_valid])
        return drafts

    def prepare_bitmask(self, items: Sequence[Any]) -> Optional[TokenBitmask]:
        """Allowed next tokens for the step's logits rows.

        Args:
            items: the sampling ``ScheduledRequest``s in batch order; each owns ``1 +
                len(item.spec_token_ids)`` consecutive logits rows.
        Returns:
            Rows (indices into those logits rows) and bits, or ``None`` when no row has a
            grammar.
        """
        if not self._matchers:
            return None
        plan, row = [], 0
        for item in items:
            matcher = self._matchers.get(item.request.request_id)
            # A terminated grammar finished its request; with overlap, the step launched
            # before that was applied still samples for it, and the token is dropped.
            if matcher is not None and not matcher.is_terminated():
                plan.append((matcher, row, list(item.spec_token_ids)))
            row += 1 + len(item.spec_token_ids)
        if not plan:
            return None
        bits = torch.empty(sum(1 + len(d) for _, _, d in plan), self._width, dtype=torch.int32,
                           pin_memory=self._pin_memory)
        rows: list[int] = []
        for matcher, start, drafts in plan:
            for j in range(len(drafts) + 1):
                matcher.fill_bitmask(bits, len(rows))
                rows.append(start + j)
                if j < len(drafts):
                    accepted = matcher.accept_token(drafts[j])
                    assert accepted, "drafts are cut to the grammar by truncate_drafts"
            if drafts:
                matcher.rollback(len(drafts))
        return TokenBitmask(rows=torch.tensor(rows, dtype=torch.long), bits=bits)

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advance ``request_id``'s matcher; ``True`` when its grammar has terminated."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        for token_id in token_ids:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token_id):
                # Only reachable when another stage forbade every token the grammar allows
                # (e.g. min_tokens blocking the EOS that must end a complete structure).
                logger.warning("guided decoding: request %s sampled token %d, which its grammar forbids; "
                               "finishing it", request_id, token_id)
                return True
        return matcher.is_terminated()

    def fork(self, parent_id: str, child_id: str, token_ids: Sequence[int]) -> None:
        """Give ``child_id`` a matcher of ``parent_id``'s grammar that consumed ``token_ids``
        (a beam forked from its parent: the parent's output tokens, then its own)."""
        grammar = self._grammar_of[parent_id]
        matcher = self._backend.make_matcher(grammar)
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                raise AssertionError(
                    f"beam {child_id}: token {token_id} is outside its grammar (the bitmask allows it)")
        self._grammar_of[child_id], self._matchers[child_id] = grammar, matcher

    def has_matcher(self, request_id: str) -> bool:
        return request_id in self._matchers

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            self._grammar_of.pop(request_id, None)


class _LazyBackend:
    """The grammar backend, built on first use by a compile (on the pool's thread: a slow import
    never blocks the engine's). The cached compile jobs hold this, not the manager that holds
    them, so the manager (and the engine above it) is no reference cycle."""

    def __init__(self, make_backend: Callable[[], GrammarBackend]) -> None:
        self._make_backend = make_backend
        self._lock = threading.Lock()
        self.backend: Optional[GrammarBackend] = None

    def compile(self, kind: str, spec: str, any_whitespace: bool) -> Any:
        with self._lock:
            if self.backend is None:
                self.backend = self._make_backend()
        return self.backend.compile(kind, spec, any_whitespace)
