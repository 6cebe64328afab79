"""The checkpoint's own 4-bit weights: Q4_1 blocks read as they are, the int4 kernel's mapping, tiny GGUF files
of several types (loaded or refused by name), SmolLM2 int4 against its float32 self, and the CLI's --precision."""
from __future__ import annotations

import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import STORY_PROMPT, TINY_GGUF, llama_permute, write_tiny_gguf

from minillm import generate, load_pretrained
from minillm.checkpoints.gguf import read_gguf, split_q4_1, split_q8_0, unpermute_rope_rows
from minillm.checkpoints.hf import load_state_dict_into
from minillm.fast.blockdot import BlockLinear
from minillm.fast.int4 import (
    RAW_TYPES,
    Int4Linear,
    Int8AsInt4Linear,
    dequantize_int4,
    int4_model,
    int4pack_problem,
    kernels_used,
    load_int4,
    pack_nibbles,
    scales_and_zeros,
    unpack_nibbles,
)
from minillm.fast.precision import PRECISIONS, load_precision
from minillm.fast.quant import MatVecLinear, greedy_match, streamed_bytes
from minillm.model import empty_model

pytestmark = pytest.mark.slow  # the C++ block kernel and SmolLM2

T = gguf.GGMLQuantizationType
BF16_ULP = 2 ** -8


def q4_1_groups(out_features: int, in_features: int, seed: int = 0):
    """A random weight through gguf's own Q4_1 quantizer: its blocks, and their dequantized float32 values."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)).numpy()
    blocks = gguf.quants.quantize(w, T.Q4_1)  # (out, in / 32 * 20) uint8
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks, T.Q4_1))


# --- the blocks and the mapping ---------------------------------------------------------------------------

def test_split_blocks_gives_gguf_s_own_dequantized_values():
    blocks, expected = q4_1_groups(8, 96)
    q, d, m = split_q4_1(blocks)
    assert q.dtype == torch.uint8 and q.shape == (8, 96) and int(q.max()) <= 15 and d.shape == m.shape == (8, 3)
    assert torch.equal(d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1), expected)
    w = torch.randn(4, 64).numpy()
    blocks8 = gguf.quants.quantize(w, T.Q8_0)
    q8, d8 = split_q8_0(blocks8)
    assert q8.dtype == torch.int8
    assert torch.equal(d8.repeat_interleave(32, 1) * q8, torch.from_numpy(gguf.quants.dequantize(blocks8, T.Q8_0)))


def test_scale_is_d_and_zero_is_m_plus_8d():
    """The kernel's weight is (q - 8) * scale + zero; Q4_1's is d * q + m: scale = d, zero = m + 8 d."""
    d, m = torch.tensor([[0.5, 0.25]]), torch.tensor([[-1.0, 2.0]])
    sz = scales_and_zeros(d, m, torch.float32)
    assert sz.shape == (2, 1, 2) and sz[:, 0].tolist() == [[0.5, 3.0], [0.25, 4.0]]
    q = torch.tensor([[0] * 32 + [15] * 32])
    assert dequantize_int4(q, sz)[0, [0, 32]].tolist() == [-1.0, 0.25 * 15 + 2.0]


def test_nibbles_round_trip():
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    assert pack_nibbles(q).shape == (16, 32) and torch.equal(unpack_nibbles(pack_nibbles(q)), q)


def test_the_cpu_int4_kernel_is_there_and_reads_the_packed_weight_as_assumed():
    assert int4pack_problem("cpu") is None


@pytest.mark.parametrize("kernel", ["int4pack", "dequant"])
def test_int4_linear_computes_x_times_the_q4_1_weight(kernel):
    """bfloat16 activations, scales and output: each rounded to 8 significant bits, so a few ulps of the
    largest output are the tolerance (the kernel accumulates in float32)."""
    blocks, weight = q4_1_groups(48, 96, seed=1)
    layer = Int4Linear.from_groups(*split_q4_1(blocks), kernel=kernel)
    assert layer.kernel == kernel
    for shape in [(1, 1, 96), (2, 5, 96)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).bfloat16()
        expected = F.linear(x.double(), weight.double())
        out = layer(x)
        assert out.shape == (*shape[:-1], 48) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=8 * BF16_ULP * expected.abs().max().item())
    torch.testing.assert_close(layer.dequantized(torch.float32), weight, rtol=0, atol=2 * BF16_ULP * 4)


def test_auto_falls_back_to_dequant_and_says_why():
    blocks, _ = q4_1_groups(40, 64)  # 40 rows: not a multiple of 16
    layer = Int4Linear.from_groups(*split_q4_1(blocks))
    assert layer.kernel == "dequant" and "out_features=40" in layer.reason
    with pytest.raises(ValueError, match="kernel='int4pack' cannot run here: out_features=40"):
        Int4Linear.from_groups(*split_q4_1(blocks), kernel="int4pack")
    assert Int4Linear.from_groups(*split_q4_1(q4_1_groups(48, 64)[0])).kernel == "int4pack"


def test_q8_0_as_two_4_bit_planes_is_exact():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)).numpy()
    blocks = gguf.quants.quantize(w, T.Q8_0)
    q, d = split_q8_0(blocks)
    plain, layer = Int8AsInt4Linear(q, d, kernel="dequant"), Int8AsInt4Linear(q, d)
    bf16_d = d.bfloat16().float().repeat_interleave(32, 1)
    assert torch.equal(plain.dequantized(torch.float32), bf16_d * q)  # the planes add up to d q, exactly
    assert layer.kernel == "int4pack"
    x = torch.randn(3, 64).bfloat16()
    expected = F.linear(x.double(), torch.from_numpy(gguf.quants.dequantize(blocks, T.Q8_0)).double())
    torch.testing.assert_close(layer(x).double(), expected, rtol=0, atol=8 * BF16_ULP * expected.abs().max().item())


# --- tiny GGUF files ----------------------------------------------------------------------------------------

def float32_model(path):
    """Today's path: every tensor dequantized to float32."""
    checkpoint = read_gguf(path)
    return load_state_dict_into(empty_model(checkpoint.config), checkpoint.state_dict).eval().requires_grad_(False)


