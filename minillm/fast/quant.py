"""Fewer bytes per weight: bfloat16 and int8 weight-only variants of a loaded model.

A decode step reads every weight once (chapter 2.3), so its speed is about
bandwidth / bytes per step. Two ways to move fewer bytes without retraining:

* bfloat16: weights and activations in 16 bits instead of 32;
* int8 weight-only: each matmul weight stored as int8 with one scale per output row; the
  activations stay in the compute dtype (bfloat16). The product comes from a kernel that
  reads the int8 weight (``torch._weight_int8pack_mm``), or from dequantizing the weight
  and calling ``F.linear``, which writes and re-reads a full-precision copy every call and
  so spends the bytes it saved.

Fewer bytes stored are not fewer bytes moved: the kernel decides. ``MatVecLinear`` routes
one token's bfloat16 matmuls around a CPU kernel that rearranges the weight first.
``make_variant(model, name)`` builds each variant from a float32 model; ``streamed_bytes``
counts what one decode step reads; ``mean_nll`` and ``greedy_match`` measure quality.
``minillm.fast.precision.load_precision`` names these variants, with the GGUF file's own 4-bit weights.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoints.hf import load_state_dict_into
from ..model import CausalLM, empty_model

KERNELS = ("auto", "int8pack", "dequant")
INT8PACK_IN_MULTIPLE = 16  # _weight_int8pack_mm: garbage (or a crash) for other widths
INT8PACK_MAX_ROWS = 32  # its time grows with the rows: a prompt is dequantized once
VARIANTS: dict[str, str] = {
    "float32": "weights and activations in float32 (4 bytes a weight)",
    "bfloat16-linear": "weights and activations in bfloat16 (2 bytes), F.linear",
    "bfloat16": "the same, a few rows' matmuls weight-first where that is faster here (MatVecLinear)",
    "int8": "int8 weights, a bfloat16 scale per output row, bfloat16 activations",
    "int8-dequant": "the same int8 weights, dequantized before every F.linear",
    "float32-matvec": "float32 weights and activations, a few rows' matmuls weight-first where that is faster "
                      "here (MatVecLinear)",
}


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``weight ~ q * scales[:, None]``.

    weight: (out, in), floating point, finite. Each row gets scale = max|row| / 127: its
    largest entry maps to +-127 and no entry moves by more than scale / 2. An all-zero row
    gets scale 1 (its q is 0). Returns q: (out, in) int8 and scales: (out,) float32.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor (out, in), got shape "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point to quantize, got {weight.dtype}")
    w = weight.detach().float()  # (out, in)
    if not torch.isfinite(w).all():
        raise ValueError("weight holds inf or nan; int8 scales need finite values")
    amax = w.abs().amax(dim=1)  # (out,)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # (out,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """The weight an int8 matrix stands for: ``q * scales[:, None]`` in ``dtype``."""
    return q.to(dtype) * scales.to(dtype)[:, None]


@functools.cache
def int8pack_available(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch has ``_weight_int8pack_mm`` for ``device_type`` and ``dtype``."""
    if not hasattr(torch, "_weight_int8pack_mm"):
        return False
    n = INT8PACK_IN_MULTIPLE
    x = torch.ones(1, n, dtype=dtype, device=device_type)  # (1, in)
    q = torch.ones(n, n, dtype=torch.int8, device=device_type)  # (out, in)
    scales = torch.ones(n, dtype=dtype, device=device_type)  # (out,)
    try:
        out = torch._weight_int8pack_mm(x, q, scales)  # (1, out), every entry n
    except (RuntimeError, NotImplementedError):
        return False
    return bool((out == n).all())


