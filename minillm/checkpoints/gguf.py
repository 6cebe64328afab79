"""Read a LLaMA checkpoint stored as GGUF (llama.cpp's file format) into minillm's names and dtype.

A GGUF file holds the config and the tokenizer as metadata, and each weight either in float32 or in
blocks of a quantized type (SmolLM2's file: Q4_1 for the layers, Q8_0 for the embedding). Reading it
takes three translations:

* names: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (Hugging Face's, which
  are minillm's);
* values: quantized blocks are dequantized to float32 (the ``gguf`` package does it, one block type at
  a time);
* layout: llama.cpp's converter permuted the rows of ``q_proj`` and ``k_proj`` so that its RoPE kernel
  can rotate adjacent pairs (x0, x1), (x2, x3), ...; minillm (like Hugging Face) rotates the two halves
  of each head, so the permutation is undone here, per head.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
TOKENIZER_KEYS = ("tokens", "token_type", "merges", "bos_token_id", "eos_token_id", "unknown_token_id",
                  "padding_token_id", "add_bos_token", "pre", "model")


@dataclass
class GGUFCheckpoint:
    """What one GGUF file holds, translated: the config, the weights, the tokenizer's metadata."""

    path: Path
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face names, float32, on the CPU
    tokenizer: dict  # the ``tokenizer.ggml.*`` fields without their prefix, plus ``chat_template``
    tensor_types: dict[str, str]  # Hugging Face name -> how the file stored it ("Q4_1", "F32", ...)
    file_bytes: int


def _gguf_module():
    try:
        import gguf
    except ImportError as error:
        raise ImportError("reading a .gguf file needs the 'gguf' package: pip install gguf "
                          "(or pip install 'minillm[pretrained]')") from error
    return gguf


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader) -> ModelConfig:
    """The ``llama.*`` metadata -> ModelConfig; another architecture or RoPE scaling is a ValueError."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{reader.data.filename}: general.architecture={arch!r}; minillm reads only "
                         "LLaMA-architecture GGUF files (general.architecture='llama')")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"llama.rope.scaling.type={scaling!r} is not supported; minillm implements plain RoPE")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    d_model = int(_field(reader, "llama.embedding_length"))
    head_dim = int(_field(reader, "llama.rope.dimension_count", d_model // n_heads))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(_field(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        d_ff=int(_field(reader, "llama.feed_forward_length")),
        max_seq_len=int(_field(reader, "llama.context_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
    )


def hf_name(gguf_name: str) -> str:
    """``blk.3.ffn_up.weight`` -> ``model.layers.3.mlp.up_proj.weight``; unknown names are a ValueError."""
    match = LAYER_PATTERN.fullmatch(gguf_name)
    if match and match.group(2) in LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}.weight"
    stem = gguf_name.removesuffix(".weight")
    if stem in GLOBAL_NAMES and gguf_name.endswith(".weight"):
        return f"{GLOBAL_NAMES[stem]}.weight"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a LLaMA model")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order for q/k: (pairs interleaved) -> (two halves).

    weight: (n_heads * head_dim, d_model). llama.cpp stores head rows as (r0, r_half, r1, r_half+1, ...).
    """
    rows, cols = weight.shape
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read and dequantize a LLaMA GGUF file (float32 weights on the CPU)."""
    gguf = _gguf_module()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the gguf package raises ValueError or struct errors on a bad header
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error
    config = config_from_gguf(reader)
    state, types = {}, {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # numpy, GGUF shape reversed
        values = values.reshape([int(n) for n in reversed(tensor.shape)])  # (out, in) as torch expects
        if name.endswith("q_proj.weight"):
            values = unpermute_rope_rows(values, config.n_heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute_rope_rows(values, config.n_kv_heads)
        state[name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
        types[name] = tensor.tensor_type.name
    tokenizer = {key: _field(reader, f"tokenizer.ggml.{key}") for key in TOKENIZER_KEYS}
    tokenizer["chat_template"] = _field(reader, "tokenizer.chat_template")
    return GGUFCheckpoint(path, config, state, tokenizer, types, path.stat().st_size)
