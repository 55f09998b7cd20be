"""``pagoda bench kv-capacity``: what a KV budget holds, with KV cache groups vs one uniform block kind.

For each model family (real checkpoints' shapes; the model is built on the meta device, so
its layers declare their caches exactly as when serving: ``runner.kv_allocation.layer_specs``)
the allocator's own arithmetic (``engine.kv.layout``: groups, block granularity, the
sliding window's bound with a ``--max-chunk`` prefill chunk, the state slot) gives:

* **tokens**: the longest single sequence the budget holds (``inf``: every layer is
  windowed, so a sequence's cache stops growing);
* **seqs@C**: how many sequences of ``C`` tokens fit at once (each its blocks and, for a
  hybrid model, its state slot);

once for the grouped layout and once for a **uniform** block kind: every layer keeps K and
V for every token (sliding windows keep every block; a linear-attention layer counted as
one more attention layer, which is what an allocator with one kind of block must reserve
for it). For hybrid families it also gives the **state checkpoint cost**: bytes of one
sequence's state (what each prefix-cache checkpoint takes), the same bytes in attention
tokens, one checkpoint's device copy time measured here (``copy_state_slots``, best of 5)
and computed at ``--hbm-bytes-per-s`` (a read and a write of the state), and the attention
block size vLLM's common-page layout would use to fit one layer's state
(its prefix-cache granularity; pagoda keeps 16-token blocks and checkpoints where it pays,
``engine.kv.state_manager``).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

# Shapes of public checkpoints (config.json fields); hybrid families: transformers 5.24's
# default configs, whose docstrings name these checkpoints.
FAMILIES = {
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072),
    "mistral-7b-v0.1": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                            intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, vocab_size=32000, sliding_window=4096,
                            max_position_embeddings=32768),
    "gemma-3-27b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=5376,
                        intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                        head_dim=128, vocab_size=262208, sliding_window=1024, max_position_embeddings=131072,
                        query_pre_attn_scalar=168, hidden_activation="gelu_pytorch_tanh", rope_theta=1e6),
    "gpt-oss-120b": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880,
                         intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                         head_dim=64, vocab_size=201088, sliding_window=128, num_local_experts=128,
                         num_experts_per_tok=4, max_position_embeddings=131072, rope_theta=150000.0,
                         rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False, "original_max_position_embeddings": 4096}),
}
_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
               linear_num_value_heads=32, head_dim=256, vocab_size=151936, max_position_embeddings=262144,
               full_attention_interval=4, partial_rotary_factor=0.25)
HYBRID_FAMILIES = {
    "qwen3-next-80b-a3b": dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048,
                               intermediate_size=5632, num_hidden_layers=48, num_attention_heads=16,
                               num_key_value_heads=2, num_experts=512, num_experts_per_tok=10,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512, **_LINEAR),
    "qwen3.5-27b": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=4096,
                        intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                        num_key_value_heads=4, **{**_LINEAR, "vocab_size": 248320}),
    "qwen3.5-35b-a3b": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
                            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, num_experts=256,
                            num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            **{**_LINEAR, "vocab_size": 248320}),
}


def family_specs(raw: dict, dtype: torch.dtype) -> list:
    """The family's per-layer cache specs, from its model built on the meta device."""
    from pagoda.engine.runner.kv_allocation import layer_specs
    from pagoda.models.registry import build_model, config_from_dict

    config = config_from_dict(raw)
    model = build_model(config, dtype=dtype, device="meta")
    return layer_specs(config, list(model.layers), dtype, config.num_key_value_heads)


def uniform_specs(specs: list) -> list:
    """Every layer as full attention with the model's attention shape (one block kind)."""
    from pagoda.engine.kv.specs import FullAttentionSpec

    attention = next(s for s in specs if s.is_paged)
    return [FullAttentionSpec(attention.num_kv_heads, attention.head_dim, attention.dtype_bytes)] * len(specs)


def max_tokens(layout, budget: int, max_chunk: int, limit: int = 1 << 30) -> float:
    """The longest sequence whose blocks and state slot fit ``budget`` (``inf`` past ``limit``)."""
    def fits(num_tokens: int) -> bool:
        blocks = layout.max_blocks_per_request(num_tokens, max_chunk)
        return blocks * layout.block_bytes + layout.slot_bytes <= budget

    if fits(limit):
        return float("inf")
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def max_seqs(layout, budget: int, context: int, max_chunk: int) -> int:
    per_seq = layout.max_blocks_per_request(context, max_chunk) * layout.block_bytes + layout.slot_bytes
    return budget // per_seq


