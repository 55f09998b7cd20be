"""Random LoRA adapters made with ``peft`` (the format users bring), and HF + PEFT references."""

from __future__ import annotations

from pathlib import Path

import torch

# name -> (rank, alpha, targets, use_rslora): different ranks, target sets and scalings.
ADAPTERS = {
    "attn-qv": (8, 16, ["q_proj", "v_proj"], False),
    "all-r4": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp-rs": (16, 8, ["o_proj", "gate_proj", "down_proj"], True),
}


def make_peft_adapter(base_path: str, out_dir: Path, name: str, seed: int) -> Path:
    """Save a random (non-zero B) PEFT LoRA adapter ``name`` (see ADAPTERS) for the base model."""
    import peft
    import transformers

    rank, alpha, targets, rslora = ADAPTERS[name]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                             init_lora_weights=False, lora_dropout=0.0)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # peft's random init gives small deltas; make each adapter matter
        for pname, param in model.named_parameters():
            if "lora_B" in pname:
                param.normal_(0.0, 0.3)
    out = Path(out_dir) / name
    model.save_pretrained(out)
    return out


def peft_model(base_path: str, adapter_path: str):
    """The base model with the adapter, as users would run it with HF + PEFT (fp32, eval)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_path).eval()


@torch.inference_mode()
def peft_greedy(model, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_token_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_token_ids):].tolist()
