"""A clock that waits for the device before it reads the time."""
from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Block until queued CUDA work is done (a no-op on CPU)."""
    device = torch.device(device) if device is not None else None
    if (device is None or device.type == "cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def now(device: torch.device | str | None = None) -> float:
    """Seconds from ``time.perf_counter`` after synchronizing ``device``."""
    synchronize(device)
    return time.perf_counter()
