"""``pagoda bench quant``: full-precision vs int8 and fp8 (e4m3) weights on the same model.

One process loads the model once per variant (the engine's dtype, e.g. fp32 on CPU, and
``quantization="int8"`` / ``"fp8"``; ``--methods``) and reports, as a markdown table:

* weight memory: bytes of parameters and buffers (tied tensors once), and the ratio;
* decode tokens/s at batch 1 and batch 16 through ``LLMEngine`` (greedy, ``ignore_eos``;
  the prefill step is excluded). Variants are timed alternately, ``--repeats`` times, and
  the best run of each is kept, so the ratios come from one run on the same machine. A
  row forces dequantize-then-matmul, to show what the 8-bit kernels buy (int8 everywhere,
  fp8 on CUDA; fp8 on CPU is always that emulation);
* logit error: ``PROMPTS`` are decoded greedily by the reference model for
  ``--num-tokens`` steps; the int8 model is fed the same tokens (teacher forcing) and its
  logits are compared at every step: max and mean |difference|, and top-1 agreement;
* greedy agreement: the int8 model decodes freely; the fraction of positions whose token
  equals the reference's, and per prompt the first position where they differ;
* perplexity of both models on ``PPL_TEXT`` (written for this benchmark; English prose,
  1,148 tokens with SmolLM2's tokenizer), computed in chunks of 256 tokens through the paged cache.

Decode steps of the quality runs batch all prompts together (8 rows: the packed int8
kernel where proven on CPU, the W8A16 kernel on CUDA); the perplexity chunks take the
256-row path. Then, per method, the matmul path taken at batch 1, batch 16 and a 256-row
prefill chunk (``bench/quant_kernels.kernels_used``) and, on CUDA, the 8-bit linear layers
timed against the model dtype's on Llama-3-8B shapes (``quant_kernels.linear_timings``).

Checkpoint methods (``awq``, ``gptq``: 4-bit, group 64, kept packed as ``Int4Weight``;
``fp8-channel``, ``fp8-block``: FP8 checkpoints, dequantized at load): the model folder is
written in that format with round-to-nearest quantization (``pagoda.models.quant_write``)
and loaded as a downloaded checkpoint would be, so the rows measure the format's layout and
the 4-bit path, not AWQ's or GPTQ's calibration.

``--llama3-8b``: the Llama-3-8B shape with dummy weights (``load_format="dummy"``, as in
``pagoda bench kernels``), for GPU timing; the quality rows are skipped (random weights,
word-level tokenizer). On an H100: ``pagoda bench quant --llama3-8b`` (docs/quantization.md
says what to expect).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = [
    "The capital of France is",
    "Here is a short story about a lighthouse keeper:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The most important idea in computer science is",
]

PPL_TEXT = """\
The town of Ashford Mill sits where two small rivers meet, and for most of its history it \
was known for nothing more remarkable than the quality of its flour. The mill that gave the \
town its name was built of grey stone in the years after a great flood had carried away an \
older wooden one. Its wheel turned for nearly two centuries, and the families who worked it \
passed the trade from parents to children with a care that bordered on stubbornness.

In the early mornings the miller would walk along the race to check the sluice gates. If the \
water was too high, he lowered the boards to spare the wheel; if it was too low, he raised \
them and waited for the pond to fill. Farmers arrived with their carts before sunrise, and by \
the time the church bell rang for seven o'clock the first sacks of flour were already stacked \
by the door. Children who lived nearby learned to tell the time by the sound of the stones: a \
low rumble meant wheat, a sharper rattle meant barley or oats.

Life in the town followed the seasons. Spring brought rain and high water, which was good for \
the mill but bad for the lanes, which turned to mud. Summer was the quiet season, when the \
rivers ran slow and the miller had time to mend the machinery, replace worn cogs and dress the \
millstones with a chisel so that they would grind cleanly again. In autumn the harvest came \
in, and the mill ran from dawn until long after dark. Winter was hardest of all. In a cold \
year the pond froze, the wheel stood still, and the town lived on whatever flour had been \
stored in the loft.

The school stood at the top of the hill, a single room with tall windows and a stove in the \
corner. The teacher, a patient woman who had come from the city as a young graduate and never \
left, taught reading, arithmetic and a little geography. She kept a large map of the world on \
the wall and liked to ask her pupils to find the places their grandparents had come from. Many \
of them had never travelled farther than the market town a day's walk to the east, but they \
could point to distant ports and mountain ranges with confidence.

Change came slowly and then all at once. A railway line was built along the valley, and with \
it came cheaper flour from large steam mills in the cities. For a few years the miller held \
on, selling to bakers who preferred the taste of stone-ground grain. But the price of wheat \
fell, the young people left for work in the factories, and one spring the wheel was not \
repaired after the floods. The building stood empty for a long time. Swallows nested in the \
rafters, and ivy climbed the northern wall until it reached the roof.