def check_int8pack(in_features: int, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError where ``torch._weight_int8pack_mm`` cannot be used."""
    if not int8pack_available(device.type, dtype):
        raise ValueError(f"torch {torch.__version__} has no _weight_int8pack_mm for "
                         f"{device.type} with {dtype} activations; use kernel='dequant'")
    if in_features % INT8PACK_IN_MULTIPLE:
        raise ValueError(f"in_features={in_features} is not a multiple of "
                         f"{INT8PACK_IN_MULTIPLE}, which _weight_int8pack_mm needs; "
                         f"use kernel='dequant'")


class Int8Linear(nn.Module):
    """``y = x @ (q * scales[:, None])^T``: 1 byte a weight plus one scale per output row.

    ``kernel="int8pack"``: ``torch._weight_int8pack_mm`` reads q and the scales as they
    are (up to ``INT8PACK_MAX_ROWS`` rows: decode). ``"dequant"``, and any prompt:
    rebuild the weight in the activations' dtype, then ``F.linear``. Portable, but for one
    token it writes and re-reads a full-precision weight: the bytes saved are spent again.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 kernel: str):
        super().__init__()
        if kernel not in KERNELS[1:]:
            raise ValueError(f"kernel={kernel!r}; choose one of {KERNELS[1:]}")
        if kernel == "int8pack":
            check_int8pack(q.shape[1], q.device, dtype)
        self.register_buffer("q", q)  # (out, in) int8
        self.register_buffer("scales", scales.to(dtype))  # (out,) in the compute dtype
        self.kernel = kernel

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype, kernel: str = "auto"):
        """Quantize an ``nn.Linear`` (no bias); ``"auto"``: int8pack where it works."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}; choose one of {KERNELS}")
        if getattr(linear, "bias", None) is not None:
            raise ValueError("Int8Linear has no bias; this linear layer has one")
        if kernel == "auto":
            usable = (int8pack_available(linear.weight.device.type, dtype)
                      and linear.in_features % INT8PACK_IN_MULTIPLE == 0)
            kernel = "int8pack" if usable else "dequant"
        q, scales = quantize_int8(linear.weight)
        return cls(q, scales, dtype, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in)
        if self.kernel == "int8pack" and rows.shape[0] <= INT8PACK_MAX_ROWS:
            out = torch._weight_int8pack_mm(rows, self.q, self.scales)  # (N, out)
        else:
            weight = dequantize_int8(self.q, self.scales, x.dtype)  # (out, in), rebuilt
            out = F.linear(rows, weight)  # (N, out)
        return out.view(*x.shape[:-1], -1)


@functools.cache
def onednn_bf16_pack_problem() -> str | None:
    """Why oneDNN cannot pack a bfloat16 weight ahead of time on this CPU (None: it can).

    Its bfloat16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: on a CPU without them (or
    under ``ONEDNN_MAX_CPU_ISA=AVX2``) it raises, so a small weight is tried once.
    """
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return f"torch {torch.__version__} has no mkldnn._reorder_linear_weight"
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 1)
    except (RuntimeError, NotImplementedError) as error:
        return str(error).splitlines()[0]
    return None


def onednn_packed_linear(weight: torch.Tensor):
    """``x -> x @ weight^T`` for one bfloat16 row (1, in), through oneDNN's linear with ``weight`` (out, in)
    packed once, ahead of time, into the layout its kernel reads (what ``torch.compile``'s ``freezing``
    does on a CPU). ValueError with the reason where this CPU cannot (``onednn_bf16_pack_problem``)."""
    problem = onednn_bf16_pack_problem()
    if problem:
        raise ValueError(f"oneDNN cannot pack a bfloat16 weight here: {problem}")
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # for 1-row inputs
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


MATVEC_MAX_ROWS = 8  # more rows: F.linear's blocked kernels


def weight_first(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows @ weight^T`` with the weight as the first operand: ``weight @ x`` (torch.mv) for one row,
    ``(weight @ rows^T)^T`` for a few. rows: (N, in) -> (N, out)."""
    if rows.shape[0] == 1:
        return torch.mv(weight, rows[0])[None]
    return (weight @ rows.T).T.contiguous()  # contiguous: the next layer reads it row by row


@functools.cache
def weight_first_pays(shape: tuple[int, int], dtype: torch.dtype, rows: int) -> bool:
    """Whether ``weight_first`` beats ``F.linear`` on this CPU for ``rows`` rows and a weight of ``shape``
    (out, in) in ``dtype``: both timed on a random weight, best of 3 runs of 2 calls, at the threads set
    now; it pays below 0.8x. Measured once per shape, dtype and row count.

    The answer depends on the CPU, the shape and what PyTorch hands the product to. On an AVX-512 CPU with
    bfloat16 instructions: bfloat16 ``F.linear`` (oneDNN) beat ``torch.mv`` 2.3x on SmolLM2's head and
    1.4x on its layers; float32 ``F.linear`` on 2 rows took 3.4x the weight-first product on the head
    (49152 x 576) and less than it on the layers."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=generator).to(dtype)  # (out, in)
    x = torch.randn(rows, shape[1], generator=generator).to(dtype)  # (rows, in)

    def best(product) -> float:
        product()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            product()
            product()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.inference_mode():
        return best(lambda: weight_first(weight, x)) < 0.8 * best(lambda: F.linear(x, weight))


class MatVecLinear(nn.Module):
    """A bias-free linear layer that routes a few rows (up to ``MATVEC_MAX_ROWS``: a decode step, a
    speculative check) through ``weight @ x`` where that is faster on this CPU for this shape
    (``weight_first_pays``), and everything else through ``F.linear``.

    ``F.linear(x, weight)`` hands the product to a kernel for (rows x in) x (in x out), the weight second;
    some such kernels rearrange the weight or block it for many rows, which for one or a few rows can cost
    more than the product. ``weight @ x`` streams the weight's rows as stored, through a kernel that may be
    slower still. So the route is measured, not assumed.
    """

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight  # (out, in); the head's is the embedding table when tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        n = rows.shape[0]
        if (n <= MATVEC_MAX_ROWS and rows.device.type == "cpu"
                and weight_first_pays(tuple(self.weight.shape), rows.dtype, min(n, 2))):  # 2 stands for 2-8
            out = weight_first(self.weight, rows)  # (N, out)
        else:
            out = F.linear(rows, self.weight)  # (N, out)
        return out.view(*x.shape[:-1], -1)


def replace_linears(model: CausalLM, make) -> CausalLM:
    """Replace each ``nn.Linear`` (attention, MLP, head) by ``make(linear)``, in place."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("the model has no nn.Linear left to replace "
                         "(already quantized?)")
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(linear))
    return model


