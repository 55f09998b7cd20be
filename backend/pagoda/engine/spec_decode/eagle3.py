"""EAGLE-3 draft heads: one decoder layer that reads the target's hidden states from three layers.

A head ships as a Hugging Face folder (``config.json`` + safetensors), as the published
heads do (``yuhuili/EAGLE3-*``, ``RedHatAI/*eagle3``):

* ``config.json``: ``architectures`` ``LlamaForCausalLMEagle3`` / ``Eagle3LlamaForCausalLM``
  (or ``LlamaForCausalLM`` with ``num_hidden_layers: 1``), the layer's Llama shape,
  ``vocab_size`` (the target's), ``draft_vocab_size`` (the head's LM head; default the
  vocabulary), ``target_hidden_size`` (default ``hidden_size``), and the auxiliary layer ids
  in ``eagle_aux_hidden_state_layer_ids`` (top level or inside ``eagle_config``; default
  vLLM's ``(2, N // 2, N - 3)`` for an ``N``-layer target);
* tensors: ``fc.weight`` ``[hidden, 3 * target_hidden]``, the layer ``midlayer.*``
  (``layers.0.*`` accepted) whose q/k/v projections take ``2 * hidden`` inputs, plus
  ``midlayer.hidden_norm.weight``; ``norm.weight``; ``lm_head.weight``
  ``[draft_vocab, hidden]``; ``d2t`` ``[draft_vocab]`` (draft id ``i`` is target id
  ``i + d2t[i]``; required when the draft vocabulary is smaller); ``t2d`` is ignored;
  ``embed_tokens.weight`` optional (absent: the target's embeddings, shared).

The computation, per token at position ``p`` (what vLLM's and SGLang's ``llama_eagle3``
compute): ``g = fc(aux_p)`` fuses the target's three hidden states at ``p`` (its first
step; later chained steps feed back the head's own pre-norm output instead); the layer's
attention input is ``concat(input_norm(embed(token_{p+1})), hidden_norm(g))`` (``2 *
hidden``), its residual ``g`` (``hidden_norm(g)`` with ``norm_before_residual``); then
attention, post-attention norm with the residual add, MLP, and the final ``norm`` with the
residual add give ``(normed, prenorm)``; ``lm_head(normed)`` scores the draft vocabulary,
scattered into the target's (``-inf`` elsewhere).

``load_eagle3_head`` refuses a head that does not fit its target, naming the field:
``vocab_size``, ``target_hidden_size``, ``draft_vocab_size``,
``eagle_aux_hidden_state_layer_ids``, a tensor's shape, or a missing tensor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pagoda import kernels
from pagoda.kernels import AttentionMetadata
from pagoda.models.config import ModelConfig, common_fields, read_config_json
from pagoda.models.llama import DecoderLayer, LlamaForCausalLM, make_cos_sin_cache
from pagoda.models.loader import checkpoint_files

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default: the residual stream entering layers 2, N // 2 and N - 3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def read_tensors(path: Path, wanted: Optional[set[str]] = None) -> dict[str, torch.Tensor]:
    """The folder's safetensors tensors (only ``wanted`` names when given)."""
    out = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if wanted is None or name in wanted:
                    out[name] = f.get_tensor(name)
    return out


