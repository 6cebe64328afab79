"""``python -m minillm serve``: minillm's engine behind an OpenAI-compatible HTTP API.

    python -m minillm serve                          # SmolLM2-135M-Instruct on http://127.0.0.1:8000/v1
    python -m minillm serve --model tiny --port 8001  # the random-weight tiny model (tests, load sweeps)

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with server-sent
events or not), ``GET /v1/models``, ``GET /health`` (with the engine's load) and ``GET /minillm/requests``
(the engine's records of the latest finished requests). FastAPI + uvicorn is the stack vLLM's own
OpenAI-compatible server is built on: an asyncio server that holds thousands of open streams cheaply,
with request validation and streaming responses built in. The code is in ``minillm.serving``.

Exit status: 0 after a clean shutdown (Ctrl-C), 2 for a bad argument, 3 when a package is missing.
"""
from __future__ import annotations

import argparse
import sys
import threading

import torch

from ..device import DEVICE_NAMES, DTYPES, resolve_device, resolve_dtype
from ..engine import Engine, EngineConfig
from ..engine.config import DEFAULT_TOKENS_PER_SEQUENCE

MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "tiny"}  # --model -> the name served
NOT_INSTALLED = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m minillm serve",
        description="Serve a minillm model over an OpenAI-compatible HTTP API (continuous batching "
                    "across concurrent requests).")
    parser.add_argument("--model", choices=list(MODELS), default="smollm2",
                        help="smollm2: SmolLM2-135M-Instruct, trained (default); tiny: random weights")
    parser.add_argument("--served-model-name", default=None,
                        help=f"the name clients ask for (default: {MODELS['smollm2']!r}, or 'tiny')")
    parser.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="default 8000")
    parser.add_argument("--device", choices=DEVICE_NAMES, default="auto", help="default: auto (CUDA if present)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="default: float32")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model's random weights (default 0)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="most requests running at once (default 8)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help=f"KV blocks in the pool (default: the engine's, max-batch-size sequences of the "
                             f"context, at most {DEFAULT_TOKENS_PER_SEQUENCE} tokens each)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="a step's token budget (chunked prefill; default: the engine's)")
    parser.add_argument("--enable-prefix-caching", action="store_true", help="share KV blocks of common prefixes")
    parser.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="exit when standard input closes (minillm.serving.launch_server uses it, so that "
                             "a server never outlives the notebook or test that started it)")
    args = parser.parse_args(argv)
    limits = (("--port", args.port, 0, 65535), ("--threads", args.threads, 1, None),
              ("--max-batch-size", args.max_batch_size, 1, None), ("--num-blocks", args.num_blocks, 1, None),
              ("--block-size", args.block_size, 1, None))
    for name, value, low, high in limits:
        if value is not None and (value < low or (high is not None and value > high)):
            parser.error(f"{name} {value} must be >= {low}" + (f" and <= {high}" if high is not None else ""))
    return args


def load(args: argparse.Namespace):
    """(model, tokenizer, description) for ``--model``."""
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    if args.model == "tiny":
        from ..model import build_model
        from ..text.byte import ByteTokenizer

        model = build_model("tiny", device=device, dtype=dtype, seed=args.seed)
        return model, ByteTokenizer(), f"the tiny model with RANDOM weights (seed {args.seed})"
    from ..checkpoints.pretrained import load_pretrained

    model, tokenizer = load_pretrained("smollm2-135m-instruct", device=device, dtype=dtype)
    return model, tokenizer, "SmolLM2-135M-Instruct"


def engine_config(args: argparse.Namespace, eos_token_id: int | None) -> EngineConfig:
    """The engine the arguments ask for; what they leave out (the pool size, the token budget) is the
    engine's default. Raises TypeError or ValueError for a bad combination."""
    return EngineConfig(max_batch_size=args.max_batch_size, num_blocks=args.num_blocks, block_size=args.block_size,
                        eos_token_id=eos_token_id, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=args.enable_prefix_caching)


def watch_stdin(server) -> None:
    """Ask uvicorn to shut down once standard input reaches its end (the parent closed it, or died)."""
    def wait():
        sys.stdin.buffer.read()
        server.should_exit = True

    threading.Thread(target=wait, name="stdin-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvicorn

        from .app import create_app
    except ImportError as error:
        print(f"python -m minillm serve: error: {error}; install the server's packages with: "
              "pip install 'minillm[serve]'", file=sys.stderr)
        return NOT_INSTALLED
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer, description = load(args)
    except (FileNotFoundError, ImportError) as error:
        print(f"python -m minillm serve: error: {error}", file=sys.stderr)
        return NOT_INSTALLED
    config = model.config
    try:
        engine = Engine.from_config(model, engine_config(args, tokenizer.eos_token_id))
    except (TypeError, ValueError) as error:
        print(f"python -m minillm serve: error: {error}", file=sys.stderr)
        return 2
    num_blocks = engine.blocks.num_blocks
    name = args.served_model_name or MODELS[args.model]
    print(f"minillm serve: {description} as {name!r} on {model.device.type}, {args.dtype}, "
          f"{torch.get_num_threads()} thread(s)\n  KV pool: {num_blocks} blocks x {args.block_size} tokens "
          f"({engine.pool.nbytes / 1e6:.0f} MB); at most {args.max_batch_size} requests running; "
          f"context {config.max_seq_len} tokens\n  OpenAI API at http://{args.host}:{args.port}/v1", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print("  note: the server has no authentication; anyone who can reach this address can use it", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(tokenizer, engine, name), host=args.host, port=args.port,
                                           access_log=not args.no_access_log, timeout_graceful_shutdown=5))
    if args.exit_with_parent:
        watch_stdin(server)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
