"""The precisions a checkpoint loads in: ``PRECISIONS`` and ``load_precision``.

float32, bfloat16 and int8 are variants of the float32 model (``minillm.fast.quant``); "int4" is the GGUF file's
own 4-bit weights (``minillm.fast.int4``), not a quantization of float32.
"""
from __future__ import annotations

from ..checkpoints.pretrained import load_pretrained
from .int4 import load_int4
from .quant import VARIANTS, make_variant

PRECISIONS: dict[str, str] = {  # what ``load_precision`` (and ``python -m minillm --precision``) offers
    "float32": VARIANTS["float32"],
    "bfloat16": "bfloat16 weights and activations, one token's matmuls as matrix-vector products",
    "int8": VARIANTS["int8"],
    "int4": "the GGUF file's own Q4_1 weights (4 bits, a scale and a minimum per 32) and Q8_0 head, through "
            "the block kernel (int8 activations, float32 around it) where the CPU has AVX2, else PyTorch's int4 "
            "kernel (bfloat16 activations, the head as two 4-bit planes)",
}


def load_precision(name_or_path="smollm2-135m-instruct", precision: str = "float32", device="cpu",
                   **load_kwargs):
    """(model, tokenizer) of a checkpoint (as ``load_pretrained`` takes it) in one of ``PRECISIONS``.

    "float32": as loaded; "bfloat16" and "int8": ``make_variant`` of it; "int4": the GGUF file's own 4-bit
    weights, loaded as they are (``minillm.fast.int4.load_int4``: a GGUF file or a packaged name only).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
    if precision == "int4":
        return load_int4(name_or_path, device)
    model, tokenizer = load_pretrained(name_or_path, device=device, **load_kwargs)
    return (model if precision == "float32" else make_variant(model, precision)), tokenizer
