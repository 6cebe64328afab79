"""Read a LLaMA checkpoint stored as GGUF (llama.cpp's file format) into minillm's names and dtype.

A GGUF file holds the config and the tokenizer as metadata, and each weight either in float32 or in
blocks of a quantized type (SmolLM2's file: Q4_1 for the layers, Q8_0 for the embedding). Reading it
takes three translations:

* names: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (Hugging Face's, which
  are minillm's);
* values: quantized blocks are dequantized to float32 (the ``gguf`` package does it, one block type at
  a time), or, for the types asked for (``read_gguf(path, raw_types=("Q4_1", "Q8_0"))``), kept as the
  file's raw blocks (``RawTensor``), which ``split_q4_1`` and ``split_q8_0`` read as integers and scales;
* layout: llama.cpp's converter permuted the rows of ``q_proj`` and ``k_proj`` so that its RoPE kernel
  can rotate adjacent pairs (x0, x1), (x2, x3), ...; minillm (like Hugging Face) rotates the two halves
  of each head, so the permutation is undone here, per head.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
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
    raw: dict[str, RawTensor] = field(default_factory=dict)  # the tensors kept as blocks (``raw_types``)


# Bytes of one block of 32 weights: Q4_1 = float16 d, float16 m, 16 bytes of nibbles; Q8_0 = float16 d, 32 int8.
BLOCK_WEIGHTS = 32
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


@dataclass
class RawTensor:
    """A weight as the file stores it: each row's blocks of 32 weights, bytes untouched.

    ``blocks``: (out, in // 32 * BLOCK_BYTES[type]) uint8, rows in minillm's order (q/k un-permuted)."""

    type: str  # "Q4_1" or "Q8_0"
    shape: tuple[int, int]  # (out, in), as torch expects
    blocks: np.ndarray


def split_q4_1(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks (out, G * 20) uint8 -> q (out, 32 G) uint8 in 0..15, d and m (out, G) float32.

    Weight j of a block is ``d * q[j] + m``. A block is d (float16), m (float16), then 16 bytes: byte i
    holds weight i in its low nibble and weight i + 16 in its high nibble (ggml's ``block_q4_1``).
    """
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(rows, -1, BLOCK_BYTES["Q4_1"])  # (out, G, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]  # (out, G)
    m = b[..., 2:4].copy().view(np.float16)[..., 0]
    nibbles = b[..., 4:]  # (out, G, 16)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)  # (out, 32 G)
    return torch.from_numpy(q), torch.from_numpy(d.astype(np.float32)), torch.from_numpy(m.astype(np.float32))


def split_q8_0(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (out, G * 34) uint8 -> q (out, 32 G) int8 and d (out, G) float32; weight = d * q."""
    rows = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(rows, -1, BLOCK_BYTES["Q8_0"])  # (out, G, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]  # (out, G)
    q = b[..., 2:].copy().view(np.int8).reshape(rows, -1)  # (out, 32 G)
    return torch.from_numpy(q), torch.from_numpy(d.astype(np.float32))


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


def read_gguf(path: str | Path, raw_types: tuple[str, ...] = ()) -> GGUFCheckpoint:
    """Read and dequantize a LLaMA GGUF file (float32 weights on the CPU).

    ``raw_types``: block types (of ``BLOCK_BYTES``) whose tensors are kept as the file's blocks in
    ``checkpoint.raw`` and not dequantized; the token embedding, a lookup table, is dequantized as well.
    """
    gguf = _gguf_module()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the gguf package raises ValueError or struct errors on a bad header
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {error}") from error
    unknown = sorted(set(raw_types) - BLOCK_BYTES.keys())
    if unknown:
        raise ValueError(f"raw_types={unknown}: only {sorted(BLOCK_BYTES)} blocks can be kept as they are")
    config = config_from_gguf(reader)
    state, types, raw = {}, {}, {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        types[name] = tensor.tensor_type.name
        if types[name] in raw_types:
            raw[name] = _raw_tensor(tensor, name, config)
            if name != "model.embed_tokens.weight":
                continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # numpy, GGUF shape reversed
        values = values.reshape([int(n) for n in reversed(tensor.shape)])  # (out, in) as torch expects
        if name.endswith("q_proj.weight"):
            values = unpermute_rope_rows(values, config.n_heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute_rope_rows(values, config.n_kv_heads)
        state[name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
    tokenizer = {key: _field(reader, f"tokenizer.ggml.{key}") for key in TOKENIZER_KEYS}
    tokenizer["chat_template"] = _field(reader, "tokenizer.chat_template")
    return GGUFCheckpoint(path, config, state, tokenizer, types, path.stat().st_size, raw)


def _raw_tensor(tensor, name: str, config: ModelConfig) -> RawTensor:
    """One tensor's blocks, copied out of the file, q/k rows un-permuted (whole rows of blocks move)."""
    shape = tuple(int(n) for n in reversed(tensor.shape))  # (out, in)
    if len(shape) != 2 or shape[1] % BLOCK_WEIGHTS:
        raise ValueError(f"{name}: shape {shape} is no matrix of whole {BLOCK_WEIGHTS}-weight blocks")
    blocks = np.array(tensor.data, dtype=np.uint8).reshape(shape[0], -1)  # (out, bytes per row)
    if name.endswith("q_proj.weight"):
        blocks = unpermute_rope_rows(blocks, config.n_heads)
    elif name.endswith("k_proj.weight"):
        blocks = unpermute_rope_rows(blocks, config.n_kv_heads)
    return RawTensor(tensor.tensor_type.name, shape, np.ascontiguousarray(blocks))
