"""``default_max_tokens``: a request without max_tokens is capped (server setting), one with
max_tokens is not, and the cap never exceeds what max_model_len leaves."""

import pytest

from pagoda.engine.config import EngineConfig
from pagoda.engine.request import Request
from pagoda.engine.sampling_params import SamplingParams
from pagoda.engine.core.sched.scheduler import Scheduler, SchedulerConfig


def add(scheduler, rid, prompt_len, max_tokens):
    request = Request(rid, [100 + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens),
                      eos_token_ids=frozenset({2}))
    scheduler.add_request(request)
    return request.max_tokens


@pytest.mark.parametrize("cap, prompt_len, max_tokens, expected", [
    (None, 10, None, 246),   # no cap: what max_model_len (256) leaves, as vLLM
    (32, 10, None, 32),      # capped
    (32, 240, None, 16),     # the cap never exceeds what is left
    (32, 10, 100, 100),      # an explicit max_tokens is the client's choice
])
def test_default_cap(cap, prompt_len, max_tokens, expected):
    scheduler = Scheduler(SchedulerConfig(num_blocks=129, max_model_len=256, block_size=4, default_max_tokens=cap))
    assert add(scheduler, "r", prompt_len, max_tokens) == expected


def test_engine_config_carries_and_checks_the_cap():
    config = EngineConfig(default_max_tokens=8)
    scheduler_config = SchedulerConfig.from_engine_config(config, num_blocks=9, max_model_len=64, model_id="m")
    assert scheduler_config.default_max_tokens == 8
    with pytest.raises(ValueError, match="default_max_tokens"):
        EngineConfig(default_max_tokens=0)
