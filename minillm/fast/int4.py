"""The checkpoint's own 4-bit weights: SmolLM2's Q4_1 blocks through PyTorch's int4 kernel, as they are.

The GGUF file stores each matmul weight in blocks of 32 along a row: 4-bit integers q (0..15), a scale d
and a minimum m (float16), weight = d * q + m (Q4_1). PyTorch's int4 weight-only kernel
(``torch._weight_int4pack_mm_for_cpu``; ``torch._weight_int4pack_mm`` on CUDA) takes groups of 32 along a
row too, with a scale and a zero per group: weight = (q - 8) * scale + zero. The same integers fit both:

    scale = d,  zero = m + 8 d        (so (q - 8) d + m + 8 d = d q + m)

so the file's bits go into the kernel unchanged, with no float32 copy on the way; only d and m are rounded
to bfloat16, the kernel's scale dtype (and its activations'). The CPU kernel's packed layout is its own
(``torch._convert_weight_to_int4pack_for_cpu`` takes q as int32 (out, in) and returns (out, in / 2)
bytes: per block of 64 output rows, byte (k, j) holds row j's weight k in its low nibble and row j + 32's
in its high one); ``Int4Linear`` hands it q and never reads it back.

SmolLM2's tied head is the token embedding, stored as Q8_0 (int8 q, a scale d per 32: weight = d q). An
int8 q is two 4-bit planes, q = 16 hi + lo with lo in 0..15 and hi in -8..7, so ``Int8AsInt4Linear``
runs it exactly as two int4 products: (lo - 8) d + 8 d and (hi + 8 - 8) 16 d + 0.

Where the kernel is missing or a shape does not fit it (out % 16, in % 32 on the CPU), a layer
dequantizes its weight and calls ``F.linear``: readable, and it says so (``kernel``, ``reason``).

On an x86 CPU with AVX2 the model's default is neither: ``kernel="blockdot"`` (``minillm.fast.blockdot``)
multiplies the file's Q4_1 and Q8_0 blocks with int8 activations, as llama.cpp does: at batch 1 its
matmuls take about half the time of PyTorch's int4 kernel's, and it reads the head once (1.06 bytes a
weight) instead of as two planes; the rest of such a model runs in float32 (``model_dtype``), as llama.cpp's does.
``load_int4`` builds the whole model from a GGUF file; matmul weights stored as floats stay floats, block
types other than Q4_1 and Q8_0 are refused by name.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checkpoints.gguf import BLOCK_WEIGHTS, GGUFCheckpoint, RawTensor, split_q4_1, split_q8_0
from ..checkpoints.pretrained import gguf_checkpoint, gguf_tokenizer
from ..device import resolve_device
from ..model import CausalLM, empty_model
from .blockdot import BlockLinear, blockdot_problem
from .quant import MatVecLinear

GROUP = BLOCK_WEIGHTS  # weights per scale: a GGUF block, and the kernel's group size
KERNELS = ("auto", "int4pack", "dequant")  # an Int4Linear's
MODEL_KERNELS = ("auto", "blockdot", *KERNELS[1:])  # a whole model's: "auto" prefers "blockdot" on a CPU
RAW_TYPES = ("Q4_1", "Q8_0")  # the block types that load as they are
FLOAT_TYPES = ("F32", "F16", "BF16")  # matmul weights stored as floats load as floats (the model dtype)
DTYPE = torch.bfloat16  # the kernel's activations and scales
CPU_OUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu refuses other row counts
CUDA_OUT_MULTIPLE = 8


def scales_and_zeros(d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """Q4_1's d, m (out, G) -> the kernel's (G, out, 2): [..., 0] = d, [..., 1] = m + 8 d, in ``dtype``."""
    return torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).to(dtype).contiguous()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q (out, in) in 0..15 -> (out, in / 2) uint8: weight 2i in the low nibble of byte i, 2i + 1 high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``: (out, in / 2) uint8 -> (out, in) uint8."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(1)


def dequantize_int4(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The weight (out, in) that q (out, in) and scales-and-zeros sz (G, out, 2) stand for, in sz's dtype:
    ``(q - 8) * scale + zero``, each group of 32 along a row with its own scale and zero."""
    scale = sz[..., 0].t().repeat_interleave(GROUP, dim=1)  # (out, in)
    zero = sz[..., 1].t().repeat_interleave(GROUP, dim=1)
    return (q.to(sz.dtype) - 8) * scale + zero


def _cuda_inner_k_tiles(in_features: int) -> int | None:
    """The CUDA kernel's K tiling: in_features must be a multiple of 16 * inner_k_tiles (2, 4 or 8)."""
    return next((t for t in (8, 4, 2) if in_features % (16 * t) == 0), None)