Many years later a group of residents decided that the mill should not be allowed to fall \
down. They formed a society, raised money with concerts and fairs, and persuaded an engineer \
who had retired to the area to study the old machinery. He found that most of the iron gears \
were still sound. The wooden parts had rotted, but careful drawings survived in the parish \
archive, and a carpenter was able to make new ones in the traditional way. It took four years \
of weekends and holidays before the wheel turned again.

Today the mill is open to visitors on the first Sunday of every month. Volunteers explain how \
grain was cleaned, ground and sifted, and how the miller judged the fineness of the flour by \
rubbing it between his fingers. Schoolchildren come on trips and are allowed to pour a small \
bag of wheat into the hopper and watch it disappear between the stones. The flour is sold in \
paper bags at the door, and a bakery in the square uses it for a dark, heavy loaf that people \
drive a long way to buy.

The rivers still meet below the town, and in spring they still rise over the meadows. Older \
residents say that the sound of the water over the weir is the same as it was when they were \
young, and that on quiet evenings, when the wheel is turning, the whole valley seems to \
remember what it used to be. Visitors who stay until dusk often remark on the same thing: \
that a place built around a single patient machine can teach a great deal about time, about \
work, and about the value of keeping useful things in good repair.

Not every story of the valley is so gentle. In the hard winter of the long strike, when the \
railway stopped running and coal could not be had at any price, the families of Ashford Mill \
burned fence posts and old furniture to keep warm. The miller opened the loft and shared out \
the last of the stored grain, keeping a careful account in a notebook that is now displayed \
in a glass case by the entrance. Each line records a name, a date and a quantity, and at the \
bottom of the final page someone has written, in a different hand, that every debt was repaid \
by the following harvest.

Historians who have studied the notebook point out that such arrangements were common in \
rural communities before banks and insurance reached them. Trust was a kind of currency, and \
a family that failed to repay a loan of flour would find it difficult to borrow anything \
again. The system was not always fair, and it could be harsh to those who fell ill or lost a \
harvest to hail, but it held the town together through seasons that might otherwise have \
emptied it. When people speak of the mill today, it is often this part of its history, more \
than the machinery, that they want their children to understand.
"""


def _greedy(model, prompts: list[list[int]], num_tokens: int, forced=None):
    """Decode all prompts together; feed ``forced`` tokens instead of our own when given.

    Returns:
        (tokens [num_prompts][num_tokens], logits [num_tokens, num_prompts, vocab] float32)
    """
    from pagoda.models.testing import StepInput, make_kv_caches, run_step

    block_size = 16
    blocks_per_seq = math.ceil((max(map(len, prompts)) + num_tokens) / block_size)
    kv = make_kv_caches(model.config, blocks_per_seq * len(prompts), block_size, dtype=model.dtype)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    logits = run_step(model, kv, [StepInput(p, 0, t) for p, t in zip(prompts, tables)], block_size)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    step_logits = [logits[ends]]  # [num_prompts, vocab]
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(num_tokens):
        for i, row in enumerate(step_logits[-1].argmax(-1).tolist()):
            tokens[i].append(row)
        if step == num_tokens - 1:
            break
        feed = [forced[i][step] if forced else tokens[i][step] for i in range(len(prompts))]
        seqs = [StepInput([tok], len(p) + step, t) for tok, p, t in zip(feed, prompts, tables)]
        step_logits.append(run_step(model, kv, seqs, block_size))
    return tokens, torch.stack(step_logits)


def perplexity(model, token_ids: list[int], chunk: int = 256) -> float:
    """exp(mean negative log-likelihood of tokens 1..n-1), prefilled ``chunk`` tokens at a time."""
    from pagoda.models.testing import StepInput, make_kv_caches, run_step

    block_size = 16
    num_blocks = math.ceil(len(token_ids) / block_size)
    kv = make_kv_caches(model.config, num_blocks, block_size, dtype=model.dtype)
    table = list(range(num_blocks))
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, chunk):
        end = min(start + chunk, len(token_ids) - 1)
        logits = run_step(model, kv, [StepInput(token_ids[start:end], start, table)], block_size)
        targets = torch.tensor(token_ids[start + 1 : end + 1])
        nll += torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum").item()
        count += end - start
    return math.exp(nll / count)


def decode_tokens_per_s(engine, batch_size: int, num_tokens: int) -> float:
    """Greedy decode of ``batch_size`` short prompts; tokens/s after the prefill step."""
    from pagoda.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens + 1, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"b{batch_size}-{i}-{time.monotonic_ns()}", list(range(1000 + i, 1016 + i)), params)
    engine.step()  # prefill and each request's first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return batch_size * num_tokens / (time.perf_counter() - start)


def _set_path(model, path: str) -> None:
    from pagoda.models.fp8 import Fp8Weight
    from pagoda.models.quant import Int8Weight

    for module in model.modules():
        if isinstance(module, (Int8Weight, Fp8Weight)):
            module.path = path


# Pre-quantized checkpoint formats (pagoda.models.quant_write: RTN quantization in each layout),
# written from the model folder and loaded as a user would load a downloaded one.
CHECKPOINT_METHODS = ("awq", "gptq", "fp8-channel", "fp8-block")
INT4_METHODS = ("awq", "gptq")


def _checkpoint_engine(args, method: str, folder: Path):
    """An engine on ``method``'s checkpoint of the model; 4-bit weights kept packed (Int4Weight)."""
    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.models.gguf_import import ensure_default_model
    from pagoda.models.int4 import PACKED_ENV
    from pagoda.models.quant_write import write_quantized

    path = write_quantized(Path(args.model or ensure_default_model()), folder / method, method)
    saved = os.environ.get(PACKED_ENV)
    os.environ[PACKED_ENV] = "1" if method in INT4_METHODS else "auto"
    try:
        return LLMEngine(EngineConfig(model=str(path), max_num_seqs=16, enable_prefix_caching=False))
    finally:
        if saved is None:
            os.environ.pop(PACKED_ENV)
        else:
            os.environ[PACKED_ENV] = saved


