"""``pagoda bench spec``: speculative decoding vs none, per proposer, batch size and window.

One greedy workload of chat prompts (some invite copying: code to edit, a list to
repeat; some are open questions), the same for every configuration, run to completion
on one engine per configuration (all engines are built first, then for each batch size
the configurations run back to back, so a noisy shared machine skews the ratios less;
prefix caching is on, and every engine has seen the same earlier runs):

* ``off``: no speculation (the baseline);
* ``ngram``: prompt lookup, fixed window ``k`` and adaptive window;
* ``draft``: a draft model (default: the target's own first ``--draft-layers`` layers with
  its final norm and LM head, sharing its weights), fixed and adaptive window.

For each batch size ``B`` (``max_num_seqs = B``; ``max(B, 4)`` requests, so ``B = 1`` runs
four requests one after the other) it reports: seconds and output tokens/s, speedup over
``off`` at the same ``B``, acceptance rate (accepted / drafted tokens), tokens per
verification (tokens emitted by a pass that verified drafts), tokens per target pass
(all output tokens / request-steps that produced tokens; 1.0 without speculation), and
whether the outputs equal the baseline's (greedy: they must). Each configuration runs
``--repeats`` times (interleaved with the others) and the fastest run is kept.

``--method eagle3|mtp`` runs the draft-head benchmark instead (``spec_heads.py``): a random
head's rejected-draft overhead per step, and batch-1 speed at forced acceptance rates
against the roofline (``--llama3-8b`` for the GPU shape).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagoda.bench.common import add_engine_bench_args, machine_line, prepare_engine_bench

PROMPTS = [
    "Add type hints to this function and return the whole function:\n\ndef merge(a, b):\n    out = []\n"
    "    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
    "            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n"
    "    out.extend(b[j:])\n    return out",
    "Repeat this list exactly, one item per line: apples, pears, plums, cherries, peaches, grapes, lemons, limes.",
    "What is the capital of France? Answer in two sentences.",
    "Rename the variable x to count in this code and show the result:\n\nx = 0\nfor item in items:\n"
    "    if item.ok:\n        x += 1\nprint(x)",
    "Write a short story about a lighthouse keeper.",
    "Correct the spelling in this sentence and repeat it: The quick brwon fox jumpd over the lazzy dog.",
    "Explain what a hash table is to a child.",
    "Convert this JSON to YAML: {\"name\": \"pagoda\", \"version\": 1, \"features\": [\"paging\", \"batching\"]}",
]


def make_requests(tokenizer, num_requests: int) -> list[list[int]]:
    prompts = []
    for i in range(num_requests):
        text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                             add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from pagoda.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    engine.add_request("warmup", prompts[0][:32], SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.get_stats()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs, token_steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_steps += sum(1 for c in out.outputs if c.delta_token_ids)
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    stats = engine.get_stats()
    num_tokens = sum(len(t) for t in outputs.values())
    drafts = stats.spec_num_drafts - before.spec_num_drafts
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {"seconds": seconds, "tokens": num_tokens, "tokens_per_s": num_tokens / seconds,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_verification": (accepted + drafts) / drafts if drafts else None,
            "tokens_per_target_pass": num_tokens / token_steps if token_steps else None,
            "drafted_tokens": drafted, "steps": stats.num_steps - before.num_steps,
            "outputs": [outputs[str(i)] for i in range(len(prompts))]}


def configurations(args) -> dict[str, dict]:
    draft = dict(speculative_method="draft", speculative_draft_num_layers=args.draft_layers)
    if args.draft_model:
        draft = dict(speculative_method="draft", speculative_model=args.draft_model)
    k = dict(num_speculative_tokens=args.k)
    configs = {"off": {}}
    for method, spec in (("ngram", dict(speculative_method="ngram")), ("draft", draft)):
        if method in args.methods:
            configs[f"{method} fixed k={args.k}"] = dict(spec, spec_adaptive=False, **k)
            configs[f"{method} adaptive k<={args.k}"] = dict(spec, spec_adaptive=True, **k)
    return configs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench spec", description=__doc__.split("\n")[0])
    parser.add_argument("--draft-model", default=None, help="draft folder (default: the target's first layers)")
    parser.add_argument("--draft-layers", type=int, default=20, help="layers of the layer-skip self-draft")
    parser.add_argument("--methods", default="ngram,draft")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="fixed window, and the adaptive window's maximum")
    parser.add_argument("--method", choices=("eagle3", "mtp"), default=None,
                        help="benchmark a draft head instead (random weights; see spec_heads.py)")
    add_engine_bench_args(parser, repeats=2)
    from pagoda.bench import spec_heads

    spec_heads.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.method is not None:
        return spec_heads.main(args)
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    model_path = prepare_engine_bench(args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = {"machine": machine_line(), "threads": torch.get_num_threads(), "model": model_path,
               "max_tokens": args.max_tokens, "runs": {}}
    # Every engine is built first and the configurations run back to back per batch size,
    # so that a shared, noisy machine disturbs the ratios as little as possible.
    engines = {name: LLMEngine(EngineConfig(model=model_path, max_num_seqs=max(batch_sizes), max_model_len=1024,
                                            **spec))
               for name, spec in configurations(args).items()}
    prompts_all = make_requests(next(iter(engines.values())).tokenizer, max(max(batch_sizes), 4))
    for repeat in range(args.repeats):
        for batch_size in batch_sizes:
            for name, engine in engines.items():
                engine.scheduler.config.max_num_seqs = batch_size  # one engine per configuration, all B
                result = run(engine, prompts_all[: max(batch_size, 4)], args.max_tokens)
                key = f"{name} | B={batch_size}"
                best = results["runs"].get(key)
                if best is None or result["seconds"] < best["seconds"]:  # the least disturbed repeat
                    results["runs"][key] = dict(result, config=name, batch_size=batch_size)
                print(f"{name:>22} B={batch_size:<3} {result['tokens_per_s']:7.1f} tok/s  "
                      f"{result['seconds']:6.1f} s  accept={_fmt(result['acceptance_rate'])}  (repeat {repeat})",
                      flush=True)
    _finish(results)
    _print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _finish(results: dict) -> None:
    runs = results["runs"]
    for run_ in runs.values():
        base = runs[f"off | B={run_['batch_size']}"]
        run_["speedup"] = base["seconds"] / run_["seconds"]
        run_["same_outputs"] = run_["outputs"] == base["outputs"]
    for run_ in runs.values():
        run_.pop("outputs")


def _fmt(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def _print_table(results: dict) -> None:
    print(f"machine: {results['machine']} ({results['threads']} torch threads); greedy, max_tokens "
          f"{results['max_tokens']}")
    print("| config | B | tok/s | speedup vs off | acceptance | tokens/verification | tokens/target pass | "
          "same outputs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["runs"].values():
        print(f"| {r['config']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
              f"{_fmt(r['acceptance_rate'])} | {_fmt(r['tokens_per_verification'])} | "
              f"{_fmt(r['tokens_per_target_pass'])} | {'yes' if r['same_outputs'] else 'NO'} |")


if __name__ == "__main__":
    raise SystemExit(main())
