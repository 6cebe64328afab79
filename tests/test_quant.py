"""int8 weight-only quantization and the bfloat16 variant: exact arithmetic on small tensors, then the
real SmolLM2 against its float32 self (finite logits, loss, greedy text)."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import SMALL, random_ids

from minillm import KVCache, build_model, generate, get_config, load_pretrained
from minillm.analysis.arithmetic import quantized_weight_bytes, streamed_weight_bytes
from minillm.book.data import EVAL_TEXT
from minillm.fast.quant import (
    INT8PACK_IN_MULTIPLE,
    INT8PACK_MAX_ROWS,
    Int8Linear,
    MatVecLinear,
    dequantize_int8,
    greedy_match,
    int8pack_available,
    make_variant,
    mean_nll,
    onednn_bf16_pack_problem,
    onednn_packed_linear,
    quantize_int8,
    quantize_model,
    streamed_bytes,
)

BF16_ULP = 2 ** -8  # relative spacing of bfloat16 numbers near 1 (8 significant bits)


def test_quantize_int8_maps_each_row_max_to_127_and_rounds_to_nearest():
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0], [3.0, 1.5, -0.75, 0.1], [0.0, 0.0, 0.0, 0.0]])
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    torch.testing.assert_close(scales, torch.tensor([1 / 127, 3 / 127, 1.0]))
    assert q.tolist() == [[64, -127, 32, 0], [127, 64, -32, 4], [0, 0, 0, 0]]  # 63.5 -> 64, 4.23 -> 4


def test_quantization_error_is_at_most_half_a_step_per_entry():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    q, scales = quantize_int8(w)
    error = (dequantize_int8(q, scales, torch.float32) - w).abs()  # (64, 96)
    assert (error <= scales[:, None] / 2 + 1e-7).all()
    assert (q.abs().amax(dim=1) == 127).all()


@pytest.mark.parametrize("weight, error, words", [
    (torch.ones(4), ValueError, ["2-D", "(4,)"]),
    (torch.ones(2, 3, 4), ValueError, ["2-D", "(2, 3, 4)"]),
    (torch.ones(2, 2, dtype=torch.int32), TypeError, ["floating point", "torch.int32"]),
    (torch.tensor([[1.0, math.inf]]), ValueError, ["inf or nan"]),
    (torch.tensor([[1.0, math.nan]]), ValueError, ["inf or nan"]),
])
def test_quantize_int8_rejects_what_it_cannot_quantize(weight, error, words):
    with pytest.raises(error) as info:
        quantize_int8(weight)
    for word in words:
        assert word in str(info.value)


def test_int8pack_exists_on_this_cpu_for_the_compute_dtypes():
    """torch 2.13's CPU build has the kernel; the CPU results below depend on it."""
    assert all(int8pack_available("cpu", dtype) for dtype in (torch.float32, torch.bfloat16))


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 4 * BF16_ULP)])
def test_both_kernels_compute_x_times_the_dequantized_weight(dtype, rtol):
    generator = torch.Generator().manual_seed(1)
    linear = nn.Linear(96, 40, bias=False)
    nn.init.normal_(linear.weight, generator=generator)
    packed = Int8Linear.from_linear(linear, dtype, "int8pack")
    plain = Int8Linear.from_linear(linear, dtype, "dequant")
    weight = dequantize_int8(packed.q, packed.scales, torch.float64)  # (out, in)
    for shape in [(2, 3, 96), (1, INT8PACK_MAX_ROWS + 1, 96)]:  # decode-sized, then a prompt
        x = torch.randn(shape, generator=generator).to(dtype)  # (B, T, in)
        expected = F.linear(x.double(), weight)  # (B, T, out)
        for layer in (packed, plain):
            out = layer(x)
            assert out.shape == (*shape[:2], 40) and out.dtype == dtype
            torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                       atol=rtol * expected.abs().max().item())
    assert packed.kernel == "int8pack" and plain.kernel == "dequant"
    assert Int8Linear.from_linear(linear, dtype).kernel == "int8pack"  # auto picks the int8 kernel


