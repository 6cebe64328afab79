"""Lab 2.5: quantize SmolLM2's weights, count the bytes a decode step reads, predict its speed, measure it.

The learner writes ``quantize_int8`` (one scale per output row), ``quantize_int4`` (a scale and a minimum
per group of 32 weights of a row, the GGUF file's Q4_1 layout), ``bytes_per_step``, ``predict_tokens_per_s``
and ``decode_tokens_per_s``; each function's catalogue (:mod:`.diagnosis`) holds the bugs learners write,
as code. The last task runs SmolLM2 on
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
from . import wire
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
from .diagnosis import Bug, Catalogue

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

def _int8_slip(weight, dim=1, divisor=127, signed_max=False, rounding=torch.round, guard=True, per_tensor=False,
               scale_dtype=torch.float32):
    """Symmetric int8 per output row, and the usual slips (flags)."""
    amax = weight.amax(dim=dim) if signed_max else weight.abs().amax(dim=dim)
    if per_tensor:
        amax = weight.abs().max().expand(weight.shape[0])
    scales = torch.where(amax > 0, amax / divisor, torch.ones_like(amax)) if guard else amax / divisor
    scale = scales[:, None] if dim == 1 else scales[None, :]
    return rounding(weight / scale).clamp(-127, 127).to(torch.int8), scales.to(scale_dtype)


def _int8_outcome(function, weight):
    q, scales = function(weight.clone())
    return q.to(torch.int64), scales.float().reshape(-1)


def _rows_of_different_sizes(seed: int, rows: int = 6, width: int = 64) -> torch.Tensor:
    """Rows whose largest weight spans four orders of magnitude, one row dominated by a negative weight."""
    w = randn(rows, width, seed=seed) * torch.logspace(-2, 1, rows)[:, None]  # (rows, width)
    w[1, 5] = -4 * float(w[1].abs().max())  # its largest |w| is negative
    return w


def _int8_probes():
    zero_row = _rows_of_different_sizes(440)
    zero_row[2] = 0
    return [(_rows_of_different_sizes(441),), (zero_row,)]


INT8_BUGS = Catalogue("quantize_int8", _int8_slip, (
    Bug("int8.per_tensor", "one scale for the whole matrix", "Each row gets its own scale, from its own "
        "largest magnitude.", lambda w: _int8_slip(w, per_tensor=True)),
    Bug("int8.over_128", "a scale of max |w| / 128", "int8 holds -128..127: with 128 steps the row's largest "
        "weight overflows the grid. The symmetric grid is -127..127.", lambda w: _int8_slip(w, divisor=128)),
    Bug("int8.signed_max", "a scale from the largest weight, not the largest magnitude", "A row whose most "
        "extreme weight is negative needs the grid to reach it too.", lambda w: _int8_slip(w, signed_max=True)),
    Bug("int8.truncate", "q cut towards zero instead of rounded", "A cast to an integer type cuts towards "
        "zero: an error can then reach a whole step; round to the nearest step first.",
        lambda w: _int8_slip(w, rounding=torch.trunc)),
    Bug("int8.floor", "q rounded down", "Round to the nearest step, not down.",
        lambda w: _int8_slip(w, rounding=torch.floor)),
    Bug("int8.zero_row", "a division by a zero row's max", "An all-zero row has max |w| = 0: give it scale 1.",
        lambda w: _int8_slip(w, guard=False)),
    Bug("int8.bf16_scales", "q computed with float32 scales, returned with bfloat16 scales", "The scales "
        "you return must be the ones q was computed with: bfloat16 keeps 8 bits of a scale, so q * scale "
        "lands off the weight. Return float32 scales.", lambda w: _int8_slip(w, scale_dtype=torch.bfloat16)),
), _int8_probes, observe=_int8_outcome)


def _int8(fns, weight, check_dtype=False):
    """The learner's (q, scales) as float32 scales; ``check_dtype``: scales must be float32 (the first
    check's own message; the others judge the values)."""
    out = call(fns["quantize_int8"], weight.clone())
    if not (isinstance(out, tuple) and len(out) == 2):
        raise wrong_value("quantize_int8", out, "a pair (q, scales)")
    rows, width = weight.shape
    q, scales = out
    if isinstance(scales, torch.Tensor) and scales.dim() == 2 and scales.shape[1] == 1:
        scales = scales[:, 0]  # (out, 1) is one scale per row too
    if isinstance(scales, torch.Tensor) and tuple(scales.shape) == (width,) and width != rows:
        raise Mismatch(f"scales has shape {tuple(scales.shape)}, one per input column; expected ({rows},), one "
                       "per output row", "Over which dimension of (out, in) do you take the largest magnitude?")
    if isinstance(scales, torch.Tensor) and scales.numel() == 1:
        raise Mismatch(f"scales holds one number for the whole matrix; expected ({rows},), one per output row",
                       "Over which dimension do you take the largest magnitude, and does each row keep its own?")
    q = expect_tensor("quantize_int8", q, (rows, width), floating=False, what="returned as q")
    scales = expect_tensor("quantize_int8", scales, (rows,), what="returned as scales")
    if q.dtype != torch.int8:
        raise Mismatch(f"q is a {str(q.dtype).removeprefix('torch.')} tensor; expected int8 (1 byte a weight)",
                       "Which dtype does your q have when you return it?")
    if check_dtype and scales.dtype != torch.float32:
        raise Mismatch(f"scales is a {str(scales.dtype).removeprefix('torch.')} tensor; expected float32",
                       **(INT8_BUGS.hint(fns, weight) or {"hint": "Which dtype do your scales have when you return "
                                                                  "them?"}))
    return q, scales.float()


