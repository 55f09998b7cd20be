"""Random-weight draft heads in their published layouts, for tests and benchmarks.

* ``write_random_eagle3_head(out_dir, target_dir)``: an EAGLE-3 head folder
  (``config.json`` + ``model.safetensors``) matched to the target in ``target_dir``, as
  ``eagle3.load_eagle3_head`` reads it: ``fc``, ``midlayer.*`` (q/k/v over ``2 * hidden``),
  ``norm``, ``lm_head`` over ``draft_vocab_size`` tokens, ``d2t``/``t2d`` for a draft
  vocabulary of a random subset of the target's, optionally its own ``embed_tokens``.
* ``add_random_mtp_layers(target_dir)``: one MTP block written into the target's own
  checkpoint, DeepSeek-V3 layout (``model.layers.{N}.*``, ``num_nextn_predict_layers``)
  or Qwen3-Next layout (``mtp.*``, ``mtp_num_hidden_layers``), as ``mtp.load_mtp_head``
  reads it.

Weights: projections ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1), LM heads ~ N(0, 16/hidden)
(as ``make_random_model``: logits spread, greedy picks are not near-ties); seeded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from pagoda.engine.spec_decode.eagle3 import Eagle3Head, default_aux_layer_ids, read_tensors
from pagoda.engine.spec_decode.mtp import MtpHead, mtp_names
from pagoda.models.config import ModelConfig, common_fields, read_config_json
from pagoda.models.registry import build_model, config_from_pretrained


def _random(shape: tuple, name: str, generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norms
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    gain = 16.0 if "lm_head" in name or "head.weight" in name else 1.0
    return torch.randn(shape, generator=generator) * (gain / shape[-1]) ** 0.5


def _aux_ids(num_layers: int) -> list[int]:
    ids = default_aux_layer_ids(num_layers)
    if all(0 <= i < num_layers for i in ids):
        return list(ids)
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


def write_random_eagle3_head(out_dir, target_dir, seed: int = 0, draft_vocab_size: Optional[int] = None,
                             own_embeddings: bool = False, aux_layer_ids: Optional[list[int]] = None,
                             dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random EAGLE-3 head for the target in ``target_dir`` (its hidden size, vocabulary and
    shape unless ``overrides`` change config fields). Returns the folder."""
    target = read_config_json(Path(target_dir))
    vocab = target["vocab_size"]
    draft_vocab = draft_vocab_size or vocab
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "tie_word_embeddings": False, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
           "target_hidden_size": target["hidden_size"],
           "eagle_config": {"use_aux_hidden_state": True,
                            "eagle_aux_hidden_state_layer_ids": aux_layer_ids or _aux_ids(target["num_hidden_layers"])}}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings", "hidden_act"):
        if key in target:
            raw[key] = target[key]
    raw.update(overrides)
    config = ModelConfig(**common_fields(raw, "Eagle3"))
    generator = torch.Generator().manual_seed(seed)
    embed = _random((vocab, config.hidden_size), "embed_tokens", generator)
    head = Eagle3Head(config, embed, raw["target_hidden_size"], draft_vocab,
                      tuple(raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]), False,
                      config.max_position_embeddings, torch.float32, torch.device("cpu"))
    tensors = {name: _random(tuple(param[rows].shape), name, generator)
               for name, (param, rows) in head.weight_targets().items()}
    if own_embeddings:
        tensors["embed_tokens.weight"] = embed
    if draft_vocab != vocab:
        ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def add_random_mtp_layers(target_dir, seed: int = 0, style: str = "deepseek", own_head: bool = False,
                          out_dir=None, dtype: torch.dtype = torch.float32) -> Path:
    """Write one random MTP block into the (single-file) checkpoint in ``target_dir`` and
    declare it in its config.json; with ``out_dir``, write a folder holding only the block
    and the declaring config instead (``speculative_model`` for a target that stays as it
    is, or has no checkpoint: ``load_format="dummy"``). ``own_head``: DeepSeek layout with
    its own ``shared_head.head`` and ``embed_tokens``. Returns the folder written."""
    folder = Path(target_dir)
    config = config_from_pretrained(folder)
    target = build_model(config, dtype=torch.float32, device="meta")
    head = MtpHead(target)
    names = mtp_names(style, config.num_hidden_layers)
    shapes = {names["enorm"]: head.enorm.shape, names["hnorm"]: head.hnorm.shape, names["proj"]: head.eh_proj.shape,
              names["norm"]: head.norm.shape}
    shapes |= {names["layer"] + local: param[rows].shape
               for local, (param, rows) in head.layer.weight_targets().items()}
    if own_head and style == "deepseek":
        shapes |= {names["head"]: (config.vocab_size, config.hidden_size),
                   names["embed"]: (config.vocab_size, config.hidden_size)}
    generator = torch.Generator().manual_seed(seed)
    tensors = read_tensors(folder) if out_dir is None else {}
    tensors |= {name: _random(tuple(shape), name, generator).to(dtype) for name, shape in shapes.items()}
    raw = read_config_json(folder)
    raw["num_nextn_predict_layers" if style == "deepseek" else "mtp_num_hidden_layers"] = 1
    out = Path(out_dir) if out_dir is not None else folder
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out