def test_auto_kernel_falls_back_where_int8pack_cannot_run():
    linear = nn.Linear(60, 8, bias=False)  # 60 input features: not a multiple of 16
    assert Int8Linear.from_linear(linear, torch.bfloat16).kernel == "dequant"


@pytest.mark.parametrize("make, words", [
    (lambda: Int8Linear.from_linear(nn.Linear(60, 8, bias=False), torch.float32, "int8pack"),
     ["in_features=60", f"multiple of {INT8PACK_IN_MULTIPLE}", "kernel='dequant'"]),
    (lambda: Int8Linear.from_linear(nn.Linear(16, 8, bias=True), torch.float32), ["bias"]),
    (lambda: Int8Linear.from_linear(nn.Linear(16, 8, bias=False), torch.float32, "int4"),
     ["kernel='int4'", "int8pack", "dequant"]),
    (lambda: quantize_model(build_model(SMALL), "int8pack"), ["in_features=60"]),
    (lambda: quantize_model(quantize_model(build_model("tiny"))), ["no nn.Linear left", "already quantized"]),
    (lambda: make_variant(build_model("tiny"), "fp8"), ["'fp8'", "int8-dequant"]),
    (lambda: make_variant(build_model("tiny", dtype="bfloat16"), "int8"), ["float32", "torch.bfloat16"]),
])
def test_quantizing_rejects_what_it_does_not_support(make, words):
    with pytest.raises(ValueError) as info:
        make()
    for word in words:
        assert word in str(info.value)


def test_quantize_model_replaces_every_linear_and_keeps_the_compute_dtype():
    model = quantize_model(build_model("tiny", dtype="bfloat16"))
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * 7 + 1
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16  # lookups are not quantized


def test_make_variant_leaves_the_float32_model_as_it_was(tiny_model):
    before = {name: p.clone() for name, p in tiny_model.named_parameters()}
    variant = make_variant(tiny_model, "int8")
    assert isinstance(tiny_model.lm_head, nn.Linear) and tiny_model.dtype == torch.float32
    assert all(torch.equal(p, before[name]) for name, p in tiny_model.named_parameters())
    assert isinstance(variant.lm_head, Int8Linear)


@pytest.mark.parametrize("tie", [False, True])
def test_streamed_bytes_equal_the_arithmetic_of_minillm_memory(tie):
    config = get_config("tiny", tie_embeddings=tie)
    model = build_model(config)
    assert streamed_bytes(make_variant(model, "float32")) == streamed_weight_bytes(config, "float32")
    for name in ("bfloat16", "bfloat16-linear"):
        assert streamed_bytes(make_variant(model, name)) == streamed_weight_bytes(config, "bfloat16")
    int8 = quantized_weight_bytes(config, 8, scale_bytes=2, dtype="bfloat16")
    assert streamed_bytes(make_variant(model, "int8")) == streamed_bytes(make_variant(model, "int8-dequant")) == int8


def test_quantized_weight_bytes_by_hand():
    """LLaMA-7B: 6.74e9 weights, 6.61e9 of them in matmuls; int8 with a float16 scale per output row."""
    c = get_config("llama-7b")
    matmul = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 32000 * 4096
    rows = 32 * (4 * 4096 + 2 * 11008 + 4096) + 32000
    norms = 65 * 4096 * 2
    assert quantized_weight_bytes(c, 8) == matmul + 2 * rows + norms
    assert quantized_weight_bytes(c, 4, group_size=32, scale_bytes=4) == matmul // 2 + 4 * matmul // 32 + norms
    assert quantized_weight_bytes(c, 16, scale_bytes=0) == streamed_weight_bytes(c, "float16")


def test_matvec_linear_equals_f_linear():
    generator = torch.Generator().manual_seed(2)
    weight = nn.Parameter(torch.randn(300, 48, generator=generator).bfloat16())
    head = MatVecLinear(weight)
    for shape in [(1, 1, 48), (2, 5, 48), (1, 48)]:
        x = torch.randn(shape, generator=generator).bfloat16()
        out = head(x)
        assert out.shape == (*shape[:-1], 300)
        torch.testing.assert_close(out.float(), F.linear(x.double(), weight.double()).float(),
                                   rtol=4 * BF16_ULP, atol=4 * BF16_ULP * 10)


