"""What a vision-language model declares and takes beside token ids: its ``VisionSpec`` and one
step's ``MultiModalBatch``.

A family with a vision tower (``models/qwen3_vl.py``) sets ``ModelConfig.vision`` to a
``VisionSpec``: the placeholder token an image expands into, how many placeholders an image
gets (``num_image_tokens``, the model's own rule, as its Hugging Face processor counts them),
the Hugging Face image processor that prepares pixels (``image_processor``), and its rotary
kind (M-RoPE sections, or none). The engine's input processor reads it; the runner hands the
model a ``MultiModalBatch`` per step.

``MultiModalBatch`` invariants:
- ``rows`` are flat rows of this step's tokens (the runner's ``_FlatBatch`` order), each a
  placeholder token whose input embedding is replaced by the matching row of ``embeds``;
  rows are distinct and ``embeds.shape[0] == len(rows)``;
- ``deepstack`` (Qwen3-VL): one ``[len(rows), hidden]`` tensor per early decoder layer, added
  to that layer's output at ``rows`` (empty for a model without it);
- ``mrope_positions``: ``[3, num_tokens]`` (temporal, height, width) positions of every token
  of the step, or None (the step's 1-D positions are the rotary positions).

The engine's torch-free rooms (the core, ``engine/kv``) never import this module; the runner does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language family's multimodal rules (``ModelConfig.vision``).

    Attributes:
        family: the family's name (``"qwen3_vl"``, ``"qwen3_5"``), for messages.
        image_token_id: the placeholder token; each one in a prompt stands for one image and
            expands into ``num_image_tokens`` copies.
        spatial_merge_size: patches merged per side into one placeholder token.
        mrope_section: M-RoPE's (temporal, height, width) split of the rotary half-dimension,
            interleaved (Qwen3-VL, Qwen3.5); empty: plain 1-D rotary.
        image_processor: the Hugging Face image processor's class name (its PIL variant: no
            torchvision).
        processor_defaults: its settings when the folder has no preprocessor_config.json.
        vision_config: the checkpoint's vision tower settings (the raw config.json entry).
        tokens_per_image: a fixed number of placeholder tokens per image (Gemma 3's
            ``mm_tokens_per_image``); 0: the count follows the image's patch grid (Qwen).
        begin_token_id, end_token_id: tokens wrapped around an image's placeholders (Gemma 3's
            ``<start_of_image>`` / ``<end_of_image>``, with a ``"\\n\\n"`` token outside each, as its
            processor writes them); None: no wrapping (Qwen's prompt holds them itself).
        is_bidirectional: an image's placeholder tokens attend to each other both ways (Gemma 3:
            a query inside an image sees keys up to the image's last position; Gemma 4: on its
            sliding layers only, the model drops the limits on the others), so a prefill chunk
            never splits an image.
        prompt_token: the token a prompt holds once per image when the model wraps its images but
            the prompt holds the placeholder itself (Gemma 4's ``<|image|>``); None: see
            ``prompt_token_id``.
        wrap_newlines: a wrapped image has a ``"\\n\\n"`` run outside each wrap token (Gemma 3's
            processor); False: the wrap tokens only (Gemma 4's ``<|image>`` ... ``<image|>``).
        counted_by_processor: the number of placeholder tokens varies per image and is the image
            processor's ``num_soft_tokens_per_image`` (Gemma 4's aspect-ratio-preserving resize).
    """

    family: str
    image_token_id: int
    spatial_merge_size: int
    mrope_section: tuple[int, ...]
    image_processor: str
    processor_defaults: dict = field(default_factory=dict)
    vision_config: dict = field(default_factory=dict)
    tokens_per_image: int = 0
    begin_token_id: Optional[int] = None
    end_token_id: Optional[int] = None
    is_bidirectional: bool = False
    prompt_token: Optional[int] = None
    wrap_newlines: bool = True
    counted_by_processor: bool = False

    @property
    def prompt_token_id(self) -> int:
        """The token a prompt holds once per image: ``prompt_token`` when set (Gemma 4's
        ``<|image|>``), else ``begin_token_id`` when the model wraps its images (Gemma 3's
        ``<start_of_image>``), else ``image_token_id`` (Qwen's ``<|image_pad|>``)."""
        if self.prompt_token is not None:
            return self.prompt_token
        return self.begin_token_id if self.begin_token_id is not None else self.image_token_id

    def num_image_tokens(self, grid_thw: Optional[tuple[int, int, int]]) -> int:
        """Placeholder tokens of one image: ``tokens_per_image`` when the model has a fixed count
        (Gemma 3), else Qwen's rule for the patch grid ``grid_thw``: ``t * h * w / merge_size**2``."""
        if self.tokens_per_image:
            return self.tokens_per_image
        t, h, w = grid_thw
        return t * h * w // (self.spatial_merge_size**2)


