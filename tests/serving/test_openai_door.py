"""`pagoda serve` alone speaks OpenAI (`--openai-port`): the OpenAI SDK against one replica,
no router started by the user. Texts are compared with the offline engine's."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

from pagoda.engine.llm import LLM
from pagoda.engine.sampling_params import SamplingParams
from tests.serving.test_serving_lifecycle import _wait_until

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def serve(openai_serve):
    return openai_serve


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{serve.openai_port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(max_model_len=512)


@pytest.fixture(scope="module")
def offline_text(offline):
    return offline.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text


def test_models_list_and_retrieve(client):
    (card,) = client.models.list().data
    assert card.id == "SmolLM2-135M-Instruct" and card.owned_by == "pagoda"
    assert client.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.models.retrieve("gpt-4")


def test_bench_serve_drives_the_openai_door(serve):
    """``pagoda bench serve --endpoint-type openai``: the endpoint AIPerf and vllm bench serve measure."""
    import asyncio

    from pagoda.bench.serve import run_workload, summarize

    prompts = [("Tell me about cats.", 4), ("Name a fruit.", 3), ("Count to three:", 5)]
    results, elapsed = asyncio.run(run_workload(f"http://127.0.0.1:{serve.openai_port}", prompts, 2, "openai"))
    assert [r.error for r in results] == [None] * 3
    assert [r.num_output_tokens for r in results] == [4, 3, 5]  # ignore_eos: exactly max_tokens
    assert all(r.num_input_tokens > 0 and r.ttft_s > 0 for r in results)
    assert all(len(r.itl_s) == r.num_output_tokens - 1 for r in results)  # one chunk per token
    assert summarize(results, elapsed, 60.0, 60.0)["goodput_fraction"] == 1.0


def test_completion_equals_the_offline_engine(client, offline_text):
    response = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0)
    assert response.choices[0].text == offline_text
    assert response.usage.completion_tokens == 8 and response.usage.prompt_tokens == 5


def test_beam_search_as_vllms_extra_parameter_equals_the_offline_engine(client, offline):
    """``use_beam_search`` (vLLM's extra body parameter): the n best of ``best_of`` beams, best
    first, with each beam's per-token ``logprobs``."""
    beams = offline.generate([PROMPT], SamplingParams(use_beam_search=True, best_of=4, n=2, temperature=0.0,
                                                      max_tokens=8, logprobs=2))[0].outputs
    response = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, n=2,
                                         logprobs=2, extra_body={"use_beam_search": True, "best_of": 4})
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [b.text for b in beams]
    for choice, beam in zip(choices, beams):
        assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in beam.logprobs], abs=1e-4)
        for top, lp in zip(choice.logprobs.top_logprobs, beam.logprobs):  # keyed by text: the top 2's values
            assert sorted(top.values(), reverse=True) == pytest.approx([v for _, v in lp.top], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=0.7,
                                  extra_body={"use_beam_search": True, "best_of": 2})


def test_chat_streaming_with_usage_equals_the_unary_answer(client):
    messages = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=10,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10


def test_bad_request_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=-3)


