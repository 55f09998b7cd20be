"""The engine as its server sees it: ``EngineClient``.

``EngineClient`` lists exactly what the serving loop (``pagoda.serving.engine_loop``) and
its LoRA control requests (``pagoda.serving.lora_control``) call on the engine; nothing
else of ``LLMEngine`` is reached from serving. ``LLMEngine`` implements it structurally
(it does not inherit), and so does every test fake of the loop; ``tests/serving`` checks
that the fakes' signatures match ``LLMEngine``'s, member by member.

Threading: every method runs on the engine loop's thread, except ``load_lora``, which
touches no engine state and runs on the LoRA loader thread.

The request envelope, ``EngineRequest``, lives in ``pagoda.engine.request``: ``engine.kv``
takes a ``Request`` and must not climb into ``engine.core`` (``tests/test_layering.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Protocol, Union, runtime_checkable

from pagoda.contracts.kv_events import KVEvent
from pagoda.engine.outputs import RequestOutput
from pagoda.engine.request import EngineRequest
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.stats import EngineStats

if TYPE_CHECKING:
    from pagoda.models.lora import LoRAAdapter


@runtime_checkable
class EngineClient(Protocol):
    """What a server drives: requests in, one ``step()`` at a time, stats and block events out."""

    def add(self, request: EngineRequest) -> None:
        """Queue a request. Raises ValueError (bad request) or EngineOverloaded (queue full)."""

    def tokenize_prompt(self, text: str, params: Optional[SamplingParams] = None) -> list[int]:
        """A text prompt's token ids for ``EngineRequest.prompt_token_ids`` (thread-safe: a
        server calls it off its engine thread). Raises ValueError (cannot fit)."""

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """End requests; their final outputs come from the next ``step()``."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Advance every schedulable request one iteration; return what progressed."""

    def get_stats(self) -> EngineStats: ...

    def take_block_events(self) -> list[KVEvent]:
        """Block events since the last call, oldest first."""

    # LoRA adapters (docs/lora.md): load off the loop thread, the rest on it.
    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Read an adapter without registering it (thread-safe). Raises ValueError."""

    def register_lora(self, adapter: LoRAAdapter) -> None: ...

    def remove_lora(self, name: str) -> None: ...

    def list_loras(self) -> list[str]: ...

    def lora_paths(self) -> dict[str, str]: ...