class Eagle3Head(nn.Module):
    """Args:
    config: the head's layer shape (a one-layer Llama config).
    embed_tokens: the target's embeddings (shared unless the head ships its own).
    target_hidden: the target's hidden size (``fc`` takes three of them).
    draft_vocab: rows of the head's LM head.
    aux_layer_ids: the target layers whose input residual stream the head reads.
    norm_before_residual: the residual is ``hidden_norm(g)`` rather than ``g``.
    max_positions: positions the rotary table covers (the engine's max_model_len at least).
    """

    def __init__(self, config: ModelConfig, embed_tokens: torch.Tensor, target_hidden: int, draft_vocab: int,
                 aux_layer_ids: tuple[int, ...], norm_before_residual: bool, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.config = config
        self.dtype, self.device = dtype, torch.device(device)
        self.aux_layer_ids = aux_layer_ids
        self.norm_before_residual = norm_before_residual
        self.draft_vocab = draft_vocab
        kw = dict(dtype=dtype, device=device)
        self.layer = DecoderLayer(config, 0, dtype, device)
        attn = self.layer.attn
        attn.qkv_weight = nn.Parameter(torch.empty(attn.q_size + 2 * attn.kv_size, 2 * hidden, **kw),
                                       requires_grad=False)  # input: concat(embeds, hidden)
        self.hidden_norm = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False)
        self.fc = nn.Parameter(torch.empty(hidden, len(aux_layer_ids) * target_hidden, **kw), requires_grad=False)
        self.norm = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False)
        self.lm_head = nn.Parameter(torch.empty(draft_vocab, hidden, **kw), requires_grad=False)
        self.embed_tokens = embed_tokens  # replaced when the head ships its own
        self.maps_vocab = False  # d2t is not the identity: logits are scattered into the target's vocabulary
        self.register_buffer("draft_to_target", torch.arange(draft_vocab, device=device), persistent=False)
        table = dataclasses.replace(config, max_position_embeddings=max(max_positions, config.max_position_embeddings))
        self.register_buffer("cos_sin_cache", make_cos_sin_cache(table, self.device), persistent=False)

    def target_features(self, target: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads from the target's step: its auxiliary hidden states ``[T, 3 * H_t]``."""
        assert target.aux_hidden is not None and target.aux_hidden.shape[0] == hidden.shape[0], \
            "the target's forward did not keep its auxiliary hidden states"
        return target.aux_hidden

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """``fc``: the target's three hidden states fused into one ``[T, H]``."""
        return F.linear(features.to(self.fc.dtype), self.fc)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, prenorm)`` ``[T, H]`` each; writes the layer's K/V at ``meta``'s slots."""
        layer, eps = self.layer, self.config.rms_norm_eps
        embeds, _ = kernels.rms_norm(F.embedding(input_ids, self.embed_tokens), layer.input_norm, eps)
        normed_hidden, _ = kernels.rms_norm(hidden, self.hidden_norm, eps)
        residual = normed_hidden if self.norm_before_residual else hidden
        h = layer.attn(torch.cat([embeds, normed_hidden], dim=-1), positions, self.cos_sin_cache, kv_caches[0], meta)
        h, residual = kernels.rms_norm(h, layer.post_attention_norm, eps, residual)
        return kernels.rms_norm(layer.mlp(h), self.norm, eps, residual)

    def compute_logits(self, normed: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[T, vocab_size]`` float32: the draft vocabulary's logits at their target ids, -inf elsewhere."""
        logits = F.linear(normed, self.lm_head).float()
        if not self.maps_vocab:
            return logits
        out = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
        out[:, self.draft_to_target] = logits
        return out

    def matmul_params(self) -> int:
        """Weights one drafted token multiplies through (cost proxy for the adaptive window)."""
        return sum(p.numel() for p in (self.layer.attn.qkv_weight, self.layer.attn.o_weight,
                                       self.layer.mlp.gate_up_weight, self.layer.mlp.down_weight, self.lm_head))

    def weight_targets(self) -> dict:
        """Checkpoint names (with ``midlayer.``) -> (parameter, index)."""
        table = {f"midlayer.{name}": target for name, target in self.layer.weight_targets().items()}
        table["midlayer.hidden_norm.weight"] = (self.hidden_norm, slice(None))
        table |= {"fc.weight": (self.fc, slice(None)), "norm.weight": (self.norm, slice(None)),
                  "lm_head.weight": (self.lm_head, slice(None))}
        return table


def head_kv_config(path: str) -> ModelConfig:
    """The head's one-layer shape from ``<path>/config.json`` (sizes its KV cache).

    Raises:
        ValueError: no config.json in ``path``.
    """
    if not (Path(path) / "config.json").exists():
        raise ValueError(f"speculative_model: no config.json in {path!r}")
    return ModelConfig(**common_fields({**read_config_json(Path(path)), "num_hidden_layers": 1}, "Eagle3"))