PACK_PROBE = ("from minillm.fast.quant import onednn_bf16_pack_problem as p; import torch; "
              "print(torch.backends.cpu.get_cpu_capability(), '|', p())")


def test_onednn_packing_runs_where_the_cpu_allows_and_names_why_not_elsewhere():
    """Chapter 2.5 packs a bfloat16 weight once; without AVX-512 oneDNN refuses: the probe says so, and the
    chapter takes the 'not applicable' case instead of stopping (on a reader's AVX2 laptop)."""
    avx2 = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", PACK_PROBE], capture_output=True, text=True, env=avx2,
                         timeout=120)
    capability, problem = out.stdout.strip().split(" | ")
    assert capability == "AVX2" and problem != "None" and "bf16" in problem
    if onednn_bf16_pack_problem() is None:  # this CPU packs: the packed product is F.linear's
        generator = torch.Generator().manual_seed(3)
        weight = torch.randn(64, 32, generator=generator).bfloat16()
        x = torch.randn(1, 32, generator=generator).bfloat16()
        torch.testing.assert_close(onednn_packed_linear(weight)(x).float(), F.linear(x, weight).float(),
                                   rtol=0.02, atol=0.02)


def test_packing_refuses_with_the_reason_where_onednn_cannot(monkeypatch):
    import minillm.fast.quant as quant

    monkeypatch.setattr(quant, "onednn_bf16_pack_problem", lambda: "bf16 path needs avx512bw")
    with pytest.raises(ValueError, match="cannot pack a bfloat16 weight here: bf16 path needs avx512bw"):
        quant.onednn_packed_linear(torch.ones(16, 16, dtype=torch.bfloat16))


def test_tiny_variants_give_nearly_the_float32_logits(tiny_model):
    """Logits of spread ~1; measured mean |difference| 0.008 (bfloat16), 0.017 (int8), max 0.09."""
    ids = random_ids(258, (1, 48))
    reference = tiny_model(ids)  # (1, 48, V)
    for name in ("bfloat16-linear", "bfloat16", "int8", "int8-dequant"):
        error = (make_variant(tiny_model, name)(ids).float() - reference).abs()
        assert torch.isfinite(error).all(), name
        assert error.mean() < 0.04 and error.max() < 0.2, name


# --- the real model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct in float32, its bfloat16 and int8 variants, and its tokenizer."""
    model, tokenizer = load_pretrained("smollm2-135m-instruct")
    return {"float32": model, "bfloat16": make_variant(model, "bfloat16"),
            "int8": make_variant(model, "int8")}, tokenizer


@pytest.fixture(scope="module")
def eval_ids(smollm2):
    return torch.tensor([smollm2[1].encode(EVAL_TEXT)])  # (1, 296)


def test_variant_bytes_halve_and_quarter_float32(smollm2):
    models, _ = smollm2
    f32, bf16, int8 = (streamed_bytes(models[name]) for name in ("float32", "bfloat16", "int8"))
    assert f32 == 4 * models["float32"].config.n_params == 538_060_032
    assert bf16 * 2 == f32
    assert int8 == quantized_weight_bytes(models["float32"].config, 8, dtype="bfloat16")
    assert 0.25 < int8 / f32 < 0.26  # the scales and norms add under 1%


@pytest.mark.parametrize("name, mean_tol", [("bfloat16", 0.2), ("int8", 0.4)])
def test_variant_logits_are_finite_and_close_to_float32(smollm2, eval_ids, name, mean_tol):
    """Measured mean |difference|: 0.11 (bfloat16) and 0.23 (int8) on logits of spread ~3."""
    models, _ = smollm2
    with torch.inference_mode():
        reference = models["float32"](eval_ids[:, :64])  # (1, 64, V)
        logits = models[name](eval_ids[:, :64]).float()
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert (logits - reference).abs().mean() < mean_tol
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.85


@pytest.fixture(scope="module")
def nll(smollm2, eval_ids):
    """Mean NLL (nats/token) of each variant on EVAL_TEXT."""
    return {name: mean_nll(model, eval_ids) for name, model in smollm2[0].items()}