def quantize_model(model: CausalLM, kernel: str = "auto") -> CausalLM:
    """Replace every linear layer (attention, MLP, head) by an ``Int8Linear``, in place.

    The activations keep the model's dtype; embeddings and norms are not quantized (a
    lookup reads one row of the table; a norm is a vector). A tied head gets an int8 copy.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; choose one of {KERNELS}")
    dtype = model.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the model's dtype {dtype} is not a float dtype to compute in")
    return replace_linears(model, lambda lin: Int8Linear.from_linear(lin, dtype, kernel))


def make_variant(model: CausalLM, name: str) -> CausalLM:
    """A new model: the float32 ``model`` as one of ``VARIANTS`` (``model`` unchanged)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose one of {list(VARIANTS)}")
    if model.dtype != torch.float32 or not isinstance(model.lm_head, nn.Linear):
        raise ValueError(f"make_variant starts from a float32 model with nn.Linear "
                         f"layers, got dtype {model.dtype} and head "
                         f"{type(model.lm_head).__name__}")
    dtype = torch.float32 if name.startswith("float32") else torch.bfloat16
    copy = empty_model(model.config, model.device, dtype)
    copy = load_state_dict_into(copy, model.state_dict()).eval().requires_grad_(False)
    if name in ("bfloat16", "float32-matvec"):
        replace_linears(copy, lambda linear: MatVecLinear(linear.weight))
    elif name.startswith("int8"):
        quantize_model(copy, "dequant" if name == "int8-dequant" else "auto")
    return copy


def streamed_bytes(model: CausalLM) -> int:
    """Bytes of weights one decode step reads: every parameter and persistent buffer once,
    except an embedding table that only lookups read (one row per token)."""
    embed = model.model.embed_tokens.weight.data_ptr()
    head = list(model.lm_head.parameters()) + list(model.lm_head.buffers())
    head_reads_embed = any(t.data_ptr() == embed for t in head)
    seen, total = set(), 0
    for tensor in list(model.parameters()) + _persistent_buffers(model):
        address = tensor.data_ptr()
        if address in seen or (address == embed and not head_reads_embed):
            continue
        seen.add(address)
        total += tensor.numel() * tensor.element_size()
    return total


def _persistent_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Every buffer a state dict would save (not the rotary frequencies)."""
    return [buffer for module in model.modules()
            for name, buffer in module.named_buffers(recurse=False)
            if name not in module._non_persistent_buffers_set]


# --- quality ---------------------------------------------------------------------------

# A fixed English passage, written for this book, on which the variants are scored:
# ordinary prose: the loss measures language modelling, not the memory of a famous text.


@torch.inference_mode()
def mean_nll(model: CausalLM, ids: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats per token) of ids[:, 1:], each given its prefix.

    ids: (1, T). Perplexity is exp(mean_nll). The log-softmax is taken in float32 whatever
    the model's dtype, so the number compares variants, not the precision of the loss.
    """
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must have shape (1, T), T >= 2, got {tuple(ids.shape)}")
    logits = model(ids)[0, :-1].float()  # (T-1, vocab): each next token's prediction
    return F.cross_entropy(logits, ids[0, 1:]).item()


@torch.inference_mode()
def greedy_match(model: CausalLM, prompt_ids: list[int], reference: list[int]) -> float:
    """Fraction of ``reference`` (greedy tokens after ``prompt_ids``) that ``model`` also
    ranks first, each given the reference's own prefix (one miss does not derail the
    rest)."""
    if not reference:
        raise ValueError("reference is empty; give the tokens to compare against")
    ids = [list(prompt_ids) + list(reference)]
    ids = torch.tensor(ids, device=model.device)  # (1, P + R)
    start = len(prompt_ids) - 1  # the position whose logits predict reference[0]
    predicted = model(ids)[0, start:start + len(reference)].argmax(-1)  # (R,)
    return (predicted == ids[0, len(prompt_ids):]).float().mean().item()
