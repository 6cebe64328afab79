"""The GGUF file's Q4_1 and Q8_0 blocks multiplied with int8 activations, as llama.cpp does (``blockdot.cpp``).

PyTorch's CPU int4 kernel turns every weight into a float before its multiply-add (16 a vector
instruction), so at batch 1 a core spends its time converting rather than reading. Here the activations are
rounded to int8 too, a scale per block of 32 (as llama.cpp's ``Q8_0`` activations), and a block's dot
product is integer arithmetic, 4 products a 32-bit lane in one instruction (AVX-512 VNNI; AVX2 in two):

    Q4_1 block:  sum_k (d q_k + m) x_k  ~  d dx sum_k q_k qx_k + m dx sum_k qx_k   (qx = round(x / dx))
    Q8_0 block:  sum_k d q_k x_k        ~  d dx sum_k q_k qx_k

The only new rounding is x's to 8 bits (up to 1/254 of a block's largest |x| an element). The minimum m
meets the rounded x, as in llama.cpp, so the rounding errors meet the centred weight d q + m, not d q.

The C++ source is compiled on first use for this CPU's vector width (``torch.utils.cpp_extension``: a C++
compiler and ninja; about 12 s on 2 cores, then cached) and registered as ``torch.ops.minillm.q4_1_mm`` /
``q8_0_mm``, with a shape-only version for ``torch.compile``. ``blockdot_problem()`` says why it cannot run
here (no x86 AVX2, no compiler, a failed build), and the layers fall back to PyTorch's kernel.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import torch
import torch.nn as nn

from ..checkpoints.gguf import BLOCK_WEIGHTS

GROUP = BLOCK_WEIGHTS  # inputs per scale: a GGUF block
ROWS = 16  # output rows a group: the lanes of one AVX-512 vector
SOURCE = Path(__file__).with_name("blockdot.cpp")
FLAGS = {  # the ISA the kernel is compiled for -> compiler flags
    "avx512_vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"],
    "avx2": ["-mavx2", "-mf16c", "-mfma"],
}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def kernel_isa() -> str | None:
    """The widest ISA both this CPU and PyTorch's chosen code path allow ("avx512_vnni", "avx2"), or None.
    ``ATEN_CPU_CAPABILITY=avx2`` (a laptop without AVX-512) selects the AVX2 kernel too."""
    flags, capability = cpu_flags(), torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512") and {"avx512bw", "avx512vl", "avx512_vnni", "f16c"} <= flags:
        return "avx512_vnni"
    if capability.startswith(("AVX2", "AVX512")) and {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return None


@functools.cache
def _build() -> tuple[str | None, str | None]:
    """(the loaded library's path, None), or (None, why the block kernel cannot run here)."""
    isa = kernel_isa()
    if isa is None:
        return None, (f"the block kernel needs an x86 CPU with AVX2 (PyTorch's code path here: "
                      f"{torch.backends.cpu.get_cpu_capability()})")
    if not any(shutil.which(name) for name in (os.environ.get("CXX", "c++"), "c++", "g++")):
        return None, "the block kernel is compiled on first use and no C++ compiler (c++, g++ or $CXX) is on the PATH"
    from torch.utils.cpp_extension import load
    try:  # OpenMP: ATen's parallel_for splits the groups of rows across threads only in code built with it
        path = load(name=f"minillm_blockdot_{isa}", sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp",
                    *FLAGS[isa]], extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:  # a failed build: say so, fall back
        return None, f"building the block kernel failed: {str(error).splitlines()[0]}"
    _register_fakes()
    return str(path), None


def blockdot_problem() -> str | None:
    """Why the block kernel cannot run here (None: it is built, loaded and registered)."""
    return _build()[1]


def blockdot_library() -> str | None:
    """The path of the compiled block kernel (None where it cannot run)."""
    return _build()[0]


def _register_fakes() -> None:
    """Shapes for ``torch.compile``: each op returns (..., out_features) in x's dtype."""
    for name in ("q4_1_mm", "q8_0_mm"):
        torch.library.register_fake(f"minillm::{name}")(
            lambda x, weight, scales, out_features: x.new_empty(*x.shape[:-1], out_features))


def _grouped(t: torch.Tensor) -> torch.Tensor:
    """(out, ...) -> (G, 16, ...): rows padded with zeros to whole groups of 16."""
    pad = -t.shape[0] % ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, ROWS, *t.shape[1:])


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (out, in) in 0..15, d and m (out, in / 32) -> the kernel's weight (G, B, 256) uint8 and scales
    (G, B, 2, 16) float16. Chunk j of a group's block: byte 4 r + t = row r's input 4 j + t (low nibble) and
    input 4 (j + 4) + t (high nibble)."""
    g = _grouped(q.to(torch.uint8)).view(-1, ROWS, q.shape[1] // GROUP, 2, 4, 4)  # (G, r, B, half, j, t)
    packed = g[:, :, :, 0] | (g[:, :, :, 1] << 4)  # (G, r, B, j, t)
    weight = packed.permute(0, 2, 3, 1, 4).reshape(g.shape[0], g.shape[2], 4 * 4 * ROWS)  # (G, B, j r t)
    return weight.contiguous(), _scales(d, m)


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (out, in) int8, d (out, in / 32) -> weight (G, B, 512) (int8 bytes as uint8) and scales
    (G, B, 1, 16) float16. Chunk j of a group's block: byte 4 r + t = row r's input 4 j + t."""
    g = _grouped(q.to(torch.int8)).view(-1, ROWS, q.shape[1] // GROUP, 8, 4)  # (G, r, B, j, t)
    weight = g.permute(0, 2, 3, 1, 4).reshape(g.shape[0], g.shape[2], 8 * 4 * ROWS)  # (G, B, j r t)
    return weight.contiguous().view(torch.uint8), _scales(d)


def _scales(*per_block: torch.Tensor) -> torch.Tensor:
    """(out, B) tensors -> (G, B, len(per_block), 16) float16."""
    return torch.stack([_grouped(t.to(torch.float16)).permute(0, 2, 1) for t in per_block], dim=2).contiguous()


def unpack(weight: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """The (out, in) float32 weight that a packed Q4_1 or Q8_0 layer stands for: the inverse of the packing."""
    G, B, nbytes = weight.shape
    if scales.shape[2] == 2:  # Q4_1: nibbles, d and m
        b = weight.view(G, B, 4, ROWS, 4).permute(0, 3, 1, 2, 4)  # (G, r, B, j, t)
        q = torch.stack([b & 15, b >> 4], dim=3).float()  # (G, r, B, half, j, t)
        d, m = (scales[:, :, i].permute(0, 2, 1).float()[..., None, None, None] for i in (0, 1))
        w = q * d + m
    else:  # Q8_0
        q = weight.view(torch.int8).view(G, B, 8, ROWS, 4).permute(0, 3, 1, 2, 4).float()  # (G, r, B, j, t)
        w = q * scales[:, :, 0].permute(0, 2, 1).float()[..., None, None]
    return w.reshape(G * ROWS, B * GROUP)[:out_features]


class BlockLinear(nn.Module):
    """``y = x @ W^T`` with W as the file's Q4_1 or Q8_0 blocks, through the block kernel (int8
    activations). ``from_q4_1`` / ``from_q8_0`` take the split blocks (``minillm.checkpoints.gguf``)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, in_features: int, out_features: int,
                 block_type: str):
        super().__init__()
        problem = blockdot_problem()
        if problem:
            raise RuntimeError(problem)
        self.in_features, self.out_features, self.block_type = in_features, out_features, block_type
        self.op = torch.ops.minillm.q4_1_mm if block_type == "Q4_1" else torch.ops.minillm.q8_0_mm
        self.register_buffer("weight", weight)  # (G, B, 256 or 512) uint8
        self.register_buffer("scales", scales)  # (G, B, 2 or 1, 16) float16

    @classmethod
    def from_q4_1(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> BlockLinear:
        """q (out, in) in 0..15, d and m (out, in / 32): weight = d q + m."""
        _check_groups(q, d, m)
        return cls(*pack_q4_1(q, d, m), q.shape[1], q.shape[0], "Q4_1")

    @classmethod
    def from_q8_0(cls, q: torch.Tensor, d: torch.Tensor) -> BlockLinear:
        """q (out, in) int8, d (out, in / 32): weight = d q."""
        _check_groups(q, d)
        return cls(*pack_q8_0(q, d), q.shape[1], q.shape[0], "Q8_0")

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The (out, in) weight this layer stands for."""
        return unpack(self.weight, self.scales, self.out_features).to(dtype or torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.scales, self.out_features)  # (..., in) -> (..., out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.block_type} blocks"


def _check_groups(q: torch.Tensor, *per_block: torch.Tensor) -> None:
    if q.dim() != 2 or q.shape[1] % GROUP or any(t.shape != (q.shape[0], q.shape[1] // GROUP) for t in per_block):
        raise ValueError(f"q {tuple(q.shape)} and scales {[tuple(t.shape) for t in per_block]}: expected q "
                         f"(out, in) with in a multiple of {GROUP} and scales (out, in / {GROUP})")