def test_an_image_for_the_text_only_model_is_a_400_and_the_door_keeps_serving(client):
    """SmolLM2's chat template concatenates content as a string: an image part is a 400 naming
    ``messages`` (no replica is asked); the next chat is answered."""
    png = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")
    with pytest.raises(openai.BadRequestError, match="chat template cannot render image parts"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2, timeout=60, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}},
                                         {"type": "text", "text": "What is it?"}]}])
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2, timeout=60,
                                            messages=[{"role": "user", "content": "Hi"}])
    assert answer.choices[0].message.content is not None


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_a_forced_tool_call_parses_on_every_try(client):
    """tool_choice required / named: the grammar engine makes every answer a valid call."""
    import json

    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    messages = [{"role": "user", "content": "What will the weather be in Rome for the next three days?"}]
    for seed in range(4):  # sampled at temperature 1: the model's own choices vary, the format never
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                    tools=[WEATHER, CLOCK], tool_choice=choice, temperature=1.0,
                                                    seed=seed, max_tokens=80)
            [result] = answer.choices
            assert result.finish_reason == ("tool_calls" if choice == "required" else "stop"), result
            assert result.message.content is None and result.message.tool_calls, result
            for call in result.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if choice != "required":
                assert [c.function.name for c in result.message.tool_calls] == ["get_weather"]
    # Streaming: the call arrives as one delta when the choice finishes, then usage.
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER],
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            max_tokens=80, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    calls = [tc for c in chunks for choice in c.choices for tc in (choice.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].index == 0
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas["get_weather"])
    assert chunks[-1].usage.completion_tokens > 0
    # The conversation goes on with the tool's answer in it.
    follow = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0, messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 25 C."}])
    assert follow.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="no tool is named 'nope'"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_dead_door_is_restarted_and_serves_again(serve, client, offline_text):
    with urllib.request.urlopen(f"http://127.0.0.1:{serve.openai_port}/health", timeout=5) as response:
        assert response.status == 200
    door_pid = _door_pid(serve.proc.pid)
    os.kill(door_pid, signal.SIGKILL)
    _wait_until(lambda: "the OpenAI door exited with code -9; restarted it" in serve.output, 60, "door restart")
    assert _door_pid(serve.proc.pid) != door_pid
    response = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0)
    assert response.choices[0].text == offline_text


def _door_pid(parent: int) -> int:
    from tests.serving.test_serving_lifecycle import _pids, _ppid

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [pid for pid in _pids() if _ppid(pid) == parent and b"router" in _cmdline(pid)]
        if pids:
            return pids[0]
        time.sleep(0.1)
    raise AssertionError("no OpenAI door process")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_door_metrics_carry_the_replicas_vllm_series(serve, client):
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=2, temperature=0)
    with urllib.request.urlopen(f"http://127.0.0.1:{serve.openai_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert "pagoda_router_metrics_scrape_failures_total 0" in text
    lines = text.splitlines()
    assert sum(line == "# TYPE vllm:num_requests_running gauge" for line in lines) == 1
    assert any(line.startswith('vllm:num_requests_running{replica_id="local",') for line in lines)
    counts = [line for line in lines if line.startswith('vllm:e2e_request_latency_seconds_count{replica_id="local"')]
    assert counts and float(counts[0].rsplit(" ", 1)[1]) >= 1


def test_usage_reports_prefix_cache_hits_as_cached_tokens(client):
    """The second time a long prompt comes, its full blocks come from the prefix cache and
    ``usage.prompt_tokens_details.cached_tokens`` says how many (OpenAI's field)."""
    prompt = "Cached tokens are reported in usage. " + " ".join(f"word{i}" for i in range(60))
    first = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1, temperature=0)
    second = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (first.usage.prompt_tokens - 1) // 16 * 16 and cached >= 64  # whole blocks, not the last token
    assert second.system_fingerprint.startswith("pagoda-")


# ---------------------------------------------------------------- lm-eval's loglikelihood path
QUESTION = "Question: What is the capital of France?\nAnswer:"
CHOICES = [" Paris", " London", " a banana"]


def _offline_loglikelihood(offline, context: list[int], continuation: list[int]) -> float:
    """log P(continuation | context) from the offline engine's prompt log-probabilities."""
    out = offline.generate([context + continuation], SamplingParams(temperature=0.0, max_tokens=1,
                                                                    prompt_logprobs=0))[0]
    return sum(entry.logprob for entry in out.prompt_logprobs[len(context):])


