"""Record offline outputs on the default model: greedy, seeded, n=2, logprobs; sync and overlapped."""
import json, sys
from pagoda import LLM, SamplingParams
prompts = ["The capital of France is", "Write a haiku about tea", "def fibonacci(n):",
           "List three colours:", "Once upon a time", "The meaning of life is"]


def _logprobs(completion):
    return [(lp.token_id, round(lp.logprob, 4), lp.rank, [(t, round(x, 4)) for t, x in lp.top])
            for lp in (completion.logprobs or [])]


def _record(completion):
    cumulative = completion.cumulative_logprob and round(completion.cumulative_logprob, 4)
    return (completion.token_ids, completion.text, completion.finish_reason, _logprobs(completion), cumulative)


res = {}
for overlap in (False, True):
    llm = LLM(async_scheduling=overlap, max_num_seqs=4)
    runs = {
      "greedy": SamplingParams(temperature=0, max_tokens=24),
      "seeded": SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=24, seed=7),
      "n2": SamplingParams(temperature=1.0, n=2, max_tokens=12, seed=3, logprobs=2),
      "penalties": SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=16,
                                  seed=11, min_tokens=4),
    }
    for name, sp in runs.items():
        outs = llm.generate(prompts, sp)
        res[f"{name}/overlap={overlap}"] = [[_record(c) for c in o.outputs] for o in outs]
json.dump(res, open(sys.argv[1], "w"))
print("recorded", len(res))