@pytest.mark.parametrize("name", ["bfloat16", "int8"])
def test_variant_loss_is_within_one_percent_of_float32(nll, name):
    """float32's mean NLL is that of a trained model; each variant's is within 1% of it."""
    assert 2.5 < nll["float32"] < 4.5
    assert abs(nll[name] / nll["float32"] - 1) < 0.01


@pytest.fixture(scope="module")
def answer(smollm2):
    """The chat prompt and float32's greedy answer to it."""
    models, tokenizer = smollm2
    prompt = tokenizer.encode_chat("What is the capital of France?")
    return prompt, generate(models["float32"], prompt, 24, eos_token_id=tokenizer.eos_token_id)


@pytest.mark.parametrize("name", ["bfloat16", "int8"])
def test_variant_writes_the_same_answer_and_agrees_on_the_greedy_tokens(smollm2, answer, name):
    models, tokenizer = smollm2
    prompt, reference = answer
    tokens = generate(models[name], prompt, 24, eos_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(tokens)
    assert "Paris" in text and tokens[-1] == tokenizer.eos_token_id and text.isprintable()
    assert greedy_match(models[name], prompt, reference) >= 0.95


def test_greedy_match_and_mean_nll_reject_bad_input(tiny_model):
    with pytest.raises(ValueError, match="reference is empty"):
        greedy_match(tiny_model, [1, 2], [])
    with pytest.raises(ValueError, match=r"\(1, T\).*\(1, 1\)"):
        mean_nll(tiny_model, torch.tensor([[3]]))
    assert greedy_match(tiny_model, [1, 2], generate(tiny_model, [1, 2], 6)) == 1.0


def test_bfloat16_variant_routes_every_matmul_through_matvec_and_agrees_with_f_linear(tiny_model):
    variant, plain = make_variant(tiny_model, "bfloat16"), make_variant(tiny_model, "bfloat16-linear")
    assert sum(isinstance(m, MatVecLinear) for m in variant.modules()) == 4 * 7 + 1
    assert not [m for m in variant.modules() if isinstance(m, nn.Linear)]
    ids = random_ids(258, (1, 13))
    logits = []
    for model in (variant, plain):
        cache = KVCache(model.config, 1, 13, dtype=torch.bfloat16)
        model(ids[:, :12], cache=cache)  # prefill: several rows, F.linear in both
        logits.append(model(ids[:, 12:], cache=cache).float())  # decode: one row, torch.mv in one
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0.05)  # bfloat16 rounding apart


def test_load_precision_builds_each_named_variant():
    from minillm.fast.precision import PRECISIONS, load_precision

    assert list(PRECISIONS) == ["float32", "bfloat16", "int8", "int4"]
    for precision, head in [("float32", nn.Linear), ("bfloat16", MatVecLinear), ("int8", Int8Linear)]:
        model, tokenizer = load_precision("smollm2-135m-instruct", precision)
        assert isinstance(model.lm_head, head) and tokenizer.eos_token_id == 2
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        load_precision("smollm2-135m-instruct", "fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matvec_linear_takes_the_route_the_probe_measured_and_agrees_with_f_linear(dtype, monkeypatch):
    """Both routes give F.linear's product; which one runs for 1 and for 2-8 rows is the probe's answer, and 9+
    rows always take F.linear."""
    from minillm.fast import quant

    weight = nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(dtype))
    layer = MatVecLinear(weight)
    pays = {rows: quant.weight_first_pays((64, 32), dtype, rows) for rows in (1, 2)}  # before the spy goes in
    calls = []
    monkeypatch.setattr(quant, "weight_first", lambda w, r: calls.append(r.shape[0]) or F.linear(r, w))
    for rows in (1, 2, 8, 9):
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows)).to(dtype)
        torch.testing.assert_close(layer(x), F.linear(x, weight))
    expected = [1] * pays[1] + [2, 8] * pays[2]
    assert calls == expected
    for rows in (1, 3):
        x = torch.randn(rows, 32).to(dtype)
        torch.testing.assert_close(quant.weight_first(weight, x), F.linear(x, weight), rtol=0.02, atol=0.02)