def load_eagle3_head(path: str, target: LlamaForCausalLM, max_model_len: int, dtype: torch.dtype,
                     device: torch.device) -> Eagle3Head:
    """The head in ``path``, checked against ``target``.

    Raises:
        ValueError: no config.json, an unknown architecture, or a head that does not fit
            the target (the message names the field or tensor).
    """
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise ValueError(f"speculative_model: no config.json in {path!r}")
    raw = read_config_json(folder)
    tc = target.config
    where = f"eagle3 head {path}"
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in EAGLE3_ARCHITECTURES or raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: architectures {arch!r} with {raw.get('num_hidden_layers')} layers is not an "
                         f"EAGLE-3 head (expected one of {EAGLE3_ARCHITECTURES} with num_hidden_layers 1)")
    if raw["vocab_size"] != tc.vocab_size:
        raise ValueError(f"{where}: vocab_size {raw['vocab_size']} differs from the target's {tc.vocab_size}; "
                         "the head was trained for another target")
    target_hidden = raw.get("target_hidden_size") or raw["hidden_size"]
    if target_hidden != tc.hidden_size:
        raise ValueError(f"{where}: target_hidden_size {target_hidden} differs from the target's hidden_size "
                         f"{tc.hidden_size}")
    draft_vocab = raw.get("draft_vocab_size") or raw["vocab_size"]
    if not 1 <= draft_vocab <= tc.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size {draft_vocab} must be in [1, vocab_size={tc.vocab_size}]")
    eagle = raw.get("eagle_config") or {}
    ids = (raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
           or default_aux_layer_ids(tc.num_hidden_layers))
    if len(ids) != 3 or not all(0 <= i < tc.num_hidden_layers for i in ids):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {list(ids)} must be three layer ids in "
                         f"[0, {tc.num_hidden_layers}) of the target")
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state false (an EAGLE-1/2 head) is not supported")
    config = ModelConfig(**common_fields({**raw, "num_hidden_layers": 1}, "Eagle3"))
    head = Eagle3Head(config, target.embed_tokens, target_hidden, draft_vocab, tuple(ids),
                      bool(raw.get("norm_before_residual")),
                      max_model_len, dtype, device)
    _load_weights(head, read_tensors(folder), where, tc.vocab_size)
    return head.eval()


@torch.no_grad()
def _load_weights(head: Eagle3Head, tensors: dict[str, torch.Tensor], where: str, vocab_size: int) -> None:
    tensors = {name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name: t
               for name, t in tensors.items()}
    table = head.weight_targets()
    missing = sorted(set(table) - set(tensors))
    if missing:
        raise ValueError(f"{where}: missing tensors {', '.join(missing[:6])}")
    for name, (param, rows) in table.items():
        if tuple(param[rows].shape) != tuple(tensors[name].shape):
            raise ValueError(f"{where}: {name} has shape {tuple(tensors[name].shape)}, the config says "
                             f"{tuple(param[rows].shape)}")
        param[rows].copy_(tensors[name])
    if "embed_tokens.weight" in tensors:
        embed = tensors["embed_tokens.weight"]
        if tuple(embed.shape) != (vocab_size, head.config.hidden_size):
            raise ValueError(f"{where}: embed_tokens.weight has shape {tuple(embed.shape)}, expected "
                             f"{(vocab_size, head.config.hidden_size)}")
        head.embed_tokens = nn.Parameter(embed.to(head.dtype).to(head.device), requires_grad=False)
    elif head.embed_tokens.shape[1] != head.config.hidden_size:
        raise ValueError(f"{where}: no embed_tokens.weight and hidden_size {head.config.hidden_size} differs from "
                         f"the target's {head.embed_tokens.shape[1]} (its embeddings cannot be shared)")
    if "d2t" in tensors:
        d2t = tensors["d2t"].to(torch.int64)
        if tuple(d2t.shape) != (head.draft_vocab,):
            raise ValueError(f"{where}: d2t has shape {tuple(d2t.shape)}, expected ({head.draft_vocab},)")
        targets = torch.arange(head.draft_vocab) + d2t
        if int(targets.min()) < 0 or int(targets.max()) >= vocab_size or targets.unique().numel() != head.draft_vocab:
            raise ValueError(f"{where}: d2t maps draft ids outside [0, vocab_size={vocab_size}) or onto one id twice")
        head.draft_to_target.copy_(targets.to(head.device))
        head.maps_vocab = head.draft_vocab != vocab_size or bool(d2t.any())
    elif head.draft_vocab != vocab_size:
        raise ValueError(f"{where}: draft_vocab_size {head.draft_vocab} < vocab_size {vocab_size} needs a d2t tensor")