def checkpoint_copy_s(specs: list, device: torch.device, conv_dtype: torch.dtype) -> float:
    """Seconds of one state checkpoint copy (every state layer, one slot), best of 5."""
    from pagoda.engine.runner.kv_allocation import copy_state_slots

    states = [(torch.ones((2, *s.conv_shape), dtype=conv_dtype, device=device),  # pages touched: no first-write
               torch.ones((2, *s.ssm_shape), dtype=torch.float32 if s.ssm_dtype_bytes == 4 else conv_dtype,
                          device=device)) for s in specs if s.is_state]
    copy_state_slots(states, [(0, 1)])  # warm-up
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        copy_state_slots(states, [(0, 1)])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _row(name: str, specs: list, args, budget: int, device: torch.device) -> str:
    from pagoda.engine.kv.layout import group_layers

    grouped = group_layers(specs, args.block_size)
    uniform = group_layers(uniform_specs(specs), args.block_size)
    cells = [name, ", ".join(f"{len(g.layer_ids)} {g.spec.kind}" for g in _merged(grouped))]
    for layout in (grouped, uniform):
        cells.append(_tokens(max_tokens(layout, budget, args.max_chunk)))
    for context in args.contexts:
        cells += [str(max_seqs(grouped, budget, context, args.max_chunk)),
                  str(max_seqs(uniform, budget, context, args.max_chunk))]
    return "| " + " | ".join(cells) + " |"


def _merged(layout) -> list:
    """One entry per kind (a kind cut into several groups of ``group_size`` counted once)."""
    seen: dict = {}
    for group in layout.groups:
        seen.setdefault(group.spec, []).extend(group.layer_ids)
    return [type("G", (), {"spec": s, "layer_ids": ids}) for s, ids in seen.items()]


def _tokens(n: float) -> str:
    return "inf" if n == float("inf") else f"{n / 1000:.0f}k"


def _state_row(name: str, specs: list, args, device: torch.device, dtype: torch.dtype) -> str:
    state = [s for s in specs if s.is_state]
    attention = [s for s in specs if s.is_paged]
    slot = sum(s.slot_bytes() for s in state)
    per_token = sum(s.page_bytes(1) for s in attention)
    layer_page = attention[0].page_bytes(1)  # one attention layer's bytes per token
    vllm_block = -(-(-(-state[0].slot_bytes() // layer_page)) // 16) * 16
    copy = checkpoint_copy_s(specs, device, dtype)
    at_hbm = 2 * slot / args.hbm_bytes_per_s  # read and write
    return (f"| {name} | {len(state)} | {slot / 2**20:.1f} MiB | {slot / per_token:,.0f} | "
            f"{copy * 1e3:.2f} ms | {at_hbm * 1e6:.0f} µs | {vllm_block} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench kv-capacity", description=__doc__.split("\n")[0])
    parser.add_argument("--budget-gib", type=float, default=40.0, help="KV cache memory (GiB)")
    parser.add_argument("--contexts", default="8192,32768,131072", help="context lengths for seqs@C (tokens)")
    parser.add_argument("--families", default=",".join([*FAMILIES, *HYBRID_FAMILIES]))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto", help="where the checkpoint copy is timed")
    parser.add_argument("--hbm-bytes-per-s", type=float, default=4.8e12,
                        help="device memory bandwidth for the computed copy time (default: an H200's 4.8 TB/s)")
    args = parser.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    budget = int(args.budget_gib * 2**30)
    known = {**FAMILIES, **HYBRID_FAMILIES}
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {sorted(known)}")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    print(f"KV budget {args.budget_gib:g} GiB, {args.dtype}, block {args.block_size}, prefill chunk "
          f"{args.max_chunk}; checkpoint copies timed on {machine} ({device})\n")
    header = ["family", "layers", "tokens grouped", "tokens uniform"]
    for context in args.contexts:
        header += [f"seqs@{context // 1024}k grouped", f"seqs@{context // 1024}k uniform"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    specs = {name: family_specs(known[name], dtype) for name in names}
    for name in names:
        print(_row(name, specs[name], args, budget, device))
    hybrid = [n for n in names if any(s.is_state for s in specs[n])]
    if hybrid:
        print(f"\n| family | state layers | checkpoint | = attention tokens | copy here | copy at "
              f"{args.hbm_bytes_per_s / 1e12:g} TB/s | vLLM-style block (tokens) |")
        print("|---|---|---|---|---|---|---|")
        for name in hybrid:
            print(_state_row(name, specs[name], args, device, dtype))
    return 0