@pytest.mark.parametrize("kernel", ["blockdot", "int4pack"])
@pytest.mark.parametrize("tie", [False, True])
def test_a_mixed_file_loads_q4_1_and_q8_0_as_blocks_and_f16_as_float(tmp_path, tie, kernel):
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, {"blk.0.attn_v.weight": T.Q8_0, "blk.1.ffn_down.weight": T.F16}, tie=tie)
    checkpoint = read_gguf(path, RAW_TYPES)
    assert checkpoint.raw["model.layers.0.self_attn.q_proj.weight"].type == "Q4_1"
    assert "model.layers.0.self_attn.q_proj.weight" not in checkpoint.state_dict  # no float32 detour
    assert "model.embed_tokens.weight" in checkpoint.state_dict  # a lookup table needs floats
    model, reference = int4_model(checkpoint, kernel=kernel), float32_model(path)
    layers = model.model.layers
    q4_1, q8_0 = (BlockLinear, BlockLinear) if kernel == "blockdot" else (Int4Linear, Int8AsInt4Linear)
    assert isinstance(layers[0].self_attn.q_proj, q4_1)
    assert isinstance(layers[0].self_attn.v_proj, q8_0)
    assert isinstance(layers[1].mlp.down_proj, MatVecLinear)
    assert isinstance(model.lm_head, q8_0 if tie else q4_1)
    if kernel == "blockdot":
        assert layers[0].self_attn.v_proj.block_type == "Q8_0" and model.dtype == torch.float32
    # the un-permuted rows of the blocks are the float path's un-permuted rows
    for proj in ("q_proj", "k_proj"):
        ours = getattr(layers[1].self_attn, proj).dequantized(torch.float32)
        theirs = getattr(reference.model.layers[1].self_attn, proj).weight
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2 * BF16_ULP * float(theirs.abs().max()))
    ids = torch.randint(0, TINY_GGUF.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours, theirs = model(ids).float(), reference(ids)
    assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()  # bfloat16 or int8 activations, 2 layers
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_the_raw_rows_of_q_and_k_are_unpermuted_whole(tmp_path):
    path = tmp_path / "q.gguf"
    weights = write_tiny_gguf(path, {})
    raw = read_gguf(path, ("Q4_1",)).raw["model.layers.0.self_attn.q_proj.weight"]
    q, d, m = split_q4_1(raw.blocks)
    values = d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)
    expected = gguf.quants.dequantize(gguf.quants.quantize(weights["blk.0.attn_q.weight"], T.Q4_1), T.Q4_1)
    assert np.array_equal(values.numpy(), expected)
    assert np.array_equal(unpermute_rope_rows(llama_permute(expected, TINY_GGUF.n_heads), TINY_GGUF.n_heads), expected)


