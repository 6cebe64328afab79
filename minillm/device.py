"""Device and dtype names, resolved with clear errors, and the device and dtype a chapter runs in."""
from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEVICE_NAMES = ("auto", "cpu", "cuda")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU; asking for absent CUDA is a ValueError."""
    if isinstance(device, torch.device):
        name = device.type
    elif isinstance(device, str):
        name = device.split(":")[0]
    else:
        raise TypeError(f"device={device!r} must be a str or torch.device")
    if name not in DEVICE_NAMES:
        raise ValueError(f"unknown device {device!r}; choose one of {DEVICE_NAMES}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for, but torch sees no CUDA device "
                         "(torch.cuda.is_available() is False); use device='cpu' or 'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype = "float32") -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or the torch dtype itself)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose one of {list(DTYPES)}")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype={dtype!r} must be a str or torch.dtype")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {list(DTYPES)}")
    return DTYPES[dtype]


def native_bfloat16(device: torch.device) -> bool:
    """True when the CUDA ``device`` computes bfloat16 in hardware: compute capability 8.0 (Ampere) or newer.

    ``torch.cuda.is_bf16_supported()`` alone also says True on older GPUs such as a T4 (7.5), which only
    emulate bfloat16, slowly and without tensor cores.
    """
    return torch.cuda.get_device_capability(device) >= (8, 0)


def pick_device(verbose: bool = True) -> tuple[torch.device, torch.dtype]:
    """CUDA when there is a GPU, in bfloat16 where it computes bfloat16 natively (``native_bfloat16``), else
    in float16; otherwise the CPU in float32. ``verbose`` prints one line naming the device and dtype."""
    device = resolve_device("auto")
    if device.type == "cuda":
        dtype = torch.bfloat16 if native_bfloat16(device) else torch.float16
        name = torch.cuda.get_device_name(device)
    else:
        dtype, name = torch.float32, f"CPU, {torch.get_num_threads()} threads"
    if verbose:
        print(f"device: {device.type} ({name}), dtype: {str(dtype).removeprefix('torch.')}")
    return device, dtype