INT8_HINT = ("For one row of this case, work out by hand its largest magnitude, its scale, and q of its largest "
             "weight; then print yours.")


def _int8_error(fns):
    w = _rows_of_different_sizes(200)
    q, scales = _int8(fns, w)
    error = (q.float() * scales[:, None] - w).abs() / scales[:, None]  # in steps of each row's grid
    worst = float(error.max()) if not bool(torch.isnan(error).any()) else math.nan
    if not worst <= 0.5 + 1e-4:
        row = int(error.nan_to_num(math.inf).amax(1).argmax())
        raise Mismatch(f"q * scales misses a weight by {worst:.3g} of its row's step (row {row}); expected at most "
                       "0.5", **INT8_BUGS.hint(fns, w))


def _int8_grid(fns):
    w = _rows_of_different_sizes(201)
    q, scales = _int8(fns, w)
    top = q.to(torch.int64).abs().amax(1)  # (rows,)
    if not bool((top == 127).all()):
        row = int((top != 127).nonzero()[0])
        raise Mismatch(f"row {row}'s largest |q| is {int(top[row])}; expected 127 (each row's largest weight on "
                       "the end of its grid)", **INT8_BUGS.hint(fns, w))


def _int8_zero_row(fns):
    w = _rows_of_different_sizes(202)
    w[3] = 0
    q, scales = _int8(fns, w)
    if not bool(torch.isfinite(scales).all()) or not float(scales[3]) > 0 or bool((q[3] != 0).any()):
        raise Mismatch(f"an all-zero row got scale {float(scales[3]):.3g} and q values "
                       f"{sorted(set(q[3].tolist()))[:3]}; expected a finite, positive scale and q = 0",
                       **INT8_BUGS.hint(fns, w))


def _int8_real(fns):
    w = tiny_model().model.layers[0].mlp.down_proj.weight.detach()  # (256, 688): a real layer's shape
    q, scales = _int8(fns, w)
    relative = float((q.float() * scales[:, None] - w).norm() / w.norm())
    if not relative < 0.01:
        raise Mismatch(f"a layer of the tiny model comes back with a relative error of {relative:.2%}; expected "
                       "under 1%", **INT8_BUGS.hint(fns, w))


