"""One step's image inputs for a vision-language model: which rows take which embedding rows,
and the step's M-RoPE positions (``models.multimodal.MultiModalBatch``).

For each scheduled request with images (``StepInput.mm_features``), the step's tokens
``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` may overlap an image's
placeholders ``[offset, offset + length)``; the overlap's rows get the matching slice of the
image's embedding (and DeepStack features), from the encoder cache (``encoder_cache.py``)
or the encoder run now, inside the step. So a chunked prefill that splits an image places
each chunk's part of it, and a prefix-cache hit that covers an image needs no encoder at all.

M-RoPE (a model with ``VisionSpec.mrope_section``): when any request of the step has images,
every token gets (t, h, w) positions: a prompt token its entry in the request's table (the
model's ``mrope_positions``, computed once per request and kept until it finishes or is
preempted), a later token its index plus the request's ``delta``, a text-only request's tokens
their index thrice. A step without image requests returns None (1-D positions are right:
text-only requests have ``delta`` 0).

Key limits (images whose tokens attend to each other both ways, Gemma 3): ``key_limits`` gives
each row of the step the last key position it sees, its own position but inside such an image,
where it is the image's last position (``kernels.AttentionMetadata.key_limits``); None when no
such image overlaps the step (plain causal).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from pagoda.engine.runner.encoder_cache import EncoderCache
from pagoda.models.multimodal import MultiModalBatch


class MultiModalInputs:
    """Args:
    model: a vision-language model (``encode_image``, ``mrope_positions``, ``config.vision``).
    device: where the step runs.
    cache_bytes: the encoder cache's cap.
    """

    def __init__(self, model: Any, device: torch.device, cache_bytes: int) -> None:
        self.model = model
        self.device = device
        self.cache = EncoderCache(cache_bytes)
        self.uses_mrope = bool(model.config.vision.mrope_section)
        self._mrope: dict[str, tuple[torch.Tensor, int]] = {}  # request id -> (prompt positions, delta)

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget the positions of finished or preempted requests."""
        for request_id in request_ids:
            self._mrope.pop(request_id, None)

    def build(self, scheduled: list, offsets: list[int]) -> Optional[MultiModalBatch]:
        """The step's ``MultiModalBatch``, or None when no request of it has images.

        Args:
            scheduled: the step's ``StepInput``s in batch order.
            offsets: each input's first flat row (``_FlatBatch.offsets``).
        """
        if not any(item.mm_features for item in scheduled):
            return None
        rows, embeds, deepstack = [], [], []
        for item, base in zip(scheduled, offsets):
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            for feature in item.mm_features:
                lo, hi = max(start, feature.offset), min(end, feature.end)
                if lo >= hi:
                    continue
                image = self.cache.get_or_encode(feature.mm_hash, feature.data, self.model.encode_image)
                rows.append(torch.arange(base + lo - start, base + hi - start))
                embeds.append(image.embeds[lo - feature.offset:hi - feature.offset])
                deepstack.append([d[lo - feature.offset:hi - feature.offset] for d in image.deepstack])
        hidden = self.model.config.hidden_size
        return MultiModalBatch(
            rows=torch.cat(rows).to(self.device) if rows else torch.empty(0, dtype=torch.int64, device=self.device),
            embeds=torch.cat(embeds) if embeds else torch.empty(0, hidden, dtype=self.model.dtype, device=self.device),
            deepstack=tuple(torch.cat(layer) for layer in zip(*deepstack)) if deepstack else (),
            mrope_positions=self._positions(scheduled) if self.uses_mrope else None)

    @staticmethod
    def key_limits(scheduled: list) -> Optional[list[int]]:
        """Per row of the step, its last visible key position, or None (module docstring)."""
        spans = [[(max(item.num_computed_tokens, f.offset), min(item.num_computed_tokens + item.num_new_tokens, f.end),
                   f.end - 1) for f in item.mm_features if f.is_bidirectional] for item in scheduled]
        if not any(lo < hi for item_spans in spans for lo, hi, _ in item_spans):
            return None
        limits: list[int] = []
        for item, item_spans in zip(scheduled, spans):
            start = item.num_computed_tokens
            row = list(range(start, start + item.num_new_tokens))
            for lo, hi, last in item_spans:
                row[lo - start:max(hi, lo) - start] = [last] * max(hi - lo, 0)
            limits += row
        return limits

    def _positions(self, scheduled: list) -> torch.Tensor:  # [3, num_tokens]
        parts = []
        for item in scheduled:
            index = torch.arange(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens)
            if not item.mm_features:
                parts.append(index.expand(3, -1))
                continue
            table, delta = self._table(item)
            part = (index + delta).expand(3, -1).clone()
            inside = index < table.shape[1]
            part[:, inside] = table[:, index[inside]]
            parts.append(part)
        return torch.cat(parts, dim=1).to(self.device)

    def _table(self, item: Any) -> tuple[torch.Tensor, int]:
        kept = self._mrope.get(item.request_id)
        if kept is None:
            kept = self._mrope[item.request_id] = self.model.mrope_positions(item.num_prompt_tokens, item.mm_features)
        return kept
