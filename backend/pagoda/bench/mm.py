"""``pagoda bench mm``: what an image costs a request's time to first token, and what the caches save.

On a vision-language model through the offline engine (greedy, one output token per request,
each request alone), four kinds of request, each TTFT the median over ``--repeats`` rounds:

- ``text only``: the prompt with its image left out (for scale);
- ``cold``: a new text with a new image: the image processor, the encoder and the whole prefill;
- ``encoder hit``: a new text with an image sent before: the encoder is skipped (its output comes
  from the encoder cache, keyed by the image's content), the prompt is still prefilled;
- ``prefix hit``: the same text and image again: the prompt's full blocks come from the prefix
  cache (keyed by the image's content too), so neither the encoder nor their prefill runs.

Each case checks it was what it claims (the engine's encoder-run and prefix-hit counters), so a
cache that stopped working fails the command instead of printing a flattering number. Then the
encoder alone: images per second through the model's vision tower (``encode_image``) on
``--images`` preprocessed images of ``--image-size`` pixels a side, after one warm-up.

``--model`` is a vision-language folder (Qwen3-VL, Qwen3.5); without it a Qwen3-VL folder of
``--preset`` sizes is written to a temporary directory with seeded random weights
(``load_format="dummy"``) and the default model's tokenizer: ``tiny`` (the tests' sizes) or
``2b-tower`` (Qwen3-VL-2B's vision tower, 24 blocks of width 1024, on a 4-layer decoder of width
512: the encoder is real-sized, the decoder is not).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from pagoda.bench.common import machine_line

IMAGE, VISION_START, VISION_END = 49000, 49001, 49002  # spare ids of the default model's vocabulary
_VISION = dict(patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304)
PRESETS = {
    "tiny": (dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, mrope=[2, 3, 3]),
             dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  deepstack_visual_indexes=[0])),
    "2b-tower": (dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, mrope=[8, 12, 12]),
                 dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=512,
                      deepstack_visual_indexes=[5, 11, 17])),
}


def write_preset(folder: Path, preset: str) -> Path:
    """A Qwen3-VL ``config.json`` of ``PRESETS[preset]``, its image processor's config and the
    default model's tokenizer in ``folder`` (no weights: the engine draws them)."""
    import transformers

    from pagoda.models.gguf_import import ensure_default_model

    text, vision = (dict(d) for d in PRESETS[preset])
    mrope = text.pop("mrope")
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
                         **text),
        vision_config={**_VISION, **vision}, image_token_id=IMAGE, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, video_token_id=49003, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, architectures=["Qwen3VLForConditionalGeneration"])
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    transformers.Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                                          max_pixels=1024 * 1024).save_pretrained(folder)
    default = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default / name).exists():
            shutil.copy(default / name, folder / name)
    return folder


def image(seed: int, size: int) -> Any:
    """A PIL RGB image of smooth random colour blobs, ``size`` pixels a side."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((4, 4, 3)) * 255).astype("uint8")).resize((size, size), Image.BILINEAR)


def _ttft(engine: Any, rid: str, prompt: list[int], images: list) -> float:
    from pagoda.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    data = {"prompt_token_ids": prompt, **({"multi_modal_data": {"image": images}} if images else {})}
    engine.add_request(rid, data, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def measure(engine: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """TTFT seconds per case and round (module docstring); raises RuntimeError when a case
    did not hit (or miss) the cache it names."""
    times: dict[str, list[float]] = {"text only": [], "cold": [], "encoder hit": [], "prefix hit": []}
    tail = list(range(2000, 2000 + args.text_tokens))
    for r in range(args.repeats + 1):  # round 0 warms up and is not kept
        picture = image(1000 + r, args.image_size)
        text = [1] + [3000 + (r * 7 + i) % 20000 for i in range(args.text_tokens)]
        cases = (("text only", [1, 6] + text[1:] + tail, []), ("cold", text + [IMAGE] + tail, [picture]),
                 ("encoder hit", [1, 5] + text[1:] + [IMAGE] + tail, [picture]),
                 ("prefix hit", text + [IMAGE] + tail, [picture]))
        for name, prompt, images in cases:
            before = engine.get_stats()
            seconds = _ttft(engine, f"{name}-{r}", prompt, images)
            after = engine.get_stats()
            _check(name, after.mm_encoder_runs - before.mm_encoder_runs,
                   after.prefix_cache_hits - before.prefix_cache_hits)
            if r:
                times[name].append(seconds)
    return times


def _check(name: str, encoded: int, hit_tokens: int) -> None:
    expected = {"text only": (0, None), "cold": (1, 0), "encoder hit": (0, 0), "prefix hit": (0, None)}[name]
    if encoded != expected[0] or (expected[1] is not None and hit_tokens != expected[1]) or \
            (name == "prefix hit" and hit_tokens <= 0):
        raise RuntimeError(f"bench mm: the {name!r} request encoded {encoded} image(s) and hit {hit_tokens} "
                           "prefix tokens: not the case it measures")


def encoder_rate(engine: Any, args: argparse.Namespace) -> tuple[float, int]:
    """(images per second through the vision tower, placeholder tokens per image)."""
    import torch

    inputs = engine.input_processor.images  # the request builder's own (engine/image_inputs.py)
    model = engine.executor.runner.model
    prepared = [inputs.prepare(i, image(5000 + i, args.image_size)) for i in range(args.images + 1)]
    with torch.inference_mode():
        model.encode_image(prepared[0][1])  # warm-up
        start = time.perf_counter()
        for _, data, _ in prepared[1:]:
            model.encode_image(data)
    return args.images / (time.perf_counter() - start), prepared[0][2]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pagoda bench mm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a vision-language folder (default: a random Qwen3-VL of --preset sizes)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="2b-tower")
    p.add_argument("--image-size", type=int, default=448, help="pixels a side of each image")
    p.add_argument("--text-tokens", type=int, default=64, help="prompt tokens before and after the image, each")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--images", type=int, default=8, help="images through the encoder for its rate")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    import torch

    from pagoda.engine.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    temp = None if args.model else tempfile.mkdtemp(prefix="pagoda-bench-mm-")
    folder = args.model or str(write_preset(Path(temp), args.preset))
    engine = LLMEngine(EngineConfig(model=folder, load_format="dummy" if temp else "safetensors",
                                    max_model_len=4096, max_num_batched_tokens=4096))
    try:
        times = measure(engine, args)
        rate, tokens = encoder_rate(engine, args)
    finally:
        engine.shutdown()
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    cold = statistics.median(times["cold"])
    print(f"pagoda bench mm: {args.model or args.preset + ' (random weights)'}, {args.image_size}x{args.image_size} "
          f"images ({tokens} tokens each), {2 * args.text_tokens} text tokens; {machine_line()}")
    print(f"{'request':<12} {'TTFT ms (median)':>17} {'vs cold':>8}")
    for name, values in times.items():
        print(f"{name:<12} {1e3 * statistics.median(values):>17.1f} {statistics.median(values) / cold:>7.2f}x")
    print(f"encoder      {rate:.2f} images/s ({args.images} images, one at a time)")
    if args.json:
        Path(args.json).write_text(json.dumps({"ttft_s": times, "encoder_images_per_s": rate,
                                               "tokens_per_image": tokens, "args": vars(args)}, indent=2))
    return 0