INT8 = Task("quantize_int8", "2.5", ("quantize_int8",), (
    Property("returns q (out, in) int8 and scales (out,) float32: one scale per output row",
             "Check what you return: q's shape and dtype, the scales' shape and dtype.",
             lambda fns: _int8(fns, _rows_of_different_sizes(203), check_dtype=True)),
    Property("q * scales is within half a step of every weight", INT8_HINT, _int8_error),
    Property("each row's largest |weight| lands on +-127: every row uses its whole grid", INT8_HINT, _int8_grid),
    Property("an all-zero row: q = 0 and a finite, positive scale",
             "What is a zero row's largest magnitude, and what does your scale become?", _int8_zero_row),
    Property("a real layer comes back within 1% (relative error of the matrix)", INT8_HINT, _int8_real,
             central=True),
))


# --- quantize_int4 ------------------------------------------------------------------------------------------

def _int4_slip(weight, axis="row", levels=15, rounding=torch.round, guard=True, signed=False, strided=False,
               zero_point=False):
    """Asymmetric int4 per group of 32 of a row (Q4_1), and the usual slips (flags)."""
    out, width = weight.shape
    if axis == "column":
        groups = weight.t().reshape(width, out // GROUP, GROUP)
    elif strided:  # (out, 32, in // 32): each "group" takes every (in // 32)-th weight
        groups = weight.reshape(out, GROUP, width // GROUP).transpose(1, 2)
    else:
        groups = weight.reshape(out, width // GROUP, GROUP)
    if signed or zero_point:  # a symmetric grid around 0: scale max |w| / 7
        scales = groups.abs().amax(-1) / 7
        q = torch.round(groups / scales[..., None]).clamp(-8, 7) + (8 if zero_point else 0)
        mins = -8 * scales if zero_point else torch.zeros_like(scales)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        spread = high - low
        scales = torch.where(spread > 0, spread / levels, torch.ones_like(low)) if guard else spread / levels
        q, mins = rounding((groups - low[..., None]) / scales[..., None]).clamp(0, 15), low
    if axis == "column":
        return q.reshape(width, out).t().to(torch.uint8), scales.t(), mins.t()
    if strided:
        q = q.transpose(1, 2)
    return q.reshape(out, width).to(torch.int8 if signed else torch.uint8), scales, mins


def _int4_outcome(function, weight):
    q, scales, mins = function(weight.clone())
    return q.to(torch.int64), scales.float(), mins.float()


def _groups_of_different_sizes(seed: int) -> torch.Tensor:
    """(64, 128) weights whose groups differ in spread and in centre (none centred on 0)."""
    w = randn(64, 128, seed=seed)
    scale = torch.logspace(-2, 1, 4).repeat_interleave(GROUP)  # (128,): each group of a row its own spread
    return w * scale + torch.linspace(-3, 3, 64)[:, None]  # (64, 128)


def _int4_probes():
    constant = _groups_of_different_sizes(450)
    constant[2, GROUP:2 * GROUP] = 0.25
    return [(_groups_of_different_sizes(451),), (constant,)]


INT4_BUGS = Catalogue("quantize_int4", expected_int4, (
    Bug("int4.over_16", "a scale of (max - min) / 16", "16 levels make 15 steps: q = 15 must land on the "
        "group's largest weight.", lambda w: _int4_slip(w, levels=16)),
    Bug("int4.floor", "q rounded down (or cut by a cast to an integer type)", "Round to the nearest step.",
        lambda w: _int4_slip(w, rounding=torch.floor)),
    Bug("int4.constant_group", "a division by a constant group's zero spread", "A group whose weights are all "
        "equal has max = min: give it scale 1 (its q is 0 and its minimum is the value).",
        lambda w: _int4_slip(w, guard=False)),
    Bug("int4.strided", "groups of every (in / 32)-th weight (a reshape to (out, 32, in / 32))", "A group is "
        "32 consecutive weights of a row: which reshape puts weights 0..31 of a row in group 0?",
        lambda w: _int4_slip(w, strided=True)),
    Bug("int4.zero_point", "a symmetric grid (scale max |w| / 7) shifted by a zero point of 8", "Q4_1 is "
        "asymmetric: each group's grid runs from its own minimum to its maximum in 15 steps. A symmetric grid "
        "around 0 wastes levels on a group that is not centred on 0.", lambda w: _int4_slip(w, zero_point=True)),
), _int4_probes, observe=_int4_outcome)


def _int4(fns, weight):
    out = call(fns["quantize_int4"], weight.clone())
    if not (isinstance(out, tuple) and len(out) == 3):
        raise wrong_value("quantize_int4", out, "a triple (q, scales, mins)")
    rows, width = weight.shape
    q, scales, mins = out
    for name, value in (("scales", scales), ("mins", mins)):
        if isinstance(value, torch.Tensor) and tuple(value.shape) in ((rows // GROUP, width), (width // GROUP,)):
            raise Mismatch(f"{name} has shape {tuple(value.shape)}; expected ({rows}, {width // GROUP})",
                           "Along which axis do your groups of 32 run: a row's inputs, or a column's outputs?")
        if isinstance(value, torch.Tensor) and tuple(value.shape) in ((rows,), (rows, 1)):
            raise Mismatch(f"{name} has shape {tuple(value.shape)}, one per row; expected ({rows}, "
                           f"{width // GROUP}), one per group of 32", "How many groups of 32 does a row of "
                           f"{width} weights have, and does each get its own scale and minimum?")
    q = expect_tensor("quantize_int4", q, (rows, width), floating=False, what="returned as q")
    scales = expect_tensor("quantize_int4", scales, (rows, width // GROUP), what="returned as scales")
    mins = expect_tensor("quantize_int4", mins, (rows, width // GROUP), what="returned as mins")
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise Mismatch(f"q holds values from {int(q.min())} to {int(q.max())}; expected 0..15 (4 bits counted up "
                       "from the group's minimum)", "What is the smallest q of a group, and the largest?")
    return q, scales.float(), mins.float()


INT4_HINT = ("For one group of this case, work out by hand its minimum, its maximum, its scale and the q of "
             "its largest weight; then print yours.")


def _int4_error(fns):
    w = _groups_of_different_sizes(210)
    q, scales, mins = _int4(fns, w)
    error = (dequantize_groups(q, scales, mins) - w).abs()
    per_step = error.reshape(w.shape[0], -1, GROUP) / scales[..., None]
    worst = float(per_step.max()) if not bool(torch.isnan(per_step).any()) else math.nan
    if not worst <= 0.5 + 1e-4:
        raise Mismatch(f"q * scale + min misses a weight by {worst:.3g} of its group's step; expected at most "
                       "0.5", **INT4_BUGS.hint(fns, w))


def _int4_ends(fns):
    w = _groups_of_different_sizes(211)
    q, scales, mins = _int4(fns, w)
    groups = q.to(torch.int64).reshape(w.shape[0], -1, GROUP)
    if not (bool((groups.amin(-1) == 0).all()) and bool((groups.amax(-1) == 15).all())):
        raise Mismatch(f"the groups' q run from {int(groups.amin(-1).max())} to {int(groups.amax(-1).min())} "
                       "at worst; expected each group to use 0..15", **INT4_BUGS.hint(fns, w))


def _int4_constant(fns):
    w = _groups_of_different_sizes(212)
    w[2, GROUP:2 * GROUP] = 0.25
    q, scales, mins = _int4(fns, w)
    back = dequantize_groups(q, scales, mins)[2, GROUP:2 * GROUP]
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()) or not torch.allclose(
            back, torch.full_like(back, 0.25)):
        raise Mismatch(f"a group of 32 weights all equal to 0.25 comes back as {float(back[0]):.3g}; expected "
                       "0.25 with a positive scale", **INT4_BUGS.hint(fns, w))


def _int4_real(fns):
    w = tiny_model().model.layers[0].mlp.up_proj.weight.detach()
    q, scales, mins = _int4(fns, w)
    relative = float((dequantize_groups(q, scales, mins) - w).norm() / w.norm())
    if not relative < 0.1:
        raise Mismatch(f"a layer of the tiny model comes back with a relative error of {relative:.1%}; expected "
                       "under 10%", **INT4_BUGS.hint(fns, w))


INT4 = Task("quantize_int4", "2.5", ("quantize_int4",), (
    Property("returns q (out, in) in 0..15, scales and mins (out, in // 32)",
             "Check what you return: q's shape and values, the shapes of scales and mins.",
             lambda fns: _int4(fns, _groups_of_different_sizes(213))),
    Property("q * scale + min is within half a step of every weight", INT4_HINT, _int4_error),
    Property("each group's smallest weight has q = 0 and its largest q = 15: the grid spans the group", INT4_HINT,
             _int4_ends, central=True),
    Property("a group whose weights are all equal comes back exactly, with a positive scale",
             "What is the spread of a constant group, and what does your scale become?", _int4_constant),
    Property("a real layer comes back within 10% (relative error of the matrix)", INT4_HINT, _int4_real,
             central=True),
))


# --- bytes_per_step -----------------------------------------------------------------------------------------

def expected_bytes(model, context_len: int) -> int:
    """What a decode step of one sequence reads: minillm's count of the weights and the KV cache."""
    return streamed_bytes(model) + kv_cache_bytes(model.config, context_len, 1, model.dtype)


def _counted(model, context_len, table="skip untied", once=True, element=True, tensors="state_dict", kv=True,
             kv_two=True, kv_heads="kv", kv_bytes=None, unit=1):
    """A count of the bytes of a step, and the usual slips (flags)."""
    embed = model.model.embed_tokens.weight
    tied = any(t.data_ptr() == embed.data_ptr() for t in model.lm_head.state_dict().values())
    listed = list(model.parameters()) if tensors == "parameters" else list(model.state_dict().values())
    seen, total = set(), 0
    for t in listed:
        is_table = t.data_ptr() == embed.data_ptr()
        if (once and t.data_ptr() in seen) or (is_table and (table == "never" or table == "skip untied"
                                                             and not tied)):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * (t.element_size() if element else 1)
    c = model.config
    heads = c.n_kv_heads if kv_heads == "kv" else c.n_heads
    per = model.dtype.itemsize if kv_bytes is None else kv_bytes
    total += ((2 if kv_two else 1) * c.n_layers * heads * c.head_dim * context_len * per) if kv else 0
    return total if unit == 1 else total / unit


def _count(**slip):
    return lambda model, context_len: _counted(model, context_len, **slip)


def _bytes_probes():
    return [(tiny_model(), 40), (_tied_model(), 40), (_int8_model(), 100), (_bf16_model(), 900)]


BYTES_BUGS = Catalogue("bytes_per_step", expected_bytes, (
    Bug("bytes.untied_table", "a count with the untied embedding table", "An embedding table is looked up, "
        "one row per token: a step reads it only when the head shares it (tied).", _count(table="always")),
    Bug("bytes.tied_twice", "a tied table counted twice", "A tied head is the embedding table itself (the "
        "same storage, the same data_ptr()): count each tensor once.", _count(once=False)),
    Bug("bytes.no_table", "a count that never includes the embedding table", "When the head is tied, it "
        "reads the whole table every step: count it, once.", _count(table="never")),
    Bug("bytes.elements", "a count of elements", "Bytes, not elements: each tensor's elements times its "
        "element size.", _count(element=False, kv_bytes=1)),
    Bug("bytes.parameters", "a count of the parameters only", "Quantized weights are buffers, not "
        "parameters: the state_dict holds every stored tensor.", _count(tensors="parameters")),
    Bug("bytes.no_kv", "a count without the KV cache", "A decode step also reads the KV cache of its context.",
        _count(kv=False)),
    Bug("bytes.kv_no_two", "a KV cache without the factor 2", "The cache holds K and V.", _count(kv_two=False)),
    Bug("bytes.kv_query_heads", "a KV cache of the query heads", "Only the KV heads are cached "
        "(config.n_kv_heads): grouped-query attention shares them.", _count(kv_heads="q")),
    Bug("bytes.kv_float32", "a KV cache always in float32", "The cache is kept in the model's compute dtype "
        "(model.dtype).", _count(kv_bytes=4)),
    Bug("bytes.megabytes", "a count in MB", "Return bytes: the prediction divides a bandwidth in bytes by it.",
        _count(unit=10**6)),
    Bug("bytes.mebibytes", "a count in MiB", "Return bytes: the prediction divides a bandwidth in bytes by it.",
        _count(unit=2**20)),
), _bytes_probes)


def _bytes(fns, model, context_len: int):
    return call(fns["bytes_per_step"], model, context_len)


def _bytes_case(make, context_len: int, what: str):
    def run(fns):
        model = make()
        got, expected = _bytes(fns, model, context_len), expected_bytes(model, context_len)
        got = expect_number("bytes_per_step", got)
        if got != expected:
            raise Mismatch(f"{what}, context {context_len}: got {got:,.6g}; expected {expected:,}",
                           **BYTES_BUGS.hint(fns, model, context_len))
    return run


def _bytes_type(fns):
    value = _bytes(fns, tiny_model(), 8)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Mismatch(f"bytes_per_step returned {value!r}; expected an int (a number of bytes)",
                       **BYTES_BUGS.hint(fns, tiny_model(), 8))


@wire.shared("lab2_5.tied_model")
@functools.lru_cache(maxsize=1)
def _tied_model():
    return build_model(ModelConfig(tie_embeddings=True, n_kv_heads=2))


@wire.shared("lab2_5.int8_model")
@functools.lru_cache(maxsize=1)
def _int8_model():
    return make_variant(tiny_model(), "int8")  # Int8Linear buffers; bfloat16 activations and KV


@wire.shared("lab2_5.bf16_model")
@functools.lru_cache(maxsize=1)
def _bf16_model():
    return make_variant(tiny_model(), "bfloat16-linear")


BYTES_HINT = ("List the tensors your count includes for this model, with the bytes of each, and compare them "
              "with what one decode step reads: each weight once, and the KV cache of the context.")
BYTES = Task("bytes_per_step", "2.5", ("bytes_per_step",), (
    Property("returns an int (a number of bytes)", "Does a division or a unit creep into your count?",
             _bytes_type),
    Property("an untied float32 model: every matrix and norm, not the embedding table, plus the KV cache",
             BYTES_HINT, _bytes_case(tiny_model, 40, "the tiny model (float32, untied)"), central=True),
    Property("a tied head reads the embedding table: counted once", BYTES_HINT,
             _bytes_case(_tied_model, 40, "a tiny model whose head is its embedding table")),
    Property("an int8 model: its weights are buffers (q and scales), its KV cache bfloat16", BYTES_HINT,
             _bytes_case(_int8_model, 100, "the tiny model with int8 weights")),
    Property("a bfloat16 model at a long context: 2 bytes a weight and a cached element", BYTES_HINT,
             _bytes_case(_bf16_model, 900, "the tiny model in bfloat16")),
))


# --- predict_tokens_per_s -----------------------------------------------------------------------------------

PREDICT_BUGS = Catalogue("predict_tokens_per_s", lambda b, gb: gb * 1e9 / b, (
    Bug("predict.gib", "a GB taken as 2**30 bytes", "A GB is 10**9 bytes (a GiB is 2**30).",
        lambda b, gb: gb * 2**30 / b),
    Bug("predict.inverted", "seconds per token (bytes / bandwidth)", "The rate is the inverse: bytes per "
        "second divided by the bytes of a step.", lambda b, gb: b / (gb * 1e9)),
    Bug("predict.no_giga", "a bandwidth left in GB/s", "Turn GB/s into bytes per second before dividing.",
        lambda b, gb: gb / b),
    Bug("predict.inverted_no_giga", "bytes divided by GB/s", "The rate is bytes per second (GB/s x 10**9) "
        "divided by the bytes of a step.", lambda b, gb: b / gb),
), lambda: [(250_000_000, 20.0), (400_000_000, 10.0), (1_000_000, 1.5)])


def _predict(fns, step_bytes, gb_s):
    return expect_number("predict_tokens_per_s", call(fns["predict_tokens_per_s"], step_bytes, gb_s))


PREDICT_HINT = "How many bytes arrive in a second at this bandwidth, and how many does one step need?"


def _predict_value(fns):
    step_bytes, gb_s = 250_000_000, 20.0
    got, expected = _predict(fns, step_bytes, gb_s), gb_s * 1e9 / step_bytes
    if not math.isclose(got, expected, rel_tol=1e-9):
        raise Mismatch(f"250 MB a step at 20 GB/s: got {got:.6g} tokens/s; expected {expected:g}",
                       **PREDICT_BUGS.hint(fns, step_bytes, gb_s))


def _predict_scaling(fns):
    base = _predict(fns, 400_000_000, 10.0)
    for step_bytes, gb_s, factor in ((200_000_000, 10.0, 2), (400_000_000, 30.0, 3)):
        got = _predict(fns, step_bytes, gb_s)
        if not math.isclose(got, base * factor, rel_tol=1e-9):
            raise Mismatch(f"400 MB at 10 GB/s gave {base:.4g} tokens/s, {step_bytes / 1e6:.0f} MB at {gb_s:g} GB/s "
                           f"gave {got:.4g}; expected {base * factor:.4g}",
                           **PREDICT_BUGS.hint(fns, step_bytes, gb_s))


PREDICT = Task("predict_tokens_per_s", "2.5", ("predict_tokens_per_s",), (
    Property("250 MB a step at 20 GB/s allows 80 steps a second", PREDICT_HINT, _predict_value, central=True),
    Property("halving the bytes doubles the bound; tripling the bandwidth triples it", PREDICT_HINT,
             _predict_scaling),
))


# --- decode_tokens_per_s ------------------------------------------------------------------------------------

def _rate_reference(start, times):
    if len(times) < 2:
        raise ValueError("fewer than two tokens")
    return 1 / statistics.median(b - a for a, b in zip(times, times[1:]))


STEADY = [2.0 + 0.0625 * i for i in range(9)]  # a 2 s prefill, then a token every 62.5 ms
PAUSED = [0.5 + 0.125 * i for i in range(6)] + [0.5 + 0.125 * 5 + 1.0 + 0.125 * i for i in range(1, 5)]


def _gaps(times):
    return [b - a for a, b in zip(times, times[1:])]


RATE_BUGS = Catalogue("decode_tokens_per_s", _rate_reference, (
    Bug("rate.whole_run", "the whole run's rate, the prefill included", "The first token waited for the "
        "prompt: the steady decode rate comes from the gaps between tokens.",
        lambda s, t: len(t) / (t[-1] - s)),
    Bug("rate.whole_run_gaps", "n - 1 tokens over the whole run", "The first token waited for the prompt: "
        "the steady decode rate comes from the gaps between tokens.", lambda s, t: (len(t) - 1) / (t[-1] - s)),
    Bug("rate.n_over_span", "n tokens over n - 1 gaps", "n tokens have n - 1 gaps.",
        lambda s, t: len(t) / (t[-1] - t[0])),
    Bug("rate.mean", "the rate of the mean gap", "One pause (another program, a page fault) drags a mean; "
        "the median gap is what a step takes.", lambda s, t: 1 / statistics.fmean(_gaps(t))),
    Bug("rate.seconds", "the median gap itself (seconds per token)", "Tokens per second is the inverse of "
        "seconds per token.", lambda s, t: statistics.median(_gaps(t))),
    Bug("rate.milliseconds", "the median gap in milliseconds", "Tokens per second is the inverse of seconds "
        "per token.", lambda s, t: 1e3 * statistics.median(_gaps(t))),
), lambda: [(0.0, list(STEADY)), (0.0, list(PAUSED)), (1.0, [1.5, 1.75, 2.0, 2.5, 2.625])])


def _rate(fns, start, times):
    return expect_number("decode_tokens_per_s", call(fns["decode_tokens_per_s"], start, list(times)))


def _rate_case(start, times, what):
    def run(fns):
        got, expected = _rate(fns, start, times), _rate_reference(start, times)
        if not math.isclose(got, expected, rel_tol=1e-6):
            raise Mismatch(f"{what}: got {got:.6g} tokens/s; expected {expected:.6g}",
                           **RATE_BUGS.hint(fns, start, list(times)))
    return run


def _rate_short(fns):
    try:
        value = call(fns["decode_tokens_per_s"], 0.0, [0.5])
    except LearnerError as exc:
        if isinstance(exc.__cause__, ValueError):
            return
        raise
    raise Mismatch(f"one token (no gap between tokens) gave {value!r}; expected it to raise ValueError",
                   "How many gaps does one token have, and what does your function do then?")


RATE_HINT = ("Which times does your rate come from: the start, the first token, or the gaps between tokens? "
             "Work this case out by hand.")
DECODE = Task("decode_tokens_per_s", "2.5", ("decode_tokens_per_s",), (
    Property("a steady run after a long prefill: 1 / the gap between tokens", RATE_HINT,
             _rate_case(0.0, STEADY, "a 2 s prefill, then a token every 62.5 ms"), central=True),
    Property("one pause in the run does not change it (the median gap)", RATE_HINT,
             _rate_case(0.0, PAUSED, "a token every 125 ms with one 1.125 s gap")),
    Property("raises ValueError with fewer than two tokens",
             "What does your function do with one token?", _rate_short),
))


# --- the prediction against a measurement (SmolLM2 on this machine) -------------------------------------------

PROMPT = "Explain in detail how a refrigerator keeps food cold."
LOW, HIGH = 1 / 12, 1.5  # the measured rate must fall within these multiples of the bound


@functools.lru_cache(maxsize=1)
def smollm2():
    """SmolLM2-135M-Instruct in float32 on the CPU, and its tokenizer (loaded once per process)."""
    return load_pretrained("smollm2-135m-instruct", device="cpu")


@wire.shared("lab2_5.smollm2")
def smollm2_model():
    """The model of ``smollm2()`` (it travels to the notebook's process by name)."""
    return smollm2()[0]


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


FAR_BELOW_HINT = ("The measured rate is far below your bound. Follow the units from bytes_per_step to the "
                  "rate: bytes, bytes per second, steps per second.")
ABOVE_HINT = ("The measured rate beats your bound, which no machine can do: which of your counts could be too "
              "small (bytes), or too large (bandwidth)?")


def _written(fns) -> None:
    """Call each function once on small inputs, so that a stub fails before SmolLM2 is loaded."""
    call(fns["bytes_per_step"], tiny_model(), 8)
    call(fns["predict_tokens_per_s"], 10**8, 10.0)
    call(fns["decode_tokens_per_s"], 0.0, [0.5, 0.625, 0.75])


def _bytes_of_smollm2(fns):
    _written(fns)
    model, tokenizer = smollm2_model(), smollm2()[1]
    context = len(tokenizer.encode_chat(PROMPT)) + 8
    got = expect_number("bytes_per_step", call(fns["bytes_per_step"], model, context))
    expected = expected_bytes(model, context)
    if got != expected:
        raise Mismatch(f"SmolLM2 in float32 (its head tied to the embedding table), context {context}: got "
                       f"{got:,.6g} bytes; expected {expected:,}", **BYTES_BUGS.hint(fns, model, context))


def _prediction_on_smollm2(fns):
    _written(fns)
    model, tokenizer = smollm2_model(), smollm2()[1]
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
                    Property("SmolLM2's bytes a step, counted from its real tensors", BYTES_HINT,
                             _bytes_of_smollm2, seconds=300, central=True),
                    Property(f"SmolLM2 in float32 on this CPU runs at x{LOW:.2g} to x{HIGH:g} of your bound",
                             PREDICT_HINT, _prediction_on_smollm2, seconds=300, central=True),
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
