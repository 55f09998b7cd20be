"""Request: token bookkeeping, status helpers, incremental block hashes."""

from pagoda.contracts.block_hash import hash_prompt_blocks
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.sampling_params import SamplingParams


def test_token_counts_and_defaults():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=5), arrival_time=2.5)
    assert request.num_tokens == 3 and request.num_prompt_tokens == 3 and request.num_output_tokens == 0
    assert request.num_cached_tokens == -1 and request.num_computed_tokens == 0 and request.num_preemptions == 0
    assert request.status == RequestStatus.WAITING and request.finish_reason is None
    assert request.max_tokens == 5 and request.metrics.arrival_time == 2.5
    assert request.sampling_state is None and request.detokenizer is None
    request.append_output_token_ids([7, 8])
    request.append_output_token_ids(9)
    assert request.output_token_ids == [7, 8, 9] and request.all_token_ids == [1, 2, 3, 7, 8, 9]
    assert request.num_tokens == 6 and request.num_output_tokens == 3


def test_status_helpers():
    finished = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED}
    for status in RequestStatus:
        assert status.is_finished() == (status in finished) == RequestStatus.is_finished(status)
    request = Request("r", [1], SamplingParams())
    for status, reason in [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
        (RequestStatus.RUNNING, None),
    ]:
        request.status = status
        assert request.finish_reason == reason and request.is_finished == (reason is not None)


def test_block_hashes_extend_as_outputs_fill_blocks():
    prompt = list(range(10))
    request = Request("r", prompt, SamplingParams(max_tokens=20), cache_salt="t")
    assert request.block_hashes == []  # hashing not initialised
    request.init_block_hashes(4, "m")
    assert request.block_hashes == hash_prompt_blocks(prompt, 4, "m", cache_salt="t")
    assert len(request.block_hashes) == 2
    request.append_output_token_ids([10])
    assert len(request.block_hashes) == 2
    request.append_output_token_ids([11, 12, 13, 14, 15])
    assert len(request.block_hashes) == 4
    assert request.block_hashes == hash_prompt_blocks(request.all_token_ids, 4, "m", cache_salt="t")
    request.init_block_hashes(4, "m")  # idempotent
    assert len(request.block_hashes) == 4