@dataclass
class ImageEmbedding:
    """One image's encoder output: what the encoder cache keeps per content hash."""

    embeds: torch.Tensor  # [num_image_tokens, hidden]
    deepstack: tuple[torch.Tensor, ...] = ()  # per early decoder layer, each [num_image_tokens, hidden]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


@dataclass
class MultiModalBatch:
    """One step's image embeddings and positions (see the module docstring)."""

    rows: torch.Tensor  # [k] int64, flat rows of the step's tokens
    embeds: torch.Tensor  # [k, hidden]
    deepstack: tuple[torch.Tensor, ...] = ()  # per early layer, [k, hidden]
    mrope_positions: Optional[torch.Tensor] = None  # [3, num_tokens] int64


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, ...]) -> torch.Tensor:
    """Per-token rotary table of interleaved M-RoPE (transformers' Qwen3-VL ``recomposition_frequencies``).

    Frequency ``j`` of the half-dimension turns with the height position when ``j % 3 == 1``
    and ``j < 3 * section[1]``, with the width position when ``j % 3 == 2`` and
    ``j < 3 * section[2]``, else with the temporal one.

    Args:
        positions: [3, num_tokens] int64 (temporal, height, width).
        inv_freq: [rotary_dim // 2] float32.
        section: the (t, h, w) split.
    Returns:
        [num_tokens, rotary_dim] float32: cos then sin, the layout of ``make_cos_sin_cache``
        (so ``kernels.apply_rotary`` reads row ``i`` for token ``i``).
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [3, T, half]
    half = inv_freq.shape[0]
    axis = torch.zeros(half, dtype=torch.int64, device=positions.device)
    j = torch.arange(half, device=positions.device)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    chosen = freqs.gather(0, axis.view(1, 1, half).expand(1, freqs.shape[1], half))[0]  # [T, half]
    return torch.cat((chosen.cos(), chosen.sin()), dim=-1)



def text_and_vision_sections(raw: dict, text_class: str, vision_class: str) -> tuple[dict, dict]:
    """A vision-language ``config.json``'s ``text_config`` and ``vision_config``, each completed
    with transformers' defaults as transformers reads them (released checkpoints name only what
    differs: no head counts, no vocabulary size; as written when transformers is not installed),
    the text section given the top level's ``tie_word_embeddings`` and, where it left them to
    defaults, ``bos_token_id`` / ``eos_token_id``. The caller checked both sections are dicts."""
    try:
        import transformers
    except ImportError:  # pragma: no cover - the vision extra installs it
        text, vision = dict(raw["text_config"]), dict(raw["vision_config"])
    else:
        text = getattr(transformers, text_class)(**raw["text_config"]).to_dict()
        vision = getattr(transformers, vision_class)(**raw["vision_config"]).to_dict()
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    for key in ("bos_token_id", "eos_token_id"):  # the top level's, where the text section left them to defaults
        if key in raw and key not in raw["text_config"]:
            text[key] = raw[key]
    return text, vision
