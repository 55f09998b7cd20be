"""Qwen3-VL's vision tower: patches -> ViT blocks -> the merger (the projector into the text model).

As transformers' ``Qwen3VLVisionModel``, for one image at a time (the encoder cache keeps
each image's output by content, so images are encoded one by one and never batched across
requests here):

1. patch embedding: each row of ``pixel_values`` (``C * temporal_patch * patch * patch``
   values, the image processor's layout) times the Conv3d weight flattened to a matrix (a
   stride-equals-kernel convolution is exactly that matmul);
2. learned positions: the square ``num_position_embeddings`` table resampled bilinearly
   (``align_corners=True``) to the image's patch grid, in the processor's merge-block order
   (``merge x merge`` neighbours consecutive), the same for each temporal frame;
3. ``depth`` pre-LayerNorm blocks of bidirectional attention (within each frame) with the
   2-D axial rotary embedding (height then width frequencies, rotate-half style) and a
   ``linear_fc1 -> act -> linear_fc2`` MLP;
4. DeepStack: after each block listed in ``deepstack_visual_indexes`` a merger with its
   norm after the merge turns the patches into one feature per placeholder token, added to
   the text model's early layers (``Qwen3VLForConditionalGeneration``);
5. the merger: LayerNorm, ``merge x merge`` patches concatenated, two linears with GELU, to
   the text model's hidden size: the image's placeholder embeddings.

Parameter names are Hugging Face's under ``model.visual.`` (``weight_targets``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.models.multimodal import ImageEmbedding

_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        self.linear_fc1 = nn.Linear(hidden, inter)
        self.linear_fc2 = nn.Linear(inter, hidden)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_len: int) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)  # each [n, heads, head_dim]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        # Bidirectional attention within each temporal frame (an image is one frame).
        frames = n // frame_len
        q, k, v = (t.reshape(frames, frame_len, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)  # [frames, heads, frame_len, head_dim]
        return self.proj(out.transpose(1, 2).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, hidden: int, inter: int, num_heads: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6)
        self.attn = VisionAttention(hidden, num_heads)
        self.mlp = VisionMLP(hidden, inter, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_len: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frame_len)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """``merge x merge`` patches -> one text-model embedding (``post_shuffle``: norm after the merge)."""

    def __init__(self, hidden: int, merge: int, out_hidden: int, post_shuffle: bool) -> None:
        super().__init__()
        self.merged = hidden * merge * merge
        self.post_shuffle = post_shuffle
        self.norm = nn.LayerNorm(self.merged if post_shuffle else hidden, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged)) if self.post_shuffle else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVisionTower(nn.Module):
    """Args:
    vision_config: config.json's ``vision_config`` entry (transformers' ``Qwen3VLVisionConfig`` fields).
    """

    def __init__(self, vision_config: dict, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = vision_config
        hidden, self.num_heads = c["hidden_size"], c["num_heads"]
        self.merge = c.get("spatial_merge_size", 2)
        self.patch_dim = c.get("in_channels", 3) * c.get("temporal_patch_size", 2) * c.get("patch_size", 16) ** 2
        self.side = int(c["num_position_embeddings"] ** 0.5)
        self.deepstack_indexes = tuple(c.get("deepstack_visual_indexes", ()))
        act = c.get("hidden_act", "gelu_pytorch_tanh")
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(c.get("in_channels", 3), hidden,
                                          kernel_size=(c.get("temporal_patch_size", 2), c.get("patch_size", 16),
                                                       c.get("patch_size", 16)))
        self.pos_embed = nn.Embedding(c["num_position_embeddings"], hidden)
        self.blocks = nn.ModuleList(VisionBlock(hidden, c["intermediate_size"], self.num_heads, act)
                                    for _ in range(c["depth"]))
        self.merger = PatchMerger(hidden, self.merge, c["out_hidden_size"], post_shuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(hidden, self.merge, c["out_hidden_size"], True)
                                                   for _ in self.deepstack_indexes)
        theta = (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        quarter = hidden // self.num_heads // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter),
                             persistent=False)
        self.to(dtype=dtype, device=device)
        self.inv_freq = self.inv_freq.float()

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> ImageEmbedding:
        """One image's placeholder embeddings (and DeepStack features).

        Args:
            pixel_values: [t * h * w, patch_dim], the image processor's rows for this image.
            grid_thw: its patch grid (temporal, height, width).
        Returns:
            ``ImageEmbedding`` with ``t * h * w / merge**2`` rows.
        """
        t, h, w = grid_thw
        weight = self.patch_embed.proj.weight
        x = F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.patch_embed.proj.bias)
        x = x + self._positions(h, w).repeat(t, 1).to(x.dtype)
        cos, sin = self._rotary(h, w, t)
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, h * w)
            if index in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(index)](x))
        return ImageEmbedding(self.merger(x), tuple(deepstack))

    def _merge_order(self, grid: torch.Tensor) -> torch.Tensor:
        """[h, w, ...] in raster order -> [h * w, ...] in merge-block order."""
        h, w = grid.shape[:2]
        m = self.merge
        return grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2).reshape(h * w, *grid.shape[2:])

    def _positions(self, h: int, w: int) -> torch.Tensor:  # [h * w, hidden]
        table = self.pos_embed.weight.float().t().reshape(1, -1, self.side, self.side)
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
        return self._merge_order(grid.permute(1, 2, 0))

    def _rotary(self, h: int, w: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:  # each [t*h*w, 1, head_dim]
        device = self.inv_freq.device
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        hw = self._merge_order(torch.stack([rows, cols], dim=-1)).repeat(t, 1)  # [t*h*w, 2]
        freqs = hw[..., None].float() * self.inv_freq  # [n, 2, quarter/2]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()

    def weight_targets(self) -> dict:
        """Hugging Face names under ``model.visual.`` -> (parameter, everything)."""
        return {name: (param, slice(None)) for name, param in self.named_parameters()}