def _engine_config(args, method):
    from pagoda.engine.config import EngineConfig

    if not args.llama3_8b:
        return EngineConfig(model=args.model, quantization=method, max_num_seqs=16, enable_prefix_caching=False,
                            dtype=args.dtype)
    max_len = 64 + args.num_tokens
    return EngineConfig(model=args.llama3_8b_folder, quantization=method, max_num_seqs=16,
                        enable_prefix_caching=False, load_format="dummy", max_model_len=max_len,
                        num_gpu_blocks_override=16 * -(-max_len // 16) + 1)


def _quality(r: dict, ref, qmodels: dict, tok, args) -> None:
    """Teacher-forced logit error, top-1 and free-running agreement, perplexity, per method."""
    prompts = [tok.encode(p) for p in PROMPTS]
    ref_tokens, ref_logits = _greedy(ref, prompts, args.num_tokens)
    r["logit_scale"] = ref_logits.abs().max().item()
    text_ids = tok.encode(PPL_TEXT)
    r["ppl_tokens"] = len(text_ids)
    r["ppl", None] = perplexity(ref, text_ids)
    for method, qm in qmodels.items():
        forced_tokens, forced_logits = _greedy(qm, prompts, args.num_tokens, forced=ref_tokens)
        free_tokens, _ = _greedy(qm, prompts, args.num_tokens)
        diff = (forced_logits - ref_logits).abs()
        r["logit", method] = (diff.max().item(), diff.mean().item())
        r["top1", method] = (forced_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(ref_tokens, free_tokens)]
        r["greedy_same", method] = sum(same) / (len(prompts) * args.num_tokens)
        r["first_diverge", method] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                      for x, y in zip(ref_tokens, free_tokens)]
        r["ppl", method] = perplexity(qm, text_ids)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda bench quant", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--llama3-8b", action="store_true",
                        help="Llama-3-8B shape with dummy weights (GPU timing; quality rows skipped)")
    parser.add_argument("--methods", default="int8,fp8",
                        help="comma-separated: int8, fp8, w8a8 (quantized at load; w8a8: CPU, int8 activations "
                             "too), awq, gptq (4-bit checkpoints, kept packed), fp8-channel, fp8-block "
                             "(FP8 checkpoints)")
    parser.add_argument("--num-tokens", type=int, default=64, help="greedy tokens per prompt and per timed request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (best kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the model dtype: the reference's and the quantized models' activations")
    return parser


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagoda.bench import quant_kernels
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.models.quant import check_quantization, weight_bytes

    for m in methods:
        if m not in CHECKPOINT_METHODS:
            check_quantization(m)
        elif args.llama3_8b:
            raise SystemExit(f"pagoda bench quant: --methods {m} writes a checkpoint from real weights; "
                             "not with --llama3-8b (dummy weights)")
    with tempfile.TemporaryDirectory() as folder:
        if args.llama3_8b:
            from pagoda.bench.kernels_e2e import LLAMA3_8B, raw_config, write_model_folder

            write_model_folder(Path(folder), raw_config(LLAMA3_8B))
            args.llama3_8b_folder = folder
        engines = {None: LLMEngine(_engine_config(args, None))}
        for m in methods:
            engines[m] = _checkpoint_engine(args, m, Path(folder)) if m in CHECKPOINT_METHODS else \
                LLMEngine(_engine_config(args, m))
    ref = engines[None].runner.model
    qmodels = {m: engines[m].runner.model for m in methods}
    r = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                    f"{torch.get_num_threads()} threads, device {ref.device}, model dtype {ref.dtype}"
                    + (f", {torch.cuda.get_device_name(ref.device)}" if ref.device.type == "cuda" else "")}
    r["bytes", None] = weight_bytes(ref)
    for m, qm in qmodels.items():
        r["bytes", m] = weight_bytes(qm)
        if m not in CHECKPOINT_METHODS:
            r["kernels", m] = quant_kernels.kernels_used(qm)
    if not args.llama3_8b:
        _quality(r, ref, qmodels, engines[None].tokenizer, args)

    variants = [("ref", None, "auto")] + [(m, m, "auto") for m in methods]
    variants += [(f"{m}-dequant", m, "dequantize") for m in methods if m == "int8" or ref.device.type == "cuda"]
    speed = {(name, b): 0.0 for name, _, _ in variants for b in (1, 16)}
    for _ in range(args.repeats):
        for batch_size in (1, 16):
            for name, method, path in variants:
                if method is not None:
                    _set_path(qmodels[method], path)
                speed[name, batch_size] = max(speed[name, batch_size],
                                              decode_tokens_per_s(engines[method], batch_size, args.num_tokens))
    for qm in qmodels.values():
        _set_path(qm, "auto")
    r["speed"] = speed
    _print_table(r, str(ref.dtype).replace("torch.", ""), methods, [v[0] for v in variants], args)
    if ref.device.type == "cuda":
        dtype_name = str(ref.dtype).replace("torch.", "")
        quant_kernels.print_linear_timings(quant_kernels.linear_timings(ref.dtype), dtype_name)
    return 0


