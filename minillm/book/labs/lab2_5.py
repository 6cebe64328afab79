"""Lab 2.5: quantize SmolLM2's weights, count the bytes a decode step reads, predict its speed, measure it.

The learner writes ``quantize_int8`` (one scale per output row), ``quantize_int4`` (a scale and a minimum
per group of 32 weights of a row, the GGUF file's Q4_1 layout), ``bytes_per_step``, ``predict_tokens_per_s``
and ``decode_tokens_per_s``. Each check names the bug its outcome points at. The last task runs SmolLM2 on
this machine: the learner's bound from a bandwidth ``minillm.analysis.roofline.measure_bandwidth`` measures,
against a rate the checker measures and the learner's function computes. ``quantized_models``,
``compare_quality`` and ``compare_speed`` are the payoff: the learner's own weights in minillm's int8 and
int4 kernels.
"""
from __future__ import annotations

import functools
import math
import statistics
import time

import torch

from ...analysis import roofline
from ...analysis.arithmetic import kv_cache_bytes
from ...checkpoints.pretrained import load_pretrained
from ...config import ModelConfig
from ...fast.int4 import Int4Linear
from ...fast.quant import (
    INT8PACK_IN_MULTIPLE,
    Int8Linear,
    greedy_match,
    int8pack_available,
    make_variant,
    mean_nll,
    replace_linears,
    streamed_bytes,
)
from ...generate import stream_generate
from ...model import build_model
from .cases import encode_prompt, randn, tiny_model
from .checker import (
    LearnerError,
    Mismatch,
    Property,
    Task,
    allow_uses,
    call,
    expect_number,
    expect_tensor,
    reference,
    register,
    wrong_value,
)

GROUP = 32  # weights of a row that share one int4 scale and minimum
# What a learner's bytes_per_step may read from minillm's objects: attributes, not counting code.
allow_uses("minillm.model.CausalLM.dtype", "minillm.model.CausalLM.device", "minillm.config.ModelConfig.n_groups")


def cpu_clock(device=None) -> float:
    """The process's CPU time (s): with one thread, the time this computation ran, even when other
    programs share the machine and pause it."""
    return time.process_time()


# --- the reference int4 quantizer (the lab's format; minillm's int4 loads the file's own blocks) ----------

