"""Small helpers the book's notebooks share (they work on Colab too)."""
from __future__ import annotations

import torch

from .device import resolve_device


def glue(name: str, value, display: bool = False):
    """``myst_nb.glue`` when it is installed (the book build); elsewhere (Colab) just the value.

    The prose of a chapter cites glued values with ``{glue:text}`name``` so that every number in it
    comes from a cell.
    """
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        return value
    myst_glue(name, value, display=display)
    return value


def pick_device(verbose: bool = True) -> tuple[torch.device, torch.dtype]:
    """CUDA (bfloat16 where supported, else float16) when there is a GPU, else CPU float32."""
    device = resolve_device("auto")
    if device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        name = torch.cuda.get_device_name(device)
    else:
        dtype, name = torch.float32, f"CPU, {torch.get_num_threads()} threads"
    if verbose:
        print(f"device: {device.type} ({name}), dtype: {str(dtype).removeprefix('torch.')}")
    return device, dtype
