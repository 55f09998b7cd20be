"""``pagoda bench spec --method eagle3|mtp``: a draft head's cost, and its speed at forced acceptance rates.

The target is ``--model`` (default SmolLM2-135M; CPU-sized) or ``--llama3-8b`` (the
Llama-3-8B shape with seeded dummy weights, ``load_format="dummy"``: a GPU run). The head
is random (``engine/spec_decode/random_heads.py``), written next to the run and matched to
the target: EAGLE-3 with a ``--draft-vocab`` token draft vocabulary (32000 as the published
Llama-3 heads), or one DeepSeek-layout MTP block. Batch 1, greedy, fixed window ``k``,
random-token prompts; each configuration runs ``--repeats`` times and the fastest is kept.

1. **Rejected-draft overhead**: a random head agrees with the target about once per
   vocabulary, so every draft is rejected and every step still yields one token: the step
   time over plain decoding's is the price of a wasted draft per step (one head pass over
   the verified positions, ``k - 1`` chained head passes, a ``1 + k``-token target pass).
2. **Forced acceptance** ``a`` (``--accept-rates``): the head runs as usual (its full
   cost), then its tokens are replaced by the target's own greedy continuation (from the
   plain run) each with probability ``a`` until the first forced miss (a token that is not
   the continuation): the unchanged exact verifier then accepts what a head of per-token
   acceptance ``a`` would. Outputs must equal the plain run's (checked).

Roofline at batch 1 (memory bound: a step streams the weights once; the verification of
``1 + k`` tokens costs what one token does at small ``k``): plain ``W_t / BW`` per token;
speculative ``(W_t + k * W_h) / BW`` per step for ``E = (1 - a^(k+1)) / (1 - a)`` tokens;
bound on the speedup ``E / (1 + k * W_h / W_t)`` with ``W`` the weights a token multiplies
through (``draft_cost`` of the adaptive window). Llama-3-8B (7.50 G matmul weights with
the LM head; bf16 at 3.35 TB/s, an H100: 4.5 ms per plain token) with a 32k-vocabulary
EAGLE-3 head (0.37 G, ratio 0.050): k = 4 bounds the speedup at 1.62x / 2.31x / 3.41x for
a = 0.5 / 0.7 / 0.9; with a DeepSeek-layout MTP block (0.78 G with the shared 128k LM
head, ratio 0.104): 1.37x / 1.96x / 2.90x. The bench prints the bound for its own shapes.
"Acceptance" in the table is accepted / drafted tokens: under forced rate ``a`` it is
``(a + ... + a^k) / k`` (a draft stops counting at its first miss), not ``a``.

GPU command (the issue's batch-1 measurement; this session had no GPU):
``pagoda bench spec --method eagle3 --llama3-8b --k 4 --max-tokens 128 --repeats 2``
(and ``--method mtp``).
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch


def roofline_speedup(acceptance: float, k: int, draft_cost: float) -> float:
    """Expected tokens per step over the step's weight traffic, relative to plain decoding."""
    expected = float(k + 1) if acceptance >= 1.0 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
    return expected / (1 + k * draft_cost)


class ForcedAcceptance:
    """Wraps a proposer: its drafts, with each token replaced by the target's own greedy
    continuation (``oracle``: prompt -> output tokens) with probability ``rate`` until the
    first forced miss (see the module docstring)."""

    def __init__(self, inner, oracle: dict[tuple, list[int]], rate: float, vocab_size: int, seed: int = 0) -> None:
        self.inner, self.oracle, self.rate, self.vocab_size = inner, oracle, rate, vocab_size
        self.rng = random.Random(seed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, batch):
        drafts = self.inner.propose(batch)
        for item in batch:
            draft = drafts.get(item.request.request_id)
            truth = self.oracle.get(tuple(item.request.prompt_token_ids))
            if draft is None or truth is None:
                continue
            start = item.request.num_output_tokens
            for j in range(len(draft.token_ids)):
                if start + j >= len(truth):
                    break
                hit = self.rng.random() < self.rate
                draft.token_ids[j] = truth[start + j] if hit else (truth[start + j] + 1) % self.vocab_size
                if not hit:
                    break
        return drafts