def test_lm_eval_loglikelihood_equals_the_offline_engine(client, offline, smollm2_path):
    """lm-eval's ``local-completions`` loglikelihood request, as it sends it
    (``tokenized_requests=True``): a list of token-id prompts (context + continuation),
    ``echo``, ``max_tokens`` 1 (or 0), ``logprobs`` 1, greedy; it sums
    ``token_logprobs[ctxlen:-1]``. That sum equals the offline engine's log-probability of
    the continuation, and a float64 forward's, within the derived bound
    (``tests/engine/test_prompt_logprobs.py``: per token, twice the float32 logits' bound)."""
    from tests.engine.test_prompt_logprobs import Float64Reference

    tokenizer = offline.engine.tokenizer
    context = tokenizer.encode(QUESTION)
    requests = [(context, tokenizer.encode(QUESTION + choice)[len(context):]) for choice in CHOICES]
    assert all(tokenizer.encode(QUESTION + c)[:len(context)] == context for c in CHOICES)
    body = dict(model="SmolLM2-135M-Instruct", prompt=[ctx + cont for ctx, cont in requests], echo=True,
                logprobs=1, temperature=0, seed=1234)
    one = client.completions.create(max_tokens=1, **body)
    zero = client.completions.create(max_tokens=0, **body)
    assert [c.index for c in one.choices] == [0, 1, 2] and one.usage.prompt_tokens == sum(
        len(ctx) + len(cont) for ctx, cont in requests)
    assert zero.usage.completion_tokens == 0 and one.usage.completion_tokens == 3
    reference = Float64Reference(smollm2_path)
    scores = []
    for (ctx, cont), with_token, prompt_only in zip(requests, one.choices, zero.choices):
        lp = with_token.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        assert len(lp.token_logprobs) == len(ctx) + len(cont) + 1  # the prompt, then the generated token
        assert prompt_only.logprobs.token_logprobs == lp.token_logprobs[:-1]  # max_tokens=0: the prompt alone
        assert prompt_only.text == tokenizer.decode(ctx + cont)
        loglikelihood = sum(lp.token_logprobs[len(ctx):-1])
        is_greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[len(ctx):-1],
                                                                 lp.top_logprobs[len(ctx):-1]))
        logprobs, scale = reference.logprobs(ctx + cont, 49152)
        bound = reference.bound(len(ctx) + len(cont), scale, 49152) * len(cont)
        expected = float(sum(logprobs[q - 1][t] for q, t in enumerate(cont, start=len(ctx))))
        assert abs(loglikelihood - expected) <= bound
        assert abs(loglikelihood - _offline_loglikelihood(offline, ctx, cont)) <= 2 * bound
        assert loglikelihood < 0
        scores.append((loglikelihood, is_greedy))
    # Multiple choice: the higher log-likelihood wins, the same on every try.
    again = client.completions.create(max_tokens=1, **body)
    assert [sum(c.logprobs.token_logprobs[len(ctx):-1]) for (ctx, _), c in zip(requests, again.choices)] == \
        [score for score, _ in scores]
    best = max(range(len(CHOICES)), key=lambda i: scores[i][0])
    assert CHOICES[best] == " Paris", scores


def test_text_prompts_lists_and_n_as_vllm_orders_them(client):
    """A list of text prompts with n=2: choice i*n + j is prompt i's j-th completion, usage
    summed; streamed, every event carries its choice's index; echo with logprobs on text
    prompts gives the prompt's tokens first."""
    prompts = [PROMPT, "Once upon a time"]
    whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts, n=2, max_tokens=3,
                                      temperature=0)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=3, temperature=0)
               for p in prompts]
    assert [c.text for c in whole.choices] == [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert whole.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    events = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts, n=2, max_tokens=3,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    texts = {}
    for event in events:
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert events[-1].usage.completion_tokens == 12
    echoed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, echo=True, logprobs=2,
                                       max_tokens=2, temperature=0)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(PROMPT) and "".join(lp.tokens) == echoed.choices[0].text
    assert lp.token_logprobs[0] is None and all(isinstance(v, float) for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == echoed.usage.prompt_tokens + 2 and all(len(t) == 2 for t in lp.top_logprobs[1:])


def test_bad_prompts_are_400s_naming_the_field(client):
    for prompt in ([1, -5], [[1, 2], "mixed", 3], []):
        with pytest.raises(openai.BadRequestError, match="prompt"):
            client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens: must be a positive integer \(0 only with echo\)"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=0)
    # One prompt the replica refuses (longer than max_model_len 512) fails the whole request
    # with the replica's message: a 400, or (streamed, once another prompt's events went) an
    # error event, which the SDK raises as APIError.
    for stream, error in ((False, openai.BadRequestError), (True, openai.APIError)):
        with pytest.raises(error, match="max_model_len"):
            list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=[[5, 6, 7], [5] * 600],
                                           max_tokens=1, stream=stream) or [])