@reference
def expected_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (out, in) uint8 in 0..15, scales, mins (out, in / 32) float32): weight ~ q * scale + min per group."""
    out, width = weight.shape
    groups = weight.detach().float().reshape(out, width // GROUP, GROUP)  # (out, G, 32)
    low, high = groups.amin(-1), groups.amax(-1)  # (out, G)
    scales = torch.where(high > low, (high - low) / 15, torch.ones_like(low))  # (out, G)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)  # (out, G, 32)
    return q.reshape(out, width).to(torch.uint8), scales, low


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The (out, in) weight that int4 groups stand for: q * scale + min, each group of 32 of a row."""
    out, width = q.shape
    groups = q.float().reshape(out, width // GROUP, GROUP)  # (out, G, 32)
    return (groups * scales.float()[..., None] + mins.float()[..., None]).reshape(out, width)


# --- quantize_int8 ------------------------------------------------------------------------------------------

INT8_COLUMNS_HINT = ("One scale per output row: take max |w| over each row's inputs (dim=1), giving (out,) "
                     "scales; dim=0 gives one per input column.")
INT8_TENSOR_HINT = ("Each row needs its own scale: one scale for the whole matrix wastes the grid on rows "
                    "whose weights are small. Take max |w| over dim=1.")
INT8_128_HINT = ("The scale is max |w| / 127, not / 128: int8 holds -128..127, so 128 steps overflow "
                 "(or clip) at the row's largest weight. A symmetric grid uses -127..127.")
INT8_ABS_HINT = ("Use the largest absolute value, w.abs().amax(dim=1): a row whose most extreme weight is "
                 "negative needs the grid to reach it too.")
ROUND_HINT = ("Round to the nearest step (torch.round); int() and .to(torch.int8) cut towards zero and "
              "floor() goes down, so an error reaches a whole step instead of half of one.")
ZERO_ROW_HINT = ("An all-zero row has max |w| = 0: dividing by it gives NaN. Give such a row scale 1 "
                 "(torch.where(amax > 0, amax / 127, 1)).")
INT8_TYPE_HINT = "Return q as int8 (q.to(torch.int8)) and one float32 scale per row: (q, scales)."


def _int8(fns, weight):
    out = call(fns["quantize_int8"], weight.clone())
    if not (isinstance(out, tuple) and len(out) == 2):
        raise wrong_value("quantize_int8", out, "a pair (q, scales)")
    rows, width = weight.shape
    q, scales = out
    if isinstance(scales, torch.Tensor) and scales.dim() == 2 and scales.shape[1] == 1:
        scales = scales[:, 0]  # (out, 1) is one scale per row too
    if isinstance(scales, torch.Tensor) and tuple(scales.shape) == (width,) and width != rows:
        raise Mismatch(f"scales has shape {tuple(scales.shape)}, one per input column; expected ({rows},)",
                       INT8_COLUMNS_HINT)
    if isinstance(scales, torch.Tensor) and scales.numel() == 1:
        raise Mismatch("scales holds one number for the whole matrix", INT8_TENSOR_HINT)
    q = expect_tensor("quantize_int8", q, (rows, width), floating=False, what="returned as q")
    scales = expect_tensor("quantize_int8", scales, (rows,), what="returned as scales")
    if q.dtype != torch.int8:
        raise Mismatch(f"q is a {str(q.dtype).removeprefix('torch.')} tensor; expected int8 (1 byte a weight)",
                       INT8_TYPE_HINT)
    return q, scales.float()


def _int8_diagnosis(weight, q, scales) -> str | None:
    w = weight.float()
    amax = w.abs().amax(1)
    if bool(torch.isnan(scales).any()) or bool((scales == 0).any()):
        return ZERO_ROW_HINT
    if torch.allclose(scales, torch.full_like(scales, float(amax.max()) / 127), rtol=1e-4):
        return INT8_TENSOR_HINT
    if torch.allclose(scales, amax / 128, rtol=1e-4):
        return INT8_128_HINT
    if torch.allclose(scales, w.amax(1) / 127, rtol=1e-4) and not torch.allclose(scales, amax / 127, rtol=1e-4):
        return INT8_ABS_HINT
    steps = w / scales[:, None]
    if torch.equal(q.to(torch.int64), steps.trunc().to(torch.int64)) or torch.equal(
            q.to(torch.int64), steps.floor().to(torch.int64)):
        return ROUND_HINT
    return None


def _rows_of_different_sizes(seed: int, rows: int = 6, width: int = 64) -> torch.Tensor:
    """Rows whose largest weight spans four orders of magnitude, one row dominated by a negative weight."""
    w = randn(rows, width, seed=seed) * torch.logspace(-2, 1, rows)[:, None]  # (rows, width)
    w[1, 5] = -4 * float(w[1].abs().max())  # its largest |w| is negative
    return w


def _int8_error(fns):
    w = _rows_of_different_sizes(200)
    q, scales = _int8(fns, w)
    error = (q.float() * scales[:, None] - w).abs() / scales[:, None]  # in steps of each row's grid
    worst = float(error.max()) if not bool(torch.isnan(error).any()) else math.nan
    if not worst <= 0.5 + 1e-4:
        row = int(error.nan_to_num(math.inf).amax(1).argmax())
        raise Mismatch(f"q * scales misses a weight by {worst:.3g} of its row's step (row {row}); at most "
                       "0.5 expected", _int8_diagnosis(w, q, scales) or ROUND_HINT)


def _int8_grid(fns):
    w = _rows_of_different_sizes(201)
    q, scales = _int8(fns, w)
    top = q.to(torch.int64).abs().amax(1)  # (rows,)
    if not bool((top == 127).all()):
        row = int((top != 127).nonzero()[0])
        raise Mismatch(f"row {row}'s largest |q| is {int(top[row])}; expected 127 (each row's largest "
                       f"weight on the end of its grid)", _int8_diagnosis(w, q, scales) or INT8_TENSOR_HINT)


def _int8_zero_row(fns):
    w = _rows_of_different_sizes(202)
    w[3] = 0
    q, scales = _int8(fns, w)
    if not bool(torch.isfinite(scales).all()) or not float(scales[3]) > 0 or bool((q[3] != 0).any()):
        raise Mismatch(f"an all-zero row got scale {float(scales[3]):.3g} and q values "
                       f"{sorted(set(q[3].tolist()))[:3]}", ZERO_ROW_HINT)


def _int8_real(fns):
    w = tiny_model().model.layers[0].mlp.down_proj.weight.detach()  # (256, 688) or so: a real layer's shape
    q, scales = _int8(fns, w)
    relative = float((q.float() * scales[:, None] - w).norm() / w.norm())
    if not relative < 0.01:
        raise Mismatch(f"a layer of the tiny model comes back with a relative error of {relative:.2%}",
                       _int8_diagnosis(w, q, scales) or ROUND_HINT)


INT8 = Task("quantize_int8", "2.5", ("quantize_int8",), (
    Property("returns q (out, in) int8 and scales (out,): one scale per output row", INT8_TYPE_HINT,
             lambda fns: _int8(fns, _rows_of_different_sizes(203))),
    Property("q * scales is within half a step of every weight", ROUND_HINT, _int8_error),
    Property("each row's largest |weight| lands on +-127: every row uses its whole grid", INT8_TENSOR_HINT,
             _int8_grid),
    Property("an all-zero row: q = 0 and a finite, positive scale", ZERO_ROW_HINT, _int8_zero_row),
    Property("a real layer comes back within 1% (relative error of the matrix)", ROUND_HINT, _int8_real),
))


# --- quantize_int4 ------------------------------------------------------------------------------------------

INT4_AXIS_HINT = ("A group is 32 consecutive weights of one row: reshape (out, in) to (out, in // 32, 32) "
                  "and reduce over the last axis, giving (out, in // 32) scales and minimums.")
INT4_ROW_HINT = ("One scale per row is int8's layout; int4 has only 16 levels, so each group of 32 weights "
                 "of a row gets its own scale and minimum: (out, in // 32) of each.")
INT4_SIGNED_HINT = ("Store q in 0..15 (uint8), counted up from the group's minimum: w ~ q * scale + min. "
                    "A signed grid around 0 wastes levels when a group's weights are not centred on 0.")
INT4_16_HINT = ("16 levels make 15 steps: scale = (max - min) / 15, so that q = 15 lands on the group's "
                "largest weight.")
INT4_CONSTANT_HINT = ("A group whose weights are all equal has max = min: dividing by 0 gives NaN. Give it "
                      "scale 1 (its q is 0 and its minimum is the value).")
INT4_TYPE_HINT = "Return (q, scales, mins): q (out, in) uint8 in 0..15, scales and mins (out, in // 32)."


def _int4(fns, weight):
    out = call(fns["quantize_int4"], weight.clone())
    if not (isinstance(out, tuple) and len(out) == 3):
        raise wrong_value("quantize_int4", out, "a triple (q, scales, mins)")
    rows, width = weight.shape
    q, scales, mins = out
    for name, value in (("scales", scales), ("mins", mins)):
        if isinstance(value, torch.Tensor) and tuple(value.shape) in ((rows // GROUP, width), (width // GROUP,)):
            raise Mismatch(f"{name} has shape {tuple(value.shape)}; expected ({rows}, {width // GROUP})",
                           INT4_AXIS_HINT)
        if isinstance(value, torch.Tensor) and tuple(value.shape) in ((rows,), (rows, 1)):
            raise Mismatch(f"{name} has shape {tuple(value.shape)}, one per row; expected "
                           f"({rows}, {width // GROUP})", INT4_ROW_HINT)
    q = expect_tensor("quantize_int4", q, (rows, width), floating=False, what="returned as q")
    scales = expect_tensor("quantize_int4", scales, (rows, width // GROUP), what="returned as scales")
    mins = expect_tensor("quantize_int4", mins, (rows, width // GROUP), what="returned as mins")
    if int(q.min()) < 0:
        raise Mismatch(f"q holds {int(q.min())}; 4 bits counted from the minimum hold 0..15", INT4_SIGNED_HINT)
    if int(q.max()) > 15:
        raise Mismatch(f"q holds {int(q.max())}; 4 bits hold 0..15", INT4_16_HINT)
    return q, scales.float(), mins.float()


def _int4_diagnosis(weight, q, scales, mins) -> str | None:
    if bool(torch.isnan(scales).any()) or bool((scales == 0).any()):
        return INT4_CONSTANT_HINT
    groups = weight.float().reshape(weight.shape[0], -1, GROUP)
    spread = groups.amax(-1) - groups.amin(-1)
    if torch.allclose(scales, spread / 16, rtol=1e-4):
        return INT4_16_HINT
    steps = (groups - mins[..., None]) / scales[..., None]
    qq = q.to(torch.int64).reshape(groups.shape)
    if torch.equal(qq, steps.floor().clamp(0, 15).to(torch.int64)) or torch.equal(
            qq, steps.trunc().clamp(0, 15).to(torch.int64)):
        return ROUND_HINT
    return None


def _groups_of_different_sizes(seed: int) -> torch.Tensor:
    """(64, 128) weights whose groups differ in spread and in centre (none centred on 0)."""
    w = randn(64, 128, seed=seed)
    scale = torch.logspace(-2, 1, 4).repeat_interleave(GROUP)  # (128,): each group of a row its own spread
    return w * scale + torch.linspace(-3, 3, 64)[:, None]  # (64, 128)


def _int4_error(fns):
    w = _groups_of_different_sizes(210)
    q, scales, mins = _int4(fns, w)
    error = (dequantize_groups(q, scales, mins) - w).abs()
    per_step = error.reshape(w.shape[0], -1, GROUP) / scales[..., None]
    worst = float(per_step.max()) if not bool(torch.isnan(per_step).any()) else math.nan
    if not worst <= 0.5 + 1e-4:
        raise Mismatch(f"q * scale + min misses a weight by {worst:.3g} of its group's step; at most 0.5 "
                       "expected", _int4_diagnosis(w, q, scales, mins) or ROUND_HINT)


def _int4_ends(fns):
    w = _groups_of_different_sizes(211)
    q, scales, mins = _int4(fns, w)
    groups = q.to(torch.int64).reshape(w.shape[0], -1, GROUP)
    if not (bool((groups.amin(-1) == 0).all()) and bool((groups.amax(-1) == 15).all())):
        raise Mismatch(f"the groups' q run from {int(groups.amin(-1).max())} to {int(groups.amax(-1).min())} "
                       "at worst; each group should use 0..15", _int4_diagnosis(w, q, scales, mins)
                       or INT4_16_HINT)


def _int4_constant(fns):
    w = _groups_of_different_sizes(212)
    w[2, GROUP:2 * GROUP] = 0.25
    q, scales, mins = _int4(fns, w)
    back = dequantize_groups(q, scales, mins)[2, GROUP:2 * GROUP]
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()) or not torch.allclose(
            back, torch.full_like(back, 0.25)):
        raise Mismatch(f"a group of 32 weights all equal to 0.25 comes back as {float(back[0]):.3g}",
                       INT4_CONSTANT_HINT)


def _int4_real(fns):
    w = tiny_model().model.layers[0].mlp.up_proj.weight.detach()
    q, scales, mins = _int4(fns, w)
    relative = float((dequantize_groups(q, scales, mins) - w).norm() / w.norm())
    if not relative < 0.1:
        raise Mismatch(f"a layer of the tiny model comes back with a relative error of {relative:.1%}",
                       _int4_diagnosis(w, q, scales, mins) or ROUND_HINT)


INT4 = Task("quantize_int4", "2.5", ("quantize_int4",), (
    Property("returns q (out, in) in 0..15, scales and mins (out, in // 32)", INT4_TYPE_HINT,
             lambda fns: _int4(fns, _groups_of_different_sizes(213))),
    Property("q * scale + min is within half a step of every weight", ROUND_HINT, _int4_error),
    Property("each group's smallest weight has q = 0 and its largest q = 15", INT4_16_HINT, _int4_ends),
    Property("a group whose weights are all equal comes back exactly, with a positive scale",
             INT4_CONSTANT_HINT, _int4_constant),
    Property("a real layer comes back within 10% (relative error of the matrix)", ROUND_HINT, _int4_real),
))


# --- bytes_per_step -----------------------------------------------------------------------------------------

EMBED_HINT = ("An embedding table is looked up, one row per token: a decode step does not read it unless "
              "the head shares it (tied). Leave model.model.embed_tokens.weight out when lm_head does not "
              "hold that same tensor.")
TIED_TWICE_HINT = ("A tied head is the embedding table itself (the same tensor, the same data_ptr()): "
                   "count each tensor once.")
TIED_NONE_HINT = ("When the head is tied, lm_head reads the whole embedding table every step: count it "
                  "(once).")
ELEMENT_HINT = "Bytes, not elements: multiply each tensor's numel() by its element_size()."
BUFFER_HINT = ("Quantized weights are buffers, not parameters (model.parameters() misses them): count every "
               "tensor the model's state_dict() holds.")
ROTARY_HINT = ("The rotary tables are computed at start-up, not weights (a state_dict leaves them out): count "
               "the state_dict's tensors, not every buffer.")
KV_HINT = ("A decode step also reads the KV cache of its context: add 2 (K and V) x layers x KV heads x "
           "head_dim x context_len x bytes per element.")
KV_TWO_HINT = "The cache holds K and V: two tensors per layer, so the factor 2."
KV_HEADS_HINT = ("Only the KV heads are cached (config.n_kv_heads), not the query heads (config.n_heads): "
                 "grouped-query attention shares them.")
KV_DTYPE_HINT = ("The cache is kept in the model's compute dtype (model.dtype): 2 bytes an element for "
                 "bfloat16, not always 4.")
UNIT_HINT = "Return bytes (an int), not MB or MiB: the prediction divides a bandwidth in bytes by it."


def expected_bytes(model, context_len: int) -> int:
    """What a decode step of one sequence reads: minillm's count of the weights and the KV cache."""
    return streamed_bytes(model) + kv_cache_bytes(model.config, context_len, 1, model.dtype)


def _tensors(model, parameters_only=False, all_buffers=False):
    tensors = list(model.parameters()) if parameters_only else list(model.state_dict().values())
    if all_buffers:
        tensors += [b for b in model.buffers()]
    return tensors


def _count(tensors, skip=(), once=True, bytes_=True) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() in skip or (once and t.data_ptr() in seen):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * (t.element_size() if bytes_ else 1)
    return total


def _bytes_bugs(model, context_len: int) -> list[tuple[str, float]]:
    """(hint, what that bug returns) for the usual wrong counts of ``model`` at ``context_len``."""
    c, embed = model.config, model.model.embed_tokens.weight
    tied = any(t.data_ptr() == embed.data_ptr() for t in model.lm_head.state_dict().values())
    skip = () if tied else (embed.data_ptr(),)
    kv = kv_cache_bytes(c, context_len, 1, model.dtype)
    weights = streamed_bytes(model)
    return [
        (EMBED_HINT, weights + embed.numel() * embed.element_size() + kv) if not tied else (EMBED_HINT, -1),
        (TIED_TWICE_HINT, weights + embed.numel() * embed.element_size() + kv) if tied else (TIED_TWICE_HINT, -1),
        (TIED_NONE_HINT, weights - embed.numel() * embed.element_size() + kv) if tied else (TIED_NONE_HINT, -1),
        (ELEMENT_HINT, _count(_tensors(model), skip, bytes_=False) + kv // model.dtype.itemsize),
        (ELEMENT_HINT, _count(_tensors(model), skip, bytes_=False) + kv),
        (BUFFER_HINT, _count(_tensors(model, parameters_only=True), skip) + kv),
        (ROTARY_HINT, _count(_tensors(model, all_buffers=True), skip) + kv),
        (KV_HINT, weights),
        (KV_TWO_HINT, weights + kv // 2),
        (KV_HEADS_HINT, weights + kv // c.n_kv_heads * c.n_heads),
        (KV_DTYPE_HINT, weights + kv_cache_bytes(c, context_len, 1, torch.float32)),
        (UNIT_HINT, (weights + kv) / 1e6), (UNIT_HINT, (weights + kv) / 2**20),
    ]


def _bytes(fns, model, context_len: int):
    return call(fns["bytes_per_step"], model, context_len)


def _bytes_case(make, context_len: int, what: str):
    def run(fns):
        model = make()
        got, expected = _bytes(fns, model, context_len), expected_bytes(model, context_len)
        got = expect_number("bytes_per_step", got)
        if got != expected:
            hint = next((h for h, wrong in _bytes_bugs(model, context_len)
                         if wrong != expected and math.isclose(got, wrong, rel_tol=1e-9)), None)
            raise Mismatch(f"{what}, context {context_len}: got {got:,.6g}", hint)
    return run


def _bytes_type(fns):
    value = _bytes(fns, tiny_model(), 8)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Mismatch(f"bytes_per_step returned {value!r}; expected an int (a number of bytes)",
                       UNIT_HINT if isinstance(value, float) else None)


@functools.lru_cache(maxsize=1)
def _tied_model():
    return build_model(ModelConfig(tie_embeddings=True, n_kv_heads=2))


@functools.lru_cache(maxsize=1)
def _int8_model():
    return make_variant(tiny_model(), "int8")  # Int8Linear buffers; bfloat16 activations and KV


@functools.lru_cache(maxsize=1)
def _bf16_model():
    return make_variant(tiny_model(), "bfloat16-linear")


BYTES = Task("bytes_per_step", "2.5", ("bytes_per_step",), (
    Property("returns an int (a number of bytes)", UNIT_HINT, _bytes_type),
    Property("an untied float32 model: every matrix and norm, not the embedding table, plus the KV cache",
             EMBED_HINT, _bytes_case(tiny_model, 40, "the tiny model (float32, untied)")),
    Property("a tied head reads the embedding table: counted once", TIED_TWICE_HINT,
             _bytes_case(_tied_model, 40, "a tiny model whose head is its embedding table")),
    Property("an int8 model: its weights are buffers (q and scales), its KV cache bfloat16", BUFFER_HINT,
             _bytes_case(_int8_model, 100, "the tiny model with int8 weights")),
    Property("a bfloat16 model at a long context: 2 bytes a weight and a cached element", KV_DTYPE_HINT,
             _bytes_case(_bf16_model, 900, "the tiny model in bfloat16")),
))


# --- predict_tokens_per_s -----------------------------------------------------------------------------------

GIB_HINT = "A GB is 10**9 bytes (a GiB is 2**30): bandwidth_gb_s * 1e9 bytes arrive each second."
INVERTED_HINT = ("That is seconds per token (bytes / bandwidth); the rate is its inverse: bandwidth in "
                 "bytes per second / bytes per step.")
GB_HINT = "bandwidth_gb_s is in GB/s: multiply it by 1e9 to get bytes per second before dividing."
PREDICT_HINT = "tokens/s <= bandwidth (bytes/s) / bytes per step: each step must read all its bytes."


def _predict(fns, step_bytes, gb_s):
    return expect_number("predict_tokens_per_s", call(fns["predict_tokens_per_s"], step_bytes, gb_s))


def _predict_value(fns):
    step_bytes, gb_s = 250_000_000, 20.0
    got, expected = _predict(fns, step_bytes, gb_s), gb_s * 1e9 / step_bytes
    if not math.isclose(got, expected, rel_tol=1e-9):
        bugs = ((GIB_HINT, gb_s * 2**30 / step_bytes), (INVERTED_HINT, step_bytes / (gb_s * 1e9)),
                (GB_HINT, gb_s / step_bytes), (INVERTED_HINT, step_bytes / gb_s))
        hint = next((h for h, wrong in bugs if math.isclose(got, wrong, rel_tol=1e-6)), None)
        raise Mismatch(f"250 MB a step at 20 GB/s: got {got:.6g} tokens/s", hint)


def _predict_scaling(fns):
    base = _predict(fns, 400_000_000, 10.0)
    for step_bytes, gb_s, factor in ((200_000_000, 10.0, 2), (400_000_000, 30.0, 3)):
        got = _predict(fns, step_bytes, gb_s)
        if not math.isclose(got, base * factor, rel_tol=1e-9):
            raise Mismatch(f"400 MB at 10 GB/s gave {base:.4g} tokens/s, {step_bytes / 1e6:.0f} MB at "
                           f"{gb_s:g} GB/s gave {got:.4g}", INVERTED_HINT if got < base else None)


PREDICT = Task("predict_tokens_per_s", "2.5", ("predict_tokens_per_s",), (
    Property("250 MB a step at 20 GB/s allows 80 steps a second", PREDICT_HINT, _predict_value),
    Property("halving the bytes doubles the bound; tripling the bandwidth triples it", PREDICT_HINT,
             _predict_scaling),
))


# --- decode_tokens_per_s ------------------------------------------------------------------------------------

WHOLE_RUN_HINT = ("That is the whole run's rate, the prefill included: the first token waited for the "
                  "prompt. Measure the steady window: the gaps between consecutive tokens.")
GAPS_HINT = "n tokens have n - 1 gaps: divide by the gaps, or take 1 / the median gap."
MEAN_HINT = ("One pause (another program, a page fault) drags a mean; the median gap is what a step "
             "takes: 1 / statistics.median(gaps).")
SECONDS_HINT = "That is seconds per token; tokens per second is its inverse."
RATE_HINT = "Take the gaps between consecutive token times and return 1 / their median."


def _rate(fns, start, times):
    return expect_number("decode_tokens_per_s", call(fns["decode_tokens_per_s"], start, list(times)))


def _rate_case(start, times, what):
    def run(fns):
        got = _rate(fns, start, times)
        gaps = [b - a for a, b in zip(times, times[1:])]
        expected = 1 / statistics.median(gaps)
        if math.isclose(got, expected, rel_tol=1e-6):
            return
        bugs = ((WHOLE_RUN_HINT, len(times) / (times[-1] - start)),
                (WHOLE_RUN_HINT, (len(times) - 1) / (times[-1] - start)),
                (GAPS_HINT, len(times) / (times[-1] - times[0])),
                (MEAN_HINT, 1 / statistics.fmean(gaps)), (MEAN_HINT, (len(times) - 1) / (times[-1] - times[0])),
                (SECONDS_HINT, statistics.median(gaps)), (SECONDS_HINT, statistics.fmean(gaps)),
                (SECONDS_HINT, 1e3 * statistics.median(gaps)))
        hint = next((h for h, wrong in bugs if not math.isclose(wrong, expected, rel_tol=1e-6)
                     and math.isclose(got, wrong, rel_tol=1e-6)), None)
        raise Mismatch(f"{what}: got {got:.6g} tokens/s", hint)
    return run


STEADY = [2.0 + 0.0625 * i for i in range(9)]  # a 2 s prefill, then a token every 62.5 ms
PAUSED = [0.5 + 0.125 * i for i in range(6)] + [0.5 + 0.125 * 5 + 1.0 + 0.125 * i for i in range(1, 5)]


def _rate_short(fns):
    try:
        value = call(fns["decode_tokens_per_s"], 0.0, [0.5])
    except LearnerError as exc:
        if isinstance(exc.__cause__, ValueError):
            return
        raise
    raise Mismatch(f"one token (no gap between tokens) gave {value!r} instead of raising ValueError",
                   "One token has no gap, so no decode rate: raise ValueError with a message.")


DECODE = Task("decode_tokens_per_s", "2.5", ("decode_tokens_per_s",), (
    Property("a steady run after a long prefill: 1 / the gap between tokens", RATE_HINT,
             _rate_case(0.0, STEADY, "a 2 s prefill, then a token every 62.5 ms")),
    Property("one pause in the run does not change it (the median gap)", MEAN_HINT,
             _rate_case(0.0, PAUSED, "a token every 125 ms with one 1.125 s gap")),
    Property("raises ValueError with fewer than two tokens", RATE_HINT, _rate_short),
))


# --- the prediction against a measurement (SmolLM2 on this machine) -------------------------------------------

PROMPT = "Explain in detail how a refrigerator keeps food cold."
LOW, HIGH = 1 / 12, 1.5  # the measured rate must fall within these multiples of the bound


@functools.lru_cache(maxsize=1)
def smollm2():
    """SmolLM2-135M-Instruct in float32 on the CPU, and its tokenizer (loaded once per process)."""
    return load_pretrained("smollm2-135m-instruct", device="cpu")


def token_times(model, prompt_ids: list[int], n: int, clock=cpu_clock) -> tuple[float, list[float]]:
    """(the clock before the prefill, the clock at each of ``n`` greedy tokens), the first right after the
    prefill."""
    start = clock()
    stamps = [clock() for _ in stream_generate(model, prompt_ids, n, eos_token_id=None)]
    return start, stamps


def measured_bandwidth() -> float:
    """Bytes/s of ``minillm.analysis.roofline.measure_bandwidth`` on the CPU, one thread, on CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return roofline.measure_bandwidth(device="cpu", clock=cpu_clock)
    finally:
        torch.set_num_threads(threads)


FAR_BELOW_HINT = ("The measured rate is far below your bound: check the units on the way (bytes, not MB; "
                  "GB/s times 1e9; tokens per second, not seconds per token).")
ABOVE_HINT = ("The measured rate beats your bound: the bound counts too many bytes, or too much bandwidth "
              "(GB/s times 1e9, not 2**30; bytes, not elements).")


def _written(fns) -> None:
    """Call each function once on small inputs, so that a stub fails before SmolLM2 is loaded."""
    call(fns["bytes_per_step"], tiny_model(), 8)
    call(fns["predict_tokens_per_s"], 10**8, 10.0)
    call(fns["decode_tokens_per_s"], 0.0, [0.5, 0.625, 0.75])


def _bytes_of_smollm2(fns):
    _written(fns)
    model, tokenizer = smollm2()
    context = len(tokenizer.encode_chat(PROMPT)) + 8
    got = expect_number("bytes_per_step", call(fns["bytes_per_step"], model, context))
    expected = expected_bytes(model, context)
    if got != expected:
        hint = next((h for h, wrong in _bytes_bugs(model, context)
                     if wrong != expected and math.isclose(got, wrong, rel_tol=1e-9)), None)
        raise Mismatch(f"SmolLM2 in float32 (its head tied to the embedding table), context {context}: got "
                       f"{got:,.6g} bytes", hint)


def _prediction_on_smollm2(fns):
    _written(fns)
    model, tokenizer = smollm2()
    ids = tokenizer.encode_chat(PROMPT)
    n = 17
    step_bytes = expect_number("bytes_per_step", call(fns["bytes_per_step"], model, len(ids) + n // 2))
    bandwidth = measured_bandwidth()
    bound = _predict(fns, step_bytes, bandwidth / 1e9)
    with torch.inference_mode():
        token_times(model, ids, 3)  # warm-up
        start, stamps = token_times(model, ids, n)  # the timing loop: outside call(), so not profiled
    measured = _rate(fns, start, stamps)
    ratio = measured / bound if bound else math.inf
    if not LOW <= ratio <= HIGH:
        raise Mismatch(f"SmolLM2 float32 at {bandwidth / 1e9:.1f} GB/s: your bound {bound:.4g} tokens/s, "
                       f"measured {measured:.4g} (x{ratio:.3g}; expected between x{LOW:.3g} and x{HIGH:g})",
                       FAR_BELOW_HINT if ratio < LOW else ABOVE_HINT)


MEASURED = Task("your prediction against a measurement", "2.5",
                ("bytes_per_step", "predict_tokens_per_s", "decode_tokens_per_s"), (
                    Property("SmolLM2's bytes a step, counted from its real tensors", EMBED_HINT,
                             _bytes_of_smollm2, seconds=300),
                    Property(f"SmolLM2 in float32 on this CPU runs at x{LOW:.2g} to x{HIGH:g} of your bound",
                             PREDICT_HINT, _prediction_on_smollm2, seconds=300),
                ))

register(INT8, INT4, BYTES, PREDICT, DECODE, MEASURED)


# --- the payoff ------------------------------------------------------------------------------------------

def _int8_linear(quantize_int8):
    def make(linear):
        q, scales = call(quantize_int8, linear.weight.detach().float())
        fits = int8pack_available("cpu", torch.bfloat16) and linear.in_features % INT8PACK_IN_MULTIPLE == 0
        return Int8Linear(q, scales.float(), torch.bfloat16, "int8pack" if fits else "dequant")
    return make


def _int4_linear(quantize_int4):
    def make(linear):
        q, scales, mins = call(quantize_int4, linear.weight.detach().float())
        return Int4Linear.from_groups(q, scales.float(), mins.float(), device="cpu", dtype=torch.bfloat16)
    return make


def quantized_models(model, quantize_int8, quantize_int4) -> dict:
    """{"float32": model, "int8 (yours)": ..., "int4 (yours)": ...}: copies of the float32 ``model`` whose
    every linear layer (the tied head included) holds the learner's quantized weights, in minillm's int8
    and int4 kernels (bfloat16 activations). Call it once ``ready`` passes for both quantizers."""
    int8 = replace_linears(make_variant(model, "bfloat16-linear"), _int8_linear(quantize_int8))
    int4 = replace_linears(make_variant(model, "bfloat16-linear"), _int4_linear(quantize_int4))
    return {"float32": model, "int8 (yours)": int8, "int4 (yours)": int4}


def compare_quality(models: dict, tokenizer, text: str, prompt: str = PROMPT, n: int = 32) -> None:
    """Each model's perplexity on ``text`` and how often it ranks float32's greedy tokens first."""
    ids = torch.tensor([tokenizer.encode(text)])  # (1, T)
    prompt_ids = encode_prompt(tokenizer, prompt)
    reference = [e.token_id for e in stream_generate(models["float32"], prompt_ids, n, eos_token_id=None)]
    base = mean_nll(models["float32"], ids)
    print(f"{ids.shape[1]} tokens of text; {n} greedy tokens of float32 as the reference")
    print(f"{'model':<14}{'perplexity':>11}{'vs float32':>12}{'same top token':>16}")
    for name, model in models.items():
        nll = mean_nll(model, ids)
        agree = greedy_match(model, prompt_ids, reference)
        print(f"{name:<14}{math.exp(nll):>11.2f}{math.exp(nll - base) - 1:>+12.2%}{agree:>16.0%}")


def compare_speed(models: dict, tokenizer, bytes_per_step, predict_tokens_per_s, decode_tokens_per_s,
                  bandwidth: float, n: int = 33, prompt: str = PROMPT) -> dict[str, tuple[float, float]]:
    """Each model's bound (the learner's bytes and prediction at ``bandwidth`` bytes/s) next to its rate
    (measured here, computed by the learner's function); {name: (bound, measured)} in tokens/s."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    context = len(prompt_ids) + n // 2
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s; {n} greedy tokens after a {len(prompt_ids)}-token prompt, "
          f"one thread, CPU time")
    print(f"{'model':<14}{'MB a step':>10}{'bound tok/s':>13}{'measured':>10}{'measured/bound':>16}")
    out = {}
    for name, model in models.items():
        step_bytes = call(bytes_per_step, model, context)
        bound = call(predict_tokens_per_s, step_bytes, bandwidth / 1e9)
        with torch.inference_mode():
            token_times(model, prompt_ids, 3)  # warm-up
            start, stamps = token_times(model, prompt_ids, n)
        measured = call(decode_tokens_per_s, start, stamps)
        out[name] = (bound, measured)
        print(f"{name:<14}{step_bytes / 1e6:>10.1f}{bound:>13.1f}{measured:>10.1f}{measured / bound:>16.0%}")
    return out