@pytest.mark.parametrize("kind, words", [
    (T.Q5_0, ["Q5_0", "model.layers.0.self_attn.q_proj.weight (Q5_0)", "'float32'"]),
    (T.Q8_0, ["4-bit (Q4_1)", "has none", "Q8_0"]),
    (T.F16, ["4-bit (Q4_1)", "has none", "F16"]),
])
def test_int4_refuses_a_file_without_its_own_4_bit_weights_by_name(tmp_path, kind, words):
    """A file of other types loads through today's float path, and int4 says which tensor stops it."""
    path = tmp_path / f"{kind.name}.gguf"
    weights = write_tiny_gguf(path, {}, default=kind)
    reference = float32_model(path)
    w = weights["blk.1.ffn_up.weight"]
    atol = {"Q5_0": 0.1, "Q8_0": 0.02, "F16": 1e-3}[kind.name]
    torch.testing.assert_close(reference.model.layers[1].mlp.up_proj.weight, torch.from_numpy(w), rtol=0, atol=atol)
    with pytest.raises(ValueError) as info:
        int4_model(read_gguf(path, RAW_TYPES))
    for word in words:
        assert word in str(info.value)


def test_raw_types_other_than_the_kernel_s_are_refused(tmp_path):
    path = tmp_path / "x.gguf"
    write_tiny_gguf(path, {})
    with pytest.raises(ValueError, match=r"raw_types=\['Q5_0'\]"):
        read_gguf(path, ("Q5_0",))
    with pytest.raises(ValueError, match="unknown precision 'int3'"):
        load_precision(path, "int3")


# --- SmolLM2 ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    float32, tokenizer = load_pretrained("smollm2-135m-instruct")
    int4, _ = load_int4("smollm2-135m-instruct")
    return float32, int4, tokenizer


def test_smollm2_int4_runs_every_matmul_through_the_block_kernel(smollm2):
    float32, int4, _ = smollm2
    assert kernels_used(int4) == {"blockdot (Q4_1 blocks, int8 activations)": 30 * 7,
                                  "blockdot (Q8_0 blocks, int8 activations)": 1}
    assert isinstance(int4.lm_head, BlockLinear) and int4.dtype == torch.float32
    # Q4_1 is 20 bytes a block of 32 (0.625 a weight), the Q8_0 head 34 (1.0625); the norms float32
    n_layer = sum(p.numel() for name, p in float32.named_parameters() if "layers" in name and "norm" not in name)
    head = float32.config.vocab_size * float32.config.d_model
    norms = (2 * 30 + 1) * 576
    assert streamed_bytes(int4) == n_layer * 20 // 32 + head * 34 // 32 + 4 * norms
    assert 95e6 < streamed_bytes(int4) < 0.2 * streamed_bytes(float32)