def _pack_for_kernel(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """q (out, in) in 0..15 -> the kernel's packed weight on ``device``."""
    if device.type == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)  # inner_k_tiles: unused on CPU
    high_first = (q[:, 0::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)  # CUDA: even weight high
    return torch._convert_weight_to_int4pack(high_first.to(device), _cuda_inner_k_tiles(q.shape[1]))


def _kernel_mm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x (N, in) bfloat16 -> (N, out) through the device's int4 kernel."""
    if x.device.type == "cpu":
        return torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
    return torch._weight_int4pack_mm(x, packed, GROUP, sz)


@functools.cache
def int4pack_problem(device_type: str) -> str | None:
    """Why the int4 kernel cannot be used on ``device_type`` (None: it can). A probe multiplies a random
    Q4_1 weight and compares with the dequantized product, so a kernel that exists but reads the packed
    nibbles in another order than assumed here is caught rather than trusted."""
    name = "_weight_int4pack_mm_for_cpu" if device_type == "cpu" else "_weight_int4pack_mm"
    if not hasattr(torch, name):
        return f"torch {torch.__version__} has no {name}"
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = 64, 128
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    d = torch.rand(out_features, in_features // GROUP, generator=generator) / 8 + 0.01
    m = -8 * d + torch.randn(d.shape, generator=generator) / 8
    sz = scales_and_zeros(d, m)
    x = torch.randn(2, in_features, generator=generator).to(DTYPE)
    expected = F.linear(x.double(), dequantize_int4(q, sz).double())  # (2, out)
    device = torch.device(device_type)
    try:
        out = _kernel_mm(x.to(device), _pack_for_kernel(q, device), sz.to(device)).cpu().double()
    except (RuntimeError, NotImplementedError) as error:
        return f"{name} failed on {device_type}: {str(error).splitlines()[0]}"
    if not torch.allclose(out, expected, rtol=0.02, atol=0.02 * float(expected.abs().max())):
        return f"{name} gave other numbers than the dequantized weight on {device_type}"
    return None


def kernel_problem(out_features: int, in_features: int, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a layer of this shape cannot use the int4 kernel here (None: it can)."""
    if dtype != DTYPE:
        return f"the int4 kernel is used with bfloat16 activations, not {dtype}"
    problem = int4pack_problem(device.type)
    if problem:
        return problem
    multiple = CPU_OUT_MULTIPLE if device.type == "cpu" else CUDA_OUT_MULTIPLE
    if out_features % multiple:
        return f"out_features={out_features} is not a multiple of {multiple}, which the kernel needs"
    if device.type != "cpu" and _cuda_inner_k_tiles(in_features) is None:
        return f"in_features={in_features} is not a multiple of 32, which the CUDA kernel needs"
    return None


class Int4Linear(nn.Module):
    """``y = x @ W^T`` with W stored as 4-bit q and a scale and zero per group of 32 weights of a row:
    ``W = (q - 8) * scale + zero`` (``dequantize_int4``). Half a byte a weight plus 4 bytes a group.

    ``kernel="int4pack"``: PyTorch's int4 kernel reads q (in its packed layout) and the scales as they are.
    ``"dequant"``: q kept as two nibbles a byte (``pack_nibbles``), the weight rebuilt in the activations'
    dtype before every ``F.linear``; ``reason`` says why a layer took it.
    """

    def __init__(self, q: torch.Tensor, sz: torch.Tensor, kernel: str = "auto", device="cpu",
                 dtype: torch.dtype = DTYPE):
        super().__init__()
        out_features, in_features = q.shape
        if in_features % GROUP or sz.shape != (in_features // GROUP, out_features, 2):
            raise ValueError(f"q {tuple(q.shape)} and scales-and-zeros {tuple(sz.shape)} do not make groups of "
                             f"{GROUP} (in_features must be a multiple of {GROUP}; sz is (in / {GROUP}, out, 2))")
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}; choose one of {KERNELS}")
        device = resolve_device(device)
        problem = kernel_problem(out_features, in_features, device, dtype)
        if kernel == "int4pack" and problem:
            raise ValueError(f"kernel='int4pack' cannot run here: {problem}; use kernel='dequant'")
        if kernel == "auto":
            kernel = "dequant" if problem else "int4pack"
        self.in_features, self.out_features, self.kernel = in_features, out_features, kernel
        self.reason = problem if kernel == "dequant" and problem else (
            "asked for" if kernel == "dequant" else f"the int4 kernel on {device.type}")
        self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=dtype))  # (G, out, 2)
        if kernel == "int4pack":
            self.register_buffer("packed", _pack_for_kernel(q, device))  # the kernel's own layout
        else:
            self.register_buffer("packed", pack_nibbles(q).to(device))  # (out, in / 2) uint8

    @classmethod
    def from_groups(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, **kwargs) -> Int4Linear:
        """Q4_1-style groups: q (out, in) in 0..15, d and m (out, in / 32): weight = d * q + m."""
        if q.dim() != 2 or d.shape != m.shape or d.shape != (q.shape[0], q.shape[1] // GROUP):
            raise ValueError(f"q {tuple(q.shape)}, d {tuple(d.shape)}, m {tuple(m.shape)}: expected q (out, in), "
                             f"d and m (out, in / {GROUP})")
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError(f"q holds values in [{int(q.min())}, {int(q.max())}], outside 4 bits (0..15)")
        return cls(q, scales_and_zeros(d.float(), m.float()), **kwargs)

    @classmethod
    def from_raw(cls, raw: RawTensor, **kwargs) -> Int4Linear:
        """A Q4_1 weight as the GGUF file stores it (``read_gguf(..., raw_types=("Q4_1",))``)."""
        if raw.type != "Q4_1":
            raise ValueError(f"Int4Linear.from_raw takes Q4_1 blocks, got {raw.type}")
        return cls.from_groups(*split_q4_1(raw.blocks), **kwargs)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The (out, in) weight this layer stands for (rebuilt; the int4pack layout is read back through
        the kernel itself: the identity matrix times W^T)."""
        sz = self.scales_and_zeros
        if self.kernel == "dequant":
            return dequantize_int4(unpack_nibbles(self.packed), sz.float()).to(dtype or sz.dtype)
        eye = torch.eye(self.in_features, dtype=sz.dtype, device=sz.device)  # (in, in)
        return _kernel_mm(eye, self.packed, sz).t().to(dtype or sz.dtype)  # (out, in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in)
        if self.kernel == "int4pack":
            out = _kernel_mm(rows, self.packed, self.scales_and_zeros)  # (N, out)
        else:
            q = unpack_nibbles(self.packed)  # (out, in)
            out = F.linear(rows, dequantize_int4(q, self.scales_and_zeros.to(x.dtype)))  # rebuilt every call
        return out.view(*x.shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel!r}"


class Int8AsInt4Linear(nn.Module):
    """A Q8_0 weight (int8 q, a scale d per group of 32: weight = d * q) as two exact 4-bit planes.

    q = 16 hi + lo, lo = q & 15 in 0..15 and hi = q >> 4 in -8..7, so d q = (d lo) + (16 d hi): the low plane
    is an ``Int4Linear`` with scale d and minimum 0, the high one has q = hi + 8, scale 16 d, minimum -128 d.
    Two int4 products read 1.25 bytes a weight, and no weight is rounded (only d, to bfloat16)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, **kwargs):
        super().__init__()
        if q.dtype != torch.int8:
            raise ValueError(f"q must be int8, got {q.dtype}")
        q = q.to(torch.int16)
        self.low = Int4Linear.from_groups(q & 15, d, torch.zeros_like(d), **kwargs)
        self.high = Int4Linear.from_groups((q >> 4) + 8, 16 * d, -128 * d, **kwargs)
        self.in_features, self.out_features = self.low.in_features, self.low.out_features
        self.kernel, self.reason = self.low.kernel, self.low.reason

    @classmethod
    def from_raw(cls, raw: RawTensor, **kwargs) -> Int8AsInt4Linear:
        if raw.type != "Q8_0":
            raise ValueError(f"Int8AsInt4Linear.from_raw takes Q8_0 blocks, got {raw.type}")
        return cls(*split_q8_0(raw.blocks), **kwargs)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.low.dequantized(torch.float32) + self.high.dequantized(torch.float32)).to(dtype or DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.low(x) + self.high(x)


# --- a whole model from a GGUF file -------------------------------------------------------------------------

def _weight_key(model: CausalLM, module_name: str) -> str:
    """The checkpoint tensor behind a linear layer (a tied head reads the embedding)."""
    if module_name == "lm_head" and model.config.tie_embeddings:
        return "model.embed_tokens.weight"
    return f"{module_name}.weight"


def check_int4_loadable(checkpoint: GGUFCheckpoint, names: list[str]) -> None:
    """ValueError naming every matmul weight that ``precision="int4"`` cannot run as the file stores it."""
    refused = [f"{name} ({checkpoint.tensor_types[name]})" for name in names
               if checkpoint.tensor_types[name] not in RAW_TYPES + FLOAT_TYPES]
    if refused:
        raise ValueError(f"{checkpoint.path.name}: precision 'int4' runs the file's own blocks and knows "
                         f"{' and '.join(RAW_TYPES)} (and float weights) only; {len(refused)} matmul weights are "
                         f"stored otherwise: {', '.join(refused[:3])}{', ...' if len(refused) > 3 else ''}; "
                         "load this file with precision 'float32', 'bfloat16' or 'int8' (dequantized)")
    if not any(checkpoint.tensor_types[name] == "Q4_1" for name in names):
        types = sorted({checkpoint.tensor_types[name] for name in names})
        raise ValueError(f"{checkpoint.path.name}: precision 'int4' runs the file's own 4-bit (Q4_1) weights, "
                         f"and this file has none (its matmul weights are {', '.join(types)}); load it with "
                         "precision 'float32', 'bfloat16' or 'int8'")


def model_kernel(device: torch.device, kernel: str = "auto") -> str:
    """The kernel a model's Q4_1 and Q8_0 layers use: ``kernel``, or for "auto" the block kernel on a CPU
    where it runs, else the layers' own choice ("auto": PyTorch's int4 kernel where it fits)."""
    if kernel not in MODEL_KERNELS:
        raise ValueError(f"kernel={kernel!r}; choose one of {MODEL_KERNELS}")
    if kernel == "blockdot" and (device.type != "cpu" or blockdot_problem()):
        raise ValueError(f"kernel='blockdot' cannot run here: "
                         f"{blockdot_problem() if device.type == 'cpu' else 'it is a CPU kernel'}")
    if kernel == "auto" and device.type == "cpu" and not blockdot_problem():
        return "blockdot"
    return kernel


def model_dtype(kernel: str) -> torch.dtype:
    """The activations' dtype: float32 around the block kernel (it rounds them to int8 itself, and bfloat16
    on top doubled the logits' error: mean |difference| from the float32 model 0.21 against 0.16 on
    SmolLM2), bfloat16 for PyTorch's int4 kernel, which takes nothing else."""
    return torch.float32 if kernel == "blockdot" else DTYPE


def int4_model(checkpoint: GGUFCheckpoint, device="cpu", kernel: str = "auto") -> CausalLM:
    """The checkpoint's model with its Q4_1 and Q8_0 weights as the file stores them, float matmul weights
    as ``MatVecLinear``; embedding and norms dequantized to ``model_dtype(kernel)``. ``kernel``
    (``model_kernel``): "blockdot" puts both block types in ``BlockLinear``; the others put Q4_1 in
    ``Int4Linear`` and Q8_0 in ``Int8AsInt4Linear``.

    ``checkpoint`` must hold its Q4_1 and Q8_0 tensors raw (``gguf_checkpoint(path, raw_types=RAW_TYPES)``).
    """
    device = resolve_device(device)
    kernel = model_kernel(device, kernel)
    model = empty_model(checkpoint.config, device, model_dtype(kernel))
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    check_int4_loadable(checkpoint, [_weight_key(model, name) for name, _ in linears])
    params = model.state_dict()
    with torch.no_grad():
        for name, tensor in checkpoint.state_dict.items():  # embedding, norms, float matmul weights
            params[name].copy_(tensor)
    for name, linear in linears:
        key = _weight_key(model, name)
        raw = checkpoint.raw.get(key)
        if raw is None and checkpoint.tensor_types[key] in RAW_TYPES:
            raise ValueError(f"{key} is {checkpoint.tensor_types[key]} but the checkpoint holds it dequantized: "
                             f"read it with raw_types={RAW_TYPES}")
        if raw is None:
            layer = MatVecLinear(linear.weight)
        elif kernel == "blockdot":
            layer = (BlockLinear.from_q4_1(*split_q4_1(raw.blocks)) if raw.type == "Q4_1"
                     else BlockLinear.from_q8_0(*split_q8_0(raw.blocks)))
        elif raw.type == "Q4_1":
            layer = Int4Linear.from_raw(raw, kernel=kernel, device=device)
        else:
            layer = Int8AsInt4Linear.from_raw(raw, kernel=kernel, device=device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return model.eval().requires_grad_(False)


def load_int4(name_or_path="smollm2-135m-instruct", device="cpu", kernel: str = "auto"):
    """(model, tokenizer) of a GGUF file (or a name in ``PACKAGED``) with its own 4-bit weights."""
    checkpoint = gguf_checkpoint(name_or_path, raw_types=RAW_TYPES)
    return int4_model(checkpoint, device, kernel), gguf_tokenizer(checkpoint)


def kernels_used(model: nn.Module) -> dict[str, int]:
    """How many block-weight layers use each kernel, with the reason:
    ``{"blockdot (Q4_1 blocks, int8 activations)": 210, "blockdot (Q8_0 blocks, int8 activations)": 1}``."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, BlockLinear):
            key = f"blockdot ({module.block_type} blocks, int8 activations)"
        elif isinstance(module, Int4Linear):
            key = f"{module.kernel} ({module.reason})"
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts
