"""EngineCore against a fake ``Executor``: the core only schedules, launches and applies.

No model, no torch in the fake: the executor "samples" token ``100 + number of outputs``
for every sampling request and answers each launch with a ``ModelRunnerOutput`` that
echoes the step's id, which is all ``Scheduler.update_from_output`` needs. The async
variant checks the gate: step N+1's job asks for it, and it opens only after N is applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.engine.config import EngineConfig
from pagoda.engine.core.engine_core import EngineCore
from pagoda.engine.runner.runner_output import ModelRunnerOutput
from pagoda.engine.request import EngineRequest
from pagoda.engine.sampling_params import SamplingParams


@dataclass
class _Handle:
    """A job run when its result is asked for: wait at the gate, then "sample"."""

    output: ModelRunnerOutput
    wait_previous: object = None
    positions: dict = field(default_factory=dict)  # request -> the output position it samples
    wait_s: float = 0.0

    def get(self) -> ModelRunnerOutput:
        if self.wait_previous is not None:
            self.wait_previous()
        # Behind the gate every earlier token is applied: the history sampling reads is whole.
        assert all(request.num_output_tokens == position for request, position in self.positions.items())
        return self.output

    def wait(self) -> None:
        pass


class _Timer:
    def break_chain(self) -> None:
        pass


class _Guided:
    num_waiting = 0

    def accept(self, request_id, token_ids) -> bool:
        return False

    def release(self, request_ids) -> None:
        pass

    def poll(self):
        return [], []


@dataclass
class _FakeExecutor:
    is_async: bool = False
    num_blocks: int = 64
    num_host_blocks: int = 0
    num_host_state_slots: int = 0
    kv_layout: None = None
    swap_cost_model: None = None
    file_tiers: None = None  # no disk or shared KV tier
    guided: _Guided = field(default_factory=_Guided)
    timer: _Timer = field(default_factory=_Timer)
    gates: list = field(default_factory=list)  # per launch: whether a gate was passed

    def propose_drafts(self, running):
        return None

    def release(self, request_ids) -> None:
        list(request_ids)

    def launch(self, scheduler_output, wait_previous) -> _Handle:
        self.gates.append(wait_previous is not None)
        items = [item for item in scheduler_output.scheduled if item.is_sampling]
        # The output position each request samples, counting placeholders of unapplied steps.
        positions = {item.request: item.request.num_output_tokens + item.request.num_output_placeholders - 1
                     for item in items}
        tokens = {request.request_id: [100 + position] for request, position in positions.items()}
        return _Handle(ModelRunnerOutput.from_tokens(scheduler_output.step_id, tokens), wait_previous, positions)

    def shutdown(self) -> None:
        pass


class _ModelConfig:
    vocab_size = 1000

    def check_max_model_len(self, max_model_len):
        return max_model_len or 128


def _core(is_async: bool) -> tuple[EngineCore, _FakeExecutor]:
    executor = _FakeExecutor(is_async=is_async)
    config = EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    return EngineCore(config, _ModelConfig(), "fake", eos_token_ids=[2], executor=executor), executor


def _run(core: EngineCore) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for request_id, prompt in (("a", [5, 6, 7, 8, 9]), ("b", [10, 11])):
        core.add_requests(core.make_requests(EngineRequest(request_id, prompt, params, arrival_time=0.0), prompt))
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    core.shutdown()
    return tokens


def test_the_core_applies_the_runner_output_it_launched():
    core, executor = _core(is_async=False)
    assert _run(core) == {"a": [100, 101, 102], "b": [100, 101, 102]}
    assert not any(executor.gates)  # synchronous: nothing to wait for
    assert core.scheduler.num_free_blocks == executor.num_blocks - 1


def test_with_overlap_each_step_after_the_first_waits_at_the_gate():
    core, executor = _core(is_async=True)
    assert _run(core) == {"a": [100, 101, 102], "b": [100, 101, 102]}
    assert executor.gates[0] is False and all(executor.gates[1:])
    assert core.scheduler.num_free_blocks == executor.num_blocks - 1