@pytest.mark.parametrize("kernel", ["blockdot", "int4pack"])
def test_smollm2_int4_logits_agree_with_the_dequantized_float32_model(smollm2, kernel):
    """The same weights; the activations differ. The block kernel rounds them to int8 per 32 (float32
    elsewhere): on logits of spread ~6 the mean |difference| was 0.16 and the max 1.06 (llama.cpp's own on
    these tokens: 0.16 and 1.04). PyTorch's int4 kernel carries bfloat16, 8 significant bits, through 30
    layers (d and m rounded to bfloat16 too): 0.14 and 0.95. Tolerance: mean < 0.25, max < 2."""
    float32, _, tokenizer = smollm2
    int4 = smollm2[1] if kernel == "blockdot" else load_int4("smollm2-135m-instruct", kernel=kernel)[0]
    from minillm.book.data import EVAL_TEXT

    ids = torch.tensor([tokenizer.encode(EVAL_TEXT)])[:, :64]
    with torch.inference_mode():
        reference, logits = float32(ids), int4(ids).float()
    error = (logits - reference).abs()
    assert torch.isfinite(logits).all() and error.mean() < 0.25 and error.max() < 2.0
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_smollm2_int4_greedy_tokens_over_128_steps(smollm2):
    """Free-running, the two split at the first near tie and then write different (fine) stories; measured at
    one thread: the first 5 of 128 agree, and at token 5 float32's two candidates are 0.10 apart, under the
    0.25 that the activations' rounding flips (at two threads float32's own sums differ and the split came
    at token 16, 0.005 apart). Given float32's own prefix, int4 picks float32's token at 124 of the 128 steps
    (>= 95% asserted; PyTorch's int4 kernel, bfloat16 activations: 127)."""
    float32, int4, tokenizer = smollm2
    prompt = tokenizer.encode(STORY_PROMPT)
    reference = generate(float32, prompt, 128, eos_token_id=None)
    tokens = generate(int4, prompt, 128, eos_token_id=None)
    first = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), 128)
    if first < 128:
        with torch.inference_mode():
            logits = float32(torch.tensor([prompt + reference[:first]]))[0, -1]
        gap = abs(float(logits[reference[first]] - logits[tokens[first]]))
        assert gap < 0.25, (first, gap)  # demo.NEAR_TIE[torch.bfloat16]
    assert first >= 4
    assert greedy_match(int4, prompt, reference) >= 0.95
    assert "village" in tokenizer.decode(tokens) or sum(c.isalpha() for c in tokenizer.decode(tokens)) > 300


def test_load_precision_offers_the_four_precisions(smollm2):
    """The int4 model answers as float32 does. Not free-running: float32's first token is a near tie ('The'
    25.33, 'L' 25.24), and on an Intel Xeon (AMX) int4 picks 'L' and writes French, on an AMD EPYC 'The'.
    Given float32's reply as its prefix, int4 ranks first all of its 8 tokens but that tie."""
    assert list(PRECISIONS) == ["float32", "bfloat16", "int8", "int4"]
    float32, _, _ = smollm2
    model, tokenizer = load_precision("smollm2-135m-instruct", "int4")
    assert isinstance(model.lm_head, BlockLinear)
    prompt = tokenizer.encode_chat("What is the capital of France?")
    reply = generate(float32, prompt, 24, eos_token_id=tokenizer.eos_token_id)
    assert "Paris" in tokenizer.decode(reply)
    assert greedy_match(model, prompt, reply) >= 1 - 1.5 / len(reply)  # at most one miss


# --- the CLI ------------------------------------------------------------------------------------------------

def test_cli_precision_int4_streams_text_and_prints_timings():
    result = subprocess.run([sys.executable, "-m", "minillm", "--precision", "int4", "--max-new-tokens", "16",
                             "--threads", "1", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "device: cpu, precision: int4" in out and "threads: 1" in out
    assert "210 layers blockdot (Q4_1 blocks, int8 activations), 1 layer blockdot (Q8_0 blocks" in out
    assert re.search(r"^--- end: 16 tokens, stopped at --max-new-tokens 16 ---$", out, re.MULTILINE), out
    row = re.search(r"^cached .*?\)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$", out, re.MULTILINE)
    assert row and min(map(float, row.groups())) > 0, out
    assert "there was" in out  # the story begins as float32's does
