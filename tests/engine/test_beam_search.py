"""Beam search in the engine equals Hugging Face ``generate(num_beams=k)``, on shared KV blocks.

Best sequences (and their order) must be identical and scores within a derived bound, for
k = 1, 2, 4, 8 with several ``length_penalty`` / ``early_stopping`` settings, batched with
ordinary greedy requests (which must still equal HF greedy). The KV side: a group's beams
hold far fewer physical blocks than k private copies, forks copy a partial block on the
device, and every block returns to the pool after aborts, preemption and stop strings.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from pagoda.engine.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.sampling_params import SamplingParams

from tests.engine.driving import drain
from tests.engine.hf_reference import make_random_model
from tests.numerics import UNIT_ROUNDOFF, gamma, model_error_bound

MAX_NEW = 10
# (beam width, n returned, length_penalty, early_stopping): every HF stopping rule once.
SETTINGS = {1: (1, 1.0, False), 2: (2, 1.0, False), 4: (2, 0.5, True), 8: (3, 1.3, "never")}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_path):
    return str(make_random_model(tmp_path_factory.mktemp("beam") / "llama", "llama-gqa3-hd64", smollm2_path))


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_beams(model, prompt, k, n, length_penalty, early_stopping, stop_ids, max_new=MAX_NEW):
    """HF's n best (tokens, score); for k == 1 (HF runs greedy search) the score is rebuilt
    from the step scores as beam search defines it: sum of logprobs / len ** length_penalty."""
    out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=n, max_new_tokens=max_new,
                         do_sample=False, length_penalty=length_penalty, early_stopping=early_stopping,
                         eos_token_id=list(stop_ids), pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    seqs = [s[len(prompt):].tolist() for s in out.sequences]
    if k > 1:
        return [(_strip_pad(s, stop_ids), score) for s, score in zip(seqs, out.sequences_scores.tolist())]
    tokens = seqs[0]
    logprobs = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.scores, tokens)]
    return [(tokens, sum(logprobs) / len(tokens) ** length_penalty)]


def _strip_pad(tokens, stop_ids):
    """HF pads shorter finished beams after their stop token."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


def _score_bound(model, prompt, length, length_penalty, cumulative):
    """|our score - HF's|: each logit is within ``2 e`` of HF's (both within ``e``, the derived
    bound of the exact logit, ``tests/numerics.py``), so each log-softmax term is within
    ``4 e`` plus both float32 log-softmaxes' own rounding (``gamma_V`` each, the log of a
    V-term sum of exponentials); over ``length`` terms, plus HF's float32 running sum
    (``length`` roundings of at most ``|cumulative|``), over the length penalty's denominator."""
    with torch.no_grad():
        scale = model(torch.tensor([prompt])).logits.abs().max().item()
    e = model_error_bound(model.config, len(prompt) + MAX_NEW, torch.float32, scale)
    per_term = 4 * e + 2 * gamma(model.config.vocab_size, torch.float32)
    total = length * (per_term + UNIT_ROUNDOFF[torch.float32] * abs(cumulative))
    return total / length ** length_penalty


