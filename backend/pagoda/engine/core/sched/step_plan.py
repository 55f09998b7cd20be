"""``StepPlan``: the bookkeeping of one ``Scheduler.schedule()`` call.

It holds the token budget left, how many tokens each scheduled request gets (drafts
included), who was preempted and who was admitted this step, and the hashes of the full
blocks this step computes. A waiting request whose next uncached blocks are among those
waits one step and then hits them instead of prefilling the same prefix again beside its
first owner (bursts sharing a prompt: an agent's fan-out, n parallel completions; see
``core.sched.constraints.SharedPrefixWait``). Under the batch queue (``core.batch_queue``) a step
also takes at most ``max_requests`` requests, so N steps in flight share the running ones.

The encoder budget (images, docs/multimodal.md): an image whose first placeholder a step
schedules is encoded in that step, so a step takes images whose placeholders sum to at most
``encoder_budget`` tokens (``cut_at_images`` ends a chunk before the first image that does not
fit; the step's first image always fits, so none waits forever). An image whose first
placeholders a prefix hit covered is not counted (the runner encodes it uncounted, or finds it
in the encoder cache).

Images whose tokens attend to each other both ways (Gemma 3, ``MultiModalFeature.is_bidirectional``):
a chunk never ends inside one (``_cut_before_bidirectional``): it ends before the image, or the
request waits when its chunk began inside the image (a prefix hit ending there) and the rest of the
image does not fit this step. The input processor refuses an image larger than a step's prefill
(``ImageInputs.max_step_tokens``), so every image fits a step of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

from pagoda.engine.request import Request

if TYPE_CHECKING:
    from pagoda.engine.scheduler_output import SchedulerOutput


class StepPlan:
    def __init__(self, budget: int, block_size: int = 16, enable_chunked_prefill: bool = True,
                 long_prefill_token_threshold: int = 0) -> None:
        self.budget = budget
        self.block_size = block_size
        self.enable_chunked_prefill = enable_chunked_prefill
        # The most tokens one request gets in this step when its prompt is chunked (0: the budget).
        self.max_chunk = long_prefill_token_threshold if enable_chunked_prefill and long_prefill_token_threshold \
            else None
        self.computing: set = set()  # hashes of the full blocks this step computes
        self.num_new_tokens: dict[str, int] = {}
        self.num_spec_tokens: dict[str, int] = {}  # of num_new_tokens, drafted tokens
        self.preempted: list[Request] = []
        # Admitted this step: their blocks may still await host -> device copies (or share
        # blocks that do), so they are never swapped out in this step.
        self.admitted: set[str] = set()
        self.max_requests: Optional[int] = None  # the batch queue's share of the requests per step
        self.encoder_budget: Optional[int] = None  # image placeholder tokens this step may encode; None: any
        self.num_encoder_tokens = 0  # of which scheduled so far

    @property
    def is_full(self) -> bool:
        """No token budget left, or as many requests as ``max_requests``."""
        return self.budget == 0 or (self.max_requests is not None and len(self.num_new_tokens) >= self.max_requests)

    def chunk(self, num_tokens_left: int) -> Optional[int]:
        """How many of a request's ``num_tokens_left`` tokens this step can take: a chunk of
        them with chunked prefill (at most ``max_chunk``), else all or nothing (None: they do
        not fit)."""
        if not self.enable_chunked_prefill and num_tokens_left > self.budget:
            return None
        return self.capped(min(num_tokens_left, self.budget))

    def capped(self, num_tokens: int) -> int:
        """``num_tokens`` at most ``max_chunk`` (the per-request cap of a step, when set)."""
        return num_tokens if self.max_chunk is None else min(num_tokens, self.max_chunk)

    def cut_at_images(self, request: Request, start: int, num_new: int) -> int:
        """``num_new`` tokens from ``start``, or fewer: never ending inside an image whose tokens
        attend to each other both ways, and up to the first image starting among them that would
        pass the encoder budget (0: the request waits for the next step)."""
        if not request.mm_features or not self.enable_chunked_prefill:
            return num_new  # (without chunked prefill a prompt runs whole, images and all)
        num_new = _cut_before_bidirectional(request, start, num_new)
        if self.encoder_budget is None:
            return num_new
        used = self.num_encoder_tokens
        for image in request.mm_features:
            if start <= image.offset < start + num_new:
                if used and used + image.length > self.encoder_budget:
                    return image.offset - start
                used += image.length
        return num_new

    def add(self, request: Request, num_new_tokens: int, num_spec_tokens: int = 0) -> None:
        start = request.num_computed_tokens
        self.num_encoder_tokens += sum(image.length for image in request.mm_features
                                       if start <= image.offset < start + num_new_tokens)
        self.num_new_tokens[request.request_id] = num_new_tokens
        if num_spec_tokens:
            self.num_spec_tokens[request.request_id] = num_spec_tokens
        self.budget -= num_new_tokens
        self._mark_computing(request, request.num_computed_tokens, num_new_tokens - num_spec_tokens)

    def _mark_computing(self, request: Request, start: int, num_tokens: int) -> None:
        self.computing.update(request.block_hashes[start // self.block_size:(start + num_tokens) // self.block_size])

    def share_with_queue(self, in_flight: Iterable["SchedulerOutput"], busy: set[str], num_live: int,
                         micro_batches: int) -> None:
        """The batch queue's rules for this step: ``busy`` becomes the ids of the requests in the
        ``in_flight`` steps (they are not scheduled), whose blocks count as computing (a waiting
        request sharing them waits for them, as for this step's own), and this step takes at
        most ``ceil(num_live / micro_batches)`` requests."""
        busy.clear()
        for scheduler_output in in_flight:
            for item in scheduler_output.scheduled:
                busy.add(item.request_id)
                self._mark_computing(item.request, item.num_computed_tokens,
                                     item.num_new_tokens - len(item.spec_token_ids))
        self.max_requests = -(-num_live // micro_batches)

    def num_shared_computing(self, request: Request, num_cached_tokens: int) -> int:
        """Tokens of ``request``'s uncached blocks, from its first one on, that this step computes."""
        index = num_cached_tokens // self.block_size
        start = index
        while index < len(request.block_hashes) and request.block_hashes[index] in self.computing:
            index += 1
        return (index - start) * self.block_size

    def remove(self, request: Request) -> None:
        self.budget += self.num_new_tokens.pop(request.request_id, 0)
        self.num_spec_tokens.pop(request.request_id, None)


def _cut_before_bidirectional(request: Request, start: int, num_new: int) -> int:
    """``num_new``, or fewer so that the chunk ``[start, start + num_new)`` does not end inside an
    image whose tokens attend to each other both ways (its queries need the keys of its later
    tokens in the same step): it ends before the image, or at ``start`` (0 tokens) when it began
    inside it (after a prefix hit) and the rest of the image does not fit this step."""
    end = start + num_new
    for image in request.mm_features:
        if image.is_bidirectional and image.offset < end < image.end:
            return max(image.offset, start) - start
    return num_new