def _print_table(r: dict, ref_name: str, methods: list[str], variant_names: list[str], args) -> None:
    s = r["speed"]
    print(f"machine: {r['machine']}")
    print(f"| metric | {ref_name} | " + " | ".join(f"{m} | {m} / {ref_name}" for m in methods) + " |")
    print("|---|---|" + "---|---|" * len(methods))

    def row(label: str, ref_cell: str, cells: dict) -> None:
        print(f"| {label} | {ref_cell} | " + " | ".join(cells.get(m, " | ") for m in methods) + " |")

    b_ref = r["bytes", None]
    row("weight memory (bytes)", f"{b_ref:,}", {m: f"{r['bytes', m]:,} | {r['bytes', m] / b_ref:.3f}" for m in methods})
    for b in (1, 16):
        row(f"decode tokens/s, batch {b}", f"{s['ref', b]:.1f}",
            {m: f"{s[m, b]:.1f} | {s[m, b] / s['ref', b]:.2f}x" for m in methods})
        forced = {m: f"{s[f'{m}-dequant', b]:.1f} | {s[f'{m}-dequant', b] / s['ref', b]:.2f}x"
                  for m in methods if f"{m}-dequant" in variant_names}
        if forced:
            row(f"decode tokens/s, batch {b}, forced to dequantize+matmul", "", forced)
    if ("ppl", None) in r:
        n = len(PROMPTS)
        row(f"perplexity, {r['ppl_tokens']}-token English text", f"{r['ppl', None]:.3f}",
            {m: f"{r['ppl', m]:.3f} | {r['ppl', m] / r['ppl', None]:.4f}" for m in methods})
        row(f"logits vs {ref_name}, teacher-forced ({n} prompts x {args.num_tokens} steps)",
            f"(max logit {r['logit_scale']:.1f})",
            {m: f"max {r['logit', m][0]:.3f}, mean {r['logit', m][1]:.4f} | " for m in methods})
        row("top-1 agreement, teacher-forced", "", {m: f"{100 * r['top1', m]:.1f}% | " for m in methods})
        row(f"greedy tokens identical, free-running ({n} x {args.num_tokens})", "",
            {m: f"{100 * r['greedy_same', m]:.1f}% | " for m in methods})
        row("first divergence per prompt (token index)", "",
            {m: ", ".join("none" if d is None else str(d) for d in r["first_diverge", m]) + " | " for m in methods})
    for m in methods:
        if ("kernels", m) in r:
            print(f"\n{m} matmul path: {r['kernels', m]}")
        elif m in INT4_METHODS:
            from pagoda.kernels.w4a16 import DEQUANT_ROWS

            print(f"\n{m} matmul path: Int4Weight: W4A16 Triton kernel on CUDA below {DEQUANT_ROWS} rows, "
                  "else dequantize + F.linear (every call on CPU)")


if __name__ == "__main__":
    raise SystemExit(main())