def _run(engine, requests):
    """requests: id -> (prompt, params); returns id -> final RequestOutput."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    return drain(engine)


def _beam(k, stop_ids=(), max_tokens=MAX_NEW, **extra):
    n, lp, es = SETTINGS[k]
    return SamplingParams(use_beam_search=True, beam_width=k, n=n, temperature=0.0, max_tokens=max_tokens,
                          length_penalty=lp, early_stopping=es, ignore_eos=True, stop_token_ids=list(stop_ids),
                          **extra)


def _check_against_hf(model, out, prompt, k, stop_ids):
    n, lp, es = SETTINGS[k]
    expected = _hf_beams(model, prompt, k, n, lp, es, stop_ids)
    got = [(c.token_ids, c.beam_score, c.cumulative_logprob) for c in out.outputs]
    assert [g[0] for g in got] == [t for t, _ in expected], f"k={k}: best beams differ from HF"
    for (tokens, ours, cumulative), (_, theirs) in zip(got, expected):
        bound = _score_bound(model, prompt, len(tokens), lp, cumulative)
        assert abs(ours - theirs) <= bound, f"k={k}: score {ours} vs HF {theirs} (bound {bound:.3g})"
    for c in out.outputs:  # cumulative_logprob is the score before the length penalty
        assert c.beam_score == pytest.approx(c.cumulative_logprob / len(c.token_ids) ** lp, rel=1e-12)
        assert c.finish_reason == ("stop" if c.token_ids[-1] in stop_ids else "length")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_model_beams_match_hf_in_a_mixed_batch(tiny_path, async_scheduling):
    model = _hf(tiny_path)
    engine = LLMEngine(EngineConfig(model=tiny_path, async_scheduling=async_scheduling))
    tok = engine.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("Once upon a time, in a land far away,"),
               tok.encode("def add(a, b):"), tok.encode("Dear diary, today")]
    # A stop token that beams do reach: HF greedy's 4th token of the first prompt (so some
    # beams end early, some later, some never: every finishing rule runs).
    greedy = model.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=4, pad_token_id=0)
    stop = {int(greedy[0, len(prompts[0]) + 3])}
    requests = {f"beam{k}": (prompts[i % len(prompts)], _beam(k, stop)) for i, k in enumerate(SETTINGS)}
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    requests.update({"plain0": (prompts[1], plain), "plain1": (prompts[3], plain)})
    done = _run(engine, requests)
    for i, k in enumerate(SETTINGS):
        _check_against_hf(model, done[f"beam{k}"], prompts[i % len(prompts)], k, stop)
    for name, prompt in (("plain0", prompts[1]), ("plain1", prompts[3])):
        hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                            pad_token_id=0)
        assert done[name].outputs[0].token_ids == hf[0, len(prompt):].tolist()
    assert any(c.finish_reason == "stop" for out in done.values() for c in out.outputs)
    _assert_no_leak(engine)


def test_default_model_beams_match_hf(smollm2_path):
    model = _hf(smollm2_path)
    engine = LLMEngine(EngineConfig(model=smollm2_path))
    eos = set(engine.tokenizer.eos_token_ids)
    prompt = engine.tokenizer.encode("The capital of France is")
    for k in (2, 8):
        n, lp, es = SETTINGS[k]
        params = SamplingParams(use_beam_search=True, beam_width=k, n=n, temperature=0.0, max_tokens=MAX_NEW,
                                length_penalty=lp, early_stopping=es)
        out = _run(engine, {"r": (prompt, params)})["r"]
        _check_against_hf(model, out, prompt, k, eos)
    _assert_no_leak(engine)


def test_beams_share_blocks_and_copy_only_partial_ones(tiny_path, monkeypatch):
    engine = LLMEngine(EngineConfig(model=tiny_path, block_size=16))
    manager = engine.core.scheduler.kv_cache_manager
    copies = []
    take = manager.take_copies

    def spy():
        pairs = take()
        copies.extend(pairs)
        return pairs

    monkeypatch.setattr(manager, "take_copies", spy)
    prompt = engine.tokenizer.encode("In a quiet village by the sea, an old lighthouse keeper kept a journal of "
                                     "every ship that passed, noting the weather and the tide.")
    k, max_tokens = 8, 24
    engine.add_request("r", prompt, SamplingParams(use_beam_search=True, beam_width=k, temperature=0.0,
                                                   max_tokens=max_tokens, ignore_eos=True))
    peak = (0, 0)
    while engine.has_unfinished_requests():
        engine.step()
        groups = {id(r.beam_group): r.beam_group for r in engine.core.scheduler.requests.values() if r.beam_group}
        for group in groups.values():
            tables = [manager.get_block_ids(m.request_id) for m in group.members]
            physical = len({b for t in tables for b in t})
            peak = max(peak, (len(tables) * max(map(len, tables)), physical))
    private, physical = peak
    assert private >= k * 3, "the beams should have grown past the prompt's blocks"
    assert physical * 2 <= private, f"{physical} physical blocks for beams that would hold {private} privately"
    assert copies, "forks at a partial block copy it on the device"
    _assert_no_leak(engine)


def test_fork_without_a_free_block_recomputes_the_partial_block(tiny_path):
    """KVCacheManager.fork: a full prefix is shared; the partial block is copied while blocks
    are free, else left to the child to recompute."""
    from pagoda.engine.request import Request

    engine = LLMEngine(EngineConfig(model=tiny_path, block_size=16, num_gpu_blocks_override=4))
    manager = engine.core.scheduler.kv_cache_manager
    params = SamplingParams(max_tokens=4)
    parent, a, b = (Request(i, list(range(1, 21)), params) for i in ("p", "a", "b"))
    manager.allocate_slots(parent, 20)  # 2 blocks: one full, one partial (4 tokens)
    assert manager.fork(parent, a, 20) == 20 and manager.take_copies() == \
        [(manager.get_block_ids("p")[1], manager.get_block_ids("a")[1])]
    assert manager.get_block_ids("a")[0] == manager.get_block_ids("p")[0]
    assert manager.fork(parent, b, 20) == 16 and manager.get_block_ids("b") == manager.get_block_ids("p")[:1]
    for r in (a, b, parent):
        manager.free(r)
    assert engine.core.scheduler.num_free_blocks == 3


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_no_leaks_after_abort_preemption_and_stop_strings(tiny_path, monkeypatch, async_scheduling):
    prompt_words = "Once upon a time, in a land far away, there lived"
    roomy = LLMEngine(EngineConfig(model=tiny_path))
    prompt = roomy.tokenizer.encode(prompt_words)
    reference = _run(roomy, {"a": (prompt, _beam(4)), "b": (prompt[:5], _beam(2))})
    # Preemption: a group is admitted only when its worst case is free (14 of 14 blocks for
    # "a", 7 for "b"), so its own forks never preempt it; a more urgent request (priority
    # policy) that needs the blocks preempts the whole group, which recomputes later.
    tight = LLMEngine(EngineConfig(model=tiny_path, block_size=8, num_gpu_blocks_override=15,
                                   scheduling_policy="priority", async_scheduling=async_scheduling))
    scheduler, preempted = tight.core.scheduler, []
    preempt_one = scheduler.preemption._preempt_one
    monkeypatch.setattr(scheduler.preemption, "_preempt_one", lambda r, step: preempted.append(r.request_id) or
                        preempt_one(r, step))
    tight.add_request("b", prompt[:5], _beam(2), priority=1)
    tight.add_request("a", prompt, _beam(4), priority=1)
    for _ in range(3):
        tight.step()
    long_prompt = (prompt * 8)[:96]  # 12 blocks: more than the groups leave free
    done = _run(tight, {"c": (long_prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))})
    while tight.has_unfinished_requests():
        for out in tight.step():
            done[out.request_id] = out
    assert {i for i in preempted if i.startswith("b")} == {"b#0", "b@beam1"}, f"got {preempted}"
    for name in ("a", "b"):
        assert [c.token_ids for c in done[name].outputs] == [c.token_ids for c in reference[name].outputs]
    _assert_no_leak(tight)
    # Abort mid-search.
    roomy.add_request("x", prompt, _beam(8, max_tokens=30))
    for _ in range(6):
        roomy.step()
    roomy.abort_request("x")
    while roomy.has_unfinished_requests():
        roomy.step()
    _assert_no_leak(roomy)
    # A stop string: the best beam's text cut there, finished as "stop".
    best = reference["a"].outputs[0].text
    stop = best[len(best) // 2: len(best) // 2 + 2]
    out = _run(roomy, {"s": (prompt, _beam(4, stop=[stop]))})["s"]
    assert any(c.finish_reason == "stop" and c.stop_reason == stop and stop not in c.text for c in out.outputs)
    _assert_no_leak(roomy)


def test_stop_strings_end_beams_as_hf_stop_strings_do(tiny_path):
    """A beam whose text holds a stop string ends there (a finished hypothesis), as with HF's
    ``generate(stop_strings=...)``: same beams (HF pads the shorter ones), same scores."""
    import transformers

    model, hf_tok = _hf(tiny_path), transformers.AutoTokenizer.from_pretrained(tiny_path)
    engine = LLMEngine(EngineConfig(model=tiny_path))
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away, there lived")
    params = SamplingParams(use_beam_search=True, beam_width=4, n=4, temperature=0.0, max_tokens=MAX_NEW,
                            ignore_eos=True)
    texts = [c.text for c in _run(engine, {"free": (prompt, params)})["free"].outputs]
    for stop in (texts[0][len(texts[0]) // 2:][:2], texts[1][3:6]):
        out = _run(engine, {"s": (prompt, params.clone(stop=[stop]))})["s"]
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4, max_new_tokens=MAX_NEW,
                                do_sample=False, eos_token_id=None, pad_token_id=0, stop_strings=[stop],
                                tokenizer=hf_tok, output_scores=True, return_dict_in_generate=True)
        expected = [s[len(prompt):].tolist() for s in hf.sequences]
        assert any(c.finish_reason == "stop" and c.stop_reason == stop for c in out.outputs), stop
        for c, tokens, score in zip(out.outputs, expected, hf.sequences_scores.tolist()):
            padding = set(tokens[len(c.token_ids):])  # HF pads a shorter beam (with -1 here)
            assert tokens[:len(c.token_ids)] == c.token_ids and padding <= {0, -1}, stop
            bound = _score_bound(model, prompt, len(c.token_ids), 1.0, c.cumulative_logprob)
            assert abs(c.beam_score - score) <= bound and stop not in c.text
    _assert_no_leak(engine)


def test_a_group_is_admitted_only_with_its_worst_case_free(tiny_path):
    """BeamGroupReserve: a group (worst case 7 of 14 blocks here) waits while a plain request
    holds 8, then runs; the plain request never waits for it."""
    from pagoda.engine.request import RequestStatus

    engine = LLMEngine(EngineConfig(model=tiny_path, block_size=8, num_gpu_blocks_override=15))
    engine.add_request("p", list(range(10, 74)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("b", list(range(10, 15)), _beam(2))
    engine.step()
    scheduler = engine.core.scheduler
    assert scheduler.get_request("p").status == RequestStatus.RUNNING
    assert scheduler.get_request("b#0").status == RequestStatus.WAITING
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert len(done["b"].outputs) == 2 and engine.get_stats().num_preemptions == 0
    _assert_no_leak(engine)


def test_refused_beam_requests(tiny_path):
    spec = LLMEngine(EngineConfig(model=tiny_path, speculative_method="ngram"))
    with pytest.raises(ValueError, match="^use_beam_search: this server runs speculative decoding.*no one token "
                                         "per position to verify drafts against"):
        spec.add_request("r", [1, 2, 3], _beam(2))
    with pytest.raises(ValueError, match="^speculative: beam search does not run with speculative decoding.*verify"):
        _beam(2, speculative=True)
    small = LLMEngine(EngineConfig(model=tiny_path, block_size=16, num_gpu_blocks_override=12))
    with pytest.raises(ValueError, match="^beam_width: 8 beams of max_tokens 32 may need"):
        small.add_request("r", [1, 2, 3], _beam(8, max_tokens=32))
    assert not small.has_unfinished_requests()
    with pytest.raises(ValueError, match="^temperature: must be 0.0 with use_beam_search"):
        SamplingParams(use_beam_search=True, beam_width=2)


def _assert_no_leak(engine):
    scheduler = engine.core.scheduler
    assert not scheduler.requests and engine.core.beams.num_groups == 0
    assert scheduler.num_free_blocks == scheduler.block_pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in scheduler.block_pool.blocks)


@pytest.mark.parametrize("seed", [20, 22])
def test_random_mixes_under_pressure_equal_a_roomy_engine(tiny_path, seed):
    """Beam groups mixed with plain requests in a tiny cache (preemption, chunked prefill,
    copy or recompute forks, async scheduling or prefix caching as drawn) return the beams a
    roomy engine returns for each group alone, and leave every block free."""
    import random

    rng = random.Random(seed)
    config = dict(block_size=8, num_gpu_blocks_override=rng.choice([16, 20]), async_scheduling=rng.random() < 0.5,
                  enable_prefix_caching=rng.random() < 0.7, max_num_batched_tokens=rng.choice([16, 64]),
                  scheduling_policy=rng.choice(["fcfs", "priority"]))
    tight, roomy = LLMEngine(EngineConfig(model=tiny_path, **config)), LLMEngine(EngineConfig(model=tiny_path))
    requests = {}
    for i in range(8):
        prompt = [rng.randint(3, 4000) for _ in range(rng.randint(1, 50))]
        if rng.random() < 0.5:
            k = rng.choice([2, 3, 4])
            params = SamplingParams(use_beam_search=True, beam_width=k, n=k, temperature=0.0,
                                    max_tokens=rng.randint(2, 10))
        else:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(5, 40), ignore_eos=True)
        try:
            tight.add_request(str(i), prompt, params, priority=rng.randint(0, 2))
            requests[str(i)] = (prompt, params)
        except ValueError:  # a group whose worst case exceeds the tiny cache
            pass
    done = _run(tight, {})
    assert tight.get_stats().num_preemptions > 0, "the tiny cache should have forced preemption"
    beams = {name: r for name, r in requests.items() if r[1].use_beam_search}
    assert len(beams) >= 3
    for name, (prompt, params) in beams.items():
        alone = _run(roomy, {name: (prompt, params)})[name]
        assert [c.token_ids for c in done[name].outputs] == [c.token_ids for c in alone.outputs], name
    _assert_no_leak(tight)


def _grammar_oracle(engine, kind, spec, prompt_len):
    """HF's ``prefix_allowed_tokens_fn`` from the same grammar, an independent matcher replayed
    over each beam's tokens (HF masks after ``log_softmax``: the reference of guided beams)."""
    from pagoda.engine.guided.backend import XGrammarBackend, bitmask_width

    vocab = engine.model_config.vocab_size
    backend = XGrammarBackend(engine.tokenizer, vocab, sorted(engine.tokenizer.eos_token_ids))
    compiled = backend.compile(kind, spec)
    bits = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)

    def allowed(batch_id, input_ids):
        matcher = backend.make_matcher(compiled)
        for token in input_ids[prompt_len:].tolist():
            if matcher.is_terminated() or not matcher.accept_token(token):
                return list(range(vocab))  # a finished (padded) HF beam: anything
        if matcher.is_terminated():
            return list(range(vocab))
        matcher.fill_bitmask(bits, 0)
        words = bits[0].tolist()
        return [t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1]

    return allowed


