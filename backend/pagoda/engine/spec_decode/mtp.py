"""Multi-token-prediction (MTP) heads: the draft layer a checkpoint carries beside its decoder.

DeepSeek-V3, GLM-4.5 and Qwen3-Next train one extra block that predicts the token after
next from the target's last hidden state and the next token's embedding. This is the loader
path for a DeepSeek-V3 target (its block an MLA layer with a MoE block, built as the
checkpoint's layer ``N``: ``mtp_layer_index``; its cache a latent cache), a GLM-4.5 target
(likewise: GLM attention with a MoE block) and for a
Llama/Qwen3-family target whose checkpoint carries such a block, in either published layout:

* DeepSeek-V3 (``num_nextn_predict_layers``: N_mtp in config.json): under
  ``model.layers.{N}.`` (``N`` = ``num_hidden_layers``): ``enorm``, ``hnorm``,
  ``eh_proj`` ``[H, 2H]``, a decoder layer of the target's family (``input_layernorm``,
  ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``), ``shared_head.norm`` and
  optionally ``shared_head.head`` and ``embed_tokens`` (absent: the target's, shared);
* Qwen3-Next (``mtp_num_hidden_layers``): ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.fc`` ``[H, 2H]``, ``mtp.layers.0.*``, ``mtp.norm``;
  embeddings and LM head are the target's.

Per token at position ``p`` (vLLM's ``deepseek_mtp`` / ``qwen3_next_mtp``):
``x = eh_proj(concat(enorm(embed(token_{p+1})), hnorm(h_p)))`` with ``h_p`` the target's
final (normed) hidden state at ``p``; the decoder layer; ``prenorm = x_out + residual``,
``normed = norm(prenorm)``, logits ``head(normed)``. Chained drafts reuse the first MTP
block, feeding back its own ``prenorm``, as vLLM does when ``k`` exceeds the checkpoint's
MTP layers (only the first block is loaded).

The target's loader skips these tensors (``models.loader.is_mtp_tensor``);
``load_mtp_head`` refuses a checkpoint without them, naming the config field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import kernels
from pagoda.engine.spec_decode.eagle3 import read_tensors
from pagoda.kernels import AttentionMetadata
from pagoda.models.config import read_config_json
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.loader import checkpoint_files
from pagoda.models.registry import config_from_pretrained

MTP_STYLES = ("deepseek", "qwen3_next")


def mtp_names(style: str, num_hidden_layers: int) -> dict[str, str]:
    """The checkpoint names of one layout: role -> name (``layer`` is a prefix)."""
    if style == "deepseek":
        p = f"model.layers.{num_hidden_layers}."
        return {"enorm": p + "enorm.weight", "hnorm": p + "hnorm.weight", "proj": p + "eh_proj.weight",
                "layer": p, "norm": p + "shared_head.norm.weight", "head": p + "shared_head.head.weight",
                "embed": p + "embed_tokens.weight"}
    return {"enorm": "mtp.pre_fc_norm_embedding.weight", "hnorm": "mtp.pre_fc_norm_hidden.weight",
            "proj": "mtp.fc.weight", "layer": "mtp.layers.0.", "norm": "mtp.norm.weight", "head": None, "embed": None}


class MtpHead(nn.Module):
    """Args:
    target: the target model (family, shape, rotary table; embeddings and LM head shared
        unless the checkpoint has the block's own).
    """

    def __init__(self, target: LlamaForCausalLM) -> None:
        super().__init__()
        config = target.config
        hidden = config.hidden_size
        self.config = config
        self.dtype, self.device = target.dtype, target.device
        kw = dict(dtype=target.dtype, device=target.device)
        self.enorm = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False)
        self.hnorm = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False)
        self.eh_proj = nn.Parameter(torch.empty(hidden, 2 * hidden, **kw), requires_grad=False)
        # As the checkpoint's layer N (DeepSeek: MLA with a MoE block); full attention as layer 0 for Llama.
        self.layer = target.layer_class(config, target.mtp_layer_index(), target.dtype, target.device)
        self.norm = nn.Parameter(torch.empty(hidden, **kw), requires_grad=False)
        self.embed_tokens = target.embed_tokens
        self.lm_head = target.lm_head
        self.cos_sin_cache = target.cos_sin_cache

    def target_features(self, target: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads from the target's step: its final hidden states ``[T, H]``."""
        return hidden

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, prenorm)`` ``[T, H]`` each; writes the block's K/V at ``meta``'s slots."""
        eps = self.config.rms_norm_eps
        embeds, _ = kernels.rms_norm(F.embedding(input_ids, self.embed_tokens), self.enorm, eps)
        normed_hidden, _ = kernels.rms_norm(hidden, self.hnorm, eps)
        x = F.linear(torch.cat([embeds, normed_hidden], dim=-1), self.eh_proj)
        x, residual = self.layer(x, None, positions, self.cos_sin_cache, kv_caches[0], meta)
        return kernels.rms_norm(x, self.norm, eps, residual)

    def compute_logits(self, normed: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return F.linear(normed, self.lm_head).float()

    def matmul_params(self) -> int:
        layer = self.layer
        return sum(p.numel() for p in (self.eh_proj, self.lm_head)) + \
            sum(p.numel() for p in layer.attn.parameters()) + sum(p.numel() for p in layer.mlp.parameters())


def load_mtp_head(path: Optional[str], target_path: str, target: LlamaForCausalLM) -> MtpHead:
    """The first MTP block of the checkpoint at ``path`` (default: the target's own folder).

    Raises:
        ValueError: the checkpoint declares no MTP layers, its shape differs from the
            target's, or a tensor is missing or mis-shaped (the message names it).
    """
    folder = Path(path or target_path)
    if not (folder / "config.json").exists():
        raise ValueError(f"speculative_model: no config.json in {str(folder)!r}")
    raw = read_config_json(folder)
    where = f"mtp checkpoint {folder}"
    style = "deepseek" if raw.get("num_nextn_predict_layers") else "qwen3_next" if raw.get(
        "mtp_num_hidden_layers") else None
    if style is None:
        raise ValueError(f"{where}: config.json has no num_nextn_predict_layers (DeepSeek-V3 layout) or "
                         "mtp_num_hidden_layers (Qwen3-Next layout): the checkpoint carries no MTP layers")
    config = config_from_pretrained(folder)
    tc = target.config
    for field in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if getattr(config, field) != getattr(tc, field):
            raise ValueError(f"{where}: {field} {getattr(config, field)} differs from the target's "
                             f"{getattr(tc, field)}")
    names = mtp_names(style, tc.num_hidden_layers)
    head = MtpHead(target)
    table = {names["enorm"]: head.enorm, names["hnorm"]: head.hnorm, names["proj"]: head.eh_proj,
             names["norm"]: head.norm}
    layer_targets = {names["layer"] + local: target for local, target in head.layer.weight_targets().items()}
    wanted = set(table) | set(layer_targets) | {n for n in (names["head"], names["embed"]) if n}
    tensors = read_tensors(folder, wanted) if checkpoint_files(folder) else {}
    missing = sorted((set(table) | set(layer_targets)) - set(tensors))
    if missing:
        raise ValueError(f"{where}: missing MTP tensors {', '.join(missing[:6])}")
    with torch.no_grad():
        for name, param in table.items():
            _copy(param, slice(None), tensors[name], name, where)
        for name, (param, rows) in layer_targets.items():
            _copy(param, rows, tensors[name], name, where)
        for role, attr in (("head", "lm_head"), ("embed", "embed_tokens")):
            if names[role] in tensors:
                own = nn.Parameter(torch.empty(tc.vocab_size, tc.hidden_size, dtype=head.dtype, device=head.device),
                                   requires_grad=False)
                _copy(own, slice(None), tensors[names[role]], names[role], where)
                setattr(head, attr, own)
    return head.eval()


def _copy(param: torch.Tensor, rows, tensor: torch.Tensor, name: str, where: str) -> None:
    if tuple(param[rows].shape) != tuple(tensor.shape):
        raise ValueError(f"{where}: {name} has shape {tuple(tensor.shape)}, the target's config says "
                         f"{tuple(param[rows].shape)}")
    param[rows].copy_(tensor)
