"""Guards for lower precision: RMSNorm's float32 upcast, float16 outliers, bfloat16 and float16 models.

Each test here was seen to fail against a deliberately broken model (RMSNorm computed in the input's
dtype), which every other test of the suite let pass.
"""
import pytest
import torch
from conftest import random_ids

from minillm import build_model
from minillm.model import RMSNorm

ULP = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}  # half the relative spacing near 1
OUTLIER_ROW = [300.0, -280.0, 1.0, 2.0]  # 300^2 = 90,000 > 65,504, the largest float16


def float64_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The exact RMSNorm (unit weight) of x's values, in float64."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_in_half_precision_is_the_exact_result_rounded_once(dtype):
    """Computed in float32 and rounded once, nearly every entry is the exact value rounded to the
    nearest half-precision number (float32's own error moves a handful across a rounding boundary).
    Computed in half precision (squares, mean, rsqrt and product each rounded) only ~70% are."""
    x = (3 * torch.randn(64, 576, generator=torch.Generator().manual_seed(0))).to(dtype)  # (T, d)
    norm = RMSNorm(576, eps=1e-5).to(dtype)  # weight 1: the output is the normalized x itself
    out = norm(x)
    expected = float64_rms_norm(x, 1e-5).to(dtype)
    assert out.dtype == dtype
    assert (out == expected).float().mean() >= 0.999
    torch.testing.assert_close(out.double(), expected.double(), rtol=2 * ULP[dtype], atol=0)


def test_float16_rms_norm_of_a_row_whose_squares_overflow_gives_the_float32_result():
    x = torch.tensor([OUTLIER_ROW, [0.5, -1.0, 2.0, 0.25]])  # (2, 4)
    assert torch.isinf(x.half().pow(2)).any()  # what a float16-only norm would compute
    norm32 = RMSNorm(4, eps=1e-5)
    norm16 = RMSNorm(4, eps=1e-5).half()
    with torch.no_grad():
        norm32.weight.copy_(torch.tensor([1.0, 0.5, 2.0, 1.5]))
        norm16.weight.copy_(norm32.weight)
    out = norm16(x.half())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), norm32(x), rtol=4 * ULP[torch.float16], atol=1e-3)
    assert out[0, 0] > 1.0  # 300 / rms 205.3 = 1.46: not flushed to 0 by an infinite mean square


def test_a_float16_model_with_an_outlier_embedding_gives_the_float32_logits():
    """A token whose embedding row holds [300, -280, ...] enters the first norm as that row."""
    ids = random_ids(258, (1, 16))
    models = [build_model("tiny"), build_model("tiny", dtype="float16")]
    for model in models:
        with torch.no_grad():
            model.model.embed_tokens.weight[ids[0, 3], :4] = torch.tensor(OUTLIER_ROW)
    reference, half = (model(ids) for model in models)  # (1, 16, V)
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), reference, rtol=0, atol=0.05)  # measured max 0.005


@pytest.mark.parametrize("dtype, mean_tol, max_tol", [("bfloat16", 0.02, 0.1), ("float16", 0.003, 0.02)])
def test_half_precision_tiny_models_stay_within_stated_tolerances(tiny_model, dtype, mean_tol, max_tol):
    """Logits of spread ~1. Measured |difference| to float32: bfloat16 mean 0.008, max 0.04; float16
    mean 0.001, max 0.005 (about 2x and 4x under the tolerances)."""
    ids = random_ids(258, (1, 64))
    error = (build_model("tiny", dtype=dtype)(ids).float() - tiny_model(ids)).abs()
    assert error.mean() < mean_tol and error.max() < max_tol
