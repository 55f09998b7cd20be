"""StepSampler: the runner's last stage, one step's logits in, its ``ModelRunnerOutput`` out.

Owned by ``ModelRunner`` and called inside ``ModelRunner.execute`` after the forward and
after the gate (the previous step's tokens are applied, so output histories and grammar
matchers are current):

* without speculative decoding: one ``SamplingBatch`` for the step's sampling rows (the
  grammar bitmask inside it, applied as the last logits processor), one ``Sampler`` call;
* with it: ``Speculator.sample`` (rows without drafts sampled in one batch, rows with
  drafts verified).

It also keeps each step's last sampled token per request on the device, for the next
step's placeholders (async scheduling): the runner reads them with ``last_token_ids``,
so no tokens travel back through the engine core.
"""

from __future__ import annotations

from typing import Container, Optional, Sequence

import torch

from pagoda.engine.guided.bitmask import TokenBitmask
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.sampling.sampler import Sampler
from pagoda.engine.spec_decode import Speculator


class StepSampler:
    """Args:
    sampler: the engine's sampler (its logits processors are the only door to logits).
    speculator: verifies drafts, or None without speculative decoding.
    device: where the last sampled tokens are kept.
    """

    def __init__(self, sampler: Sampler, speculator: Optional[Speculator], device: torch.device) -> None:
        self.sampler = sampler
        self.speculator = speculator
        self.device = device
        self._last = torch.zeros(0, dtype=torch.int64, device=device)  # [num_sampled_requests]
        self._last_rows: dict[str, int] = {}

    def __call__(self, logits: Optional[torch.Tensor], items: Sequence,
                 token_bitmask: Optional[TokenBitmask] = None) -> ModelRunnerOutput:
        """Tokens and raw logprobs of every sampling request, in batch order.

        Args:
            logits: ``ModelRunner.compute_logits``'s rows, ``1 + len(spec_token_ids)`` per item.
            items: the step's ``ScheduledRequest``s with ``is_sampling``, in batch order.
            token_bitmask: grammar masks indexing those logits rows, or None.
        """
        if not items:
            return ModelRunnerOutput()
        req_ids = [item.request.request_id for item in items]
        if self.speculator is not None:
            tokens, logprobs = self.speculator.sample(logits, list(items), token_bitmask)
            return ModelRunnerOutput(req_ids, tokens, logprobs)
        batch = self.sampler.make_batch([item.request.sampling_state for item in items], token_bitmask)
        result = self.sampler(logits, batch)
        return ModelRunnerOutput(req_ids, [[t] for t in result.token_ids], [[lp] for lp in result.logprobs])

    def keep_last(self, output: ModelRunnerOutput) -> None:
        """Keep ``output``'s last token per request on the device (the next step's placeholders)."""
        self._last = torch.tensor([t[-1] for t in output.sampled_token_ids], dtype=torch.int64, device=self.device)
        self._last_rows = {req_id: row for row, req_id in enumerate(output.req_ids)}

    @property
    def kept_request_ids(self) -> Container[str]:
        """Requests whose token from the last kept step is on the device."""
        return self._last_rows.keys()

    def last_token_ids(self, request_ids: Sequence[str]) -> torch.Tensor:
        """``[len(request_ids)]`` each request's token from the last kept step, on the device."""
        try:
            src = [self._last_rows[request_id] for request_id in request_ids]
        except KeyError as exc:
            raise AssertionError(f"placeholder for {exc} which did not sample in the previous step") from None
        return self._last[torch.tensor(src, dtype=torch.int64, device=self.device)]
