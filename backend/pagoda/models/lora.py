"""LoRA adapters in PEFT's format, fused to the model's projections, and their device slots.

Format read (what ``peft``'s ``save_pretrained`` writes): a folder with
``adapter_config.json`` (``peft_type`` "LORA", ``r``, ``lora_alpha``, ``target_modules``,
optional ``use_rslora``, ``rank_pattern``/``alpha_pattern``) and
``adapter_model.safetensors`` holding, per adapted projection,
``base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight`` (``[r, in]``)
and ``...lora_B.weight`` (``[out, r]``). Targets may be any of ``q_proj k_proj v_proj
o_proj gate_proj up_proj down_proj``; anything else (embeddings, the LM head, DoRA,
biases) is refused with a clear error rather than silently ignored. On a Mixture-of-Experts
model, LoRA on the experts or the router is refused too (an adapter naming ``experts``, a
``block_sparse_moe`` module, or an MLP target on a sparse layer); its attention targets and
the dense layers' MLPs (Qwen3-MoE's ``mlp_only_layers``) are adapted as usual.

Fusing: the model stores q/k/v as one ``qkv_weight`` and gate/up as one ``gate_up_weight``
(``models/llama.py``), so an adapter is stored per fused projection as one shrink matrix
``A`` (the targets' ``A``s stacked along the rank: ``[n_targets * max_rank, in]``) and one
expand matrix ``B`` (block-diagonal: each target's ``B`` in its own output rows and rank
columns, ``[out, n_targets * max_rank]``), the scaling ``alpha / r`` (``alpha / sqrt(r)``
with rsLoRA) folded into ``B``. A target the adapter does not adapt is a zero block, and a
rank below ``max_rank`` is zero-padded, so every adapter has the same shapes and one slot
layout serves all of them. Then for every token ``delta = B @ (A @ x)`` is exactly the sum
of the per-target LoRA deltas, in the fused output layout.

Slots (``LoRASlots``): a fixed number of device-resident adapter slots per fused
projection, ``A_stack [num_slots, R, in]`` and ``B_stack [num_slots, out, R]``; the engine's
``LoRAManager`` copies an adapter into a slot when a step needs it (LRU). A step passes a
``LoRABatch`` (per-token slot index, -1 for base-model tokens, plus the host-side list of
token indices per active slot) and each projection adds ``kernels.lora_apply``'s delta.

Tensor parallelism: on a sharded model (``models.tensor_parallel``) each projection owner
carries ``tp_shards``; ``LoRASlots`` then holds and loads only this rank's slice of every
adapter (``lora_slices``: B's rows for column-parallel projections, A's columns for
row-parallel ones). A pipeline stage (``models.pipeline_parallel``) holds slots for its
layers only (``first_layer`` on: the model-wide index of its first).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from pagoda.models.config import ModelConfig

# Our fused projection -> (module attribute, the PEFT target names fused into it, in order).
FUSED_TARGETS = {
    "qkv_weight": ("attn", ("q_proj", "k_proj", "v_proj")),
    "o_weight": ("attn", ("o_proj",)),
    "gate_up_weight": ("mlp", ("gate_proj", "up_proj")),
    "down_weight": ("mlp", ("down_proj",)),
}
SUPPORTED_TARGETS = frozenset(t for _, targets in FUSED_TARGETS.values() for t in targets)
_PEFT_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}



# LoRA weights are small (typically |w| < 10); beyond this an adapter is corrupt or hostile and
# its deltas would overflow 16-bit activations.
MAX_ADAPTER_WEIGHT = 1e4

def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each PEFT target projection for this model."""
    hidden, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


@dataclass
class LoRAAdapter:
    """One adapter, fused and padded to ``max_rank``, on the host (see the module docstring).

    ``weights[layer][fused_name] = (A [n * max_rank, in], B [out, n * max_rank])``, or no
    entry when the adapter leaves that projection alone in that layer.
    """

    name: str
    path: str
    rank: int
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]