def _run(engine, prompts, max_tokens: int) -> dict:
    from pagoda.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("warmup", prompts[0][:16], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.get_stats()
    outputs, start = {}, time.perf_counter()
    for i, prompt in enumerate(prompts):  # batch 1: one after the other
        engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[i] = out.outputs[0].token_ids
    seconds = time.perf_counter() - start
    stats = engine.get_stats()
    drafted = stats.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    steps = stats.num_steps - before.num_steps
    return {"seconds": seconds, "steps": steps, "ms_per_step": 1e3 * seconds / steps,
            "tokens_per_s": sum(len(o) for o in outputs.values()) / seconds,
            "acceptance_rate": accepted / drafted if drafted else None,
            "outputs": [outputs[i] for i in range(len(prompts))]}


def _folders(args, root: Path) -> tuple[str, dict]:
    """(target folder, engine overrides for the head) — everything written under ``root``."""
    from pagoda.bench.common import prepare_engine_bench
    from pagoda.engine.spec_decode.random_heads import add_random_mtp_layers, write_random_eagle3_head

    extra = {}
    if args.llama3_8b:
        from pagoda.bench.kernels_e2e import LLAMA3_8B, raw_config, write_model_folder

        target = root / "llama3-8b"
        target.mkdir()
        write_model_folder(target, raw_config(LLAMA3_8B))
        extra = dict(load_format="dummy", dtype="bfloat16")
    else:
        target = Path(prepare_engine_bench(args))
    dtype = torch.bfloat16 if args.llama3_8b else torch.float32
    if args.method == "eagle3":
        head = write_random_eagle3_head(root / "head", target, seed=1, dtype=dtype,
                                        draft_vocab_size=min(args.draft_vocab, _vocab(target)))
    else:
        head = add_random_mtp_layers(target, seed=1, out_dir=root / "head", dtype=dtype)
    return str(target), dict(extra, speculative_method=args.method, speculative_model=str(head))


def _vocab(folder: Path) -> int:
    from pagoda.models.config import read_config_json

    return read_config_json(folder)["vocab_size"]


def main(args) -> int:
    from pagoda.bench.common import machine_line
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.models.config import read_config_json

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        target, head = _folders(args, Path(tmp))
        max_len = min(1024, read_config_json(Path(target)).get("max_position_embeddings", 1024))
        # Two engines side by side: KV for one max-length sequence each, not a memory fraction.
        common = dict(model=target, max_num_seqs=1, max_model_len=max_len, enable_prefix_caching=False,
                      num_gpu_blocks_override=-(-max_len // 16) + 8,
                      **{k: v for k, v in head.items() if k in ("load_format", "dtype")})
        off = LLMEngine(EngineConfig(**common))
        spec = LLMEngine(EngineConfig(**common, **head, spec_adaptive=False, num_speculative_tokens=args.k))
        vocab = off.model_config.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        rates = [float(r) for r in args.accept_rates.split(",") if r]
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            runs = {"off": (off, None), "rejected drafts": (spec, None)} | {f"forced a={r}": (spec, r) for r in rates}
            for name, (engine, rate) in runs.items():
                inner = engine.speculator.proposer if engine.speculator else None
                if rate is not None:
                    oracle = {tuple(p): o for p, o in zip(prompts, best["off"]["outputs"])}
                    engine.speculator.proposer = ForcedAcceptance(inner, oracle, rate, vocab)
                try:
                    result = _run(engine, prompts, args.max_tokens)
                finally:
                    if inner is not None:
                        engine.speculator.proposer = inner
                if name not in best or result["seconds"] < best[name]["seconds"]:
                    best[name] = result
        draft_cost = spec.speculator.proposer.draft_cost
    _report(best, args, machine_line(), draft_cost)
    return 0


def _report(best: dict, args, machine: str, draft_cost: float) -> None:
    base = best["off"]
    shape = "Llama-3-8B shape, dummy bf16 weights" if args.llama3_8b else (args.model or "SmolLM2-135M")
    print(f"machine: {machine}; {shape}; random {args.method} head (W_head / W_target = {draft_cost:.3f}); "
          f"batch 1, greedy, k = {args.k}, {args.num_prompts} prompts x {args.max_tokens} tokens")
    print("| run | ms/step | tok/s | acceptance | speedup vs off | roofline bound | same outputs |")
    print("|---|---|---|---|---|---|---|")
    for name, r in best.items():
        rate = None if name in ("off", "rejected drafts") else float(name.split("=")[1])
        bound = "-" if rate is None else f"{roofline_speedup(rate, args.k, draft_cost):.2f}x"
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        same = "yes" if r["outputs"] == base["outputs"] else "NO"
        print(f"| {name} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | {acc} | "
              f"{base['seconds'] / r['seconds']:.2f}x | {bound} | {same} |")
    rejected = best["rejected drafts"]
    print(f"rejected-draft overhead: {rejected['ms_per_step'] - base['ms_per_step']:+.2f} ms per step "
          f"({rejected['ms_per_step'] / base['ms_per_step'] - 1:+.0%}), k = {args.k}")


def add_arguments(parser) -> None:
    g = parser.add_argument_group("draft heads (--method eagle3|mtp)")
    g.add_argument("--llama3-8b", action="store_true", help="Llama-3-8B shape with dummy weights (GPU)")
    g.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE-3 head's draft vocabulary")
    g.add_argument("--accept-rates", default="0.5,0.7,0.9", help="forced per-token acceptance rates")
    g.add_argument("--num-prompts", type=int, default=2)
    g.add_argument("--prompt-len", type=int, default=64)
