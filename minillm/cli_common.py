"""What ``python -m minillm`` and ``python -m minillm serve`` share: the model flags (``add_model_args``),
loading the model they name (``load_from_args``), argparse types that check a flag's range as it is parsed,
and the exit statuses: 2 for a bad argument (argparse's own), 3 when the model or a package is not installed."""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from .device import DEVICE_NAMES, DTYPES, resolve_device, resolve_dtype
from .fast.int4 import kernels_used
from .fast.precision import PRECISIONS, load_precision
from .fast.quant import make_variant

BAD_ARGUMENT, NOT_INSTALLED = 2, 3
PRETRAINED = "smollm2-135m-instruct"  # --model smollm2: the packaged SmolLM2-135M-Instruct
MODELS = ("smollm2", "tiny")


def int_range(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [minimum, maximum]; the error names the value and the limit."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum or (maximum is not None and value > maximum):
            limit = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            raise argparse.ArgumentTypeError(f"{value} must be {limit}")
        return value

    return parse


def seconds(zero_ok: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of seconds, > 0 (or >= 0 with ``zero_ok``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"{value} must be a finite number {'>=' if zero_ok else '>'} 0")
        return value

    return parse


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--dtype``, ``--precision``, ``--threads`` (check them with
    ``check_model_args`` once parsed)."""
    parser.add_argument("--model", choices=MODELS, default="smollm2",
                        help="smollm2: SmolLM2-135M-Instruct, trained (default); tiny: random weights")
    parser.add_argument("--device", choices=DEVICE_NAMES, default="auto", help="default: auto (CUDA if present)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32")
    parser.add_argument("--precision", choices=list(PRECISIONS), default=None,
                        help="the weights: float32, bfloat16, int8 (weight-only) or int4 (smollm2 only: the GGUF "
                             "file's own 4-bit weights); instead of --dtype")
    parser.add_argument("--threads", type=int_range(1), default=None, help="CPU threads for torch (default: torch's)")


def check_model_args(args: argparse.Namespace) -> None:
    """ValueError when the model flags contradict each other."""
    if args.precision is not None and args.dtype is not None:
        raise ValueError(f"give --precision or --dtype, not both (--precision {args.precision} sets the dtype)")
    if args.precision == "int4" and args.model == "tiny":
        raise ValueError("--precision int4 is the GGUF file's own 4-bit weights, and the tiny model has no file: use "
                         "--model smollm2, or --precision float32, bfloat16 or int8")


class Loaded(NamedTuple):
    model: torch.nn.Module
    tokenizer: object
    description: str  # what was loaded, for a banner


def load_from_args(args: argparse.Namespace, seed: int = 0, preset: str = "tiny") -> Loaded:
    """The model the flags name, on ``--device`` with ``--threads``: SmolLM2 in ``--dtype`` or ``--precision``,
    or the ``preset`` with random weights from ``seed`` (made into ``--precision``'s variant). ValueError for a
    device that is not there; FileNotFoundError or ImportError when the model is not installed."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype or "float32")
    if args.model == "tiny":
        from .model import build_model
        from .text.byte import ByteTokenizer

        model = build_model(preset, device=device, dtype=dtype, seed=seed)
        if args.precision not in (None, "float32"):
            model = make_variant(model, args.precision)
        return Loaded(model, ByteTokenizer(), f"the {preset!r} preset with RANDOM weights (seed {seed})")
    if args.precision is None:
        from .checkpoints.pretrained import load_pretrained

        model, tokenizer = load_pretrained(PRETRAINED, device=device, dtype=dtype)
    else:
        model, tokenizer = load_precision(PRETRAINED, args.precision, device)
    return Loaded(model, tokenizer, "SmolLM2-135M-Instruct")


def load_or_exit(prog: str, args: argparse.Namespace, seed: int = 0, preset: str = "tiny") -> Loaded:
    """``load_from_args``, or exit with ``prog``'s error: ``BAD_ARGUMENT`` for a device that is not there,
    ``NOT_INSTALLED`` (the message says what to install) when the model is not."""
    try:
        return load_from_args(args, seed, preset)
    except ValueError as error:
        status, message = BAD_ARGUMENT, str(error)
    except (FileNotFoundError, ImportError) as error:
        status, message = NOT_INSTALLED, str(error)
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(status)


def weights_name(args: argparse.Namespace) -> str:
    """The weights the flags ask for: the precision, else the dtype (float32 unless told)."""
    return args.precision or args.dtype or "float32"


def weights_text(args: argparse.Namespace, model: torch.nn.Module) -> str:
    """``dtype: float32``, or ``precision: int8 (...)`` with what it means (int4: the kernels its layers use)."""
    if args.precision is None:
        return f"dtype: {weights_name(args)}"
    if args.precision != "int4":
        return f"precision: {args.precision} ({PRECISIONS[args.precision]})"
    kernels = ", ".join(f"{n} layer{'s' * (n > 1)} {kernel}" for kernel, n in kernels_used(model).items())
    return (f"precision: int4 (the file's own Q4_1 weights, {str(model.dtype).removeprefix('torch.')} activations; "
            f"{kernels})")