@pytest.mark.parametrize("kind,spec,k", [("regex", "[0-9]{2}-[a-z]{2,4}", 4), ("choice", '["yes", "no", "maybe"]', 2)])
def test_guided_beams_follow_their_grammar_and_match_hf(tiny_path, kind, spec, k):
    """Structured output per beam: each beam's own matcher (forks replay their parent's
    grammar); every returned beam is in the grammar's language, and the beams and scores
    equal HF's beam search constrained by the same grammar."""
    model = _hf(tiny_path)
    engine = LLMEngine(EngineConfig(model=tiny_path))
    eos = set(engine.tokenizer.eos_token_ids)
    prompt = engine.tokenizer.encode("Answer:")
    n, lp, es = SETTINGS[k]
    guided = {kind: spec if kind == "regex" else json.loads(spec)}
    params = SamplingParams(use_beam_search=True, beam_width=k, n=n, temperature=0.0, max_tokens=MAX_NEW,
                            length_penalty=lp, early_stopping=es, guided_decoding=guided)
    out = _run(engine, {"g": (prompt, params), "plain": (prompt, _beam(2))})["g"]
    allowed = _grammar_oracle(engine, kind, spec, len(prompt))
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=n, max_new_tokens=MAX_NEW,
                            do_sample=False, length_penalty=lp, early_stopping=es, eos_token_id=sorted(eos),
                            pad_token_id=0, prefix_allowed_tokens_fn=allowed, output_scores=True,
                            return_dict_in_generate=True)
    expected = [(_strip_pad(s[len(prompt):].tolist(), eos), score)
                for s, score in zip(hf.sequences, hf.sequences_scores.tolist())]
    assert [c.token_ids for c in out.outputs] == [t for t, _ in expected]
    for c, (_, theirs) in zip(out.outputs, expected):
        assert abs(c.beam_score - theirs) <= _score_bound(model, prompt, len(c.token_ids), lp, c.cumulative_logprob)
        text = engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if kind == "regex":
            assert re.fullmatch(spec, text), text
        else:
            assert text in guided[kind], text
    _assert_no_leak(engine)
    assert not engine.core.guided._matchers and not engine.core.guided._grammar_of