def _read_config(folder: Path) -> dict:
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {folder}: no adapter_config.json (expected PEFT's save_pretrained format)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {folder}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        kind = "array" if isinstance(config, list) else type(config).__name__
        raise ValueError(f"LoRA adapter {folder}: adapter_config.json must be a JSON object, got a JSON {kind}")
    _check_scaling_fields(folder, config)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {folder}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {folder}: DoRA adapters are not supported")
    return config


def _check_scaling_fields(folder: Path, config: dict) -> None:
    """``lora_alpha`` a number, ``alpha_pattern`` / ``rank_pattern`` objects of positive numbers
    (``_scaling`` divides by a rank)."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if "lora_alpha" in config and not number(config["lora_alpha"]):
        raise ValueError(f"LoRA adapter {folder}: lora_alpha must be a number, got {config['lora_alpha']!r}")
    for field, positive_int in (("alpha_pattern", False), ("rank_pattern", True)):
        pattern = config.get(field, {})
        if not isinstance(pattern, dict):
            raise ValueError(f"LoRA adapter {folder}: {field} must be an object of target -> number")
        for target, value in pattern.items():
            good = (isinstance(value, int) and not isinstance(value, bool) and value > 0) if positive_int \
                else number(value)
            if not good:
                wanted = "a positive integer" if positive_int else "a number"
                raise ValueError(f"LoRA adapter {folder}: {field}.{target} must be {wanted}, got {value!r}")


def _target_name(key: str) -> tuple[int, str, str]:
    """``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` -> (3, "q_proj", "A")."""
    parts = key.split(".")
    if "experts" in parts or "block_sparse_moe" in parts:
        raise ValueError(f"unsupported LoRA weight {key!r}: LoRA on MoE expert or router weights is not supported")
    try:
        i = parts.index("layers")
        layer, proj, which = int(parts[i + 1]), parts[i + 3], parts[i + 4]
    except (ValueError, IndexError):
        raise ValueError(f"unsupported LoRA weight {key!r}: only decoder-layer projections can be adapted") from None
    if proj not in SUPPORTED_TARGETS:
        raise ValueError(f"unsupported LoRA target {proj!r} in {key!r}; supported: {sorted(SUPPORTED_TARGETS)}")
    if which not in ("lora_A", "lora_B") or not key.endswith(".weight"):
        raise ValueError(f"unsupported LoRA weight {key!r} (only lora_A/lora_B weights)")
    return layer, proj, which[-1]


def load_peft_adapter(name: str, path: str, config: ModelConfig, max_rank: int,
                      dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read a PEFT LoRA folder and fuse it for this model (host tensors, ``dtype``).

    Raises:
        ValueError: missing/invalid files, a target or weight this engine cannot apply,
            shapes that do not match the base model, or a rank above ``max_rank``.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    weights_path = folder / "adapter_model.safetensors"
    if not folder.is_dir() or not weights_path.is_file():  # one message: it tells no one which folders exist
        raise ValueError(f"LoRA adapter {name!r}: no PEFT adapter (adapter_config.json and "
                         f"adapter_model.safetensors) at {path}")
    cfg = _read_config(folder)
    raw = load_file(str(weights_path))
    for key, tensor in raw.items():  # one bad adapter must not poison every request that uses it
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"LoRA adapter {name!r}: {key} holds NaN or infinite values")
        if tensor.is_floating_point() and tensor.numel() and float(tensor.abs().max()) > MAX_ADAPTER_WEIGHT:
            raise ValueError(f"LoRA adapter {name!r}: {key} holds a weight of magnitude "
                             f"{float(tensor.abs().max()):.3g}, above {MAX_ADAPTER_WEIGHT:g} (a corrupt adapter?)")
    shapes = target_shapes(config)
    per_layer: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(config.num_hidden_layers)]
    for key, tensor in raw.items():
        layer, proj, which = _target_name(key)
        if not 0 <= layer < config.num_hidden_layers:
            raise ValueError(f"LoRA adapter {name!r}: {key} names layer {layer}; the model has "
                             f"{config.num_hidden_layers}")
        if _PEFT_MODULE[proj] == "mlp" and config.is_moe_layer(layer):
            raise ValueError(f"LoRA adapter {name!r}: {key} adapts {proj} of layer {layer}, a MoE layer; "
                             "LoRA on MoE expert weights is not supported")
        per_layer[layer].setdefault(proj, {})[which] = tensor
    rank = 0
    fused_layers = []
    for layer, targets in enumerate(per_layer):
        fused = {}
        for fused_name, (_, names) in FUSED_TARGETS.items():
            present = [t for t in names if t in targets]
            if not present:
                continue
            a_parts, b_parts = [], []
            for target in names:
                out_f, in_f = shapes[target]
                a = torch.zeros(max_rank, in_f, dtype=torch.float32)
                b = torch.zeros(out_f, max_rank, dtype=torch.float32)
                if target in targets:
                    pair = targets[target]
                    if set(pair) != {"A", "B"}:
                        raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} lacks lora_A or lora_B")
                    r = pair["A"].shape[0]
                    if r == 0:
                        raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} has rank 0 (empty lora_A)")
                    if r > max_rank:
                        raise ValueError(f"LoRA adapter {name!r}: rank {r} exceeds max_lora_rank {max_rank}")
                    if tuple(pair["A"].shape) != (r, in_f) or tuple(pair["B"].shape) != (out_f, r):
                        raise ValueError(f"LoRA adapter {name!r}: layer {layer} {target} has A {tuple(pair['A'].shape)}"
                                         f" and B {tuple(pair['B'].shape)}; the base model needs [r, {in_f}] and "
                                         f"[{out_f}, r] (an adapter for another model?)")
                    rank = max(rank, r)
                    a[:r] = pair["A"].float()
                    b[:, :r] = pair["B"].float() * _scaling(cfg, target, r)
                a_parts.append(a)
                b_parts.append(b)
            a_cat = torch.cat(a_parts)  # [n * max_rank, in]
            b_diag = torch.block_diag(*b_parts)  # [sum(out), n * max_rank]
            fused[fused_name] = (a_cat.to(dtype), b_diag.to(dtype))
        fused_layers.append(fused)
    if rank == 0:
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} holds no lora_A/lora_B weights")
    return LoRAAdapter(name, str(folder), rank, fused_layers)


def _scaling(cfg: dict, target: str, r: int) -> float:
    alpha = cfg.get("alpha_pattern", {}).get(target, cfg.get("lora_alpha", 8))
    r_cfg = cfg.get("rank_pattern", {}).get(target, r)
    return alpha / math.sqrt(r_cfg) if cfg.get("use_rslora") else alpha / r_cfg


@dataclass
class LoRABatch:
    """Which adapter slot each token of a step uses.

    ``token_slots [num_tokens]`` int64 on the model's device (-1: base model);
    ``groups``: for each slot used this step, the indices of its tokens (device tensors),
    built on the host from the step's layout, so no kernel or reference needs a host sync.
    """

    token_slots: torch.Tensor
    groups: list[tuple[int, torch.Tensor]]

    @staticmethod
    def build(slots_per_request: list[int], tokens_per_request: list[int], device: torch.device) -> "LoRABatch":
        """From each request's slot (-1 none) and token count, in the step's token order."""
        token_slots: list[int] = []
        for slot, n in zip(slots_per_request, tokens_per_request):
            token_slots += [slot] * n
        slots_t = torch.tensor(token_slots, dtype=torch.int64)
        groups = [(s, torch.nonzero(slots_t == s).flatten().to(device)) for s in sorted(set(slots_per_request))
                  if s >= 0]
        return LoRABatch(slots_t.to(device), groups)


def lora_slices(owner, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a LoRA pair (A ``[r, in]``, B ``[out, r]``) on ``owner.<name>``;
    the pair itself when ``owner`` is not sharded."""
    shards = getattr(owner, "tp_shards", None)
    if shards is None:
        return a, b
    how, where = shards[name]
    if how == "rows":
        return a, b[where.to(b.device)]
    return a[:, where[0]:where[1]], b


class LoRASlots:
    """The device stacks of every fused projection, ``num_slots`` adapters deep.

    Attaches ``module.lora_stacks[fused_name] = (A_stack, B_stack)`` to each layer's
    attention and MLP modules; the model adds the LoRA delta when a step passes a batch.
    """

    def __init__(self, model, num_slots: int, max_rank: int) -> None:
        """Raises:
            ValueError: a hybrid model (Gated DeltaNet layers, gated attention) or multi-head latent
                attention: its projections have other shapes than the PEFT targets' and no adapter
                path is checked yet."""
        if model.config.linear_attention is not None or model.config.attention_output_gate:
            raise ValueError(f"LoRA adapters are not supported for {model.config.architecture} yet: its "
                             "linear-attention and gated-attention projections have no adapter path")
        if model.config.mla is not None:
            raise ValueError(f"LoRA adapters are not supported for {model.config.architecture} yet: its "
                             "multi-head latent attention projections (q_a/q_b, kv_a/kv_b) have no adapter path")
        if model.config.gemma4 is not None:
            raise ValueError(f"LoRA adapters are not supported for {model.config.architecture} yet: its attention "
                             "projections differ per layer (head_dim, KV heads, KV-shared and k=v layers)")
        self.model, self.num_slots, self.max_rank = model, num_slots, max_rank
        config, dtype, device = model.config, model.dtype, model.device
        shapes = target_shapes(config)
        # A pipeline stage holds a range of the layers; adapters and targets are indexed model-wide.
        for index, layer in enumerate(model.layers, start=getattr(model, "first_layer", 0)):
            for fused_name, (owner_name, names) in _layer_targets(config, index):
                owner = getattr(layer, owner_name)
                out_f = sum(shapes[t][0] for t in names)
                in_f = shapes[names[0]][1]
                rank_total = len(names) * max_rank
                stacks = getattr(owner, "lora_stacks", None)
                if stacks is None:
                    stacks = owner.lora_stacks = {}
                # A tensor-parallel rank holds its slice (models/tensor_parallel.py).
                a, b = lora_slices(owner, fused_name, torch.empty(rank_total, in_f), torch.empty(out_f, rank_total))
                stacks[fused_name] = (torch.zeros(num_slots, *a.shape, dtype=dtype, device=device),
                                      torch.zeros(num_slots, *b.shape, dtype=dtype, device=device))

    def load(self, slot: int, adapter: Optional[LoRAAdapter]) -> None:
        """Copy ``adapter`` into ``slot`` (zeros where it adapts nothing; ``None`` clears)."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range"
        for index, layer in enumerate(self.model.layers, start=getattr(self.model, "first_layer", 0)):
            for fused_name, (owner_name, _) in _layer_targets(self.model.config, index):
                owner = getattr(layer, owner_name)
                a_stack, b_stack = owner.lora_stacks[fused_name]
                pair = adapter.weights[index].get(fused_name) if adapter is not None else None
                if pair is None:
                    a_stack[slot].zero_()
                    b_stack[slot].zero_()
                else:
                    a, b = lora_slices(owner, fused_name, *pair)
                    a_stack[slot].copy_(a)
                    b_stack[slot].copy_(b)

    def bytes_per_slot(self) -> int:
        total = 0
        for index, layer in enumerate(self.model.layers, start=getattr(self.model, "first_layer", 0)):
            for fused_name, (owner_name, _) in _layer_targets(self.model.config, index):
                a, b = getattr(layer, owner_name).lora_stacks[fused_name]
                total += (a[0].numel() + b[0].numel()) * a.element_size()
        return total


def _layer_targets(config: ModelConfig, layer: int) -> list[tuple[str, tuple[str, tuple[str, ...]]]]:
    """The fused projections of ``layer`` that take adapters (a MoE layer's MLP takes none)."""
    return [(fused, (owner, names)) for fused, (owner, names) in FUSED_TARGETS.items()
            if not (owner == "mlp" and config.is_moe_layer(layer))]
