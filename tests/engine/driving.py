"""Small helpers that drive an engine in tests."""


def drain(engine) -> dict:
    """Step ``engine`` until it has no work; each finished request's final output by id."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def greedy_tokens(engine, prompts, params=None, prefix: str = "", lora_name=None, max_tokens: int = 8) -> list:
    """Each prompt's generated token ids, all prompts in one batch (``params``: one
    ``SamplingParams`` for all, a list of one per prompt, or greedy ``max_tokens`` ignoring EOS)."""
    from pagoda.engine.sampling_params import SamplingParams

    params = params if params is not None else SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"{prefix}{i}", prompt, p, lora_name=lora_name)
    finals = drain(engine)
    return [finals[f"{prefix}{i}"].outputs[0].token_ids for i in range(len(prompts))]


def family_case(folder, max_new: int):
    """A random model folder's test case: (folder, four prompts — one alone, three sharing a
    long prefix —, transformers' greedy tokens for each, an engine without prefix caching)."""
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    from tests.engine.hf_reference import HFGreedy

    engine = LLMEngine(EngineConfig(model=str(folder), enable_prefix_caching=False))
    tok = engine.tokenizer
    shared = tok.encode("In a quiet village by the sea, an old lighthouse keeper kept a journal of every ship "
                        "that passed, noting the weather and the hour of the tide.")
    prompts = [tok.encode("The capital of France is"), shared + tok.encode(" One morning he wrote"),
               shared + tok.encode(" Years later, his granddaughter found it and"), shared + tok.encode(" The")]
    hf = HFGreedy(str(folder))
    return str(folder), prompts, [hf.generate(p, max_new) for p in prompts], engine


def check_beams_and_a_grammar(engine, folder, prompts) -> None:
    """The two best of 2 beams on ``prompts[1]`` equal transformers' ``generate(num_beams=2)``; a
    choice grammar constrains every sampled answer; every block is free afterwards."""
    import torch

    from pagoda.engine.guided import GuidedDecodingParams
    from pagoda.engine.sampling_params import SamplingParams

    from tests.engine.hf_reference import HFGreedy

    beams = SamplingParams(use_beam_search=True, beam_width=2, n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("beam", prompts[1], beams)
    done = drain(engine)
    with torch.no_grad():
        out = HFGreedy(folder).model.generate(torch.tensor([prompts[1]]), num_beams=2, num_return_sequences=2,
                                              max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                                              length_penalty=1.0)
    assert [c.token_ids for c in done["beam"].outputs] == [s[len(prompts[1]):].tolist() for s in out]
    choices = ["north", "south", "east", "west"]
    guided = SamplingParams(temperature=1.0, seed=3, max_tokens=6, guided_decoding=GuidedDecodingParams(choice=choices))
    answers = greedy_tokens(engine, prompts, guided, prefix="g")
    assert all(engine.tokenizer.decode(tokens) in choices for tokens in answers)
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_blocks


def check_seeded_alone_equals_batch(folder, prompts, max_tokens: int, alone=None) -> None:
    """A seeded request (``prompts[1]``, temperature 0.9, top-p 0.9) gets the same tokens alone (in
    ``alone``, or a fresh engine) as behind every prompt sampled with another seed, in 9-token steps."""
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.sampling_params import SamplingParams

    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=max_tokens, ignore_eos=True)
    engine = alone if alone is not None else LLMEngine(EngineConfig(model=str(folder)))
    expected = greedy_tokens(engine, [prompts[1]], seeded, prefix="alone")[0]
    batch = LLMEngine(EngineConfig(model=str(folder), max_num_batched_tokens=9))
    others = SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        batch.add_request(f"o{i}", prompt, others)
    assert greedy_tokens(batch, [prompts[1]], seeded, prefix="s") == [expected]
